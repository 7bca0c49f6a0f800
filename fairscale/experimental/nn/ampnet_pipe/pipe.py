# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``AMPnetPipe``: asynchronous (AMPnet, stale weights) training over a multi-process pipeline."""

from typing import Any, List, Optional

from fairscale.internal.agreement import check_outcome_agrees, check_ranks_agree
from fairscale.nn.pipe.async_pipe import AsyncPipe
from fairscale.nn.pipe.async_schedule import PipelineAbortedError

from .ampnet import AsyncAMPnetEventLoop

__all__ = ["AMPnetPipe"]

#: What ``interleave`` calls on its ``transform_logger_object``.
_LOGGER_METHODS = (
    "transform_input",
    "transform_target",
    "transform_output_before_loss",
    "log_loss",
    "check_and_save_weights",
)


class AMPnetPipe(AsyncPipe):
    """AMPnet training (arXiv 1705.09786) on top of :class:`~fairscale.nn.pipe.AsyncPipe`.

    Constructed with the keyword arguments of ``AsyncPipe`` (``module``, ``balance``, ``group``, ``worker_map``,
    ``input_device``, ``chunks``, ``checkpoint``, ``deferred_batch_norm``); one process per stage. Instead of
    ``forward``, every stage calls :meth:`interleave` once per epoch with the same data loader; each item of the
    loader is one micro-batch. Stages do not wait for a whole mini-batch: each steps its own optimizer as soon as
    enough gradients went through it, so the weights a micro-batch sees are up to a few updates stale::

        pipe = AMPnetPipe(module=model, balance=[2, 2], group=group, chunks=10, checkpoint="never")
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
        pipe.interleave(loader, nn.MSELoss(), optimizer, logger)

    Skip connections across stages are not supported.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def interleave(
        self,
        lm_dataloader: Any,
        criterion: Any,
        optimizer: Any,
        transform_logger_object: Any,
        min_update_interval: int = 1,
        weight_prediction: bool = False,
    ) -> None:
        """Train one epoch over ``lm_dataloader``.

        Args:
            lm_dataloader: a sized iterable of batches, the same length on every stage; the first and the last
                stage each take exactly ``len(lm_dataloader)`` items (extra ones are left, with a warning). The
                first stage feeds ``transform_logger_object.transform_input(batch)`` to its partition; the last one
                compares its output with ``transform_target(batch)``.
            criterion: the loss function ``criterion(output, target)`` (used on the last stage).
            optimizer: this stage's optimizer (``None``: no steps); it steps after every
                ``min_update_interval`` micro-batches went backward through the stage, then ``zero_grad()``.
            transform_logger_object: provides ``transform_input(batch)``, ``transform_target(batch)``,
                ``transform_output_before_loss(output)``, ``log_loss(batch, loss, count)`` (last stage, after
                each micro-batch) and ``check_and_save_weights(count)`` (after each optimizer step).
            min_update_interval (int): micro-batches per optimizer step (default ``1``).
            weight_prediction (bool): call ``optimizer.update_weight_using_future_predictions(rank,
                num_stages, count, chunks, forward=...)`` before each forward and backward, and step every
                ``chunks`` micro-batches instead.

        Raises:
            ValueError: bad arguments (one stage, ``min_update_interval < 1``, a logger or optimizer lacking the
                methods used, a loader without ``len``), or this stage's loader yielded fewer items than its
                ``len()`` (the other stages then raise ``PipelineAbortedError``).
            RanksDisagreeError: the stages' loaders have other lengths, or they differ in balance or chunks (raised on
                every stage; checked when every rank of a gloo or MPI group holds a stage).
            RuntimeError: another stage's arguments were bad (it raised the ``ValueError``).
            PipelineAbortedError: another stage failed.
        """
        if self.pipeline is None:
            return  # this rank holds no stage
        self._check_epoch(lm_dataloader, optimizer, transform_logger_object, min_update_interval, weight_prediction)
        event_loop = AsyncAMPnetEventLoop(
            self.partitions,
            self.group,
            self.pipeline.transport,
            min_update_interval,
            weight_prediction,
            self.pipeline.checkpoint_stop,
            self.input_device,
            self.chunks,
        )
        # Ranks of the group past the balance hold no stage (they returned above).
        event_loop.num_stages = len(self.balance)
        args = (lm_dataloader, criterion, optimizer, transform_logger_object)
        try:
            if self.group.rank() == 0:
                event_loop.event_loop_head_across_minibatches(*args)
            elif self.final_stage:
                event_loop.event_loop_tail_across_minibatches(*args)
            else:
                event_loop.event_loop_across_minibatches(*args)
        except PipelineAbortedError:
            raise
        except Exception:
            # Stop the other stages too: they would wait for this one's messages forever.
            event_loop.fail_over()
            raise

    def _check_epoch(
        self, lm_dataloader: Any, optimizer: Any, logger: Any, min_update_interval: int, weight_prediction: bool
    ) -> None:
        """Check the arguments here, then, where the group allows (as ``AsyncPipe``'s first step), that every stage
        got good ones and loaders of one length: a stage waits for as many messages as its loader has batches, so
        one that stopped or runs another count would leave the others waiting forever. Two small collectives per
        epoch (none where the group cannot agree)."""
        error: Optional[Exception] = None
        try:
            _check_arguments(self, lm_dataloader, optimizer, logger, min_update_interval, weight_prediction)
        except ValueError as e:
            error = e
        if not self._group_can_agree():
            if error is not None:
                raise error
            return
        check_outcome_agrees("AMPnetPipe.interleave: the argument check", error, self.group)
        check_ranks_agree(
            "AMPnetPipe.interleave: the balance, chunks and loader length (micro-batches per epoch)",
            [("balance", list(self.balance)), ("chunks", self.chunks), ("loader length", len(lm_dataloader))],
            self.group,
            hint="Give every stage a loader of the same length, and construct the pipe alike on every rank.",
        )


def _check_arguments(
    pipe: AMPnetPipe,
    lm_dataloader: Any,
    optimizer: Any,
    logger: Any,
    min_update_interval: int,
    weight_prediction: bool,
) -> None:
    if len(pipe.balance) < 2:
        raise ValueError(
            "AMPnetPipe needs at least 2 pipeline stages (a balance of length >= 2); train a single stage directly"
        )
    if not isinstance(min_update_interval, int) or min_update_interval < 1:
        raise ValueError(f"min_update_interval must be a positive integer, not {min_update_interval!r}")
    if not hasattr(lm_dataloader, "__len__"):
        raise ValueError(
            "lm_dataloader must have a len() (every stage runs that many micro-batches), "
            f"got {type(lm_dataloader).__name__}"
        )
    missing: List[str] = [name for name in _LOGGER_METHODS if not callable(getattr(logger, name, None))]
    if missing:
        raise ValueError(f"transform_logger_object lacks the method(s) {', '.join(missing)} that interleave calls")
    if weight_prediction and not callable(getattr(optimizer, "update_weight_using_future_predictions", None)):
        raise ValueError(
            "weight_prediction=True needs an optimizer with update_weight_using_future_predictions(cur_rank, N, "
            f"count, chunks, forward=...), got {type(optimizer).__name__}"
        )
