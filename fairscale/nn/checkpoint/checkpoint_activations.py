# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Activation checkpointing for any module: :func:`checkpoint_wrapper` and its thread-local flags.

How it works: the wrapped module's ``forward`` is replaced by one that runs the original forward
through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``. That implementation gives
fairscale's semantics exactly: the first pass runs under ``torch.no_grad()`` and keeps only the
inputs; during backward the forward runs again with grad enabled (replaying the RNG and autocast
state of the first pass) and a nested backward through that recomputed graph produces the
gradients. On top of torch's function this module adds what fairscale users rely on:

* keyword arguments and tensors nested in lists, tuples and dicts are real inputs (they get
  gradients), and outputs may be any nesting of those containers with non-tensor leaves;
* parameters get gradients even when no input requires grad;
* thread-local flags (:func:`is_checkpointing`, :func:`is_recomputing`) tell code inside the
  module (for instance a nested ``FullyShardedDataParallel``) which pass is running;
* batch-norm running statistics are updated once per step, not twice (see ``patch_batchnorm``);
* optional offload of the saved inputs to CPU memory between forward and backward.
"""

import contextlib
import copy
import inspect
import threading
import types
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from .checkpoint_utils import patch_batchnorm

__all__ = [
    "checkpoint_wrapper",
    "disable_checkpointing",
    "enable_checkpointing",
    "enable_recomputing",
    "is_checkpointing",
    "is_recomputing",
]


class _Flags(threading.local):
    """Per-thread flags. Backward may run on an autograd worker thread, and the recomputation
    sets and reads its flag on that same thread, so thread-local state is the right scope."""

    def __init__(self) -> None:
        self.is_checkpointing = False
        self.is_recomputing = False
        self.is_checkpointing_disabled = False


_flags = _Flags()

_ModuleT = TypeVar("_ModuleT", bound=nn.Module)


@contextlib.contextmanager
def _set_flag(name: str, value: bool) -> Iterator[None]:
    previous = getattr(_flags, name)
    setattr(_flags, name, value)
    try:
        yield
    finally:
        setattr(_flags, name, previous)


def disable_checkpointing() -> contextlib.AbstractContextManager[None]:
    """Context manager: inside it, checkpoint-wrapped modules run as plain modules (no recomputation)."""
    return _set_flag("is_checkpointing_disabled", True)


def enable_checkpointing() -> contextlib.AbstractContextManager[None]:
    """Context manager: :func:`is_checkpointing` returns ``True`` inside it (set during the first pass)."""
    return _set_flag("is_checkpointing", True)


def enable_recomputing() -> contextlib.AbstractContextManager[None]:
    """Context manager: :func:`is_recomputing` returns ``True`` inside it (set during the recomputation)."""
    return _set_flag("is_recomputing", True)


def is_checkpointing() -> bool:
    """Whether the current thread is in the first (no-grad) forward pass of a checkpointed module.

    Returns:
        bool: ``True`` while a checkpoint-wrapped module runs its first forward.
    """
    return _flags.is_checkpointing


def is_recomputing() -> bool:
    """Whether the current thread is re-running a checkpointed forward during backward.

    Returns:
        bool: ``True`` while a checkpoint-wrapped module recomputes its forward in backward.
    """
    return _flags.is_recomputing


def checkpoint_wrapper(module: _ModuleT, offload_to_cpu: bool = False) -> _ModuleT:
    """Checkpoint the activations of ``module``: keep only its inputs and recompute in backward.

    The module is changed in place (its ``forward`` is replaced and its batch-norm layers are
    patched) and returned, so the usual pattern is ``self.block = checkpoint_wrapper(Block())``.
    The wrapped module accepts the same arguments and returns the same structure as before:
    positional and keyword arguments, tensors nested in lists/tuples/dicts, and outputs with
    non-tensor values all work. Random operations (dropout) and autocast are replayed exactly,
    so gradients equal those of the unwrapped module. Batch-norm running statistics are updated
    once per step, during the recomputation.

    Checkpointing is skipped (the original forward runs directly) when grad is disabled, inside
    :func:`disable_checkpointing`, and when neither an input nor a parameter of the module
    requires grad (then autograd keeps nothing, so there is nothing to save).

    Args:
        module (nn.Module): the module to checkpoint. It may be, or contain, a
            ``FullyShardedDataParallel`` instance; such code can consult :func:`is_recomputing`.
        offload_to_cpu (bool): keep the saved inputs in CPU memory between forward and backward
            and copy them back to their device for the recomputation. Default: ``False``.

    Returns:
        nn.Module: ``module`` itself, now checkpointed.

    Example::

        >>> block = checkpoint_wrapper(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)))
        >>> block(torch.randn(4, 8, requires_grad=True)).sum().backward()
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_wrapper expects an nn.Module, got {type(module).__name__}")
    if not isinstance(offload_to_cpu, bool):
        raise TypeError(f"checkpoint_wrapper: offload_to_cpu must be a bool, got {offload_to_cpu!r}")
    patch_batchnorm(module)
    setattr(module, "forward", _CheckpointedForward(module, module.forward, offload_to_cpu))
    return module


