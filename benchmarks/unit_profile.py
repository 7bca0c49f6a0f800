#!/usr/bin/env python3
# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Kernel launches, CPU time and peak memory per sharding unit: ``optimize_backward_concat`` off/on, prefetch off/on.

One process, the main job's GPT (``--layers --hidden ...``, one unit per block plus the root), three parts:

* ``obc``: an accumulation window of ``--accum-microbatches`` microbatches of ``--accum-batch`` sequences, fairscale
  with ``reshard_after_forward=False`` (the accum scenario's setting), ``optimize_backward_concat`` off and on, and
  FSDP2 on the same window;
* ``prefetch``: a training step of one microbatch of ``--batch`` sequences, ``reshard_after_forward=True`` (every
  all-gather and hook runs), fairscale with ``forward_prefetch``/``backward_prefetch`` both off and both on, and FSDP2;
* ``bitwise``: a real 1-rank group (NCCL on CUDA, gloo on CPU): the gradients after one window with the flag off and
  on, compared bit for bit under deterministic kernels (math attention; a second flag-off run is the control), and
  the concatenations each window's backward runs.

The first two run on a group of torch's "fake" backend at ``--world-size`` ranks: every sharded code path runs (the
gathers and reduce-scatters are issued, nothing is communicated), so a figure is what the wrapper itself costs and no
other rank's timing enters it; one GPU is enough. The numbers computed there mean nothing (no other rank's shard is
real): only costs are measured. Per variant: median window/step wall time (device synchronized), CPU time to issue it
(the process's and this thread's, up to the final synchronize, whose wait spins on a core), CUDA kernel launches,
memcpy/memset calls and device kernels per window/step (torch profiler, one extra step), ``aten::cat`` ops, and the
peak of the device's caching allocator over the timed steps (CPU: not measured). "Per unit" divides by the FSDP
instances and, for the window, by its microbatches.

    python benchmarks/unit_profile.py                   # CPU, a small model (~20 s on 2 cores)
    python benchmarks/unit_profile.py --device cuda --layers 8 --hidden 1024 --heads 16 --seq-len 512 \\
        --vocab 32000 --mixed-precision bf16            # what .ci/cuda-checks runs

docs/benchmarks.rst ("On one GPU: NVIDIA H200 (issue 31)") has a run.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Deterministic cuBLAS (the bitwise part) needs a fixed workspace, set before cuBLAS starts; 8 x 4 MiB is about the
# default's size, so the timed parts are not affected.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from _fsdp_bench.config import BenchConfig, validate  # noqa: E402
from _fsdp_bench.model import lm_loss  # noqa: E402
from _fsdp_bench.peers import Peer, RunSpec, build_peer, skip_reason  # noqa: E402
from fairscale.internal.device import DeviceHandle  # noqa: E402
from fairscale.nn.data_parallel import FullyShardedDataParallel, get_fsdp_instances  # noqa: E402

#: CUDA runtime/driver calls that launch a kernel, and those that start a copy or a fill.
LAUNCHES = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel",
)
COPIES = ("cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemcpy", "cudaMemset")
CATS = ("aten::cat", "aten::_chunk_cat")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One measured configuration: its part, its label and the benchmark run it builds."""

    part: str
    label: str
    spec: RunSpec


def variants(accum_microbatches: int) -> List[Variant]:
    """The obc and prefetch parts' variants, in the order they are reported."""
    obc = [
        Variant("obc", "fairscale obc off", RunSpec("accum", "fairscale", False, accum_microbatches, False)),
        Variant("obc", "fairscale obc on", RunSpec("accum", "fairscale", False, accum_microbatches, True)),
        Variant("obc", "fsdp2", RunSpec("accum", "fsdp2", False, accum_microbatches)),
    ]
    prefetch = [
        Variant("prefetch", "fairscale prefetch off", RunSpec("train", "fairscale", True, 1, prefetch=False)),
        Variant("prefetch", "fairscale prefetch on", RunSpec("train", "fairscale", True, 1, prefetch=True)),
        Variant("prefetch", "fsdp2", RunSpec("train", "fsdp2", True, 1)),
    ]
    return obc + prefetch


def _tokens(cfg: BenchConfig, batch: int, step: int, mb: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + mb)
    return torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=g).to(device)


def _window(peer: Peer, cfg: BenchConfig, spec: RunSpec, batch: int, step: int, device: torch.device) -> None:
    """Forward and backward of every microbatch of one window (gradient sync in the last one only)."""
    for mb in range(spec.microbatches):
        x = _tokens(cfg, batch, step, mb, device)
        with peer.microbatch(mb == spec.microbatches - 1):
            with peer.forward_context():
                out = peer.model(x)
            lm_loss(out, x).backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated


def _profile_counts(prof: Any) -> Dict[str, int]:
    launches = copies = kernels = cats = 0
    for e in prof.events():
        name = e.name
        if name in LAUNCHES:
            launches += 1
        elif name in COPIES:
            copies += 1
        elif name in CATS:
            cats += 1
        if getattr(e.device_type, "name", "") == "CUDA":  # a kernel, as the device ran it
            kernels += 1
    return {"kernel_launches": launches, "memcpy_memset": copies, "device_kernels": kernels, "cat_ops": cats}


