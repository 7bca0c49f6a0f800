# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Hybrid sharding (``replicate_process_group``, issue 29), on CPU with gloo.

World size 4 = 2 shard groups {0, 1}, {2, 3} x 2 replicate groups {0, 2}, {1, 3}. Every rank gets its own batch, so
the two replicas only stay identical through the replicate all-reduce: each parity case also checks that the
members of a replicate group hold bitwise equal shards and gradients, and a control run without the replicate group
shows that they would diverge (so no test here passes with the feature removed). References: torch's
DistributedDataParallel over the world (same seed, same per-rank batches, same no_sync windows) and plain full
sharding over the 4 ranks. Checkpoints are in ``test_fsdp_hybrid_checkpoint.py``.
"""

import contextlib
import copy
import functools
import os
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _group_net import Net, batch, expect_value_error, initial_params, mb_loss
from _models import DTYPES, ELEMENTWISE_TOL, UPDATE_REL, assert_update_close, gather_full_grads
from torch import Tensor

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal import collectives
from fairscale.internal.collectives import count_collectives
from fairscale.internal.parallel import ProcessGroupName
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import get_fsdp_instances, hybrid_groups, zero2_groups
from fairscale.nn.data_parallel._fsdp.state import HandleState

TIMEOUT = 200.0
# Worlds whose expected outcome is an error on every rank: a hang is the failure mode, so fail fast.
ERROR_TIMEOUT = 25.0
LR = 0.05

# (process_group, replicate_process_group, zero2_process_group) of one run; None: the default (whole world, none).
Groups = Tuple[Any, Any, Any]


# ------------------------------------------------------------------------------------------------------ model

# Net, batch and mb_loss come from _group_net (shared with the zero2 tests).


def cfg(**overrides: Any) -> Dict[str, Any]:
    base = dict(
        nested=True,
        prec="fp32",
        fp32_rs=False,
        flatten=True,
        raf=True,
        obc=False,
        tie=False,
        cpu=False,
        bucket=25,
        fwd_prefetch=False,
        bwd_prefetch=True,
        steps=2,
        num_mb=2,
    )
    base.update(overrides)
    return base


def build(c: Dict[str, Any], groups: Groups) -> FSDP:
    """The FSDP model, from the same seed on every rank."""
    pg, replicate, zero2 = groups
    torch.manual_seed(0)
    net = Net(tie=c["tie"])
    kwargs: Dict[str, Any] = dict(
        process_group=pg,
        replicate_process_group=replicate,
        zero2_process_group=zero2,
        mixed_precision=c["prec"] != "fp32",
        compute_dtype=DTYPES[c["prec"]] if c["prec"] != "fp32" else None,
        fp32_reduce_scatter=c["fp32_rs"],
        flatten_parameters=c["flatten"],
        reshard_after_forward=c["raf"],
        optimize_backward_concat=c["obc"],
        move_params_to_cpu=c["cpu"],
        bucket_cap_mb=c["bucket"],
        forward_prefetch=c["fwd_prefetch"],
        backward_prefetch=c["bwd_prefetch"],
    )
    if c["nested"]:
        for i in range(len(net.blocks)):
            net.blocks[i] = FSDP(net.blocks[i], **kwargs)
    return FSDP(net, disable_reshard_on_root=c["nested"], **kwargs)


def local_shards(model: FSDP) -> List[Tensor]:
    """This rank's fp32 shards of every handle of the tree (what a replica must hold identically)."""
    return [h.fp32_shard.detach().clone() for m in get_fsdp_instances(model) for h in m._handles]


def replicate_peers(values: Any, replicate: Any) -> List[Any]:
    """``values`` of every member of this rank's replicate group, in group order."""
    out: List[Any] = [None] * dist.get_world_size(replicate)
    dist.all_gather_object(out, values, group=replicate)
    return out


def assert_replicas_equal(values: List[Tensor], replicate: Any, what: str) -> None:
    peers = replicate_peers(values, replicate)
    for other in peers:
        assert len(other) == len(values), what
        for i, (a, b) in enumerate(zip(values, other)):
            assert torch.equal(a, b), f"{what} {i} differs inside the replicate group: max diff {(a - b).abs().max()}"


# ------------------------------------------------------------------------------------------------------ runners


