# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""SyncBatchNorm: batch normalisation with statistics over the whole process group, checkpoint friendly.

Forward needs two all-reduces (the element count, then the stacked mean and mean of squares); backward one
(the two per-channel sums of the input gradient). Weight and bias gradients stay local, as DDP reduces them.
Under :func:`fairscale.nn.checkpoint.checkpoint_wrapper` the statistics are computed once, in the first pass,
and reused by the recomputation, so neither the collectives nor the running-statistics update happen twice.
"""

import zlib
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from fairscale.internal import torch_version as torch_version  # noqa: F401  # upstream's module exposes it
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.collectives import all_reduce, group_size
from fairscale.internal.dry_load import load_state_dict_all_or_nothing
from fairscale.internal.group_copy import deepcopy_sharing_group, refuse_pickling_group
from fairscale.nn.checkpoint import is_checkpointing, is_recomputing
from fairscale.nn.checkpoint.checkpoint_activations import current_call_stash, enclosing_call_stash

__all__ = ["SyncBatchNorm"]


def _forward(input: Tensor, affine: bool, mean: Tensor, invstd: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    # The statistics (and fp32 parameters) are fp32 for fp16/bf16 inputs; the output keeps the input's dtype, as
    # torch's batch norm does (an fp32 output crashed the next half-precision layer). torch's inference-mode batch
    # norm with these statistics as its "running" ones computes the same in one kernel, with no fp32 temporaries of
    # the input's size (the elementwise formula below made several: twice the time for fp16 inputs).
    # The aten op itself: ``F.batch_norm`` refuses eps=0 on some releases (2.11: "eps must be positive"), and the
    # variance given here is exact. cuDNN takes no eps below 1e-5, hence cudnn_enabled=False (ATen's kernel).
    w, b = (weight, bias) if affine else (None, None)
    try:
        return torch.batch_norm(input, w, b, mean.reshape(-1), invstd.reshape(-1).pow(-2), False, 0.0, 0.0, False)
    except RuntimeError:  # a dtype the device's batch norm lacks (fp16 on the CPU before torch 2.2)
        pass
    if affine:
        return ((input - mean) * (invstd * weight.reshape_as(mean)) + bias.reshape_as(mean)).to(input.dtype)
    return ((input - mean) * invstd).to(input.dtype)


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the mean and invstd for inputs of ``dtype``: fp32 for half precision, as torch's opmath (a mean
    rounded to fp16/bf16 shifted every output by its rounding error, 5-50x torch's error for inputs away from 0)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _track_running_stats(
    running_mean: Tensor, running_var: Tensor, momentum: float, mean: Tensor, var: Tensor, total_count: Tensor
) -> None:
    # Bessel's factor in float64: the count arrives as fp32, whose factor put fp32 rounding into float64 buffers.
    count = total_count.to(torch.float64)
    unbiased_var = (var.to(torch.float64) * (count / (count - 1).clamp(min=1))).to(running_var.dtype)
    # Nothing measured, or one value per channel (no variance: Bessel's factor is infinite, and running_var became
    # NaN): the running statistics stay as they are (on the device, no sync).
    step = momentum * (total_count > 1).to(running_mean.dtype)
    running_mean += step * (mean.reshape(-1) - running_mean)
    running_var += step * (unbiased_var.reshape(-1) - running_var)


# Codes of the input dtypes in the layout check (the statistics need a floating dtype; any other is 0).
_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}


def settings_code(momentum: Any, eps: float, affine: bool, track_running_stats: bool) -> int:
    """A number below ``2**20`` for the layer's settings, the same on ranks with the same settings: ranks whose
    momentum, eps, affine or tracking differed computed other outputs and running statistics, silently. Small enough
    that ``n`` ranks' sum of its squares stays an exact float64 integer (below ``2**53``) for any real world size."""
    return zlib.crc32(repr((momentum, float(eps), bool(affine), bool(track_running_stats))).encode()) % (1 << 20)


# Length of the count all-reduce's vector (see _calculate_stats); its last place is the "failed" flag.
_SUMS_LEN = 10


