# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Checkpointing of one partition on one micro-batch, with the recomputation scheduled by autograd.

:class:`Checkpointing` pairs two autograd functions that share two one-slot buffers:

* ``Checkpoint`` runs the partition under ``no_grad`` in the forward pass (saving the RNG states and the inputs);
  in the backward pass it back-propagates through the recomputed graph it finds in the "recomputed" slot.
* ``Recompute`` is an identity on a phony in the forward pass; its backward runs the partition again with the
  saved RNG states (so dropout masks repeat), the modules' ``training`` flags of the forward (so an ``eval()``
  between the forward and the backward changes nothing) and its autocast state (a backward inside the caller's
  ``torch.autocast`` block does not recompute in low precision), and fills the slot. Fork/join edges make autograd run it
  just before ``Checkpoint``'s backward, and after the gradient of the later micro-batch has arrived, so that only
  one micro-batch's activations are alive per partition at a time.
"""

import contextlib
import threading
from collections import deque
from contextlib import contextmanager
from typing import Any, Deque, Generator, List, Optional, Protocol, Tuple, Union, cast

import torch
from torch import Tensor, nn

from fairscale.internal.autocast import AutocastState, autocast_state
from fairscale.internal.device import accelerator_rng_state, set_accelerator_rng_state
from fairscale.nn.checkpoint._training_flags import TrainingFlags as TrainingFlags  # Pipe's names (re-exported)
from fairscale.nn.checkpoint._training_flags import replay_training_flags as replay_training_flags
from fairscale.nn.checkpoint._training_flags import training_flags_of as training_flags_of

from .dependency import fork, join
from .microbatch import Batch
from .phony import get_phony

__all__ = ["is_checkpointing", "is_recomputing"]

_GRAD_UNSUPPORTED = (
    "Pipe: a training forward that checkpointed micro-batches supports a plain backward only (loss.backward() or "
    "torch.autograd.backward without inputs=): with {what}, the checkpointed micro-batches' backward (a recomputation "
    "back-propagated into .grad) would silently miss the requested gradients or write .grad. Call loss.backward() and "
    "read .grad, or build the pipeline with checkpoint='never' (or run it in eval mode)."
)

Tensors = Tuple[Tensor, ...]
TensorOrTensors = Union[Tensor, Tensors]

# The one-slot buffers shared by a Checkpoint/Recompute pair.
# The recomputed output, its input leaves, and the stash phonies the recomputation made (see note_stash_phony).
Recomputed = Tuple[TensorOrTensors, Tensors, List[Tensor]]
RNGStates = Tuple[Tensor, Optional[Tensor]]  # (CPU state, accelerator state of the input's device)


class Function(Protocol):
    def __call__(self, input: TensorOrTensors) -> TensorOrTensors: ...  # noqa: E704


class Context:
    """What :class:`Checkpoint` and :class:`Recompute` keep on their autograd context (the type of ``ctx``)."""

    recomputed: Deque[Recomputed]
    rng_states: Deque[RNGStates]
    function: Function
    input_atomic: bool
    saved_tensors: Tuple[Tensor, ...]

    def save_for_backward(self, *tensors: Tensor) -> None:
        """Keep ``tensors`` for the backward as ``saved_tensors``."""
        self.saved_tensors = tensors


class ThreadLocal(threading.local):
    def __init__(self) -> None:
        self.is_checkpointing = False
        self.is_recomputing = False
        self.stash_phonies: Optional[List[Tensor]] = None


thread_local = ThreadLocal()


def note_stash_phony(phony: Tensor) -> None:
    """Called by a stash's portal: a recomputation keeps its phonies, the skip tensors' gradient paths, as roots of
    the checkpoint's backward (a partition output with no gradient must not cut them off)."""
    if thread_local.stash_phonies is not None and phony.requires_grad:
        thread_local.stash_phonies.append(phony)


@contextmanager
def enable_checkpointing() -> Generator[None, None, None]:
    """Make :func:`is_checkpointing` true in this thread for the block."""
    orig = thread_local.is_checkpointing
    thread_local.is_checkpointing = True
    try:
        yield
    finally:
        thread_local.is_checkpointing = orig


