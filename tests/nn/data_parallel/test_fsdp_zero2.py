# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``zero2_process_group`` (fork contract section 2, issue 8), on CPU with gloo.

World size 4 with zero2 groups {0, 1}, {2, 3}; world size 2 with G = 1 and G = 2 (= N). Each parity case also
checks that resharded instances hold a zero2 slice after forward, so no test passes with the feature removed.
"""

import contextlib
import copy
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _group_net import DIM_IN, Net, batch, expect_value_error, initial_params, mb_loss
from _models import DTYPES, ELEMENTWISE_TOL, UPDATE_REL, assert_update_close
from torch import Tensor

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal import collectives
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.collectives import count_collectives
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import get_fsdp_instances, zero2_groups
from fairscale.nn.data_parallel._fsdp.state import HandleState

TIMEOUT = 150.0
# Worlds whose expected outcome is an error on every rank: a hang is the failure mode, so fail fast.
ERROR_TIMEOUT = 25.0


# ------------------------------------------------------------------------------------------------------ model


def cfg(**overrides: Any) -> Dict[str, Any]:
    base = dict(nested=True, prec="fp32", flatten=True, raf=True, obc=False, tie=False, cpu=False, bucket=25)
    base.update(overrides)
    return base


def build(c: Dict[str, Any], zero2: Any) -> Tuple[FSDP, Net]:
    """The FSDP model and the unwrapped reference, from the same seed on every rank."""
    torch.manual_seed(0)
    net = Net(tie=c["tie"])
    ref = copy.deepcopy(net)
    kwargs: Dict[str, Any] = dict(
        mixed_precision=c["prec"] != "fp32",
        compute_dtype=DTYPES[c["prec"]] if c["prec"] != "fp32" else None,
        flatten_parameters=c["flatten"],
        reshard_after_forward=c["raf"],
        optimize_backward_concat=c["obc"],
        move_params_to_cpu=c["cpu"],
        bucket_cap_mb=c["bucket"],
        zero2_process_group=zero2,
    )
    if c["nested"]:
        for i in range(len(net.blocks)):
            net.blocks[i] = FSDP(net.blocks[i], **kwargs)
    # Without nesting the root must reshard for the zero2 group to matter (the root ignores it otherwise).
    return FSDP(net, disable_reshard_on_root=c["nested"], **kwargs), ref


def resharded_handles(model: FSDP) -> List[Any]:
    """Handles of instances that reshard after forward and own a separately gathered full parameter."""
    return [
        h
        for m in get_fsdp_instances(model)
        if m.reshard_after_forward
        for h in m._handles
        if h.is_sharded and h.has_full_buffer
    ]


# ------------------------------------------------------------------------------------------------------ runners


def train(c: Dict[str, Any], zero2: Any, rank: int, steps: int = 2, num_mb: int = 2) -> Dict[str, Any]:
    """Windows of ``num_mb`` microbatches (all but the last under no_sync); losses, first grads, final params."""
    model, _ = build(c, zero2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses: List[float] = []
    grads: List[Tensor] = []
    slices_seen = 0
    for step in range(steps):
        for mb in range(num_mb):
            ctx = model.no_sync() if mb < num_mb - 1 else contextlib.nullcontext()
            with ctx:
                loss = mb_loss(model(batch(step, mb, rank)))
                slices_seen += sum(h.state == HandleState.ZERO2_SLICE for h in resharded_handles(model))
                loss.backward()
            losses.append(loss.item())
        if step == 0:
            grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "sd": model.state_dict(), "slices_seen": slices_seen}


def train_reference(c: Dict[str, Any], world_size: int, steps: int = 2, num_mb: int = 2) -> Dict[str, Any]:
    torch.manual_seed(0)
    ref = Net(tie=c["tie"])
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    losses: List[float] = []
    for step in range(steps):
        for mb in range(num_mb):
            xs = [batch(step, mb, r) for r in range(world_size)]
            loss = mb_loss(ref(torch.cat(xs))) / world_size
            loss.backward()
            losses.append([mb_loss(ref(x)).item() for x in xs])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "sd": ref.state_dict()}


def check_parity(c: Dict[str, Any], zero2: Any, rank: int, world_size: int) -> None:
    """zero2 == plain resharding bitwise (same values gathered, other group) and == the reference."""
    z = train(c, zero2, rank)
    plain = train(c, None, rank)
    assert z["slices_seen"] > 0, "no resharded instance kept a zero2 slice after forward"
    assert plain["slices_seen"] == 0
    assert z["losses"] == plain["losses"], f"losses {z['losses']} != {plain['losses']}"
    for i, (a, b) in enumerate(zip(z["grads"], plain["grads"])):
        assert torch.equal(a, b), f"grad {i}: max diff {(a - b).abs().max()}"
    for k in plain["sd"]:
        assert torch.equal(z["sd"][k], plain["sd"][k]), f"param {k} differs from the run without zero2"
    ref = train_reference(c, world_size)
    atol, rtol = ELEMENTWISE_TOL[c["prec"]]
    for i, loss in enumerate(z["losses"]):
        torch.testing.assert_close(loss, ref["losses"][i][rank], atol=atol * 10, rtol=rtol, msg=f"loss {i}")
    assert set(z["sd"]) == set(ref["sd"])
    if c["prec"] == "fp32":
        for k, v in ref["sd"].items():
            torch.testing.assert_close(z["sd"][k].float(), v, atol=atol, rtol=rtol, msg=f"param {k} vs reference")
    else:
        got = {k: v.float() for k, v in z["sd"].items()}
        assert_update_close(got, ref["sd"], initial_params(c), UPDATE_REL[c["prec"]], "params vs reference")


def parity_cases(zero2: Any, rank: int, world_size: int, full: bool) -> List[Tuple[str, Callable[[], None]]]:
    configs: List[Tuple[str, Dict[str, Any]]] = []
    precs = ("fp32", "fp16", "bf16") if full else ("fp32", "bf16")
    for prec in precs:
        for flatten in (True, False) if full else (True,):
            for nested in (True, False):
                configs.append(
                    (f"{prec},flatten={flatten},nested={nested}", cfg(prec=prec, flatten=flatten, nested=nested))
                )
    if full:
        configs += [
            ("optimize_backward_concat", cfg(obc=True)),
            ("optimize_backward_concat_bf16_unnested", cfg(obc=True, prec="bf16", nested=False)),
            ("shared_params", cfg(tie=True)),
            ("shared_params_unflattened_fp16", cfg(tie=True, flatten=False, prec="fp16")),
            ("move_params_to_cpu", cfg(cpu=True)),
            ("move_params_to_cpu_fp16", cfg(cpu=True, prec="fp16")),
            ("no_bucket", cfg(bucket=0)),
        ]
    return [(name, lambda c=c: check_parity(c, zero2, rank, world_size)) for name, c in configs]


# ------------------------------------------------------------------------------------------------------ bookkeeping


def expected_slice(h: Any, model_group: Any, zero2: Any, compute_dtype: torch.dtype) -> Tensor:
    """This rank's zero2 slice of the padded full parameter, computed independently of FSDP."""
    full = torch.empty(h.shard_numel * h.world_size, dtype=compute_dtype)
    collectives.all_gather_into_flat(full, h.fp32_shard.to(compute_dtype), model_group)
    g = collectives.group_size(zero2)
    piece = full.numel() // g
    return full.narrow(0, collectives.group_rank(zero2) * piece, piece)