def _calculate_stats(
    input: Tensor,
    eps: float,
    process_group: Any,
    check_layout: bool,
    settings: int = 0,
    backward_reduces: Optional[bool] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Global ``(mean, var, invstd, total_count)`` of ``input`` over every dim except 1 and every rank.

    The element count's all-reduce also carries ``(C, C**2, d, d**2, s, s**2)`` for this rank's channel count ``C``,
    dtype code ``d`` and :func:`settings_code` ``s``. After the sum, ``sum(x)**2 == n * sum(x**2)`` holds for ``n``
    ranks iff every rank sent the same ``x``
    (Cauchy-Schwarz), and every rank reads the same sums: with ``check_layout`` all ranks raise together before the
    statistics' all-reduce, whose sizes would differ (gloo aborts the process, NCCL hangs or corrupts memory). The
    check costs no collective; reading the sums waits for the device, so on accelerators the caller asks for it on
    the layer's first forward only.

    It carries ``(k, g)`` too: ``k`` is 1 where ``backward_reduces`` is known (not ``None``) and ``g`` is 1 where it
    is True. The ranks that know agree iff ``sum(g)`` is 0 or ``sum(k)``; where they do not, only some ranks' backward
    would run the gradient all-reduce, and those would wait in it forever.
    """
    dim = [d for d in range(input.ndim) if d != 1]
    channels, code = input.size(1), _DTYPE_CODES.get(input.dtype, 0)
    # float64: the count and the squares stay exact integers far beyond any real world size (fp32 counts would be
    # exact to 2**24; upstream used the input dtype, which overflows fp16 beyond 65504 elements per channel).
    # The last value is 0: a rank whose input failed its own check sends 1 there (see _join_and_raise).
    known, reduces = int(backward_reduces is not None), int(bool(backward_reduces))
    values = (
        input.numel() // max(channels, 1),
        channels,
        channels**2,
        code,
        code**2,
        settings,
        settings**2,
        known,
        reduces,
        0,
    )
    if input.device.type == "cpu":
        sums = torch.tensor(values, dtype=torch.float64)
    else:  # filled on the device: a list copied to it would wait for the work queued there (a host sync)
        sums = torch.empty(len(values), dtype=torch.float64, device=input.device)
        for i, value in enumerate(values):
            sums[i] = value
    count = sums[:1].clone()
    count_work = all_reduce(sums, group=process_group, async_op=True)
    if values[0] > 0:
        # Each rank's statistics centred on its own mean (var_mean accumulates stably), combined as mean and mean of
        # squares in float64. Upstream's E[x^2] - E[x]^2 in the input dtype lost the variance to cancellation for
        # inputs far from zero (mean 100, std 0.01 gave NaN in fp32); the float64 combination keeps about 16 digits
        # of E[x^2], so the variance keeps its digits unless the mean is ~10^8 times the spread.
        # fp16/bf16 in fp32 (a transient copy, freed here): var_mean in the input dtype rounded the mean before the
        # float64 combination below.
        stats_input = input.to(_stats_dtype(input.dtype))
        local_var, local_mean = torch.var_mean(stats_input, dim=dim, correction=0, keepdim=True)
        del stats_input
        mean64 = local_mean.to(torch.float64)
        vec = torch.cat([mean64, local_var.to(torch.float64) + mean64 * mean64])
    else:
        # An empty batch on this rank contributes nothing (the mean of nothing is NaN, which the all-reduce spread to
        # every rank's statistics and output).
        vec = torch.zeros(
            [2 if d == 0 else channels if d == 1 else 1 for d in range(input.ndim)],
            dtype=torch.float64,
            device=input.device,
        )
    assert count_work is not None  # async_op=True always returns the handle
    count_work.wait()
    if check_layout:
        _check_same_layout(sums, channels, input.dtype, process_group)
    total_count = sums[:1].to(torch.float32)
    vec = (vec * (count / sums[:1].clamp(min=1))).contiguous()
    all_reduce(vec, group=process_group)
    mean64, meansqr64 = vec.chunk(2)
    var64 = (meansqr64 - mean64 * mean64).clamp(min=0)
    stats_dtype = _stats_dtype(input.dtype)
    mean, var = mean64.to(stats_dtype), var64.to(stats_dtype)
    invstd = torch.rsqrt(var64 + eps).to(stats_dtype)
    return mean, var, invstd, total_count


def _join_and_raise(error: Exception, device: torch.device, process_group: Any) -> None:
    """Raise ``error`` (this rank's input failed a check of its own) after taking part in the count all-reduce, whose
    last place carries a 1 from this rank: where the other ranks read the sums (on the CPU always, on accelerators at
    the layer's first forward) they raise too, before the statistics' all-reduce, instead of waiting in it for this
    rank until the group's timeout. (Reading them at every forward on an accelerator would wait for the device.)
    """
    sums = torch.zeros(_SUMS_LEN, dtype=torch.float64, device=device)
    sums[-1] = 1
    all_reduce(sums, group=process_group)
    raise error


def _check_same_layout(sums: Tensor, channels: int, dtype: torch.dtype, process_group: Any) -> None:
    n = group_size(process_group)
    count, c1, c2, d1, d2, s1, s2, known, reduces, failed = (int(v) for v in sums.tolist())
    if failed:
        raise RuntimeError(
            f"SyncBatchNorm: the input of {failed} other rank(s) of the process group failed its own check (that "
            "rank raised why); every rank stops here instead of waiting for it"
        )
    if c1 * c1 != n * c2 or d1 * d1 != n * d2:
        raise RanksDisagreeError(
            f"SyncBatchNorm: the {n} ranks of the process group disagree on the layer's channels or input dtype "
            f"(this rank: {channels} channels, {dtype}); every rank must run the same model on inputs of one dtype"
        )
    if s1 * s1 != n * s2:
        raise RanksDisagreeError(
            f"SyncBatchNorm: the {n} ranks of the process group disagree on the layer's momentum, eps, affine or "
            "track_running_stats; every rank must build the same layer (their outputs and running statistics would "
            "differ)"
        )
    if 0 < reduces < known:
        raise RanksDisagreeError(
            f"SyncBatchNorm: the {n} ranks of the process group disagree on whether the layer's input requires grad "
            f"(with grad mode on): it does on {reduces} of them, not on {known - reduces}; only the former would run "
            "the backward's gradient all-reduce and wait in it for the others forever. Every rank must run the same "
            "model (the same frozen layers) under the same grad mode"
        )
    if count == 1:
        # torch's BatchNorm refuses it too: the variance of one value is 0 and the output would be the bias alone.
        raise ValueError(
            "SyncBatchNorm: expected more than 1 value per channel when training, got 1 over the whole process "
            "group; use a larger batch (or eval mode)"
        )


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        affine: bool,
        mean: Tensor,
        invstd: Tensor,
        total_count: Tensor,
        process_group: Any,
    ) -> Tensor:
        ctx.save_for_backward(input, weight, bias, mean, invstd, total_count)
        ctx.affine = affine
        ctx.process_group = process_group
        return _forward(input, affine, mean, invstd, weight, bias)  # type: ignore[arg-type]

    @staticmethod
    # Not twice differentiable: mean and invstd come from a no_grad forward as constants and the all-reduce has no
    # autograd formula, so a double backward (create_graph=True, a gradient penalty) gave silently wrong second-order
    # gradients. once_differentiable makes it raise torch's error instead.
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> Tuple[Optional[Tensor], ...]:
        input, weight, bias, mean, invstd, total_count = ctx.saved_tensors
        affine: bool = ctx.affine
        dim = [d for d in range(input.ndim) if d != 1]
        need_input, need_weight, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_input = grad_weight = grad_bias = None
        gc: Optional[Tensor] = None
        if need_input or need_weight:
            gc = torch.sum((input - mean) * grad_output, dim=dim, keepdim=True)
        if need_input:
            assert gc is not None
            w = weight.reshape_as(mean) if affine else None
            gi = invstd * w * grad_output if w is not None else invstd * grad_output
            grad_mean = -torch.sum(gi, dim=dim, keepdim=True)
            grad_invstd = gc * w if w is not None else gc
            grad_var = -0.5 * invstd.pow(3) * grad_invstd
            grad_mean = grad_mean - 2 * mean * grad_var
            vec = torch.cat([grad_mean, grad_var]).contiguous()
            work = all_reduce(vec, group=ctx.process_group, async_op=True)
            assert work is not None
            # The weight/bias gradients below overlap with the all-reduce.
            if need_weight:
                grad_weight = (gc * invstd).reshape(-1)
            if need_bias:
                grad_bias = torch.sum(grad_output, dim=dim, dtype=_stats_dtype(grad_output.dtype))
            work.wait()
            vec = vec / total_count.to(vec.dtype)
            grad_mean, grad_meansqr = vec.chunk(2)
            grad_input = (gi + grad_mean + 2 * input * grad_meansqr).to(input.dtype)
        else:
            if need_weight:
                assert gc is not None
                grad_weight = (gc * invstd).reshape(-1)
            if need_bias:
                grad_bias = torch.sum(grad_output, dim=dim, dtype=_stats_dtype(grad_output.dtype))
        # Each gradient in its tensor's dtype (fp16 parameters next to fp32 statistics).
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(torch.nn.BatchNorm2d):
    """Batch normalisation over the global batch of a process group (a faster, checkpoint-aware alternative to
    ``torch.nn.SyncBatchNorm``).

    In training mode with ``torch.distributed`` initialised, the statistics are those of the concatenation of
    every rank's input (any input with the channels in dim 1). In eval mode, or without ``torch.distributed``,
    it is ``BatchNorm2d`` (4-D input only, as upstream).

    Args:
        *args: ``BatchNorm2d``'s arguments (``num_features, eps, momentum, affine, track_running_stats``).
        process_group (Optional[ProcessGroup]): the group to synchronise over (default: the default group, looked
            up at each call, so that the layer can be copied and saved whole).
        **kwargs: ``BatchNorm2d``'s keyword arguments.
    """

    def __init__(self, *args: Any, process_group: Optional[Any] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # None: the default group, resolved at each call (upstream stored dist.group.WORLD, which made the layer
        # impossible to deepcopy or save whole, unlike torch's SyncBatchNorm).
        self._process_group = process_group
        self.saved_for_2nd_fwd: List[Tuple[Tensor, Tensor, Tensor]] = []
        # Tells fairscale.nn.checkpoint's batch-norm patching to leave this layer alone: it already updates its
        # running statistics only once per checkpointed step.
        self.disable_patch_batchnorm = True
        self._layout_checked = False  # see forward: whether the ranks' channels and dtype were compared once

    def __deepcopy__(self, memo: Dict[int, Any]) -> "SyncBatchNorm":
        # A copy (an EMA model, a reference model) synchronises over the same group: process groups cannot be copied.
        return deepcopy_sharing_group(self, memo, self._process_group)

    def __reduce_ex__(self, protocol: Any) -> Any:
        refuse_pickling_group(
            self, self._process_group
        )  # a clear TypeError instead of torch's "cannot pickle ProcessGroup"
        return super().__reduce_ex__(protocol)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, all or nothing: a failed load leaves the layer as it was (torch's copied
        the entries that fit before raising on one of another shape)."""
        return load_state_dict_all_or_nothing(self, state_dict, strict, assign)

    def _input_problem(self, input: Tensor) -> Optional[Exception]:
        """What is wrong with this rank's call on its own (``None`` if nothing)."""
        if input.ndim < 2:
            return ValueError(
                f"SyncBatchNorm expects an input with at least 2 dims (channels in dim 1), got {input.ndim}"
            )
        if input.size(1) != self.num_features:
            return ValueError(
                f"SyncBatchNorm: input has {input.size(1)} channels in dim 1 but the layer has {self.num_features}"
            )
        reference = self.weight if self.weight is not None else self.running_mean
        if (
            reference is not None
            and input.dtype != reference.dtype
            and not (input.dtype in (torch.float16, torch.bfloat16) and reference.dtype == torch.float32)
        ):
            # torch's batch norm refuses this too; only half-precision input over fp32 parameters is a supported mix
            # (before, a float32 input over float64 parameters, a forgotten .double(), was accepted silently).
            return RuntimeError(
                f"SyncBatchNorm: input dtype {input.dtype} does not match the layer's {reference.dtype} parameters "
                "(only float16/bfloat16 input over float32 parameters may mix); convert the input or the layer"
            )
        if self._updates_running_stats() and self.momentum is None:
            return RuntimeError("SyncBatchNorm does not support momentum=None (cumulative average); pass a float")
        return None

    def _updates_running_stats(self) -> bool:
        """Whether a training forward updates the running statistics: as torch's batch norm, only while
        ``track_running_stats`` is on and the buffers exist (setting the flag off at run time freezes them)."""
        return bool(self.track_running_stats) and self.running_mean is not None and self.running_var is not None

    def forward(self, input: Tensor) -> Tensor:
        if not dist.is_initialized() or not self.training:
            return super().forward(input)
        wait_phase = is_checkpointing()
        recompute_phase = is_recomputing()
        grad_mode = torch.is_grad_enabled()  # read before the no_grad block below
        if not recompute_phase:
            with torch.no_grad():
                # On CPU the layout check reads sums already in host memory; elsewhere it waits for the device, so
                # there only the first forward checks (a layer's channels are fixed, and a dtype that differs
                # between ranks usually does from the start).
                check_layout = input.device.type == "cpu" or not getattr(self, "_layout_checked", False)
                self._layout_checked = True
                problem = self._input_problem(input)
                if problem is not None:
                    # Raised alone, before the collectives, it left the other ranks waiting in them.
                    _join_and_raise(problem, input.device, self._process_group)
                settings = settings_code(self.momentum, self.eps, self.affine, self.track_running_stats)
                # Whether this call's backward runs the gradient all-reduce: _SyncBatchNormFunction's backward runs
                # it iff needs_input_grad[0], i.e. the input requires grad and grad mode is on at the call (weight or
                # bias gradients alone stay local). Unknown (None) in the first pass of a checkpointed call: it runs
                # under no_grad and the recomputation decides; such ranks are left out of the comparison.
                backward_reduces = None if wait_phase else grad_mode and input.requires_grad
                mean, var, invstd, total_count = _calculate_stats(
                    input, self.eps, self._process_group, check_layout, settings, backward_reduces
                )
                # fairscale's batch-norm patches leave this layer's flag alone (disable_patch_batchnorm); a flag
                # turned off by the user, or by OffloadModel's recomputation, freezes the statistics as in torch.
                if self._updates_running_stats():
                    assert self.running_mean is not None and self.running_var is not None  # narrows for mypy
                    assert self.momentum is not None  # refused by _input_problem; narrows the type for mypy
                    _track_running_stats(self.running_mean, self.running_var, self.momentum, mean, var, total_count)
        # Under checkpoint_wrapper the statistics are kept with the checkpointed call (its stash lives as long as the
        # call's graph): a forward whose backward never runs left them in saved_for_2nd_fwd for the next
        # recomputation to take, and two checkpointed calls of one layer, recomputed in reverse order, took each
        # other's. saved_for_2nd_fwd (upstream's list) serves code that sets the flags by hand.
        key = ("SyncBatchNorm", id(self))
        stash = current_call_stash()
        saved = stash.setdefault(key, []) if stash is not None else self.saved_for_2nd_fwd
        if wait_phase and recompute_phase:
            # The first pass of a checkpointed call nested in another one's recomputation: the statistics are those
            # the outer first pass computed (in the enclosing call's stash); this call's recomputation needs them too.
            # (Before: no statistics at all, "UnboundLocalError: 'mean'".)
            enclosing = enclosing_call_stash()
            source = enclosing.setdefault(key, []) if enclosing is not None else saved
            if not source:
                raise RuntimeError("SyncBatchNorm: recomputation without statistics saved by the checkpointed pass")
            mean, invstd, total_count = source.pop(0)
        if wait_phase:
            saved.append((mean, invstd, total_count))
            return _forward(input, self.affine, mean, invstd, self.weight, self.bias)
        if recompute_phase:
            if not saved:
                raise RuntimeError("SyncBatchNorm: recomputation without statistics saved by the checkpointed pass")
            mean, invstd, total_count = saved.pop(0)
        out: Tensor = _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.affine, mean, invstd, total_count, self._process_group
        )
        return out

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group: Optional[Any] = None) -> torch.nn.Module:
        """Replace every batch-norm layer of ``module`` by a :class:`SyncBatchNorm` sharing its parameters and buffers.

        Args:
            module (nn.Module): the module (itself converted if it is a batch-norm layer).
            process_group (Optional[ProcessGroup]): the group of the new layers (default: the world group).

        Returns:
            nn.Module: the converted module (the same object unless ``module`` itself was converted).
        """
        converted = module
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            converted = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_group=process_group,
            )
            if module.affine:
                converted.weight = module.weight
                converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            # As torch's converter: a layer frozen with .eval() stays in eval mode (in training mode its next forward
            # normalised with batch statistics and overwrote the shared running statistics).
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted
