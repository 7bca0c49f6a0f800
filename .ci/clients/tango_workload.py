"""Client workload: AI2 Tango 1.3.2's torch::train step with its FairScaleTrainingEngine (FullyShardedDataParallel).

Written for this repository's `clients` CI stage (.ci/clients/run); see docs/clients.rst. Run it with the python of a
venv that has ai2-tango 1.3.2 (without extras), torch and this repository installed.

``tango.integrations.fairscale`` trains under fairscale: ``FairScaleTrainingEngine`` wraps the model in
``FullyShardedDataParallel`` (its ``FSDPConfig``), ``with_wrapped_modules`` wraps inner modules too, checkpoints are
each rank's ``local_state_dict()`` and ``local_metadata_dict()`` (and its own optimizer state), a restarted step
loads them with ``load_local_state_dict``, and rank 0 writes the final weights with
``FSDP.consolidate_shard_weights`` over the ranks' shard files (in the order ``glob`` finds them). Every training
here is tango's own ``TorchTrainStep`` (``torch::train``), built from tango's registrable configs and run with
``step.result(LocalWorkspace)``: 2 CPU workers that tango spawns itself (gloo), a small regression model (three
Linear layers, registered as a tango ``Model``), Adam, a ``DistributedSampler`` with shuffling, 2 epochs of 8 steps,
a checkpoint every 4 steps. Checks, each against the same step with tango's ``TorchTrainingEngine`` (torch DDP, no
fairscale), same data and seed:
  1. ``FairScaleTrainingEngine`` with ``FSDPConfig()`` defaults (one root instance, ``reshard_after_forward=True``);
  2. ``with_wrapped_modules`` (each Linear its own FSDP instance) inside the root, with ``activation_checkpointing``
     (fairscale's ``checkpoint_wrapper(offload_to_cpu=True)`` inside each inner instance: every Linear's forward
     must run twice a micro-batch, counted), ``reshard_after_forward=False``, and 2 micro-batches a step
     (``grad_accum=2``; tango accumulates without ``no_sync``), against DDP with ``grad_accum=2``;
  3. check 1's step interrupted before step 8 (a callback raises; both workers die) and run again: tango restarts
     it from its last checkpoint (``load_local_state_dict`` and each rank's optimizer shard; the callback records
     that the second run trained from step 8), against the uninterrupted run of check 1.
Compared: the final weights file that tango writes (``weights.pt``: consolidated from the shards by
``save_complete_weights_from_checkpoint`` under FSDP, rank 0's ``state_dict`` under DDP) and the model that the step
returns (tango loads ``weights.pt`` into a fresh model with ``strict=False``, so the file's keys are checked too).
Each FSDP run's last checkpoint is also checked: one shard file per rank, each holding half of the values, the
expected number of FSDP instances in the metadata, and ``consolidate_shard_weights`` of the shards in rank order and
reversed equal to tango's ``weights.pt`` (tango's glob returns ``worker1`` first here: upstream's consolidation
needs rank order). With 2 ranks FSDP divides each gradient by 2 before the sum and DDP after it, both exact in
float32, so checks 1 and 3 must be bit-identical. Check 2 is not: with 2 micro-batches tango accumulates without
``no_sync``, so DDP averages the accumulated gradients ((avg1 + g2 of rank 0) + (avg1 + g2 of rank 1)) / 2, where
FSDP reduces only the new gradient and adds the two averages, avg1 + avg2: another float32 summation order (checked
with plain torch DDP: its gradient equals the first form bit for bit, the second within 2e-9). The final weights
differ by 6e-8, one float32 ulp of weights between 0.5 and 1 (DDP itself with 2 micro-batches vs 1, the same
arithmetic summed in another order, differs by 9e-8: printed as the floor); the check accepts 1e-6, 17 times that
and about 1e-5 of how far training moves the weights (0.14). Each check prints one line, ``tango: ... (ok)`` or
``(MISMATCH)``; the exit code is non-zero on any mismatch.

Two workarounds, marked below (see docs/clients.rst): tango never destroys its process group, and a gloo group left
to interpreter finalization can abort a worker (``terminate called without an active exception``, see the Lightning
workloads), which fails the whole step, so each spawned worker destroys it in an ``atexit`` handler; and tango fails
to start a step from a git checkout without an ``origin`` remote, so the steps run from the workload's own
directory. Not needed: tango's ``torch.load`` calls take torch 2.6's ``weights_only=True`` default and read these
checkpoints (the FSDP metadata is plain containers), and its training loop runs on CPU workers with gloo as it is.
"""

