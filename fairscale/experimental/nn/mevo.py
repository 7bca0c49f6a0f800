# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""MEVO: a memory-efficient vocabulary output layer fused with its softmax cross-entropy loss.

The usual ``F.cross_entropy(x @ w.T, y)`` materialises (and autograd saves) a ``tokens x vocab`` logit matrix,
which dominates memory for large vocabularies. MEVO computes the same summed cross-entropy tile by tile: the
per-token maximum logit, then the per-token sum of ``exp(logit - max)``, then the target logit. Each tile is an
autograd Function that saves only views of its input and weight tiles and recomputes its ``s_in x s_w`` logits in
backward, so at most one tile of logits exists at a time (at the cost of recomputing each tile in backward).

The tiles read the weight through :class:`BackwardTrigger`; each tile's backward adds its piece of the weight
gradient into a buffer of its forward's, and the trigger's backward, which autograd runs after all tiles, hands the
sum to autograd as the weight's gradient (``_mevo_grad.py``): it reaches a flattened weight, the wrappers' hooks
and ``autograd.grad`` as any gradient does. The trigger's own tiny parameter receives a zero gradient each backward,
as upstream's.
"""

from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from fairscale.internal.device import DeviceHandle
from fairscale.internal.errors import FairscaleTypeError, FairscaleValueError

from ._mevo_grad import ForwardKernel, WeightGradSink, weight_grad_wanted
from ._mevo_grad import accumulate_row_grads as _accumulate_row_grads
from ._mevo_grad import accumulate_weight_grad as _accumulate_weight_grad

__all__ = [
    "MemoryEfficientVocabOutput",
    "BaselineSoftmax",
    "BaselineSoftmaxNllLoss",
    "BackwardTrigger",
    "BackwardTriggerFn",
    "GetMaxFunction",
    "GetSumFunction",
    "TargetScoreFunction",
    "lmcl_matmul",
    "get_data",
    "DEBUG",
]

#: Print per-step memory information on rank 0 when true.
DEBUG = False


def _debug(msg: str, device: Optional[torch.device] = None) -> None:
    if not DEBUG or (dist.is_initialized() and dist.get_rank() != 0):
        return
    allocated = DeviceHandle.for_device(device).memory_allocated() if device is not None else 0
    print(f"DEBUG {msg}, memory allocated {allocated / 1024 / 1024:.1f} MiB")


def get_data(
    shape: Tuple[Tuple[int, int], Tuple[int, int]], dtype: torch.dtype = torch.float16, device: str = "cuda"
) -> Tuple[Tensor, Tensor, Tensor]:
    """Random ``(input, weight, target)`` for tests and benchmarks.

    Args:
        shape: ``((tokens, d1), (d2, vocab))`` with ``d1 == d2``.
        dtype: ``torch.float16`` or ``torch.float32``.
        device: where the tensors go.

    Returns:
        ``input`` (tokens, d1) requiring grad, ``weight`` (vocab, d2) Parameter, ``target`` (tokens,) long.
    """
    (tokens, d1), (d2, vocab) = shape
    if d1 != d2:
        raise FairscaleValueError(
            f"get_data: incorrect shape {d1} vs {d2}: the input's width {d1} must equal the weight's {d2}; "
            "pass shape=((tokens, d), (d, vocab))"
        )
    if dtype not in (torch.float16, torch.float32):
        raise FairscaleValueError(f"get_data: unsupported dtype {dtype}; pass torch.float16 or torch.float32")
    input = torch.rand(tokens, d1, device=device, dtype=dtype).requires_grad_(True)
    weight = nn.Linear(d2, vocab, bias=False, device=device, dtype=dtype).weight
    target = (torch.rand(tokens, device=device) * vocab).long()
    return input, weight, target


def _next_power_of_2_or_max(n: int, max_n: int) -> int:
    """1 for 0, else the smallest power of two >= ``n``, capped at ``max_n``."""
    if n == 0:
        return 1
    p = 1 << (n - 1).bit_length()
    return min(p, max_n)


def _reshape_inputs(input: Tensor, target: Tensor) -> Tuple[Tensor, Tensor]:
    if input.ndim == 3:
        input = input.reshape(-1, input.shape[2])
    if target.ndim == 2:
        target = target.reshape(-1)
    return input, target


def lmcl_matmul(
    i: Tensor, w: Tensor, tgt: Tensor, w_idx: int, margin: float, scale: Optional[float], w_split_size: int = 0
) -> Tensor:
    """Large-margin cosine logits of one tile: ``scale * (cos(x, w) - margin * [column is the target])``.

    Args:
        i, w: an input tile (tokens, d) and a weight tile (rows, d).
        tgt: the target of each token of the input tile.
        w_idx: index of the weight tile.
        margin, scale: the LMCL margin and scale.
        w_split_size: rows per weight tile (upstream used ``w.shape[0]``, wrong for a shorter last tile).
    """
    logits = torch.matmul(F.normalize(i, dim=1), F.normalize(w, dim=1).T)
    offset = w_idx * (w_split_size or w.shape[0])
    cols = torch.arange(w.shape[0], device=w.device) + offset
    is_target = (cols.unsqueeze(0) == tgt.unsqueeze(1)).to(logits.dtype)
    return (logits - margin * is_target) * (scale if scale is not None else 1.0)


def _tile_logits(
    i: Tensor, w: Tensor, tgt: Tensor, w_idx: int, w_split_size: int, full_precision: bool, margin: float, scale: Any
) -> Tensor:
    if full_precision:
        i, w = i.float(), w.float()
    if scale is not None:
        return lmcl_matmul(i, w, tgt, w_idx, margin, scale, w_split_size)
    return torch.matmul(i, w.T)


def _check_split_dim(split_dim: int, who: str) -> None:
    # The tile Functions are public (upstream exported them), so a caller can pass any split_dim.
    if split_dim != 0:
        raise FairscaleValueError(
            f"{who}: only splitting along dim 0 is supported, got split_dim={split_dim}; pass 0 (tiles are row "
            "blocks of the input and of the weight)"
        )


def _weight_leaf(w: Tensor, full_precision: bool, kernel_obj: Any) -> Tensor:
    """The weight tile as the leaf of a backward's recomputation: in fp32 under full precision, so that its gradient
    piece is not rounded to a low-precision weight's dtype before the pieces are summed; not requiring grad when the
    running backward does not want the weight's gradient (no piece is computed then)."""
    w = w.detach()
    return (w.float() if full_precision else w).requires_grad_(weight_grad_wanted(kernel_obj))


