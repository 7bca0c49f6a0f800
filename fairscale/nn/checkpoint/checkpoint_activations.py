# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Activation checkpointing for any module: :func:`checkpoint_wrapper` and its thread-local flags.

How it works: the wrapped module's ``forward`` is replaced by one that runs the original forward
through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``. That implementation gives
fairscale's semantics exactly: the first pass runs under ``torch.no_grad()`` and keeps only the
inputs; during backward the forward runs again with grad enabled (replaying the RNG and autocast
state of the first pass) and a nested backward through that recomputed graph produces the
gradients. On top of torch's function this module adds what fairscale users rely on:

* keyword arguments and tensors nested in lists, tuples, dicts and dataclass instances are real inputs
  (they get gradients), and outputs may be any nesting of those containers with non-tensor leaves (a generator
  is consumed in the pass and returned as a tuple);
* parameters get gradients even when no input requires grad;
* thread-local flags (:func:`is_checkpointing`, :func:`is_recomputing`) tell code inside the
  module (for instance a nested ``FullyShardedDataParallel``) which pass is running;
* batch-norm running statistics are updated once per step, not twice (see ``patch_batchnorm``). The update
  happens in the recomputation, which backward runs in reverse order: a wrapped module called twice in a step
  updates them with its second call's batch first (as upstream; momentum makes the order matter);
* the recomputation replays each submodule's ``training`` flag of the first pass (torch's does not), so a
  ``train()``/``eval()`` switch between a forward and its backward changes neither gradients nor statistics;
