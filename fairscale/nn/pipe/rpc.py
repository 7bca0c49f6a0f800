# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``PipeRPCWrapper``: drive every stage of an :class:`~fairscale.nn.pipe.AsyncPipe` from pipeline rank 0 via RPC.

Rank 0 builds its own stage and asks every other pipeline rank (through ``torch.distributed.rpc``) to build theirs;
``forward`` on rank 0 then runs the whole pipeline, and the output (on rank 0) back-propagates through every stage.
It needs ``torch.distributed.rpc.init_rpc`` on every rank and a ``worker_map`` of global rank to worker name.
"""

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fairscale.internal.device import accelerator_available, current_accelerator_device
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleValueError
from fairscale.nn.model_parallel.initialize import get_pipeline_parallel_group as get_pipeline_parallel_group

from .async_pipe import AsyncPipe
from .microbatch import Batch
from .types import EVENT_LOOP_QUEUE as EVENT_LOOP_QUEUE
from .types import PipeMessage as PipeMessage
from .types import TensorOrTensors

__all__ = [
    "PipeRPCWrapper",
    "PipeBackRedirect",
    "callback_with_model",
    "set_device_based_on_group",
    "get_shapes",
    "get_dtype",
    "get_global_ranks_from_group",
    "DEFAULT_MAX_SOURCE_POSITIONS",
    "DEFAULT_MAX_TARGET_POSITIONS",
]

DEFAULT_MAX_SOURCE_POSITIONS = 1024
DEFAULT_MAX_TARGET_POSITIONS = 1024

# The stage of this process when it is driven by a PipeRPCWrapper on rank 0 (one per process, as upstream).
_remote_model: Optional[AsyncPipe] = None
_remote_output: Optional[TensorOrTensors] = None


def _rpc() -> Any:
    from torch.distributed import rpc

    api: Any = rpc.api
    if not (rpc.is_available() and api._is_current_rpc_agent_set()):
        raise RuntimeError(
            "PipeRPCWrapper needs torch.distributed.rpc: call rpc.init_rpc(name, rank=..., world_size=...) on every "
            "rank first, and pass worker_map={global rank: worker name}"
        )
    return rpc


def get_global_ranks_from_group(group: Any) -> List[int]:
    """The global ranks of ``group`` in group-rank order."""
    return list(dist.get_process_group_ranks(group))


def set_device_based_on_group(group: Any) -> None:
    """No-op kept for upstream compatibility: the device is the caller's (upstream set ``cuda:<group rank>``)."""


def get_shapes(tensor: TensorOrTensors) -> Union[torch.Size, List[torch.Size]]:
    """The shape of a tensor, or the shapes of a tuple of tensors."""
    if isinstance(tensor, Tensor):
        return tensor.shape
    return [t.shape for t in tensor]


def get_dtype(tensor: TensorOrTensors) -> Union[torch.dtype, List[torch.dtype]]:
    """The dtype of a tensor, or the dtypes of a tuple of tensors."""
    if isinstance(tensor, Tensor):
        return tensor.dtype
    return [t.dtype for t in tensor]


def _empty_like(shapes: Any, dtypes: Any) -> TensorOrTensors:
    if isinstance(shapes, torch.Size):
        return torch.empty(shapes, dtype=dtypes)
    return tuple(torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes))


