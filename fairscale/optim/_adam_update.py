# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The arithmetic of :class:`fairscale.optim.Adam`, on PyTorch's own Adam kernels (no C++/CUDA extension).

Upstream's fused kernel computes, per element and in fp32, with ``t`` the step of the group::

    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = sqrt(v) + eps                       (sqrt(v + eps) with eps_inside_sqrt)
    S = lr * sqrt(1 - b2**t) / (1 - b1**t)      (lr without bias_correction)
    p = p - S * (m / denom + weight_decay * p)

PyTorch's AdamW (fused on devices that have the fused kernel, foreach elsewhere) computes
``p = p * (1 - lr' * wd') - lr' / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps')``, which is the same
update with ``lr' = S * (1 - b1**t) / sqrt(1 - b2**t)``, ``eps' = eps / sqrt(1 - b2**t)`` and ``wd' = S * wd / lr'``.
Only ``eps_inside_sqrt`` has no AdamW equivalent; it runs as plain tensor arithmetic here.

Tensors that are not fp32 (fp16 parameters, fp16 state scaled by the optimizer-state scale) are updated through
fp32 copies that are written back, so the arithmetic is always fp32 as in upstream's kernel.
"""

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor
from torch.optim.adamw import adamw as _torch_adamw

__all__ = ["AdamHyper", "adam_update"]


@dataclass(frozen=True)
class AdamHyper:
    """The hyper-parameters of one group for one step (``step`` is the group's step count ``t``, >= 1)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction: bool
    eps_inside_sqrt: bool
    step: int


def _fused_devices() -> List[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return list(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch: the fused Adam kernel is CUDA-only
        return ["cuda"]


_FUSED_DEVICES = _fused_devices()


def adam_update(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    hyper: AdamHyper,
    state_scale: float = 1.0,
) -> Optional[bool]:
    """Update ``params`` and their state in place with upstream's Adam arithmetic.

    Args:
        params: the tensors to update (fp32 masters, or the parameters themselves), all on one device.
        grads: their gradients (any float dtype; read as fp32).
        exp_avgs, exp_avg_sqs: the state, fp32 or fp16; fp16 state is stored multiplied by ``state_scale``.
        hyper: the group's hyper-parameters.
        state_scale: the optimizer-state scale of fp16 state (1.0 otherwise).

    Returns:
        Optional[bool]: for fp16 state, whether a stored moment became inf/nan; ``None`` otherwise.
    """
    work_p = [p if p.dtype == torch.float32 else p.float() for p in params]
    work_g = [g if g.dtype == torch.float32 else g.float() for g in grads]
    fp16_state = any(t.dtype != torch.float32 for t in exp_avgs + exp_avg_sqs)
    work_m = [_load_state(m, state_scale) for m in exp_avgs]
    work_v = [_load_state(v, state_scale) for v in exp_avg_sqs]
    if hyper.eps_inside_sqrt:
        _update_eps_inside_sqrt(work_p, work_g, work_m, work_v, hyper)
    else:
        _update_with_torch_adamw(work_p, work_g, work_m, work_v, hyper)
    for dst, src in zip(params, work_p):
        if dst is not src:
            dst.copy_(src)
    found_inf = False
    for dst, src in zip(exp_avgs + exp_avg_sqs, work_m + work_v):
        if dst is not src:
            dst.copy_(src * state_scale if dst.dtype != torch.float32 else src)
            if dst.dtype != torch.float32:
                found_inf = found_inf or not bool(torch.isfinite(dst).all())
    return found_inf if fp16_state else None


def _load_state(t: Tensor, scale: float) -> Tensor:
    if t.dtype == torch.float32:
        return t
    return t.float() / scale


def _step_size(hyper: AdamHyper) -> float:
    if not hyper.bias_correction:
        return hyper.lr
    return hyper.lr * math.sqrt(1 - hyper.beta2**hyper.step) / (1 - hyper.beta1**hyper.step)


def _update_with_torch_adamw(
    params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], hyper: AdamHyper
) -> None:
    bc1 = 1 - hyper.beta1**hyper.step
    sqrt_bc2 = math.sqrt(1 - hyper.beta2**hyper.step)
    step_size = _step_size(hyper)
    lr = step_size * bc1 / sqrt_bc2
    weight_decay = step_size * hyper.weight_decay / lr if lr != 0 else 0.0
    device = params[0].device
    fused = device.type in _FUSED_DEVICES
    # torch increments the step tensors before using them: start one below the group's step.
    steps = [
        torch.full((), float(hyper.step - 1), dtype=torch.float32, device=device if fused else "cpu") for _ in params
    ]
    _torch_adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=None if fused else True,
        fused=True if fused else None,
        amsgrad=False,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        lr=lr,
        weight_decay=weight_decay,
        eps=hyper.eps / sqrt_bc2,
        maximize=False,
    )


def _update_eps_inside_sqrt(
    params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], hyper: AdamHyper
) -> None:
    step_size = _step_size(hyper)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        m.mul_(hyper.beta1).add_(g, alpha=1 - hyper.beta1)
        v.mul_(hyper.beta2).addcmul_(g, g, value=1 - hyper.beta2)
        update = m / (v + hyper.eps).sqrt()
        if hyper.weight_decay != 0:
            update.add_(p, alpha=hyper.weight_decay)
        p.add_(update, alpha=-step_size)
