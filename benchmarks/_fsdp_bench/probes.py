# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Instruments of the untimed probe run: a collective spy, and peak memory and op counts from the profiler.

* :class:`CommSpy` sees every ``c10d`` collective of any implementation (fairscale goes through
  ``fairscale.internal.collectives``, the others call ``torch.distributed`` themselves), as a dispatch mode on the
  rank's thread. It slows every op down, which is why it only runs in the probe run.
* :func:`analyze_profile` reads the torch profiler's events of the probe run: on CPU, the running sum of the CPU
  allocator's allocation/free events since the model was built gives the live tensor bytes at every instant; and
  the ``aten::cat`` / split ops that ran inside each microbatch's ``backward()``.

Limits of the CPU memory figure: the profiler sees the allocations and frees made on the rank's own thread. Scratch
buffers that gloo allocates on its worker threads are not counted, and a tensor whose last reference happens to be
dropped on a c10d worker thread (it completes the collective and releases its work object, racing the rank's
thread) is never seen freed, so that rank's figure comes out too high by that tensor. The errors of the second
kind only ever inflate, and the ranks of a run hold equal shards, so with these events (the fallback where the C
heap cannot be read, see heap.py) the report uses the smallest rank's value and keeps every rank's in the JSON.
"""

import contextlib
import os
import re
import sys
from collections import Counter
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

PROBE_STEP = "bench::probe_step"
BACKWARD = "bench::backward"
#: Ops that concatenate. FSDP1's flat parameters show up as ``aten::cat`` under ``SplitWithSizesBackward0``,
#: fairscale's under ``FlatParamViewsBackward``; FSDP2 packs its reduce-scatter input with ``aten::_chunk_cat``.
CAT_OPS = ("aten::cat", "aten::_chunk_cat", "aten::concat", "aten::concatenate")
_OP_OF_INTEREST = re.compile(r"cat|split|FlatParamViews", re.IGNORECASE)


def _kind(op_name: str) -> str:
    name = op_name.split(".")[1] if "." in op_name else op_name
    for needle, kind in (
        ("allgather", "all_gather"),
        ("all_gather", "all_gather"),
        ("reduce_scatter", "reduce_scatter"),
        ("allreduce", "all_reduce"),
        ("broadcast", "broadcast"),
        ("barrier", "barrier"),
    ):
        if needle in name:
            return kind
    return name.rstrip("_")


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


def _process_group(args: Tuple[Any, ...]) -> Any:
    """The process group among a c10d op's arguments (boxed as a script object), or ``None``."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except Exception:  # a ReduceOp or another script object, not the group
                continue
    return None


#: Global ranks per group name: every op of a step asks, and the lookup walks c10d's tables.
_RANKS_BY_NAME: Dict[str, Tuple[int, ...]] = {}


def group_ranks(group: Any) -> Tuple[int, ...]:
    """The sorted global ranks of a c10d process group (cached by the group's name, unique in a world)."""
    # torch 2.1's ProcessGroup has no group_name; c10d's table names it there.
    name = str(getattr(group, "group_name", None) or dist.distributed_c10d._get_process_group_name(group))
    ranks = _RANKS_BY_NAME.get(name)
    if ranks is None:
        ranks = _RANKS_BY_NAME[name] = tuple(sorted(dist.get_process_group_ranks(group)))
    return ranks


def _group_ranks(args: Tuple[Any, ...]) -> Tuple[int, ...]:
    group = _process_group(args)
    return () if group is None else group_ranks(group)


def ranks_key(kind: str, phase: str, ranks: Sequence[int]) -> str:
    """The key of a per-group summary: ``"<kind>/<phase>/ranks=<r0>,<r1>..."``."""
    return f"{kind}/{phase}/ranks={','.join(str(r) for r in ranks)}"