import argparse
import atexit
import gc
import json
import os
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict

import torch
from torch import nn

from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from tango.common import DatasetDict, Lazy, Params
from tango.common.logging import initialize_logging, teardown_logging
from tango.integrations.fairscale import FairScaleTrainingEngine  # noqa: F401  (registers "fairscale")
from tango.integrations.torch import DataLoader, Model, TorchTrainStep, TrainCallback, TrainingEngine
from tango.workspaces import LocalWorkspace

IN, HIDDEN, OUT = 12, 24, 3
SAMPLES, BATCH = 96, 6  # 48 samples a worker, 8 steps an epoch
EPOCHS = 2
INTERRUPT_AT = 8  # check 3 stops before step 8 (0-based), after the checkpoint written at the end of step 7


FORWARDS = [0]  # this process's Linear forward calls (a recomputation under activation checkpointing included)


class CountingLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        FORWARDS[0] += 1
        return super().forward(x)


@Model.register("clients::regressor")
class Regressor(Model):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            CountingLinear(IN, HIDDEN),
            nn.Tanh(),
            CountingLinear(HIDDEN, HIDDEN),
            nn.Tanh(),
            CountingLinear(HIDDEN, OUT),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x), y)}


@TrainCallback.register("clients::record")
class Record(TrainCallback):
    """Records on rank 0, for the parent, the first step that the run trained (a restarted run starts after its
    checkpoint) and the Linear forward calls per layer and micro-batch (2 under activation checkpointing). Stops the
    training before step INTERRUPT_AT when CLIENTS_TANGO_INTERRUPT is set, as a killed job would stop."""

    first_step = -1

    def pre_batch(self, step: int, epoch: int, batch) -> None:
        if self.first_step < 0:
            self.first_step = step
            FORWARDS[0] = 0
        if step == INTERRUPT_AT and os.environ.get("CLIENTS_TANGO_INTERRUPT") == "1":
            raise RuntimeError(f"interrupted before step {step} (on purpose)")

    def post_train_loop(self, step: int, epoch: int) -> None:
        if self.is_local_main_process:
            micro_batches = (step + 1 - self.first_step) * self.train_config.grad_accum
            with open(os.environ["CLIENTS_TANGO_RECORD"], "w") as f:
                json.dump({"first_step": self.first_step, "forwards": FORWARDS[0] / (3 * micro_batches)}, f)


def make_data() -> DatasetDict:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(SAMPLES, OUT, generator=g)
    return DatasetDict(splits={"train": [{"x": x[i], "y": y[i]} for i in range(SAMPLES)]})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def destroy_group_at_exit() -> None:
    # Workaround: tango leaves the gloo process group to interpreter finalization (see the docstring).
    gc.collect()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__mp_main__":
    # This script is imported again, as __mp_main__, in each worker that tango spawns (torch.multiprocessing's
    # "spawn"); multiprocessing.parent_process() is still None while it is imported.
    atexit.register(destroy_group_at_exit)


def make_step(engine: Dict[str, Any], model: Dict[str, Any], grad_accum: int = 1):
    """A torch::train step, built as a tango config would build it (registrable types from Params)."""
    return TorchTrainStep(
        step_name="train",
        model=Lazy(Model, Params(model)),
        training_engine=Lazy(
            TrainingEngine, Params({**engine, "optimizer": {"type": "torch::Adam", "lr": 1e-2, "weight_decay": 1e-3}})
        ),
        dataset_dict=make_data(),
        train_dataloader=Lazy(
            DataLoader,
            Params(
                {
                    "batch_size": BATCH // grad_accum,
                    "sampler": {"type": "torch::DistributedSampler", "shuffle": True, "seed": 0},
                }
            ),
        ),
        train_epochs=EPOCHS,
        grad_accum=grad_accum,
        checkpoint_every=4,
        log_every=4,
        seed=0,
        device_count=2,
        distributed_port=free_port(),
        callbacks=[Lazy(TrainCallback, Params({"type": "clients::record"}))],
    )


