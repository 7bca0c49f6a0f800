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

import logging
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
        ValueError: (also an ``AssertionError``, as upstream asserted) with scaling enabled, ``growth_factor <= 1``
            or ``backoff_factor >= 1``.
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
        self.layer_info: List[LayerInfo] = []
        if self._apply_layerwise_scaling:
            if not self._growth_factor > 1.0:
                raise FairscaleValueError(f"The growth factor must be > 1.0, got {self._growth_factor}.")
            if not self._backoff_factor < 1.0:
                raise FairscaleValueError(f"The backoff factor must be < 1.0, got {self._backoff_factor}.")
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
        return infos

    def scale(self) -> None:
        """Register the scaling hooks for the next backward (call before the forward)."""
        if not self._apply_layerwise_scaling:
            return
        for idx, info in enumerate(self.layer_info):
            inputs_multiplier = 1.0 if idx == 0 else self.layer_info[idx - 1].scaling_factor
            helper = GradientHelper(info.layer_name, inputs_multiplier, 1.0 / info.scaling_factor)
            self._handles.append(info.layer.register_full_backward_hook(helper.scale_gradients))

    def unscale(self) -> None:
        """Divide each layer's parameter gradients by its scale and remove the hooks (call after backward)."""
        if not self._apply_layerwise_scaling:
            return
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
        """Step ``optimizer`` unless a layer's gradients hold inf/nan, then update the scales."""
        if not self._apply_layerwise_scaling:
            optimizer.step()
            return
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
