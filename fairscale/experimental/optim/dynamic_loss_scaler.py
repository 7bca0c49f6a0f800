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
"""

import math
import numbers
from collections import defaultdict
from enum import Enum
from typing import Any, Dict, Optional

import torch
from torch import Tensor

__all__ = ["DynamicLossScaler", "OptState"]


class OptState(Enum):
    """Per-optimizer stage of an iteration."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _refresh_per_optimizer_state() -> Dict[str, Any]:
    return {"stage": OptState.READY}


class DynamicLossScaler(object):
    """Scales the loss, skips steps whose gradients overflow and adapts the scale.

    Args:
        init_scale (float): initial loss scale. Default: ``2.0**15``.
        scale_factor (float): factor of every scale change. Default: 2.0.
        scale_window (int): iterations without overflow before the scale grows. Default: 2000.
        tolerance (float): fraction of overflowing iterations since the last rescale that is tolerated before the
            scale shrinks. Default: 0.0 (shrink at every overflow).
        threshold (Optional[float]): lower bound the scale never shrinks below. Default: ``None``.
        min_loss_scale (float): reaching this scale raises ``FloatingPointError``. Default: 1e-4.
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
        if not (isinstance(init_scale, (int, float)) and 0 < init_scale < float("inf")):
            raise ValueError(f"DynamicLossScaler: init_scale must be a finite number > 0, got {init_scale!r}")
        if not (isinstance(scale_factor, (int, float)) and 0 < scale_factor < float("inf")):
            raise ValueError(f"DynamicLossScaler: scale_factor must be a finite number > 0, got {scale_factor!r}")
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

    def scale(self, outputs: Tensor) -> Tensor:
        """Multiply ``outputs`` (a tensor) by the loss scale."""
        return self.loss_scale * outputs  # type: ignore[operator]

    @torch.no_grad()
    def _get_gradients_norm(self, params: Any) -> float:
        grads = [p.grad.detach() for p in params if p.grad is not None]
        if not grads:
            return 0.0
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
        return float(torch.linalg.vector_norm(norms).item())

    def _decrease_loss_scale(self) -> None:
        assert self.loss_scale is not None
        self.loss_scale /= self.scale_factor
        if self.threshold is not None:
            self.loss_scale = max(self.loss_scale, self.threshold)

    def _check_overflow(self, grad_norm: float) -> None:
        """Record an overflow when ``grad_norm`` is inf/nan, shrinking the scale; raises ``OverflowError`` then."""
        if grad_norm == float("inf") or grad_norm != grad_norm:
            prev_scale = self.loss_scale
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
                self.loss_scale = prev_scale
                raise FloatingPointError(
                    (
                        "Minimum loss scale reached ({}). Your loss is probably exploding. "
                        "Try lowering the learning rate, using gradient clipping or "
                        "increasing the batch size."
                    ).format(self.min_loss_scale)
                )
            self._iter += 1
            raise OverflowError("setting loss scale to: " + str(self.loss_scale))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide every gradient of ``optimizer`` by the loss scale, once per iteration.

        :meth:`step` unscales what was not unscaled yet, so gradient clipping may come in between
        (``unscale_``, clip, ``step``), as with torch's ``GradScaler``.

        Raises:
            RuntimeError: called twice for ``optimizer`` in one iteration, or after its :meth:`step`.
        """
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        elif optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        assert self.loss_scale is not None
        inv_scale = 1.0 / self.loss_scale
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
            RuntimeError: a ``closure`` keyword argument.
            FloatingPointError: the scale fell to ``min_loss_scale``.
        """
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if DynamicLossScaler is enabled.")
        for group in optimizer.param_groups:
            try:
                self._check_overflow(self._get_gradients_norm(group["params"]))
            except OverflowError:
                return None
        # Upstream unscaled here whatever unscale_() had done already (the gradients were divided twice, silently)
        # and never recorded the stage, so its "already unscaled" and "after step" errors could not fire.
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called on this optimizer since the last update().")
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

    def state_dict(self) -> Dict[str, Optional[float]]:
        """``{"loss_scale": ...}``."""
        return {"loss_scale": self.loss_scale}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore the loss scale (when the dict has one).

        Raises:
            ValueError: the saved loss scale is not a finite number > 0 (the scale is left as it was). Upstream took
                any value: inf or NaN skipped every later step, silently, and 0 failed at the first step with a
                ``ZeroDivisionError``.
        """
        if "loss_scale" in state_dict:
            value = state_dict["loss_scale"]
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < math.inf:
                raise ValueError(
                    f"DynamicLossScaler.load_state_dict: loss_scale must be a finite number > 0, got {value!r}; pass "
                    "a state dict saved by DynamicLossScaler.state_dict()"
                )
            self.loss_scale = value  # type: ignore[assignment]  # a Real: int, float or numpy scalar, as saved