def train(name: str, workspace: LocalWorkspace, step: TorchTrainStep) -> Dict[str, Any]:
    start = time.time()
    record = Path(workspace.dir) / "record.json"
    record.unlink(missing_ok=True)
    os.environ["CLIENTS_TANGO_RECORD"] = str(record)  # the workers inherit the environment
    model = step.result(workspace)
    work = workspace.step_dir(step) / "work"
    weights = torch.load(work / "weights.pt", map_location="cpu", weights_only=True)
    print(f"tango:   ({name}: {time.time() - start:.0f} s)", flush=True)
    return {
        "file": weights,
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "work": work,
        **json.loads(record.read_text()),
    }


def check_shards(name: str, run: Dict[str, Any], instances: int) -> bool:
    """The FSDP run's last checkpoint: one shard file per rank, sharded, and consolidated in either order to the
    weights file that tango consolidated from them (in the order its glob gave)."""
    ckpt = (run["work"] / "checkpoint_state_best").resolve()
    files = list(ckpt.glob("worker*_model.pt"))  # as FairScaleTrainingEngine.save_complete_weights_from_checkpoint
    glob_order = [p.name.split("_")[0] for p in files]
    shards = [torch.load(ckpt / f"worker{r}_model.pt", map_location="cpu", weights_only=True) for r in (0, 1)]
    found = {len(s["metadata"]["param_metadata"]) for s in shards}
    numels = [sum(t.numel() for t in s["weights"].values()) for s in shards]
    total = sum(t.numel() for t in run["file"].values())
    sharded = all(total / 2 <= n < total for n in numels)
    diffs = []
    for order in ((0, 1), (1, 0)):
        full = FSDP.consolidate_shard_weights(
            [shards[r]["weights"] for r in order], [shards[r]["metadata"] for r in order]
        )
        same_keys = sorted(full) == sorted(run["file"])
        diffs.append(max((full[k] - run["file"][k]).abs().max().item() for k in full) if same_keys else float("inf"))
    good = sorted(glob_order) == ["worker0", "worker1"] and found == {instances} and sharded and diffs == [0.0, 0.0]
    print(
        f"tango: {name}: checkpoint {ckpt.name}: shard files in glob order {', '.join(glob_order)}, "
        f"{'/'.join(str(n) for n in sorted(found))} FSDP instances (expected {instances}), "
        f"{' + '.join(str(n) for n in numels)} of {total} values; consolidate_shard_weights in rank order and "
        f"reversed vs weights.pt max|dw| = {max(diffs):.3g} ({'ok' if good else 'MISMATCH'})",
        flush=True,
    )
    return good


def maxdiff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b) if sorted(a) == sorted(b) else float("inf")


def compare(
    name: str,
    got: Dict[str, Any],
    ref: Dict[str, Any],
    init: Dict[str, torch.Tensor],
    tol: float,
    note: str = "",
    also: bool = True,
) -> bool:
    ok = also
    moved = maxdiff(ref["model"], init)
    parts = []
    for what in ("file", "model"):  # tango's weights.pt, the model the step returned
        same_keys = sorted(got[what]) == sorted(ref[what]) == sorted(init)
        diff = maxdiff(got[what], ref[what]) if same_keys else float("inf")
        ok &= same_keys and diff <= tol and moved > 1e-3
        parts.append(f"{what} max|dw| = {diff:.3g}{'' if same_keys else ' (keys differ)'}")
    print(
        f"tango: {name}: {', '.join(parts)} (tol {tol:g}{note}; weights moved {moved:.3g}) "
        f"({'ok' if ok else 'MISMATCH'})",
        flush=True,
    )
    return ok