class GetMaxFunction(torch.autograd.Function):
    """Per-token maximum logit of one (input tile, weight tile) pair, recomputed in backward."""

    @staticmethod
    def forward(
        ctx: Any, i: Tensor, w: Tensor, tgt: Tensor, kernel_obj: Any, w_idx: int, w_split_size: int, split_dim: int
    ) -> Tensor:
        _check_split_dim(split_dim, "GetMaxFunction")
        ctx.save_for_backward(i, w, tgt)
        ctx.kernel_obj, ctx.w_idx, ctx.w_split_size = kernel_obj, w_idx, w_split_size
        with torch.no_grad():
            return GetMaxFunction.get_max(
                i, w, tgt, w_idx, kernel_obj.fp_max, kernel_obj.margin, kernel_obj.scale, w_split_size
            )

    @staticmethod
    def get_max(
        i: Tensor,
        w: Tensor,
        tgt: Tensor,
        w_idx: int,
        full_precision: bool,
        margin: float,
        scale: Any,
        w_split_size: int = 0,
    ) -> Tensor:
        """Per-token maximum logit of tile ``w_idx`` (``w_split_size``: rows per tile, 0 = ``w``'s rows)."""
        return _tile_logits(i, w, tgt, w_idx, w_split_size, full_precision, margin, scale).max(dim=1).values

    @staticmethod
    @once_differentiable  # a second-order backward raises instead of silently missing the loss's share
    def backward(ctx: Any, *args: Any) -> Tuple[Optional[Tensor], ...]:
        (grad,) = args
        i, w, tgt = ctx.saved_tensors
        k = ctx.kernel_obj
        i, w = i.detach().requires_grad_(True), _weight_leaf(w, k.fp_max, k)
        with torch.enable_grad():
            m = GetMaxFunction.get_max(i, w, tgt, ctx.w_idx, k.fp_max, k.margin, k.scale, ctx.w_split_size)
        torch.autograd.backward(m, grad)
        if w.grad is not None:
            _accumulate_weight_grad(k, w.grad, ctx.w_idx, ctx.w_split_size)
        return (i.grad,) + (None,) * 6


