# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OSS keeps every parameter's owner for good, and keeps its parameters views of the broadcast buckets.

* Ownership: ``add_param_group`` after a parameter was frozen or unfrozen used to re-partition every group with the
  current trainability (upstream 0.4.13) while the wrapped optimizers kept their old shards: parameters that changed
  owner were stepped by nobody, and the consolidated state dict filed one parameter's state under another. Now only
  the new parameters are placed, continuing from the current loads; without a trainability change that is exactly
  the partition of OSS built with all the groups at once.
* Buckets: after ``model.double()``, ``model.to()`` or ``param.data = ...`` the parameters were no longer views of
  OSS's broadcast buckets, the broadcast carried stale values and the ranks drifted apart silently (upstream only
  noticed a change of device type). ``step()`` now rebuilds the buckets, keeping ownership and optimizer state.
* A frozen parameter of an owner with nothing trainable left kept its value of when it was frozen at every
  ``broadcast_fp16`` step (its old bucket re-pointed it into itself).

References: torch's optimizer on the full model (one process computing what DDP computes), real gloo worlds.
"""

import copy
import random
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS
from fairscale.optim._oss import partition as _partition

TIMEOUT = 120.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1000 * step + rank))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x.to(next(model.parameters()).dtype)).pow(2).mean()


def _oss_step(model: nn.Module, oss: OSS, rank: int, world_size: int, step: int) -> None:
    """One data-parallel step: local loss, gradients averaged by hand (what DDP does), OSS step."""
    oss.zero_grad()
    _loss(model, _data(step, rank)).backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world_size
    oss.step()


def _reference_step(model: nn.Module, opt: torch.optim.Optimizer, world_size: int, step: int) -> None:
    """The same step on one process: the mean of every rank's loss, then the plain torch optimizer."""
    opt.zero_grad()
    for rank in range(world_size):
        (_loss(model, _data(step, rank)) / world_size).backward()
    opt.step()


def _assert_close_params(model: nn.Module, reference: nn.Module, what: str) -> None:
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert p.dtype == r.dtype, f"{what}: {name} is {p.dtype}, the reference {r.dtype}"
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-6, rtol=1e-5, msg=f"{what}: {name}")


def _assert_same_on_every_rank(model: nn.Module, what: str) -> None:
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, gathered[0]) for g in gathered), f"{what}: the ranks' parameters differ"


def _owners(oss: OSS, params: List[torch.Tensor]) -> List[int]:
    return [oss._param_to_rank[p] for p in params]


def _assert_consistent(oss: OSS) -> None:
    """Ownership, shard groups, wrapped optimizer and buckets tell the same story."""
    partition = oss.partition_parameters()
    for rank, rank_groups in enumerate(partition):
        for group, shard in zip(oss.param_groups, rank_groups):
            assert [id(p) for p in shard["params"]] == [
                id(p) for p in group["params"] if oss._param_to_rank[p] == rank
            ], "a shard group holds exactly its rank's parameters, in group order"
    inner = [[id(p) for p in g["params"]] for g in oss.optim.param_groups]
    assert inner == [[id(p) for p in g["params"]] for g in partition[oss.rank]], "the wrapped optimizer's shard"
    for device, per_rank in oss._per_device_params.items():
        for owner, params in enumerate(per_rank):
            trainable = [p for p in params if p.requires_grad]
            if trainable:
                bucket = oss.buckets[device][owner].buffer
                assert bucket is not None
                start, end = bucket.data_ptr(), bucket.data_ptr() + bucket.numel() * bucket.element_size()
                assert all(start <= p.data_ptr() < end for p in trainable), "owned parameters live in its bucket"


# ------------------------------------------------------------------------------------------------------------------
# The placement rule, without a world


def _ids(partition: List[List[Dict[str, Any]]]) -> List[List[List[int]]]:
    return [[[id(p) for p in group["params"]] for group in rank_groups] for rank_groups in partition]


