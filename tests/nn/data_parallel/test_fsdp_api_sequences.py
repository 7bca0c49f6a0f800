# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FullyShardedDataParallel under orders of API calls that randomized sequences of calls found wrong (session 35),
each against plain PyTorch on the global batch (DDP's averaging):

* a frozen parameter's gradient vanished from ``p.grad`` at the next backward of its unit, and an unfreeze brought
  it back, added to the next gradient even across ``zero_grad(set_to_none=True)``;
* hybrid sharding over a one-rank shard group did not refuse ``optimizer.step()`` / ``clip_grad_norm_()`` after a
  ``no_sync()`` backward (the replicas drifted apart);
* ``clip_grad_norm_()`` after ``model.double()`` failed inside ``torch.linalg.vector_norm``;
* a move (``.to()``, ``.double()``/``.float()``, ``_reset_lazy_init()``) inside a ``no_sync()`` window made
  ``optimizer.step()`` fail with torch's "size of tensor a must match" instead of the documented refusal.
"""

import contextlib
import copy
import functools
from typing import Any, List, Optional

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.errors import FairscaleRuntimeError
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import hybrid_groups

WORLD = 2
TIMEOUT = 120.0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


def _batch(step: int) -> Tensor:
    return torch.randn(2 * WORLD, 4, generator=torch.Generator().manual_seed(step))


def _mine(x: Tensor) -> Tensor:
    rank = dist.get_rank()
    return x[2 * rank : 2 * rank + 2]


def _reference_backward(ref: nn.Module, step: int) -> None:
    x = _batch(step)
    (sum(ref(x[2 * r : 2 * r + 2]).pow(2).sum() for r in range(WORLD)) / WORLD).backward()


def _full_grad(model: FSDP, param: nn.Parameter) -> Optional[Tensor]:
    """The gathered gradient of a (flat or unflattened) parameter, None when its p.grad is None on every rank."""
    pieces: List[Optional[Tensor]] = [None] * WORLD
    dist.all_gather_object(pieces, None if param.grad is None else param.grad.detach().clone())
    if all(p is None for p in pieces):
        return None
    return torch.cat([p.reshape(-1) for p in pieces if p is not None])


def _frozen_gradient_case(flatten: bool, window: bool = False, obc: bool = False) -> None:
    """``window``: the first backward runs inside ``no_sync()``, and the freeze comes inside that window."""
    torch.manual_seed(0)
    plain = _Net()
    ref = copy.deepcopy(plain)
    net = copy.deepcopy(plain)
    if flatten:  # the root's flat parameter (b) is frozen while the nested unit (a) trains
        net.a = FSDP(net.a, optimize_backward_concat=obc)
        model = FSDP(net, optimize_backward_concat=obc)
        frozen = [p for n, p in model.named_parameters() if ".a." not in n and "a." != n[:2]]
        ref_frozen = [ref.b.weight, ref.b.bias]
    else:  # one parameter of an unflattened unit
        model = FSDP(net, flatten_parameters=False)
        frozen = [p for n, p in model.named_parameters() if n.endswith("a.bias")]
        ref_frozen = [ref.a.bias]
    assert frozen

    def check(what: str) -> None:
        # The flat parameter holds b's weight and bias (and zero padding): compared through the sum of all elements.
        got = [_full_grad(model, p) for p in frozen]
        want = [r.grad for r in ref_frozen]
        if all(w is None for w in want):
            assert all(g is None for g in got), f"{what}: p.grad is set, plain torch's is None"
            return
        assert all(g is not None for g in got), f"{what}: p.grad is None, plain torch keeps its gradient"
        total = sum(g.sum() for g in got if g is not None)
        torch.testing.assert_close(total, sum(w.sum() for w in want if w is not None), msg=lambda m: f"{what}: {m}")

    if window:
        with model.no_sync():
            model(_mine(_batch(0))).pow(2).sum().backward()
    else:
        model(_mine(_batch(0))).pow(2).sum().backward()
    _reference_backward(ref, 0)
    for p in frozen + ref_frozen:
        p.requires_grad_(False)
    model(_mine(_batch(1))).pow(2).sum().backward()
    _reference_backward(ref, 1)
    check("frozen, after a backward of its unit")
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    for p in frozen + ref_frozen:
        p.requires_grad_(True)
    model(_mine(_batch(2))).pow(2).sum().backward()
    _reference_backward(ref, 2)
    check("unfrozen after zero_grad, after the next backward")


def _frozen_body(rank: int, world_size: int) -> None:
    run_cases((f"flatten={flat}", functools.partial(_frozen_gradient_case, flat)) for flat in (False, True))


def _frozen_in_window_body(rank: int, world_size: int) -> None:
    run_cases(
        (f"flatten={flat},obc={obc}", functools.partial(_frozen_gradient_case, flat, True, obc))
        for flat, obc in ((True, False), (True, True), (False, False))
    )


def test_a_parameter_frozen_inside_no_sync_keeps_the_window_gradient() -> None:
    """The window's sum of a parameter frozen inside ``no_sync()`` is reduced into p.grad, as a plain module keeps
    it (it was kept aside, p.grad stayed None, and an unfreeze added it to a later gradient across zero_grad())."""
    run_distributed(_frozen_in_window_body, WORLD, timeout=TIMEOUT)


def test_a_frozen_parameter_keeps_its_gradient_and_zero_grad_clears_it() -> None:
    run_distributed(_frozen_body, WORLD, timeout=TIMEOUT)


def _hybrid_one_rank_case(call: str) -> None:
    shard, replicas = hybrid_groups(1)
    torch.manual_seed(0)
    model = FSDP(nn.Linear(4, 4), process_group=shard, replicate_process_group=replicas)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.no_sync():
        model(_mine(_batch(0))).sum().backward()
        with pytest.raises(FairscaleRuntimeError, match="no_sync"):
            opt.step() if call == "step" else model.clip_grad_norm_(1.0)
    model(_mine(_batch(1))).sum().backward()  # the window's last backward reduces both: then they may run
    opt.step()
    weights: List[Optional[Tensor]] = [None] * WORLD
    with model.summon_full_params():
        dist.all_gather_object(weights, model.weight.detach().clone())
    assert weights[0] is not None and weights[1] is not None and torch.equal(weights[0], weights[1])


def _hybrid_body(rank: int, world_size: int) -> None:
    run_cases((call, functools.partial(_hybrid_one_rank_case, call)) for call in ("step", "clip_grad_norm_"))


def test_hybrid_one_rank_shard_group_refuses_a_step_inside_no_sync() -> None:
    run_distributed(_hybrid_body, WORLD, timeout=TIMEOUT)


def _clip_after_double_body(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    ref = copy.deepcopy(plain).double()
    model = FSDP(copy.deepcopy(plain)).double()
    x = _batch(0).double()
    model(_mine(x)).pow(2).sum().backward()
    (sum(ref(x[2 * r : 2 * r + 2]).pow(2).sum() for r in range(WORLD)) / WORLD).backward()
    norm = model.clip_grad_norm_(1.0)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    # In float64, as torch (it was fp32, and the clipped gradients differed from torch's by its rounding).
    assert norm.dtype == torch.float64
    torch.testing.assert_close(norm, want)
    assert model.clip_grad_norm_(0.5, norm_type=float("inf")).dtype == torch.float64


def test_clip_grad_norm_after_double() -> None:
    run_distributed(_clip_after_double_body, WORLD, timeout=TIMEOUT)


def _move_in_window_case(move: str) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    ref = copy.deepcopy(plain)
    model = FSDP(copy.deepcopy(plain))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.no_sync():
        model(_mine(_batch(0))).pow(2).sum().backward()
        if move == "to":
            model.to("cpu")
        elif move == "double_float":
            model.double().float()
        else:
            model._reset_lazy_init()
        with pytest.raises(FairscaleRuntimeError, match="inside a no_sync"):
            opt.step()
    model(_mine(_batch(1))).pow(2).sum().backward()
    for step in range(2):
        _reference_backward(ref, step)
    got = _full_grad(model, next(model.parameters()))
    want = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])  # type: ignore[union-attr]
    assert got is not None
    torch.testing.assert_close(got[: want.numel()], want)


def _move_body(rank: int, world_size: int) -> None:
    run_cases((move, functools.partial(_move_in_window_case, move)) for move in ("to", "double_float", "reset"))


def test_a_move_inside_no_sync_keeps_the_step_refusal() -> None:
    run_distributed(_move_body, WORLD, timeout=TIMEOUT)


def _load_refused_on_one_rank_case(what: str) -> None:
    torch.manual_seed(0)
    net = _Net()
    net.a = FSDP(net.a)
    model = FSDP(net)
    sd = model.state_dict() if what == "load_state_dict" else model.local_state_dict()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # Rank 0 keeps a forward whose backward is still to come; rank 1's forward has no graph.
    if dist.get_rank() == 0:
        out = model(_mine(_batch(0)))
    else:
        with torch.no_grad():
            out = model(_mine(_batch(0)))
    with pytest.raises(RuntimeError, match="between a forward and its backward"):
        getattr(model, what)(sd)
    del out
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    getattr(model, what)(sd)  # the graph is gone: the load goes through on every rank


def _load_refused_body(rank: int, world_size: int) -> None:
    run_cases(
        (what, functools.partial(_load_refused_on_one_rank_case, what))
        for what in ("load_state_dict", "load_local_state_dict")
    )


def test_a_load_refused_on_one_rank_is_refused_on_every_rank() -> None:
    """A load refused on one rank (a backward pending there only) raises on every rank, leaving the model unchanged
    (the other ranks went into the load's collectives and waited until the group's timeout)."""
    run_distributed(_load_refused_body, WORLD, timeout=60.0)


class _FailOnRank(torch.autograd.Function):
    """Identity whose backward raises when ``fail`` (a simulated out-of-memory error on one rank)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fail: bool) -> Tensor:
        ctx.fail = fail
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        if ctx.fail:
            raise RuntimeError("simulated out-of-memory error")
        return grad, None