def train(c: Dict[str, Any], groups: Groups, rank: int) -> Dict[str, Any]:
    """Windows of ``num_mb`` microbatches (all but the last under no_sync), SGD.

    Returns the per-microbatch losses, the full gradients of step 0 (gathered inside the shard group), this rank's
    shard gradients of step 0, the full state dict and the local shards after the steps.
    """
    model = build(c, groups)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses: List[float] = []
    full_grads: Dict[str, Tensor] = {}
    shard_grads: List[Tensor] = []
    slices_seen = 0
    for step in range(c["steps"]):
        for mb in range(c["num_mb"]):
            ctx = model.no_sync() if mb < c["num_mb"] - 1 else contextlib.nullcontext()
            with ctx:
                loss = mb_loss(model(batch(step, mb, rank)))
                slices_seen += sum(
                    h.state == HandleState.ZERO2_SLICE for m in get_fsdp_instances(model) for h in m._handles
                )
                loss.backward()
            losses.append(loss.item())
        if step == 0:
            full_grads = gather_full_grads(model)
            shard_grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "losses": losses,
        "full_grads": full_grads,
        "shard_grads": shard_grads,
        "sd": model.state_dict(),
        "local": local_shards(model),
        "slices_seen": slices_seen,
    }


_DDP_CACHE: Dict[Tuple[Any, ...], Dict[str, Any]] = {}


def train_ddp(c: Dict[str, Any], rank: int) -> Dict[str, Any]:
    """torch DDP over the world, fp32, the same batches and no_sync windows as :func:`train` (cached per rank)."""
    key = (c["tie"], c["steps"], c["num_mb"])
    if key not in _DDP_CACHE:
        torch.manual_seed(0)
        net = Net(tie=c["tie"])
        ddp = nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        losses: List[float] = []
        grads: Dict[str, Tensor] = {}
        for step in range(c["steps"]):
            for mb in range(c["num_mb"]):
                ctx = ddp.no_sync() if mb < c["num_mb"] - 1 else contextlib.nullcontext()
                with ctx:
                    loss = mb_loss(ddp(batch(step, mb, rank)))
                    loss.backward()
                losses.append(loss.item())
            if step == 0:
                grads = {n: p.grad.detach().clone() for n, p in net.named_parameters()}  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad(set_to_none=True)
        _DDP_CACHE[key] = {"losses": losses, "grads": grads, "sd": copy.deepcopy(net.state_dict())}
    return _DDP_CACHE[key]