def _upstream_rule(groups: List[Dict[str, Any]], world_size: int) -> List[List[List[int]]]:
    """The documented rule, written out: all groups at once, to the least loaded rank (lowest on ties)."""
    loads = [0] * world_size
    result: List[List[List[int]]] = [[[] for _ in groups] for _ in range(world_size)]
    for g, group in enumerate(groups):
        for p in group["params"]:
            rank = min(range(world_size), key=lambda r: (loads[r], r))
            result[rank][g].append(id(p))
            loads[rank] += p.numel() if p.requires_grad else 1
    return result


def test_placing_groups_one_by_one_equals_placing_them_at_once() -> None:
    """Without a trainability change, adding groups one at a time gives upstream's partition of all of them."""
    rng = random.Random(0)
    for trial in range(200):
        world_size = rng.randint(1, 5)
        groups = [
            {"params": [torch.zeros(rng.randint(1, 40), requires_grad=rng.random() < 0.8) for _ in range(n)]}
            for n in [rng.randint(0, 6) for _ in range(rng.randint(1, 4))]
        ]
        owners: Dict[torch.Tensor, int] = {}
        for end in range(1, len(groups) + 1):
            owners = _partition.assign_owners(groups[:end], world_size, owners)
        expected = _upstream_rule(groups, world_size)
        assert _ids(_partition.split_by_owner(groups, world_size, owners)) == expected, f"trial {trial}"
        assert _ids(_partition.partition_param_groups(groups, world_size)) == expected, f"trial {trial}"


def test_placing_after_a_trainability_change_keeps_the_owners_and_continues_from_the_loads() -> None:
    sizes = [10, 4, 8, 4]
    params = [torch.zeros(n, requires_grad=i != 0) for i, n in enumerate(sizes)]
    owners = _partition.assign_owners([{"params": params}], 2, {})
    assert [owners[p] for p in params] == [0, 1, 0, 1]  # loads: 1 + 8 = 9 and 4 + 4 = 8
    params[0].requires_grad_(True)
    new = [torch.zeros(4, requires_grad=True), torch.zeros(3, requires_grad=True)]
    kept = _partition.assign_owners([{"params": params}, {"params": new}], 2, owners)
    # Upstream's walk over everything again would give [0, 1, 1, 0, ...]: the old parameters keep theirs, and the
    # new ones go by the loads with the current flags, 10 + 8 = 18 against 4 + 4 = 8: both to rank 1 (8, then 12).
    assert [kept[p] for p in params + new] == [0, 1, 0, 1, 1, 1]
    assert all(kept[p] == owner for p, owner in owners.items())


# ------------------------------------------------------------------------------------------------------------------
# Ownership in a world


def _ownership_body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("add_param_group after unfreezing trains like torch", lambda: _case_unfreeze_then_add(rank, world_size)),
            ("add_param_group equals building at once", lambda: _case_add_equals_at_once(world_size)),
            ("rebuild at step keeps owners", lambda: _case_rebuild_keeps_owners(rank, world_size)),
            ("flags that differ at add_param_group", lambda: _case_flags_differ_at_add(rank)),
        ]
    )


def _frozen_layer_setup() -> Tuple[nn.Module, nn.Module, List[List[Any]], OSS, torch.optim.Adam]:
    """The model and its reference; OSS and torch's Adam over the first and third layers, the first one frozen."""
    model = _model()
    reference = copy.deepcopy(model)
    body = [list(m[0].parameters()) + list(m[2].parameters()) for m in (model, reference)]
    for params in body:
        params[0].requires_grad_(False)
    oss = OSS(body[0], optim=torch.optim.Adam, lr=0.05)
    ref = torch.optim.Adam(body[1], lr=0.05)
    return model, reference, body, oss, ref


def _case_unfreeze_then_add(rank: int, world_size: int) -> None:
    """A layer frozen when OSS was built is unfrozen, then a head is added: the reference is torch's Adam."""
    model, reference, body, oss, ref = _frozen_layer_setup()
    before = _owners(oss, body[0])
    _oss_step(model, oss, rank, world_size, 0)
    _reference_step(reference, ref, world_size, 0)
    for params in body:
        params[0].requires_grad_(True)
    oss.refresh_trainable()
    oss.add_param_group({"params": list(model[4].parameters()), "lr": 0.02})
    ref.add_param_group({"params": list(reference[4].parameters()), "lr": 0.02})
    assert _owners(oss, body[0]) == before, "the parameters that were there keep their owner"
    # Current loads 24 + 30 against 6 + 5: the head goes to rank 1 (upstream moved model[2].weight to rank 1).
    assert _owners(oss, list(model[4].parameters())) == [1, 1]
    _assert_consistent(oss)
    for step in range(1, 4):
        _oss_step(model, oss, rank, world_size, step)
        _reference_step(reference, ref, world_size, step)
        _assert_close_params(model, reference, f"step {step}")
    _assert_same_on_every_rank(model, "after the steps")
    state = oss.state_dict(all_ranks=True)
    expected = ref.state_dict()
    assert sorted(state["state"]) == sorted(expected["state"])
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(state["state"][index][key], value, msg=f"state {index} {key}")


def _case_add_equals_at_once(world_size: int) -> None:
    """No trainability change: add_param_group twice gives the partition of OSS built with the three groups."""
    model = _model()
    model[2].weight.requires_grad_(False)  # frozen all along: counts one element in both
    params = list(model.parameters())
    groups = [{"params": params[:1]}, {"params": params[1:4], "lr": 0.2}, {"params": params[4:], "lr": 0.3}]
    at_once = OSS(copy.deepcopy(groups), lr=0.1)
    added = OSS(copy.deepcopy(groups[:1]), lr=0.1)
    # deepcopy of the groups copies the parameters too: compare by position.
    for group in copy.deepcopy(groups[1:]):
        added.add_param_group(group)

    def positions(oss: OSS) -> List[List[List[int]]]:
        index = oss._param_to_index
        return [
            [[index[id(p)] for p in g["params"]] for g in rank_groups] for rank_groups in oss.partition_parameters()
        ]

    assert positions(added) == positions(at_once), (positions(added), positions(at_once))
    assert positions(at_once) == [[[0], [], [5]], [[], [1, 2, 3], [4]]], positions(at_once)
    _assert_consistent(added)
    # The same owners on every rank.
    gathered: List[Any] = [None] * world_size
    dist.all_gather_object(gathered, positions(added))
    assert all(g == gathered[0] for g in gathered)


def _case_rebuild_keeps_owners(rank: int, world_size: int) -> None:
    """The rebuild at step() (here after model.double()) once re-partitioned with the current trainability."""
    model = _model()
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m[0].weight.requires_grad_(False)
    oss = OSS(model.parameters(), lr=0.05, momentum=0.9)
    ref = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    before = _owners(oss, list(model.parameters()))
    _oss_step(model, oss, rank, world_size, 0)
    _reference_step(reference, ref, world_size, 0)
    for m in (model, reference):
        m[0].weight.requires_grad_(True)
    oss.refresh_trainable()
    for m in (model, reference):
        m.double()
    for step in range(1, 4):
        _oss_step(model, oss, rank, world_size, step)
        _reference_step(reference, ref, world_size, step)
        _assert_close_params(model, reference, f"step {step}")
    assert _owners(oss, list(model.parameters())) == before
    _assert_consistent(oss)


def _case_flags_differ_at_add(rank: int) -> None:
    """The new parameters are placed by the current flags: ranks that froze differently are told, not desynced."""
    model = _model()
    oss = OSS(list(model[0].parameters()) + list(model[2].parameters()), lr=0.1)
    if rank == 1:
        model[2].weight.requires_grad_(False)
    with pytest.raises(RanksDisagreeError, match="group 0, parameter 2"):
        oss.add_param_group({"params": list(model[4].parameters())})
    assert len(oss.param_groups) == 1 and len(oss.optim.param_groups) == 1, "nothing was added"
    model[2].weight.requires_grad_(True)
    oss.add_param_group({"params": list(model[4].parameters())})
    _assert_consistent(oss)


