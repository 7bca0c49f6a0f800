# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Layer-by-layer memory traces of a forward and backward pass, and checkpoint placement suggestions.

:class:`LayerwiseMemoryTracker` hooks every module of a model and records, for each leaf module as it runs,
the memory allocated after it, the bytes of the activations it produced, its parameter bytes and the bytes
all-gathered for it (FSDP with a :class:`ProcessGroupTracker` as process group). Memory numbers come from the
accelerator allocator's statistics on a GPU and from the profiler's memory events on the CPU (see
``_memory_probe``); everything else (names, order, activation and parameter bytes) is device independent.

Example::

    tracker = LayerwiseMemoryTracker()
    tracker.monitor(model)
    model(batch).sum().backward()
    tracker.stop()
    print(tracker.summary)
    tracker.show_plots()  # needs matplotlib and Pillow
"""

import json
import math
import numbers
import operator
import weakref
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from fairscale.internal.errors import FairscaleValueError

# Upstream's module also exposes FullyShardedDataParallel (tracked modules are recognised by class name here).
from fairscale.nn.data_parallel import FullyShardedDataParallel as FullyShardedDataParallel  # noqa: F401

from ._memory_plots import compare_memory_traces_in_plot, matplotlib_figure_to_image, null_context
from ._memory_probe import MemoryMark, MemoryProbe, probe_for
from ._memory_traces import LayerMemoryTrace, TraceBackwardEvent, TraceForwardEvent, load_traces
from ._tensor_walk import collect_tensors, first_output_tensor, new_tensors, tensor_bytes

__all__ = [
    "LayerwiseMemoryTracker",
    "LayerMemoryTrace",
    "TraceForwardEvent",
    "TraceBackwardEvent",
    "LayerwiseMemoryTrackerSummary",
    "ProcessGroupTracker",
    "ProcessGroupTrackingEvent",
    "find_best_reset_points",
    "suggest_checkpoint_location",
    "SuggestedCheckpoints",
    "compare_memory_traces_in_plot",
    "matplotlib_figure_to_image",
    "null_context",
]


@dataclass
class LayerwiseMemoryTrackerSummary:
    """Totals of a run: peaks, activation bytes, forward allocations and the top activation producers."""

    max_memory_allocated: int
    max_memory_cached: int
    total_activation_allocations: int
    total_forward_allocations: int
    top_forward_activation_producers: List[LayerMemoryTrace]


class ProcessGroupTrackingEvent(Enum):
    allgather = auto()


class ProcessGroupTracker:
    """A process group proxy that reports all-gathers to a listener before running them.

    Args:
        group: the real process group.
        listener: called as ``listener(ProcessGroupTrackingEvent.allgather, output_tensors, input_tensors)``.
    """

    def __init__(self, group: Any, listener: Optional[Callable[..., None]] = None) -> None:
        self.group = group
        self.listener = listener

    def __getattr__(self, item: str) -> Any:
        # Only called for attributes not found on the proxy itself. Its own fields and dunders are not forwarded:
        # copy and pickle look them up on an instance whose __init__ has not run, and forwarding them to the
        # missing ``group`` recursed without end.
        if item in ("group", "listener") or item.startswith("__"):
            raise AttributeError(item)
        if item in ("allgather", "_allgather_base"):
            return self._build_wrapper(getattr(self.group, item))
        return getattr(self.group, item)

    def fairscale_proxied_group(self) -> Tuple[Any, Callable[[Any, Any], None]]:
        """The real group, and what fairscale's collectives call with each all-gather's output and input on it (they
        run on the real group: torch's functions accept only its own group objects)."""
        return self.group, self._notify_all_gather

    def _notify_all_gather(self, output_tensors: Any, input_tensors: Any) -> None:
        if self.listener is not None:
            self.listener(ProcessGroupTrackingEvent.allgather, output_tensors, input_tensors)

    def _build_wrapper(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(output_tensors: Any, input_tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if self.listener is not None:
                self.listener(ProcessGroupTrackingEvent.allgather, output_tensors, input_tensors)
            return fn(output_tensors, input_tensors, *args, **kwargs)

        return wrapper


def _is_fsdp(module: nn.Module) -> bool:
    return type(module).__name__ == "FullyShardedDataParallel"


class _Pending(NamedTuple):
    position: int
    mark: MemoryMark
    pre_forward: Optional[MemoryMark]


class _Hooked(NamedTuple):
    """A module hooked by a tracker: the module (weakly, see ``LayerwiseMemoryTracker.monitor``) and its hooks."""

    module: "weakref.ref[nn.Module]"
    handles: List[RemovableHandle]


class LayerwiseMemoryTracker:
    """Record memory layer by layer during forward and backward (see the module docstring).

    Traces are available in :attr:`memory_traces` (a list of :class:`LayerMemoryTrace`), and summarised by
    :attr:`summary`, :meth:`top_forward_activation_producers` and :meth:`show_plots`.
    """

    def __init__(self) -> None:
        self._traces: List[LayerMemoryTrace] = []
        self._pending: List[_Pending] = []
        self._previous_module_name: Optional[str] = None
        self._last_all_gather_memory = 0
        self._cumul_all_gather_memory: List[int] = []
        self._memory_pre_forward: Optional[MemoryMark] = None
        self._probe: Optional[MemoryProbe] = None
        # The modules hooked since the last stop(), by id(): a module is hooked once (see monitor). The entry holds the
        # module weakly and is checked against it: a freed module's id is reused by new objects, and a set of ids
        # took a new module at that address for a hooked one and left it unhooked, silently.
        self._monitored: Dict[int, _Hooked] = {}
        # The ProcessGroupTrackers whose listener this tracker is (weakly): stop() detaches them.
        self._listened: List["weakref.ref[ProcessGroupTracker]"] = []
        # Counts stop()s: a backward hook attached to a graph by a forward of an earlier monitoring session records
        # nothing in a later one.
        self._session = 0

    @property
    def memory_traces(self) -> List[LayerMemoryTrace]:
        """The traces recorded so far, in order."""
        self._resolve()
        return self._traces

    @memory_traces.setter
    def memory_traces(self, traces: List[LayerMemoryTrace]) -> None:
        self._traces = list(traces)
        self._pending = []

    def monitor(self, model: nn.Module) -> None:
        """Install the hooks on every module of ``model`` (root included) and start measuring.

        Several models (or parts of one) may be monitored by one tracker: they share its memory probe. (A second call
        made a second probe before, and the first one's CPU profiler session was never stopped: a later tracker then
        read 0 bytes everywhere.) A module already monitored (a part of a model monitored before, or the same model
        again) keeps its first hooks and name: hooked twice, its forward trace was lost and its backward traced twice.

        Each forward of a leaf module that is traced hooks the autograd node of its output (the first tensor of it,
        as upstream's legacy module backward hook), and that node's backward makes the matching backward trace.
        Outputs holding no tensor (``None``, numbers) get no backward trace: torch's legacy module hook failed on them.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"LayerwiseMemoryTracker.monitor: model must be an nn.Module, got {type(model).__name__}")
        if self._probe is None:
            param = next(model.parameters(), None)
            self._probe = probe_for(param.device if param is not None else torch.device("cpu"))
            self._last_all_gather_memory = 0  # a new session: nothing gathered yet
        self._forget_freed_modules()
        for name, m in model.named_modules():
            hooked = self._monitored.get(id(m))
            if hooked is not None and hooked.module() is m:
                continue
            handles = [m.register_forward_pre_hook(self._create_pre_forward_hook(name))]
            if _is_fsdp(m):
                # Ends the module's all-gather scope also when its forward raises (always_call): the entry its
                # pre-hook pushed stayed, and every later gather of the session was added to it.
                handles.append(m.register_forward_hook(self._create_gather_scope_end(), always_call=True))
            handles.append(m.register_forward_hook(self._create_post_forward_hook(name)))
            self._monitored[id(m)] = _Hooked(weakref.ref(m), handles)
            group = getattr(m, "process_group", None) if _is_fsdp(m) else None
            if isinstance(group, ProcessGroupTracker):
                group.listener = self._handle_process_group_call
                self._listened.append(weakref.ref(group))
        self._probe.start()

    def _forget_freed_modules(self) -> None:
        """Drop the entries of modules that were freed (their hooks went with them)."""
        for key in [key for key, hooked in self._monitored.items() if hooked.module() is None]:
            del self._monitored[key]

    def clear_traces(self) -> None:
        """Forget every trace, and the all-gathered bytes not counted in a trace yet."""
        self._traces.clear()
        self._pending.clear()
        self._previous_module_name = None
        self._memory_pre_forward = None
        self._last_all_gather_memory = 0
        self._cumul_all_gather_memory.clear()

    def stop(self) -> None:
        """Remove the hooks and stop measuring (the traces are kept).

        The tracker also stops being the all-gather listener of the ``ProcessGroupTracker`` groups it was listening
        to: before, the gathers of later unmonitored steps were added to the first trace of the next ``monitor()``.
        """
        for hooked in self._monitored.values():
            for handle in hooked.handles:
                handle.remove()
        self._monitored.clear()
        for ref in self._listened:
            group = ref()
            if group is not None and group.listener == self._handle_process_group_call:
                group.listener = None
        self._listened.clear()
        if self._probe is not None:
            self._resolve()
            self._probe.stop()
            self._probe = None  # a later monitor() may be of a model on another device
        self._session += 1
        self._previous_module_name = None
        self._memory_pre_forward = None
        self._last_all_gather_memory = 0
        self._cumul_all_gather_memory.clear()

    @property
    def forward_traces(self) -> List[LayerMemoryTrace]:
        return [t for t in self.memory_traces if t.is_forward]

    @property
    def backward_traces(self) -> List[LayerMemoryTrace]:
        return [t for t in self.memory_traces if not t.is_forward]

    @property
    def max_memory_allocated(self) -> int:
        return max(t.allocated for t in self.memory_traces)

    @property
    def max_memory_cached(self) -> int:
        return max(t.reserved for t in self.memory_traces)

    @property
    def summary(self) -> LayerwiseMemoryTrackerSummary:
        """Peaks and totals of the forward traces, with the 10 largest activation producers."""
        forward = self.forward_traces
        return LayerwiseMemoryTrackerSummary(
            max_memory_allocated=self.max_memory_allocated,
            max_memory_cached=self.max_memory_cached,
            total_activation_allocations=sum(t.event.memory_activations for t in forward),
            total_forward_allocations=sum(t.event.memory_diff for t in forward),
            top_forward_activation_producers=self.top_forward_activation_producers(top=10),
        )

    def top_forward_activation_producers(self, top: int = 10) -> List[LayerMemoryTrace]:
        """The ``top`` forward traces with the most activation bytes (stable order on ties).

        Raises:
            ValueError: ``top`` is not an int >= 0 (a negative one sliced the last traces off, silently).
        """
        try:
            count = operator.index(top)  # numpy integers too
        except TypeError:
            count = -1
        if isinstance(top, bool) or count < 0:
            raise ValueError(f"top_forward_activation_producers: top must be an int >= 0 (a count), got {top!r}")
        return sorted(self.forward_traces, key=lambda t: t.event.memory_activations, reverse=True)[:count]

    def show_plots(self, figsize: Tuple[int, int] = (16, 20), capture: bool = False) -> Any:
        """Plot the traces (needs matplotlib and Pillow); returns a ``PIL.Image`` when ``capture`` is true."""
        return compare_memory_traces_in_plot({"run": self.memory_traces}, figsize, capture)

    def save_traces(self, path: str) -> None:
        """Write the traces as JSON ``{"traces": [...]}``."""
        with open(path, "w") as f:
            json.dump({"traces": [t.to_dict() for t in self.memory_traces]}, f)

    @classmethod
    def load(cls, path: str) -> "LayerwiseMemoryTracker":
        """A tracker holding the traces saved by :meth:`save_traces` (``ValueError`` for any other file)."""
        tracker = cls()
        tracker.memory_traces = load_traces(path)
        return tracker

    # ---- hooks

    def _hooks_own(self, module: nn.Module) -> bool:
        """Whether ``module`` is one this tracker hooked: a ``copy.deepcopy`` of a monitored model (an EMA copy)
        copies the hooks too, which ``stop()`` cannot remove; its forwards were recorded as the model's, also in a
        later ``monitor()`` of another model."""
        hooked = self._monitored.get(id(module))
        return hooked is not None and hooked.module() is module

    def _create_pre_forward_hook(self, name: str) -> Callable[..., None]:
        def _pre_forward_hook(module: nn.Module, inputs: Any) -> None:
            if self._probe is None or not self._hooks_own(module):  # stopped (see _backward_hook), or a copy's
                return
            self._probe.sync()
            self._previous_module_name = name
            self._memory_pre_forward = self._probe.mark()
            if _is_fsdp(module):
                self._cumul_all_gather_memory.append(0)

        return _pre_forward_hook

    def _create_gather_scope_end(self) -> Callable[..., None]:
        def _gather_scope_end(module: nn.Module, inputs: Any, outputs: Any) -> None:
            if self._probe is None or not self._hooks_own(module):
                return
            if self._cumul_all_gather_memory:
                self._cumul_all_gather_memory.pop()

        return _gather_scope_end

    def _create_post_forward_hook(self, name: str) -> Callable[..., None]:
        def _post_forward_hook(module: nn.Module, inputs: Any, outputs: Any) -> None:
            if self._probe is None or not self._hooks_own(module):  # stopped (see _backward_hook), or a copy's
                return
            self._probe.sync()
            # Only a leaf as executed: no other module's pre-hook ran since this module's own.
            if self._previous_module_name == name:
                mark = self._probe.mark()
                trace = LayerMemoryTrace(
                    module_name=name,
                    module_params=tensor_bytes(list(module.parameters())),
                    allocated=0,
                    reserved=0,
                    is_forward=True,
                    all_gathered=self._last_all_gather_memory,
                    cumul_all_gathered=sum(self._cumul_all_gather_memory),
                    event=TraceForwardEvent(
                        memory_diff=0, memory_activations=tensor_bytes(new_tensors(outputs, inputs))
                    ),
                )
                self._append(trace, mark, self._memory_pre_forward)
                self._last_all_gather_memory = 0
                self._hook_backward(name, module, outputs)
            self._previous_module_name = None
            self._memory_pre_forward = None

        return _post_forward_hook

    def _hook_backward(self, name: str, module: nn.Module, outputs: Any) -> None:
        """Attach the backward trace of this traced forward call to the autograd node of its output.

        Where upstream's legacy module backward hook attaches it (the node of the output's first tensor), registered
        here per traced call instead of by torch for every module: torch's own walk to that tensor raised on outputs
        holding none (``None``, a number, ``(None, t)``), and a set of traced names made a container whose name was
        a leaf's in an earlier run get a backward trace.
        """
        tensor = first_output_tensor(outputs)
        node = tensor.grad_fn if tensor is not None else None
        if node is None:  # no gradient flows back through this output
            return
        hook = self._create_backward_hook(name, weakref.ref(module), self._session)
        node.register_hook(hook)

    def _create_backward_hook(
        self, name: str, module_ref: "weakref.ref[nn.Module]", session: int
    ) -> Callable[[Any, Any], None]:
        # The legacy hook's arguments: the node's gradients with respect to its inputs (grad_input) and its outputs.
        def _backward_hook(grad_input: Any, grad_output: Any) -> None:
            # A forward run while monitoring attached this hook to its graph: it still fires in a backward after
            # stop(), and after a later monitor(). That backward is not measured (it used to fail).
            if self._probe is None or session != self._session:
                return
            self._probe.sync()
            module = module_ref()  # held weakly: the graph must not keep a model alive
            # Upstream's value: the gradients this module receives (grad_output) that are not also among those it
            # passes on, as the forward counts the outputs that are not inputs.
            activations = tensor_bytes(new_tensors(grad_output, grad_input))
            trace = LayerMemoryTrace(
                module_name=name,
                module_params=tensor_bytes(list(module.parameters())) if module is not None else 0,
                allocated=0,
                reserved=0,
                is_forward=False,
                all_gathered=self._last_all_gather_memory,
                cumul_all_gathered=0,
                event=TraceBackwardEvent(memory_activations=activations),
            )
            self._append(trace, self._probe.mark(), None)
            self._last_all_gather_memory = 0

        return _backward_hook

    def _handle_process_group_call(self, event: ProcessGroupTrackingEvent, *args: Any) -> None:
        """All-gather listener: count the gathered bytes for the next trace and the enclosing FSDP module."""
        if self._probe is None:  # stopped: nothing is measured until the next monitor()
            return
        self._probe.sync()
        if event == ProcessGroupTrackingEvent.allgather:
            outputs, _ = args
            size = tensor_bytes(collect_tensors(outputs))
            self._last_all_gather_memory += size
            if self._cumul_all_gather_memory:
                self._cumul_all_gather_memory[-1] += size

    # ---- lazily measured memory

    def _append(self, trace: LayerMemoryTrace, mark: MemoryMark, pre_forward: Optional[MemoryMark]) -> None:
        self._traces.append(trace)
        self._pending.append(_Pending(len(self._traces) - 1, mark, pre_forward))

    def _resolve(self) -> None:
        if not self._pending or self._probe is None:
            return
        marks = [p.mark for p in self._pending] + [p.pre_forward for p in self._pending if p.pre_forward is not None]
        self._probe.resolve(marks)
        for index, mark, pre in self._pending:
            trace = self._traces[index]
            allocated, reserved = int(mark.allocated or 0), int(mark.reserved or 0)
            event = trace.event
            if trace.is_forward:
                before = int(pre.allocated or 0) if pre is not None else allocated
                event = event._replace(memory_diff=allocated - before)
            self._traces[index] = trace._replace(allocated=allocated, reserved=reserved, event=event)
        self._pending.clear()


@dataclass
class SuggestedCheckpoints:
    """Result of :func:`suggest_checkpoint_location`."""

    max_memory: int
    split_modules: List[str]
    all_modules: List[str]


def _check_count(what: str, value: Any) -> None:
    """Refuse a count that is not a non-negative int: -1 or 1.5 split after every layer, -1 layers skipped kept
    only the last one, all silently."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FairscaleValueError(f"{what} must be a non-negative int, got {value!r}")


def find_best_reset_points(activation_sizes: List[int], num_checkpoints: int) -> Tuple[int, List[int]]:
    """Split ``activation_sizes`` into at most ``num_checkpoints + 1`` contiguous segments minimising the largest sum.

    Args:
        activation_sizes: the activation bytes of each layer, in order.
        num_checkpoints: the number of split points allowed.

    Returns:
        ``(max_memory, split_points)``: the largest segment sum and the ascending exclusive end index of every
        segment but the last (``len(activation_sizes)`` may appear: an empty last segment). Ties keep the earliest
        split.
    """
    _check_count("find_best_reset_points: num_checkpoints", num_checkpoints)
    sizes = list(activation_sizes)
    for i, size in enumerate(sizes):
        # Byte counts: a negative one made an empty last segment look best, a NaN one made every comparison false.
        # numbers.Real: numpy's integers too (a list(np.array(...)) of sizes was refused as "not a number >= 0").
        if isinstance(size, bool) or not isinstance(size, numbers.Real) or not math.isfinite(size) or size < 0:
            raise ValueError(
                f"find_best_reset_points: activation_sizes[{i}] is {size!r}; sizes are byte counts (numbers >= 0)"
            )
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    # More split points than layers change nothing (each split takes at least one layer, or ends the search).
    k = min(num_checkpoints, n)
    # Bottom-up over the splits left (a top-down search recursed once per split: RecursionError past ~1000 layers).
    # value[start] and choice[start]: the best largest segment sum from ``start`` with the splits of this round, and
    # the end of its first segment (None: no split, one segment to the end).
    value = [prefix[n] - prefix[start] for start in range(n + 1)]
    choices: List[List[Optional[int]]] = [[None] * (n + 1)]
    for _ in range(k):
        new_value = list(value)
        choice: List[Optional[int]] = [None] * (n + 1)
        for start in range(n):
            best_value, best_end = None, None
            for end in range(start + 1, n + 1):
                candidate = max(prefix[end] - prefix[start], value[end])
                if best_value is None or candidate < best_value:  # strictly: ties keep the earliest split
                    best_value, best_end = candidate, end
            if best_value is not None:
                new_value[start], choice[start] = best_value, best_end
        value = new_value
        choices.append(choice)
    points: List[int] = []
    start, remaining = 0, k
    while remaining > 0 and start < n:
        first_end = choices[remaining][start]
        if first_end is None:
            break
        points.append(first_end)
        start, remaining = first_end, remaining - 1
    return value[0], points


def suggest_checkpoint_location(
    traces: List[LayerMemoryTrace], num_checkpoints: int, num_skipped_layers: int = 0
) -> SuggestedCheckpoints:
    """Suggest where to put ``num_checkpoints`` activation checkpoints to minimise the peak activation memory.

    Args:
        traces: the traces of a run (the first forward trace of each module is used).
        num_checkpoints: the number of checkpoints to place.
        num_skipped_layers: leading layers to leave out of the search.
    """
    _check_count("suggest_checkpoint_location: num_checkpoints", num_checkpoints)
    _check_count("suggest_checkpoint_location: num_skipped_layers", num_skipped_layers)
    visited: Set[str] = set()
    names: List[str] = []
    sizes: List[int] = []
    for t in traces:
        if t.is_forward and t.module_name not in visited:
            visited.add(t.module_name)
            names.append(t.module_name)
            sizes.append(t.event.memory_activations)
    names, sizes = names[num_skipped_layers:], sizes[num_skipped_layers:]
    max_memory, points = find_best_reset_points(sizes, num_checkpoints)
    return SuggestedCheckpoints(max_memory, [names[i] for i in points if i < len(names)], names)
