# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Model-parallel RNG: named generator states, seeding, and an activation checkpoint that restores them.

Dropout inside a model-parallel region (e.g. on a :class:`ColumnParallelLinear` output that is not
gathered) must draw *different* masks on the ranks of a model-parallel group and the *same* masks
across data-parallel replicas; dropout outside must draw the same mask everywhere. The tracker keeps
a second generator state under the name ``"model-parallel-rng"`` and :meth:`CudaRNGStatesTracker.fork`
swaps it in for the duration of a block.

The names are upstream's (``cuda`` in them), but the states are those of the *device RNG*: the
default generator of the current accelerator, or the CPU generator on a machine without one (see
:func:`fairscale.internal.device.rng_device`), so all of this also works on CPU.
"""

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Set, Tuple, Union, cast

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import detach_variable
from torch.utils.hooks import RemovableHandle

from fairscale.internal import device as device_layer
from fairscale.nn.checkpoint._rng_sources import register_rng_source
from fairscale.nn.checkpoint._grad_need import _may_need_grad
from fairscale.nn.checkpoint.checkpoint_utils import _is_patched_kind, _RunningStatsGuard

from .initialize import get_data_parallel_rank, get_model_parallel_rank

__all__ = [
    "CudaRNGStatesTracker",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "CheckpointFunction",
    "checkpoint",
]

# Name of the tracked state that model-parallel regions draw from.
_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


def _resolve_device(device: Union[int, str, torch.device]) -> Any:
    """Upstream's device argument: ``-1`` = the default RNG device, an int = that accelerator index."""
    if isinstance(device, int):
        if device == -1:
            return None
        current = device_layer.current_accelerator_device()
        # Without an accelerator an index can only mean the one device RNG there is, the CPU's.
        return torch.device(current.type, device) if current is not None else None
    return torch.device(device)


def _set_cuda_rng_state(new_state: Tensor, device: Union[int, str, torch.device] = -1) -> None:
    """Restore the device RNG to ``new_state`` (``new_state`` is not modified).

    Args:
        new_state (Tensor): a state from :func:`fairscale.internal.device.rng_get_state`.
        device (Union[int, str, torch.device]): ``-1`` (default) for the current accelerator, or the CPU
            without one; an int is an accelerator index; a string or device names the device.
    """
    device_layer.rng_set_state(new_state, _resolve_device(device))


def _get_rng_state() -> Tensor:
    return device_layer.rng_get_state()


class CudaRNGStatesTracker:
    """Named device-RNG states, used one at a time through :meth:`fork`.

    Each state is seeded once by :meth:`add`; a fork continues its stream where the previous fork
    of the same name stopped, and never advances the default stream.
    """

    def __init__(self) -> None:
        self.states_: Dict[str, Tensor] = {}
        self.seeds_: Set[int] = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, Tensor]:
        """A new dict holding the current states (the state tensors are shared, never modified)."""
        return dict(self.states_)

    def set_states(self, states: Dict[str, Tensor]) -> None:
        """Replace the states by ``states`` (e.g. from :meth:`get_states`)."""
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Create the state ``name`` seeded with ``seed``; the default stream is left where it was.

        Raises:
            Exception: the seed or the name is already used (upstream's type and texts; as upstream,
                the seed counts as used even when the name check then fails).
        """
        if seed in self.seeds_:
            raise Exception("seed {} already exists".format(seed))
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception("cuda rng state {} already exists".format(name))
        orig_rng_state = _get_rng_state()
        device_layer.rng_manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_cuda_rng_state(orig_rng_state)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Draw from the state ``name`` inside the block; the default stream resumes afterwards.

        Raises:
            Exception: ``name`` was not added.
        """
        if name not in self.states_:
            raise Exception("cuda rng state {} is not added".format(name))
        orig_rng_state = _get_rng_state()
        _set_cuda_rng_state(self.states_[name])
        try:
            yield
        finally:
            # Keep the advanced state so the next fork continues this stream.
            self.states_[name] = _get_rng_state()
            _set_cuda_rng_state(orig_rng_state)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()
