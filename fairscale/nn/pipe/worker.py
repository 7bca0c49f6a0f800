# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Worker threads: one per distinct device, each running the tasks queued for the partitions on it."""

import sys
import threading
from contextlib import contextmanager
from queue import Empty, Queue
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Dict, Generator, List, Optional, Tuple, Type, Union, cast

import torch

from fairscale.internal.device import current_accelerator_device

from .microbatch import Batch
from .stream import AbstractStream, use_device, use_stream

__all__ = ["Task", "worker", "create_workers", "join_workers", "spawn_workers"]

ExcInfo = Tuple[Type[BaseException], BaseException, TracebackType]

# In-queue items: a Task, or None to stop the worker. Out-queue items: (True, (task, batch)), (False, exc_info)
# or, when the worker stops, (False, None).
if TYPE_CHECKING:
    InQueueT = Queue[Optional["Task"]]
    OutQueueT = Queue[Tuple[bool, Union[Tuple["Task", Batch], ExcInfo, None]]]
else:
    InQueueT = Queue
    OutQueueT = Queue


class Task:
    """A task for a worker thread: ``compute`` then (on the main thread) ``finalize``.

    Both run under the grad mode in effect when the task was created (the creator's thread), with ``stream``
    current. Only grad mode is carried over, not other thread-local state such as autocast.
    """

    def __init__(
        self,
        stream: Optional[AbstractStream],
        *,
        compute: Callable[[], Batch],
        finalize: Optional[Callable[[Batch], None]],
    ) -> None:
        self.stream = stream
        self._compute = compute
        self._finalize = finalize
        self._grad_enabled = torch.is_grad_enabled()

    def compute(self) -> Batch:
        with use_stream(self.stream), torch.set_grad_enabled(self._grad_enabled):
            return self._compute()

    def finalize(self, batch: Batch) -> None:
        if self._finalize is None:
            return
        with use_stream(self.stream), torch.set_grad_enabled(self._grad_enabled):
            self._finalize(batch)


def worker(in_queue: InQueueT, out_queue: OutQueueT, device: torch.device) -> None:
    """The main loop of a worker thread: run tasks until ``None`` arrives, then report ``(False, None)``."""
    try:
        with use_device(device):
            while True:
                task = in_queue.get()
                if task is None:
                    break
                try:
                    batch = task.compute()
                except BaseException:  # noqa: B902
                    # Not only Exception: a partition raising SystemExit (or a test framework's failure) ended this
                    # thread, its error was lost, and the next forward waited forever on the dead thread's queue.
                    # Signals are delivered to the main thread, so nothing here swallows a Ctrl-C.
                    exc_info = cast(ExcInfo, sys.exc_info())
                    out_queue.put((False, exc_info))
                    del task, exc_info  # see below (the traceback holds the frames' tensors)
                    continue
                out_queue.put((True, (task, batch)))
                # While this thread waits for the next task, its locals kept the last micro-batch (with its graph
                # and skip tracker) alive after the caller dropped the output (a fuzz of Pipe, session 44).
                del task, batch
    finally:
        # Also when the thread itself fails (e.g. the device cannot be made current): the waiting side must wake.
        out_queue.put((False, None))


def _normalize(device: Any) -> Any:
    # Partitions on one device share one thread: "cpu:0" is "cpu", "cuda" is the current CUDA device.
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type == "cpu":
            return torch.device("cpu")
        if device.type != "meta" and device.index is None:
            current = current_accelerator_device()
            return torch.device(device.type, current.index if current is not None else 0)
    return device


def create_workers(devices: List[Any]) -> Tuple[List[InQueueT], List[OutQueueT]]:
    """Start one daemon worker thread per distinct device; return the queues of each input device."""
    in_queues: List[InQueueT] = []
    out_queues: List[OutQueueT] = []
    workers: Dict[Any, Tuple[InQueueT, OutQueueT]] = {}
    for device in devices:
        key = _normalize(device)
        try:
            in_queue, out_queue = workers[key]
        except KeyError:
            in_queue = Queue()
            out_queue = Queue()
            workers[key] = (in_queue, out_queue)
            t = threading.Thread(target=worker, args=(in_queue, out_queue, key), daemon=True)
            t.start()
        in_queues.append(in_queue)
        out_queues.append(out_queue)
    return in_queues, out_queues


def join_workers(in_queues: List[InQueueT], out_queues: List[OutQueueT], timeout: Optional[float] = None) -> None:
    """Stop the workers after the tasks already queued, and wait for them.

    Args:
        timeout (Optional[float]): give up waiting after this many seconds per worker (used at interpreter
            shutdown, when the daemon threads may already be gone); ``None`` waits as long as it takes.
    """
    for in_queue in set(in_queues):
        in_queue.put(None)
    running = set(out_queues)
    while running:
        out_queue = running.pop()
        while True:
            try:
                ok, payload = out_queue.get(timeout=timeout)
            except Empty:
                break
            if not ok and payload is None:
                break


@contextmanager
def spawn_workers(devices: List[Any]) -> Generator[Tuple[List[InQueueT], List[OutQueueT]], None, None]:
    """Context manager: :func:`create_workers`, then :func:`join_workers` on exit (also on an exception)."""
    in_queues, out_queues = create_workers(devices)
    try:
        yield (in_queues, out_queues)
    finally:
        join_workers(in_queues, out_queues)
