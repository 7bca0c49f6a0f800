# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What a checkpointed call hands back: aliases of its first pass's outputs, and the warnings about gradients that
checkpointing cannot give (tensors stored in the arguments by the no-grad first pass, ``create_graph=True``)."""

import warnings
from typing import Any, Callable, Dict, List, Tuple

import torch

from ._structure import _flatten

__all__ = ["_aliases", "_warn_about_tensors_stored_in_arguments", "_warn_create_graph"]


def _warn_about_tensors_stored_in_arguments(
    forward: Callable[..., Any], arguments: Any, input_tensors: Tuple[torch.Tensor, ...]
) -> None:
    """Warn when the first pass left tensors in the caller's arguments that were not among its inputs.

    The first pass runs without grad: a tensor it appends to a list argument (a dense block's features, a
    load-balancing loss) or puts in a dict has no graph, and whatever the caller computes from it gets no gradient
    into this module, silently. Plain PyTorch would train on it; upstream had the same silent gap.
    """
    inputs = {id(t) for t in input_tensors}
    stored, _ = _flatten(arguments)
    # A tensor that requires grad came from outside the pass (a parameter); an integer one never carries a gradient.
    if any(id(t) not in inputs and not t.requires_grad and (t.is_floating_point() or t.is_complex()) for t in stored):
        owner = getattr(forward, "__self__", forward)
        warnings.warn(
            f"checkpoint_wrapper: the forward of {type(owner).__name__} stored new tensors in its arguments (a list "
            "or dict it was given). They come from the checkpoint's first pass, which runs without grad: nothing "
            "computed from them back-propagates into this module. Return them from the forward to train on them; "
            "values kept only to be logged are fine (this warning is shown once per module class).",
            stacklevel=2,
        )


def _aliases(tensors: List[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """:func:`_alias` of each output, keeping outputs that share memory views of one tensor.

    Separate detached aliases hid from autograd that outputs overlap (``(y, y[0])``): an in-place change of one
    changed the other's values but not its graph, and the gradients came out wrong, silently. As views of one
    tensor the checkpoint's node returns them as torch's own reentrant checkpoint does, and autograd refuses an
    in-place change of them ("... is a view and is being modified inplace").
    """
    out = [_alias(t) for t in tensors]
    groups: Dict[Tuple[Any, int], List[int]] = {}
    for i, t in enumerate(tensors):
        if t.layout == torch.strided and t.numel() > 0 and not (t.is_leaf and t.requires_grad):
            groups.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(i)
    for members in groups.values():
        first = tensors[members[0]]
        if len(members) < 2 or any(tensors[i].dtype != first.dtype for i in members):
            continue
        whole = first.detach().as_strided((first.untyped_storage().nbytes() // first.element_size(),), (1,), 0)
        for i in members:
            out[i] = whole.as_strided(tensors[i].size(), tensors[i].stride(), tensors[i].storage_offset())
    return tuple(out)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor the checkpoint's node may make its output without changing ``t``: a leaf that requires grad (a
    parameter) gets a view, so that an in-place change of it still fails as it does without checkpointing ("a view
    of a leaf Variable that requires grad is being used in an in-place operation"); anything else a detached alias."""
    if t.is_leaf and t.requires_grad:
        return t.view_as(t)
    return t.detach()


def _warn_create_graph(grad: torch.Tensor) -> None:
    """A backward with ``create_graph=True`` (a gradient penalty's double backward) runs with grad enabled: torch's
    reentrant checkpoint back-propagates the recomputed graph without a graph of its own, so the gradients of this
    region's parameters and of everything before it are not differentiable, and a second-order gradient through them
    misses their share, silently. A penalty on gradients after the region (a head's) is right: a warning, not an
    error."""
    if torch.is_grad_enabled():
        warnings.warn(
            "checkpoint_wrapper: a backward with create_graph=True (a double backward, e.g. a gradient penalty) "
            "reached a checkpointed module: its recomputation is back-propagated without a graph, so the gradients "
            "of its parameters and of everything before it are not differentiable (a second-order gradient through "
            "them misses their share). Run such a step without checkpointing (inside "
            "fairscale.nn.checkpoint.checkpoint_activations.disable_checkpointing(), or with torch.utils.checkpoint "
            "and use_reentrant=False).",
            stacklevel=2,
        )