def check_memory(c: Dict[str, Any], zero2: Any, rank: int) -> None:
    """Contract 2.1/2.3/2.5: the slice after forward, nothing but the fp32 shard after backward."""
    model, _ = build(c, zero2)
    g = collectives.group_size(zero2)
    for mb in range(2):
        ctx = model.no_sync() if mb == 0 else contextlib.nullcontext()
        with ctx:
            loss = mb_loss(model(batch(0, mb, rank)))
            for m in get_fsdp_instances(model):
                for h in m._handles:
                    assert h.param.data.data_ptr() == h.fp32_shard.data_ptr(), f"{h.name}: p.data is not the shard"
                    if not h.is_sharded:
                        continue
                    if m.reshard_after_forward:
                        assert h.state == HandleState.ZERO2_SLICE, f"{h.name}: {h.state} after forward"
                        assert h.zero2_slice is not None
                        assert h.zero2_slice.numel() == h.shard_numel * h.world_size // g
                        assert h.zero2_slice.dtype == m.compute_dtype
                        assert h.full_padded.untyped_storage().size() == 0, f"{h.name}: full parameter kept"
                        want = expected_slice(h, m.process_group, zero2, m.compute_dtype)
                        assert torch.equal(h.zero2_slice, want), f"{h.name}: wrong slice content"
                    else:  # root / reshard_after_forward=False: the zero2 group is ignored
                        assert h.state == HandleState.FULL and h.zero2_slice is None, f"{h.name}: {h.state}"
            loss.backward()
        for m in get_fsdp_instances(model):
            for h in m._handles:
                assert h.zero2_slice is None, f"{h.name}: zero2 slice alive after backward {mb}"
                assert h.param.data.data_ptr() == h.fp32_shard.data_ptr()
                if m.reshard_after_forward or mb == 1:
                    assert h.state == HandleState.SHARDED, f"{h.name}: {h.state} after backward {mb}"
                    if h.has_full_buffer:
                        assert h.full_padded.untyped_storage().size() == 0, f"{h.name}: full param after backward"
                if mb == 1 and h.param.grad is not None:
                    assert h.param.grad.shape == h.fp32_shard.shape


