# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""fp32 master copies of fp16 parameters for SlowMo's error feedback.

When the model's parameters are fp16 and the optimizer keeps fp32 masters (apex's ``_amp_stash``, or fairseq's
``fp32_params``), averaging the fp16 values loses what the masters hold beyond fp16: SlowMo subtracts each fp16
value from its master before communicating and adds the communicated fp16 value back after, so that the masters
keep their own low bits.
"""

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fairscale.internal.errors import FairscaleValueError

__all__ = ["Fp32Pairs", "fp16_fp32_pairs", "subtract_before_communication"]

# (model parameter, its fp32 master) pairs.
Fp32Pairs = List[Tuple[Tensor, Tensor]]

_WHAT_TO_PASS = "pass a one-entry dict, a list aligned with self.parameters(), or one flat tensor"


def fp16_fp32_pairs(
    params: Sequence[Tensor], optimizer: torch.optim.Optimizer, fp32_params: Optional[Any]
) -> Fp32Pairs:
    """``(parameter, fp32 master)`` pairs from the optimizer's ``_amp_stash`` or from ``fp32_params``.

    Raises:
        FairscaleValueError: ``fp32_params`` does not match ``params`` (a dict of other than one entry, a list of
            another length or with tensors of other shapes, a flat tensor of another size): upstream zipped them,
            so a short list skipped the last parameters silently, and a long flat tensor left its tail unused.
    """
    stash = getattr(optimizer, "_amp_stash", None)
    if stash is not None:
        return [
            pair for fp16s, fp32s in zip(stash.fp16_groups, stash.fp32_from_fp16_groups) for pair in zip(fp16s, fp32s)
        ]
    if fp32_params is None:
        return []
    if isinstance(fp32_params, dict):
        if len(fp32_params) != 1:
            raise FairscaleValueError(
                f"SlowMoDistributedDataParallel.perform_slowmo: fp32_params as a dict must have exactly one entry "
                f"(fairseq style), got {len(fp32_params)}; {_WHAT_TO_PASS}"
            )
        fp32_params = next(iter(fp32_params.values()))
    if isinstance(fp32_params, (list, tuple)):
        return _aligned_pairs(params, fp32_params)
    if isinstance(fp32_params, Tensor):
        return _flat_pairs(params, fp32_params)
    raise FairscaleValueError(
        f"SlowMoDistributedDataParallel.perform_slowmo: fp32_params is a {type(fp32_params).__name__}; {_WHAT_TO_PASS}"
    )


def _aligned_pairs(params: Sequence[Tensor], masters: Sequence[Any]) -> Fp32Pairs:
    if len(masters) != len(params):
        raise FairscaleValueError(
            f"SlowMoDistributedDataParallel.perform_slowmo: fp32_params has {len(masters)} entries but the model has "
            f"{len(params)} parameters; {_WHAT_TO_PASS}"
        )
    for i, (p, master) in enumerate(zip(params, masters)):
        if not isinstance(master, Tensor) or master.shape != p.shape:
            got = tuple(master.shape) if isinstance(master, Tensor) else type(master).__name__
            raise FairscaleValueError(
                f"SlowMoDistributedDataParallel.perform_slowmo: fp32_params[{i}] is {got}, but parameter {i} has "
                f"shape {tuple(p.shape)}; {_WHAT_TO_PASS}"
            )
    return list(zip(params, masters))


def _flat_pairs(params: Sequence[Tensor], flat: Tensor) -> Fp32Pairs:
    total = sum(p.numel() for p in params)
    if flat.numel() != total:
        raise FairscaleValueError(
            f"SlowMoDistributedDataParallel.perform_slowmo: the flat fp32_params has {flat.numel()} elements but the "
            f"model's parameters have {total}; {_WHAT_TO_PASS}"
        )
    flat = flat.view(-1)
    pairs: Fp32Pairs = []
    offset = 0
    for p in params:
        pairs.append((p, flat[offset : offset + p.numel()].view_as(p)))
        offset += p.numel()
    return pairs


def subtract_before_communication(pairs: Fp32Pairs, quantise_by: Optional[int]) -> None:
    """Take each parameter's value out of its master (added back after communication).

    Args:
        pairs: the pairs.
        quantise_by: the world size of an all-reduce that averages the parameters (``None``: no all-reduce): the
            parameter is divided and multiplied by it first, so that it is rounded as the all-reduce will round it.
    """
    with torch.no_grad():
        for param, master in pairs:
            if quantise_by is not None:
                param.div_(quantise_by).mul_(quantise_by)
            master.sub_(param.float())