def _close(actual: Dict[str, Tensor], expected: Dict[str, Tensor], prec: str, what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: names {sorted(actual)} vs {sorted(expected)}"
    atol, rtol = ELEMENTWISE_TOL[prec]
    for k, v in expected.items():
        torch.testing.assert_close(actual[k].float(), v.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what} {k}: {m}")


def check_parity(c: Dict[str, Any], hybrid: Groups, rank: int, full_zero2: Any = None) -> Dict[str, Any]:
    """Hybrid vs full sharding over the world (same options) and vs DDP; replicas bitwise equal."""
    h = train(c, hybrid, rank)
    f = train(c, (None, None, full_zero2), rank)
    d = train_ddp(c, rank)
    prec = c["prec"]
    atol, rtol = ELEMENTWISE_TOL[prec]
    loss_atol = atol if prec == "fp32" else atol * 10
    for i, (lh, lf, ld) in enumerate(zip(h["losses"], f["losses"], d["losses"])):
        torch.testing.assert_close(lh, lf, atol=loss_atol, rtol=rtol, msg=f"loss {i} vs full sharding")
        torch.testing.assert_close(lh, ld, atol=loss_atol, rtol=rtol, msg=f"loss {i} vs DDP")
    # Step 0's gradients: the shard group's full gradient is the world's average.
    _close(h["full_grads"], f["full_grads"], prec, "step-0 grad vs full sharding")
    if prec == "fp32":
        _close(h["full_grads"], d["grads"], prec, "step-0 grad vs DDP")
    # The replicate all-reduce leaves the same reduced shard on every replica: bitwise.
    _, replicate, _ = hybrid
    assert_replicas_equal(h["shard_grads"], replicate, "step-0 shard grad")
    assert_replicas_equal(h["local"], replicate, "final shard")
    if prec == "fp32":
        _close(h["sd"], f["sd"], prec, "params vs full sharding")
        _close(h["sd"], d["sd"], prec, "params vs DDP")
    else:
        got = {k: v.float() for k, v in h["sd"].items()}
        init = initial_params(c)
        assert_update_close(got, {k: v.float() for k, v in f["sd"].items()}, init, UPDATE_REL[prec], "vs full")
        assert_update_close(got, d["sd"], init, UPDATE_REL[prec], "params vs DDP (fp32)")
    return h


def check_zero2_composes(c: Dict[str, Any], hybrid: Groups, rank: int) -> None:
    """zero2 inside the shard group: resharded instances keep a slice, numerics bitwise those without zero2."""
    z = check_parity(c, hybrid, rank)
    plain = train(c, (hybrid[0], hybrid[1], None), rank)
    assert z["slices_seen"] > 0, "no resharded instance kept a zero2 slice after forward"
    assert z["losses"] == plain["losses"], f"losses {z['losses']} != {plain['losses']}"
    for i, (a, b) in enumerate(zip(z["shard_grads"], plain["shard_grads"])):
        assert torch.equal(a, b), f"grad {i}: max diff {(a - b).abs().max()}"
    for k in plain["sd"]:
        assert torch.equal(z["sd"][k], plain["sd"][k]), f"param {k} differs from hybrid without zero2"


def check_clip_grad_norm(rank: int, hybrid: Groups) -> None:
    """The total norm is the world's gradient norm (the replicas' copies are not counted twice) and equals DDP's."""
    c = cfg(nested=False)
    model = build(c, hybrid)
    mb_loss(model(batch(0, 0, rank))).backward()
    total = model.clip_grad_norm_(0.5)
    torch.manual_seed(0)
    net = Net()
    ddp = nn.parallel.DistributedDataParallel(net)
    mb_loss(ddp(batch(0, 0, rank))).backward()
    expected = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5, msg="clip_grad_norm_ total norm vs DDP")
    grads = gather_full_grads(model)
    for n, p in net.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-5, msg=f"clipped grad {n}")


def check_replicate_of_one(rank: int, world: Groups) -> None:
    """hybrid_groups(4): replicate groups of one rank; the same numbers as plain full sharding, bitwise."""
    a = train(cfg(), world, rank)
    b = train(cfg(), (None, None, None), rank)
    assert a["losses"] == b["losses"]
    for k in b["sd"]:
        assert torch.equal(a["sd"][k], b["sd"][k]), k


def check_root_over_world(rank: int, hybrid: Groups) -> None:
    """Hybrid blocks inside a root sharded over the whole world (no replicate group): still DDP's numbers."""
    c = cfg(steps=3)
    torch.manual_seed(0)
    net = Net()
    for i in range(len(net.blocks)):
        net.blocks[i] = FSDP(net.blocks[i], process_group=hybrid[0], replicate_process_group=hybrid[1])
    model = FSDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(c["steps"]):
        for mb in range(c["num_mb"]):
            ctx = model.no_sync() if mb < c["num_mb"] - 1 else contextlib.nullcontext()
            with ctx:
                loss = mb_loss(model(batch(step, mb, rank)))
                loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    d = train_ddp(c, rank)
    torch.testing.assert_close(losses, d["losses"], atol=1e-5, rtol=1e-5)
    _close(model.state_dict(), d["sd"], "fp32", "params vs DDP")


# ------------------------------------------------------------------------------------------------------ collectives


def _one_step(model: FSDP, rank: int, step: int, sync: bool = True) -> Tuple[Any, Any]:
    ctx = contextlib.nullcontext() if sync else model.no_sync()
    with ctx:
        with count_collectives() as fwd:
            loss = mb_loss(model(batch(step, 0, rank)))
        with count_collectives() as bwd:
            loss.backward()
    return fwd, bwd


def check_collectives(c: Dict[str, Any], hybrid: Groups, rank: int) -> Dict[str, Any]:
    """After the first step: gathers and reduce-scatters on the shard group only, all-reduces on the replicate group
    only, of the reduced shard's bytes, and nothing that spans the world. Returns the second step's backward."""
    shard_ranks = collectives.group_ranks(hybrid[0])
    replicate_ranks = collectives.group_ranks(hybrid[1])
    assert len(shard_ranks) == len(replicate_ranks) == 2 and set(shard_ranks) & set(replicate_ranks) == {rank}
    model = build(c, hybrid)
    _one_step(model, rank, 0)  # lazy init: the world-wide check of the layout runs here
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.step()
    opt.zero_grad(set_to_none=True)
    # A no_sync microbatch first: no reduction at all.
    fwd0, bwd0 = _one_step(model, rank, 1, sync=False)
    fwd, bwd = _one_step(model, rank, 1)
    for what, counter in (("forward", fwd0), ("no_sync backward", bwd0), ("forward", fwd), ("backward", bwd)):
        spanning = [r for r in counter.records if r.group_size == 4]
        assert not spanning, f"{what}: collectives over the whole world after the first step: {counter.summary()}"
        for r in counter.records:
            if r.kind in ("all_gather", "reduce_scatter"):
                assert r.ranks == shard_ranks, f"{what}: {r.kind} over {r.ranks}, shard group is {shard_ranks}"
            elif r.kind == "all_reduce":
                assert r.ranks == replicate_ranks, f"{what}: all_reduce over {r.ranks}, replicate is {replicate_ranks}"
            else:
                raise AssertionError(f"{what}: unexpected {r.kind} over {r.ranks}")
    for counter in (fwd0, fwd):
        assert counter.count("all_gather") > 0 and counter.count() == counter.count("all_gather"), counter.summary()
    assert bwd0.count("reduce_scatter") == bwd0.count("all_reduce") == 0, f"no_sync reduced: {bwd0.summary()}"
    rs = [r for r in bwd.records if r.kind == "reduce_scatter"]
    ar = [r for r in bwd.records if r.kind == "all_reduce"]
    assert rs and all(r.phase == "backward" for r in rs + ar), bwd.summary()
    # One all-reduce per reduce-scatter (per bucket fill, or per gradient without buckets), of its reduced shard.
    assert sorted(r.bytes for r in ar) == sorted(r.shard_bytes for r in rs), bwd.summary()
    handles = [h for m in get_fsdp_instances(model) for h in m._handles]
    reduce_dtype = torch.float32 if c["prec"] == "fp32" or c["fp32_rs"] else DTYPES[c["prec"]]
    assert all(r.dtype == reduce_dtype for r in ar), [r.dtype for r in ar]
    expected_bytes = sum(h.shard_numel for h in handles) * torch.empty((), dtype=reduce_dtype).element_size()
    assert sum(r.bytes for r in ar) == expected_bytes, f"{sum(r.bytes for r in ar)} != {expected_bytes}"
    if c["bucket"] == 0:
        assert len(ar) == len(rs) == len(handles), f"{len(handles)} handles: {bwd.summary()}"
        assert sorted(r.bytes for r in ar) == sorted(
            h.shard_numel * torch.empty((), dtype=reduce_dtype).element_size() for h in handles
        )
    return {"all_reduces": len(ar), "bytes": sum(r.bytes for r in ar), "handles": len(handles)}


def check_bucketing(hybrid: Groups, rank: int) -> None:
    """bucket_cap_mb merges the small gradients' all-reduces (as their reduce-scatters) into fewer calls."""
    merged = check_collectives(cfg(bucket=25), hybrid, rank)
    single = check_collectives(cfg(bucket=0), hybrid, rank)
    assert merged["bytes"] == single["bytes"]
    assert single["all_reduces"] == single["handles"] == 3
    assert merged["all_reduces"] < single["all_reduces"], (merged, single)


def check_shard_of_one_collectives(rank: int, groups: Groups) -> None:
    """Shard groups of one rank: no gather or reduce-scatter, one all-reduce of each whole gradient over the world."""
    model = build(cfg(), groups)
    _one_step(model, rank, 0)
    fwd, bwd = _one_step(model, rank, 1)
    assert fwd.count() == 0, fwd.summary()
    ar = [r for r in bwd.records if r.kind == "all_reduce"]
    assert bwd.count() == len(ar) == 3 and all(r.ranks == (0, 1, 2, 3) for r in ar), bwd.summary()
    numel = sum(p.numel() for p in Net().parameters())
    assert sum(r.numel for r in ar) == numel


# ------------------------------------------------------------------------------------------------------ world 4


