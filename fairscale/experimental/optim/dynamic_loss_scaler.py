# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A dynamic loss scaler written with plain tensor operations (no CUDA-only AMP kernels): it runs on any device.

It follows the fairseq-style rule: the loss scale is divided by ``scale_factor`` when the scaled gradients
overflow (subject to ``tolerance`` and ``threshold``) and multiplied by it after ``scale_window`` iterations
without overflow. Usage mirrors ``torch.amp.GradScaler``::

    scaler = DynamicLossScaler()
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)   # skipped (returns None) when the gradients overflowed
        scaler.update()

Each optimizer's stage of the iteration is recorded (:class:`OptState`), as in ``torch.amp.GradScaler``: call
:meth:`unscale_` before :meth:`step` to clip the true gradients, and :meth:`step` unscales only what was not
unscaled yet. (Upstream recorded no stage, so that order divided the gradients twice; see docs/differences.rst.)

The scale an iteration multiplies its losses by is fixed at its first :meth:`scale` (or :meth:`unscale_` /
:meth:`step`) call and divided out of every optimizer's gradients, even after an overflow lowered ``loss_scale``
(as upstream, at once, in :meth:`step`): upstream divided a second optimizer's gradients by the lowered scale, so
they came out ``scale_factor`` times too large. One iteration lowers the scale at most once.
"""

import math
import numbers
from collections import defaultdict
from enum import Enum
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

_SPARSE_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)

__all__ = ["DynamicLossScaler", "OptState"]


class OptState(Enum):
    """Per-optimizer stage of an iteration."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _refresh_per_optimizer_state() -> Dict[str, Any]:
    return {"stage": OptState.READY}


