# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""MEVO's weight gradient reaches autograd (session 37). Before, the tiles added it by hand into
``proj_weight.grad`` and gave autograd none, so:

* under FlattenParamsWrapper and FSDP's default flattening (the weight a view of a flat parameter) the gradient was
  lost: the flat gradient held only the embedding's share, or nothing for an untied head; training was wrong,
  silently;
* under torch DDP an untied head's ``AccumulateGrad`` hook never ran, so its gradient was never averaged;
* ``autograd.grad(loss, input)`` and ``backward(inputs=[input])`` changed ``proj_weight.grad``, and
  ``autograd.grad(loss, proj_weight)`` said the weight was not used;
* bf16 pieces were summed in bf16, tile after tile (up to 3x plain bf16 autograd's error);
* a ``create_graph=True`` backward returned an input gradient without a graph, silently.
"""

import copy
import functools
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fairscale.experimental.nn import MEVO
from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.misc import FlattenParamsWrapper

V, D = 11, 6


class _LM(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.lin = nn.Linear(D, D)
        self.out_w = None if tied else nn.Parameter(torch.randn(V, D))
        self.head = MEVO(self.emb.weight if tied else self.out_w, tile_factor=2)

    def forward(self, ids: Tensor, y: Tensor) -> Tensor:
        return self.head(torch.tanh(self.lin(self.emb(ids))), y)


def _batch(n: int) -> Any:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (n,), generator=g), torch.randint(0, V, (n,), generator=g)


def _grads(model: nn.Module) -> Dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and "trigger" not in n}


@pytest.mark.parametrize("tied", [True, False])
def test_gradients_under_flatten_params_wrapper_equal_the_plain_model(tied: bool) -> None:
    ref = _LM(tied)
    fpw: Any = FlattenParamsWrapper(copy.deepcopy(ref))
    ids, y = _batch(8)
    ref(ids, y).backward()
    fpw(ids, y).backward()
    want = _grads(ref)
    names = [n[len("_fpw_module.") :] for n in fpw.flat_param.metadata()[0]]
    got = dict(zip(names, fpw.flat_param.grad.split(fpw.flat_param._param_numels)))
    for name, grad in want.items():
        torch.testing.assert_close(got[name].view_as(grad), grad, rtol=1e-5, atol=1e-6)


def test_input_only_backwards_leave_the_weight_gradient_alone() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, D, generator=g).requires_grad_()
    w = nn.Parameter(torch.randn(V, D, generator=g))
    y = torch.randint(V, (12,), generator=g)
    mevo = MEVO(w, tile_factor=4)
    loss = mevo(x, y)
    (gx,) = torch.autograd.grad(loss, x, retain_graph=True)
    loss.backward(inputs=[x], retain_graph=True)
    assert w.grad is None
    (gw,) = torch.autograd.grad(loss, w, retain_graph=True)  # was: "appears to not have been used in the graph"
    loss.backward()
    x_ref, w_ref = x.detach().requires_grad_(), w.detach().requires_grad_()
    F.cross_entropy(x_ref @ w_ref.T, y, reduction="sum").backward()
    torch.testing.assert_close(gx, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, w_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)  # counted once, not three times


def test_a_second_order_backward_raises() -> None:
    x = torch.randn(8, D).requires_grad_()
    mevo = MEVO(nn.Parameter(torch.randn(V, D)), tile_factor=2)
    (gx,) = torch.autograd.grad(mevo(x, torch.randint(V, (8,))), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.pow(2).sum().backward()


def test_bf16_weight_gradient_is_summed_in_fp32() -> None:
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(256, 16, generator=g, dtype=torch.float64)
    w64 = torch.randn(64, 16, generator=g, dtype=torch.float64) * 0.3
    y = torch.randint(64, (256,), generator=g)
    x_ref, w_ref = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    F.cross_entropy(x_ref @ w_ref.T, y, reduction="sum").backward()
    w = nn.Parameter(w64.to(torch.bfloat16))
    # 16 tiles: 256 tile pairs (64 took half a minute on 2 cores: bf16 reductions are slow on CPU).
    MEVO(w, tile_factor=16)(x64.to(torch.bfloat16).requires_grad_(), y).backward()
    err = ((w.grad.double() - w_ref.grad).norm() / w_ref.grad.norm()).item()
    # bf16 carries 8 bits (3.9e-3 relative); summing the 16 tiles' pieces in bf16 gave 6.5e-3 here, fp32 sums 2.7e-3.
    assert err < 4e-3, err


def _train_case(wrap: str, tied: bool) -> None:
    ws, rank = dist.get_world_size(), dist.get_rank()
    ref = _LM(tied)
    if wrap == "ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(copy.deepcopy(ref))
    else:
        model = FSDP(copy.deepcopy(ref), flatten_parameters=wrap == "fsdp_flat")
    ids, y = _batch(4 * ws)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        model(ids[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]).backward()
        (ref(ids, y) / ws).backward()  # both average the gradients over the ranks
        opt.step()
        ref_opt.step()
    if isinstance(model, FSDP):
        with model.summon_full_params():
            got = {k: v.clone() for k, v in model.state_dict().items()}
    else:
        got = {k[len("module.") :]: v for k, v in model.state_dict().items()}
    for k, v in ref.state_dict().items():
        if not k.endswith("trigger"):
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def _train_body(rank: int, world_size: int) -> None:
    run_cases(
        (f"{wrap}, tied={tied}", functools.partial(_train_case, wrap, tied))
        for wrap in ("fsdp_flat", "fsdp", "ddp")
        for tied in (True, False)
    )


def test_training_under_fsdp_and_ddp_equals_one_process() -> None:
    run_distributed(_train_body, 2, timeout=180.0)


@pytest.mark.parametrize("ask", ["w", "x_and_w"])
def test_autograd_grad_of_the_weight_with_an_existing_gradient(ask: str) -> None:
    # With a gradient already there (accumulation, zero_grad(set_to_none=False)) the tiles add straight into it, but
    # autograd.grad must return the gradient and leave .grad alone: it returned zeros and changed .grad (review).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, D, generator=g).requires_grad_()
    w = nn.Parameter(torch.randn(V, D, generator=g))
    y = torch.randint(V, (10,), generator=g)
    w.grad = torch.full_like(w, 0.5)
    wanted = [w] if ask == "w" else [x, w]
    got = torch.autograd.grad(MEVO(w, tile_factor=2)(x, y), wanted)[-1]
    want = torch.autograd.grad(F.cross_entropy(x @ w.T, y, reduction="sum"), wanted)[-1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(w.grad, torch.full_like(w, 0.5))