def check_collectives(c: Dict[str, Any], zero2: Any, rank: int, world_size: int) -> None:
    """Contract 2.2/2.4: forward gathers over N, backward gathers of resharded instances over G, reductions over N."""
    model, _ = build(c, zero2)
    g = collectives.group_size(zero2)
    my_zero2_ranks = collectives.group_ranks(zero2)
    for mb in range(2):
        ctx = model.no_sync() if mb == 0 else contextlib.nullcontext()
        with ctx:
            with count_collectives() as fwd:
                loss = mb_loss(model(batch(0, mb, rank)))
            expected = sorted(
                h.shard_numel * h.world_size * h.zero2_slice.element_size() for h in resharded_handles(model)
            )
            with count_collectives() as bwd:
                loss.backward()
        gathers_f = [r for r in fwd.records if r.kind == "all_gather"]
        assert gathers_f and all(r.group_size == world_size for r in gathers_f), fwd.summary()
        gathers_b = [r for r in bwd.records if r.kind == "all_gather"]
        assert len(gathers_b) == len(expected) > 0, f"microbatch {mb}: {bwd.summary()}"
        for r in gathers_b:
            assert r.group_size == g and r.ranks == my_zero2_ranks, f"backward gather over {r.ranks}"
            assert r.shard_bytes * g == r.bytes
        assert sorted(r.bytes for r in gathers_b) == expected, "backward gathers must rebuild whole parameters"
        reductions = [r for r in bwd.records if r.kind == "reduce_scatter"]
        assert all(r.group_size == world_size for r in reductions), bwd.summary()
        assert len(reductions) == (0 if mb == 0 else len([h for m in get_fsdp_instances(model) for h in m._handles]))


# ------------------------------------------------------------------------------------------------------ world 4


def _world4(rank: int, world_size: int) -> None:
    z = zero2_groups(2)  # {0, 1}, {2, 3}
    assert collectives.group_ranks(z) == ((0, 1) if rank < 2 else (2, 3))
    cases = parity_cases(z, rank, world_size, full=True)
    for prec in ("fp32", "bf16"):
        for flatten in (True, False):
            c = cfg(prec=prec, flatten=flatten, bucket=0)
            cases.append((f"memory,{prec},flatten={flatten}", lambda c=c: check_memory(c, z, rank)))
            cases.append((f"collectives,{prec},flatten={flatten}", lambda c=c: check_collectives(c, z, rank, 4)))
    cases.append(("memory,unnested", lambda: check_memory(cfg(nested=False), z, rank)))
    cases.append(("memory,no_reshard_ignores_zero2", lambda: check_memory(cfg(raf=False), z, rank)))
    cases.append(("collectives,obc", lambda: check_collectives(cfg(obc=True, bucket=0), z, rank, 4)))
    run_cases(cases)


