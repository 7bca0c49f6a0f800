# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Transports of :class:`~fairscale.nn.pipe.types.PipeMessage` between pipeline stages.

* :class:`SendRecvTransport`: point-to-point send/recv on the pipeline process group (through
  :mod:`fairscale.internal.collectives`). The header travels as a fixed-size pickled ``uint8`` tensor tagged with
  the queue id and is received from any rank; tensor ``k`` follows with tag ``message.tag + k``. Receiving from
  any rank needs gloo (or MPI): NCCL groups must use RPC. Under PyTorch's collective checker
  (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) the messages travel on a twin of the pipeline group instead, so that they
  leave the sequence numbers of its collectives alone (see :func:`fairscale.internal.collectives.p2p_group`).
* :class:`RpcTransport`: ``torch.distributed.rpc`` pushes the whole message (tensors on CPU) onto the receiver's
  in-process queues. Needs ``rpc.init_rpc`` on every rank and a ``worker_map`` of rank to worker name.
"""

import os
import pickle
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from queue import Empty, Queue
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from fairscale.internal import collectives
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleValueError
from fairscale.internal.object import pyobject_to_tensor as pyobject_to_tensor
from fairscale.internal.object import tensor_to_pyobject as tensor_to_pyobject
from fairscale.nn.model_parallel.initialize import get_pipeline_parallel_group as get_pipeline_parallel_group

from .types import EVENT_LOOP_QUEUE, MESSAGE_GENERATION_START, InputDevice, PipeMessage, Tensors

__all__ = [
    "Transport",
    "RpcTransport",
    "SendRecvTransport",
    "MakeTransport",
    "MessageQueues",
    "MESSAGE_TENSOR_SIZE",
    "rpc_push_queue",
    "to_input_device",
    "TRANSPORT_ENV",
]

#: Bytes of a pickled message header on the wire.
MESSAGE_TENSOR_SIZE = 1024

#: Set to ``rpc`` or ``sendrecv`` to choose the transport of :class:`~fairscale.nn.pipe.AsyncPipe` explicitly.
TRANSPORT_ENV = "FAIRSCALE_PIPE_TRANSPORT"

#: This process's incoming message queues (filled by :func:`rpc_push_queue`), one per queue id.
MessageQueues: List["Queue[PipeMessage]"] = [Queue() for _ in range(MESSAGE_GENERATION_START)]


def to_input_device(tensors: Tensors, input_device: InputDevice) -> Tensors:
    """Move ``tensors`` to ``input_device`` (unchanged when it is ``None``)."""
    if input_device is None:
        return tensors
    return tuple(t.to(input_device) for t in tensors)


def rpc_push_queue(message: PipeMessage) -> None:
    """Run (through RPC) on the receiving process: queue ``message`` for its event loop."""
    MessageQueues[message.queue_name].put(message)


@dataclass(frozen=True)
class Transport(ABC):
    """Sends and receives pipeline messages.

    Attributes:
        worker_map: global rank to RPC worker name (RPC transport only).
        input_device: where received tensors are placed (``None``: where they arrive).
        group: the pipeline process group (send/recv transport only).
    """

    worker_map: Optional[Dict[int, str]]
    input_device: InputDevice

    def recv_message(self, queue_name: int, *, nowait: bool = False) -> PipeMessage:
        """Receive a whole message (header and tensors) from queue ``queue_name``."""
        message = self.recv_message_header(queue_name, nowait)
        return self.recv_message_tensors(message)

    @abstractmethod
    def recv_message_header(self, queue_name: int, nowait: bool = False) -> PipeMessage:
        """Receive the next header of queue ``queue_name`` (``queue.Empty`` with ``nowait`` when none is ready)."""

    @abstractmethod
    def recv_message_tensors(self, message: PipeMessage) -> PipeMessage:
        """Fill in (or relocate) the tensors of a received header."""

    @abstractmethod
    def send_message(self, message: PipeMessage, sync: bool = False, skip_header: bool = False) -> None:
        """Send ``message`` to ``message.dest``."""

    @abstractmethod
    def get_out_of_order(self, queue_name: int, index: int) -> Tensors:
        """The tensors of the message of queue ``queue_name`` whose ``args`` equal ``index``."""

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every message this process sent was received (nothing to wait for by default).

        Args:
            timeout (Optional[float]): give up after this many seconds (``None``: wait as long as it takes).

        Returns:
            bool: ``True`` when nothing is left in flight, ``False`` when ``timeout`` passed first.
        """
        return True