def _units(model: torch.nn.Module) -> int:
    if isinstance(model, FullyShardedDataParallel):
        return len(get_fsdp_instances(model))
    return 1 + sum(1 for m in model.modules() if m is not model and type(m).__name__.startswith("FSDP"))


def measure(variant: Variant, cfg: BenchConfig, device: torch.device, steps: int, warmup: int) -> Dict[str, Any]:
    """Time ``steps`` windows/steps of ``variant`` after ``warmup``, then profile one more."""
    spec = variant.spec
    batch = cfg.accum_batch if variant.part == "obc" else cfg.batch
    handle = DeviceHandle.for_device(device)
    peer = build_peer(spec, cfg, device)
    for step in range(warmup):
        _window(peer, cfg, spec, batch, step, device)
        peer.model.zero_grad(set_to_none=True)
    handle.synchronize()
    wall: List[float] = []
    cpu: List[float] = []
    own: List[float] = []
    on_device = device.type != "cpu"
    if on_device:
        handle.reset_peak_memory_stats()
    base = handle.memory_allocated() if on_device else 0
    for step in range(steps):
        c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        _window(peer, cfg, spec, batch, warmup + step, device)
        # CPU time up to here: what the host spent issuing the window. The synchronize below spins on a CPU core
        # while the GPU finishes (the first H200 run counted it: CPU time equal to wall time).
        cpu.append(time.process_time() - c0)
        own.append(time.thread_time() - t0)
        handle.synchronize()
        wall.append(time.perf_counter() - w0)
        peer.model.zero_grad(set_to_none=True)
    peak = handle.max_memory_allocated() - base if on_device else None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _window(peer, cfg, spec, batch, warmup + steps, device)
        handle.synchronize()
    counts = _profile_counts(prof)
    units = _units(peer.model)
    per = units * spec.microbatches
    del peer
    med_cpu, med_own = statistics.median(cpu), statistics.median(own)
    return {
        "part": variant.part,
        "label": variant.label,
        "units": units,
        "microbatches": spec.microbatches,
        "wall_ms": 1e3 * statistics.median(wall),
        "wall_ms_all": [1e3 * w for w in wall],
        "cpu_ms": 1e3 * med_cpu,
        "thread_cpu_ms": 1e3 * med_own,
        "cpu_us_per_unit": 1e6 * med_cpu / per,
        "thread_cpu_us_per_unit": 1e6 * med_own / per,
        "kernel_launches_per_unit": counts["kernel_launches"] / per,
        "peak_bytes": peak,
        **counts,
    }


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """Deterministic kernels, and the math attention kernel: the fused attention backwards of CUDA accumulate with
    atomics, so two runs of the *same* configuration can differ in their last bits."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except ImportError:  # torch < 2.3: the default selection (deterministic mode still applies)
            math_only: ContextManager[Any] = contextlib.nullcontext()
        else:
            math_only = sdpa_kernel(SDPBackend.MATH)
        with math_only:
            yield
    finally:
        torch.use_deterministic_algorithms(before)


def _window_gradients(cfg: BenchConfig, device: torch.device, obc: bool) -> Tuple[List[torch.Tensor], int]:
    """The gradients after the second window of a fresh model, and the concatenations that window ran."""
    spec = RunSpec("accum", "fairscale", False, cfg.accum_microbatches, obc)
    peer = build_peer(spec, cfg, device)
    _window(peer, cfg, spec, cfg.accum_batch, 0, device)  # the first window: lazy init and its checks
    peer.model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _window(peer, cfg, spec, cfg.accum_batch, 1, device)
    grads = [p.grad.detach().clone() for p in peer.model.parameters() if p.grad is not None]
    return grads, _profile_counts(prof)["cat_ops"]


def _same(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) > 0 and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def bitwise(cfg: BenchConfig, device: torch.device) -> Dict[str, Any]:
    """Gradients after one window, flag off vs on, on a real 1-rank group (the default group at this point), with
    deterministic kernels; a second flag-off run is the control (it must equal the first for the check to mean
    anything)."""
    with _deterministic():
        off, cat_off = _window_gradients(cfg, device, False)
        control, _ = _window_gradients(cfg, device, False)
        on, cat_on = _window_gradients(cfg, device, True)
    return {
        "gradients": len(off),
        "control_equal": _same(off, control),
        "bitwise_equal": _same(off, on),
        "cat_ops_off": cat_off,
        "cat_ops_on": cat_on,
    }


def _init_fake(world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def _init_single(device: torch.device, rendezvous: str) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=0, world_size=1)


def run(cfg: BenchConfig, steps: int, warmup: int) -> Dict[str, Any]:
    """Every part; returns the JSON document."""
    device = torch.device(cfg.device, 0) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.accelerator.set_device_index(0)  # this process's GPU, for NCCL and FSDP
    _init_fake(cfg.world_size)
    rows: List[Dict[str, Any]] = []
    skipped: Dict[str, str] = {}
    errors: Dict[str, str] = {}
    try:
        for v in variants(cfg.accum_microbatches):
            reason = skip_reason(v.spec, cfg)
            if reason is not None:
                skipped[f"{v.part}/{v.label}"] = reason
                continue
            try:
                rows.append(measure(v, cfg, device, steps, warmup))
            except Exception as e:  # one variant's failure must not hide the others' figures (one GPU call)
                traceback.print_exc()
                errors[f"{v.part}/{v.label}"] = f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as tmp:
        _init_single(device, os.path.join(tmp, "rendezvous"))
        exact: Dict[str, Any] = {"gradients": 0, "control_equal": False, "bitwise_equal": False}
        try:
            exact = bitwise(cfg, device)
        except Exception as e:
            traceback.print_exc()
            errors["bitwise"] = f"{type(e).__name__}: {e}"
        finally:
            dist.destroy_process_group()
    return {
        "device": DeviceHandle.for_device(device).name(),
        "torch": torch.__version__,
        "config": dataclasses.asdict(cfg),
        "steps": steps,
        "warmup": warmup,
        "rows": rows,
        "skipped": skipped,
        "errors": errors,
        "bitwise": exact,
    }


def text(doc: Dict[str, Any]) -> str:
    """The short table of a run."""
    cfg = doc["config"]
    lines = [
        f"{doc['device']}, torch {doc['torch']}; {cfg['layers']} x {cfg['hidden']} GPT, {cfg['mixed_precision']}, "
        f"fake group of {cfg['world_size']} ranks; medians of {doc['steps']} windows/steps",
        f"{'part':<9}{'variant':<24}{'wall ms':>9}{'CPU ms':>8}{'CPU us/unit':>12}{'launch/unit':>12}"
        f"{'launches':>9}{'kernels':>8}{'cat':>5}{'peak MiB':>9}",
    ]
    for r in doc["rows"]:
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
        lines.append(
            f"{r['part']:<9}{r['label']:<24}{r['wall_ms']:9.2f}{r['cpu_ms']:8.1f}{r['cpu_us_per_unit']:12.1f}"
            f"{r['kernel_launches_per_unit']:12.1f}{r['kernel_launches']:9d}{r['device_kernels']:8d}"
            f"{r['cat_ops']:5d}{peak:>9}"
        )
    for key, reason in doc["skipped"].items():
        lines.append(f"skipped {key}: {reason}")
    for key, error in doc["errors"].items():
        lines.append(f"FAILED {key}: {error}")
    b = doc["bitwise"]
    lines.append(
        f"1-rank window, deterministic kernels: off vs off (control) bitwise equal: {b['control_equal']}; "
        f"obc off vs on: {b['gradients']} gradients bitwise equal: {b['bitwise_equal']}; "
        f"cat ops in the window {b.get('cat_ops_off')} (off) vs {b.get('cat_ops_on')} (on)"
    )
    return "\n".join(lines)


def parse(argv: Optional[Sequence[str]]) -> Tuple[BenchConfig, int, int, str]:
    """The configuration, timed steps, warmup steps and output path."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--world-size", type=int, default=2, help="ranks of the fake group")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4, help="sequences per step of the prefetch part")
    p.add_argument("--accum-batch", type=int, default=1, help="sequences per microbatch of the obc part")
    p.add_argument("--accum-microbatches", type=int, default=8, help="microbatches per window of the obc part")
    p.add_argument("--mixed-precision", choices=("none", "fp16", "bf16"), default="none")
    p.add_argument("--steps", type=int, default=10, help="timed windows/steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="unit_profile.json", help="JSON with every number ('' to skip)")
    a = p.parse_args(argv)
    if a.world_size < 2:
        p.error("--world-size must be >= 2 (the sharded code paths)")
    if a.steps < 1 or a.warmup < 1:
        p.error("--steps and --warmup must be >= 1 (the first window runs the lazy initialisation)")
    cfg = BenchConfig(
        layers=a.layers,
        hidden=a.hidden,
        heads=a.heads,
        seq_len=a.seq_len,
        vocab=a.vocab,
        batch=a.batch,
        accum_batch=a.accum_batch,
        accum_microbatches=a.accum_microbatches,
        world_size=a.world_size,
        mixed_precision=a.mixed_precision,
        device=a.device,
        out=a.out or None,
        plot=None,
    )
    problems = validate(cfg)  # the main job's checks (sizes, heads dividing hidden, ...)
    if problems:
        p.error("; ".join(problems))
    return cfg, a.steps, a.warmup, a.out


def main(argv: Optional[Sequence[str]] = None) -> int:
    cfg, steps, warmup, out = parse(argv)
    if cfg.threads == 0 and cfg.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    doc = run(cfg, steps, warmup)
    print(text(doc))
    if out:
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
    ok = doc["bitwise"]["bitwise_equal"] and doc["bitwise"]["control_equal"] and not doc["errors"]
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
