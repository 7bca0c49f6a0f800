# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Flatten/unflatten tensor lists, communicate them one flat buffer per dtype, create warmed-up groups, log."""

import collections
import logging
import sys
from typing import Any, Callable, DefaultDict, Dict, List, Mapping, MutableMapping, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from fairscale.internal.collectives import all_reduce
from fairscale.internal.device import DeviceHandle, current_accelerator_device
from fairscale.internal.parallel import default_group_timeout, new_group_with_timeout

__all__ = [
    "MultiProcessAdapter",
    "communicate",
    "create_process_group",
    "flatten_tensors",
    "group_by_dtype",
    "make_logger",
    "unflatten_tensors",
]


def flatten_tensors(tensors: Sequence[Tensor]) -> Tensor:
    """One 1-D tensor with the contents of ``tensors`` (a clone for a single tensor, as upstream)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1).clone()
    return torch.cat([t.reshape(-1) for t in tensors], dim=0)


def unflatten_tensors(flat: Tensor, tensors: Sequence[Tensor]) -> Tuple[Tensor, ...]:
    """Views of ``flat`` shaped like each of ``tensors``, in order."""
    outputs = []
    offset = 0
    for t in tensors:
        numel = t.numel()
        outputs.append(flat.narrow(0, offset, numel).view_as(t))
        offset += numel
    return tuple(outputs)


def group_by_dtype(tensors: Sequence[Tensor]) -> DefaultDict[torch.dtype, List[Tensor]]:
    """The tensors grouped by dtype, each group in the original order."""
    groups: DefaultDict[torch.dtype, List[Tensor]] = collections.defaultdict(list)
    for t in tensors:
        groups[t.dtype].append(t)
    return groups


def communicate(
    tensors: Sequence[Tensor], communication_op: Callable[..., Any], logger: Optional[logging.Logger] = None
) -> None:
    """Run ``communication_op(tensor=flat)`` on one flat buffer per dtype and copy the result back into ``tensors``."""
    for group in group_by_dtype(tensors).values():
        flat = flatten_tensors(group)
        communication_op(tensor=flat)
        with torch.no_grad():
            for f, t in zip(unflatten_tensors(flat, group), group):
                t.copy_(f)
    if logger is not None:
        logger.debug("communicated %d tensors", len(tensors))


_HELPERS_LOGGER = logging.getLogger(__name__)

# Names of the loggers make_logger() already gave a handler and a level (upstream's public name): configuring a
# logger once keeps repeated calls from stacking handlers and printing every message several times.
HANDLER_AND_LEVEL_SET: Set[str] = set()


def make_logger(rank: int, verbose: bool = True) -> logging.Logger:
    """The helpers' logger; on first use it gets a stdout handler prefixed with ``rank`` (DEBUG if ``verbose``)."""
    logger = _HELPERS_LOGGER
    if logger.name not in HANDLER_AND_LEVEL_SET:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter(f"{rank}: %(levelname)s -- %(threadName)s -- %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG if verbose else logging.INFO)
        HANDLER_AND_LEVEL_SET.add(logger.name)
    return logger


def _comm_device() -> torch.device:
    # NCCL groups communicate accelerator tensors; gloo groups CPU tensors.
    if dist.is_initialized() and dist.get_backend() == "nccl":
        acc = current_accelerator_device()
        if acc is not None:
            return acc
    return torch.device("cpu")


def create_process_group(ranks: Sequence[int]) -> Any:
    """``dist.new_group(ranks)``, warmed up by its members with an fp32 and an fp16 all-reduce.

    Every process must call this for every group, in the same order (``new_group`` is collective). The group has the
    default group's timeout (``init_process_group``'s): ``new_group`` alone takes the backend's (30 minutes for gloo).
    """
    group: Any = new_group_with_timeout(list(ranks), default_group_timeout())
    device = _comm_device()
    if dist.get_rank() in ranks:
        for dtype in (torch.float32, torch.float16):
            all_reduce(torch.zeros(1, dtype=dtype, device=device), group=group)
    DeviceHandle.for_device(device).synchronize()
    return group


class MultiProcessAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Prefixes every message with ``process: <process_num>``.

    Args:
        logger: the logger to write to.
        extra: a mapping with the key ``process_num`` (``None`` logs ``process: None``).
        **kwargs: passed on to ``logging.LoggerAdapter`` (``merge_extra`` from Python 3.13).
    """

    # Python 3.9's LoggerAdapter requires ``extra`` (its default came in 3.10): defined here so that
    # ``MultiProcessAdapter(logger)`` works on every supported Python, as it does upstream on 3.10+.
    def __init__(self, logger: logging.Logger, extra: Optional[Mapping[str, object]] = None, **kwargs: Any) -> None:
        super().__init__(logger, extra, **kwargs)

    def process(self, msg: str, kwargs: MutableMapping[str, Any]) -> Tuple[str, MutableMapping[str, Any]]:
        extra: Dict[str, Any] = dict(self.extra or {})
        return f"process: {extra.get('process_num')} {msg}", kwargs