def _register_remote_model(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Run (via RPC) on a non-zero pipeline rank: build this rank's stage."""
    global _remote_model
    from fairscale.nn.model_parallel.initialize import get_pipeline_parallel_group

    kwargs = dict(kwargs)
    kwargs["group"] = get_pipeline_parallel_group()
    _remote_model = AsyncPipe(*args, **kwargs)


def _stage() -> AsyncPipe:
    """This rank's stage, built by :func:`_register_remote_model` when rank 0 constructed its PipeRPCWrapper."""
    if _remote_model is None:
        raise FairscaleRuntimeError(
            "no PipeRPCWrapper stage on this rank: construct the PipeRPCWrapper on pipeline rank 0 first (it builds "
            "the stages of the other ranks)"
        )
    return _remote_model


def _run_remote_forward(
    shapes: Any, dtypes: Any, training: bool, grad_enabled: bool = True
) -> Optional[Tuple[Any, Any]]:
    """Run (via RPC) this rank's stage on a placeholder input; the final stage keeps its output.

    ``grad_enabled``: the caller's grad mode (a training-mode forward under ``torch.no_grad()`` waits for no
    gradients, as AsyncPipe's).
    """
    global _remote_output
    model = _stage()
    model.train(training)
    with torch.set_grad_enabled(training and grad_enabled):
        output = model(_empty_like(shapes, dtypes))
    if model.final_stage:
        _remote_output = output
        return get_shapes(output), get_dtype(output)
    return None


def _fetch_output() -> TensorOrTensors:
    """Run (via RPC) on the final stage: its output, detached (it travels back to rank 0)."""
    if _remote_output is None:
        raise FairscaleRuntimeError("PipeRPCWrapper: the final stage holds no output; run forward on rank 0 first")
    if isinstance(_remote_output, Tensor):
        return _remote_output.detach()
    return tuple(t.detach() for t in _remote_output)


def _backward_output(grads: TensorOrTensors) -> None:
    """Run (via RPC) on the final stage: back-propagate the gradients of its output."""
    global _remote_output
    output = _remote_output
    if output is None:
        raise FairscaleRuntimeError(
            "PipeRPCWrapper: the final stage holds no output to back-propagate (backward ran twice, or before forward)"
        )
    _remote_output = None
    outputs = (output,) if isinstance(output, Tensor) else tuple(output)
    grad_list = (grads,) if isinstance(grads, Tensor) else tuple(grads)
    pairs = [(o, g) for o, g in zip(outputs, grad_list) if o.requires_grad]
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def callback_with_model(callback: Callable[[Any, AsyncPipe], None], ctx: Any) -> None:
    """Run (via RPC) ``callback(ctx, model)`` on this rank's stage; errors are printed, as upstream."""
    try:
        model = _stage()
        with model.lock:
            callback(ctx, model)
    except Exception as exc:  # noqa: B902 - upstream prints remote callback errors
        print(f"PipeRPCWrapper callback failed: {exc!r}")


class PipeBackRedirect(torch.autograd.Function):
    """Identity on rank 0 whose backward sends the output gradients to the final stage.

    ``forward(ctx, inputs, dest, event, message, transport, futures)``: ``dest`` is the final stage's RPC worker
    name and ``event`` is set once the gradients are on their way. The gradients travel by RPC here, so
    ``message`` and ``transport`` (upstream's header-less send through the MPI transport) are unused: pass
    ``None``. ``futures``, when a list, receives the future of that RPC.
    """

    @staticmethod
    def forward(
        ctx: Any,
        inputs: Tensor,
        dest: str,
        event: threading.Event,
        message: Optional[PipeMessage],
        transport: Any,
        futures: Optional[List[Any]],
    ) -> Tensor:
        ctx.dest = dest
        ctx.event = event
        ctx.futures = futures
        return inputs.detach()

    @staticmethod
    def backward(ctx: Any, *grad: Tensor) -> Tuple[None, ...]:
        rpc = _rpc()
        # The final stage back-propagates; rank 0's own stage (waiting in its thread) then receives gradients.
        future = rpc.rpc_async(ctx.dest, _backward_output, args=(grad[0],))
        if ctx.futures is not None:
            ctx.futures.append(future)
        ctx.event.set()
        return (None,) * 6


# How long a failed forward waits for this rank's own stage to report its error (it failed first, normally).
_HEAD_JOIN_S = 10.0


class PipeRPCWrapper(nn.Module):
    """An :class:`AsyncPipe` driven entirely from pipeline rank 0 (the other ranks only serve RPCs).

    Takes the same arguments as :class:`AsyncPipe`; ``worker_map`` is required and RPC must be initialised on
    every rank. Must be constructed on pipeline rank 0 only.

    Example::

        model = PipeRPCWrapper(layers, balance, worker_map=worker_map, chunks=4)
        out = model(x)  # on rank 0, whatever the number of stages
        loss_fn(out, y).backward()
        model.foreach_worker(lambda ctx, m: step(m), include_self=True)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        from fairscale.nn.model_parallel.initialize import get_pipeline_parallel_group

        self.group = kwargs.get("group") or get_pipeline_parallel_group()
        if self.group.rank() != 0:
            raise FairscaleValueError(
                f"PipeRPCWrapper must be constructed on pipeline rank 0 only (this is pipeline rank "
                f"{self.group.rank()}): the other ranks build their stages when rank 0 asks them over RPC"
            )
        if self.group is not get_pipeline_parallel_group():
            raise FairscaleValueError(
                "Can't pickle groups, so group must be `get_pipeline_parallel_group()`: the other ranks find their "
                "group there (set it up with fairscale.nn.model_parallel.initialize_model_parallel)"
            )
        if kwargs.get("worker_map") is None:
            raise ValueError("PipeRPCWrapper requires worker_map={global rank: RPC worker name}")
        rpc = _rpc()
        self.worker_map: Dict[int, str] = kwargs["worker_map"]
        kwargs["group"] = None
        if accelerator_available():
            kwargs["input_device"] = current_accelerator_device()
        self.lock = threading.Lock()
        # Work of the previous forward that completes only with its backward (non-final stages, rank 0's stage).
        self._pending: List[Any] = []
        self._head: Optional[threading.Thread] = None
        self._head_errors: List[BaseException] = []
        # Set by the backward of the last training output (PipeBackRedirect); None when nothing waits for one.
        self._backward_sent: Optional[threading.Event] = None
        remote_kwargs = dict(kwargs)
        futures = [
            rpc.rpc_async(self.worker_map[rank], _register_remote_model, args=(args, remote_kwargs))
            for rank in get_global_ranks_from_group(self.group)[1:]
        ]
        kwargs["group"] = self.group
        self.model = AsyncPipe(*args, **kwargs)
        for future in futures:
            future.wait()

    def _wait_previous(self) -> None:
        """Wait for the previous forward's stages to finish (their backward, in training).

        Raises:
            RuntimeError: the previous training forward's output has not been back-propagated: its stages wait for
                those gradients, so waiting here would hang (nothing is waited for; back-propagate it, then retry).
        """
        sent = self._backward_sent
        if sent is not None and not sent.is_set():
            raise FairscaleRuntimeError(
                "PipeRPCWrapper: the previous training forward's output has not been back-propagated, and every stage "
                "waits for its gradients; call backward on a loss computed from it before the next forward or "
                "foreach_worker (use torch.no_grad() or eval() for forwards without backward)"
            )
        self._backward_sent = None
        for future in self._pending:
            future.wait()
        self._pending = []
        if self._head is not None:
            self._head.join()
            self._head = None
            if self._head_errors:
                raise self._head_errors[0]

    @property
    def final_stage(self) -> bool:
        return self.model.final_stage

    def foreach_worker(
        self, callback: Callable[[Any, AsyncPipe], None], ctx: Any = None, *, include_self: bool = False
    ) -> None:
        """Run ``callback(ctx, model)`` on every other stage (and this one with ``include_self``)."""
        rpc = _rpc()
        self._wait_previous()
        futures = [
            rpc.rpc_async(self.worker_map[rank], callback_with_model, args=(callback, ctx))
            for rank in get_global_ranks_from_group(self.group)[1:]
        ]
        for future in futures:
            future.wait()
        if include_self:
            with self.model.lock:
                callback(ctx, self.model)

    def forward(self, tensor: TensorOrTensors) -> TensorOrTensors:
        shapes = get_shapes(tensor)
        dtypes = get_dtype(tensor)
        if self.model.final_stage:
            return self.model(tensor)
        rpc = _rpc()
        self._wait_previous()
        ranks = get_global_ranks_from_group(self.group)
        # Under torch.no_grad() nothing waits for gradients (the stages used self.training alone: a training-mode
        # forward under no_grad, whose output has no graph to back-propagate, left every stage waiting for good).
        with_grad = self.training and torch.is_grad_enabled()
        futures = [
            rpc.rpc_async(
                self.worker_map[rank],
                _run_remote_forward,
                args=(shapes, dtypes, self.training, torch.is_grad_enabled()),
            )
            for rank in ranks[1:]
        ]
        event = threading.Event()
        errors: List[BaseException] = []

        def run_head() -> None:
            try:
                with torch.set_grad_enabled(with_grad):
                    self.model(tensor, event=event)
            except BaseException as exc:  # noqa: B902 - re-raised on the caller's thread
                errors.append(exc)

        head = threading.Thread(target=run_head, daemon=True)
        head.start()
        # The final stage returns once its forward is done; in training the others return only after the backward.
        try:
            futures[-1].wait()
        except BaseException as failure:  # noqa: B902 - re-raised, or replaced by the cause it reports
            # The final stage stopped because an earlier one failed; when that is this rank's own stage, its error
            # is what went wrong (only "stage 0 failed ... see that rank's error" reached the caller; found by a fuzz).
            head.join(timeout=_HEAD_JOIN_S)
            if errors:
                raise errors[0] from failure
            raise
        final_name = self.worker_map[ranks[-1]]
        output = rpc.rpc_sync(final_name, _fetch_output)
        self._pending = futures[:-1]
        self._head = head
        self._head_errors = errors
        if not with_grad:
            self._wait_previous()
            return output
        if isinstance(output, Tensor):
            # The backward's RPC future joins the pending ones: the next forward (or foreach_worker) waits until the
            # final stage's backward has returned there, not only until the head received its gradients (which the
            # final stage sends before its backward returns; a forward arriving in between found the step unfinished).
            self._backward_sent = event
            return PipeBackRedirect.apply(output.requires_grad_(), final_name, event, None, None, self._pending)
        raise TypeError("PipeRPCWrapper supports a single output tensor in training")