class _FailingInsideNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(_FailOnRank.apply(self.a(x), dist.get_rank() == 0))


def _load_after_uneven_abort_case(how: str) -> None:
    torch.manual_seed(0)
    model = FSDP(_FailingInsideNet())
    sd = model.state_dict()
    out = model(_mine(_batch(0)))
    # Rank 0's backward fails inside the model (FSDP's backward hooks ran), rank 1's before it reaches the model.
    with pytest.raises(RuntimeError, match="simulated"):
        _FailOnRank.apply(out, dist.get_rank() == 1).sum().backward()
    del out
    with pytest.warns(UserWarning, match="did not finish") if dist.get_rank() == 0 else contextlib.nullcontext():
        if how == "parent":
            nn.Sequential(model).load_state_dict({"0." + k: v for k, v in sd.items()})
        else:
            model.load_state_dict(sd)
    for key, value in model.state_dict().items():
        assert torch.equal(value, sd[key]), key


def _uneven_abort_body(rank: int, world_size: int) -> None:
    run_cases((how, functools.partial(_load_after_uneven_abort_case, how)) for how in ("parent", "direct"))


def test_loads_after_a_backward_that_failed_at_different_points_on_the_ranks() -> None:
    """A backward that raised inside the model on one rank and before it on the other: the loads recover first, as
    the other calls between steps do (the parent-module load skipped the agreed check on the rank left in a backward
    state, and the other rank waited in it until the timeout; the direct load was refused on every rank)."""
    run_distributed(_uneven_abort_body, WORLD, timeout=60.0)