def test_ownership_never_changes() -> None:
    run_distributed(_ownership_body, 2, timeout=TIMEOUT)


def _sharded_ddp_body(rank: int, world_size: int, reduce_buffer_size: int) -> None:
    """The same with ShardedDataParallel, which picks up the unfrozen layer and the new group at the forward."""
    model, reference, body, oss, ref = _frozen_layer_setup()
    sharded = ShardedDataParallel(model, oss, reduce_buffer_size=reduce_buffer_size)
    before = _owners(oss, body[0])
    for params in body:
        params[0].requires_grad_(True)
    oss.add_param_group({"params": list(model[4].parameters())})
    ref.add_param_group({"params": list(reference[4].parameters())})
    for step in range(3):
        sharded.zero_grad()
        _loss(sharded, _data(step, rank)).backward()
        oss.step()
        _reference_step(reference, ref, world_size, step)
        _assert_close_params(model, reference, f"step {step}")
        if step == 1:
            buckets = oss.buckets
    assert oss.buckets is buckets, "no rebuild once the changes were taken in"
    assert _owners(oss, body[0]) == before
    _assert_consistent(oss)


@pytest.mark.parametrize("reduce_buffer_size", [0, 2**20], ids=["unbucketed", "bucketed"])
def test_sharded_ddp_add_param_group_after_unfreezing(reduce_buffer_size: int) -> None:
    run_distributed(_sharded_ddp_body, 2, reduce_buffer_size, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------------------
# Parameters that stopped being views of their buckets


def _rebucket_body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("model.double() after OSS", lambda: _case_converted(rank, world_size, "double")),
            ("one .data replaced, not first in its bucket", lambda: _case_converted(rank, world_size, "data")),
            ("model.double() with broadcast_fp16", lambda: _case_converted_fp16(rank, world_size)),
            ("Adam reloaded after model.double()", lambda: _case_adam_reload(rank, world_size)),
            ("one layer converted", lambda: _case_one_layer_converted(rank, world_size)),
            ("no rebuild without a change", lambda: _case_no_rebuild(rank, world_size)),
        ]
    )


def _convert(model: nn.Module, how: str) -> None:
    if how == "double":
        model.double()
    else:
        # The largest parameter is the last of its owner's bucket (buckets are sorted by size): only a check of
        # every parameter, not of each bucket's first one, sees it.
        model[0].weight.data = model[0].weight.data.clone()


def _case_converted(rank: int, world_size: int, how: str) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    oss = OSS(model.parameters(), lr=0.05, momentum=0.9)
    ref = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        if step == 1:
            _convert(model, how)
            _convert(reference, how)
        _oss_step(model, oss, rank, world_size, step)
        _reference_step(reference, ref, world_size, step)
        _assert_close_params(model, reference, f"{how}, step {step}")
    _assert_same_on_every_rank(model, how)
    _assert_consistent(oss)


def _case_converted_fp16(rank: int, world_size: int) -> None:
    """fp16 broadcasts round every value, so no torch reference: the ranks stay identical, and the buckets follow."""
    model = _model()
    oss = OSS(model.parameters(), lr=0.05, momentum=0.9, broadcast_fp16=True)
    _oss_step(model, oss, rank, world_size, 0)
    model.double()
    for step in range(1, 4):
        before = [p.detach().clone() for p in model.parameters()]
        _oss_step(model, oss, rank, world_size, step)
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters())), "every parameter moved"
        _assert_same_on_every_rank(model, f"step {step}")
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all(
        b.buffer is not None and b.buffer.dtype == torch.float64 for b in oss.buckets[torch.device("cpu")].values()
    )
    _assert_consistent(oss)