def test_world_size_4_groups_of_2() -> None:
    """Parity (mixed precision x flatten x nesting, no_sync windows), collective counter and memory at N=4, G=2."""
    run_distributed(_world4, 4, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ world 2


def _world2(rank: int, world_size: int) -> None:
    g1 = zero2_groups(1)  # G = 1: the full parameter is kept until backward, the backward gather is local
    g2 = zero2_groups(2)  # G = N: behaves as plain resharding
    cases = []
    for name, z in (("G=1", g1), ("G=2", g2)):
        cases += [(f"{name},{n}", fn) for n, fn in parity_cases(z, rank, world_size, full=False)]
        cases.append((f"{name},memory", lambda z=z: check_memory(cfg(bucket=0), z, rank)))
        cases.append(
            (f"{name},memory_bf16_unnested", lambda z=z: check_memory(cfg(prec="bf16", nested=False), z, rank))
        )
        cases.append((f"{name},collectives", lambda z=z: check_collectives(cfg(bucket=0), z, rank, 2)))
    run_cases(cases)


def test_world_size_2_groups_of_1_and_2() -> None:
    run_distributed(_world2, 2, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ stale data


def _stale_after_summon_write(rank: int, world_size: int) -> None:
    """Contract 2.8: after summon_full_params with writes, a new forward must not read an old zero2 slice."""
    z = zero2_groups(1)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    net = copy.deepcopy(ref)
    for i in range(2):  # the root owns no parameter: only zero2 slices can be stale
        net[i] = FSDP(net[i], zero2_process_group=z)
    model = FSDP(net, zero2_process_group=z)
    x = torch.randn(2, 3)
    out = model(x)  # its backward never runs (e.g. a skipped batch)
    assert all(h.state == HandleState.ZERO2_SLICE for m in get_fsdp_instances(model) for h in m._handles)
    del out
    with model.summon_full_params():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1.0)
        torch.testing.assert_close(model(x), ref(x), msg="a forward after summon_full_params(writes) used stale data")


def test_no_stale_slice_after_summon_with_writes() -> None:
    run_distributed(_stale_after_summon_write, 2, timeout=TIMEOUT)


def _forward_forward_backward(rank: int, world_size: int) -> None:
    """A forward whose backward never runs, then a normal step: correct, and nothing left allocated."""
    z = zero2_groups(1)
    c = cfg()
    model, ref = build(c, z)
    model(batch(0, 9, rank))  # abandoned
    assert all(h.state == HandleState.ZERO2_SLICE for h in resharded_handles(model))
    mb_loss(model(batch(0, 0, rank))).backward()
    ref_loss = sum(mb_loss(ref(batch(0, 0, r))) for r in range(world_size)) / world_size
    ref_loss.backward()  # type: ignore[union-attr]
    for m in get_fsdp_instances(model):
        for h in m._handles:
            assert h.state == HandleState.SHARDED and h.zero2_slice is None, f"{h.name}: {h.state}"
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    opt.step()
    ref_opt.step()
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, atol=1e-5, rtol=1e-5, msg=k)


