# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AdaScale's gradient statistics: the per-window estimates, their moving averages and the gain.

They live in the wrapped optimizer's state under ``"adascale"`` (so checkpoints carry them), as numpy vectors with
one entry per param group: ``grad_sqr_avg`` (the squared norm of the true gradient) and ``grad_var_avg`` (the
variance of the per-worker gradients), plus the bookkeeping of the chosen averaging (``*_biased``/``*_unbias`` with
debiasing, ``*_total``/``*_count`` without). Nothing here communicates: the caller all-reduces first, so every rank
computes the same values.
"""

from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from numpy.typing import NDArray

from fairscale.internal.errors import FairscaleValueError

#: The key of the statistics in the wrapped optimizer's ``state``.
STATE_KEY = "adascale"

#: One value per param group.
Vector = NDArray[Any]


def fresh(n_groups: int) -> Dict[str, Any]:
    """The statistics before any measurement: gain 1 (no variance) for each of ``n_groups`` groups."""
    return {"grad_sqr_avg": np.ones(n_groups), "grad_var_avg": np.zeros(n_groups)}


def check_loadable(data: Any) -> None:
    """Raise unless the AdaScale statistics of state dict ``data``, if it has any, hold one value per param group.

    Raises:
        ValueError: a statistics vector is missing or of another length than the dict's param groups.
    """
    if not isinstance(data, dict) or not isinstance(data.get("state"), dict) or STATE_KEY not in data["state"]:
        return  # torch's load checks the rest; a dict without statistics starts them afresh
    stats, groups = data["state"][STATE_KEY], data.get("param_groups")
    n_groups = len(groups) if isinstance(groups, list) else None
    for key in ("grad_sqr_avg", "grad_var_avg"):
        value = stats.get(key) if isinstance(stats, dict) else None
        if value is None or np.ndim(value) != 1 or (n_groups is not None and len(value) != n_groups):
            raise FairscaleValueError(
                f"AdaScale.load_state_dict: state['{STATE_KEY}']['{key}'] must hold one value per param group "
                f"({n_groups}), got {value!r}: the dict is not one AdaScale.state_dict() wrote for these groups"
            )
    as_vectors(stats)  # raises for values that are not numbers


def as_vectors(stats: Dict[str, Any]) -> Dict[str, Any]:
    """The statistics as float64 numpy vectors, whatever form a checkpoint converted them to.

    Tensors (for ``torch.load(weights_only=True)``) and lists (a JSON round trip) hold the same numbers; they were
    accepted as they were, and ``gain()`` or the next window's end failed on them ("sum() got an unexpected keyword
    argument 'axis'"; found by a fuzz, session 43).

    Raises:
        ValueError: a value is not a vector of numbers.
    """
    out: Dict[str, Any] = {}
    for key, value in stats.items():
        try:
            if isinstance(value, torch.Tensor):  # any dtype numpy lacks (bfloat16) too
                value = value.detach().cpu().double().numpy()
            out[key] = np.asarray(value, dtype=np.float64)
            if value is None or out[key].ndim != 1:
                raise ValueError(key)
        except (TypeError, ValueError, RuntimeError):
            raise FairscaleValueError(
                f"AdaScale.load_state_dict: state['{STATE_KEY}']['{key}'] must be a vector of numbers, got {value!r}"
            ) from None
    return out


def checked_smoothing(smoothing: Any, debias_ewma: bool) -> float:
    """``smoothing`` as a float, if it is a factor the moving averages can use.

    Raises:
        TypeError: not a number.
        ValueError: outside ``[0, 1)`` (``[0, 1]`` without debiasing).
    """
    try:
        value = float(smoothing)
    except (TypeError, ValueError):
        raise TypeError(f"AdaScale: smoothing must be a number in [0, 1), got {type(smoothing).__name__}") from None
    # A factor outside [0, 1] makes the averages grow without bound or flip sign; 1 never lets a measurement in
    # (with debiasing the average is then 0 / 0).
    upper_ok = value <= 1.0 if not debias_ewma else value < 1.0
    if not (value >= 0.0 and upper_ok):
        allowed = "[0, 1)" if debias_ewma else "[0, 1]"
        raise ValueError(
            f"AdaScale: smoothing must be in {allowed} (the weight of the previous average), got {smoothing}"
            + ("; 1 is allowed with debias_ewma=False only (a running mean)" if value == 1.0 else "")
        )
    return value


def estimate(
    local_sqr: Vector, total_sqr: Vector, accum: int, world_size: int, scale: float, is_scaled_loss: bool
) -> Optional[Tuple[Vector, Vector]]:
    """Unbiased estimates ``(grad_sqr, grad_var)`` of one window, from the summed local squared norms (of each
    backward's local gradients) and the squared norms of the reduced, accumulated gradients.

    Returns ``None`` for a window whose values are not finite (the step an AMP grad scaler skips, or an overflow):
    folded in, one of them made the gain NaN for good, and with it every later learning rate.
    """
    if not (np.isfinite(local_sqr).all() and np.isfinite(total_sqr).all()):
        return None
    c, n, s = accum, world_size, scale
    cn = c * n
    if c > 1:
        if is_scaled_loss:
            local_sqr = local_sqr * (c * c)
        else:
            total_sqr = total_sqr / (c * c)
    # The local term in float32 (the all-reduced squared norms' dtype), the rest in float64: upstream's roundings
    # (numpy keeps an fp32 array fp32 when multiplied or divided by a Python number), so that its gains are
    # reproduced to the last bit whatever s / cn and cn - 1 are.
    local_term = (local_sqr.astype(np.float32) * np.float32(s / cn)) / np.float32(cn - 1)
    total_sqr = total_sqr.astype(np.float64)
    grad_var = local_term.astype(np.float64) - total_sqr * s / (cn - 1)
    grad_sqr = total_sqr - grad_var / s
    grad_var = np.maximum(grad_var, 1e-6)
    grad_sqr = np.maximum(grad_sqr, 0.0)
    if not (np.isfinite(grad_var).all() and np.isfinite(grad_sqr).all()):
        return None  # finite but huge squared norms overflowed float32 in the accumulation correction
    return grad_sqr, grad_var


def update_average(state: Dict[str, Any], name: str, value: Vector, factor: float, debias_ewma: bool) -> None:
    """Fold ``value`` into the moving average ``state[name]`` (weight ``factor`` for the previous average).

    With ``debias_ewma`` an exponential average debiased as Adam's moments are (each starts at its first value);
    without it a plain running mean over the first ``1 / (1 - factor)`` values, exponential after that.
    """
    if debias_ewma:
        # Per-group vectors: a group added later starts its own debiasing at 0.
        biased = state.get(name + "_biased", np.zeros_like(value)) * factor + (1.0 - factor) * value
        unbias = state.get(name + "_unbias", np.zeros_like(value)) * factor + (1.0 - factor)
        state[name + "_biased"] = biased
        state[name + "_unbias"] = unbias
        state[name] = biased / unbias
        return
    count = state.setdefault(name + "_count", np.zeros(1))
    count += 1
    window = float("inf") if factor >= 1.0 else 1.0 / (1.0 - factor)
    if count[0] < window:
        total = state.get(name + "_total", 0.0) + value
        state[name + "_total"] = total
        state[name] = total / count
    else:
        state[name] = factor * state[name] + (1.0 - factor) * value


def rescale_variance(state: Dict[str, Any], ratio: float, debias_ewma: bool) -> None:
    """Multiply the variance estimate (and the sums it is made of) by ``ratio`` (old scale / new scale)."""
    state["grad_var_avg"] *= ratio
    extra = "grad_var_avg_biased" if debias_ewma else "grad_var_avg_total"
    if extra in state:
        state[extra] *= ratio


def add_group(state: Dict[str, Any]) -> None:
    """Extend every per-group vector by one entry for a new param group (gain 1 until it is measured)."""
    for name, value in list(state.items()):
        if name.endswith("_count") or not isinstance(value, np.ndarray) or value.ndim != 1:
            continue
        state[name] = np.append(value, 1.0 if name == "grad_sqr_avg" else 0.0)


def gain(state: Dict[str, Any], scale: float, pg_idx: Optional[int]) -> float:
    """``(var + sqr) / (var / scale + sqr)`` of group ``pg_idx``, or of the sums over all groups for ``None``."""
    var = state["grad_var_avg"]
    sqr = state["grad_sqr_avg"]
    if pg_idx is None:
        var, sqr = np.sum(var), np.sum(sqr)
    else:
        var, sqr = var[pg_idx], sqr[pg_idx]
    return float((var + sqr) / (var / scale + sqr))
