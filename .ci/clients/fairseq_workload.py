"""Client workload: fairseq 0.12.2 `transformer_lm` with fairscale FSDP (--ddp-backend fully_sharded) and OSS
(--zero-sharding os) on 2 CPU ranks.

Written for this repository's `clients` CI stage (.ci/clients/run); see docs/clients.rst. Run it with the python of
a venv that has fairseq 0.12.2 and this repository installed; every fairseq command goes through fairseq_launch.py
(beside this file), which applies the CPU / Python 3.11 workarounds, and trainings run under that venv's torchrun.

Steps (all in a temporary folder):
  1. generate a small text corpus (a seeded word-level Markov chain, so the model has something to learn) and
     binarize it with fairseq-preprocess;
  2. train a tiny transformer_lm for --updates updates with --ddp-backend legacy_ddp and with fully_sharded
     (FSDP, each decoder layer wrapped in its own FSDP instance, --min-params-to-wrap), gradient clipping off:
     the per-update losses must be equal (bit-exact by default, --loss-tol), the final consolidated weights too
     (--weight-tol); the gradient norms, logged but unused with clipping off, are compared at a float32 tolerance
     (FSDP sums squared norms shard by shard, legacy_ddp over the whole gradient: another summation order);
     The same with --checkpoint-activations --offload-activations (fairseq's activation checkpointing, inside
     each layer's FSDP instance), bit-exact too;
  3. sharded resume, twice: a fully_sharded training stopped after half the updates and resumed from its
     checkpoint_last.pt must log the same losses and gradient norms for the second half, bit for bit, and end on
     the same weights as the uninterrupted run: once with fairseq's default consolidated checkpoint (fairscale's
     gather_full_optim_state_dict / get_shard_from_optim_state_dict), once with --use-sharded-state (each rank
     saves and loads its own shard: local_state_dict / load_local_state_dict);
  4. --zero-sharding os (fairseq's optimizer inside fairscale's OSS) against legacy_ddp, bit-exact; then with
     --memory-efficient-bf16 (bf16 parameters, fp32 Adam moments in the consolidated optimizer state), a resume
     after half the updates against the uninterrupted run, bit-exact;
  5. one process without torchrun (no torch.distributed): fully_sharded, which fairseq builds on
     fairscale.utils.testing.DummyProcessGroup, against the same training without FSDP, as in step 2.

Prints one result line per comparison, `fairseq: ... (ok)` or `(MISMATCH)`; exits non-zero on any mismatch or
failed command.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH = os.path.join(HERE, "fairseq_launch.py")
BIN = os.path.dirname(sys.executable)

MODEL = [
    "--task",
    "language_modeling",
    "--arch",
    "transformer_lm",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "32",
    "--decoder-input-dim",
    "32",
    "--decoder-output-dim",
    "32",
    "--decoder-ffn-embed-dim",
    "64",
    "--decoder-attention-heads",
    "2",
    "--share-decoder-input-output-embed",
    "--tokens-per-sample",
    "32",
    "--batch-size",
    "8",
    "--optimizer",
    "adam",
    "--adam-betas",
    "(0.9, 0.98)",
    "--lr",
    "2e-3",
    "--weight-decay",
    "0.01",
    "--lr-scheduler",
    "inverse_sqrt",
    "--warmup-updates",
    "10",
    "--clip-norm",
    "0",
    "--dropout",
    "0.1",
    "--attention-dropout",
    "0.1",
    "--seed",
    "3",
    "--cpu",
    "--distributed-backend",
    "gloo",
    "--num-workers",
    "0",
    "--log-format",
    "json",
    "--log-interval",
    "1",
    "--no-epoch-checkpoints",
    "--disable-validation",
    "--no-progress-bar",
]


def make_corpus(folder: str) -> None:
    rng = random.Random(0)
    words = ["w%d" % i for i in range(60)]
    successors = {w: rng.sample(words, 4) for w in words}  # each word is followed by one of 4 others

    def sentence() -> str:
        out = [rng.choice(words)]
        for _ in range(rng.randint(4, 16)):
            out.append(rng.choice(successors[out[-1]]))
        return " ".join(out)

    for split, n in (("train", 1500), ("valid", 100)):
        with open(os.path.join(folder, split + ".txt"), "w") as f:
            f.write("\n".join(sentence() for _ in range(n)) + "\n")


def run(cmd: list, log: str, env: dict = None) -> None:
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        with open(log) as f:
            tail = f.read()[-6000:]
        sys.exit(
            f"fairseq: command failed with exit code {proc.returncode}: {' '.join(cmd)}\n{tail}\n"
            f"fairseq: FAILED (log: {log})"
        )


def train(
    workdir: str, name: str, backend: str, updates: int, save_dir: str, extra: list = (), one_process: bool = False
) -> list:
    """One torchrun training of 2 ranks (or one process without torchrun); returns its per-update stats (rank 0)."""
    stats = os.path.join(workdir, name + ".jsonl")
    env = dict(os.environ, CLIENTS_FAIRSEQ_STATS=stats, OMP_NUM_THREADS="1")
    launcher = (
        [sys.executable] if one_process else [os.path.join(BIN, "torchrun"), "--standalone", "--nproc-per-node", "2"]
    )
    cmd = [
        *launcher,
        LAUNCH,
        "train",
        os.path.join(workdir, "data-bin"),
        *MODEL,
        "--ddp-backend",
        backend,
        "--max-update",
        str(updates),
        "--save-dir",
        save_dir,
        *extra,
    ]
    start = time.time()
    run(cmd, os.path.join(workdir, name + ".log"), env)
    print(f"fairseq:   ({name}: {updates} updates, {time.time() - start:.0f} s)", flush=True)
    with open(stats) as f:
        return [json.loads(line) for line in f]


def weights(save_dir: str, suffix: str = "") -> dict:
    """The model state of checkpoint_last{suffix}.pt: consolidated weights, or a rank's flat shards (suffix -shardR)."""
    path = os.path.join(save_dir, f"checkpoint_last{suffix}.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)
    # `_float_tensor` buffers are uninitialized placeholders fairseq keeps only for their device and dtype: never read.
    return {k: v for k, v in state["model"].items() if not k.endswith("_float_tensor")}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def compare_updates(a: list, b: list) -> tuple:
    assert [s["update"] for s in a] == [s["update"] for s in b], ([s["update"] for s in a], [s["update"] for s in b])
    dloss = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
    dnorm = max(abs(x["gnorm"] - y["gnorm"]) / abs(y["gnorm"]) for x, y in zip(a, b))
    return dloss, dnorm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--loss-tol", type=float, default=0.0)
    parser.add_argument("--weight-tol", type=float, default=0.0)
    parser.add_argument(
        "--gnorm-rtol",
        type=float,
        default=1e-5,
        help="relative; float32 sums of ~1e4 squares in another order differ by a few ulp",
    )
    parser.add_argument("--keep", help="work in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    half = args.updates // 2
    ok = True

    with tempfile.TemporaryDirectory(prefix="clients-fairseq-") as tmp:
        workdir = args.keep or tmp
        if args.keep and os.path.exists(args.keep) and os.listdir(args.keep):
            sys.exit(f"fairseq: --keep {args.keep}: not empty (fairseq would resume from its checkpoints)")
        os.makedirs(workdir, exist_ok=True)
        make_corpus(workdir)
        run(
            [
                sys.executable,
                LAUNCH,
                "preprocess",
                "--only-source",
                "--workers",
                "1",
                "--trainpref",
                os.path.join(workdir, "train.txt"),
                "--validpref",
                os.path.join(workdir, "valid.txt"),
                "--destdir",
                os.path.join(workdir, "data-bin"),
            ],
            os.path.join(workdir, "preprocess.log"),
        )

        # Each decoder layer in its own FSDP instance (nested FSDP), the rest in the root one.
        fsdp = ["--min-params-to-wrap", "1000"]
        ddp = train(workdir, "legacy_ddp", "legacy_ddp", args.updates, os.path.join(workdir, "ck-ddp"))
        fs = train(workdir, "fully_sharded", "fully_sharded", args.updates, os.path.join(workdir, "ck-fsdp"), fsdp)
        dloss, dnorm = compare_updates(fs, ddp)
        dw = max_diff(weights(os.path.join(workdir, "ck-fsdp")), weights(os.path.join(workdir, "ck-ddp")))
        first, last = ddp[0]["loss"], ddp[-1]["loss"]
        good = dloss <= args.loss_tol and dw <= args.weight_tol and dnorm <= args.gnorm_rtol and last < first - 0.5
        ok &= good
        print(
            f"fairseq: fully_sharded vs legacy_ddp over {args.updates} updates: max|dloss| = {dloss:.3g}, "
            f"final max|dw| = {dw:.3g}, gnorm max rel diff = {dnorm:.2g} (loss {first:.4f} -> {last:.4f}) "
            f"({'ok' if good else 'MISMATCH'})",
            flush=True,
        )

        # fairseq's own activation checkpointing (its checkpoint_wrapper, which moves the layer's activations to the
        # CPU with --offload-activations) around each decoder layer, inside that layer's FSDP instance: the layers
        # run their forward again in the backward, with the same dropout masks.
        ckpt = ["--checkpoint-activations", "--offload-activations"]
        fs_ckpt = train(
            workdir,
            "fully_sharded-ckpt",
            "fully_sharded",
            args.updates,
            os.path.join(workdir, "ck-fsdp-ckpt"),
            fsdp + ckpt,
        )
        dloss, dnorm = compare_updates(fs_ckpt, ddp)
        dw = max_diff(weights(os.path.join(workdir, "ck-fsdp-ckpt")), weights(os.path.join(workdir, "ck-ddp")))
        good = dloss <= args.loss_tol and dw <= args.weight_tol and dnorm <= args.gnorm_rtol
        ok &= good
        print(
            f"fairseq: fully_sharded --checkpoint-activations --offload-activations vs legacy_ddp over {args.updates} "
            f"updates: max|dloss| = {dloss:.3g}, final max|dw| = {dw:.3g}, gnorm max rel diff = {dnorm:.2g} "
            f"({'ok' if good else 'MISMATCH'})",
            flush=True,
        )

        for label, extra in (("consolidated checkpoint", []), ("--use-sharded-state", ["--use-sharded-state"])):
            tag = "sharded-state" if extra else "consolidated"
            save_dir = os.path.join(workdir, "ck-resume-" + tag)
            reference = fs
            if extra:  # the uninterrupted run of this flavour
                reference = train(
                    workdir,
                    "full-" + tag,
                    "fully_sharded",
                    args.updates,
                    os.path.join(workdir, "ck-full-" + tag),
                    fsdp + extra,
                )
            first_half = train(workdir, "half-" + tag, "fully_sharded", half, save_dir, fsdp + extra)
            second_half = train(workdir, "resumed-" + tag, "fully_sharded", args.updates, save_dir, fsdp + extra)
            dloss, dnorm = compare_updates(first_half + second_half, reference)
            if extra:  # per-rank shard files: compare what each rank saved
                full_dir = os.path.join(workdir, "ck-full-" + tag)
                dw = max(max_diff(weights(save_dir, f"-shard{r}"), weights(full_dir, f"-shard{r}")) for r in range(2))
            else:
                dw = max_diff(weights(save_dir), weights(os.path.join(workdir, "ck-fsdp")))
            good = dloss == 0 and dnorm == 0 and dw == 0 and second_half[0]["update"] == half + 1
            ok &= good
            print(
                f"fairseq: fully_sharded resume ({label}) after {half}/{args.updates} updates vs uninterrupted: "
                f"max|dloss| = {dloss:.3g}, max rel |dgnorm| = {dnorm:.3g}, final max|dw| = {dw:.3g} "
                f"({'ok' if good else 'MISMATCH'})",
                flush=True,
            )

        # --zero-sharding os: fairseq's optimizer wrapped in fairscale's OSS (consolidated optimizer state in its
        # checkpoints). Against legacy_ddp without it; then with --memory-efficient-bf16 (bf16 parameters, fp32 Adam
        # moments that OSS must load back in fp32: fairseq turns its own repair of torch's cast off under OSS), a
        # resume against the uninterrupted run.
        oss = ["--zero-sharding", "os"]
        os_run = train(workdir, "zero-sharding-os", "legacy_ddp", args.updates, os.path.join(workdir, "ck-os"), oss)
        dloss, dnorm = compare_updates(os_run, ddp)
        dw = max_diff(weights(os.path.join(workdir, "ck-os")), weights(os.path.join(workdir, "ck-ddp")))
        good = dloss == 0 and dnorm == 0 and dw == 0
        ok &= good
        print(
            f"fairseq: --zero-sharding os vs legacy_ddp over {args.updates} updates: max|dloss| = {dloss:.3g}, "
            f"max rel |dgnorm| = {dnorm:.3g}, final max|dw| = {dw:.3g} ({'ok' if good else 'MISMATCH'})",
            flush=True,
        )
        bf16 = oss + ["--memory-efficient-bf16"]
        full = train(workdir, "os-bf16", "legacy_ddp", args.updates, os.path.join(workdir, "ck-os-bf16"), bf16)
        save_dir = os.path.join(workdir, "ck-os-bf16-resume")
        first_half = train(workdir, "half-os-bf16", "legacy_ddp", half, save_dir, bf16)
        second_half = train(workdir, "resumed-os-bf16", "legacy_ddp", args.updates, save_dir, bf16)
        dloss, dnorm = compare_updates(first_half + second_half, full)
        dw = max_diff(weights(save_dir), weights(os.path.join(workdir, "ck-os-bf16")))
        good = dloss == 0 and dnorm == 0 and dw == 0 and second_half[0]["update"] == half + 1
        ok &= good
        print(
            f"fairseq: --zero-sharding os --memory-efficient-bf16 resume after {half}/{args.updates} updates vs "
            f"uninterrupted: max|dloss| = {dloss:.3g}, max rel |dgnorm| = {dnorm:.3g}, final max|dw| = {dw:.3g} "
            f"({'ok' if good else 'MISMATCH'})",
            flush=True,
        )

        # One process, no torch.distributed: fairseq's fsdp_enable_wrap then passes
        # fairscale.utils.testing.DummyProcessGroup(rank=0, size=1) as the process group (an ImportError with
        # upstream 0.4.13, which has no fairscale.utils). The same training without FSDP is the reference.
        single = train(workdir, "one-process", "legacy_ddp", args.updates, os.path.join(workdir, "ck-one"), (), True)
        single_fs = train(
            workdir, "one-process-fsdp", "fully_sharded", args.updates, os.path.join(workdir, "ck-one-fsdp"), fsdp, True
        )
        dloss, dnorm = compare_updates(single_fs, single)
        dw = max_diff(weights(os.path.join(workdir, "ck-one-fsdp")), weights(os.path.join(workdir, "ck-one")))
        good = dloss <= args.loss_tol and dw <= args.weight_tol and dnorm <= args.gnorm_rtol
        ok &= good
        print(
            f"fairseq: one process (DummyProcessGroup) fully_sharded vs legacy_ddp over {args.updates} updates: "
            f"max|dloss| = {dloss:.3g}, final max|dw| = {dw:.3g}, gnorm max rel diff = {dnorm:.2g} "
            f"({'ok' if good else 'MISMATCH'})",
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