def _case_adam_reload(rank: int, world_size: int) -> None:
    """Adam's moments keep their dtype (torch's Adam then refuses float64 parameters, as OSS's shards do); the
    documented way on: reload the consolidated state, which casts it, as torch's load_state_dict does."""
    model = _model()
    reference = copy.deepcopy(model)
    oss = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.05)
    ref = torch.optim.Adam(reference.parameters(), lr=0.05)
    _oss_step(model, oss, rank, world_size, 0)
    _reference_step(reference, ref, world_size, 0)
    model.double()
    reference.double()
    oss.load_state_dict(oss.state_dict(all_ranks=True))
    ref.load_state_dict(ref.state_dict())
    for step in range(1, 4):
        _oss_step(model, oss, rank, world_size, step)
        _reference_step(reference, ref, world_size, step)
        _assert_close_params(model, reference, f"step {step}")
    _assert_same_on_every_rank(model, "Adam")


def _case_one_layer_converted(rank: int, world_size: int) -> None:
    """One owner's bucket would hold two dtypes: every rank raises the same TypeError, and recovers."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n)) for n in (4, 3, 2, 5)]
    initial = [p.detach().double() for p in params]
    oss = OSS(params, lr=0.05)
    assert _owners(oss, params) == [0, 1, 1, 0]
    params[2].data = params[2].data.double()  # rank 1 owns it with a float parameter

    def step() -> None:
        for p in params:
            p.grad = torch.ones_like(p)
        oss.step()

    with pytest.raises(TypeError, match="several dtypes"):
        step()
    for p in params:
        p.data = p.data.double()
    step()
    # One step of SGD on every parameter: the refused step changed nothing.
    assert all(torch.equal(p.detach(), q - 0.05) for p, q in zip(params, initial))
    _assert_same_on_every_rank(nn.ParameterList(params), "after converting the rest")
    _assert_consistent(oss)


def _case_no_rebuild(rank: int, world_size: int) -> None:
    """The check must not fire by itself (also when fp16 broadcasts swap the buffers at every step)."""
    for fp16 in (False, True):
        model = _model()
        oss = OSS(model.parameters(), lr=0.05, broadcast_fp16=fp16)
        buckets = oss.buckets
        for step in range(3):
            _oss_step(model, oss, rank, world_size, step)
        assert oss.buckets is buckets, f"rebuilt without a change (broadcast_fp16={fp16})"
        model.double()
        _oss_step(model, oss, rank, world_size, 3)
        assert oss.buckets is not buckets, "model.double() is noticed"


def test_parameters_that_left_their_buckets_are_rebucketed() -> None:
    run_distributed(_rebucket_body, 2, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------------------
# The bucket kept for an owner whose parameters are all frozen


def _kept_bucket_body(rank: int, world_size: int) -> Tuple[List[float], int]:
    a = nn.Parameter(torch.ones(4))
    b = nn.Parameter(torch.full((4,), 2.0))
    oss = OSS([a, b], lr=0.1, broadcast_fp16=True)
    assert _owners(oss, [a, b]) == [0, 1]
    b.requires_grad_(False)
    oss.refresh_trainable()
    with torch.no_grad():
        b.copy_(torch.full((4,), 3.0))  # a frozen parameter changed on purpose, on every rank
    a.grad = torch.ones(4)
    oss.step()
    return b.tolist(), len(oss.buckets[torch.device("cpu")])


def test_frozen_parameter_keeps_its_value_with_broadcast_fp16() -> None:
    """Rank 1 owns only ``b``, now frozen: its old bucket is still broadcast (upstream's layout) but backs nothing.
    It used to re-point ``b`` into itself at each fp16 broadcast, back to its value of when it was frozen."""
    results = run_distributed(_kept_bucket_body, 2, timeout=TIMEOUT)
    assert results == [([3.0] * 4, 2)] * 2, results
