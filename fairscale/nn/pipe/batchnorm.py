# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Batch normalization whose running statistics cover the whole mini-batch, not each micro-batch."""

import warnings
from typing import Any, Optional, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from fairscale.internal.dry_load import in_dry_run
from fairscale.internal.errors import FairscaleValueError
from fairscale.nn.checkpoint.checkpoint_utils import patch_batchnorm_while

from .checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm"]

TModule = TypeVar("TModule", bound=nn.Module)

# In a state dict's metadata for a DeferredBatchNorm: (elements per channel, micro-batches) not yet committed.
_COUNTS_KEY = "fairscale_deferred_counts"


class DeferredBatchNorm(_BatchNorm):
    """A batch norm that normalizes each micro-batch with its own statistics but updates the running statistics
    once per mini-batch (every ``chunks`` micro-batches), with the statistics of the whole mini-batch.

    The running variance is the population (biased) variance of the mini-batch, as upstream computes it.
    Statistics are not tracked during the recomputation of a checkpointed micro-batch. Partial sums carry over to
    the next ``forward`` when a mini-batch yields fewer than ``chunks`` micro-batches. An empty mini-batch leaves
    the running statistics as they are (as a plain batch norm does: only ``num_batches_tracked`` counts it), and a
    ``forward`` that raises leaves the partial sums and counts as they were.

    Args:
        num_features (int): the number of channels (dimension 1 of the input).
        eps (float): added to the variance for numerical stability.
        momentum (Optional[float]): the running-average factor, ``None`` for a cumulative average.
        affine (bool): learnable ``weight`` and ``bias``.
        chunks (int): the number of micro-batches of a mini-batch.
    """

    sum: Tensor
    sum_squares: Tensor
    running_mean: Tensor
    running_var: Tensor
    num_batches_tracked: Tensor

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        chunks: int = 1,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.register_buffer("sum", torch.zeros_like(self.running_mean))
        self.register_buffer("sum_squares", torch.zeros_like(self.running_var))
        self.counter = 0  # elements per channel seen since the last commit
        self.tracked = 0  # micro-batches seen since the last commit
        self.chunks = chunks

    def _check_input_dim(self, input: Tensor) -> None:
        # Upstream defines a >= 3-D check that its forward never calls; 2-D (N, C) inputs work.
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        # Without affine parameters nothing else compares the channels with the sums: a 1-channel input broadcast
        # into them silently, another count failed half-way through the accumulation.
        if input.size(1) != self.num_features:
            raise ValueError(
                f"DeferredBatchNorm({self.num_features}) got an input with {input.size(1)} channels (dimension 1 of "
                f"shape {tuple(input.shape)}): pass inputs of shape (N, {self.num_features}, ...)"
            )

    def _track(self, input: Tensor) -> bool:
        """Accumulate the statistics of a micro-batch; return whether a whole mini-batch was seen."""
        dim = [0, *range(2, input.dim())]
        with torch.no_grad():
            # Both sums first, then the updates: an error leaves the accumulators as they were.
            batch_sum = input.sum(dim)
            batch_sum_squares = (input**2).sum(dim)
            self.sum += batch_sum
            self.sum_squares += batch_sum_squares
        # An empty micro-batch counts as one of the mini-batch (the next mini-batch starts in step) with no elements.
        self.counter += input.numel() // input.size(1)
        self.tracked += 1
        # At least: counts loaded from a pipe with more chunks (a resume with another `chunks`) are past it already.
        return self.tracked >= self.chunks

    def _commit(self) -> None:
        """Update the running statistics with the mini-batch statistics and reset the sums."""
        self.num_batches_tracked += 1
        if self.counter > 0:
            # An empty mini-batch has no statistics (0 / 0 made the running ones NaN for good); a plain batch norm
            # leaves them alone too and counts the batch in num_batches_tracked only.
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
            else:
                factor = self.momentum
            mean = self.sum / self.counter
            var = self.sum_squares / self.counter - mean**2
            self.running_mean.mul_(1 - factor).add_(mean * factor)
            self.running_var.mul_(1 - factor).add_(var * factor)
        self.sum.zero_()
        self.sum_squares.zero_()
        self.counter = 0
        self.tracked = 0

    # The counts of a carried-over mini-batch travel in the state dict's metadata (not as entries: upstream's format
    # has none, and a strict load of ours there must still work). Without them a load paired the loaded partial sums
    # with this instance's counts, and the next commit divided them by the wrong number, silently.
    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        metadata = getattr(destination, "_metadata", None)
        if metadata is not None and prefix[:-1] in metadata:
            metadata[prefix[:-1]][_COUNTS_KEY] = (self.counter, self.tracked)

    def _load_from_state_dict(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: Any,
        unexpected_keys: Any,
        error_msgs: Any,
    ) -> None:
        errors = len(error_msgs)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if len(error_msgs) > errors or prefix + "sum" not in state_dict or self.sum.is_meta or in_dry_run():
            # A failed load, or an all-or-nothing load's trial run (on shape-only tensors, or with assign=True on the
            # state dict's own: setting the counts there left them changed by a load that then failed).
            return
        counts = local_metadata.get(_COUNTS_KEY) if isinstance(local_metadata, dict) else None
        if counts is not None:
            self.counter, self.tracked = int(counts[0]), int(counts[1])
        elif bool(self.sum.any()) or bool(self.sum_squares.any()):
            # Partial sums without their counts (upstream's format, or a dict edited by hand): unusable, so the
            # carried-over micro-batches are dropped; the running statistics are what was loaded.
            warnings.warn(
                f"DeferredBatchNorm ({prefix or 'root'}): the state dict holds the partial sums of an unfinished "
                "mini-batch but not their counts (saved by upstream fairscale?); they are dropped",
                stacklevel=2,
            )
            if isinstance(local_metadata, dict) and local_metadata.get("assign_to_params_buffers"):
                # assign=True made the caller's state-dict tensors this module's buffers: zeroing them in place
                # changed the caller's dict.
                self.sum = torch.zeros_like(self.sum)
                self.sum_squares = torch.zeros_like(self.sum_squares)
            else:
                with torch.no_grad():
                    self.sum.zero_()
                    self.sum_squares.zero_()
            self.counter = self.tracked = 0
        else:
            self.counter = self.tracked = 0

    def forward(self, input: Tensor) -> Tensor:
        if not self.training:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        self._check_input_dim(input)
        # Normalize with the micro-batch's own statistics, as a plain batch norm on that chunk would. First: it
        # rejects what a plain batch norm rejects (one value per channel, wrong dtypes), and a rejected micro-batch
        # must not reach the sums (it was mixed into the next commit, which then fell out of step for good).
        output = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if not is_recomputing() and self._track(input):
            self._commit()
        return output

    @classmethod
    def convert_deferred_batch_norm(cls, module: TModule, chunks: int = 1) -> TModule:
        """Replace (recursively, in place for containers) every batch norm that tracks running statistics by a
        :class:`DeferredBatchNorm` sharing its parameters and buffers.

        Args:
            module (nn.Module): a batch norm or a module containing some.
            chunks (int): the number of micro-batches.

        Returns:
            The converted module (``module`` itself unless it is a batch norm that had to be replaced).
        """
        if isinstance(module, DeferredBatchNorm) and module.chunks is chunks:
            return module
        compiled = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(compiled, nn.Module) and any(
            isinstance(m, _BatchNorm)
            and m.track_running_stats
            and not (isinstance(m, DeferredBatchNorm) and m.chunks == chunks)
            for m in compiled.modules()
        ):
            # Its compiled code calls the batch norm it was compiled with: a replacement inside would never run, and
            # the running statistics would move once per micro-batch, silently.
            raise FairscaleValueError(
                f"{type(compiled).__name__} was compiled (torch.compile) before its batch norms were made deferred: "
                "convert first, then compile (DeferredBatchNorm.convert_deferred_batch_norm(layer, chunks), then "
                "torch.compile), or compile only layers without batch norm"
            )

        module_output: nn.Module = module
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            converted = DeferredBatchNorm(module.num_features, module.eps, module.momentum, module.affine, chunks)
            if module.affine:
                converted.register_parameter("weight", module.weight)
                converted.register_parameter("bias", module.bias)
            converted.register_buffer("running_mean", module.running_mean)
            converted.register_buffer("running_var", module.running_var)
            converted.register_buffer("num_batches_tracked", module.num_batches_tracked)
            # The sums live where the statistics live.
            if module.running_mean is None:
                raise FairscaleValueError(
                    f"{type(module).__name__} has track_running_stats=True but no running_mean buffer: restore it "
                    "(or set track_running_stats=False) before converting to DeferredBatchNorm"
                )
            converted.register_buffer("sum", torch.zeros_like(module.running_mean))
            converted.register_buffer("sum_squares", torch.zeros_like(module.running_mean))
            module_output = converted

        for name, child in module.named_children():
            module_output.add_module(name, cls.convert_deferred_batch_norm(child, chunks))

        return cast(TModule, module_output)


def count_plain_batch_norms_once(module: nn.Module) -> None:
    """Make the plain batch norms in ``module`` leave their running statistics alone in a checkpointed micro-batch's
    recomputation.

    A checkpointed micro-batch runs its partition twice, without grad in the forward and again in the backward: a
    plain batch norm updated its statistics both times (``num_batches_tracked`` 3 or 4 per mini-batch of 2
    micro-batches instead of 2), where it updates them once per micro-batch outside a pipe. The forward's update is
    the one kept, as :class:`DeferredBatchNorm` (which is left alone here) keeps it. Layers with a
    ``disable_patch_batchnorm`` attribute manage their statistics themselves and are skipped too.
    """
    for layer in module.modules():
        if isinstance(layer, _BatchNorm) and not isinstance(layer, DeferredBatchNorm):
            patch_batchnorm_while(layer, is_recomputing)