def _world4(rank: int, world_size: int) -> None:
    # Every rank creates every group in the same order (new_group is collective over the world).
    hybrid = hybrid_groups(2)  # shard {0, 1}, {2, 3}; replicate {0, 2}, {1, 3}
    assert collectives.group_ranks(hybrid[0]) == ((0, 1) if rank < 2 else (2, 3))
    assert collectives.group_ranks(hybrid[1]) == ((0, 2) if rank % 2 == 0 else (1, 3))
    z1 = zero2_groups(1)
    z2 = zero2_groups(2)  # the shard group itself
    ones = hybrid_groups(1)  # 4 "nodes" of one rank: replicate group = the world
    fours = hybrid_groups(4)  # one node: replicate groups of one rank
    h: Groups = (hybrid[0], hybrid[1], None)
    configs: List[Tuple[str, Dict[str, Any]]] = [
        ("fp32", cfg()),
        ("fp32,unnested", cfg(nested=False)),
        ("fp32,unflattened", cfg(flatten=False)),
        ("fp32,no_no_sync,3_steps", cfg(num_mb=1, steps=3)),
        ("fp32,3_microbatches", cfg(num_mb=3)),
        ("fp16", cfg(prec="fp16")),
        ("bf16", cfg(prec="bf16")),
        ("fp16,fp32_reduce_scatter", cfg(prec="fp16", fp32_rs=True)),
        ("bf16,fp32_reduce_scatter,unnested", cfg(prec="bf16", fp32_rs=True, nested=False)),
        ("optimize_backward_concat", cfg(obc=True)),
        ("optimize_backward_concat,bf16,unnested", cfg(obc=True, prec="bf16", nested=False)),
        ("forward_prefetch,no_backward_prefetch", cfg(fwd_prefetch=True, bwd_prefetch=False)),
        ("forward_prefetch,backward_prefetch", cfg(fwd_prefetch=True)),
        ("move_params_to_cpu", cfg(cpu=True)),
        ("bucket_cap_mb=0", cfg(bucket=0)),
        ("no_reshard_after_forward", cfg(raf=False)),
        ("shared_params", cfg(tie=True)),
    ]
    cases: List[Tuple[str, Callable[[], Any]]] = [
        (f"parity,{name}", lambda c=c: check_parity(c, h, rank)) for name, c in configs
    ]
    cases += [
        ("zero2_of_1", lambda: check_zero2_composes(cfg(), (hybrid[0], hybrid[1], z1), rank)),
        ("zero2_of_2", lambda: check_zero2_composes(cfg(), (hybrid[0], hybrid[1], z2), rank)),
        ("zero2_of_2,bf16,obc", lambda: check_zero2_composes(cfg(prec="bf16", obc=True), (*hybrid, z2), rank)),
        ("clip_grad_norm", lambda: check_clip_grad_norm(rank, h)),
        ("hybrid_blocks_in_root_over_world", lambda: check_root_over_world(rank, h)),
        ("shard_group_of_1", lambda: check_parity(cfg(), (ones[0], ones[1], None), rank)),
        ("shard_group_of_1,bf16,unnested", lambda: check_parity(cfg(prec="bf16", nested=False), (*ones, None), rank)),
        ("shard_group_of_1,collectives", lambda: check_shard_of_one_collectives(rank, (ones[0], ones[1], None))),
        ("replicate_group_of_1", lambda: check_replicate_of_one(rank, (fours[0], fours[1], None))),
        ("collectives,fp32,bucket_0", lambda: check_collectives(cfg(bucket=0), h, rank)),
        ("collectives,fp16,bucket_0", lambda: check_collectives(cfg(prec="fp16", bucket=0), h, rank)),
        ("collectives,fp16,fp32_rs", lambda: check_collectives(cfg(prec="fp16", fp32_rs=True), h, rank)),
        ("collectives,obc,unflattened", lambda: check_collectives(cfg(obc=True, flatten=False, bucket=0), h, rank)),
        ("collectives,bucketing", lambda: check_bucketing(h, rank)),
    ]
    run_cases(cases)


def test_hybrid_2x2_parity_composition_collectives() -> None:
    """Parity with DDP and full sharding over the option matrix, shard/replicate groups of 1, collectives per group."""
    run_distributed(_world4, 4, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ replicas


def _replicas(rank: int, world_size: int) -> None:
    hybrid = hybrid_groups(2)
    c = cfg(steps=3, num_mb=1)
    with_feature = train(c, (hybrid[0], hybrid[1], None), rank)
    assert_replicas_equal(with_feature["local"], hybrid[1], "final shard")
    ddp = train_ddp(c, rank)
    _close(with_feature["sd"], ddp["sd"], "fp32", "params vs DDP")
    # Control: the same shard groups without the replicate all-reduce train two different models.
    without = train(c, (hybrid[0], None, None), rank)
    peers = replicate_peers(without["local"], hybrid[1])
    assert any(not torch.equal(a, b) for a, b in zip(peers[0], peers[1])), "replicas agree without the all-reduce"


def test_replicas_fed_different_batches_stay_identical() -> None:
    """Each replica sees other data; only the replicate all-reduce keeps them identical (and equal to DDP)."""
    run_distributed(_replicas, 4, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ validation


# Every misconfiguration is refused with a ValueError on every rank.
_expect_value_error = functools.partial(expect_value_error, option="replicate_process_group")


def _nested(process_group: Any, replicate: Any, **kwargs: Any) -> FSDP:
    torch.manual_seed(0)
    net = Net()
    net.blocks[0] = FSDP(net.blocks[0], process_group=process_group, replicate_process_group=replicate, **kwargs)
    return FSDP(net, process_group=process_group, replicate_process_group=replicate, **kwargs)


def _same_message_everywhere(msg: str) -> None:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, msg)
    assert all(m == out[0] for m in out), f"ranks raised different errors: {out}"


def _validation(rank: int, world_size: int) -> None:
    # Every rank creates every group, in the same order (new_group is collective over the world).
    solo = [dist.new_group([r]) for r in range(4)]
    half_a, half_b = dist.new_group([0, 1]), dist.new_group([2, 3])
    cross_a, cross_b = dist.new_group([0, 2]), dist.new_group([1, 3])
    diag_a, diag_b = dist.new_group([0, 3]), dist.new_group([1, 2])
    world = dist.new_group([0, 1, 2, 3])
    half = half_a if rank < 2 else half_b
    cross = cross_a if rank % 2 == 0 else cross_b

    def check(make: Callable[[], FSDP], *needles: str) -> None:
        _same_message_everywhere(_expect_value_error(make, "invalid hybrid sharding groups", *needles))

    def not_tiling() -> None:
        # Shard groups of one rank x replicate groups of two: 1 x 2 ranks cover half the world.
        check(lambda: _nested(solo[rank], half), "does not tile")

    def unequal_sizes() -> None:
        # Ranks 0 and 2 replicate over {0, 2}; ranks 1 and 3 alone.
        check(lambda: _nested(half, cross_a if rank % 2 == 0 else solo[rank]), "all must be equal")

    def shares_shard_group() -> None:
        check(lambda: _nested(half, world), "share ranks")

    def different_shard_index() -> None:
        # {0, 3} joins shard 0 of {0, 1} with shard 1 of {2, 3}.
        check(lambda: _nested(half, diag_a if rank in (0, 3) else diag_b), "hold shard")

    def not_a_member() -> None:
        # Ranks 2 and 3 pass {0, 2}'s and {1, 3}'s peer group {0, 1} instead: not theirs.
        check(lambda: _nested(half, cross if rank < 2 else half_a), "not a member")

    def inconsistent_shard_groups() -> None:
        # Rank 3 shards alone (its own group of one) while rank 2 thinks {2, 3} is its shard group.
        check(lambda: _nested(solo[3] if rank == 3 else half, cross), "invalid")

    def reduce_scatter_over_other_ranks() -> None:
        # The replicate group (the shard group's size, other ranks) as process_group_reduce_scatter averaged the
        # wrong gradients, silently: refused at construction, hybrid or plain, on every rank (found by a fuzz).
        for replicate in (cross, None):
            msg = expect_value_error(
                lambda: _nested(half, replicate, process_group_reduce_scatter=cross),
                "process_group_reduce_scatter holds the ranks",
                "in the same order",
                option="process_group_reduce_scatter",
            )
            assert f"process_group holds {[0, 1] if rank < 2 else [2, 3]}" in msg, msg

    def helper_not_dividing() -> None:
        for bad in (3, 0, 8):
            with pytest.raises(ValueError, match="must divide the world size"):
                hybrid_groups(bad)

    def helper_without_local_world_size() -> None:
        saved = os.environ.pop("LOCAL_WORLD_SIZE", None)
        try:
            with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
                hybrid_groups()
            os.environ["LOCAL_WORLD_SIZE"] = "2"
            shard, replicate = hybrid_groups()  # as torchrun on 2 nodes of 2 ranks
            assert collectives.group_ranks(shard) == collectives.group_ranks(half)
            assert collectives.group_ranks(replicate) == collectives.group_ranks(cross)
        finally:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
            if saved is not None:
                os.environ["LOCAL_WORLD_SIZE"] = saved

    run_cases(
        [
            ("not_tiling", not_tiling),
            ("unequal_sizes", unequal_sizes),
            ("shares_shard_group", shares_shard_group),
            ("different_shard_index", different_shard_index),
            ("not_a_member", not_a_member),
            ("inconsistent_shard_groups", inconsistent_shard_groups),
            ("reduce_scatter_over_other_ranks", reduce_scatter_over_other_ranks),
            ("helper_not_dividing", helper_not_dividing),
            ("helper_without_local_world_size", helper_without_local_world_size),
        ]
    )


def test_validation_errors_on_every_rank() -> None:
    """Layouts that do not form a grid: the same ValueError on every rank at the first forward, never a hang."""
    run_distributed(_validation, 4, timeout=60.0)


def _nested_or_plain(rank: int, shard: Any, replicate: Any, plain_group: Any, plain_rs: Any) -> FSDP:
    """Ranks 0 and 1 shard over their node and replicate; ranks 2 and 3 forgot both (plain sharding over the world).

    Both sides pass the same ``process_group_reduce_scatter`` (the same script with the replicate argument dropped on
    some ranks): the group-creation calls of construction then match, which the first forward's check relies on.
    """
    if rank < 2:
        return _nested(shard, replicate, process_group_reduce_scatter=plain_rs)
    torch.manual_seed(0)
    net = Net()
    net.blocks[0] = FSDP(net.blocks[0], process_group=plain_group, process_group_reduce_scatter=plain_rs)
    return FSDP(net, process_group=plain_group, process_group_reduce_scatter=plain_rs)


def _replicate_on_some_ranks_only(rank: int, world_size: int) -> None:
    shard, replicate = hybrid_groups(2)
    # Every instance reduce-scatters over its process_group: no cached reduce-scatter group on any rank.
    make = functools.partial(_nested_or_plain, rank, shard, replicate, None, ProcessGroupName.default)
    msg = _expect_value_error(make, "differs between ranks")
    assert "rank 0: zero2_process_group on none, replicate_process_group on ['<root>', 'blocks.0']" in msg
    assert "rank 3: zero2_process_group on none, replicate_process_group on none" in msg, msg
    _same_message_everywhere(msg)


def test_replicate_group_on_some_ranks_only() -> None:
    """A replicate group passed on some ranks only (the others shard over the world): one ValueError everywhere."""
    run_distributed(_replicate_on_some_ranks_only, 4, timeout=ERROR_TIMEOUT)


def _replicate_on_some_ranks_only_defaults(rank: int, world_size: int) -> None:
    shard, replicate = hybrid_groups(2)
    make = functools.partial(_nested_or_plain, rank, shard, replicate, None, ProcessGroupName.reduce_scatter)
    _same_message_everywhere(_expect_value_error(make, "differs between ranks"))


def test_replicate_group_on_some_ranks_only_default_groups() -> None:
    """As above with every default on the others (FSDP(module) as a script without hybrid would build it)."""
    run_distributed(_replicate_on_some_ranks_only_defaults, 4, timeout=ERROR_TIMEOUT)


def _replicate_on_inner_instance_only(rank: int, world_size: int) -> None:
    shard, replicate = hybrid_groups(2)

    def make() -> FSDP:
        torch.manual_seed(0)
        net = Net()
        net.blocks[0] = FSDP(net.blocks[0], process_group=shard, replicate_process_group=replicate)
        return FSDP(net, process_group=shard)  # the root forgot it: its gradients would stay per replica

    _same_message_everywhere(_expect_value_error(make, "instance <root> has no replicate_process_group"))


def test_replicate_group_on_inner_instance_only() -> None:
    """Every instance must replicate: a root sharded over the node alone would diverge across replicas."""
    run_distributed(_replicate_on_inner_instance_only, 4, timeout=ERROR_TIMEOUT)