# checkpoint_wrapper's recomputation replays the tracker's streams, as this module's checkpoint() does (its forks
# drew new dropout masks there). get_states() is a new dict of immutable state tensors; set_states keeps a copy.
register_rng_source(_CUDA_RNG_STATE_TRACKER.get_states, lambda states: _CUDA_RNG_STATE_TRACKER.set_states(dict(states)))


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide tracker."""
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default device RNG with ``seed`` and the tracked model-parallel state with ``seed + 2718 + mp_rank``.

    Call it with the same ``seed`` on every rank: the default stream is then the same everywhere,
    and the model-parallel stream differs between the ranks of a model-parallel group and agrees
    across data-parallel replicas. Upstream does nothing here without CUDA; this port seeds the CPU
    generator instead (see the differences page).

    Raises:
        AssertionError: model parallel is not initialised (:func:`initialize_model_parallel`).
    """
    offset = seed + 2718
    model_parallel_seed = offset + get_model_parallel_rank()
    data_parallel_seed = seed
    if torch.distributed.get_rank() == 0:
        print(
            "> initializing model parallel cuda seeds on global rank {}, model parallel rank {}, and data parallel "
            "rank {} with model parallel seed: {} and data parallel seed: {}".format(
                torch.distributed.get_rank(),
                get_model_parallel_rank(),
                get_data_parallel_rank(),
                model_parallel_seed,
                data_parallel_seed,
            ),
            flush=True,
        )
    _CUDA_RNG_STATE_TRACKER.reset()
    device_layer.rng_manual_seed(data_parallel_seed)
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, model_parallel_seed)


