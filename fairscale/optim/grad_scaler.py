# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AMP gradient scalers: :class:`GradScaler` (accepts fp16 gradients) and :class:`ShardedGradScaler`.

Both keep the interface of torch's AMP scaler (``scale`` / ``unscale_`` / ``step`` / ``update`` /
``state_dict`` ...) and derive from ``torch.cuda.amp.GradScaler`` as upstream's do. Differences from upstream,
all deliberate:

* On torch >= 2.3 they are built on torch's device-generic scaler, so they scale, unscale and skip steps on the
  CPU too (upstream disabled itself without CUDA). The device defaults to the current accelerator, else the CPU.
* :class:`ShardedGradScaler` reduces one combined inf/nan flag per ``unscale_`` in place over its process group,
  also on the CPU (gloo), and every rank takes part even when it holds no gradient, so all ranks agree on
  skipping a step. Any nonzero flag counts as an overflow.
"""

import math
import numbers
import warnings
from typing import Any, Dict, Mapping, Optional

import torch
from torch import Tensor

from fairscale.internal import collectives
from fairscale.internal import torch_version as torch_version  # noqa: F401  # upstream's module exposes it
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.device import AmpOptState as OptState
from fairscale.internal.device import CudaAmpGradScaler, amp_scaler_device_type, device_generic_amp_scaler
from fairscale.internal.errors import FairscaleRuntimeError
from fairscale.internal.group_copy import deepcopy_sharing_group, refuse_pickling_group

try:
    from torch.distributed import ProcessGroup
except ImportError:  # pragma: no cover - torch without distributed support
    ProcessGroup = Any  # type: ignore[misc,assignment]

__all__ = ["GradScaler", "ShardedGradScaler", "OptState"]

_SUPPORTED_DEVICE_TYPES = ("cuda", "xla", "cpu", "xpu", "hpu", "mps")

# What torch's GradScaler.state_dict() holds, all read by its load_state_dict().
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
# The attributes torch's load_state_dict sets (the two tensors are filled in place).
_LOADED_ATTRIBUTES = (
    "_init_scale",
    "_scale",
    "_growth_factor",
    "_backoff_factor",
    "_growth_interval",
    "_init_growth_tracker",
    "_growth_tracker",
)


def _refresh_per_optimizer_state() -> Dict[str, Any]:
    """A fresh per-optimizer record: stage ``READY`` and no inf/nan checks yet."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _check_init_scale(who: str, init_scale: Any) -> None:
    """Raise ``ValueError`` unless ``init_scale`` is a positive finite number.

    torch accepts any value; a scale of 0 (or a negative one) makes the unscale divide by it (or flip the gradients'
    signs), and the scale never recovers: the first step writes NaN into every weight, silently.
    """
    try:
        value = float(init_scale)
    except (TypeError, ValueError):
        raise TypeError(
            f"{who}: init_scale must be a positive finite number, got {type(init_scale).__name__}"
        ) from None
    if not (math.isfinite(value) and 0 < value <= _FLOAT32_MAX):
        raise ValueError(
            f"{who}: init_scale must be a positive finite number within float32's range (the initial loss scale, "
            f"e.g. 2.0**16), got "
            f"{init_scale}"
        )


def _checked_new_scale(who: str, new_scale: Any) -> Any:
    """``new_scale`` (for ``update``) once it is known to be a positive finite number within float32's range.

    torch fills its scale with whatever it gets: 0 (or a negative or NaN value) made the next unscale divide by it and
    wrote NaN into every weight (or flipped the gradients' signs), silently; inf unscaled every gradient to 0. A
    float and a 1-element real tensor are taken as torch takes them; another real number (an int, a numpy scalar) is
    passed on as a float, which torch's ``fill_`` needs. Real tensors of another size are left to torch's own checks
    (it refuses them).

    Raises:
        ValueError: the value is 0, negative, not finite or beyond float32's range (``init_scale``'s rule).
        TypeError: neither a real number nor a tensor, or a bool or complex tensor.
    """
    if isinstance(new_scale, Tensor):
        if new_scale.is_complex() or new_scale.dtype == torch.bool:
            # torch copies either into its float scale without a word: False (or 0j) became a scale of 0 and the
            # next step wrote NaN into every weight; a complex value lost its imaginary part.
            raise TypeError(
                f"{who}: new_scale must be a real number or a real (floating point or integer) tensor, got a tensor "
                f"of dtype {new_scale.dtype}"
            )
        if new_scale.numel() != 1:
            return new_scale  # torch refuses it in its own words
        value = float(new_scale.detach().reshape(()))
    elif isinstance(new_scale, numbers.Real) and not isinstance(new_scale, bool):
        value = float(new_scale)
    else:
        raise TypeError(
            f"{who}: new_scale must be a positive finite number or a 1-element tensor, got "
            f"{type(new_scale).__name__}"
        )
    if not (math.isfinite(value) and 0 < value <= _FLOAT32_MAX):
        raise ValueError(
            f"{who}: new_scale must be a positive finite number within float32's range (the new loss scale, "
            f"e.g. 2.0**16), got {value}"
        )
    return new_scale if isinstance(new_scale, Tensor) else value