class GetSumFunction(torch.autograd.Function):
    """Per-token sum of ``exp(logit - max)`` of one tile pair, recomputed in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        i: Tensor,
        w: Tensor,
        tgt: Tensor,
        maxs: Tensor,
        kernel_obj: Any,
        w_idx: int,
        w_split_size: int,
        split_dim: int,
    ) -> Tensor:
        _check_split_dim(split_dim, "GetSumFunction")
        ctx.save_for_backward(i, w, tgt, maxs)
        ctx.kernel_obj, ctx.w_idx, ctx.w_split_size = kernel_obj, w_idx, w_split_size
        with torch.no_grad():
            return GetSumFunction.get_sum(
                i, w, tgt, maxs, w_idx, kernel_obj.fp_sum, kernel_obj.margin, kernel_obj.scale, w_split_size
            )

    @staticmethod
    def get_sum(
        i: Tensor,
        w: Tensor,
        tgt: Tensor,
        maxs: Tensor,
        w_idx: int,
        full_precision: bool,
        margin: float,
        scale: Any,
        w_split_size: int = 0,
    ) -> Tensor:
        """Per-token sum of ``exp(logit - maxs)`` over tile ``w_idx`` (``w_split_size`` as in ``get_max``)."""
        logits = _tile_logits(i, w, tgt, w_idx, w_split_size, full_precision, margin, scale)
        return torch.exp(logits - maxs.unsqueeze(1)).sum(dim=1)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *args: Any) -> Tuple[Optional[Tensor], ...]:
        (grad,) = args
        i, w, tgt, maxs = ctx.saved_tensors
        k = ctx.kernel_obj
        i, w = i.detach().requires_grad_(True), _weight_leaf(w, k.fp_sum, k)
        maxs = maxs.detach().requires_grad_(True)
        with torch.enable_grad():
            s = GetSumFunction.get_sum(i, w, tgt, maxs, ctx.w_idx, k.fp_sum, k.margin, k.scale, ctx.w_split_size)
        torch.autograd.backward(s, grad)
        if w.grad is not None:
            _accumulate_weight_grad(k, w.grad, ctx.w_idx, ctx.w_split_size)
        return (i.grad, None, None, maxs.grad) + (None,) * 4


def _check_targets(target: Tensor, vocab: int) -> None:
    """Raise unless ``target`` holds class indices in ``[0, vocab)``.

    The target logits are gathered by indexing the weight, which reads a negative index from the end: -1 (a common
    padding value) silently scored the last vocabulary row. One reduction and one host sync per forward, as
    ``F.cross_entropy``'s own bounds check costs; MEVO has no ``ignore_index``.
    """
    # int64/int32 only: indexing reads a uint8 (or bool) tensor as a mask (a silently wrong loss) and refuses int8.
    if target.dtype not in (torch.int64, torch.int32):
        raise FairscaleTypeError(
            f"MEVO.forward: target must hold integer class indices (int64 or int32), got dtype {target.dtype}; pass "
            "token ids (e.g. target.long())"
        )
    if target.numel() == 0:
        return
    out_of_range = (target < 0) | (target >= vocab)
    if bool(out_of_range.any()):
        first = int(target[out_of_range][0])
        raise FairscaleValueError(
            f"MEVO.forward: target {first} is out of bounds: class indices must be in [0, {vocab}) (the weight's "
            "vocabulary); MEVO has no ignore_index: drop padding tokens from input and target before the loss"
        )


def _target_score(i: Tensor, w: Tensor, target: Tensor, full_precision: bool, margin: float, scale: Any) -> Tensor:
    return _score_rows(i, w[target], full_precision, margin, scale)


def _score_rows(i: Tensor, rows: Tensor, full_precision: bool, margin: float, scale: Any) -> Tensor:
    """Per-token logit of the target class, given each token's target row of the weight (already gathered)."""
    if full_precision:
        # Cast after the gather: ``w.float()`` first would copy the whole (vocab x d) weight.
        i, rows = i.float(), rows.float()
    if scale is not None:
        return ((F.normalize(i, dim=1) * F.normalize(rows, dim=1)).sum(dim=1) - margin) * scale
    return (i * rows).sum(dim=1)


