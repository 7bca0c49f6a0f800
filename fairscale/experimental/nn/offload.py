# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OffloadModel: train an ``nn.Sequential`` larger than the compute device by moving slices onto it one at a time.

The model lives on ``offload_device`` (normally the CPU). Forward loads slice ``i`` onto ``device``, runs it, and
drops it back before slice ``i + 1`` is loaded; backward does the same in reverse order. With
``checkpoint_activation=True`` only the slice boundaries are kept and each slice is recomputed in backward, split
into ``num_microbatches`` chunks so that only one chunk's intermediate activations exist at a time.

Streams and pinned memory go through :mod:`fairscale.internal.device`, so the same code runs with
``device == offload_device == cpu`` (then every move is a no-op and the result is plain sequential training).
"""

import logging
import warnings
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, TypeVar, cast

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from fairscale.internal.autocast import autocast_state
from fairscale.internal.containers import rebuild_sequence
from fairscale.internal.device import (
    DeviceHandle,
    accelerator_available,
    accelerator_rng_state,
    amp_custom_fwd_bwd,
    set_accelerator_rng_state,
)
from fairscale.internal.dry_load import load_state_dict_all_or_nothing
from fairscale.internal.errors import FairscaleRuntimeError

from .offload_checkpoint import (
    InPlaceSafeAlias,
    autocast_replayed,
    chunk_output,
    checkpoint_inputs,
    chunks,
    grad_chunks,
    join_chunks,
    join_grads,
    module_modes,
    modes_replayed,
    output_rows,
    save_slice_inputs,
    saved_slice_inputs,
)

__all__ = ["OffloadModel", "ModelShard", "OffloadFunction", "ShardSyncLayer"]

_FnT = TypeVar("_FnT", bound=Callable[..., Any])

_PREFIX = "fairscale.experimental.nn.offload:"


_CUSTOM_FWD, _CUSTOM_BWD = amp_custom_fwd_bwd("cuda")


def _amp_fwd(fn: _FnT) -> _FnT:
    # Records the autocast state of forward so that backward's recomputation runs under the same state.
    return cast(_FnT, _CUSTOM_FWD(fn))


def _amp_bwd(fn: _FnT) -> _FnT:
    return cast(_FnT, _CUSTOM_BWD(fn))


def _split(modules: nn.Sequential, number_splits: int) -> List[List[nn.Module]]:
    """Split ``modules`` into at most ``number_splits`` consecutive slices of about equal parameter count.

    The parameter count is the proxy for memory. A slice closes when it already holds parameters, the next layer
    would take it strictly over ``total // n`` and it is not the last slice. Parameters are pinned in place (when an
    accelerator exists) because they will be copied to and from the device at every step.
    """
    n = min(len(modules), number_splits)
    total = sum(p.numel() for p in modules.parameters())
    target = total // n
    pinner = DeviceHandle.for_device("cpu")
    splits: List[List[nn.Module]] = [[] for _ in range(n)]
    sizes = [0] * n
    current = 0
    for layer in modules:
        for p in layer.parameters():
            p.data = pinner.pin_memory(p.data)
        layer_size = sum(p.numel() for p in layer.parameters())
        if sizes[current] > 0 and sizes[current] + layer_size > target and current < n - 1:
            current += 1
        splits[current].append(layer)
        sizes[current] += layer_size
    splits = [s for s in splits if s]
    logging.info("This model has %.2fM parameters, aiming for %.2fM parameters per shard", total / 1e6, target / 1e6)
    for i, size in enumerate(sizes[: len(splits)]):
        logging.info("Shard %d holds %.2fM parameters", i, size / 1e6)
    return splits


class ModelShard(nn.Module):
    """One slice of an :class:`OffloadModel`, kept on ``offload_device`` and loaded onto ``device`` when used.

    Args:
        cpu_model_shard (nn.Module): the slice.
        device (torch.device): the compute device.
        offload_device (torch.device): where the slice rests between uses.
        index (int): position of the slice in the model.
    """

    def __init__(
        self, cpu_model_shard: nn.Module, device: torch.device, offload_device: torch.device, index: int
    ) -> None:
        super().__init__()
        self.model_shard = cpu_model_shard
        self.index = index
        self.device = torch.device(device)
        self.offload_device = torch.device(offload_device)
        self.model_shard.to(self.offload_device)
        self._handle = DeviceHandle.for_device(self.device)
        self._cpu_to_gpu_stream = self._handle.new_stream()
        self._gpu_to_cpu_stream = self._handle.new_stream()

    def forward(self, *inputs: Any, **_: Any) -> Any:
        return self.model_shard(*inputs)

    def to(self, device: Any, *args: Any, **kwargs: Any) -> "ModelShard":  # type: ignore[override]
        """Move the wrapped slice only (upstream behaviour); returns ``self``."""
        self.model_shard.to(device, *args, **kwargs)
        return self

    def train(self, mode: bool = True) -> "ModelShard":
        """Set the mode of the wrapped slice (like upstream, this shard's own ``training`` flag is left as is)."""
        self.model_shard.train(mode)
        return self

    def to_device(self) -> None:
        """Move the slice onto the compute device."""
        self.model_shard.to(self.device, non_blocking=True)

    def forward_load(self, non_blocking: bool = True) -> None:
        """Load the slice onto the compute device before its forward."""
        self._load(non_blocking)

    def backward_load(self, non_blocking: bool = True) -> None:
        """Load the slice onto the compute device before its backward."""
        self._load(non_blocking)

    def forward_drop(self, non_blocking: bool = True) -> None:
        """Move the slice back to the offload device after its forward."""
        self._drop(non_blocking)

    def backward_drop(self, non_blocking: bool = True) -> None:
        """Move the slice (and its gradients) back to the offload device after its backward."""
        self._drop(non_blocking)

    def _load(self, non_blocking: bool) -> None:
        with self._handle.stream(self._cpu_to_gpu_stream):
            self.model_shard.to(self.device, non_blocking=non_blocking)
        # Compute on the current stream must not start before the copy is done.
        self._handle.current_stream().wait_stream(self._cpu_to_gpu_stream)

    def _drop(self, non_blocking: bool) -> None:
        # The copy back must wait for the kernels that still read or write the slice.
        self._gpu_to_cpu_stream.wait_stream(self._handle.current_stream())
        with self._handle.stream(self._gpu_to_cpu_stream):
            self.model_shard.to(self.offload_device, non_blocking=non_blocking)
        self._handle.current_stream().wait_stream(self._gpu_to_cpu_stream)


def _to(tensors: Sequence[Any], device: torch.device) -> Tuple[Any, ...]:
    return tuple(t.to(device) if isinstance(t, Tensor) else t for t in tensors)


class ShardSyncLayer(torch.autograd.Function):
    """Identity on the activations whose side effects move slices at a slice boundary.

    Forward: drop slice ``index`` (if ``index >= 0``) and load slice ``index + 1`` (if it exists). Backward: the
    mirror image, so slice ``index`` is on the device when its backward runs and its gradients move off it with
    it afterwards. ``anchor`` is an empty grad-requiring tensor that makes sure the backward also runs for the
    boundary in front of the first slice when the model input does not require grad.
    """

    @staticmethod
    @_amp_fwd
    def forward(
        ctx: Any, anchor: Tensor, index: int, model_slices: List[ModelShard], model_instance: Any, *inputs: Any
    ) -> Tuple[Any, ...]:
        ctx.index = index
        ctx.model_slices = model_slices
        ctx.model_instance = model_instance
        if index >= 0:
            with torch.autograd.profiler.record_function(_PREFIX + "forward_drop"):
                model_slices[index].forward_drop()
        if index + 1 < len(model_slices):
            with torch.autograd.profiler.record_function(_PREFIX + "forward_load"):
                model_slices[index + 1].forward_load()
        # Aliases, not views: each is a new node of this Function (so this backward runs), and a slice may start
        # with an in-place op (``nn.ReLU(inplace=True)``), which torch refuses on a custom Function's view output.
        # The alias shares the input's version counter, so a change to a tensor that the previous slice saved for
        # its backward still raises torch's error, as in the plain model.
        return tuple(t.detach() if isinstance(t, Tensor) else t for t in inputs)

    @staticmethod
    @_amp_bwd
    def backward(ctx: Any, *grad_outputs: Any) -> Tuple[Any, ...]:
        # Only this call's ctx is read: the model may have run other (or failed) forwards by the time this backward
        # runs. Autograd keeps the tensors the slices' backward needs itself (upstream also moved bookkeeping copies
        # of them kept on the model, to no effect).
        load, drop = ctx.index, ctx.index + 1
        slices: List[ModelShard] = ctx.model_slices
        if drop < len(slices):
            with torch.autograd.profiler.record_function(_PREFIX + "backward_drop"):
                slices[drop].backward_drop()
        if load >= 0:
            with torch.autograd.profiler.record_function(_PREFIX + "backward_load"):
                slices[load].backward_load()
        return (None, None, None, None) + tuple(grad_outputs)


class OffloadFunction(torch.autograd.Function):
    """The whole offloaded forward with activation checkpointing at slice boundaries (one autograd node).

    Call it as ``OffloadFunction.apply(first_input, dummy, model, *more_inputs)``: the model's input tensors are
    separate arguments (autograd tracks tensors passed directly only, so the tensors of a tuple argument got no
    gradient and their outputs no autograd link). It returns one tensor, or a tuple of one per input.

    Forward runs every slice under ``no_grad`` on ``num_microbatches`` chunks and keeps the slice inputs as CPU
    copies. Backward re-loads the slices in reverse order, recomputes each chunk with grad enabled (restoring the
    RNG state the slice's forward started from, CPU and device, so dropout masks repeat) and backpropagates it.

    Everything the backward reads (slice inputs, RNG states, each module's ``training`` flag, the autocast state,
    slices, micro-batch count) is kept on this call's ``ctx``, so what happens between the forward and its backward
    (a second batch accumulated into one loss, an ``eval()`` and ``no_grad`` validation pass, the end of an autocast
    block) cannot change its gradients. Running statistics of normalisation layers are updated by the forward only,
    once per chunk, as a plain model run chunk by chunk would.
    """

    @staticmethod
    @_amp_fwd
    def forward(ctx: Any, inputs: Any, dummy_input: Tensor, model_instance: Any, *more_inputs: Any) -> Any:
        if not isinstance(inputs, Tensor):
            raise TypeError(
                f"OffloadFunction.apply: the first argument must be a tensor, got {type(inputs).__name__}; pass the "
                "tensors of a tuple input as separate arguments, apply(first, dummy, model, *rest) (autograd does not "
                "track the tensors inside a tuple, so they and the slices would get no gradient)"
            )
        inputs_tuple = (inputs,) + more_inputs
        device: torch.device = model_instance.device
        nmb: int = model_instance._num_microbatches
        slices: List[ModelShard] = list(model_instance.model_slices)
        ctx.grad_requirements = tuple(isinstance(x, Tensor) and x.requires_grad for x in inputs_tuple)
        # Each input's gradient goes back to the input's own device: the slices run (and backpropagate) on
        # ``device``, and autograd refuses an input gradient on another device (a CPU batch fed to a GPU model).
        ctx.input_devices = tuple(x.device if isinstance(x, Tensor) else None for x in inputs_tuple)
        ctx.device = device
        ctx.num_microbatches = nmb
        ctx.model_slices = slices
        ctx.rng_states = []
        ctx.modes = []
        ctx.autocast = autocast_state(device.type)
        # The model outputs' shapes before the squeeze: the backward gives their gradients these shapes back, so
        # that each micro-batch's recomputed output meets its own gradient whatever the squeeze did to the whole
        # (a 1-D output, whose 1-row micro-batch a per-chunk squeeze would make 0-d; a batch of one).
        ctx.output_shapes = []
        ctx.output_rows = []  # per slice and input: its micro-batch outputs' dim-0 sizes (see grad_chunks)
        # Whether each slice's recomputation must backpropagate into its input: only when a model input or a
        # parameter of an earlier slice requires grad (otherwise the input gradient goes nowhere; a frozen first
        # slice was backpropagated for nothing).
        wanted = any(ctx.grad_requirements)
        ctx.input_grad_wanted = []
        for shard in slices:
            ctx.input_grad_wanted.append(wanted)
            wanted = wanted or any(p.requires_grad for p in shard.parameters())
        activations: List[Tuple[Any, ...]] = [inputs_tuple]
        kept: List[Tuple[Any, ...]] = []
        for index, shard in enumerate(slices):
            with torch.autograd.profiler.record_function(_PREFIX + "forward_load"):
                activations[index] = _to(activations[index], device)
                shard.forward_load()
            # Copied before the slice runs: a slice that starts with an in-place op (nn.ReLU(inplace=True)) changes
            # the tensor it is given, and its recomputation needs the input as it was.
            kept.append(tuple(t.to("cpu", copy=True) if isinstance(t, Tensor) else t for t in activations[index]))
            ctx.rng_states.append((torch.get_rng_state(), accelerator_rng_state(device)))
            ctx.modes.append(module_modes(shard))
            last = index == len(slices) - 1
            with torch.autograd.profiler.record_function(_PREFIX + "no_grad_forward_pass"):
                with torch.no_grad():
                    outputs = []
                    ctx.output_rows.append([])
                    for x in activations[index]:
                        outs = [chunk_output(shard(c), index) for c in chunks(x, nmb)]
                        ctx.output_rows[index].append(output_rows(outs))
                        out = join_chunks(outs, index)
                        # Upstream squeezes every slice output, which breaks a width-1 boundary between slices
                        # (the next slice gets (N,) instead of (N, 1)); only the model output keeps that squeeze.
                        outputs.append(out.squeeze(-1) if last else out)
                        if last:
                            ctx.output_shapes.append(out.shape)
            with torch.autograd.profiler.record_function(_PREFIX + "forward_drop"):
                activations[index] = kept[index]
                activations.append(tuple(outputs))
                shard.forward_drop()
        # The slice inputs (not the model output: keeping it on ctx would make a reference cycle through its
        # grad_fn) belong to this call, not to the model: kept on the model they held the last forward's tensors
        # until the next forward and broke ``copy.deepcopy`` of the model.
        save_slice_inputs(ctx, kept)
        # No requires_grad set here: forward runs with grad disabled, so it cannot tell a no_grad call from a
        # training one, and a flag set here stayed on the returned leaf under torch.no_grad (unlike the plain model,
        # whose output then does not require grad). ``apply`` makes the floating outputs require grad, through this
        # Function's node, exactly when grad mode is on (``dummy_input`` always requires grad).
        result = tuple(r.to(device) for r in activations[-1])
        return result[0] if len(result) == 1 else result

    @staticmethod
    @_amp_bwd
    def backward(ctx: Any, *grad_outputs: Any) -> Tuple[Any, ...]:
        if not torch.autograd._is_checkpoint_valid():
            # The recomputation back-propagates into every parameter's ``.grad`` from inside this backward, which
            # only a plain ``backward()`` expects. Torch's own message advised ".backward()", which the caller of
            # ``backward(inputs=...)`` already used.
            raise FairscaleRuntimeError(
                "OffloadModel with checkpoint_activation=True supports loss.backward() (or torch.autograd.backward) "
                "without inputs= only: torch.autograd.grad() and backward(inputs=...) cannot be served by its "
                "recomputation; use checkpoint_activation=False for such requests"
            )
        if torch.is_grad_enabled():
            # Grad mode is on in a backward only with create_graph=True (a gradient penalty).
            warnings.warn(
                "OffloadModel with checkpoint_activation=True: backward with create_graph=True back-propagates the "
                "recomputed slices without a graph, so the gradients of the model's parameters and inputs are not "
                "differentiable and a second-order gradient through them misses the model's share; use "
                "checkpoint_activation=False for gradient penalties on them",
                UserWarning,
                stacklevel=2,
            )
        grads: Tuple[Any, ...] = tuple(
            g.reshape(shape) if isinstance(g, Tensor) else g for g, shape in zip(grad_outputs, ctx.output_shapes)
        )
        slices: List[ModelShard] = ctx.model_slices
        slice_inputs = saved_slice_inputs(ctx)
        for index in reversed(range(len(slices))):
            grads = _backward_slice(ctx, index, slice_inputs[index], grads)
        # The first slice's input gradients belong to the model inputs (upstream returned None here).
        input_grads = tuple(
            (g.to(dev) if isinstance(g, Tensor) else g) if req else None
            for g, req, dev in zip(grads, ctx.grad_requirements, ctx.input_devices)
        )
        return (input_grads[0], None, None) + input_grads[1:]


def _backward_slice(ctx: Any, index: int, slice_input: Tuple[Any, ...], grads: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """Recompute slice ``index`` chunk by chunk and backpropagate ``grads``; return the gradients of its inputs.

    Args:
        ctx: the :class:`OffloadFunction` call's context (RNG states, modes, slices, micro-batch count).
        index (int): the slice.
        slice_input (Tuple[Any, ...]): the slice's inputs kept by the forward.
        grads (Tuple[Any, ...]): gradients of the slice's outputs (``None`` where nothing depends on an output).

    Returns:
        Tuple[Any, ...]: gradients of the slice's inputs (``None`` where an input takes none).
    """
    want_input_grad: bool = ctx.input_grad_wanted[index]
    if all(g is None for g in grads) or not (
        want_input_grad or any(p.requires_grad for p in ctx.model_slices[index].parameters())
    ):
        # Nothing later depends on this slice (a frozen slice after it took integer inputs), or nothing in or before
        # it takes a gradient (a frozen backbone): nothing to compute.
        return tuple(None for _ in slice_input)
    device: torch.device = ctx.device
    nmb: int = ctx.num_microbatches
    shard: ModelShard = ctx.model_slices[index]
    with torch.autograd.profiler.record_function(_PREFIX + "backward_load"):
        # A copy: an in-place first op of the slice changes the tensor it is given, and the saved input must stay
        # as it was (a second backward with retain_graph=True reads it again).
        acts = tuple(a.to(device, copy=True) if isinstance(a, Tensor) else a for a in slice_input)
        shard.backward_load()
    cpu_state, device_state = torch.get_rng_state(), accelerator_rng_state(device)
    fwd_cpu_state, fwd_device_state = ctx.rng_states[index]
    torch.set_rng_state(fwd_cpu_state)
    if fwd_device_state is not None:
        set_accelerator_rng_state(device, fwd_device_state)
    input_grads: List[Optional[Tensor]] = []
    try:
        with modes_replayed(shard, ctx.modes[index]):
            for x, grad, rows in zip(acts, grads, ctx.output_rows[index]):
                x_chunks = chunks(x, nmb)
                g_chunks = grad_chunks(grad if isinstance(grad, Tensor) else None, rows, len(x_chunks))
                collected = [_backward_chunk(ctx, shard, xc, gc, want_input_grad) for xc, gc in zip(x_chunks, g_chunks)]
                input_grads.append(join_grads(collected))
    finally:
        torch.set_rng_state(cpu_state)
        if device_state is not None:
            set_accelerator_rng_state(device, device_state)
    with torch.autograd.profiler.record_function(_PREFIX + "backward_drop"):
        shard.backward_drop()
    return tuple(input_grads)


def _backward_chunk(
    ctx: Any, shard: ModelShard, x_chunk: Tensor, g_chunk: Optional[Tensor], want_input_grad: bool
) -> Optional[Tensor]:
    """Recompute ``shard`` on one micro-batch and backpropagate ``g_chunk``; return the chunk's input gradient
    (``None`` unless ``want_input_grad``).

    The chunk is recomputed even when nothing is backpropagated, so that the RNG stream of the later chunks repeats
    the forward's.
    """
    leaf = x_chunk.detach().requires_grad_(True) if want_input_grad and x_chunk.is_floating_point() else x_chunk
    with torch.autograd.profiler.record_function(_PREFIX + "forward_pass_with_enable_grad"):
        # Under the forward's autocast state: upstream replayed CUDA's only, so under CPU autocast the recomputation
        # ran in fp32 on the kept bf16 inputs and failed.
        with torch.enable_grad(), autocast_replayed(ctx.device.type, ctx.autocast):
            # Through an alias, not the leaf itself: torch refuses an in-place first op (ReLU(inplace=True)) on a
            # leaf that requires grad.
            out = shard(InPlaceSafeAlias.apply(leaf) if leaf.requires_grad else leaf)
    if g_chunk is None or not (isinstance(out, Tensor) and out.requires_grad):
        # A frozen slice on integer inputs (a frozen embedding) or one without parameters: nothing to backpropagate.
        return None
    with torch.autograd.profiler.record_function(_PREFIX + "backward_pass"):
        torch.autograd.backward(out, g_chunk)
    return leaf.grad if leaf.requires_grad else None


def _check_count(name: str, value: Any) -> None:
    """``value`` must be an ``int`` (not a ``bool``) of at least 1; the error names the argument."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"OffloadModel: {name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"OffloadModel: {name} must be a positive integer, got {value}")


class OffloadModel(nn.Module):
    """Wrap an ``nn.Sequential`` so that it trains with only one slice at a time on the compute device.

    The model is split into ``num_slices`` slices of about equal parameter count (or taken as given when ``model``
    is a list of modules, such as the output of :func:`fairscale.experimental.nn.auto_shard.shard_model`). At rest
    every slice, with its gradients, is on ``offload_device``; the optimizer therefore steps there.

    Example::

        model = OffloadModel(nn.Sequential(...), device=torch.device("cuda"), num_slices=3)
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()

    Args:
        model (nn.Sequential or List[nn.Module]): the model, or its slices.
        device (torch.device): the compute device (``cpu`` works too: then nothing moves).
        offload_device (torch.device): where the model rests (default: CPU).
        num_slices (int): number of slices when ``model`` is an ``nn.Sequential`` (default: 3; at least 1, and at
            most one slice per layer is made).
        checkpoint_activation (bool): recompute each slice in backward instead of keeping its activations.
        num_microbatches (int): chunks each slice's batch is split into when checkpointing (default: 1; at least 1).
            BatchNorm layers then see each chunk as a batch (statistics and running-stat updates per chunk).

    Raises:
        TypeError: ``model`` or ``device`` is missing, ``model`` is not an ``nn.Sequential`` or a list, or is an
            ``nn.Sequential`` subclass with its own ``forward`` (only its layers would run), ``device`` is a CUDA
            device on a machine without CUDA, or ``num_slices`` / ``num_microbatches`` is not an ``int``.
        ValueError: ``num_slices`` or ``num_microbatches`` is below 1, or ``offload_device`` is a meta device.
        RuntimeError: ``num_microbatches > 1`` without ``checkpoint_activation``.
    """

    def __init__(
        self,
        model: Any,
        device: torch.device,
        offload_device: torch.device = torch.device("cpu"),
        num_slices: int = 3,
        checkpoint_activation: bool = False,
        num_microbatches: int = 1,
    ) -> None:
        super().__init__()
        if model is None:
            raise TypeError("`model` argument to `OffloadModel` cannot be None.")
        if device is None:
            # ``is None``, not falsiness: ``device=0`` is torch's shorthand for ``cuda:0`` (upstream called it None).
            raise TypeError("`device` argument to `OffloadModel` cannot be None.")
        if not (isinstance(model, nn.Sequential) or type(model) == list):
            raise TypeError("`model` argument to `OffloadModel` must be of type `nn.Sequential`.")
        if isinstance(model, nn.Sequential) and type(model).forward is not nn.Sequential.forward:
            # The model is split into its layers, which run one after the other: an own forward (a residual
            # connection, a reshape) is dropped, as upstream did silently. A warning, not an error: a forward that
            # only calls nn.Sequential's (logging, a decorator) computes the same and worked upstream.
            warnings.warn(
                f"`model` argument to `OffloadModel`: {type(model).__name__} overrides nn.Sequential.forward, which "
                "OffloadModel does not run (it splits the model into its layers and runs them in order): whatever "
                "that forward adds to its layers (a residual connection, a reshape) is left out. Pass an "
                "nn.Sequential whose layers compute the model, or its slices as a list of modules",
                UserWarning,
                stacklevel=2,
            )
        if len(model) == 0:
            # A TypeError as upstream's (whose falsiness test took an empty model for None), with a message that fits.
            raise TypeError("`model` argument to `OffloadModel` has no layers: pass an nn.Sequential of at least one.")
        if isinstance(model, list):
            # A list is taken as the slices themselves (upstream's form): each must be a module.
            for i, part in enumerate(model):
                if not isinstance(part, nn.Module):
                    raise TypeError(
                        f"`model` argument to `OffloadModel`: a list must hold the slices as nn.Modules; item {i} "
                        f"is a {type(part).__name__}"
                    )
        if isinstance(device, int) and not accelerator_available():
            # torch.device(0) means the accelerator; say what upstream says for a CUDA device without CUDA.
            raise TypeError("CUDA must be available as one of the compute devices for `OffloadModel`.")
        device = torch.device(device)
        if device.type != "cpu" and not accelerator_available():
            raise TypeError("CUDA must be available as one of the compute devices for `OffloadModel`.")
        # Before the model is split (which pins its parameters): upstream divided by zero or indexed out of range
        # here, or accepted a count that only failed in the first forward.
        _check_count("num_slices", num_slices)
        _check_count("num_microbatches", num_microbatches)
        if not isinstance(checkpoint_activation, (bool, int)) or checkpoint_activation not in (0, 1):
            # A string such as "no" was truthy: upstream checkpointed when asked not to.
            raise TypeError(
                f"`checkpoint_activation` argument to `OffloadModel` must be a bool, got {checkpoint_activation!r}"
            )
        checkpoint_activation = bool(checkpoint_activation)
        if not checkpoint_activation and num_microbatches > 1:
            # Before the split too: the model's parameters were pinned before this was refused.
            raise RuntimeError("We currently only support microbatches with activation checkpointing.")
        self.device = device
        self.offload_device = torch.device(offload_device)
        if self.offload_device.type == "meta":
            # Checked before the model moves there: its weights would be lost, and only the first forward failed.
            raise ValueError(
                "`offload_device` argument to `OffloadModel` is a meta device, which holds no data: the model rests "
                "there between uses, so pass a real device (normally the CPU)"
            )
        if isinstance(model, nn.Sequential):
            slices: List[nn.Module] = [nn.Sequential(*split) for split in _split(model, num_slices)]
        else:
            slices = list(model)
        self.model_slices = [ModelShard(s, self.device, self.offload_device, i) for i, s in enumerate(slices)]
        self._model = nn.Sequential(*self.model_slices)
        self._activations: List[Tuple[Any, ...]] = []
        self._checkpoint_activation = checkpoint_activation
        self._num_microbatches = num_microbatches

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, all or nothing: the load is tried on shape-only tensors first
        (:mod:`fairscale.internal.dry_load`), so a dict that does not fit raises torch's error before any value
        changes (``nn.Module`` copies the entries that fit, then raises).
        """
        return load_state_dict_all_or_nothing(self, state_dict, strict, assign)

    def forward(self, *inputs: Any, **_: Any) -> Any:
        """Run the slices in order; keyword arguments are accepted and ignored (as upstream).

        With checkpointing the input is one tensor or a tuple of tensors, each of which runs through the slices on
        its own (anything else raises ``TypeError``).

        Returns:
            The last slice's output on ``device``: one tensor, or a tuple (a list with checkpointing, one output per
            input tensor) of several. With checkpointing the output's last dim is squeezed when it is 1 (upstream's
            ``squeeze(-1)``).
        """
        # The anchor (and the checkpointed call's dummy) requires grad only when some parameter does: it makes the
        # backward reach the slices when the input does not require grad, and a grad-requiring one made a fully
        # frozen model's output require grad (unlike the plain model), so backward reloaded and recomputed slices
        # for nothing and a loss with nothing to differentiate passed silently.
        trainable = any(p.requires_grad for p in self.parameters())
        # Nothing of the forward is kept on the module (``_activations`` stays empty): upstream kept the last
        # forward's boundary tensors there, which held its autograd graph until the next forward and made
        # ``copy.deepcopy`` of the model fail on their non-leaf tensors. Autograd keeps what the backward needs.
        self._activations = []
        if self._checkpoint_activation:
            values = checkpoint_inputs(inputs)
            out = OffloadFunction.apply(values[0], torch.tensor([], requires_grad=trainable), self, *values[1:])
            # Upstream's types: one tensor, or a list of several.
            return out if isinstance(out, Tensor) else list(out)
        anchor = torch.tensor([], requires_grad=trainable)
        acts: Tuple[Any, ...] = inputs
        for index in range(-1, len(self.model_slices)):
            if index >= 0:
                args = _to(acts, self.device)
                # A tuple output is spread into the next slice's arguments (as upstream: slices given as a list may
                # take several), but an nn.Sequential slice takes one, and gets the tuple whole as nn.Sequential hands
                # it on. Spread there, a pair failed in Sequential.forward, naming neither OffloadModel nor the
                # boundary, wherever the split fell between two layers (a fuzz, session 45).
                whole = index > 0 and len(args) > 1 and type(self.model_slices[index].model_shard) is nn.Sequential
                # Whole, a namedtuple (or PackedSequence) keeps its type (a review, session 45).
                out = self.model_slices[index](*((rebuild_sequence(acts, list(args)),) if whole else args))
                acts = out if isinstance(out, tuple) else (out,)
            # The tensors inside lists and dicts cross the boundary too: passed as one non-tensor, a list's tensors
            # bypassed the Function, whose backward (the neighbours' reload and drop) then never ran (a fuzz, s. 45).
            leaves, spec = tree_flatten(acts)
            acts = tree_unflatten(list(ShardSyncLayer.apply(anchor, index, self.model_slices, self, *leaves)), spec)
        result = _to(acts, self.device)
        return result[0] if len(result) == 1 else result