def run_checks(workdir: str) -> bool:
    # Workaround: tango records the git commit and remote of the current directory in each step's info and fails in a
    # checkout that has no "origin" remote (ValueError: Remote named 'origin' didn't exist), as the stage's working
    # copies may be; the steps run from the workload's own directory, outside any checkout.
    os.chdir(workdir)
    workspace = LocalWorkspace(os.path.join(workdir, "workspace"))
    # As the `tango` command does: the workers send their log records to the main process over a socket.
    initialize_logging(log_level="warning")
    torch.manual_seed(0)
    init = Regressor().state_dict()  # what tango's seed gives each worker (set_seed_all(0) before building the model)
    regressor = {"type": "clients::regressor"}
    wrapped = {
        "type": "fairscale::with_wrapped_modules",
        "model": regressor,
        "modules_to_wrap": [r"net\.[024]"],
        "fsdp_config": {"reshard_after_forward": False},
        "activation_checkpointing": True,  # fairscale's checkpoint_wrapper(offload_to_cpu=True) inside each FSDP
    }
    ok = True
    ddp = train("torch (DDP)", workspace, make_step({"type": "torch"}, regressor))
    fsdp = train("fairscale, FSDPConfig()", workspace, make_step({"type": "fairscale"}, regressor))
    ok &= compare("FairScaleTrainingEngine FSDPConfig() vs TorchTrainingEngine (DDP)", fsdp, ddp, init, 0.0)
    ok &= check_shards("FSDPConfig()", fsdp, 1)

    ddp2 = train("torch (DDP), grad_accum=2", workspace, make_step({"type": "torch"}, regressor, grad_accum=2))
    fsdp2 = train(
        "fairscale, with_wrapped_modules, grad_accum=2",
        workspace,
        make_step({"type": "fairscale", "fsdp_config": {"reshard_after_forward": False}}, wrapped, grad_accum=2),
    )
    ok &= compare(
        "FairScaleTrainingEngine with_wrapped_modules (activation_checkpointing), reshard_after_forward=False, "
        "grad_accum=2 vs DDP",
        fsdp2,
        ddp2,
        init,
        1e-6,
        f"; reordering floor: DDP grad_accum=2 vs 1 max|dw| = {maxdiff(ddp2['file'], ddp['file']):.3g}; "
        f"forwards per Linear and micro-batch {fsdp2['forwards']:g}, DDP's {ddp2['forwards']:g}",
        fsdp2["forwards"] == 2 and ddp2["forwards"] == 1,  # checkpoint_wrapper recomputes each forward once
    )
    ok &= check_shards("with_wrapped_modules", fsdp2, 4)  # the root and one per Linear

    # Check 1's step again, in a workspace of its own (the first one has it cached): interrupted, then run again.
    restart = LocalWorkspace(os.path.join(workdir, "workspace-restart"))
    os.environ["CLIENTS_TANGO_INTERRUPT"] = "1"
    try:
        train("fairscale, interrupted", restart, make_step({"type": "fairscale"}, regressor))
        interrupted = False
    except Exception as e:  # mp.spawn's ProcessRaisedException, with the worker's traceback
        interrupted = "interrupted before step" in str(e)
    del os.environ["CLIENTS_TANGO_INTERRUPT"]
    resumed = train("fairscale, run again", restart, make_step({"type": "fairscale"}, regressor))
    ok &= compare(
        "FairScaleTrainingEngine restarted from its checkpoint vs uninterrupted",
        resumed,
        fsdp,
        init,
        0.0,
        f"; interrupted {'before step ' + str(INTERRUPT_AT) if interrupted else 'NOT as planned'}, "
        f"the second run trained from step {resumed['first_step']}",
        interrupted and resumed["first_step"] == INTERRUPT_AT and fsdp["first_step"] == 0,
    )
    ok &= check_shards("restarted", resumed, 1)
    teardown_logging()
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", default=None, help="keep tango's workspace in this new (or empty) directory")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    cwd = os.getcwd()
    if args.keep:
        # A used workspace would answer from tango's step cache instead of training.
        if os.path.isdir(args.keep) and os.listdir(args.keep):
            parser.error(f"--keep {args.keep}: not empty")
        os.makedirs(args.keep, exist_ok=True)
        return 0 if run_checks(os.path.abspath(args.keep)) else 1
    with tempfile.TemporaryDirectory(prefix="clients-tango-") as workdir:
        try:
            return 0 if run_checks(workdir) else 1
        finally:
            os.chdir(cwd)


if __name__ == "__main__":
    sys.exit(main())
