# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Layer-wise gradient scaling: a separate scale per layer, applied with full backward hooks.

Gradients of layers deep in a network (far from the loss) can underflow in fp16 while those near the loss are
fine. Instead of one loss scale, :class:`LayerwiseGradientScaler` gives chosen layers their own scale: the hook
of layer ``i`` multiplies the gradient it passes back by ``s_(i-1) / s_i``, so the gradient arriving at layer
``i``'s output carries the factor ``s_i / s_last`` (the factors telescope). :meth:`LayerwiseGradientScaler.unscale`
divides each layer's parameter gradients by its scale again; :meth:`LayerwiseGradientScaler.step` skips the step
when a gradient is inf/nan and adapts the scales of the layers that overflowed.

Usage::

    scaler = LayerwiseGradientScaler(model, {"fc1": 1024.0, "fc2": 512.0})
    for x, y in data:
        optimizer.zero_grad()
        scaler.scale()
        loss_fn(model(x), y).backward()
        scaler.unscale()
        scaler.step(optimizer)

Behaviour kept from upstream (documented in ``docs/differences.rst``): layers are all of ``model.named_modules()``
except the root, containers included, in that order; the scheme is exact only when the last of them has scale 1
(end the model with e.g. ``nn.Identity``); :meth:`unscale` skips the layers that overflowed in the *previous*
step; and a container's scale also divides its children's gradients.
"""

import enum
import logging
import math
import numbers
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from fairscale.internal.errors import FairscaleValueError

__all__ = ["LayerInfo", "GradientHelper", "LayerwiseGradientScaler"]

logger = logging.getLogger(__name__)


class LayerInfo:
    """One layer's scaling state.

    Args:
        name (str): the layer's name in ``model.named_modules()``.
        layer (nn.Module): the layer.
        scale (float): its gradient scale. Default: 1.0.
        scale_layer (bool): whether the scale adapts (backoff on overflow, growth). Default: ``False``.
    """

    def __init__(self, name: str, layer: nn.Module, scale: float = 1.0, scale_layer: bool = False) -> None:
        self.layer_name = name
        self.layer = layer
        self.scaling_factor = scale
        self.found_inf_or_nan = False
        self.growth_tracker = 0
        self.scale_layer = scale_layer


class GradientHelper:
    """The full backward hook of one layer: multiplies the gradients it passes back by a constant.

    Args:
        name (str): the layer's name.
        inputs_multiplier (float): the previous layer's scale.
        outputs_multiplier (float): the reciprocal of this layer's scale.
    """

    def __init__(self, name: str, inputs_multiplier: float, outputs_multiplier: float) -> None:
        self.layer_name = name
        self.inputs_multiplier = inputs_multiplier
        self.outputs_multiplier = outputs_multiplier

    def scale_gradients(
        self, m: nn.Module, inputs: Tuple[Optional[Tensor], ...], outputs: Tuple[Optional[Tensor], ...]
    ) -> Tuple[Optional[Tensor], ...]:
        """The hook: ``inputs`` are the gradients w.r.t. the layer's inputs (``None`` entries are kept)."""
        factor = self.inputs_multiplier * self.outputs_multiplier
        return tuple(None if g is None else g * factor for g in inputs)


class _Stage(enum.Enum):
    """Where a :class:`LayerwiseGradientScaler` is in its ``scale()`` / backward / ``unscale()`` / ``step()`` cycle.

    The methods divide or multiply the gradients in place and register hooks, so a call out of turn is not a no-op:
    a second ``scale()`` registered every hook twice (gradients scaled twice over), an ``unscale()`` without
    ``scale()``, or a second one, divided gradients that were not scaled.
    """

    READY = "ready"  # no hooks: scale() next (or step() without scaling)
    SCALED = "scaled"  # hooks registered: the backward, then unscale()
    UNSCALED = "unscaled"  # gradients divided back, hooks removed: step() (or scale() again once they are cleared)