@dataclass(frozen=True)
class RpcTransport(Transport):
    def send_message(self, message: PipeMessage, sync: bool = False, skip_header: bool = False) -> None:
        from torch.distributed import rpc

        if self.worker_map is None:
            raise FairscaleValueError(
                "RpcTransport needs a worker_map {global rank: RPC worker name} to send messages; build it with "
                "MakeTransport(use_rpc=True, worker_map=...)"
            )
        message.tensors = tuple(t.cpu() for t in message.tensors)
        name = self.worker_map[message.dest]
        if sync:
            rpc.rpc_sync(name, rpc_push_queue, args=(message,))
        else:
            rpc.rpc_async(name, rpc_push_queue, args=(message,))

    def recv_message_header(self, queue_name: int, nowait: bool = False) -> PipeMessage:
        queue = MessageQueues[queue_name]
        return queue.get_nowait() if nowait else queue.get()

    def recv_message_tensors(self, message: PipeMessage) -> PipeMessage:
        # The tensors travelled inside the message; only their device may change.
        message.tensors = to_input_device(message.tensors, self.input_device)
        return message

    def get_out_of_order(self, queue_name: int, index: int) -> Tensors:
        queue = MessageQueues[queue_name]
        while True:
            message = self.recv_message(queue_name)
            if message.args == index:
                return message.tensors
            queue.put(message)


class _Sender:
    """A daemon thread that performs this process's sends, in order.

    A gloo send returns only once the peer received it. Sending from the event loop would let a stage that
    failed (and stopped receiving) block its neighbours forever, before they could read its abort message; with
    the sends on this thread, the event loop only ever blocks on receives.

    Nothing waits for a daemon thread when the interpreter exits: a send still queued or in progress then is lost
    (and a gloo send cut off mid-way aborts the process). :meth:`flush` is how the pipeline makes sure none is left
    before ``forward`` or the last stage's backward returns.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.pid = os.getpid()
        # ``None`` asks the thread to end (see :func:`_sender`).
        self.queue: "Queue[Optional[Tuple[int, List[Tuple[Tensor, int]]]]]" = Queue()
        self.error: Optional[BaseException] = None
        # Messages put and not yet completely sent (or failed), guarded by ``done``.
        self.pending = 0
        self.done = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="fairscale-pipe-sender", daemon=True)
        self.thread.start()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"an earlier pipeline send to another stage failed: {self.error!r}. The stages' message streams are "
                "out of step now; restart the processes"
            ) from self.error

    def put(self, dest: int, items: List[Tuple[Tensor, int]]) -> None:
        self._raise_error()
        with self.done:
            self.pending += 1
        self.queue.put((dest, items))

    def _loop(self) -> None:
        while True:
            work = self.queue.get()
            if work is None:
                return
            dest, items = work
            try:
                for tensor, tag in items:
                    collectives.send(tensor, dest, group=self.group, tag=tag)
            except Exception as exc:  # noqa: B902 - reported by the next put() or flush()
                self.error = exc
            finally:
                with self.done:
                    self.pending -= 1
                    self.done.notify_all()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued send was received by its peer.

        Args:
            timeout (Optional[float]): give up after this many seconds (``None``: wait as long as it takes).

        Returns:
            bool: ``True`` when nothing is left to send, ``False`` when ``timeout`` passed first.

        Raises:
            RuntimeError: a send failed (its peer is gone, say).
        """
        with self.done:
            if not self.done.wait_for(lambda: self.pending == 0, timeout):
                return False
        self._raise_error()
        return True


_senders: Dict[int, _Sender] = {}
_senders_lock = threading.Lock()


def _sender(group: Any) -> _Sender:
    with _senders_lock:
        sender = _senders.get(id(group))
        # A forked child inherits the dict but not the thread: start its own.
        if sender is None or sender.group is not group or sender.pid != os.getpid():
            _forget_destroyed_senders()
            sender = _senders[id(group)] = _Sender(group)
        return sender


def _forget_destroyed_senders() -> None:
    """End the threads of the groups torch destroyed (or of their twins, see ``p2p_group_retired``): each held its
    group (threads and sockets with gloo) for the rest of the process, so a process that re-initialised the world per
    trial gathered them. Their queues are empty: a pipeline flushes its sends before ``forward`` or the last stage's
    backward returns."""
    for key, sender in list(_senders.items()):
        if collectives.p2p_group_retired(sender.group):
            if sender.pid == os.getpid():  # a forked child's copy has no thread (and its queue's lock may be held)
                sender.queue.put(None)
            del _senders[key]