class TargetScoreFunction(torch.autograd.Function):
    """Per-token logit of the target class (gathers the target rows of the weight, no tiles)."""

    @staticmethod
    def forward(ctx: Any, i: Tensor, w: Tensor, target: Tensor, kernel_obj: Any) -> Tensor:
        ctx.save_for_backward(i, w, target)
        ctx.kernel_obj = kernel_obj
        with torch.no_grad():
            return TargetScoreFunction.get_target_score(
                i, w, target, kernel_obj.fp_target, kernel_obj.margin, kernel_obj.scale
            )

    @staticmethod
    def get_target_score(
        i: Tensor, w: Tensor, target: Tensor, full_precision: bool, margin: float, scale: Any
    ) -> Tensor:
        """Per-token logit of the target class."""
        return _target_score(i, w, target, full_precision, margin, scale)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *args: Any) -> Tuple[Optional[Tensor], ...]:
        (grad,) = args
        i, w, target = ctx.saved_tensors
        k = ctx.kernel_obj
        # Differentiate with respect to the gathered rows (tokens x d), not the whole weight: see
        # _accumulate_row_grads.
        # Under fp_target the rows are fp32 leaves, so that repeated targets sum in fp32 as they did through autograd.
        rows = w.detach()[target]
        rows = (rows.float() if k.fp_target else rows).requires_grad_(weight_grad_wanted(k))
        i = i.detach().requires_grad_(True)
        with torch.enable_grad():
            t = _score_rows(i, rows, k.fp_target, k.margin, k.scale)
        torch.autograd.backward(t, grad)
        if rows.grad is not None:
            _accumulate_row_grads(k, rows.grad, target)
        return i.grad, None, None, None


class BackwardTriggerFn(torch.autograd.Function):
    """Identity on the weight whose backward gives the trigger tensor a zero gradient, and the weight what the
    forward's sink (if any) collected from the tiles."""

    @staticmethod
    def forward(ctx: Any, w: Tensor, trigger_tensor: Tensor, sink: Optional[WeightGradSink] = None) -> Tensor:
        ctx.save_for_backward(trigger_tensor)
        ctx.sink = sink
        # The tiles give the weight no gradient through autograd (they add into the sink); left materialised, autograd
        # would allocate a zero (vocab x d) gradient for this output on every backward, only for it to be ignored.
        ctx.set_materialize_grads(False)
        return w.view_as(w)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *args: Any) -> Tuple[Optional[Tensor], Tensor, None]:
        (trigger,) = ctx.saved_tensors
        # Runs after every tile (they all read the weight through this node): the sink holds their whole sum.
        sink: Optional[WeightGradSink] = ctx.sink
        return (sink.take() if sink is not None else None), torch.zeros_like(trigger), None