* optional offload of the saved inputs to CPU memory between forward and backward.
"""

import contextlib
import dataclasses
import inspect
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from fairscale.internal.containers import pack_kwargs, split_non_tensors, unpack_kwargs, unpack_non_tensors

from fairscale.internal import device
from fairscale.internal.errors import FairscaleTypeError, FairscaleValueError
from ._outputs import _aliases, _warn_about_tensors_stored_in_arguments, _warn_create_graph
from ._grad_need import _may_need_grad
from ._recomputation_hooks import run_recomputation_hooks
from ._structure import ObjectWalk, _flatten, _map_structure, _unflatten, output_walk
from ._rng_sources import captured_rng_sources, replaying_rng_sources
from ._training_flags import TrainingFlags, replay_training_flags, training_flags_of
from .checkpoint_utils import (
    own_forward_without_stats,
    patch_batchnorm,
    patch_batchnorm_while,
)  # noqa: F401 (upstream name)

__all__ = [
    "CheckpointFunction",
    "ThreadLocalCheckpointingState",
    "autocast",
    "get_rng_state",
    "is_autocast_enabled",
    "pack_kwargs",
    "set_rng_state",
    "split_non_tensors",
    "thread_local",
    "unpack_kwargs",
    "unpack_non_tensors",
    "checkpoint_wrapper",
    "disable_checkpointing",
    "enable_checkpointing",
    "enable_recomputing",
    "is_checkpointing",
    "is_recomputing",
]


@dataclasses.dataclass
class ThreadLocalCheckpointingState(threading.local):
    """Per-thread checkpointing flags (the type of :data:`thread_local`).

    Backward may run on an autograd worker thread, and the recomputation sets and reads its flag on that same
    thread, so thread-local state is the right scope. Read the flags with :func:`is_checkpointing` and
    :func:`is_recomputing`; set them with the context managers of this module.

    Attributes:
        is_checkpointing (bool): in the first (no-grad) forward of a checkpointed module.
        is_recomputing (bool): in the recomputation of a checkpointed forward during backward.
        is_checkpointing_disabled (bool): inside :func:`disable_checkpointing`.
    """

    is_checkpointing: bool = False
    is_recomputing: bool = False
    is_checkpointing_disabled: bool = False


#: The flags of the current thread (upstream's name).
thread_local = ThreadLocalCheckpointingState()
_flags = thread_local

_ModuleT = TypeVar("_ModuleT", bound=nn.Module)


class _CallStash(threading.local):
    """The stashes of the checkpointed calls whose forwards (first pass or recomputation) run on this thread, outer
    first (a checkpointed call inside another one's recomputation makes two)."""

    def __init__(self) -> None:
        self.stack: List[Dict[Any, Any]] = []


_call_stash = _CallStash()


# Set in a call's stash once its recomputation completed: a retained graph's second backward recomputes it again.
_RECOMPUTED = object()


def _statistics_counted_already() -> bool:
    """Whether the batch-norm layers of the checkpointed call running now must leave their running statistics alone:
    in its no-grad first pass, and in a recomputation after the first (``backward(retain_graph=True)`` twice updated
    them once per backward, where the plain module updates them once per forward)."""
    if is_checkpointing():
        return True
    stack = _call_stash.stack
    return is_recomputing() and bool(stack) and _RECOMPUTED in stack[-1]


def current_call_stash() -> Optional[Dict[Any, Any]]:
    """A dict that belongs to the checkpointed call running now, the same object in its first pass and in its
    recomputation (``None`` outside a :func:`checkpoint_wrapper` forward).

    For layers that compute something once in the first pass and reuse it when the call is recomputed
    (``SyncBatchNorm``'s statistics). It lives as long as that call's autograd graph: a forward whose backward never
    runs leaves nothing behind, and two checkpointed calls never see each other's values, whatever order backward
    recomputes them in.
    """
    stack = _call_stash.stack
    return stack[-1] if stack else None


def enclosing_call_stash() -> Optional[Dict[Any, Any]]:
    """The stash of the checkpointed call around the current one (``None`` if there is none).

    A checkpointed call nested in another runs its first pass plainly inside the outer call's first pass (no grad
    there), and for real inside the outer call's recomputation: what its layers computed in the outer first pass is
    in the enclosing call's stash.
    """
    stack = _call_stash.stack
    return stack[-2] if len(stack) > 1 else None


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


def checkpoint_wrapper(module: _ModuleT, offload_to_cpu: Any = False) -> _ModuleT:
    """Checkpoint the activations of ``module``: keep only its inputs and recompute in backward.

    The module is changed in place (its ``forward`` is replaced and its batch-norm layers are
    patched) and returned, so the usual pattern is ``self.block = checkpoint_wrapper(Block())``.
    The wrapped module accepts the same arguments and returns the same structure as before:
    positional and keyword arguments, tensors nested in lists/tuples/dicts, and outputs with
    non-tensor values all work. Random operations (dropout, also under the model-parallel RNG tracker's
    ``fork()``), autocast and each submodule's
    ``training`` flag are replayed exactly (an ``eval()`` between the forward and its backward changes
    nothing), so gradients equal those of the unwrapped module. Batch-norm running statistics are updated
    once per step, during the recomputation, if the forward ran in training mode.

    Checkpointing is skipped (the original forward runs directly) when grad is disabled, inside
    :func:`disable_checkpointing`, and when neither an input nor a parameter of the module
    requires grad (then autograd keeps nothing, so there is nothing to save).

    Args:
        module (nn.Module): the module to checkpoint. It may be, or contain, a
            ``FullyShardedDataParallel`` instance; such code can consult :func:`is_recomputing`.
        offload_to_cpu (bool): keep the saved inputs in CPU memory between forward and backward
            and copy them back to their device for the recomputation. Default: ``False``. Other values
            are taken by their truth, as upstream does, with a ``DeprecationWarning``.

    Returns:
        nn.Module: ``module`` itself, now checkpointed.

    Example::

        >>> block = checkpoint_wrapper(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)))
        >>> block(torch.randn(4, 8, requires_grad=True)).sum().backward()
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_wrapper expects an nn.Module, got {type(module).__name__}")
    if not isinstance(offload_to_cpu, bool):
        # Upstream takes any value by its truth (code written for an older signature may pass something else
        # positionally); keep accepting it, but say so.
        warnings.warn(
            f"checkpoint_wrapper: offload_to_cpu should be a bool, got {type(offload_to_cpu).__name__}; "
            f"using bool({offload_to_cpu!r}) = {bool(offload_to_cpu)}",
            DeprecationWarning,
            stacklevel=2,
        )
        offload_to_cpu = bool(offload_to_cpu)
    patch_batchnorm_while(module, _statistics_counted_already)
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

    run = _RunForward(forward, input_spec, (args, kwargs), input_tensors, module)
    # torch's reentrant checkpoint only tracks gradients if one of its inputs requires grad; the
    # parameters used inside are invisible to it, so this empty tensor stands in for them.
    grad_anchor = torch.empty((0,), requires_grad=True)
    offload = _offload_saved_tensors() if offload_to_cpu else contextlib.nullcontext()
    with offload:
        output_tensors = torch_checkpoint(run, grad_anchor, *input_tensors, use_reentrant=True, preserve_rng_state=True)
    for t in output_tensors:
        if t.requires_grad:
            t.register_hook(_warn_create_graph)
    return _unflatten(run.output_spec, list(output_tensors), run.output_walk)


class _RunForward:
    """The function handed to torch's checkpoint: unpacks the flat tensor inputs, runs the module's
    forward under the flag of the current pass, and returns the output tensors as a flat tuple."""

    def __init__(
        self,
        forward: Callable[..., Any],
        input_spec: Any,
        caller_arguments: Tuple[Tuple[Any, ...], Dict[str, Any]],
        caller_tensors: List[torch.Tensor],
        module: Optional[nn.Module] = None,
    ) -> None:
        self.forward = forward
        self.module = module  # the checkpointed module, whose forward this calls directly (its hooks do not run)
        self.input_spec = input_spec
        # The first pass gets the caller's own arguments, containers and all (rebuilt from the spec, a list holding a
        # tensor would be a copy, and what the forward appends to it would not reach the caller), as long as torch
        # hands it the caller's tensors themselves (its reentrant checkpoint does). Dropped after that pass.
        self.caller_arguments: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]] = caller_arguments
        self.caller_tensors: List[torch.Tensor] = caller_tensors
        # The recomputation runs on the arguments as they were before the first pass: that pass gets the caller's
        # own containers (its writes reach the caller, once, as without checkpointing), and a forward that consumes
        # an argument (opts.pop("scale")) must not recompute another function from what the first pass left.
        self.recompute_spec = _map_structure(input_spec, lambda x: x, lambda x: False, always_copy=True)
        # Structure (and non-tensor values) of the first pass's output; recomputed non-tensor
        # outputs are discarded, as the caller already has those. A forward may return None: whether the first
        # pass ran is its own flag.
        self.first_pass_done = False
        self.output_spec: Any = None
        self.output_walk: Optional[ObjectWalk] = None  # which plain objects of the output are walked (_structure)
        self.num_output_tensors = 0
        self.stash: Dict[Any, Any] = {}  # see current_call_stash
        # Recorded at the forward, replayed by the recomputation: a switch to eval() (or train()) before backward
        # recomputed dropout and batch norm in the new mode, with other gradients and statistics than the forward's.
        self.training_flags: TrainingFlags = training_flags_of(module) if module is not None else ()
        self.rng_sources = captured_rng_sources()  # torch's checkpoint replays only its own generators
        enclosing = current_call_stash()
        if is_recomputing() and enclosing is not None and _RECOMPUTED in enclosing:
            # A call made inside a retained graph's second recomputation of the call around it is a new call with a
            # new stash, but the step already counted its batch-norm statistics in the first one.
            self.stash[_RECOMPUTED] = True

    def __call__(self, _grad_anchor: torch.Tensor, *input_tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        first_pass = not self.first_pass_done
        caller, caller_tensors = self.caller_arguments, self.caller_tensors
        self.caller_arguments, self.caller_tensors = None, []
        same_tensors = len(input_tensors) == len(caller_tensors) and all(
            a is b for a, b in zip(input_tensors, caller_tensors)
        )
        if first_pass and caller is not None and same_tensors:
            args, kwargs = caller
        else:
            args, kwargs = _unflatten(self.input_spec if first_pass else self.recompute_spec, list(input_tensors))
        _call_stash.stack.append(self.stash)
        # Entered first, so the flags are in place before the batch-norm guards read them: a layer updates its
        # statistics in the recomputation of a training-mode forward only, whatever its mode at backward time.
        replay = replay_training_flags(() if first_pass else self.training_flags)
        try:
            own_stats = (
                own_forward_without_stats(self.module, _statistics_counted_already)
                if self.module is not None
                else contextlib.nullcontext()
            )
            rng = contextlib.nullcontext() if first_pass else replaying_rng_sources(self.rng_sources)
            walk = output_walk((args, kwargs), self.module)  # before the forward: its new objects are walked
            with replay, rng, enable_checkpointing() if first_pass else enable_recomputing(), own_stats:
                outputs = self.forward(*args, **kwargs)
                if isinstance(outputs, types.GeneratorType):
                    # A forward written as a generator runs its body only when consumed: left lazy, it would run
                    # after the checkpoint, unchecked, and the recomputation would have nothing to return. It is
                    # run here, in this pass, and the caller gets a tuple (upstream's type for it too).
                    outputs = tuple(outputs)
        finally:
            _call_stash.stack.pop()
        if not first_pass:
            self.stash[_RECOMPUTED] = True
        if first_pass:
            _warn_about_tensors_stored_in_arguments(self.forward, (args, kwargs), input_tensors)
        output_tensors, output_spec = _flatten(outputs, walk)
        if first_pass:
            self.first_pass_done = True
            self.output_spec, self.output_walk = output_spec, walk
            self.num_output_tensors = len(output_tensors)
            # The checkpoint's autograd function makes its outputs its own (it sets their grad_fn). A tensor the
            # forward returns as it is, a parameter or a buffer of the module, would be changed in place: a
            # parameter stopped being a leaf and backward called the checkpoint's node over and over (a hang). An
            # alias of each output is what the caller gets instead; the recomputation returns the real tensors,
            # so a returned parameter still gets its gradient.
            return _aliases(output_tensors)
        if len(output_tensors) != self.num_output_tensors:
            raise RuntimeError(
                f"checkpoint_wrapper: the recomputed forward returned {len(output_tensors)} tensors but the "
                f"first forward returned {self.num_output_tensors}; a checkpointed forward must be "
                "deterministic in its output structure."
            )
        if self.module is not None:
            run_recomputation_hooks(self.module, output_tensors)
        return tuple(output_tensors)


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


# ---------------------------------------------------------------------------------------------------------------
# Upstream's building blocks, kept for code that uses them directly. checkpoint_wrapper itself relies on torch's
# reentrant checkpoint (above), which implements the same protocol.


def get_rng_state() -> Dict[str, Any]:
    """The RNG states a checkpointed forward replays: the CPU generator's, plus the current accelerator's.

    Returns:
        Dict[str, Any]: ``{"torch_rng_state": Tensor}``, plus ``"cuda_rng_state"`` (``"<type>_rng_state"`` for
        other accelerators) when an accelerator is available.
    """
    state: Dict[str, Any] = {"torch_rng_state": torch.get_rng_state()}
    accelerator = device.current_accelerator_device()
    if accelerator is not None:
        state[f"{accelerator.type}_rng_state"] = device.rng_get_state(accelerator)
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore RNG states returned by :func:`get_rng_state`.

    Args:
        state (Dict[str, Any]): the dict :func:`get_rng_state` returned (accelerator entries are skipped on a
            machine without that accelerator).
    """
    if not isinstance(state, dict) or "torch_rng_state" not in state:
        raise FairscaleValueError("set_rng_state: expected the dict returned by get_rng_state()")
    torch.set_rng_state(state["torch_rng_state"])
    accelerator = device.current_accelerator_device()
    key = f"{accelerator.type}_rng_state" if accelerator is not None else None
    if accelerator is not None and key in state:
        device.rng_set_state(state[key], accelerator)


def is_autocast_enabled() -> bool:
    """Whether autocast is on for the current accelerator (``False`` on a machine without one, as upstream)."""
    accelerator = device.current_accelerator_device()
    if accelerator is None:
        return False
    try:
        return bool(torch.is_autocast_enabled(accelerator.type))
    except TypeError:  # torch < 2.4: no device argument, the answer is CUDA's
        return bool(torch.is_autocast_enabled())


@contextlib.contextmanager
def autocast(enabled: bool) -> Iterator[None]:
    """Context manager: accelerator autocast on or off (a no-op on a machine without an accelerator).

    Args:
        enabled (bool): the autocast state inside the context.
    """
    accelerator = device.current_accelerator_device()
    if accelerator is None:
        yield
        return
    with torch.autocast(device_type=accelerator.type, enabled=enabled):
        yield


class CheckpointFunction(torch.autograd.Function):
    """Upstream's autograd function for checkpointing a module's forward (the protocol, for direct callers).

    Call it as ``CheckpointFunction.apply(dummy, forward, parent_ctx_dict, kwarg_keys, *flat_args)``:

    * ``dummy``: a tensor that requires grad (``torch.tensor([], requires_grad=True)``), so that autograd calls
      the backward even when no input requires grad;
    * ``forward``: the module's *unbound* forward; ``flat_args[0]`` is the module (see :func:`pack_kwargs`:
      ``kwarg_keys, flat_args = pack_kwargs(module, *args, **kwargs)``);
    * ``parent_ctx_dict``: a dict with key ``"offload"`` (bool: keep the saved tensor inputs on the CPU). The
      function adds ``"output_requires_grad"`` (whether a parameter or input requires grad; if not, detach the
      outputs) and, for non-tensor outputs, ``"packed_non_tensor_outputs"`` for :func:`unpack_non_tensors`.

    It returns the output tensor, or the tuple of output tensors. The first pass runs without grad under
    :func:`is_checkpointing`; backward re-runs the forward with the first pass's RNG and autocast state (and, when
    ``flat_args[0]`` is a module, its submodules' ``training`` flags) under :func:`is_recomputing` and
    back-propagates through it.
    """

    @staticmethod
    def forward(
        ctx: Any,
        dummy_tensor_requires_grad: torch.Tensor,
        run_function: Callable[..., Any],
        parent_ctx_dict: Dict[str, Any],
        kwarg_keys: Tuple[str, ...],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if kwargs:
            raise FairscaleTypeError("CheckpointFunction: pass keyword arguments through pack_kwargs and kwarg_keys")
        if "offload" not in parent_ctx_dict:
            raise FairscaleValueError("CheckpointFunction: parent_ctx_dict needs an 'offload' entry (bool)")
        ctx.run_function, ctx.kwarg_keys = run_function, kwarg_keys
        ctx.fwd_rng_state = get_rng_state()
        ctx.had_autocast_in_fwd = is_autocast_enabled()
        tensor_inputs, ctx.packed_non_tensor_inputs = split_non_tensors(args)
        ctx.input_devices = tuple(t.device for t in tensor_inputs)
        ctx.input_requires_grad = tuple(t.requires_grad for t in tensor_inputs)
        if parent_ctx_dict["offload"]:
            tensor_inputs = tuple(t.to("cpu", non_blocking=True) for t in tensor_inputs)
        ctx.save_for_backward(*tensor_inputs)
        call_args, call_kwargs = unpack_kwargs(kwarg_keys, args)
        module = call_args[0] if call_args else None
        # Replayed by the recomputation, as checkpoint_wrapper does (an eval() before backward changed the gradients).
        ctx.training_flags = training_flags_of(module) if isinstance(module, nn.Module) else ()
        ctx.rng_sources = captured_rng_sources()
        with torch.no_grad(), enable_checkpointing():
            outputs = run_function(*call_args, **call_kwargs)
        params_need_grad = isinstance(module, nn.Module) and _may_need_grad(module, [])
        parent_ctx_dict["output_requires_grad"] = params_need_grad or any(ctx.input_requires_grad)
        if isinstance(outputs, torch.Tensor):
            return outputs
        outputs, parent_ctx_dict["packed_non_tensor_outputs"] = split_non_tensors(tuple(outputs))
        return outputs

    @staticmethod
    def backward(ctx: Any, *args: Any) -> Tuple[Optional[torch.Tensor], ...]:
        grad_outputs = args  # upstream's parameter name
        if not torch.autograd._is_checkpoint_valid():  # type: ignore[no-untyped-call]
            raise RuntimeError("CheckpointFunction: checkpointing is not compatible with .grad(); use .backward()")
        inputs = []
        for saved, dev, needs_grad in zip(ctx.saved_tensors, ctx.input_devices, ctx.input_requires_grad):
            inputs.append(saved.to(dev, non_blocking=True).detach().requires_grad_(needs_grad))
        flat_args = unpack_non_tensors(tuple(inputs), ctx.packed_non_tensor_inputs)
        call_args, call_kwargs = unpack_kwargs(ctx.kwarg_keys, flat_args)
        backward_rng_state = get_rng_state()
        set_rng_state(ctx.fwd_rng_state)
        try:
            with torch.enable_grad(), enable_recomputing(), autocast(ctx.had_autocast_in_fwd):
                with replay_training_flags(ctx.training_flags), replaying_rng_sources(ctx.rng_sources):
                    outputs = ctx.run_function(*call_args, **call_kwargs)
        finally:
            set_rng_state(backward_rng_state)
        output_tensors, _ = split_non_tensors(outputs if isinstance(outputs, torch.Tensor) else tuple(outputs))
        pairs = [(o, g) for o, g in zip(output_tensors, grad_outputs) if o.requires_grad and g is not None]
        if not pairs:
            raise RuntimeError("CheckpointFunction: none of the recomputed outputs requires grad")
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = (t.grad if isinstance(t, torch.Tensor) else None for t in flat_args)
        return (None, None, None, None) + tuple(input_grads)
