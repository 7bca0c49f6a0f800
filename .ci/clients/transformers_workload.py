"""Client workload: Hugging Face transformers 4.29.2's Trainer with ``--sharded_ddp`` (fairscale OSS, ShardedDDP, FSDP).

Written for this repository's `clients` CI stage (.ci/clients/run); see docs/clients.rst. Run it with the python of
a venv that has transformers 4.29.2, accelerate and this repository installed. 4.29 is the last release whose
``zero_dp_2``/``zero_dp_3`` work: 4.30-4.34 wrap the FullyShardedDataParallel model in torch DDP as well (through
accelerate), which overwrote rank 1's shards with rank 0's and learnt nothing (with upstream too); this repository's
FSDP refuses that with a TypeError. ``--sharded_ddp`` was removed in 4.35.

transformers' Trainer imports fairscale itself (``ShardedDataParallel``, ``FullyShardedDataParallel``,
``auto_wrap``, ``OSS``) and drives it through its own training loop: gradient accumulation under the wrapper's
``no_sync()``, ``OSS.clip_grad_norm`` / ``FullyShardedDataParallel.clip_grad_norm_``, ``OSS.consolidate_state_dict``
for checkpoints, ``state_dict()`` of the FSDP-wrapped model for ``save_model`` (keys must be the plain model's:
``from_pretrained`` reads them back). Every training runs a small GPT-2 (built from a config, no download) on
synthetic tokens in 2 CPU processes (gloo) started by ``torchrun``, 8 optimizer steps of 2 accumulated micro-batches
with AdamW, a linear LR schedule and gradient clipping. Checks, each against the same training under plain torch
DDP (``sharded_ddp`` empty):
  1. ``sharded_ddp="simple"`` (OSS + ShardedDataParallel), ``"zero_dp_2"`` (FullyShardedDataParallel,
     reshard_after_forward=False), ``"zero_dp_3 auto_wrap"`` with ``gradient_checkpointing=True``
     (reshard_after_forward=True; the Trainer's ``auto_wrap`` call outside an ``enable_wrap`` context returns the model unchanged, as upstream's;
     GPT-2's blocks recompute their forward in the backward, torch's reentrant checkpoint), ``"zero_dp_3 offload"``
     (cpu_offload=True): the final model saved by ``save_model`` (its file's keys as DDP's) and loaded with
     ``GPT2LMHeadModel.from_pretrained``, max |dw|, the logged losses and ``Trainer.evaluate``'s loss on other
     samples after training;
  2. resume with ``"simple"``: a run that saves a checkpoint after half the steps (the consolidated OSS state), a new
     run with ``resume_from_checkpoint``; its final weights vs the uninterrupted run's (bit-exact).
Sharded and DDP runs add the two ranks' gradients in another order and clip with norms summed in another order, so
check 1 allows --tol (default 1e-4, the weights move ~1e-2). Each check prints one line, ``transformers: ... (ok)``
or ``(MISMATCH)``; the exit code is non-zero on any mismatch.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings

import torch

VOCAB, POSITIONS, EMBED, LAYERS, HEADS = 96, 32, 32, 2, 2
SAMPLES, SEQ = 64, 24  # 32 samples a rank: 8 steps of 2 micro-batches of 2
STEPS, MICRO_BATCH, ACCUMULATE = 8, 2, 2
CHECKPOINTING = " gradient_checkpointing"


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=POSITIONS,
        n_embd=EMBED,
        n_layer=LAYERS,
        n_head=HEADS,
        # No dropout: a sharded and a DDP run must compute the same function.
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)  # the same initial weights in every process and run
    return GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    """Synthetic language-model samples: a repeating pattern with noise, so the loss can go down."""

    def __init__(self, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (SAMPLES, 1), generator=g)
        step = torch.randint(1, 5, (SAMPLES, 1), generator=g)
        ids = (start + step * torch.arange(SEQ)) % VOCAB
        noise = torch.rand(SAMPLES, SEQ, generator=g) < 0.1
        self.ids = torch.where(noise, torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g), ids)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def worker(sharded_ddp: str, out: str, save_steps: int, resume: str) -> None:
    """One rank of one training (started by torchrun): trains, saves the final model (rank 0 writes)."""
    from transformers import Trainer, TrainingArguments

    # A mode may end in " gradient_checkpointing": the Trainer's flag of that name, not a --sharded_ddp option.
    checkpointing = sharded_ddp.endswith(CHECKPOINTING)
    sharded_ddp = sharded_ddp[: -len(CHECKPOINTING)] if checkpointing else sharded_ddp
    args = TrainingArguments(
        output_dir=out,
        no_cuda=True,
        ddp_backend="gloo",
        sharded_ddp=sharded_ddp,
        gradient_checkpointing=checkpointing,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        learning_rate=3e-3,
        max_grad_norm=0.5,  # small enough that clipping is active on some steps
        optim="adamw_torch",
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=resume or None)
    # Evaluation on other samples: a no_grad forward of the trained wrapper (FSDP: the model itself), each rank its
    # half of the batches, the losses gathered over the ranks.
    eval_loss = trainer.evaluate(eval_dataset=Tokens(seed=99))["eval_loss"]
    trainer.save_model(os.path.join(out, "final"))  # collective with FSDP (full state dict); rank 0 writes
    if trainer.is_world_process_zero():
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump({"losses": losses, "eval_loss": eval_loss}, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(sharded_ddp: str, out: str, save_steps: int = 0, resume: str = "") -> tuple:
    """One 2-process training under torchrun: (final state dict, logged losses + [eval loss], keys of the file)."""
    start = time.time()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_port()), os.path.abspath(__file__), "--worker", sharded_ddp, "--out", out]
    cmd += ["--save-steps", str(save_steps), "--resume", resume]
    env = dict(os.environ)
    if resume:
        # transformers 4.29 reads its own RNG-state file (numpy arrays inside) with torch.load's default, which is
        # weights_only=True since torch 2.6; the OSS checkpoint itself is read with weights_only=True in run_checks.
        env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    subprocess.run(cmd, check=True, env=env)
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(os.path.join(out, "final"))
    saved = torch.load(os.path.join(out, "final", "pytorch_model.bin"), map_location="cpu", weights_only=True)
    with open(os.path.join(out, "losses.json")) as f:
        logged = json.load(f)
    losses = logged["losses"] + [logged["eval_loss"]]
    what = (sharded_ddp or "DDP") + (f", resumed from {os.path.basename(resume)}" if resume else "")
    print(f"transformers:   ({what}: {time.time() - start:.0f} s)", flush=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, sorted(saved)


def max_abs_diff(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        raise SystemExit(f"transformers: state dict keys differ: {sorted(a.keys() ^ b.keys())} (MISMATCH)")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def run_checks(workdir: str, tol: float, modes: list) -> bool:
    ddp, ddp_losses, ddp_keys = train("", os.path.join(workdir, "ddp"))
    moved = max_abs_diff(ddp, tiny_gpt2().state_dict())
    ok = moved > 1e-3 and len(ddp_losses) == STEPS + 1
    print(
        f"transformers: DDP baseline: {len(ddp_losses) - 1} steps, weights moved {moved:.3g} from init, loss "
        f"{ddp_losses[0]:.3f} -> {ddp_losses[-2]:.3f}, eval loss {ddp_losses[-1]:.3f} ({'ok' if ok else 'MISMATCH'})",
        flush=True,
    )
    finals = {}
    for mode in modes:
        finals[mode], losses, keys = train(mode, os.path.join(workdir, mode.replace(" ", "_")))
        diff = max_abs_diff(finals[mode], ddp)
        dloss = max(abs(a - b) for a, b in zip(losses, ddp_losses)) if len(losses) == len(ddp_losses) else float("inf")
        good = diff <= tol and dloss <= 1e-3 and keys == ddp_keys
        ok &= good
        print(
            f"transformers: sharded_ddp={mode!r} vs DDP: max|dw| = {diff:.3g}, max|dloss| = {dloss:.3g} over "
            f"{len(losses) - 1} logged steps and the evaluation, saved keys {'as' if keys == ddp_keys else 'NOT as'} DDP's "
            f"({'ok' if good else 'MISMATCH'})",
            flush=True,
        )

    # Resume (simple): the checkpoint after half the steps holds the OSS state consolidated on rank 0.
    half = STEPS // 2
    sub = os.path.join(workdir, "resume")
    whole = finals["simple"] if "simple" in finals else train("simple", os.path.join(sub, "whole"))[0]
    stopped_dir = os.path.join(sub, "stopped")
    train("simple", stopped_dir, save_steps=half)  # the first half: the same steps as the uninterrupted run
    ckpt = os.path.join(stopped_dir, f"checkpoint-{half}")
    optim_state = torch.load(os.path.join(ckpt, "optimizer.pt"), map_location="cpu", weights_only=True)
    n_state = len(optim_state["state"])
    resumed = train("simple", os.path.join(sub, "resumed"), resume=ckpt)[0]
    diff = max_abs_diff(resumed, whole)
    good = diff == 0.0 and n_state == len(list(tiny_gpt2().parameters()))
    ok &= good
    print(
        f"transformers: sharded_ddp='simple' resumed after {half}/{STEPS} steps vs uninterrupted: max|dw| = "
        f"{diff:.3g} (checkpoint holds AdamW state for {n_state} parameters) ({'ok' if good else 'MISMATCH'})",
        flush=True,
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tol", type=float, default=1e-4, help="largest max|dw| accepted against DDP")
    parser.add_argument(
        "--modes", default="simple,zero_dp_2,zero_dp_3 auto_wrap gradient_checkpointing,zero_dp_3 offload"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--save-steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--resume", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # transformers' deprecation notice for --sharded_ddp, and others
    if args.worker is not None:
        worker(args.worker, args.out, args.save_steps, args.resume)
        return 0
    with tempfile.TemporaryDirectory(prefix="clients-transformers-") as workdir:
        ok = run_checks(workdir, args.tol, [m for m in args.modes.split(",") if m])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