class BackwardTrigger(nn.Module):
    """Owns a one-element ``trigger`` Parameter that receives a (zero) gradient whenever the weight is used.

    Args:
        linked_param (nn.Parameter): the weight (not registered here; ``trigger._linked_param`` points to it).
    """

    def __init__(self, linked_param: Tensor) -> None:
        super().__init__()
        if not isinstance(linked_param, nn.Parameter):
            raise FairscaleTypeError(
                f"BackwardTrigger needs an nn.Parameter, got {type(linked_param).__name__}; wrap the weight in "
                "nn.Parameter (usually the embedding's weight)"
            )
        self.trigger = nn.Parameter(torch.rand(1, dtype=linked_param.dtype, device=linked_param.device))
        # FSDP reads this attribute to handle the weight shared with the embedding.
        setattr(self.trigger, "_linked_param", linked_param)
        # A tuple, so that the weight is not registered (again) as a parameter of this module.
        self._linked = (linked_param,)

    def relink(self, linked_param: nn.Parameter) -> None:
        """Point the trigger at ``linked_param`` (the owner's weight was replaced: an ``assign=True`` load, a tie)."""
        setattr(self.trigger, "_linked_param", linked_param)
        self._linked = (linked_param,)

    def forward(self, sink: Optional[WeightGradSink] = None) -> Tensor:
        out: Tensor = BackwardTriggerFn.apply(self._linked[0], self.trigger, sink)
        return out


