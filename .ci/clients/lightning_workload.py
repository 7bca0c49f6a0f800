"""Client workload: PyTorch Lightning 1.9.5 with strategy="ddp_sharded_spawn" (fairscale OSS + ShardedDataParallel).

Written for this repository's `clients` CI stage (.ci/clients/run); see docs/clients.rst. Run it with the python of
a venv that has pytorch-lightning 1.9.5 and this repository installed.

Every training runs in 2 CPU processes (gloo) spawned by Lightning, on a small MLP regression with Adam (whose
per-parameter state OSS shards), a shuffling sampler and 8 steps an epoch. Checks:
  1. strategy="ddp_sharded_spawn" vs strategy="ddp_spawn" (torch DDP, no fairscale): final weights, max |dw|;
  2. checkpoint save and resume with ddp_sharded_spawn: a run stopped after half the epochs writes a checkpoint
     (Lightning consolidates the OSS state on rank 0 through OSS.consolidate_state_dict), a new run resumes from it
     with `fit(ckpt_path=...)`; its final weights vs the uninterrupted run's;
  3. the same two with a per-step LR scheduler (LambdaLR): Lightning builds the scheduler on the Adam it got from
     configure_optimizers, then replaces that Adam by an OSS built from its param groups, so the scheduler only
     drives the rate through the shared param-group dicts; a resume used to lose them (fixed in commit 1fd5642,
     "OSS.load_state_dict keeps the param-group dicts others hold"). --no-scheduler leaves these out.
Both strategies add the same two float32 gradients per step and apply the same Adam update, and a resume restores
every state exactly, so the tolerance is 0 (--tol). Each check prints one line, `lightning: ... (ok)` or
`(MISMATCH)`; the exit code is non-zero on any mismatch.

Two workarounds live in SmallRegressor.setup (see there): Lightning 1.9's spawn launcher shares the module's CPU
tensors between the processes, and leaves the gloo process group to interpreter finalization.
"""

import argparse
import atexit
import gc
import os
import sys
import tempfile
import time
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import pytorch_lightning as pl

IN, HIDDEN, OUT = 12, 24, 3
SAMPLES, BATCH = 96, 6  # 48 samples a rank, 8 steps an epoch


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(SAMPLES, OUT, generator=g)
    return TensorDataset(x, y)


def _destroy_process_group() -> None:
    # Collect the run's garbage first: the strategy's objects (ShardedDataParallel, OSS, the trainer) sit in reference
    # cycles, and when the cycles were left to interpreter finalization a worker still aborted now and then after
    # destroy_process_group (4 of 20 runs of a bare OSS + ShardedDataParallel script; 0 of 20 with this collect).
    gc.collect()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class SmallRegressor(pl.LightningModule):
    def __init__(self, scheduler: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights in every process and run
        self.net = nn.Sequential(
            nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)
        )
        self.use_scheduler = scheduler

    def setup(self, stage: str) -> None:
        # CPU workaround (a Lightning 1.9 bug, not fairscale's): the spawn launcher hands this module to the workers
        # through torch.multiprocessing, which moves CPU tensors into shared memory, so without this every rank
        # would update one and the same parameter storage (racy double updates, and the main process's copy too).
        # This hook runs in each worker before the strategy wraps the model and builds the optimizers.
        for tensor in list(self.parameters()) + list(self.buffers()):
            tensor.data = tensor.data.clone()
        # Second workaround (torch, not fairscale): Lightning 1.9 leaves the gloo process group to be destroyed at
        # interpreter finalization, where gloo's worker threads now and then abort the process ("terminate called
        # without an active exception", SIGABRT; about 1 worker in 30 here). Destroy it while Python is alive.
        atexit.register(_destroy_process_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2, weight_decay=1e-3)
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.1 * step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        # A shuffling DistributedSampler of our own (Trainer(replace_sampler_ddp=False)) whose order is a function of
        # the epoch alone, so a resume that restored the wrong epoch sees other batches. Lightning's own choice for
        # shuffle=True wraps a RandomSampler drawing from the global RNG, which Lightning 1.9 does not restore on
        # resume: the resumed run would see other batches even with every state restored right.
        data = make_data()
        sampler = DistributedSampler(
            data, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=True, seed=0
        )
        return DataLoader(data, batch_size=BATCH, sampler=sampler)