@contextmanager
def enable_recomputing() -> Generator[None, None, None]:
    """Make :func:`is_recomputing` true in this thread for the block."""
    orig = thread_local.is_recomputing
    thread_local.is_recomputing = True
    try:
        yield
    finally:
        thread_local.is_recomputing = orig


def is_checkpointing() -> bool:
    """Whether the current forward pass is a checkpointed one (its activations will be recomputed).

    A module can use it to skip work in the checkpointed pass that it will do in the recomputation, e.g.::

        if not is_checkpointing():
            self.counter += 1
    """
    return thread_local.is_checkpointing


def is_recomputing() -> bool:
    """Whether the current forward pass is the recomputation of a checkpointed one.

    Typical use: don't update running statistics twice, e.g. ``if not is_recomputing(): self.counter += 1``.
    """
    return thread_local.is_recomputing


AutocastStates = Tuple[Tuple[str, AutocastState], ...]


def autocast_states_of(batch: Batch) -> AutocastStates:
    """The autocast state, for the CPU and each device type of ``batch``, of the thread running a forward."""
    states = []
    for device_type in sorted({t.device.type for t in batch if isinstance(t, Tensor)} | {"cpu"}):
        try:
            states.append((device_type, autocast_state(device_type)))
        except (RuntimeError, TypeError):  # a device type autocast does not know (meta): nothing to replay
            continue
    return tuple(states)


class _ReplayForwardState:
    """``function`` run with the ``training`` flags and the autocast state that the checkpointed forward ran with.

    The forward runs on a worker thread, where an autocast entered by the caller is off (thread-local); the
    recomputation runs in backward, which the autograd engine runs with the backward caller's autocast state: a
    backward inside a ``torch.autocast`` block recomputed in low precision what the forward computed in fp32.
    """

    def __init__(self, function: Function, flags: TrainingFlags, autocast: AutocastStates) -> None:
        self.function = function
        self.flags = flags
        self.autocast = autocast

    def __call__(self, input: TensorOrTensors) -> TensorOrTensors:
        with contextlib.ExitStack() as stack:
            for device_type, (enabled, dtype) in self.autocast:
                if dtype is None:
                    stack.enter_context(torch.autocast(device_type, enabled=enabled))
                else:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            stack.enter_context(replay_training_flags(self.flags))
            return self.function(input)


class Checkpointing:
    """Generates a pair of :class:`Checkpoint` and :class:`Recompute` for one partition and one micro-batch.

    Args:
        function: the partition (called with the tensor of an atomic batch, else the tuple).
        batch (Batch): its input micro-batch.
        module (Optional[nn.Module]): the modules ``function`` runs. Their ``training`` flags are recorded by the
            checkpointed forward and replayed in the recomputation: a backward run after ``eval()`` (a validation
            pass between a training forward and its backward) recomputed dropout and batch norm in eval mode, and
            the gradients were not those of the forward. ``None``: the recomputation runs in the current modes.
        training_flags (Optional[TrainingFlags]): the modes to replay, recorded once for the whole forward.
    """

    def __init__(
        self,
        function: Function,
        batch: Batch,
        module: Optional[nn.Module] = None,
        training_flags: Optional[TrainingFlags] = None,
    ) -> None:
        self.function = function
        self.batch = batch
        self.module = module
        # Given: recorded once for the whole forward (all its micro-batches run the same modes), not per micro-batch.
        self._given_flags = training_flags
        self.training_flags: TrainingFlags = ()
        self.autocast_states: AutocastStates = ()
        # Shared by the pair: Recompute fills them, Checkpoint empties them.
        self.recomputed: Deque[Recomputed] = deque(maxlen=1)
        self.rng_states: Deque[RNGStates] = deque(maxlen=1)

    def checkpoint(self) -> Batch:
        """Run the function without keeping activations; return its output batch."""
        if self._given_flags is not None:
            self.training_flags = self._given_flags
        elif self.module is not None:
            # Recorded with the RNG states, per micro-batch, when the forward runs.
            self.training_flags = training_flags_of(self.module)
        self.autocast_states = autocast_states_of(self.batch)
        input_atomic = self.batch.atomic
        input = tuple(self.batch)
        # The grad-requiring phony makes the outputs require grad even when no input does, so the backward
        # (and the recomputation of parameters' gradients) always happens. Pipe checkpoints only partitions that
        # hold a tensor requiring grad or get an input that does (see pipeline.Pipeline.run).
        phony = get_phony(self.batch[0].device, requires_grad=True)
        output = Checkpoint.apply(phony, self.recomputed, self.rng_states, self.function, input_atomic, *input)
        if isinstance(output, tuple):
            output = tuple(x if x.is_floating_point() else x.detach() for x in output)
        return Batch(output, self.batch.index)

    def recompute(self, batch: Batch) -> None:
        """Attach the recomputation to ``batch`` (the checkpointed output), in place."""
        input_atomic = self.batch.atomic
        input = tuple(self.batch)
        index = _first_grad_index(batch)
        batch[index], phony = fork(batch[index])
        function = self.function
        if self.training_flags or self.autocast_states:
            function = _ReplayForwardState(function, self.training_flags, self.autocast_states)
        phony = Recompute.apply(phony, self.recomputed, self.rng_states, function, input_atomic, *input)
        batch[index] = join(batch[index], phony)