def summary_by_ranks(records: Iterable[Tuple[str, str, Sequence[int], int]]) -> Dict[str, Dict[str, int]]:
    """Totals per ``ranks_key`` of ``(kind, phase, ranks, bytes)`` records: groups of equal size stay apart (the
    shard and the replicate group of a 2 x 2 layout both have 2 ranks)."""
    out: Dict[str, Dict[str, int]] = {}
    for kind, phase, ranks, nbytes in records:
        entry = out.setdefault(ranks_key(kind, phase, ranks), {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += nbytes
    return out


class CommSpy(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is unannotated
    """Records every c10d collective dispatched on this thread: kind, phase, group size and full-buffer bytes.

    Bytes follow the fairscale counter's convention: the all-gather output, the reduce-scatter input, the
    all-reduce/broadcast tensor (what one rank holds after, or before, the collective).
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        self.records: List[Tuple[str, str, int, int]] = []
        # The same collectives with their group's global ranks (see summary_by_ranks).
        self.group_records: List[Tuple[str, str, Tuple[int, ...], int]] = []
        self.current_phase = "none"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Tag the collectives issued inside with ``name``."""
        previous, self.current_phase = self.current_phase, name
        try:
            yield
        finally:
            self.current_phase = previous

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name.startswith("c10d."):
            kind = _kind(name)
            payload = args[1] if kind == "reduce_scatter" and len(args) > 1 else (args[0] if args else None)
            ranks, nbytes = _group_ranks(args), _tensor_bytes(payload)
            self.records.append((kind, self.current_phase, len(ranks) or -1, nbytes))
            self.group_records.append((kind, self.current_phase, ranks, nbytes))
        return func(*args, **(kwargs or {}))

    def summary(self) -> Dict[str, Dict[str, int]]:
        """Totals per ``"<kind>/<phase>/gs=<group size>"`` (the format of ``CollectiveCounter.summary()``)."""
        out: Dict[str, Dict[str, int]] = {}
        for kind, phase, size, nbytes in self.records:
            entry = out.setdefault(f"{kind}/{phase}/gs={size}", {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += nbytes
        return out

    def summary_by_ranks(self) -> Dict[str, Dict[str, int]]:
        """Totals per ``"<kind>/<phase>/ranks=<global ranks>"``: one entry per group, not per group size."""
        return summary_by_ranks(self.group_records)


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (C++ logging included) for the duration; Python errors still propagate."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _start_ns(e: Any) -> int:
    # torch 2.1's profiler events have microseconds only (start_us, duration_us).
    return int(e.start_ns()) if hasattr(e, "start_ns") else int(e.start_us()) * 1000


def _end_ns(e: Any) -> int:
    if hasattr(e, "end_ns"):
        return int(e.end_ns())
    if hasattr(e, "duration_ns"):  # torch 2.4: start and duration in nanoseconds, no end
        return int(e.start_ns()) + int(e.duration_ns())
    return (int(e.start_us()) + int(e.duration_us())) * 1000


def _ranges(events: List[Any], name: str) -> List[Tuple[int, int]]:
    found = [(_start_ns(e), _end_ns(e)) for e in events if e.name() == name]
    return sorted(found)


def _same_op(a: str, b: str) -> bool:
    return a == b or (a in CAT_OPS and b in CAT_OPS)


def _outermost_ops(events: List[Any]) -> List[Tuple[int, str]]:
    """``(start_ns, name)`` of the cat/split ops that do not run inside the same op.

    An op re-dispatched through the spy's dispatch mode, or ``aten::_chunk_cat`` calling ``aten::cat``, shows up
    nested in itself; such inner events are one op, not two. (A cat inside ``SplitWithSizesBackward0`` or
    ``FlatParamViewsBackward`` counts.)
    """
    out: List[Tuple[int, str]] = []
    stacks: Dict[int, List[Any]] = {}
    for e in sorted(events, key=lambda e: (_start_ns(e), -_end_ns(e))):
        stack = stacks.setdefault(e.start_thread_id(), [])
        while stack and _end_ns(stack[-1]) < _start_ns(e):
            stack.pop()
        name = e.name()
        if _OP_OF_INTEREST.search(name) and not any(_same_op(name, s.name()) for s in stack):
            out.append((_start_ns(e), name))
        stack.append(e)
    return out


def analyze_profile(prof: Any, microbatches: int, track_memory: bool) -> Dict[str, Any]:
    """Peak/steady memory of the probe step and the concat/split ops of each microbatch's backward.

    Returns:
        ``{"memory": {"steady_bytes", "peak_bytes"} or None, "backward_ops": [Counter per microbatch]}``.
    """
    events = list(prof.profiler.kineto_results.events())
    probe = _ranges(events, PROBE_STEP)
    backward = _ranges(events, BACKWARD)[-microbatches:]
    outermost = _outermost_ops(events)
    ops: List[Dict[str, int]] = []
    for start, end in backward:
        counts = Counter(name for t, name in outermost if start <= t <= end)
        ops.append(dict(sorted(counts.items())))
    memory: Optional[Dict[str, int]] = None
    if track_memory and probe:
        start, end = probe[-1]
        allocs = sorted((_start_ns(e), e.nbytes()) for e in events if e.name() == "[memory]")
        live, steady, peak = 0, 0, 0
        for t, nbytes in allocs:
            if t > end:
                break
            if t < start:
                live += nbytes
                steady = live
                continue
            live += nbytes
            peak = max(peak, live)
        memory = {"steady_bytes": steady, "peak_bytes": max(peak, steady)}
    return {"memory": memory, "backward_ops": ops}


def cat_count(ops: Dict[str, int]) -> int:
    """Concatenations in one microbatch's backward."""
    return sum(n for name, n in ops.items() if name in CAT_OPS)


def split_backward_count(ops: Dict[str, int]) -> int:
    """Flat-parameter view nodes (``FlatParamViewsBackward``; ``SplitWithSizesBackward`` for split views) in one
    microbatch's backward."""
    return sum(n for name, n in ops.items() if name.startswith(("SplitWithSizesBackward", "FlatParamViewsBackward")))
