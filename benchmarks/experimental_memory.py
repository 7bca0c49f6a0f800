#!/usr/bin/env python3
# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Memory benchmarks of ``fairscale.experimental``: MEVO's peak against ``Linear`` + ``F.cross_entropy``, and the
largest ``OffloadModel`` that trains in a fixed device-memory budget.

* ``mevo``: one forward + backward of the output layer and loss, for the given tokens, hidden size and vocabulary
  (defaults: the benchmark GPT's hidden size 256 and a 32k vocabulary; try ``--vocab 262144``). Reports the peak
  bytes allocated above the inputs for both, the logits' size, and ``extra / logits`` where ``extra`` is the peak
  minus the weight gradient (which both allocate). Target: MEVO's ratio at most 0.25. On CUDA the allocator's peak
  is used; on the CPU the profiler's allocation events (the peak of their running sum, in time order).
* ``offload`` (CUDA only): for growing depths of a stack of ``Linear(width, width)`` layers, whether one SGD step
  fits in ``--budget-mib`` of device memory without offload and with ``OffloadModel`` (``--slices`` slices,
  activation checkpointing); reports the largest depth of each.

Usage: ``python benchmarks/experimental_memory.py mevo --vocab 32768`` or ``... offload --budget-mib 512``.
"""

import argparse
import itertools
import json
import sys
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._C._profiler import _EventType

from fairscale.experimental.nn import MEVO, OffloadModel
from fairscale.internal.device import DeviceHandle, accelerator_available, current_accelerator_device


def peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Peak bytes allocated while ``fn`` runs, above what was allocated before."""
    handle = DeviceHandle.for_device(device)
    if handle.is_accelerator:
        handle.synchronize()
        handle.reset_peak_memory_stats()
        base = handle.memory_allocated()
        fn()
        handle.synchronize()
        return handle.max_memory_allocated() - base
    return _cpu_peak_bytes(fn)


def _cpu_peak_bytes(fn: Callable[[], None]) -> int:
    """The peak of the running sum of the CPU allocator's allocations and frees (negative sizes), in time order.

    Each allocation is a profiler event of its own; summing the ops' ``self_cpu_memory_usage`` in the ops' start
    order instead counted a free at the start of the op that did it, before the allocations of that op's children
    (an autograd Function's backward freeing its temporary): it missed MEVO's two weight-sized temporaries.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events: List[Tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    events.sort()
    return max(itertools.accumulate(size for _, size in events), default=0)


def bench_mevo(tokens: int, hidden: int, vocab: int, tile_factor: int, device: torch.device) -> Dict[str, float]:
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(vocab, hidden, device=device) * 0.02)
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    y = torch.randint(vocab, (tokens,), device=device)

    def dense() -> None:
        F.cross_entropy(x @ weight.T, y, reduction="sum").backward()

    mevo_layer = MEVO(weight, tile_factor=tile_factor)

    def mevo() -> None:
        mevo_layer(x, y).backward()

    results: Dict[str, float] = {}
    logits = tokens * vocab * 4
    for name, fn in (("dense", dense), ("mevo", mevo)):
        weight.grad = None
        x.grad = None
        peak = peak_bytes(fn, device)
        results[f"{name}_peak_bytes"] = peak
        results[f"{name}_extra_over_logits"] = (peak - weight.numel() * 4) / logits
    results["logits_bytes"] = logits
    return results


def _fits(build: Callable[[], nn.Module], width: int, batch: int, budget: int, device: torch.device) -> bool:
    handle = DeviceHandle.for_device(device)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, width, device=device)

    def step() -> None:
        model(x).sum().backward()
        opt.step()

    try:
        peak = peak_bytes(step, device)
    except RuntimeError as e:  # out of memory
        if "out of memory" not in str(e):
            raise
        return False
    finally:
        del model, opt
        handle.synchronize()
    return peak <= budget


def bench_offload(width: int, batch: int, budget_mib: int, slices: int, max_depth: int) -> Dict[str, int]:
    device = current_accelerator_device()
    assert device is not None
    budget = budget_mib * 1024 * 1024
    best = {"plain_max_depth": 0, "offload_max_depth": 0}
    for depth in range(1, max_depth + 1):

        def layers() -> nn.Sequential:
            return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))

        if _fits(lambda: layers().to(device), width, batch, budget, device):
            best["plain_max_depth"] = depth

        def offloaded() -> nn.Module:
            return OffloadModel(layers(), device, num_slices=min(slices * depth, depth), checkpoint_activation=True)

        if _fits(offloaded, width, batch, budget, device):
            best["offload_max_depth"] = depth
    return best


def main(argv: List[str]) -> Dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    mevo = sub.add_parser("mevo")
    mevo.add_argument("--tokens", type=int, default=2048)
    mevo.add_argument("--hidden", type=int, default=256)
    mevo.add_argument("--vocab", type=int, default=32768)
    mevo.add_argument("--tile-factor", type=int, default=16)
    offload = sub.add_parser("offload")
    offload.add_argument("--width", type=int, default=2048)
    offload.add_argument("--batch", type=int, default=64)
    offload.add_argument("--budget-mib", type=int, default=256)
    offload.add_argument("--slices", type=int, default=1, help="slices per layer group (OffloadModel num_slices)")
    offload.add_argument("--max-depth", type=int, default=64)
    args = parser.parse_args(argv)
    if args.what == "mevo":
        device = current_accelerator_device() or torch.device("cpu")
        result: Dict[str, float] = dict(bench_mevo(args.tokens, args.hidden, args.vocab, args.tile_factor, device))
    else:
        if not accelerator_available():
            raise SystemExit("the offload benchmark measures device memory: it needs an accelerator")
        result = dict(bench_offload(args.width, args.batch, args.budget_mib, args.slices, args.max_depth))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