def _load_in_summon_case() -> None:
    torch.manual_seed(0)
    model = FSDP(_Net())
    sd = model.state_dict()
    # A forward whose backward is still to come on rank 0; rank 1's has no graph.
    with torch.no_grad() if dist.get_rank() == 1 else contextlib.nullcontext():
        out = model(_mine(_batch(0)))
    with model.summon_full_params():
        with pytest.raises(RuntimeError, match="inside summon_full_params"):
            model.load_state_dict(sd)
        copied = copy.deepcopy(model.module)  # a full-weight copy, as before the context record of session 36
    del out
    assert [tuple(p.shape) for p in copied.parameters()] == [(4, 4), (4,), (4, 4), (4,)]


def _load_in_summon_body(rank: int, world_size: int) -> None:
    run_cases([("load and copy inside summon_full_params", _load_in_summon_case)])


def test_a_load_inside_summon_refused_on_one_rank_is_refused_on_every_rank() -> None:
    """Inside summon_full_params(), a load refused on one rank (a backward pending there) raises on every rank (the
    others waited in the load's gather); a copy of the wrapped module made there holds the full weights."""
    run_distributed(_load_in_summon_body, WORLD, timeout=60.0)


def _cast_under_setting_case(setting: str, flatten: bool) -> None:
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    swap = torch.__future__.get_swap_module_params_on_conversion()
    try:
        torch.__future__.set_overwrite_module_params_on_conversion(setting == "overwrite")
        torch.__future__.set_swap_module_params_on_conversion(setting == "swap")
        torch.manual_seed(0)
        ref = _Net()
        model = FSDP(copy.deepcopy(ref), flatten_parameters=flatten)
        model(_mine(_batch(0))).pow(2).sum().backward()  # after lazy init, with gradients to convert
        before = list(model.parameters())
        model.double()
        ref.double()
        # Still the objects FSDP shards (a new one would be an unsharded stranger, refused at the next forward).
        assert [id(p) for p in model.parameters()] == [id(p) for p in before]
        assert all(p.dtype == torch.float64 for p in before)
        assert torch.__future__.get_overwrite_module_params_on_conversion() == (setting == "overwrite")
        assert torch.__future__.get_swap_module_params_on_conversion() == (setting == "swap")
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
        torch.__future__.set_swap_module_params_on_conversion(swap)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(1, 3):
        opt.zero_grad()
        ref_opt.zero_grad()
        model(_mine(_batch(step).double())).pow(2).sum().backward()
        x = _batch(step).double()
        (sum(ref(x[2 * r : 2 * r + 2]).pow(2).sum() for r in range(WORLD)) / WORLD).backward()
        opt.step()
        ref_opt.step()
    with model.summon_full_params():
        got = {k: v.clone() for k, v in model.state_dict().items()}
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v)


def _cast_under_setting_body(rank: int, world_size: int) -> None:
    run_cases(
        (f"{setting}-flatten={flatten}", functools.partial(_cast_under_setting_case, setting, flatten))
        for setting in ("overwrite", "swap")
        for flatten in (True, False)
    )


def test_a_cast_under_torch_future_conversion_settings_keeps_the_sharded_parameters() -> None:
    """``torch.__future__.set_overwrite_module_params_on_conversion(True)`` made ``model.double()`` register new
    parameter objects that FSDP did not shard (refused at the next forward); the swap setting refused the cast. FSDP
    converts its parameters in place under either (session 37)."""
    run_distributed(_cast_under_setting_body, WORLD, timeout=TIMEOUT)
