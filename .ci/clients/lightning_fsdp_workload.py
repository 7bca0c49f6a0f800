"""Client workload: PyTorch Lightning 1.9.5 with strategy="fsdp" (fairscale FullyShardedDataParallel).

Written for this repository's `clients` CI stage (.ci/clients/run, after lightning_workload.py); see
docs/clients.rst. Run it with the python of a venv that has pytorch-lightning 1.9.5 and this repository installed.

Lightning 1.x's ``strategy="fsdp"`` (``DDPFullyShardedStrategy``) is built on fairscale: ``FullyShardedDataParallel``
around the module (or inside ``configure_sharded_model`` with ``enable_wrap``/``wrap``/``auto_wrap`` and
``default_auto_wrap_policy``), its ``state_dict()`` for checkpoints, ``FlatParameter`` to check the optimizer. Each
training runs in 2 CPU processes (gloo) that Lightning starts itself (its subprocess launcher runs this script again
for rank 1), a small MLP with Adam, 2 epochs of 8 steps; rank 0 writes the final checkpoint. Checks, each against
``strategy="ddp"`` (torch DDP, no fairscale) with the same data:
  1. FSDP around the whole module (Lightning wraps it);
  2. ``auto_wrap()`` in ``configure_sharded_model``, with a ``min_num_params`` small enough to wrap every layer;
  3. ``wrap()`` of each layer in ``configure_sharded_model`` (no root instance), with ``cpu_offload=True``
     (``move_params_to_cpu``: on CPU a move to the same device, but another code path).
With 2 ranks FSDP divides each gradient by 2 before the sum and DDP after it, which is exact in float32, so the final
weights (the checkpoint's plain ``state_dict`` keys included) must be bit-identical. Each check prints one line,
``lightning: ... (ok)`` or ``(MISMATCH)``; the exit code is non-zero on any mismatch.

One workaround (CPU only, see docs/clients.rst): Lightning 1.9's FSDP strategy refuses to start without a GPU in
``setup_distributed``; the workload gives it the ``ddp`` strategy's ``setup_distributed`` (nothing else is patched).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPFullyShardedStrategy, DDPStrategy

from fairscale.nn import auto_wrap, wrap

IN, HIDDEN, OUT = 12, 24, 3
SAMPLES, BATCH = 96, 6  # 48 samples a rank, 8 steps an epoch
EPOCHS = 2

# The CPU workaround: Lightning 1.9's check that refuses the strategy without a GPU.
DDPFullyShardedStrategy.setup_distributed = DDPStrategy.setup_distributed  # type: ignore[method-assign]


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.1 * torch.randn(SAMPLES, OUT, generator=g))


def make_net() -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights in every process and run
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        # The wrapped model's parameters: under FSDP these are the flat shards (Lightning checks it).
        return torch.optim.Adam(self.trainer.model.parameters(), lr=1e-2, weight_decay=1e-3)

    def train_dataloader(self):
        data = make_data()
        sampler = DistributedSampler(
            data, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=True, seed=0
        )
        return DataLoader(data, batch_size=BATCH, sampler=sampler)


class AutoWrapRegressor(Regressor):
    # Overriding this hook tells Lightning that the module wraps itself: the strategy then adds no root wrapper.
    def configure_sharded_model(self) -> None:
        # Runs inside the strategy's enable_wrap context (only with a FSDP strategy: DDP never calls it).
        self.net = auto_wrap(self.net)  # each Linear (min_num_params below) and the Sequential


class WrapRegressor(Regressor):
    def configure_sharded_model(self) -> None:
        for i in (0, 2, 4):  # each Linear an instance of its own, with the strategy's arguments; no root instance
            self.net[i] = wrap(self.net[i])


class SaveAtEnd(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)  # collective under FSDP (full state dict); rank 0 writes


def child(config: str, path: str) -> None:
    """One training (both ranks run this: Lightning starts rank 1 as a new process with the same arguments)."""
    pl.seed_everything(0, workers=True)
    if config == "ddp":
        strategy = "ddp"
    else:
        # min_num_params 1: auto_wrap wraps every Linear left unwrapped (the default policy's 1e8 would wrap none).
        strategy = DDPFullyShardedStrategy(cpu_offload=config == "wrap_offload", min_num_params=1)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        replace_sampler_ddp=False,
        callbacks=[SaveAtEnd(path)],
    )
    model = {"auto_wrap": AutoWrapRegressor, "wrap_offload": WrapRegressor}.get(config, Regressor)()
    trainer.fit(model)
    if trainer.global_rank == 0 and config != "ddp":
        wrappers = sum(type(m).__name__ == "FullyShardedDataParallel" for m in trainer.model.modules())
        print(f"lightning-fsdp-child: {config}: {wrappers} FullyShardedDataParallel instances", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def train(config: str, workdir: str) -> dict:
    start = time.time()
    path = os.path.join(workdir, f"{config}.ckpt")
    # A clean environment for Lightning's launcher: it starts rank 1 itself (MASTER_PORT etc. from scratch).
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", config, "--path", path],
        env=env,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout
    for line in out.splitlines():
        if line.startswith("lightning-fsdp-child: "):
            print("lightning:   (" + line.split(": ", 1)[1] + ")", flush=True)
    print(f"lightning:   (strategy {config}, {EPOCHS} epochs: {time.time() - start:.0f} s)", flush=True)
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--path", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # Lightning's deprecation notices for the fairscale strategies, and others
    if args.child is not None:
        child(args.child, args.path)
        return 0
    ok = True
    with tempfile.TemporaryDirectory(prefix="clients-lightning-fsdp-") as workdir:
        ddp = train("ddp", workdir)
        init = {f"net.{k}": v for k, v in make_net().state_dict().items()}
        moved = max((ddp[k] - init[k]).abs().max().item() for k in init)
        for config in ("root", "auto_wrap", "wrap_offload"):
            got = train(config, workdir)
            same_keys = sorted(got) == sorted(ddp)
            diff = max((got[k] - ddp[k]).abs().max().item() for k in ddp) if same_keys else float("inf")
            good = same_keys and diff == 0.0 and moved > 1e-3
            ok &= good
            print(
                f"lightning: strategy=fsdp ({config}) vs ddp max|dw| = {diff:.3g} after {EPOCHS} epochs, checkpoint "
                f"keys {'as' if same_keys else 'NOT as'} ddp's {sorted(ddp)[:2]}... (weights moved {moved:.3g}) "
                f"({'ok' if good else 'MISMATCH'})",
                flush=True,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