class SaveAtEnd(pl.Callback):
    """Writes a full checkpoint (model, consolidated OSS state, scheduler, loops) at the end of training."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)  # collective: every rank sends its OSS shard, rank 0 writes


def fit(
    strategy: str, epochs: int, workdir: str, scheduler: bool, resume_from: str = None, save_to: str = None
) -> dict:
    """Trains in 2 spawned CPU processes; returns the final weights (Lightning sends rank 0's back here)."""
    start = time.time()
    pl.seed_everything(0, workers=True)
    model = SmallRegressor(scheduler=scheduler)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        replace_sampler_ddp=False,
        default_root_dir=workdir,
        callbacks=[SaveAtEnd(save_to)] if save_to else [],
    )
    trainer.fit(model, ckpt_path=resume_from)
    what = (
        f"{strategy}, {epochs} epochs" + (", LR scheduler" if scheduler else "") + (", resumed" if resume_from else "")
    )
    print(f"lightning:   ({what}: {time.time() - start:.0f} s)", flush=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def run_checks(workdir: str, epochs: int, tol: float, scheduler: bool) -> bool:
    tag = " with LR scheduler" if scheduler else ""
    sub = os.path.join(workdir, "sched" if scheduler else "plain")

    sharded = fit("ddp_sharded_spawn", epochs, os.path.join(sub, "sharded"), scheduler)
    plain = fit("ddp_spawn", epochs, os.path.join(sub, "ddp"), scheduler)
    moved = max_abs_diff(plain, SmallRegressor().state_dict())
    diff = max_abs_diff(sharded, plain)
    ok1 = diff <= tol and moved > 1e-3
    print(
        f"lightning: ddp_sharded_spawn vs ddp_spawn{tag} max|dw| = {diff:.3g} after {epochs} epochs "
        f"(weights moved {moved:.3g} from init) ({'ok' if ok1 else 'MISMATCH'})",
        flush=True,
    )

    half, ckpt = epochs // 2, os.path.join(sub, "half.ckpt")
    stopped = fit("ddp_sharded_spawn", half, os.path.join(sub, "half"), scheduler, save_to=ckpt)
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    n_state = len(saved["optimizer_states"][0]["state"])  # the consolidated Adam state: one entry a parameter
    resumed = fit("ddp_sharded_spawn", epochs, os.path.join(sub, "resumed"), scheduler, resume_from=ckpt)
    diff = max_abs_diff(resumed, sharded)
    moved = max_abs_diff(stopped, sharded)
    ok2 = diff <= tol and moved > 1e-3 and n_state == len(sharded)
    print(
        f"lightning: ddp_sharded_spawn{tag} resumed after {half}/{epochs} epochs vs uninterrupted "
        f"max|dw| = {diff:.3g} (checkpoint holds Adam state for {n_state}/{len(sharded)} tensors; weights moved "
        f"{moved:.3g} in the second half) ({'ok' if ok2 else 'MISMATCH'})",
        flush=True,
    )
    return ok1 and ok2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--tol", type=float, default=0.0, help="largest max|dw| accepted (default 0: bit-exact)")
    parser.add_argument("--no-scheduler", action="store_true", help="leave out the checks with an LR scheduler")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # Lightning's deprecation notices for the fairscale strategies, and others

    with tempfile.TemporaryDirectory(prefix="clients-lightning-") as workdir:
        ok = run_checks(workdir, args.epochs, args.tol, scheduler=False)
        if not args.no_scheduler:
            ok &= run_checks(workdir, args.epochs, args.tol, scheduler=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