@dataclass(frozen=True)
class SendRecvTransport(Transport):
    """Point-to-point messages between the stages (see the module docstring).

    Attributes:
        group: the pipeline process group.
        p2p_group: the group that carries the messages: ``group`` when ``None``, else its twin from
            :func:`fairscale.internal.collectives.p2p_group` (which :func:`MakeTransport` chooses).
    """

    group: Any = None
    p2p_group: Any = None

    @property
    def _wire(self) -> Any:
        return self.group if self.p2p_group is None else self.p2p_group

    def send_message(self, message: PipeMessage, sync: bool = False, skip_header: bool = False) -> None:
        """Queue ``message`` on this process's sender thread (see :class:`_Sender`); ``sync`` does not block."""
        # gloo sends CPU tensors; the receiver moves them to its input device.
        tensors = tuple(t.detach().cpu().contiguous() for t in message.tensors)
        message.tensor_shapes = [t.shape for t in tensors]
        message.tensor_dtypes = [t.dtype for t in tensors]
        items: List[Tuple[Tensor, int]] = []
        if not skip_header:
            header = PipeMessage.__new__(PipeMessage)
            header.__dict__.update(message.__dict__)
            header.tensors = tuple()
            items.append((_pickle_header(header), message.queue_name))
        items.extend((tensor, message.tag + index) for index, tensor in enumerate(tensors))
        _sender(self._wire).put(message.dest, items)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Block until every message this process sent on the group was received (see :meth:`_Sender.flush`)."""
        return _sender(self._wire).flush(timeout)

    def recv_message_header(self, queue_name: int, nowait: bool = False) -> PipeMessage:
        if nowait:
            raise Empty()
        buffer = torch.empty(MESSAGE_TENSOR_SIZE, dtype=torch.uint8)
        collectives.recv(buffer, None, group=self._wire, tag=queue_name)
        return _unpickle_header(buffer)

    def recv_message_tensors(self, message: PipeMessage) -> PipeMessage:
        tensors = []
        for index, (shape, dtype) in enumerate(zip(message.tensor_shapes, message.tensor_dtypes)):
            t = torch.empty(shape, dtype=dtype)
            collectives.recv(t, message.src, group=self._wire, tag=message.tag + index)
            tensors.append(t)
        message.tensors = to_input_device(tuple(tensors), self.input_device)
        return message

    def get_out_of_order(self, queue_name: int, index: int) -> Tensors:
        message = self.recv_message(queue_name)
        if message.args != index:
            # Point-to-point messages arrive in order: a different one means the stages are out of step.
            raise FairscaleRuntimeError(
                f"pipeline messages out of order on queue {queue_name}: expected the message of {index}, got "
                f"{message.args} (do all stages run the same number of micro-batches?)"
            )
        return message.tensors


def _pickle_header(message: PipeMessage) -> Tensor:
    data = pickle.dumps(message)
    if len(data) > MESSAGE_TENSOR_SIZE:
        raise ValueError(
            f"message too big to send, increase `fixed_buffer_size`? - {len(data)} > {MESSAGE_TENSOR_SIZE}"
        )
    buffer = torch.zeros(MESSAGE_TENSOR_SIZE, dtype=torch.uint8)
    buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buffer


def _unpickle_header(buffer: Tensor) -> PipeMessage:
    message = pickle.loads(buffer.numpy().tobytes())
    if not isinstance(message, PipeMessage):
        raise FairscaleRuntimeError(
            f"received a {type(message).__name__} where a pipeline message header was expected: another user of "
            "the pipeline group sent on the pipeline's tags"
        )
    return message


def use_rpc_by_default(worker_map: Optional[Dict[int, str]]) -> bool:
    """Which transport :class:`~fairscale.nn.pipe.AsyncPipe` uses.

    ``FAIRSCALE_PIPE_TRANSPORT`` (``rpc`` / ``sendrecv``) wins; ``FORCE_RPC`` selects RPC as upstream. Otherwise RPC
    when RPC is initialised (as upstream, which used RPC whenever it was not launched by MPI: a missing
    ``worker_map`` then raises upstream's ``ValueError``), else point-to-point send/recv on the pipeline group.
    """
    chosen = os.environ.get(TRANSPORT_ENV, "").lower()
    if chosen in ("rpc", "sendrecv"):
        return chosen == "rpc"
    if chosen:
        raise ValueError(f"{TRANSPORT_ENV} must be 'rpc' or 'sendrecv', not {chosen!r}")
    if "FORCE_RPC" in os.environ:
        return True
    return _rpc_initialized()


def _rpc_initialized() -> bool:
    try:
        from torch.distributed import rpc

        api: Any = rpc.api
        return bool(rpc.is_available() and api._is_current_rpc_agent_set())
    except (ImportError, AttributeError):
        return False


def MakeTransport(
    use_rpc: bool, worker_map: Optional[Dict[int, str]], input_device: InputDevice, group: Any = None
) -> Transport:
    """Build the transport: RPC (needs ``worker_map``) or send/recv on ``group``.

    Where PyTorch's collective checker wraps ``group``, the send/recv transport carries the messages on a twin of it
    (:func:`fairscale.internal.collectives.p2p_group`), created at the first call for the group: that one is
    collective over the group (``AsyncPipe``'s constructor makes it on every rank of the group beforehand).
    """
    if use_rpc:
        if worker_map is None:
            raise ValueError(
                "'RpcTransport' requires 'worker_map' to be set: torch RPC is initialised, so AsyncPipe sends "
                "through it; pass worker_map={global rank: RPC worker name}, or set "
                f"{TRANSPORT_ENV}=sendrecv for point-to-point send/recv on a gloo pipeline group"
            )
        return RpcTransport(worker_map, input_device)
    wire = collectives.p2p_group(group)
    return SendRecvTransport(worker_map, input_device, group, None if wire is group else wire)