class _RNGSnapshot:
    """The CPU state, the accelerator state when there is one, and the tracker's states."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.device = device_layer.rng_get_state() if device_layer.rng_device().type != "cpu" else None
        self.tracker = get_cuda_rng_tracker().get_states()

    def restore(self) -> None:
        """Put the states back; the snapshot stays as it is, so it can be restored again.

        A retained graph's second backward restores the forward's snapshot a second time. The tracker keeps the
        dict it is given and each ``fork()`` writes its advanced state into it: handed the snapshot's own dict, the
        first recomputation advanced the snapshot, and the second one drew other dropout masks (wrong gradients).
        The generators copy the state tensors they are set from, so those need no copy.
        """
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            _set_cuda_rng_state(self.device)
        get_cuda_rng_tracker().set_states(dict(self.tracker))


class _Recomputation(threading.local):
    """How many checkpoint recomputations run on this thread, and the batch-norm guards active in them."""

    def __init__(self) -> None:
        self.depth = 0
        self.guards: Dict[int, _RunningStatsGuard] = {}


_recomputation = _Recomputation()


def _always() -> bool:
    return True


def _suspend_running_stats(module: nn.Module, inputs: Tuple[Any, ...]) -> None:
    # A global hook sees every module on every thread: only batch-norm layers run by this thread's recomputation.
    if _recomputation.depth and _is_patched_kind(module) and id(module) not in _recomputation.guards:
        guard = _RunningStatsGuard(_always)
        _recomputation.guards[id(module)] = guard
        guard.suspend(cast(_BatchNorm, module), inputs)


def _restore_running_stats(module: nn.Module, inputs: Tuple[Any, ...], output: Any) -> None:
    guard = _recomputation.guards.pop(id(module), None) if _recomputation.depth else None
    if guard is not None:
        guard.restore(cast(_BatchNorm, module), inputs, output)


@contextlib.contextmanager
def _running_stats_left_alone() -> Iterator[None]:
    """Inside the block, the batch-norm layers this thread runs leave their running statistics alone.

    The checkpointed function is any callable (a closure over the layers, as Megatron writes it), so its batch-norm
    layers cannot be listed: global module hooks, active only while a recomputation runs and only on its thread,
    apply :func:`fairscale.nn.checkpoint.checkpoint_utils.patch_batchnorm`'s guard to each layer they see. The
    first (no-grad) pass has updated the statistics, as the plain call does; each recomputation (one per backward
    through a retained graph, and any checkpoint nested inside) would have updated them once more.
    """
    handles: List[RemovableHandle] = []
    if _recomputation.depth == 0:
        handles.append(torch.nn.modules.module.register_module_forward_pre_hook(_suspend_running_stats))
        # always_call: a forward that raises must not leave the layer without statistics for good.
        handles.append(torch.nn.modules.module.register_module_forward_hook(_restore_running_stats, always_call=True))
    _recomputation.depth += 1
    try:
        yield
    finally:
        _recomputation.depth -= 1
        for handle in handles:
            handle.remove()


class _WithoutGradAnchor:
    """The checkpointed function, called with an extra first argument (the grad anchor, see :func:`checkpoint`)
    that it does not see."""

    def __init__(self, function: Any) -> None:
        self.function = function

    def __call__(self, _grad_anchor: Tensor, *args: Any) -> Any:
        return self.function(*args)


class CheckpointFunction(torch.autograd.Function):
    """Activation checkpoint that replays the forward with the RNG states it had (tracker included).

    All positional arguments of the checkpointed function must be tensors.
    """

    @staticmethod
    def forward(ctx: Any, run_function: Any, *args: Any) -> Any:
        ctx.run_function = run_function
        ctx.fwd_rng = _RNGSnapshot()
        ctx.save_for_backward(*args)
        with torch.no_grad():
            outputs = run_function(*args)
        return outputs

    @staticmethod
    def backward(ctx: Any, *args: Any) -> Tuple[Any, ...]:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("Checkpointing is not compatible with .grad(), please use .backward() if possible")
        inputs = ctx.saved_tensors
        # The inner backward is covered too: a checkpoint_wrapper module inside recomputes there.
        with _running_stats_left_alone():
            bwd_rng = _RNGSnapshot()
            ctx.fwd_rng.restore()
            detached_inputs = detach_variable(inputs)
            try:
                with torch.enable_grad():
                    outputs = ctx.run_function(*detached_inputs)
            finally:
                bwd_rng.restore()
            if isinstance(outputs, Tensor):
                outputs = (outputs,)
            # Only the recomputed outputs that require grad: one that needs none (a mask the function also returns)
            # made backward fail ("element 1 of tensors does not require grad"), as torch's own checkpoint does not.
            pairs = [(out, grad) for out, grad in zip(outputs, args) if isinstance(out, Tensor) and out.requires_grad]
            if pairs:
                torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
            elif not isinstance(ctx.run_function, _WithoutGradAnchor):
                raise RuntimeError(
                    "model_parallel.random.checkpoint: none of the checkpointed function's outputs requires grad, so "
                    "there is nothing to back-propagate; call the function without checkpoint()"
                )
            # else: the anchor was only a guess that parameters inside would need grad, and none did.
        return (None,) + tuple(inp.grad if isinstance(inp, Tensor) else None for inp in detached_inputs)


def _may_need_a_grad_anchor(function: Any, args: Tuple[Any, ...]) -> bool:
    """Whether :func:`checkpoint` must add a grad anchor: grad is on, no input requires grad, and the function may
    use a tensor that does (a module's parameter; anything, for a callable that is not a module)."""
    if not torch.is_grad_enabled() or any(isinstance(a, Tensor) and a.requires_grad for a in args):
        return False
    module = function if isinstance(function, nn.Module) else getattr(function, "__self__", None)
    if isinstance(module, nn.Module):
        return _may_need_grad(module, [])
    return True


def checkpoint(function: Any, *args: Any) -> Any:
    """Run ``function(*args)`` without keeping activations; recompute them, with the same RNG, in backward.

    The recomputation replays the CPU and device generators and the tracker's states (also for a second backward
    through a retained graph), and leaves batch-norm running statistics alone: they are updated once, in the
    forward, as by the plain call. Parameters used by ``function`` get gradients even when no input requires grad.

    Args:
        function: the function to checkpoint.
        *args: its inputs, all tensors.

    Returns:
        What ``function`` returns.

    Raises:
        TypeError: an argument that is neither a tensor nor ``None`` (they are saved for the recomputation with
            ``save_for_backward``, whose error named neither this function nor the argument).
    """
    for i, arg in enumerate(args):
        if arg is not None and not isinstance(arg, Tensor):
            raise TypeError(
                f"model_parallel.random.checkpoint: argument {i} is a {type(arg).__name__}; the checkpointed "
                "function's arguments must be tensors (or None): bind other values into the function "
                "(functools.partial) or use fairscale.nn.checkpoint_wrapper, which takes any arguments"
            )
    if _may_need_a_grad_anchor(function, args):
        # An autograd function only records a backward when one of its inputs requires grad: with none that does, the
        # output did not require grad and the parameters inside silently got no gradient. This empty tensor is an
        # input that does (checkpoint_wrapper adds one for the same reason); the function does not see it.
        grad_anchor = torch.empty((0,), requires_grad=True)
        return CheckpointFunction.apply(_WithoutGradAnchor(function), grad_anchor, *args)
    return CheckpointFunction.apply(function, *args)