class _CheckpointedForward:
    """The ``forward`` installed on a checkpointed module.

    It refers to its module only through a weak reference: a strong one would form the cycle
    module -> forward -> module, which keeps the module and its parameters alive until the
    cyclic garbage collector happens to run. Pickling and ``copy.deepcopy`` rebuild it around
    the new module (see ``__reduce__``).
    """

    def __init__(self, module: nn.Module, forward: Callable[..., Any], offload_to_cpu: bool) -> None:
        self._module_ref = weakref.ref(module)
        # A bound method of the module itself would hold the module strongly; keep the plain
        # function and pass the module at call time instead.
        self._takes_module = inspect.ismethod(forward) and forward.__self__ is module
        self._forward: Callable[..., Any] = getattr(forward, "__func__") if self._takes_module else forward
        self.offload_to_cpu = offload_to_cpu

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module_ref()
        if module is None:
            raise RuntimeError(
                "The module of this checkpointed forward has been garbage collected; call the module "
                "itself instead of keeping a reference to its forward method."
            )
        forward = types.MethodType(self._forward, module) if self._takes_module else self._forward
        return _checkpointed_forward(forward, module, self.offload_to_cpu, args, kwargs)

    def __reduce__(self) -> Tuple[Callable[..., "_CheckpointedForward"], Tuple[Any, ...]]:
        # While pickling/copying a module, the module is memoized before its ``__dict__`` (which
        # holds this object) is saved, so referring to it here does not recurse.
        return (
            _rebuild_checkpointed_forward,
            (self._module_ref(), self._forward, self._takes_module, self.offload_to_cpu),
        )


def _rebuild_checkpointed_forward(
    module: nn.Module, forward: Callable[..., Any], takes_module: bool, offload_to_cpu: bool
) -> _CheckpointedForward:
    if takes_module:
        forward = types.MethodType(forward, module)
    return _CheckpointedForward(module, forward, offload_to_cpu)


def _checkpointed_forward(
    forward: Callable[..., Any],
    module: nn.Module,
    offload_to_cpu: bool,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
) -> Any:
    if not torch.is_grad_enabled() or _flags.is_checkpointing_disabled:
        return forward(*args, **kwargs)
    input_tensors, input_spec = _flatten((args, kwargs))
    if not _may_need_grad(module, input_tensors):
        # With nothing requiring grad autograd saves no activations, so checkpointing would only
        # cost a second forward (and would skip the batch-norm statistics update of this step).
        return forward(*args, **kwargs)

    run = _RunForward(forward, input_spec)
    # torch's reentrant checkpoint only tracks gradients if one of its inputs requires grad; the
    # parameters used inside are invisible to it, so this empty tensor stands in for them.
    grad_anchor = torch.empty((0,), requires_grad=True)
    offload = _offload_saved_tensors() if offload_to_cpu else contextlib.nullcontext()
    with offload:
        output_tensors = torch_checkpoint(run, grad_anchor, *input_tensors, use_reentrant=True, preserve_rng_state=True)
    assert run.output_spec is not None  # set by the first pass, which has run by now
    return _unflatten(run.output_spec, list(output_tensors))