def _real(value: Any) -> Optional[float]:
    """``value`` as a float when it is a real number (numpy's too; not a bool), else ``None``."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _stored_values(grad: Tensor) -> Tensor:
    """The values a gradient holds: itself when dense, the (summed) stored entries of a sparse one.

    The norm of a sparse tensor has no kernel (upstream's ``torch.norm`` failed on them too); its norm is that of
    its coalesced values (duplicate entries add up first, as they do in the optimizer's step).
    """
    if grad.layout == torch.sparse_coo:
        return grad.coalesce().values()
    if grad.layout in _SPARSE_COMPRESSED:
        return grad.values()
    return grad


def _check_optimizer(optimizer: Any, method: str) -> None:
    if getattr(optimizer, "param_groups", None) is None:
        raise TypeError(
            f"DynamicLossScaler.{method}: expected a torch optimizer (with param_groups), got "
            f"{type(optimizer).__name__}"
        )


def _norm(grad: Tensor) -> Tensor:
    """The gradient's 2-norm as a float64 scalar, inf only when a value is.

    fp16 gradients are summed in float32 (their squares overflow in their own dtype); float32 and bf16 ones in
    float64: a finite value above about 1.8e19 has a square beyond float32's range, and such a step was skipped as an
    overflow (the scale halved) with nothing inf or NaN (a fuzz, session 45; upstream did the same). float64 and
    complex gradients in their own dtype (a narrower ``dtype`` is refused for them).
    """
    if grad.is_complex() or grad.dtype == torch.float64:
        norm: Tensor = torch.linalg.vector_norm(grad)
    else:
        norm = torch.linalg.vector_norm(grad, dtype=torch.float32 if grad.dtype == torch.float16 else torch.float64)
    return norm.double()


class DynamicLossScaler(object):
    """Scales the loss, skips steps whose gradients overflow and adapts the scale.

    Args:
        init_scale (float): initial loss scale. Default: ``2.0**15``.
        scale_factor (float): factor of every scale change, above 1. Default: 2.0.
        scale_window (int): iterations without overflow before the scale grows. Default: 2000.
        tolerance (float): fraction (in [0, 0.5]) of overflows among the iterations since the last rescale (an
            overflowing iteration counts twice) that is tolerated before the scale shrinks. Default: 0.0 (shrink at
            every overflow).
        threshold (Optional[float]): lower bound the scale never shrinks below, at most ``init_scale``. Default:
            ``None``.
        min_loss_scale (float): reaching this scale raises ``FloatingPointError``. Default: 1e-4.

    Raises:
        ValueError: a ``scale_window`` that is not an int >= 1; an ``init_scale`` that is not a finite number > 0; a
            ``scale_factor`` that is not a finite number > 1; a ``tolerance`` outside [0, 0.5] (or NaN); a
            ``threshold`` that is not ``None`` or a finite number in (0, ``init_scale``]; a ``min_loss_scale`` that
            is not a finite number >= 0. (Upstream took the last five unchecked: the scale then stayed too high, or
            went to inf, and every step was skipped, silently.)
    """

    def __init__(
        self,
        init_scale: float = 2.0**15,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        tolerance: float = 0.0,
        threshold: Optional[float] = None,
        min_loss_scale: float = 1e-4,
    ) -> None:
        if isinstance(scale_window, bool) or not isinstance(scale_window, int) or scale_window < 1:
            # 0 failed at the first update() with "integer modulo by zero".
            raise ValueError(f"DynamicLossScaler: scale_window must be an int >= 1 (iterations), got {scale_window!r}")
        init = _real(init_scale)
        if init is None or not 0 < init < math.inf:
            raise ValueError(f"DynamicLossScaler: init_scale must be a finite number > 0, got {init_scale!r}")
        # Upstream took the settings below unchecked; each of these values left the scale too high for good, so
        # every later step was skipped, silently (no FloatingPointError either).
        factor = _real(scale_factor)
        if factor is None or not 1 < factor < math.inf:
            raise ValueError(
                "DynamicLossScaler: scale_factor must be a finite number > 1 (an overflow divides the scale by it: 1 "
                f"never lowers the scale, below 1 raises it), got {scale_factor!r}"
            )
        # An overflowing iteration advances the iteration count twice (in step() and in update(), upstream's
        # counting), so right after a backoff the overflow fraction can reach 0.5 but never more: above 0.5 the scale
        # shrank once and then never again while every step overflowed.
        tol = _real(tolerance)
        if tol is None or not 0 <= tol <= 0.5:
            raise ValueError(
                "DynamicLossScaler: tolerance must be a number in [0, 0.5] (the fraction of overflows among the "
                "iterations since the last rescale, an overflowing iteration counted twice, tolerated before the "
                f"scale shrinks: it never exceeds 0.5 after a backoff, so a larger tolerance stops the scale from "
                f"coming down), got {tolerance!r}"
            )
        if threshold is not None:
            floor = _real(threshold)
            if floor is None or not 0 < floor < math.inf:
                raise ValueError(
                    "DynamicLossScaler: threshold must be None or a finite number > 0 (the lowest scale an overflow "
                    f"may set), got {threshold!r}"
                )
            if floor > init:
                raise ValueError(
                    f"DynamicLossScaler: threshold ({threshold!r}) must not exceed init_scale ({init_scale!r}): the "
                    "first overflow would raise the scale to it. Lower threshold or raise init_scale"
                )
        min_scale = _real(min_loss_scale)
        if min_scale is None or not 0 <= min_scale < math.inf:
            raise ValueError(
                "DynamicLossScaler: min_loss_scale must be a finite number >= 0 (reaching it raises "
                f"FloatingPointError), got {min_loss_scale!r}"
            )
        self.loss_scale: Optional[float] = init_scale
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.tolerance = tolerance
        self.threshold = threshold
        self.min_loss_scale = min_loss_scale
        self._iter = 0
        self._last_overflow_iter = -1
        self._last_rescale_iter = -1
        self._overflows_since_rescale = 0
        self._per_optimizer_states: Dict[int, Dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)
        self._scale: Optional[Tensor] = None
        # The scale this iteration's losses are multiplied by, fixed until update(): an overflow lowers loss_scale
        # at once (upstream's timing), while gradients scaled by the old value may still wait for their unscale.
        self._iteration_scale: Optional[float] = None
        # Whether this iteration already lowered the scale: two optimizers overflowing on one loss are one overflow.
        self._iteration_overflowed = False

    def _scale_of_iteration(self) -> Optional[float]:
        if self._iteration_scale is None:
            self._iteration_scale = self.loss_scale
        return self._iteration_scale

    def scale(self, outputs: Tensor) -> Tensor:
        """Multiply ``outputs`` (a tensor, or a number) by the loss scale of this iteration.

        That is ``loss_scale`` at the iteration's first :meth:`scale`, :meth:`unscale_` or :meth:`step` call: it
        stays the same until :meth:`update` even when an overflow in :meth:`step` lowered ``loss_scale`` already.
        """
        if not isinstance(outputs, (Tensor, numbers.Number)):
            # An int loss scale times a list repeated the list, silently.
            raise TypeError(
                f"DynamicLossScaler.scale: expected the loss (a tensor or a number), got {type(outputs).__name__}; scale each "
                "loss of a list separately"
            )
        return self._scale_of_iteration() * outputs  # type: ignore[operator]

    @torch.no_grad()
    def _get_gradients_norm(self, params: Any) -> float:
        grads = [_stored_values(p.grad.detach()) for p in params if p.grad is not None]
        if not grads:
            return 0.0
        norms = torch.stack([_norm(g) for g in grads])
        return float(torch.linalg.vector_norm(norms).item())

    def _decrease_loss_scale(self) -> None:
        assert self.loss_scale is not None
        self.loss_scale /= self.scale_factor
        if self.threshold is not None:
            self.loss_scale = max(self.loss_scale, self.threshold)

    def _check_overflow(self, grad_norm: float) -> None:
        """Record an overflow when ``grad_norm`` is inf/nan, shrinking the scale; raises ``OverflowError`` then.

        Only the iteration's first overflow changes the scale and the counters: upstream lowered the scale once per
        overflowing optimizer of the same loss (twice for two optimizers, where torch's scaler lowers it once).
        """
        if grad_norm == float("inf") or grad_norm != grad_norm:
            if self._iteration_overflowed:
                raise OverflowError("loss scale already lowered in this iteration, to: " + str(self.loss_scale))
            # What the FloatingPointError below puts back: a failed call changes nothing (before, the counters stayed
            # changed, and a retried step() divided by zero).
            before = (self.loss_scale, self._last_overflow_iter, self._overflows_since_rescale, self._last_rescale_iter)
            iter_since_rescale = self._iter - self._last_rescale_iter
            self._last_overflow_iter = self._iter
            self._overflows_since_rescale += 1
            pct_overflow = self._overflows_since_rescale / float(iter_since_rescale)
            if pct_overflow >= self.tolerance:
                self._decrease_loss_scale()
                self._last_rescale_iter = self._iter
                self._overflows_since_rescale = 0
            assert self.loss_scale is not None
            if self.loss_scale <= self.min_loss_scale:
                self.loss_scale, self._last_overflow_iter, self._overflows_since_rescale, self._last_rescale_iter = (
                    before
                )
                raise FloatingPointError(
                    (
                        "Minimum loss scale reached ({}). Your loss is probably exploding. "
                        "Try lowering the learning rate, using gradient clipping or "
                        "increasing the batch size."
                    ).format(self.min_loss_scale)
                )
            self._iter += 1
            self._iteration_overflowed = True
            raise OverflowError("setting loss scale to: " + str(self.loss_scale))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide every gradient of ``optimizer`` by this iteration's loss scale, once per iteration.

        :meth:`step` unscales what was not unscaled yet, so gradient clipping may come in between
        (``unscale_``, clip, ``step``), as with torch's ``GradScaler``. Sparse gradients are divided too.

        Raises:
            RuntimeError: called twice for ``optimizer`` in one iteration, or after its :meth:`step` (a skipped one
                included).
        """
        _check_optimizer(optimizer, "unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        elif optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        scale = self._scale_of_iteration()
        if scale is None:
            raise RuntimeError("DynamicLossScaler.unscale_: loss_scale is None, there is no scale to divide by")
        inv_scale = 1.0 / scale
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inv_scale)
        optimizer_state["stage"] = OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale and step ``optimizer`` unless a group's gradient norm is inf/nan.

        Returns:
            ``optimizer.step(*args, **kwargs)``'s result, or ``None`` when the step was skipped.

        Raises:
            RuntimeError: a ``closure`` keyword argument; a second call for ``optimizer`` before :meth:`update`
                (after a skipped step too: upstream checked the gradients again and lowered the scale once more).
            FloatingPointError: the scale fell to ``min_loss_scale``.
        """
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if DynamicLossScaler is enabled.")
        # Upstream unscaled here whatever unscale_() had done already (the gradients were divided twice, silently)
        # and never recorded the stage, so its "already unscaled" and "after step" errors could not fire.
        _check_optimizer(optimizer, "step")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called on this optimizer since the last update().")
        self._scale_of_iteration()  # fixed before an overflow lowers loss_scale: later optimizers unscale by it
        for group in optimizer.param_groups:
            try:
                self._check_overflow(self._get_gradients_norm(group["params"]))
            except OverflowError:
                optimizer_state["stage"] = OptState.STEPPED  # skipped is done for this iteration, as in torch's
                return None
        if optimizer_state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        result = optimizer.step(*args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        return result

    def update(self) -> None:
        """End the iteration: grow the scale after ``scale_window`` iterations without overflow."""
        if (self._iter - self._last_overflow_iter) % self.scale_window == 0:
            assert self.loss_scale is not None
            self.loss_scale *= self.scale_factor
            self._last_rescale_iter = self._iter
        self._iter += 1
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._iteration_scale = None
        self._iteration_overflowed = False

    def state_dict(self) -> Dict[str, Any]:
        """``{"loss_scale": ...}`` (upstream's dict) and the counters that decide the scale's next change.

        The counters (``iter``, ``last_overflow_iter``, ``last_rescale_iter``, ``overflows_since_rescale``) make a
        resumed run change its scale at the same iterations as the uninterrupted one (without them the scale grew
        ``scale_window`` clean iterations after the resume instead of after the last overflow). Upstream's loader
        reads ``loss_scale`` only, so these dicts load there too.

        Take it at an iteration boundary (after :meth:`update`): the scale of an iteration left open is not saved,
        so a scaler loading a dict taken between two optimizers' :meth:`step` calls divides the remaining gradients by
        the loaded ``loss_scale`` (lowered already if the iteration overflowed).
        """
        return {
            "loss_scale": self.loss_scale,
            "iter": self._iter,
            "last_overflow_iter": self._last_overflow_iter,
            "last_rescale_iter": self._last_rescale_iter,
            "overflows_since_rescale": self._overflows_since_rescale,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore the loss scale (when the dict has one) and the counters (when it has them: upstream's dicts do
        not, and the counters then stay as they are).

        An iteration this scaler has open (:meth:`scale`, :meth:`unscale_` or :meth:`step` called since the last
        :meth:`update`) keeps its scale: gradients already multiplied by it are divided by it, and the loaded
        ``loss_scale`` applies from the next iteration (before, a load between ``backward`` and :meth:`step`
        divided them by the loaded scale). Call :meth:`update` first to start anew at once.

        Raises:
            ValueError: the saved loss scale is not a finite number > 0, or the dict has some counters but not all,
                or one is not an integer in its range; nothing is changed then. Upstream
                took any loss scale: inf or NaN skipped every later step, silently, and 0 failed at the first step
                with a ``ZeroDivisionError``.
        """
        if "loss_scale" in state_dict:
            value = state_dict["loss_scale"]
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < _as_float(value) < math.inf:
                raise ValueError(
                    f"DynamicLossScaler.load_state_dict: loss_scale must be a finite number > 0, got {value!r}; pass "
                    "a state dict saved by DynamicLossScaler.state_dict()"
                )
        counters = _counters(state_dict)
        if "loss_scale" in state_dict:
            value = state_dict["loss_scale"]
            # An int past int64 (2**70) is a finite scale, but multiplying a tensor by it raised a bare OverflowError
            # at the next scale() (a review, session 50): kept as the float it is.
            self.loss_scale = (
                float(value) if isinstance(value, numbers.Integral) and abs(int(value)) >= 2**63 else value
            )
        if counters is not None:
            self._iter, self._last_overflow_iter, self._last_rescale_iter, self._overflows_since_rescale = counters


def _as_float(value: Any) -> float:
    # An int past float's range (10**400) raised a bare OverflowError from float(): it is out of range, as inf is.
    try:
        return float(value)
    except OverflowError:
        return math.inf


_COUNTERS = ("iter", "last_overflow_iter", "last_rescale_iter", "overflows_since_rescale")


def _counters(state_dict: Dict[str, Any]) -> Optional[Tuple[int, int, int, int]]:
    """The saved counters, checked (all or none: None when the dict has none, as upstream's)."""
    present = [k for k in _COUNTERS if k in state_dict]
    if not present:
        return None
    if len(present) != len(_COUNTERS):
        missing = [k for k in _COUNTERS if k not in state_dict]
        raise ValueError(
            f"DynamicLossScaler.load_state_dict: the dict has the counters {present} but not {missing}; pass a "
            "state dict saved by DynamicLossScaler.state_dict() (or one with loss_scale only)"
        )
    values = [state_dict[k] for k in _COUNTERS]
    for key, value in zip(_COUNTERS, values):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"DynamicLossScaler.load_state_dict: {key} must be an integer, got {value!r}")
    it, last_overflow, last_rescale, overflows = (int(v) for v in values)
    if it < 0 or not -1 <= last_overflow <= it or not -1 <= last_rescale <= it or overflows < 0:
        raise ValueError(
            "DynamicLossScaler.load_state_dict: inconsistent counters (need iter >= 0, -1 <= last_overflow_iter <= "
            f"iter, -1 <= last_rescale_iter <= iter, overflows_since_rescale >= 0), got {dict(zip(_COUNTERS, values))}"
        )
    return it, last_overflow, last_rescale, overflows
