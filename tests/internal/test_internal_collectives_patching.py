# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Patching ``torch.distributed`` functions reaches fairscale's collectives (they are looked up at call time).

Upstream's tests (and users' tools) replace ``torch.distributed.all_gather_into_tensor`` and friends to count calls
or inject delays; that only works if the collectives layer does not bind the functions at import time.
"""

import contextlib
import functools
import warnings
from typing import Any, Callable, Dict, Iterator, List

import torch
import torch.distributed as dist

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal import collectives


@contextlib.contextmanager
def _counting(name: str, calls: List[str]) -> Iterator[None]:
    """Replace ``torch.distributed.<name>`` by a wrapper that records the call and delegates to the original."""
    original: Callable[..., Any] = getattr(dist, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the older names are deprecated on recent torch
            return original(*args, **kwargs)

    setattr(dist, name, wrapper)
    try:
        yield
    finally:
        setattr(dist, name, original)


def _all_gather(name: str, world_size: int) -> None:
    calls: List[str] = []
    out = torch.empty(2 * world_size)
    with _counting(name, calls):
        collectives.all_gather_into_flat(out, torch.full((2,), float(dist.get_rank())))
        collectives.all_gather_into_flat(out, torch.full((2,), float(dist.get_rank())), async_op=True).wait()
    assert calls == [name, name], calls
    assert out.tolist() == [float(r) for r in range(world_size) for _ in range(2)]


def _reduce_scatter(name: str, world_size: int) -> None:
    calls: List[str] = []
    out = torch.empty(3)
    with _counting(name, calls):
        collectives.reduce_scatter_from_flat(out, torch.arange(3.0 * world_size))
    assert calls == [name], calls
    rank = dist.get_rank()
    assert out.tolist() == [world_size * (3.0 * rank + i) for i in range(3)]


def _others(world_size: int) -> None:
    calls: List[str] = []
    t = torch.ones(3)
    names = ("all_reduce", "broadcast", "barrier", "all_gather_object", "broadcast_object_list")
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(_counting(name, calls))
        collectives.all_reduce(t)
        collectives.broadcast(t, src=0)
        collectives.barrier()
        collectives.all_gather_object({"rank": dist.get_rank()})
        collectives.broadcast_object_list([dist.get_rank()], src=0)
    assert calls == list(names), calls
    assert t.tolist() == [float(world_size)] * 3


def _list_fallback(world_size: int) -> None:
    """The list variant (chosen when a backend lacks the tensor one) is also looked up at call time."""
    calls: List[str] = []
    out = torch.empty(world_size)
    with collectives._force_strategy("all_gather", "list"), _counting("all_gather", calls):
        collectives.all_gather_into_flat(out, torch.ones(1))
    assert calls == ["all_gather"], calls


def _patched_worlds(rank: int, world_size: int) -> None:
    cases: Dict[str, Callable[[], None]] = {}
    # Which variant this torch's gloo takes (torch 2.1's has no flat all-gather or reduce-scatter: the list variant
    # then runs, and the flat names are never called).
    collectives.all_gather_into_flat(torch.empty(world_size), torch.ones(1))
    collectives.reduce_scatter_from_flat(torch.empty(1), torch.ones(world_size))
    flat = {
        kind: collectives._chosen.get(("gloo", kind, torch.float32, "cpu")) == "tensor"
        for kind in ("all_gather", "reduce_scatter")
    }
    # The newest name, and the older names that upstream-era code patches (torch keeps them as wrappers).
    for name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"):
        if hasattr(dist, name) and flat["all_gather"]:
            cases[f"all_gather via {name}"] = functools.partial(_all_gather, name, world_size)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
        if hasattr(dist, name) and flat["reduce_scatter"]:
            cases[f"reduce_scatter via {name}"] = functools.partial(_reduce_scatter, name, world_size)
    cases["all_reduce, broadcast, barrier, object collectives"] = functools.partial(_others, world_size)
    cases["list fallback"] = functools.partial(_list_fallback, world_size)
    run_cases(list(cases.items()))


def test_patching_torch_distributed_reaches_collectives() -> None:
    run_distributed(_patched_worlds, 2, timeout=60)