def test_abandoned_forward_then_step() -> None:
    run_distributed(_forward_forward_backward, 2, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ validation


# Every misconfiguration is refused with a ValueError on every rank.
_expect_value_error = functools.partial(expect_value_error, option="zero2_process_group")


def _nested(zero2: Any, process_group: Optional[Any] = None) -> FSDP:
    torch.manual_seed(0)
    net = Net()
    net.blocks[0] = FSDP(net.blocks[0], process_group=process_group, zero2_process_group=zero2)
    return FSDP(net, process_group=process_group)


def _validation(rank: int, world_size: int) -> None:
    # Every rank creates every group, in the same order (new_group is collective over the world).
    g012, g123 = dist.new_group([0, 1, 2]), dist.new_group([1, 2, 3])
    half_a, half_b = dist.new_group([0, 1]), dist.new_group([2, 3])
    cross_a, cross_b = dist.new_group([0, 2]), dist.new_group([1, 3])
    g12, g23 = dist.new_group([1, 2]), dist.new_group([2, 3])
    solo = [dist.new_group([r]) for r in range(4)]
    half = half_a if rank < 2 else half_b

    def non_dividing() -> None:
        _expect_value_error(lambda: _nested(g012 if rank < 3 else g123), "3", "4", "divide")

    def outside_process_group() -> None:
        cross = cross_a if rank in (0, 2) else cross_b
        _expect_value_error(lambda: _nested(cross, process_group=half), "not in process_group")

    def overlapping() -> None:
        mine = {0: half_a, 1: g12, 2: g12, 3: g23}[rank]
        _expect_value_error(lambda: _nested(mine), "overlap")

    def unequal() -> None:
        mine = half_a if rank < 2 else solo[rank]
        _expect_value_error(lambda: _nested(mine), "different sizes")

    def helper_bad_size() -> None:
        with pytest.raises(ValueError, match="must divide"):
            zero2_groups(3)

    run_cases(
        [
            ("non_dividing", non_dividing),
            ("outside_process_group", outside_process_group),
            ("overlapping", overlapping),
            ("unequal", unequal),
            ("helper_bad_size", helper_bad_size),
        ]
    )


def test_validation_errors_on_every_rank() -> None:
    """Contract 2.6: ValueErrors naming the ranks and sizes, raised on every rank (never a hang)."""
    run_distributed(_validation, 4, timeout=60.0)


def _group_without_this_rank(rank: int, world_size: int) -> None:
    low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
    _expect_value_error(lambda: _nested(low), "zero2")  # ranks 2, 3 pass a group they are not in
    del high


def test_group_that_does_not_contain_this_rank() -> None:
    """Ranks 2 and 3 pass the group {0, 1}: a clear ValueError on every rank, not an AttributeError or a hang."""
    run_distributed(_group_without_this_rank, 4, timeout=ERROR_TIMEOUT)


def _mixed_local_outcome(rank: int, world_size: int) -> None:
    g012, solo3 = dist.new_group([0, 1, 2]), dist.new_group([3])
    # Ranks 0-2 pass a group of 3 (does not divide 4), rank 3 a group of 1 (divides 4): the local checks disagree.
    _expect_value_error(lambda: _nested(g012 if rank < 3 else solo3), "zero2")


def test_misconfiguration_seen_by_some_ranks_only() -> None:
    """A problem only some ranks can see locally must still raise on every rank, not leave the others hanging."""
    run_distributed(_mixed_local_outcome, 4, timeout=ERROR_TIMEOUT)


def _zero2_on_some_ranks_only(rank: int, world_size: int) -> None:
    half_a, half_b = dist.new_group([0, 1]), dist.new_group([2, 3])
    # Ranks 0 and 1 pass their node's group, ranks 2 and 3 forgot it: without a check on every rank, the first two
    # would validate and gather over {0, 1} while the others gather over the world, and nothing would ever match.
    msg = _expect_value_error(lambda: _nested(half_a if rank < 2 else None), "differs between ranks")
    assert "rank 0: zero2_process_group on ['blocks.0']" in msg, msg
    assert "rank 3: zero2_process_group on none" in msg, msg
    del half_b


def test_zero2_group_on_some_ranks_only() -> None:
    """A zero2 group passed on some ranks and None on the others: the same ValueError on every rank, no hang."""
    run_distributed(_zero2_on_some_ranks_only, 4, timeout=ERROR_TIMEOUT)


def _different_wrapping(rank: int, world_size: int) -> None:
    def make() -> FSDP:
        torch.manual_seed(0)
        net = Net()
        if rank == 0:  # an extra nested instance on rank 0 only
            net.blocks[0] = FSDP(net.blocks[0])
        return FSDP(net)

    with pytest.raises(RanksDisagreeError) as info:  # the agreement error every other check raises
        mb_loss(make()(torch.randn(2, DIM_IN))).backward()
    msg = str(info.value)
    assert "the FSDP instances (the modules wrapped, and their nesting) differ between ranks" in msg, msg
    # The groups are not blamed: none was passed.
    assert "rank 0: 2 instances ['<root>', 'blocks.0']" in msg and "rank 1: 1 instances ['<root>']" in msg, msg
    assert "zero2" not in msg, msg


def test_different_wrapping_across_ranks() -> None:
    """Ranks that wrap different modules would issue different collectives: a clear ValueError instead of a hang."""
    run_distributed(_different_wrapping, 2, timeout=ERROR_TIMEOUT)


def _local_calls_stay_local(rank: int, world_size: int) -> None:
    model = _nested(zero2_groups(1))
    if rank == 0:  # a rank-local call before any forward must not start the cross-rank check
        model.local_state_dict()
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    assert total.item() == world_size
    with count_collectives() as counter:
        mb_loss(model(torch.randn(2, DIM_IN))).backward()
    assert counter.count("all_gather_object", phase="init") == 2, counter.summary()  # setting + partition
    with count_collectives() as counter:
        mb_loss(model(torch.randn(2, DIM_IN))).backward()
    assert counter.count(phase="init") == 0, counter.summary()


def test_cross_rank_check_waits_for_the_first_forward() -> None:
    """local_state_dict() on one rank before any forward stays local; the check runs once, at the first forward."""
    run_distributed(_local_calls_stay_local, 2, timeout=ERROR_TIMEOUT)