def _first_grad_index(batch: Batch) -> int:
    # The fork/join must sit on a tensor that autograd follows; non-float outputs are detached. With none requiring
    # grad, the first floating one: a join on an integer tensor was dropped with it, and a skip's gradient was lost
    # at the stash, silently (``(ids, x)`` with ``x`` the raw input; found by a fuzz, session 43).
    first_float = None
    for i, t in enumerate(batch):
        if t.requires_grad:
            return i
        if first_float is None and t.is_floating_point():
            first_float = i
    return 0 if first_float is None else first_float


def save_rng_states(device: torch.device, rng_states: Deque[RNGStates]) -> None:
    """Save the CPU RNG state and, for an accelerator ``device``, that device's RNG state."""
    cpu_state = torch.get_rng_state()
    device_state = accelerator_rng_state(device) if device.type != "cpu" else None
    rng_states.append((cpu_state, device_state))


@contextmanager
def restore_rng_states(device: torch.device, rng_states: Deque[RNGStates]) -> Generator[None, None, None]:
    """Run the block with the RNG states saved by :func:`save_rng_states`; the global streams are left as they were."""
    # Read, not taken: a second backward through the same graph (retain_graph=True) recomputes with the same states.
    cpu_state, device_state = rng_states[-1]
    forked: List[torch.device] = [device] if device_state is not None else []
    with torch.random.fork_rng(forked, device_type=device.type if forked else "cuda"):
        torch.set_rng_state(cpu_state)
        if device_state is not None:
            set_accelerator_rng_state(device, device_state)
        yield


def _keep(
    ctx: Context,
    recomputed: Deque[Recomputed],
    rng_states: Deque[RNGStates],
    function: Function,
    input_atomic: bool,
    input: Tuple[Tensor, ...],
) -> None:
    """Store the arguments of :class:`Checkpoint`'s and :class:`Recompute`'s forward on ``ctx``: the pair shares the
    queues, and Recompute's backward runs ``function`` again on the saved input."""
    ctx.recomputed = recomputed
    ctx.rng_states = rng_states
    ctx.function = function
    ctx.input_atomic = input_atomic
    ctx.save_for_backward(*input)


class Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Context,
        phony: Tensor,
        recomputed: Deque[Recomputed],
        rng_states: Deque[RNGStates],
        function: Function,
        input_atomic: bool,
        *input: Tensor,
    ) -> TensorOrTensors:
        _keep(ctx, recomputed, rng_states, function, input_atomic, input)
        cast(Any, ctx).set_materialize_grads(False)  # an output with no gradient stays None (see dependency.Fork)
        save_rng_states(input[0].device, ctx.rng_states)
        with torch.no_grad(), enable_checkpointing():
            output = function(input[0] if input_atomic else input)
        return output

    @staticmethod
    def backward(ctx: Context, *grad_output: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        output, input_leaf, stash_phonies = ctx.recomputed.pop()
        outputs: Tensors = output if isinstance(output, tuple) else (output,)
        # Pair each gradient with its own output before filtering (upstream filtered the outputs only, which
        # misaligned the gradients when a non-grad output preceded a grad one). An output with no gradient is left
        # out (a zero passed back gave zero gradients where the plain model leaves None); the stashes' phonies are
        # roots of their own, so a skip's gradient still reaches the stash (one node runs once per backward call,
        # also when an output's path reaches it too).
        pairs = [(y, g) for y, g in zip(outputs, grad_output) if y.requires_grad and g is not None]
        pairs += [(phony, torch.zeros_like(phony)) for phony in stash_phonies]
        if pairs:
            torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
        grad_input: List[Optional[Tensor]] = [None, None, None, None, None]
        grad_input.extend(x.grad for x in input_leaf)
        return tuple(grad_input)


class Recompute(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Context,
        phony: Tensor,
        recomputed: Deque[Recomputed],
        rng_states: Deque[RNGStates],
        function: Function,
        input_atomic: bool,
        *input: Tensor,
    ) -> Tensor:
        _keep(ctx, recomputed, rng_states, function, input_atomic, input)
        return phony

    @staticmethod
    def backward(ctx: Context, *grad_output: Tensor) -> Tuple[None, ...]:
        input = ctx.saved_tensors
        input_leaf = tuple(x.detach().requires_grad_(x.requires_grad) for x in input)
        stash_phonies: List[Tensor] = []
        previous = thread_local.stash_phonies
        thread_local.stash_phonies = stash_phonies
        try:
            with restore_rng_states(input[0].device, ctx.rng_states):
                with torch.enable_grad(), enable_recomputing():
                    output = ctx.function(input_leaf[0] if ctx.input_atomic else input_leaf)
        finally:
            thread_local.stash_phonies = previous
        ctx.recomputed.append((output, input_leaf, stash_phonies))
        grad_input: List[None] = [None, None, None, None, None]
        grad_input.extend(None for _ in ctx.saved_tensors)
        return tuple(grad_input)


class _CheckpointGuard(torch.autograd.Function):
    """Identity on one micro-batch's output of a training forward that checkpointed micro-batches; its backward
    refuses what checkpointing cannot serve.

    A checkpointed micro-batch's backward back-propagates its recomputed graph with a plain backward of its own, into
    ``.grad``. ``torch.autograd.grad`` and ``backward(inputs=...)`` run only the nodes on a path to the requested
    tensors: asked for parameters, the checkpointed micro-batches' share went missing without an error; asked for the
    input, the answer was right but every parameter's ``.grad`` got the checkpointed micro-batches' partial gradients.
    Both are refused, as torch's reentrant checkpoint refuses them. With ``create_graph=True`` the recomputed graph is
    back-propagated without a graph of its own: the gradients would not be differentiable. Every micro-batch's output
    is guarded, as a request may reach the pipeline through any of them.
    """

    @staticmethod
    def forward(ctx: Any, *tensors: Tensor) -> Tensors:
        ctx.set_materialize_grads(False)  # no gradient stays None (see dependency.Fork)
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        if torch.is_grad_enabled():
            raise RuntimeError(_GRAD_UNSUPPORTED.format(what="a backward with create_graph=True (double backward)"))
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(_GRAD_UNSUPPORTED.format(what="torch.autograd.grad() or backward(inputs=...)"))
        return grads


def guard_checkpointed(batches: List[Batch]) -> None:
    """Put every micro-batch output of ``batches`` (in place) behind a :class:`_CheckpointGuard`; outputs that do not
    require grad pass as they are.

    Guarding the micro-batches rather than the gathered output keeps the output a fresh tensor (``torch.cat``'s):
    a custom function's output that is its input is a view, which in-place operations on the output refuse.
    """
    for batch in batches:
        positions = [i for i, t in enumerate(batch) if t.requires_grad]
        if not positions:
            continue
        guarded = _CheckpointGuard.apply(*(batch[i] for i in positions))
        for i, t in zip(positions, guarded):
            batch[i] = t


def holds_grad_tensor(module: nn.Module) -> bool:
    """Whether a parameter, buffer or tensor attribute of ``module`` or of a module below it requires grad.

    A tensor attribute counts too: a learnable tensor that is not a ``Parameter`` (owned by another module, say).
    One reached otherwise (a list attribute, a closure) is not seen: Pipe then runs the partition without
    checkpointing when its input requires no grad, and autograd finds it.
    """
    for m in module.modules():
        if any(t is not None and t.requires_grad for t in (*m._parameters.values(), *m._buffers.values())):
            return True
        for v in m.__dict__.values():
            if isinstance(v, Tensor) and v.requires_grad:
                return True
    return False
