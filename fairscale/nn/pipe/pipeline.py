# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The single-process pipeline engine: runs micro-batches through partitions in clock cycles.

At clock cycle ``k`` every ``(micro-batch i, partition j)`` with ``i + j == k`` runs, each partition on the worker
thread of its device. Between cycles the main thread "fences" the next cycle: it copies activations (and skip
tensors) to the next partition's device and adds the phony dependencies that make the backward pass of each
partition process the micro-batches in reverse order.
"""

import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.profiler import record_function

from .checkpoint import Checkpointing, TrainingFlags, _first_grad_index, holds_grad_tensor, training_flags_of
from .copy import Copy, Wait
from .dependency import fork, join
from .microbatch import Batch, TensorOrTensors, check
from .skip.layout import SkipLayout
from .skip.tracker import SkipTrackerThroughPotals, use_skip_tracker
from .stream import AbstractStream, current_stream, new_stream, use_device
from .worker import ExcInfo, InQueueT, OutQueueT, Task, create_workers
from .worker import join_workers as join_workers  # upstream exported it from this module too

__all__ = ["Pipeline", "clock_cycles", "depend", "copy", "wait"]

Schedule = List[Tuple[int, int]]


def depend(fork_from: Batch, join_to: Batch) -> None:
    """Make the backward of ``fork_from`` wait for the backward of ``join_to`` (both updated in place).

    Nothing to order when no tensor of ``join_to`` requires grad: its backward never reaches this partition. Joining
    the grad-requiring phony there anyway made the partition's input require grad where ``nn.Sequential``'s does not,
    so autograd recorded what the plain model does not (an in-place op after a frozen stretch then failed in backward;
    found by a fuzz of Pipe, session 43). The fork and join sit on the first tensor autograd follows (upstream used
    the first tensor, which may be an integer one).
    """
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in join_to):
        return
    i = _first_grad_index(fork_from)
    fork_from[i], phony = fork(fork_from[i])
    j = _first_grad_index(join_to)
    join_to[j] = join(join_to[j], phony)


def _detach_non_float(batch: Batch) -> None:
    # Integer and boolean tensors cannot carry gradients; keep them out of autograd's way.
    batch[:] = tuple(x if x.is_floating_point() else x.detach() for x in batch)


def copy(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    """Move ``batch`` (in place) to the device of ``next_stream``, autograd-aware."""
    batch[:] = Copy.apply(prev_stream, next_stream, *batch)
    _detach_non_float(batch)


def wait(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    """Make ``next_stream`` wait for ``prev_stream`` before ``batch`` (in place) is used on it."""
    batch[:] = Wait.apply(prev_stream, next_stream, *batch)
    _detach_non_float(batch)


def clock_cycles(m: int, n: int) -> Iterable[Schedule]:
    """The schedule of ``m`` micro-batches on ``n`` partitions: per cycle ``k``, the ``(i, j)`` with ``i + j == k``.

    Within a cycle the pairs are ordered by partition ``j`` ascending. For ``m = 3``, ``n = 3``::

        [(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1), (0, 2)], [(2, 1), (1, 2)], [(2, 2)]
    """
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]


class Pipeline:
    """Runs micro-batches through partitions in lock-step clock cycles (see the module docstring).

    Worker threads are started at construction and stopped when the pipeline is garbage-collected. A copy
    (``copy.deepcopy``) or an unpickled pipeline starts worker threads and copy streams of its own.
    """

    def __init__(
        self,
        partitions: List[nn.Sequential],
        devices: List[torch.device],
        copy_streams: List[List[AbstractStream]],
        skip_layout: SkipLayout,
        checkpoint_stop: int,
    ) -> None:
        self.partitions = partitions
        self.devices = devices
        self.copy_streams = copy_streams
        self.skip_layout = skip_layout
        self.checkpoint_stop = checkpoint_stop
        # During run(): each partition's modules' training flags, which checkpointed recomputations replay.
        self._training_flags: Optional[List[TrainingFlags]] = None
        self._holds_grad: Optional[List[bool]] = None
        self.in_queues: List[InQueueT]
        self.out_queues: List[OutQueueT]
        self.in_queues, self.out_queues = create_workers(devices)
        self._owner_pid = os.getpid()

    def __del__(self) -> None:
        in_queues: Optional[List[InQueueT]] = getattr(self, "in_queues", None)
        if in_queues is None or getattr(self, "_owner_pid", None) != os.getpid():
            # Not built in this process: a forked child inherits the object but not its worker threads (and may
            # collect it as garbage), so there is nobody to stop.
            return
        # Ask the workers to stop after what is queued, but never wait for them here: a finalizer runs wherever the
        # garbage collector happens to run, at interpreter shutdown (daemon threads no longer run, which is what hung
        # upstream's interpreters at exit) or inside one of these very worker threads, where waiting for the
        # thread's own reply can never end.
        for in_queue in set(in_queues):
            in_queue.put(None)

    # Queues (thread locks) and accelerator streams cannot be pickled or deep-copied ("cannot pickle
    # '_thread.lock' object" made a Pipe impossible to copy or save whole), and a copy sharing the original's
    # workers would interleave its tasks with the original's: they are left out and made anew on the other side.
    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("in_queues", "out_queues", "_owner_pid"):
            state.pop(name, None)
        state["copy_streams"] = [len(streams) for streams in self.copy_streams]
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        counts: List[int] = state["copy_streams"]
        self.copy_streams = [[new_stream(d) for _ in range(n)] for d, n in zip(self.devices, counts)]
        self.in_queues, self.out_queues = create_workers(self.devices)
        self._owner_pid = os.getpid()

    def _restart_workers(self) -> None:
        for in_queue in set(self.in_queues):
            in_queue.put(None)  # the threads still alive finish what is queued, then stop
        self.in_queues, self.out_queues = create_workers(self.devices)

    def run(self, batches: List[Batch]) -> None:
        """Run the pipeline on ``batches``, replacing each by its output (in place)."""
        m = len(batches)
        n = len(self.partitions)
        skip_trackers = [SkipTrackerThroughPotals(self.skip_layout, i) for i in range(m)]
        # The modes the checkpointed micro-batches' recomputations replay: one walk over each partition per forward
        # (a walk per micro-batch cost about 0.5 ms per 1000 modules, on the workers, holding the GIL).
        checkpointing = self.checkpoint_stop > 0 and self.partitions[0].training
        self._training_flags = [training_flags_of(p) for p in self.partitions] if checkpointing else None
        # Whether each partition computes with a tensor that requires grad (looked at once per forward): a partition
        # that holds none, given an input that requires none, is not checkpointed. Autograd records nothing there,
        # so checkpointing saves nothing, and its output required grad (the checkpoint's phony) where the plain
        # model's does not: a backward recomputed such partitions for nothing, and an in-place op after a saved
        # activation further on failed ("modified by an inplace operation"; a frozen stretch, found by a fuzz of
        # Pipe, session 43). Run plainly, autograd decides, also for a learnable tensor the walk cannot see.
        self._holds_grad = [holds_grad_tensor(part) for part in self.partitions] if checkpointing else None
        for tracker in skip_trackers:
            tracker.reserve_per_pop = True  # see compute()
        try:
            for schedule in clock_cycles(m, n):
                self.fence(batches, schedule, skip_trackers)
                self.compute(batches, schedule, skip_trackers)
        finally:
            self._training_flags = None
            self._holds_grad = None

    def fence(self, batches: List[Batch], schedule: Schedule, skip_trackers: List[SkipTrackerThroughPotals]) -> None:
        """Copy what the tasks of ``schedule`` need onto their devices; order the backward of micro-batches."""
        copy_streams = self.copy_streams
        skip_layout = self.skip_layout
        for i, j in schedule:
            # Partition j must process the gradient of micro-batch i before that of micro-batch i - 1.
            if i != 0 and j != 0:
                depend(batches[i - 1], batches[i])
            next_stream = copy_streams[j][i]
            for prev_j, ns, name in skip_layout.copy_policy(j):
                prev_stream = copy_streams[prev_j][i]
                skip_trackers[i].copy(batches[i], prev_stream, next_stream, ns, name)
            if j != 0:
                prev_stream = copy_streams[j - 1][i]
                copy(batches[i], prev_stream, next_stream)

    def compute(self, batches: List[Batch], schedule: Schedule, skip_trackers: List[SkipTrackerThroughPotals]) -> None:
        """Run the tasks of one clock cycle on the workers; re-raise the first failure after all have finished."""
        partitions = self.partitions
        devices = self.devices
        copy_streams = self.copy_streams
        checkpoint_stop = self.checkpoint_stop if partitions[0].training else 0
        n = len(partitions)
        streams = [current_stream(d) for d in devices]

        for i, j in schedule:
            batch = batches[i]
            if j != 0:
                wait(batch, copy_streams[j][i], streams[j])
            flags = self._training_flags[j] if self._training_flags is not None else None
            holds_grad = self._holds_grad
            checkpoint = i < checkpoint_stop and (
                holds_grad is None or holds_grad[j] or any(x.requires_grad for x in batch)
            )
            if checkpoint:
                # The pops of this partition hand their skip tensors out once more, in the recomputation.
                for _, ns, name in self.skip_layout.copy_policy(j):
                    skip_trackers[i].reserve_recompute(ns, name)
            task = _make_task(batch, partitions[j], skip_trackers[i], streams[j], i, j, checkpoint, flags)
            self.in_queues[j].put(task)

        exc_info: Optional[ExcInfo] = None
        for i, j in schedule:
            ok, payload = self.out_queues[j].get()
            # After a failure, drain the other results of this cycle without finalizing them.
            if exc_info is not None:
                continue
            if not ok:
                if payload is None:
                    # New workers for the next call: waiting on this one's queue would never end.
                    self._restart_workers()
                    raise RuntimeError(f"the worker thread of device {devices[j]} stopped unexpectedly")
                exc_info = payload  # type: ignore[assignment]
                continue
            task, batch = payload  # type: ignore[misc]
            if j != n - 1:
                wait(batch, streams[j], copy_streams[j][i])
            with use_device(devices[j]):
                task.finalize(batch)
            batches[i] = batch

        if exc_info is not None:
            raise exc_info[1].with_traceback(exc_info[2])


def _make_task(
    batch: Batch,
    partition: nn.Sequential,
    skip_tracker: SkipTrackerThroughPotals,
    stream: AbstractStream,
    chunk_id: int,
    part_id: int,
    checkpoint: bool,
    training_flags: Optional[TrainingFlags] = None,
) -> Task:
    def function(input: TensorOrTensors) -> TensorOrTensors:
        with use_skip_tracker(skip_tracker), record_function(f"chunk{chunk_id}-part{part_id}"):
            output = partition(input)
        # Outputs cross a partition boundary (or are concatenated): only tensors and tuples of tensors can.
        _check_output(output, part_id)
        return output

    if checkpoint:
        chk = Checkpointing(function, batch, partition, training_flags)
        return Task(stream, compute=chk.checkpoint, finalize=chk.recompute)

    def compute() -> Batch:
        return batch.call(function)

    return Task(stream, compute=compute, finalize=None)


def _check_output(output: object, part_id: int) -> None:
    try:
        check(output)
    except TypeError as exc:
        raise TypeError(f"{exc} (output of partition {part_id}: partitions must return a tensor or a tuple of tensors)")
    if isinstance(output, tuple) and not output:  # was a bare IndexError in the next partition's dependency
        raise TypeError(f"output of partition {part_id} is an empty tuple: return a tensor or a tuple of tensors")
    if isinstance(output, tuple) and not all(isinstance(x, Tensor) for x in output):
        raise TypeError(f"expected Tensor, but got tuple (output of partition {part_id} contains a nested tuple)")