class MemoryEfficientVocabOutput(nn.Module):
    """Fused output projection + softmax + NLL loss that never materialises the ``tokens x vocab`` logits.

    Exported as ``fairscale.experimental.nn.MEVO``. In training mode ``forward(input, target)`` returns the
    cross-entropy of ``input @ proj_weight.T`` against ``target`` (summed, or averaged over tokens); in eval mode
    without a target it returns the logits.

    Example::

        mevo = MEVO(embedding.weight, tile_factor=16)
        loss = mevo(hidden, target)  # == F.cross_entropy(hidden @ embedding.weight.T, target, reduction="sum")

    Args:
        proj_weight (nn.Parameter): the ``(vocab, d_model)`` weight, usually shared with the input embedding.
        tile_factor (int): number of tiles along the tokens and along the vocabulary (default: 16).
        reduction (str): ``"sum"`` or ``"mean"`` (default: ``"sum"``).
        margin (float): LMCL (CosFace) margin, used when ``scale`` is set (default: 0.35).
        scale (Optional[float]): LMCL scale; ``None`` for plain softmax (default).
    """

    def __init__(
        self,
        proj_weight: nn.Parameter,
        tile_factor: int = 16,
        reduction: str = "sum",
        margin: float = 0.35,
        scale: Optional[float] = None,
    ) -> None:
        super().__init__()
        if isinstance(tile_factor, bool) or not isinstance(tile_factor, int) or tile_factor < 1:
            # 0 divided by zero in the first forward, a float failed inside, a negative was taken silently.
            raise FairscaleValueError(f"MEVO: tile_factor must be a positive integer, got {tile_factor!r}")
        if not isinstance(proj_weight, Tensor) or proj_weight.ndim != 2:  # forward's unpacking named nothing
            shape = tuple(proj_weight.shape) if isinstance(proj_weight, Tensor) else type(proj_weight).__name__
            raise FairscaleValueError(f"MEVO: proj_weight must be a 2-D (vocab, d_model) parameter, got {shape}")
        self.proj_weight = proj_weight
        self.tf_in, self.tf_w = tile_factor, tile_factor
        self.fp_max = True
        self.fp_sum = True
        self.fp_target = True
        self.log_softmax = True
        if reduction not in ["sum", "mean"]:
            raise FairscaleValueError(f"MEVO: reduction must be 'sum' or 'mean', got {reduction!r}")
        self.reduction = reduction
        self.margin = margin
        self.scale = scale
        self.trigger = BackwardTrigger(self.proj_weight)

    def eval_forward(self, input: Tensor) -> Tensor:
        """Logits ``input @ proj_weight.T`` (any leading shape), for inference."""
        return torch.matmul(input, self.proj_weight.T)

    def get_target_nlprob(
        self, i: Tensor, w: Tensor, target: Tensor, debase_max: Tensor, exp_sums: Tensor, kernel_obj: Any = None
    ) -> Tensor:
        """Summed negative log-probability of the targets (``kernel_obj``: the forward's, default this module)."""
        t = TargetScoreFunction.apply(i, w, target, self if kernel_obj is None else kernel_obj)
        # log(exp(t - m) / S) computed as t - m - log S: exact also when exp(t - m) underflows.
        log_prob = t - debase_max - torch.log(exp_sums)
        if not self.log_softmax:
            log_prob = torch.exp(log_prob)
        return -log_prob.sum()

    def forward(self, input: Tensor, target: Optional[Tensor]) -> Tensor:
        if not self.training and target is None:
            return self.eval_forward(input)
        if not isinstance(input, Tensor):
            raise FairscaleTypeError(f"MEVO.forward: input must be a tensor, got {type(input).__name__}")
        if not isinstance(target, Tensor):
            raise FairscaleTypeError(
                f"MEVO.forward: target must be a tensor (required in training mode), got {type(target).__name__}; "
                "pass the target token ids, or call .eval() to get the logits"
            )
        if torch.is_grad_enabled() and not input.requires_grad:
            raise FairscaleValueError(
                "MEVO.forward: input must require grad in training (while autograd is enabled); pass an input "
                "that requires grad, or compute the loss under torch.no_grad()"
            )
        # Other ranks failed in the unpacking below with Python's "too many values to unpack", naming nothing.
        if input.ndim not in (2, 3):
            raise FairscaleValueError(
                f"MEVO.forward: input must be 2-D (tokens, d_model) or 3-D (batch, seq, d_model), got shape "
                f"{tuple(input.shape)}"
            )
        if target.ndim not in (1, 2):
            raise FairscaleValueError(
                f"MEVO.forward: target must be 1-D (tokens) or 2-D (batch, seq), got shape {tuple(target.shape)}"
            )
        if input.ndim == 3 and target.ndim == 2 and tuple(target.shape) != tuple(input.shape[:2]):
            # Both are flattened: a (seq, batch) target for a (batch, seq, d) input paired tokens with other tokens'
            # labels, silently (torch's cross entropy refuses it).
            raise FairscaleValueError(
                f"MEVO.forward: a 2-D target must have the input's (batch, seq) shape {tuple(input.shape[:2])}, got "
                f"{tuple(target.shape)}; transpose the target (or the input) so that both are batch-major"
            )
        input, target = _reshape_inputs(input, target)
        tokens, d_model = input.shape
        (t2,) = target.shape
        vocab, d2 = self.proj_weight.shape
        if d_model != d2:
            raise FairscaleValueError(
                f"MEVO.forward: incorrect shape {d_model} vs {d2}: the input's last dimension ({d_model}) must equal "
                f"the weight's d_model ({d2})"
            )
        if tokens != t2:
            raise FairscaleValueError(
                f"MEVO.forward: incorrect shape {tokens} vs {t2}: the input has {tokens} tokens but the target has "
                f"{t2}; pass one target per token"
            )
        _check_targets(target, vocab)
        s_in = _next_power_of_2_or_max(tokens // self.tf_in, tokens)
        s_w = _next_power_of_2_or_max(vocab // self.tf_w, vocab)
        _debug(f"mevo tiles: input {s_in} rows, weight {s_w} rows", input.device)
        split_in = torch.split(input, s_in)
        if self.trigger._linked[0] is not self.proj_weight:
            # proj_weight was replaced (load_state_dict(assign=True), a tie after construction): the loss read the
            # weight captured at construction while the gradients went to the new one.
            self.trigger.relink(self.proj_weight)
        # This forward's weight gradient is summed in its own sink and handed to autograd (see _mevo_grad.py).
        sink = WeightGradSink(self.proj_weight) if torch.is_grad_enabled() and self.proj_weight.requires_grad else None
        kernel = ForwardKernel(self, sink)
        w = self.trigger(sink)
        if sink is not None:
            sink.watch(w)
        split_w = torch.split(w, s_w)
        empty = torch.empty(0, dtype=torch.long, device=input.device)
        split_tgt = torch.split(target, s_in) if self.scale is not None else tuple(empty for _ in split_in)

        tile_maxs: List[Tensor] = []
        for i, tgt in zip(split_in, split_tgt):
            m: Optional[Tensor] = None
            for w_idx, w_tile in enumerate(split_w):
                tile_m = GetMaxFunction.apply(i, w_tile, tgt, kernel, w_idx, s_w, 0)
                m = tile_m if m is None else torch.max(m, tile_m)
            assert m is not None  # split_w has at least one tile; narrows the type for mypy
            tile_maxs.append(m)
        maxs = torch.cat(tile_maxs)

        tile_sums: List[Tensor] = []
        for i, tgt, m in zip(split_in, split_tgt, torch.split(maxs, s_in)):
            s: Optional[Tensor] = None
            for w_idx, w_tile in enumerate(split_w):
                tile_s = GetSumFunction.apply(i, w_tile, tgt, m, kernel, w_idx, s_w, 0)
                s = tile_s if s is None else s + tile_s
            assert s is not None  # as above
            tile_sums.append(s)
        sums = torch.cat(tile_sums)

        loss = self.get_target_nlprob(input, w, target, maxs, sums, kernel)
        if self.reduction == "mean":
            loss = loss / tokens
        return loss


class BaselineSoftmax(nn.Module):
    """Reference: full logits and a float32 (log-)softmax, for comparing MEVO's numbers and memory.

    Upstream required the weight on CUDA; this one follows the weight's device.

    Args:
        proj_weight (nn.Parameter): the ``(vocab, d_model)`` weight.
        tile_factor (int): unused (kept for signature compatibility).
        log_softmax (bool): return log-probabilities (default) or probabilities.
        margin (float): LMCL margin, used when ``scale`` is set.
        scale (Optional[float]): LMCL scale; ``None`` for plain logits.
    """

    def __init__(
        self,
        proj_weight: nn.Parameter,
        tile_factor: int = 0,
        log_softmax: bool = True,
        margin: float = 0.35,
        scale: Optional[float] = None,
    ) -> None:
        super().__init__()
        out_features, in_features = proj_weight.shape
        self.fc = nn.Linear(in_features, out_features, bias=False, device="meta")
        self.fc.weight = proj_weight
        self.fp16 = proj_weight.dtype == torch.float16
        self.log_softmax = log_softmax
        self.margin = margin
        self.scale = scale

    def lmcl_pre_softmax(self, input: Tensor, target: Tensor) -> Tensor:
        """LMCL logits ``scale * (cos(x, w) - margin at the target column)``."""
        x = F.normalize(input, dim=1)
        w = F.normalize(self.fc.weight, dim=1)
        logits = torch.einsum("nc,kc->nk", x, w)
        one_hot = F.one_hot(target, logits.shape[1]).to(logits.dtype)
        scale = self.scale if self.scale is not None else 1.0
        return (logits - self.margin * one_hot) * scale

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        input, target = _reshape_inputs(input, target)
        if self.fp16 and input.dtype != torch.float16:
            raise FairscaleTypeError(
                f"BaselineSoftmax.forward: input must be fp16 when the weight is fp16, got {input.dtype}; "
                "convert the input with .half()"
            )
        logits = self.lmcl_pre_softmax(input, target) if self.scale is not None else self.fc(input)
        if self.log_softmax:
            return F.log_softmax(logits, dim=-1, dtype=torch.float32)
        return F.softmax(logits, dim=-1, dtype=torch.float32)


class BaselineSoftmaxNllLoss(BaselineSoftmax):
    """Reference loss: :class:`BaselineSoftmax` followed by a summed ``F.nll_loss``."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        log_probs = super().forward(input, target)
        _, target = _reshape_inputs(input, target)
        return F.nll_loss(log_probs, target, reduction="sum")