class _RunForward:
    """The function handed to torch's checkpoint: unpacks the flat tensor inputs, runs the module's
    forward under the flag of the current pass, and returns the output tensors as a flat tuple."""

    def __init__(self, forward: Callable[..., Any], input_spec: Any) -> None:
        self.forward = forward
        self.input_spec = input_spec
        # Structure (and non-tensor values) of the first pass's output; recomputed non-tensor
        # outputs are discarded, as the caller already has those.
        self.output_spec: Optional[Any] = None
        self.num_output_tensors = 0

    def __call__(self, _grad_anchor: torch.Tensor, *input_tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        args, kwargs = _unflatten(self.input_spec, list(input_tensors))
        first_pass = self.output_spec is None
        with enable_checkpointing() if first_pass else enable_recomputing():
            outputs = self.forward(*args, **kwargs)
        output_tensors, output_spec = _flatten(outputs)
        if first_pass:
            self.output_spec = output_spec
            self.num_output_tensors = len(output_tensors)
        elif len(output_tensors) != self.num_output_tensors:
            raise RuntimeError(
                f"checkpoint_wrapper: the recomputed forward returned {len(output_tensors)} tensors but the "
                f"first forward returned {self.num_output_tensors}; a checkpointed forward must be "
                "deterministic in its output structure."
            )
        return tuple(output_tensors)


def _may_need_grad(module: nn.Module, input_tensors: List[torch.Tensor]) -> bool:
    """Whether anything the forward can see requires grad: an input, a parameter, or a plain tensor
    attribute (``FlattenParamsWrapper`` replaces parameters by such views and also lists them in
    ``_unflattened_param_views``)."""
    if any(t.requires_grad for t in input_tensors):
        return True
    if any(p.requires_grad for p in module.parameters()):
        return True
    for sub in module.modules():
        views = getattr(sub, "_unflattened_param_views", None) or []
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in views):
            return True
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in vars(sub).values()):
            return True
    return False


def _offload_saved_tensors() -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks that move the checkpoint's saved inputs to CPU memory until backward needs them.

    Non-blocking copies are safe here: the copy back is issued on the same stream as the copy out,
    so it is ordered after it, and nothing reads the CPU copy on the host.
    """

    def pack(tensor: torch.Tensor) -> Tuple[Optional[torch.device], torch.Tensor]:
        if tensor.device.type == "cpu":
            return None, tensor
        return tensor.device, tensor.to("cpu", non_blocking=True)

    def unpack(packed: Tuple[Optional[torch.device], torch.Tensor]) -> torch.Tensor:
        device, tensor = packed
        return tensor if device is None else tensor.to(device, non_blocking=True)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class _Slot:
    """Placeholder for the i-th tensor in a flattened structure."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _map_structure(obj: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool]) -> Any:
    """Rebuild ``obj`` (nested tuples, namedtuples, lists and dicts) with ``fn`` applied to its leaves
    for which ``is_leaf`` holds; every other value is kept as is."""
    if is_leaf(obj):
        return fn(obj)
    if isinstance(obj, tuple):
        items = [_map_structure(x, fn, is_leaf) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [_map_structure(x, fn, is_leaf) for x in obj]
    if isinstance(obj, dict):
        # A shallow copy keeps the dict's type and extra state (OrderedDict, model-output classes).
        new = copy.copy(obj)
        for key, value in obj.items():
            new[key] = _map_structure(value, fn, is_leaf)
        return new
    return obj


def _flatten(obj: Any) -> Tuple[List[torch.Tensor], Any]:
    """Split ``obj`` into its tensors (in traversal order) and a spec with a ``_Slot`` for each."""
    tensors: List[torch.Tensor] = []

    def to_slot(t: torch.Tensor) -> _Slot:
        tensors.append(t)
        return _Slot(len(tensors) - 1)

    spec = _map_structure(obj, to_slot, lambda x: isinstance(x, torch.Tensor))
    return tensors, spec


def _unflatten(spec: Any, tensors: List[torch.Tensor]) -> Any:
    """Inverse of :func:`_flatten`."""
    return _map_structure(spec, lambda slot: tensors[slot.index], lambda x: isinstance(x, _Slot))