def _as_real(value: Any) -> Optional[float]:
    """``value`` as a float when it is a real number (numpy scalars too; not a bool) or a 0-dim real tensor."""
    if isinstance(value, Tensor):
        if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
            return None
        return float(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _is_integer(value: Any) -> bool:
    """Whether ``value`` is an integer torch's scale update takes as its interval: an int (numpy's too, not a bool)
    or a 0-dim integer tensor. A float, even an integral one (``2e3``), makes torch's update raise ``TypeError``."""
    if isinstance(value, Tensor):
        return value.dim() == 0 and not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_setting(who: str, name: str, raw: Any) -> float:
    """``raw``, the scaler setting ``name`` (a key of :data:`_STATE_KEYS`), as a float once it is one torch can use.

    Raises:
        TypeError: not a finite real number; an interval that is not an int; a tracker that is not a non-negative
            integer.
        ValueError: a scale that is not positive or beyond float32's range, a backoff factor outside (0, 1), a growth
            factor below 1.
    """
    value = _as_real(raw)
    if value is None or not math.isfinite(value):
        raise TypeError(f"{who}: {name} must be a finite real number, got {raw!r}")
    if name == "scale" and not 0.0 < value <= _FLOAT32_MAX:
        raise ValueError(f"{who}: the saved scale must be a positive number within float32's range, got {value}")
    # A growth factor below 1 shrank the scale at every clean interval, 0 at once: the next step multiplied the
    # gradients by 1/0 and wrote NaN into every weight, silently. A backoff factor of 1 or above never lets an
    # overflowing scale come down: every step was skipped. (1 as growth factor, a scale that never grows, is taken
    # as torch's load takes it; torch's constructor refuses it.)
    if name == "backoff_factor" and not 0.0 < value < 1.0:
        raise ValueError(f"{who}: backoff_factor must be in (0, 1) (0 zeroes the scale), got {value}")
    if name == "growth_factor" and not value >= 1.0:
        raise ValueError(f"{who}: growth_factor must be at least 1 (below, it shrinks the scale to 0), got {value}")
    # A negative growth interval is torch's way to never grow the scale (the tracker never reaches it): accepted.
    # A float one (2e3, or 4.0 from a hand-written state dict) passed an "integral value" check, and every update()
    # then raised inside torch, after the optimizer had stepped.
    if name == "growth_interval" and not _is_integer(raw):
        raise TypeError(
            f"{who}: growth_interval must be an integer (an int, e.g. 2000 rather than 2e3: torch's scale update takes "
            f"no float), got {raw!r}"
        )
    if name == "_growth_tracker" and not (value >= 0 and value.is_integer()):
        raise TypeError(f"{who}: _growth_tracker must be a non-negative integer, got {raw!r}")
    return value


def _check_loadable(who: str, state_dict: Dict[str, Any]) -> None:
    """Raise unless every entry of a scaler state dict is one torch's scaler can take and use.

    torch stores the values without looking at them (while its scale tensor does not exist yet), and a bad one
    fails later, in the middle of a step (a scale beyond float32), or silently (a backoff factor of 0 zeroes the
    scale). What torch's own scalers write (numpy scalars and 0-dim tensors included) is accepted.
    """
    for name in _STATE_KEYS:
        _check_setting(who, name, state_dict[name])


class _GeneralMultiDeviceReplicator:
    """Serves copies of ``master`` on the devices asked for (always a copy, cached per device).

    Args:
        master (Tensor): a tensor on a supported device (CUDA, XLA, CPU or another torch accelerator).
    """

    def __init__(self, master: Tensor) -> None:
        if master.device.type not in _SUPPORTED_DEVICE_TYPES:
            raise AssertionError(f"unsupported device for a grad scaler tensor: {master.device}")
        self.master = master
        self._per_device_tensors: Dict[torch.device, Tensor] = {}

    def get(self, device: torch.device) -> Tensor:
        """The copy of ``master`` on ``device`` (made on first request)."""
        copy = self._per_device_tensors.get(device)
        if copy is None:
            copy = self.master.to(device=device, non_blocking=True, copy=True)
            self._per_device_tensors[device] = copy
        return copy


def _no_inf_checks(scaler: str) -> str:
    # torch asserts it in step() (python -O removes that check; _maybe_opt_step makes it again).
    return (
        f"{scaler}.step: no inf checks were recorded for this optimizer: none of its parameters has a gradient (on "
        "any rank, for ShardedGradScaler). Run the scaled loss's backward before step()."
    )


class _ScalerBase(CudaAmpGradScaler):
    """Shared construction: torch's device-generic scaler where torch has it, with fp16 gradients allowed."""

    def __init__(
        self,
        init_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        enabled: bool,
        device: Optional[str],
    ) -> None:
        if enabled:
            _check_init_scale(type(self).__name__, init_scale)
            # What load_state_dict refuses is refused here too: a scaler built with backoff_factor=0 zeroed its scale
            # at the first overflow and wrote NaN into the weights from then on, and its state dict did not load back.
            settings: Dict[str, Any] = {"scale": init_scale, "growth_factor": growth_factor, "_growth_tracker": 0}
            settings.update(backoff_factor=backoff_factor, growth_interval=growth_interval)
            _check_loadable(type(self).__name__, settings)
        if device_generic_amp_scaler():
            device_type = amp_scaler_device_type() if device is None else str(device)
            # Skips torch.cuda.amp.GradScaler.__init__ on purpose: it only forwards with device "cuda" and a
            # deprecation warning; the grand-parent takes the device type.
            torch.amp.GradScaler.__init__(
                self,
                device_type,
                init_scale=init_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                enabled=enabled,
            )
        else:  # pragma: no cover - torch < 2.3: CUDA-only scaler, disabled (with torch's warning) without CUDA
            CudaAmpGradScaler.__init__(self, init_scale, growth_factor, backoff_factor, growth_interval, enabled)

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> Dict[torch.device, Tensor]:
        # fp16 gradients are legitimate here (fairscale Adam's PURE_FP16, FSDP/ShardedDDP fp16 reductions).
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Optional[float]:
        """torch's ``step``, whose bare ``AssertionError`` for a step before any backward names what to do here."""
        try:
            return super().step(optimizer, *args, **kwargs)
        except AssertionError as error:
            if "No inf checks were recorded" not in str(error) or isinstance(error, FairscaleRuntimeError):
                raise
            self._forget_empty_unscale(optimizer)
            raise FairscaleRuntimeError(_no_inf_checks(type(self).__name__)) from error

    def _forget_empty_unscale(self, optimizer: torch.optim.Optimizer) -> None:
        # The refused step's unscale_ recorded nothing but left the optimizer UNSCALED: every later step skipped its
        # unscale and raised this again, with gradients present (torch's scaler too; found by a fuzz, session 43).
        if self._enabled and not self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]:
            self._per_optimizer_states[id(optimizer)] = _refresh_per_optimizer_state()

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: Dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        # torch checks this with an assert just before, which python -O removes: the optimizer then stepped with no
        # inf/nan check at all.
        if not optimizer_state["found_inf_per_device"]:
            self._forget_empty_unscale(optimizer)
            raise FairscaleRuntimeError(_no_inf_checks(type(self).__name__))
        return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)

    # torch's setters store any value: set_backoff_factor(0.0) zeroed the scale at the next overflow and wrote NaN into
    # the weights from then on, a float interval made every update() raise inside torch, and the scaler's own state
    # dict no longer loaded. They refuse what the constructor and load_state_dict refuse, in the same words.

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (torch's setter), checked as the constructor checks it.

        Raises:
            ValueError: enabled, and ``new_factor`` is below 1; nothing changes then.
            TypeError: enabled, and ``new_factor`` is not a finite real number.
        """
        if self._enabled:
            _check_setting(f"{type(self).__name__}.set_growth_factor", "growth_factor", new_factor)
        super().set_growth_factor(new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (torch's setter), checked as the constructor checks it.

        Raises:
            ValueError: enabled, and ``new_factor`` is not in (0, 1); nothing changes then.
            TypeError: enabled, and ``new_factor`` is not a finite real number.
        """
        if self._enabled:
            _check_setting(f"{type(self).__name__}.set_backoff_factor", "backoff_factor", new_factor)
        super().set_backoff_factor(new_factor)

    def _clamp_growth_tracker(self) -> None:
        """Lower a count of clean steps at or beyond the (positive) interval to one short of it, so that the next
        clean step grows the scale: torch grows only when the count equals the interval, and a count left beyond it
        (torch's own ``set_growth_interval`` can leave one, and its state dicts save it) stopped the growth until the
        next overflow."""
        interval = self.get_growth_interval()
        if interval > 0 and self._get_growth_tracker() >= interval:
            tracker = int(interval) - 1
            self._init_growth_tracker = tracker
            growth_tracker = getattr(self, "_growth_tracker", None)  # a tensor once the first scale() made it
            if growth_tracker is not None:
                growth_tracker.fill_(tracker)

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (torch's setter), checked as the constructor checks it.

        When the clean steps already counted reach the new (positive) interval, the count is lowered to one short of
        it, so the next clean step grows the scale: torch grows only when the count equals the interval, and a count
        left beyond it stopped the growth until the next overflow.

        Raises:
            TypeError: enabled, and ``new_interval`` is not an integer (a float such as ``2e3`` included); nothing
                changes then.
        """
        if not self._enabled:
            super().set_growth_interval(new_interval)
            return
        _check_setting(f"{type(self).__name__}.set_growth_interval", "growth_interval", new_interval)
        super().set_growth_interval(new_interval)
        self._clamp_growth_tracker()

    def update(self, new_scale: Optional[Any] = None) -> None:
        """Update the scale (torch's ``update``); see ``torch.amp.GradScaler.update``.

        Args:
            new_scale (Optional[Any]): a scale to set instead of updating from the inf/nan checks: a positive
                finite number within float32's range, or a 1-element tensor holding one.

        Raises:
            FairscaleRuntimeError: enabled, without ``new_scale``, and no ``step()`` (or ``unscale_()``) since the
                last update: there is no inf/nan result to update from. torch checks this with an ``assert`` on older
                versions, which ``python -O`` removes (an ``IndexError`` follows there).
            ValueError: enabled, and ``new_scale`` is 0, negative, not finite or beyond float32's range (torch took
                it, and the next step wrote NaN into every weight); nothing changes then.
            TypeError: enabled, and ``new_scale`` is neither a real number nor a tensor.
        """
        if self._enabled and new_scale is not None:
            new_scale = _checked_new_scale(f"{type(self).__name__}.update", new_scale)
            scale = getattr(self, "_scale", None)
            if isinstance(new_scale, Tensor) and isinstance(scale, Tensor) and new_scale.numel() == 1:
                # torch copies it into its scale, whose shape ([] or [1], by version) it must match for copy_.
                new_scale = new_scale.reshape(scale.shape)
        if self._enabled and new_scale is None:
            recorded = any(state["found_inf_per_device"] for state in self._per_optimizer_states.values())
            if not recorded:
                raise FairscaleRuntimeError(
                    f"{type(self).__name__}.update() without a step(optimizer) or unscale_(optimizer) since the last "
                    "update(): no inf/nan check was recorded to update the scale from (call scaler.step(optimizer) "
                    "first, or pass new_scale)"
                )
        super().update(new_scale)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a scaler state; nothing changes when it is refused.

        Args:
            state_dict (Dict[str, Any]): what :meth:`state_dict` returned.

        An empty ``state_dict`` (what a disabled scaler saves) loaded into a scaler enabled on another device than
        CUDA keeps the current state, with a warning: upstream's scalers, and ``torch.cuda.amp.GradScaler``, are
        disabled without CUDA, so every checkpoint they wrote on such a machine holds ``{}``, which this scaler
        (enabled there) has to resume from.

        Raises:
            RuntimeError: enabled on CUDA, and ``state_dict`` is empty (saved from a disabled scaler), as torch.
            KeyError: enabled, and an entry is missing (torch changed the scale before raising it).
            ValueError: enabled, and the saved scale is not positive or beyond float32's range, the backoff
                factor is not in (0, 1), or the growth factor is below 1. A growth tracker at or beyond a positive
                growth interval (torch's set_growth_interval can leave one) is lowered to one short of it.
            TypeError: enabled, and an entry is not a finite real number (numpy scalars and 0-dim tensors are), the
                interval is not an integer (an int or a 0-dim integer tensor: torch's update takes no float, not
                even ``4.0``), or the tracker is not a non-negative integer.
        """
        empty = isinstance(state_dict, Mapping) and len(state_dict) == 0  # None stays torch's TypeError
        if self._enabled and empty and torch.device(getattr(self, "_device", "cuda")).type != "cuda":
            warnings.warn(
                f"{type(self).__name__}.load_state_dict: the state dict is empty, saved by a disabled scaler "
                "(upstream fairscale's and torch.cuda.amp's scalers are disabled without CUDA); this scaler, enabled "
                f"on {self._device}, keeps its current state (scale {self.get_scale()})",
                UserWarning,
                stacklevel=2,
            )
            return
        if self._enabled and state_dict:
            missing = [key for key in _STATE_KEYS if key not in state_dict]
            if missing:
                raise KeyError(
                    f"{type(self).__name__}.load_state_dict: the state dict lacks {missing} (it has "
                    f"{sorted(state_dict)}); nothing was loaded"
                )
            _check_loadable(f"{type(self).__name__}.load_state_dict", state_dict)
        # torch assigns entry after entry: a value it cannot take (a growth tracker that is not a number, a scale
        # tensor of another shape) fails after the first ones changed. Put them back then.
        saved = {name: getattr(self, name, None) for name in _LOADED_ATTRIBUTES}
        tensors = {name: value.clone() for name, value in saved.items() if isinstance(value, Tensor)}
        try:
            super().load_state_dict(state_dict)
        except BaseException:
            for name, value in saved.items():
                setattr(self, name, value)
            for name, copy in tensors.items():
                getattr(self, name).copy_(copy)
            raise
        if self._enabled and state_dict:
            self._clamp_growth_tracker()  # torch's state dicts may hold a count beyond the interval: loaded, clamped


class GradScaler(_ScalerBase):
    """torch's AMP gradient scaler that also unscales fp16 gradients.

    Use it like ``torch.amp.GradScaler``; unlike torch's, ``unscale_`` accepts fp16 gradients (for example with
    :class:`fairscale.optim.Adam` and ``precision=Precision.PURE_FP16``).

    Args:
        init_scale (float): initial scale factor, a positive finite number. Default: ``2.0**16``.
        growth_factor (float): factor the scale grows by after ``growth_interval`` steps without inf/nan.
        backoff_factor (float): factor the scale shrinks by after a step with inf/nan.
        growth_interval (int): number of consecutive clean steps before the scale grows.
        enabled (bool): ``False`` makes every method a pass-through.
        device (Optional[str]): device type of the scale (fairscale addition, keyword only); default the current
            accelerator's type, else ``"cpu"``.

    Raises:
        ValueError: enabled, with an ``init_scale`` that is 0, negative, not finite or beyond float32's range
            (torch accepts it, and the first step turns every weight into NaN), a ``backoff_factor`` outside (0, 1)
            or a ``growth_factor`` below 1.
        TypeError: enabled, with another setting that is not a finite real number, or a ``growth_interval`` that
            is not an integer (an int: a float such as ``2e3`` made every ``update()`` raise inside torch).

    ``set_growth_factor``, ``set_backoff_factor`` and ``set_growth_interval`` refuse what the constructor refuses.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        device: Optional[str] = None,
    ) -> None:
        super().__init__(init_scale, growth_factor, backoff_factor, growth_interval, enabled, device)


class ShardedGradScaler(_ScalerBase):
    """AMP gradient scaler for sharded training (FSDP, OSS, ShardedDataParallel).

    With sharded gradients each rank sees a different part of the gradients, so an inf/nan may show up on one rank
    only. ``unscale_`` (and the inf check of ``step``) reduces the inf/nan flag over ``process_group``, so every
    rank skips the same steps and backs the scale off together.

    Example::

        scaler = ShardedGradScaler()
        for batch in data:
            optimizer.zero_grad()
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                loss = model(batch).sum()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

    Args:
        init_scale (float): initial scale factor, a positive finite number. Default: ``2.0**16``.
        growth_factor (float): factor the scale grows by after ``growth_interval`` steps without inf/nan.
        backoff_factor (float): factor the scale shrinks by after a step with inf/nan.
        growth_interval (int): number of consecutive clean steps before the scale grows.
        enabled (bool): ``False`` makes every method a pass-through.
        process_group (Optional[ProcessGroup]): the ranks that share one decision; the sharding group of the
            model/optimizer (default: the world group).
        device (Optional[str]): device type of the scale (fairscale addition, keyword only); default the current
            accelerator's type, else ``"cpu"``.

    Raises:
        ValueError: enabled, with an ``init_scale`` that is 0, negative, not finite or beyond float32's range
            (torch accepts it, and the first step turns every weight into NaN), a ``backoff_factor`` outside (0, 1)
            or a ``growth_factor`` below 1.
        TypeError: enabled, with another setting that is not a finite real number, or a ``growth_interval`` that
            is not an integer (an int: a float such as ``2e3`` made every ``update()`` raise inside torch).

    ``set_growth_factor``, ``set_backoff_factor`` and ``set_growth_interval`` refuse what the constructor refuses.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Optional[ProcessGroup] = None,
        *,
        device: Optional[str] = None,
    ) -> None:
        super().__init__(init_scale, growth_factor, backoff_factor, growth_interval, enabled, device)
        self.group = process_group

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ShardedGradScaler":
        # A copy decides over the same ranks: process groups cannot be copied ("cannot pickle ProcessGroup" before).
        return deepcopy_sharing_group(self, memo, self.group)

    def __reduce_ex__(self, protocol: Any) -> Any:
        refuse_pickling_group(self, self.group)  # a clear TypeError instead of torch's "cannot pickle ProcessGroup"
        return super().__reduce_ex__(protocol)

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> Dict[torch.device, Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        # One flag on the scale's device, reduced once: ranks may hold gradients on different numbers of devices
        # (or none at all, e.g. a rank that owns no shard), and each must issue the same collectives.
        # The same all-reduce also counts the devices that held gradients: when no rank held any, there is nothing
        # the step checked, and torch's step refuses that ("No inf checks were recorded") on every rank alike. Before,
        # the combined flag made such an iteration a clean step, and the scale grew at each one.
        # It also carries the scale (as its max and, negated, its min): a rank with another scale (another
        # init_scale or growth setting, or a scaler state loaded on that rank only) unscaled its share of gradients
        # that the reductions summed over ranks scaled alike; the update was wrong on every rank, silently. A max
        # reduction keeps the flag and the count meaningful (> 0 on any rank).
        both = torch.zeros(4, dtype=torch.float32, device=found_inf.device)
        for flag in per_device.values():
            both[0] += flag.to(both.device).reshape(())
        both[1] = float(len(per_device))
        both[2] = inv_scale.to(both.device).reshape(())
        both[3] = -both[2]
        collectives.all_reduce(both, group=self.group, op="max")
        flags, devices, high, low = both.tolist()
        if high != -low:
            raise RanksDisagreeError(
                f"ShardedGradScaler: the ranks' loss scales differ (from {1 / high:g} to {1 / -low:g}) across "
                "process_group: a scaler built with another init_scale or growth setting, or loaded from another "
                "state, on some rank. Build and load the scalers alike on every rank. The step was not taken (the "
                "gradients are unscaled by each rank's own scale: zero them)."
            )
        if devices == 0:
            return {}
        combined = torch.full(found_inf.shape, flags, dtype=found_inf.dtype, device=found_inf.device)
        return {combined.device: combined}