class LayerwiseGradientScaler:
    """Per-layer gradient scales with dynamic backoff and growth.

    Args:
        model (nn.Module): the model.
        layer_scale_dict (Dict[str, float]): initial scale per layer name (``model.named_modules()`` names); empty
            disables scaling (every method is then a pass-through).
        growth_factor (float): scale growth after ``growth_interval`` clean steps. Default: 2.0.
        backoff_factor (float): scale shrink after an overflow. Default: 0.5.
        growth_interval (int): clean steps before a growth. Default: 10000.
        min_scale (float): lower bound of the scales. Default: the smallest positive normal fp32.
        max_scale (float): upper bound of the scales. Default: the largest fp32.

    Raises:
        ValueError: (also an ``AssertionError``, as upstream asserted) with scaling enabled, ``growth_factor <= 1``,
            ``backoff_factor`` outside (0, 1) or ``min_scale <= 0``; and (a plain ``ValueError``) with scaling
            enabled, a ``growth_interval`` below 1 (the scales never grew), a ``min_scale`` or ``max_scale`` that is
            not finite (inf pinned the scales at inf), a ``max_scale`` below ``min_scale``; a scale in
            ``layer_scale_dict`` that is not a positive finite number (0 divided by zero in :meth:`scale`, NaN or inf
            poisoned the gradients), or a name the model does not have; a model holding flattened parameters
            (FullyShardedDataParallel or FlattenParamsWrapper with ``flatten_parameters=True``), whose gradients
            cannot be unscaled layer by layer.
        TypeError: a scale that is not a number; with scaling enabled, a ``growth_interval`` that is not an int, or a
            ``min_scale`` / ``max_scale`` that is not a number.

    With scaling enabled, the calls must come in the order ``scale()``, backward, ``unscale()``, ``step()``:
    ``scale()`` twice in a row, ``unscale()`` without a ``scale()`` before it, ``step()`` between ``scale()`` and
    ``unscale()``, and ``scale()`` after ``unscale()`` while the model still holds gradients (no ``step()`` or
    ``zero_grad()`` in between) raise ``RuntimeError`` and change nothing (they used to scale or unscale the gradients
    twice, to step with scaled gradients, or to divide the gradients already unscaled again). ``step()`` without any
    ``scale()`` still steps as upstream did. To accumulate gradients over micro-batches, call ``scale()`` once before
    the first and ``unscale()`` once after the last.
    """

    def __init__(
        self,
        model: nn.Module,
        layer_scale_dict: Dict[str, float],
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 10000,
        min_scale: float = torch.finfo(torch.float32).tiny,
        max_scale: float = torch.finfo(torch.float32).max,
    ) -> None:
        self._model = model
        self._layer_scale_dict = layer_scale_dict
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._apply_layerwise_scaling = bool(layer_scale_dict)
        self._handles: List[Any] = []
        self._stage = _Stage.READY
        self.layer_info: List[LayerInfo] = []
        if self._apply_layerwise_scaling:
            if not self._growth_factor > 1.0:
                raise FairscaleValueError(f"The growth factor must be > 1.0, got {self._growth_factor}.")
            # 0 or less collapsed every overflowing layer's scale to min_scale at once (its gradients then underflowed
            # and were silently wrong); a min_scale of 0 or less let a scale reach 0, and scale() divided by it.
            if not 0.0 < self._backoff_factor < 1.0:
                raise FairscaleValueError(
                    f"The backoff factor must be < 1.0 and > 0 (0 or less zeroes the scales), got {self._backoff_factor}."
                )
            _check_bounds(min_scale, max_scale)
            if not self._min_scale > 0.0:
                raise FairscaleValueError(
                    f"The min scale must be > 0 (a scale of 0 divides the gradients by 0), got {self._min_scale}."
                )
            _check_growth_interval(growth_interval)
            for name, scale in layer_scale_dict.items():
                _check_scale(name, scale)
            self.layer_info = self._build_layer_info()

    def _build_layer_info(self) -> List[LayerInfo]:
        infos = []
        for name, layer in self._model.named_modules():
            if name == "":
                continue  # the root
            if name in self._layer_scale_dict:
                infos.append(LayerInfo(name, layer, self._layer_scale_dict[name], scale_layer=True))
            else:
                infos.append(LayerInfo(name, layer))
        unknown = set(self._layer_scale_dict) - {info.layer_name for info in infos}
        if unknown:
            raise ValueError(f"layer_scale_dict names layers the model does not have: {sorted(unknown)}")
        _refuse_flat_parameters(self._model)
        # What each layer's gradients are read from: checked again before each backward (see _check_layers).
        self._param_names = [[n for n, _ in info.layer.named_parameters()] for info in infos]
        return infos

    def _check_layers(self) -> None:
        """Raise unless every layer still holds the parameters it had when the scaler was built.

        Wrapping the model afterwards in FullyShardedDataParallel or FlattenParamsWrapper (``flatten_parameters=True``)
        moves them into one flat parameter: unscale() found no gradient to divide and left them multiplied by the
        scales, silently (a fuzz of mixed precision, session 46).
        """
        _refuse_flat_parameters(self._model)
        for info, names in zip(self.layer_info, self._param_names):
            now = [n for n, _ in info.layer.named_parameters()]
            if now != names:
                raise RuntimeError(
                    f"LayerwiseGradientScaler: layer {info.layer_name!r} holds the parameters {now}, not the "
                    f"{names} it held when the scaler was built. FullyShardedDataParallel or FlattenParamsWrapper "
                    "with flatten_parameters=True moves a layer's parameters into one flat parameter, whose gradient "
                    "cannot be unscaled layer by layer: wrap with flatten_parameters=False, and build the scaler "
                    "again after changing the model."
                )

    def scale(self) -> None:
        """Register the scaling hooks for the next backward (call before the forward).

        Raises:
            RuntimeError: :meth:`scale` was already called and :meth:`unscale` not since (the hooks are in place); a
                layer no longer holds the parameters it held when the scaler was built (the model was flattened by
                a wrapper since).
            ValueError: the model holds flattened parameters now.
        """
        if not self._apply_layerwise_scaling:
            return
        if self._stage is _Stage.SCALED:
            raise RuntimeError(
                "LayerwiseGradientScaler.scale: already called, and unscale() not since: the hooks are in place, a "
                "second set would scale the gradients twice. Run the backward, then unscale() and step() (after a "
                "forward or backward that raised, unscale() removes the hooks)."
            )
        self._check_layers()
        # The next unscale() divides the whole accumulated gradient: what the last unscale() already divided is
        # scaled back first, exactly as unscale() divides it, so a scale()/unscale() pair per micro-batch
        # accumulates right (it divided the earlier micro-batches again). No check of the values (a device sync per
        # parameter): gradients about to be zeroed (upstream's scale(); zero_grad(); ... loop) are scaled for
        # nothing, harmlessly.
        if self._stage is _Stage.UNSCALED:
            with torch.no_grad():
                for info in self.layer_info:
                    if info.found_inf_or_nan:
                        continue  # unscale() left those as they were
                    for _, param in info.layer.named_parameters():
                        if param.grad is not None:
                            param.grad.mul_(info.scaling_factor)
        self._stage = _Stage.SCALED
        for idx, info in enumerate(self.layer_info):
            inputs_multiplier = 1.0 if idx == 0 else self.layer_info[idx - 1].scaling_factor
            helper = GradientHelper(info.layer_name, inputs_multiplier, 1.0 / info.scaling_factor)
            self._handles.append(info.layer.register_full_backward_hook(helper.scale_gradients))

    def unscale(self) -> None:
        """Divide each layer's parameter gradients by its scale and remove the hooks (call after backward).

        Raises:
            RuntimeError: :meth:`scale` was not called before (or this :meth:`unscale` already ran after it): the
                gradients are not scaled, dividing them would make them wrong.
        """
        if not self._apply_layerwise_scaling:
            return
        if self._stage is not _Stage.SCALED:
            again = self._stage is _Stage.UNSCALED
            raise RuntimeError(
                "LayerwiseGradientScaler.unscale: "
                + ("already called since the last scale()" if again else "scale() was not called before")
                + ": the gradients are not scaled, and dividing them by the scales would make them wrong. Call scale() "
                "before the forward, then the backward, unscale() once, and step()."
            )
        self._stage = _Stage.UNSCALED
        with torch.no_grad():
            for info in self.layer_info:
                if info.found_inf_or_nan:
                    continue
                inv = 1.0 / info.scaling_factor
                for _, param in info.layer.named_parameters():
                    if param.grad is not None:
                        param.grad.mul_(inv)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _check_for_inf_or_nan(self) -> None:
        for info in self.layer_info:
            info.found_inf_or_nan = False
            for _, param in info.layer.named_parameters():
                if param.grad is not None and not bool(torch.isfinite(param.grad).all()):
                    info.found_inf_or_nan = True
                    break

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` unless a layer's gradients hold inf/nan, then update the scales.

        Raises:
            RuntimeError: between :meth:`scale` and :meth:`unscale` (the gradients are still scaled).
        """
        if not self._apply_layerwise_scaling:
            optimizer.step()
            return
        if self._stage is _Stage.SCALED:
            raise RuntimeError(
                "LayerwiseGradientScaler.step: scale() was called and unscale() not since: the gradients are still "
                "scaled. Call unscale() after the backward, then step()."
            )
        self._stage = _Stage.READY
        self._check_for_inf_or_nan()
        if not any(info.found_inf_or_nan for info in self.layer_info):
            optimizer.step()
        else:
            logger.debug("layer-wise gradient scaler: inf/nan gradients, optimizer step skipped")
        self._update_scale()

    def _clamp(self, value: float) -> float:
        return max(self._min_scale, min(value, self._max_scale))

    def _update_scale(self) -> None:
        for info in self.layer_info:
            if info.found_inf_or_nan:
                if info.scale_layer:
                    info.scaling_factor = self._clamp(self._backoff_factor * info.scaling_factor)
                    info.growth_tracker = 0
            else:
                info.growth_tracker += 1
                if info.scale_layer and info.growth_tracker == self._growth_interval:
                    info.scaling_factor = self._clamp(self._growth_factor * info.scaling_factor)
                    info.growth_tracker = 0

    def get_layer_info(self) -> List[LayerInfo]:
        """The per-layer states, in ``named_modules()`` order (root excluded)."""
        return self.layer_info

    def get_backward_hooks(self) -> List[Tuple[str, Any]]:
        """``(name, backward hooks)`` of every non-root module (to check that :meth:`unscale` removed them)."""
        return [(name, layer._get_backward_hooks()) for name, layer in self._model.named_modules() if name != ""]


def _refuse_flat_parameters(model: nn.Module) -> None:
    """Raise ``ValueError`` if ``model`` holds a FlattenParamsWrapper flat parameter (the layers' parameters in one)."""
    # Imported here: fairscale.nn imports fairscale.optim (ShardedDataParallel), which is still loading at import time.
    from fairscale.nn.misc._flatten.flat_parameter import FlatParameter

    flat = [name for name, p in model.named_parameters() if isinstance(p, FlatParameter)]
    if flat:
        raise ValueError(
            f"LayerwiseGradientScaler: the model holds flattened parameters {flat[:3]} (FullyShardedDataParallel or "
            "FlattenParamsWrapper with flatten_parameters=True), which join the parameters of several layers: their "
            "gradients cannot be unscaled layer by layer. Wrap with flatten_parameters=False."
        )


def _check_growth_interval(growth_interval: Any) -> None:
    """Raise unless ``growth_interval`` is a whole number >= 1.

    A layer's scale grows when its count of clean steps equals the interval: 0 or less was never reached, and 2.5 or
    a string was never equal, so the scales silently never grew. An integral float (``1e4``) equals the count, as
    upstream took it.
    """
    if (
        isinstance(growth_interval, bool)
        or not isinstance(growth_interval, numbers.Real)
        or not float(growth_interval).is_integer()
    ):
        raise TypeError(
            f"LayerwiseGradientScaler: growth_interval must be an int (clean steps before a scale grows), got "
            f"{type(growth_interval).__name__} {growth_interval!r}"
        )
    if growth_interval < 1:
        raise ValueError(
            f"LayerwiseGradientScaler: growth_interval must be >= 1 (clean steps before a scale grows), got "
            f"{growth_interval}"
        )


def _check_bounds(min_scale: Any, max_scale: Any) -> None:
    """Raise unless ``min_scale`` and ``max_scale`` are finite numbers with ``min_scale <= max_scale``.

    A min_scale of inf pinned every scale at inf after one step (its gradients divided to 0, or NaN); bounds in the
    wrong order clamped every scale to min_scale whatever happened.
    """
    for name, value in (("min_scale", min_scale), ("max_scale", max_scale)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"LayerwiseGradientScaler: {name} must be a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise ValueError(
                f"LayerwiseGradientScaler: {name} must be finite (a scale of inf divides the gradients to 0), got "
                f"{value}; the defaults are float32's smallest normal and largest values"
            )
    if min_scale > max_scale:
        raise ValueError(
            f"LayerwiseGradientScaler: min_scale ({min_scale}) must not exceed max_scale ({max_scale}): every scale "
            "would be clamped to min_scale"
        )


def _check_scale(name: str, scale: Any) -> None:
    """Raise unless ``scale``, the initial scale of layer ``name``, is a positive finite number."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(
            f"LayerwiseGradientScaler: the scale of layer {name!r} must be a number, got {type(scale).__name__} "
            f"{scale!r}"
        )
    if not (math.isfinite(scale) and float(scale) > 0):
        raise ValueError(
            f"LayerwiseGradientScaler: the scale of layer {name!r} must be a positive finite number, got {scale}; "
            "leave a layer out of layer_scale_dict to keep its gradients unscaled (scale 1)"
        )
