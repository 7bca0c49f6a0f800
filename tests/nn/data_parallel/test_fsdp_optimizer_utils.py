# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""gather_full_optim_state_dict / get_shard_from_optim_state_dict against a single-process optimizer.

The reference is the unwrapped model with the same optimizer, trained on the global batch; every FSDP rank trains on
its slice. The gathered state must equal the reference optimizer's state (per original parameter), re-sharding it
must give back every rank's own state, and a run resumed from it (at any world size) must continue like the
reference.
"""

import copy
import functools
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from _models import (
    ModelWithUnusedParams,
    NestedWrappedModule,
    build,
    global_batch,
    local_slice,
    reference_loss,
    scaled_loss,
    wrap_model,
)
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal import collectives
from fairscale.internal.parallel import chunk_and_pad
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel.fsdp_optim_utils import (
    check_param_counts_before_sharding,
    flatten_optim_state_dict,
    is_singleton_tensor,
    param_id_runs,
)

GLOBAL_N = 12  # divisible by every world size used here


def _optim(params: Any, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if kind == "adadelta":
        return torch.optim.Adadelta(params, lr=1.0)
    raise ValueError(kind)


def _train(
    fsdp: FSDP, ref: nn.Module, opt: Any, ref_opt: Any, steps: range, rank: int, world_size: int, replicas: int = 1
) -> None:
    """Data-parallel steps. With ``replicas`` > 1, ranks ``r`` and ``r + world_size / replicas`` share a slice."""
    slices = world_size // replicas
    for step in steps:
        batch = global_batch(ref, step, GLOBAL_N)
        opt.zero_grad()
        scaled_loss(type(ref), fsdp(*local_slice(batch, rank % slices, slices)), GLOBAL_N, slices).backward()
        opt.step()
        ref_opt.zero_grad()
        reference_loss(ref, batch, 1).backward()
        ref_opt.step()


def _names_by_global_id(fsdp: FSDP) -> List[str]:
    """Original parameter names in global-id order, read from the (independently tested) metadata."""
    names = []
    for entry in fsdp.local_metadata_dict()["param_metadata"]:
        for info in entry["params"].values():
            names += [f"{entry['fsdp_path']}.{n}" if entry["fsdp_path"] else n for n in info["names"]]
    return names


def _broadcast(obj: Any) -> Any:
    box = [obj]
    collectives.broadcast_object_list(box, src=0)
    return box[0]


def _assert_state_close(actual: Dict[str, Any], expected: Dict[str, Any], what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: keys {sorted(actual)} vs {sorted(expected)}"
    for key, value in expected.items():
        got = actual[key]
        if key == "step":
            assert isinstance(got, (int, float)), f"{what}: step must be a plain number in the full dict"
            assert got == float(value), f"{what}: step {got} vs {value}"
        else:
            torch.testing.assert_close(got, value, rtol=1e-4, atol=1e-6, msg=lambda m: f"{what} {key}: {m}")


def _assert_local_equal(actual: Dict[str, Any], expected: Dict[str, Any], what: str) -> None:
    """Two per-rank optimizer state dicts are equal (a ``step`` may be a number on one side, a tensor on the other)."""
    assert actual["param_groups"] == expected["param_groups"], f"{what}: param_groups differ"
    assert sorted(actual["state"]) == sorted(expected["state"]), f"{what}: state ids differ"
    for local, entry in expected["state"].items():
        assert sorted(actual["state"][local]) == sorted(entry), f"{what}: keys of {local} differ"
        for key, value in entry.items():
            got = actual["state"][local][key]
            if isinstance(value, Tensor) and value.dim() > 0:
                assert torch.equal(got, value), f"{what}: {local}/{key} differs"
            else:
                assert float(got) == float(value), f"{what}: {local}/{key}: {got} vs {value}"


def _assert_gathered_matches_reference(full: Dict[str, Any], fsdp: FSDP, ref: nn.Module, ref_opt: Any) -> None:
    names = _names_by_global_id(fsdp)
    ref_ids = {name: i for i, (name, _) in enumerate(ref.named_parameters())}
    ref_sd = ref_opt.state_dict()
    assert sorted(full) == ["param_groups", "param_id_map", "state", "uncollected_local_ids"]
    assert full["uncollected_local_ids"] == []
    assert sorted(full["state"]) == sorted(g for g, n in enumerate(names) if ref_ids[n] in ref_sd["state"])
    for gid, name in enumerate(names):
        if ref_ids[name] in ref_sd["state"]:
            _assert_state_close(full["state"][gid], ref_sd["state"][ref_ids[name]], f"state of {name}")
    expected_group = dict(ref_sd["param_groups"][0], params=list(range(len(names))))
    assert full["param_groups"] == [expected_group]
    meta = [e for e in fsdp.local_metadata_dict()["param_metadata"] if e["params"]]
    expected_map = {}
    for local, entry in enumerate(meta):
        for _ in entry["params"]["flat_param_0"]["names"]:
            expected_map[len(expected_map)] = local
    assert full["param_id_map"] == expected_map
    assert param_id_runs(full["param_id_map"]) == len(meta)


# ------------------------------------------------------------------------------------------------------ 2 ranks


def _case_gather_and_reshard(rank: int, world_size: int, kind: str, mode: str) -> None:
    model, ref = build(NestedWrappedModule)
    fsdp = wrap_model(model, {"bucket_cap_mb": 0}, mode)
    opt, ref_opt = _optim(fsdp.parameters(), kind), _optim(ref.parameters(), kind)
    _train(fsdp, ref, opt, ref_opt, range(2), rank, world_size)
    local = copy.deepcopy(opt.state_dict())
    full = fsdp.gather_full_optim_state_dict(opt, recipient_rank=0)  # unknown keyword arguments are ignored
    if rank != 0:
        assert full is None
    else:
        _assert_gathered_matches_reference(full, fsdp, ref, ref_opt)
    # The live optimizer is untouched (steps stay of the type torch keeps: tensors, or ints in torch 2.1's Adadelta)
    # and can step on.
    _assert_local_equal(opt.state_dict(), local, "live optimizer after the gather")
    step_types = {type(s["step"]) for s in opt.state.values() if "step" in s}
    assert step_types == {type(s["step"]) for s in ref_opt.state.values() if "step" in s}, step_types
    # Shard-after-gather gives back each rank's own state, without modifying the full dict.
    full = _broadcast(full)
    kept = copy.deepcopy(full)
    shard = fsdp.get_shard_from_optim_state_dict(full)
    _assert_local_equal(shard, local, "re-sharded state")
    assert _same(full, kept), "get_shard_from_optim_state_dict modified its input"
    # It loads, and training continues like the reference.
    resumed = _optim(fsdp.parameters(), kind)
    resumed.load_state_dict(shard)
    _train(fsdp, ref, resumed, ref_opt, range(2, 3), rank, world_size)
    with fsdp.summon_full_params():
        for (name, p), q in zip(fsdp.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} after resume: {m}")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _case_unused_params(rank: int, world_size: int, mode: str) -> None:
    """``unused`` never runs: as its own instance it has no state at all; inside a flat param its state is zero."""
    model, ref = build(ModelWithUnusedParams)
    fsdp = wrap_model(model, {"bucket_cap_mb": 0}, mode)
    opt, ref_opt = _optim(fsdp.parameters(), "adam"), _optim(ref.parameters(), "adam")
    _train(fsdp, ref, opt, ref_opt, range(2), rank, world_size)
    local = opt.state_dict()
    full = _broadcast(fsdp.gather_full_optim_state_dict(opt))
    names = _names_by_global_id(fsdp)
    assert list(full["param_id_map"]) == list(range(len(names)))  # every parameter is mapped, used or not
    ref_ids = {name: i for i, (name, _) in enumerate(ref.named_parameters())}
    ref_state = ref_opt.state_dict()["state"]
    for gid, name in enumerate(names):
        if ref_ids[name] in ref_state:
            _assert_state_close(full["state"][gid], ref_state[ref_ids[name]], f"{mode}: state of {name}")
        elif mode == "nested":
            assert gid not in full["state"], f"{name} has no gradient, so no state"
        else:
            assert not full["state"][gid]["exp_avg"].any(), f"{name}: zero gradients give zero moments"
    _assert_local_equal(fsdp.get_shard_from_optim_state_dict(full), local, f"{mode}: re-sharded state")


def _case_nested_group_of_one_expert(rank: int, world_size: int) -> None:
    """MoE style: a nested expert on a group of one rank with ``no_broadcast_optim_state``: rank 0's state is not
    gathered (``uncollected_local_ids``) but split per original parameter like the others, as upstream (its MoE
    consolidation test counts one entry per parameter of the unwrapped model), and handed back unchanged. The
    earlier form, the expert's flat state under its first global id, still loads."""
    groups = [dist.new_group([r]) for r in range(world_size)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2))
    torch.manual_seed(100 + rank)  # every rank its own expert
    model[1] = FSDP(nn.Linear(6, 6), process_group=groups[rank], no_broadcast_optim_state=True)
    fsdp = FSDP(model, bucket_cap_mb=0)
    opt = _optim(fsdp.parameters(), "adam")
    fsdp(torch.randn(3, 4)).sum().backward()
    opt.step()
    local = opt.state_dict()
    full = fsdp.gather_full_optim_state_dict(opt)
    if rank == 0:
        assert full["uncollected_local_ids"] == [1]
        assert full["param_id_map"] == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1}
        assert sorted(full["state"]) == [0, 1, 2, 3, 4, 5]  # one per parameter, as the unwrapped model's optimizer
        expert = local["state"][1]["exp_avg"]
        assert torch.equal(full["state"][4]["exp_avg"], expert[:36].view(6, 6))  # the expert's weight, then bias
        assert torch.equal(full["state"][5]["exp_avg"], expert[36:])
        assert full["state"][4]["step"] == full["state"][5]["step"] == float(local["state"][1]["step"])
    full = _broadcast(full)
    rank0_expert = _broadcast(local["state"][1]["exp_avg"])
    earlier = copy.deepcopy(full)  # the earlier form: the expert's flat state under its first global id
    earlier["state"][4] = {
        **earlier["state"][4],
        "exp_avg": rank0_expert,
        "exp_avg_sq": torch.cat([earlier["state"][4]["exp_avg_sq"].reshape(-1), earlier["state"].pop(5)["exp_avg_sq"]]),
    }
    for given in (full, earlier):
        shard = fsdp.get_shard_from_optim_state_dict(given)
        assert torch.equal(shard["state"][0]["exp_avg"], local["state"][0]["exp_avg"])
        assert torch.equal(shard["state"][1]["exp_avg"], rank0_expert)  # rank 0's, on every rank (as upstream)
        _optim(fsdp.parameters(), "adam").load_state_dict(shard)


def _case_bad_input(rank: int, world_size: int) -> None:
    model, _ = build(NestedWrappedModule)
    fsdp = wrap_model(model, {"bucket_cap_mb": 0}, "nested")
    opt = _optim(fsdp.parameters(), "adam")
    fsdp(*global_batch(model, 0, 4)).sum().backward()
    opt.step()
    full = _broadcast(fsdp.gather_full_optim_state_dict(opt))
    nonflat = wrap_model(build(NestedWrappedModule)[0], {"flatten_parameters": False}, "nested")
    with pytest.raises(NotImplementedError, match="flatten_parameters=True"):
        nonflat.gather_full_optim_state_dict(_optim(nonflat.parameters(), "sgd"))
    with pytest.raises(NotImplementedError, match="flatten_parameters=True"):
        nonflat.get_shard_from_optim_state_dict(full)
    params = list(fsdp.parameters())
    two_groups = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:]}], lr=0.1)
    with pytest.raises(NotImplementedError, match="exactly one parameter group"):
        fsdp.gather_full_optim_state_dict(two_groups)
    with pytest.raises(ValueError, match=r"model\.parameters\(\) order"):
        fsdp.gather_full_optim_state_dict(torch.optim.SGD(params[::-1], lr=0.1))
    # The trainable parameters only (the requires_grad filter): the message names the cause, not "another model".
    params[1].requires_grad_(False)
    try:
        trainable = torch.optim.SGD([p for p in params if p.requires_grad], lr=0.1)
        with pytest.raises(ValueError, match=r"leaves out 1 of the model's \d+ flat parameters .*1 of those left out"):
            fsdp.gather_full_optim_state_dict(trainable)
    finally:
        params[1].requires_grad_(True)
    # On one rank only (found by a rank-disagreement review): that rank raised alone and the others waited in the
    # gathers until the group's timeout; its error now reaches every rank through the schema gather.
    with pytest.raises(NotImplementedError, match=r"group rank 1: .*exactly one parameter group"):
        fsdp.gather_full_optim_state_dict(two_groups if rank == 1 else opt)
    # The hint said a per-rank dict "loads directly": one of a torch optimizer over the unwrapped module then failed
    # in the next step on shapes.
    with pytest.raises(ValueError, match="expects a gather_full_optim_state_dict.*unwrapped module is neither"):
        fsdp.get_shard_from_optim_state_dict(opt.state_dict())
    with pytest.warns(UserWarning, match="recipient_rank=1 is ignored"):
        fsdp.gather_full_optim_state_dict(opt, recipient_rank=1)
    # State under a key that is not a parameter (torch allows it): was "invalid literal for int()", on every rank.
    opt.state["global_count"] = {"count": 1}  # type: ignore[index]
    try:
        with pytest.raises(ValueError, match=r"state under keys that are not parameters \(\['global_count'\]\)"):
            fsdp.gather_full_optim_state_dict(opt)
    finally:
        del opt.state["global_count"]  # type: ignore[arg-type]
    other = wrap_model(build(ModelWithUnusedParams)[0], {}, "nested")
    with pytest.raises(ValueError, match="describes 10 parameters but this model has 6"):
        other.get_shard_from_optim_state_dict(full)
    wrong_shape = copy.deepcopy(full)
    wrong_shape["state"][1]["exp_avg"] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 1 \(layers\.0\.bias\) has shape \(4,\)"):
        fsdp.get_shard_from_optim_state_dict(wrong_shape)
    wrong_map = copy.deepcopy(full)
    wrong_map["param_id_map"][9] = 0
    with pytest.raises(ValueError, match=r"maps parameter 9 \(layers\.2\.0\.bias\) to flat parameter 0"):
        fsdp.get_shard_from_optim_state_dict(wrong_map)


def _case_upstream_fixture(rank: int, world_size: int) -> None:
    """A full Adam dict written from the documented format (not by this code) loads and steps."""
    model, _ = build(NestedWrappedModule)
    fsdp = wrap_model(model, {"bucket_cap_mb": 0}, "nested")
    gen = torch.Generator().manual_seed(3)
    # Global ids: root (layers.0, layers.3), then block 1 (layers.1.0, layers.1.2), then block 2 (layers.2.0).
    shapes = [(5, 7), (5,), (3, 5), (3,), (9, 5), (9,), (5, 9), (5,), (5, 5), (5,)]
    local_ids = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    state = {
        g: {"step": 1.0, "exp_avg": torch.randn(*s, generator=gen), "exp_avg_sq": torch.rand(*s, generator=gen)}
        for g, s in enumerate(shapes)
    }
    group = dict(_optim([torch.zeros(1)], "adam").state_dict()["param_groups"][0], params=list(range(10)))
    full = {
        "state": state,
        "param_groups": [group],
        "param_id_map": dict(enumerate(local_ids)),
        "uncollected_local_ids": [],
        "loss_scale": 128.0,
    }
    shard = fsdp.get_shard_from_optim_state_dict(full)
    assert shard["loss_scale"] == 128.0 and shard["param_groups"][0]["params"] == [0, 1, 2]
    for local in range(3):
        gids = [g for g, k in enumerate(local_ids) if k == local]
        flat = torch.cat([state[g]["exp_avg"].reshape(-1) for g in gids])
        assert torch.equal(shard["state"][local]["exp_avg"], chunk_and_pad(flat, world_size)[rank])
        assert shard["state"][local]["step"] == 1.0
    opt = _optim(fsdp.parameters(), "adam")
    opt.load_state_dict(shard)
    fsdp(*global_batch(model, 0, 4)).sum().backward()
    opt.step()
    assert all(float(s["step"]) == 2.0 for s in opt.state.values())


class _ScaleFirst(nn.Module):
    """A 0-dim parameter registered first (CLIP's ``logit_scale``), so it leads the flat parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(2.0))
        self.lin = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * self.logit_scale


def _train_three_steps(
    build: Callable[[], FSDP],
    make_optim: Callable[[Any], torch.optim.Optimizer],
    loss: Callable[[FSDP, int], Tensor],
    resume: bool,
) -> Tuple[Dict[str, Tensor], Any]:
    """Three steps; with ``resume``, the optimizer is rebuilt after the first from the gathered full state dict.
    Returns the full parameters and the gathered dict (gathered after the first step in both runs)."""
    torch.manual_seed(0)
    fsdp = build()
    opt = make_optim(fsdp.parameters())
    full = None
    for step in range(3):
        if step == 1:
            full = fsdp.gather_full_optim_state_dict(opt)
            if resume:
                opt = make_optim(fsdp.parameters())
                opt.load_state_dict(fsdp.get_shard_from_optim_state_dict(_broadcast(full)))
        opt.zero_grad()
        loss(fsdp, step).backward()
        opt.step()
    with fsdp.summon_full_params():
        return {n: p.detach().clone() for n, p in fsdp.named_parameters()}, full


def _assert_resume_exact(
    build: Callable[[], FSDP], make_optim: Callable[[Any], torch.optim.Optimizer], loss: Callable[[FSDP, int], Tensor]
) -> Any:
    """Resuming from the gathered dict gives the uninterrupted run's parameters bit for bit; returns that dict."""
    (uninterrupted, full), (resumed, _) = [_train_three_steps(build, make_optim, loss, r) for r in (False, True)]
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name
    return full


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def _case_zero_dim_parameter_first(rank: int, world_size: int) -> None:
    # The per-element state of a flat parameter whose first parameter is 0-dim was resharded to that one element
    # (its 0-dim exp_avg was taken for a shared value like step): the next Adam step failed on the shapes.
    def loss(fsdp: FSDP, step: int) -> Tensor:
        return fsdp(torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + rank))).sum()

    _assert_resume_exact(lambda: FSDP(_ScaleFirst()), _adam, loss)


def _single_parameter_model(inner_bias: bool) -> FSDP:
    torch.manual_seed(0)
    inner = FSDP(nn.Linear(4, 4, bias=inner_bias), flatten_parameters=False)
    return FSDP(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), inner, nn.Tanh(), nn.Linear(4, 2)))


def _case_single_parameter_instance_not_flattened(rank: int, world_size: int) -> None:
    """A nested instance with flatten_parameters=False and one parameter of its own (upstream's MEVO test): upstream
    gathers it like a flat one; it was refused. Resuming from the gathered dict equals the uninterrupted run."""

    def loss(fsdp: FSDP, step: int) -> Tensor:
        return fsdp(torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + rank))).sum()

    full = _assert_resume_exact(lambda: _single_parameter_model(inner_bias=False), _adam, loss)
    if rank == 0:  # the root's 4 parameters, then the inner instance's weight (4 x 4)
        assert sorted(full["state"]) == [0, 1, 2, 3, 4] and full["param_id_map"][4] == 1, full["param_id_map"]
        assert full["state"][4]["exp_avg"].shape == (4, 4)
    two = _single_parameter_model(inner_bias=True)
    with pytest.raises(NotImplementedError, match="flatten them .* or to hold a single parameter of its own"):
        two.gather_full_optim_state_dict(torch.optim.SGD(two.parameters(), lr=0.1))


class _MevoTied(nn.Module):
    """Upstream's MEVO test model, reduced: the embedding's weight is MEVO's projection, declared by MEVO's
    (non-flat) instance with append_shared_param next to its own trigger parameter."""

    def __init__(self) -> None:
        super().__init__()
        from fairscale.experimental.nn import MEVO

        self.l0 = nn.Embedding(64, 8)
        self.l1 = MEVO(self.l0.weight, tile_factor=2, reduction="sum")
        self.middle = nn.Linear(8, 8)
        self.l0 = FSDP(self.l0, flatten_parameters=False)
        self.l1 = FSDP(self.l1, flatten_parameters=False)
        self.l1.append_shared_param(self.l0.module.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.l1(torch.tanh(self.middle(self.l0(x))), x + 1)


def _case_borrowing_single_parameter_instance(rank: int, world_size: int) -> None:
    """A non-flat instance with one parameter of its own and a borrowed one (upstream's MEVO test): upstream counts
    only its own; it was refused. Resuming from the gathered dict equals the uninterrupted run."""

    def loss(fsdp: FSDP, step: int) -> Tensor:
        return fsdp(torch.randint(0, 62, (2, 3), generator=torch.Generator().manual_seed(10 * step + rank)))

    _assert_resume_exact(lambda: FSDP(_MevoTied()), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), loss)


class _ScalarsOnly(nn.Module):
    """CLIP/SigLIP's layout: the root instance owns only 0-dim parameters, the tower is a nested instance."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(2.0))
        self.logit_bias = nn.Parameter(torch.tensor(-1.0))
        self.tower = FSDP(nn.Linear(4, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.tower(x) * self.logit_scale + self.logit_bias


def _sgd_momentum(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _case_only_zero_dim_parameters(rank: int, world_size: int) -> None:
    # Every parameter of the root's flat parameter is 0-dim: their 0-dim exp_avg were taken for a shared value
    # (one kept for the whole flat parameter) and the next step after loading failed on the shapes.
    def loss(fsdp: FSDP, step: int) -> Tensor:
        return fsdp(torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + rank))).sum()

    for make_optim in (_adam, _sgd_momentum):
        full = _assert_resume_exact(lambda: FSDP(_ScalarsOnly()), make_optim, loss)
        if rank == 0:
            key = "exp_avg" if make_optim is _adam else "momentum_buffer"
            assert [full["state"][g][key].shape for g in (0, 1)] == [(), ()], full["state"]


def _case_non_flat_expert_on_a_group_of_one(rank: int, world_size: int) -> None:
    """An uncollected single non-flat parameter (an expert on a group of one rank, not sharded): its state was
    handed back flat (36,) for a (6, 6) parameter; load_state_dict took it and the next step failed."""
    groups = [dist.new_group([r]) for r in range(world_size)]
    torch.manual_seed(100 + rank)
    expert = FSDP(
        nn.Linear(6, 6, bias=False), process_group=groups[rank], flatten_parameters=False, no_broadcast_optim_state=True
    )
    fsdp = FSDP(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), expert))
    opt = _adam(fsdp.parameters())
    fsdp(torch.randn(2, 4)).sum().backward()
    opt.step()
    live = opt.state_dict()["state"]
    shard = fsdp.get_shard_from_optim_state_dict(_broadcast(fsdp.gather_full_optim_state_dict(opt)))
    assert shard["state"][1]["exp_avg"].shape == live[1]["exp_avg"].shape == (6, 6)
    resumed = _adam(fsdp.parameters())
    resumed.load_state_dict(shard)
    fsdp(torch.randn(2, 4)).sum().backward()
    resumed.step()


def _case_reshard_shares_nothing_with_the_full_dict(rank: int, world_size: int) -> None:
    """A full dict whose ``step`` values are tensors (torch's own per-parameter form): the shard handed them back
    as they were, torch's load_state_dict kept them and stepping incremented the caller's dict in place."""
    fsdp = _single_parameter_model(inner_bias=False)
    opt = _adam(fsdp.parameters())
    for _ in range(2):
        fsdp(torch.randn(2, 4)).sum().backward()
        opt.step()
    full = _broadcast(fsdp.gather_full_optim_state_dict(opt))
    for entry in full["state"].values():
        entry["step"] = torch.tensor(float(entry["step"]))
    kept = copy.deepcopy(full)
    shard = fsdp.get_shard_from_optim_state_dict(full)
    inputs = {id(v) for e in full["state"].values() for v in e.values()}
    assert not any(id(v) in inputs for e in shard["state"].values() for v in e.values())
    resumed = _adam(fsdp.parameters())
    resumed.load_state_dict(shard)
    fsdp(torch.randn(2, 4)).sum().backward()
    resumed.step()
    assert _same(full, kept), "stepping after the load changed the full dict"


def _ws2_body(rank: int, world_size: int) -> None:
    cases: List[Tuple[str, Callable[[], Any]]] = []
    for kind, mode in (("sgd", "nested"), ("adam", "nested"), ("adadelta", "nested"), ("adam", "one")):
        case = functools.partial(_case_gather_and_reshard, rank, world_size, kind, mode)
        cases.append((f"gather_and_reshard[{kind}-{mode}]", case))
    for mode in ("nested", "one"):
        cases.append((f"unused_params[{mode}]", functools.partial(_case_unused_params, rank, world_size, mode)))
    cases.append(("expert_group_of_one", functools.partial(_case_nested_group_of_one_expert, rank, world_size)))
    cases.append(("bad_input", functools.partial(_case_bad_input, rank, world_size)))
    cases.append(("upstream_fixture", functools.partial(_case_upstream_fixture, rank, world_size)))
    borrowing = functools.partial(_case_borrowing_single_parameter_instance, rank, world_size)
    cases.append(("borrowing_single_parameter_instance", borrowing))
    cases.extend(_cases_at_any_world_size(rank, world_size))
    run_cases(cases)


def _cases_at_any_world_size(rank: int, world_size: int) -> List[Tuple[str, Callable[[], Any]]]:
    return [
        (case.__name__[len("_case_") :], functools.partial(case, rank, world_size))
        for case in (
            _case_zero_dim_parameter_first,
            _case_only_zero_dim_parameters,
            _case_single_parameter_instance_not_flattened,
            _case_non_flat_expert_on_a_group_of_one,
            _case_reshard_shares_nothing_with_the_full_dict,
        )
    ]


def test_optimizer_state_two_ranks() -> None:
    run_distributed(_ws2_body, 2)


def _ws1_body(rank: int, world_size: int) -> None:
    run_cases(_cases_at_any_world_size(rank, world_size))


def test_optimizer_state_one_rank() -> None:
    """A group of one rank does not shard: a single non-flat parameter keeps its shape, and so must its state."""
    run_distributed(_ws1_body, 1)


# ------------------------------------------------------------------------------------------------------ other groups


def _subgroup_body(rank: int, world_size: int) -> None:
    """Nested instances sharded over a group of 2 ({0, 1} and {2, 3}), replicated across the two groups."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model, ref = build(NestedWrappedModule)
    fsdp = wrap_model(model, {"bucket_cap_mb": 0}, "nested", {"process_group": groups[rank // 2]})
    opt, ref_opt = _optim(fsdp.parameters(), "adam"), _optim(ref.parameters(), "adam")
    _train(fsdp, ref, opt, ref_opt, range(2), rank, world_size, replicas=2)
    local = opt.state_dict()
    full = fsdp.gather_full_optim_state_dict(opt)
    if rank == 0:
        _assert_gathered_matches_reference(full, fsdp, ref, ref_opt)
    _assert_local_equal(fsdp.get_shard_from_optim_state_dict(_broadcast(full)), local, f"rank {rank}'s re-shard")


def test_nested_instances_on_their_own_groups() -> None:
    run_distributed(_subgroup_body, 4)


def _root_on_a_subgroup_body(rank: int, world_size: int) -> None:
    """The root sharded over a data-parallel group ({0, 2} and {1, 3}: tensor parallelism's layout, each group
    training its own part of the model): each group's rank 0 gets its part's full dict. Only global rank 0 did, and
    the other data-parallel leader got None (its part of the optimizer state was never saved)."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    part = rank % 2
    model, _ = build(NestedWrappedModule, seed=1 + part)
    fsdp = wrap_model(model, {"process_group": groups[part]}, "nested")
    opt = _optim(fsdp.parameters(), "adam")
    opt.zero_grad()
    batch = global_batch(model, part, GLOBAL_N)
    scaled_loss(NestedWrappedModule, fsdp(*local_slice(batch, rank // 2, 2)), GLOBAL_N, 2).backward()
    opt.step()
    full = fsdp.gather_full_optim_state_dict(opt)
    assert (full is not None) == (rank < 2), f"rank {rank}: {'a dict' if full is not None else 'None'}"
    leaders: List[Any] = [None] * world_size
    dist.all_gather_object(leaders, full)
    _assert_local_equal(fsdp.get_shard_from_optim_state_dict(leaders[part]), opt.state_dict(), f"rank {rank}")


def test_root_on_a_data_parallel_subgroup() -> None:
    run_distributed(_root_on_a_subgroup_body, 4)


# ------------------------------------------------------------------------------------------------------ resume


KINDS = ("sgd", "adam", "adadelta")


def _save_body(rank: int, world_size: int) -> Dict[str, Any]:
    saved = {}
    for kind in KINDS:
        model, ref = build(NestedWrappedModule)
        fsdp = wrap_model(model, {"bucket_cap_mb": 0}, "nested")
        opt, ref_opt = _optim(fsdp.parameters(), kind), _optim(ref.parameters(), kind)
        _train(fsdp, ref, opt, ref_opt, range(2), rank, world_size)
        optim_sd = fsdp.gather_full_optim_state_dict(opt)
        saved[kind] = (fsdp.state_dict(), optim_sd, ref.state_dict(), ref_opt.state_dict())
    return saved


def _resume_body(rank: int, world_size: int, saved: Dict[str, Any]) -> None:
    def resume(kind: str) -> None:
        model_sd, optim_sd, ref_sd, ref_optim_sd = saved[kind]
        model, ref = build(NestedWrappedModule, seed=9)
        fsdp = wrap_model(model, {"bucket_cap_mb": 0}, "nested")
        fsdp.load_state_dict(model_sd)
        ref.load_state_dict(ref_sd)
        opt, ref_opt = _optim(fsdp.parameters(), kind), _optim(ref.parameters(), kind)
        opt.load_state_dict(fsdp.get_shard_from_optim_state_dict(optim_sd))
        ref_opt.load_state_dict(ref_optim_sd)
        _train(fsdp, ref, opt, ref_opt, range(2, 4), rank, world_size)
        with fsdp.summon_full_params():
            for (name, p), q in zip(fsdp.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m: f"{kind} {name}: {m}")

    run_cases([(f"resume[{kind}]", functools.partial(resume, kind)) for kind in KINDS])


def test_resume_optimizer_state_at_other_world_sizes() -> None:
    saved = run_distributed(_save_body, 2)[0]
    for world_size in (3, 1):
        run_distributed(_resume_body, world_size, saved)


def _mixed_batch(step: int) -> Tensor:
    return torch.randn(GLOBAL_N, 4, generator=torch.Generator().manual_seed(step))


def _mixed_steps(fsdp: FSDP, opt: Any, steps: range, rank: int, world_size: int) -> None:
    per_rank = GLOBAL_N // world_size
    for step in steps:
        opt.zero_grad()
        fsdp(_mixed_batch(step)[rank * per_rank : (rank + 1) * per_rank]).mean().backward()
        opt.step()


class _Scale(nn.Module):
    """One 0-dim parameter (a learned temperature, CLIP's ``logit_scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


def _scalar_instance_model() -> FSDP:
    torch.manual_seed(0)
    return FSDP(nn.Sequential(nn.Linear(4, 3), FSDP(_Scale(), flatten_parameters=False)))


def _mid_run_model(which: str) -> FSDP:
    if which == "scalar":
        return _scalar_instance_model()
    return _single_parameter_model(inner_bias=False) if which == "single" else _uncollected_model()


def _mid_run_save_body(rank: int, world_size: int, which: str) -> Tuple[Dict[str, Any], Any, Dict[str, Tensor]]:
    """One step, a checkpoint (model and gathered optimizer state), then two more steps; returns the checkpoint and
    the parameters those two steps give."""
    fsdp = _mid_run_model(which)
    opt = _adam(fsdp.parameters())
    _mixed_steps(fsdp, opt, range(1), rank, world_size)
    model_sd, optim_sd = fsdp.state_dict(), fsdp.gather_full_optim_state_dict(opt)
    _mixed_steps(fsdp, opt, range(1, 3), rank, world_size)
    with fsdp.summon_full_params():
        return model_sd, optim_sd, {n: p.detach().clone() for n, p in fsdp.named_parameters()}


def _mid_run_resume_body(
    rank: int, world_size: int, which: str, saved: Tuple[Dict[str, Any], Any, Dict[str, Tensor]]
) -> None:
    """Resume from the checkpoint and run the same two steps: the parameters match the uninterrupted run's."""
    model_sd, optim_sd, expected = saved
    fsdp = _mid_run_model(which)
    fsdp.load_state_dict(model_sd)
    opt = _adam(fsdp.parameters())
    opt.load_state_dict(fsdp.get_shard_from_optim_state_dict(optim_sd))
    _mixed_steps(fsdp, opt, range(1, 3), rank, world_size)
    with fsdp.summon_full_params():
        for name, p in fsdp.named_parameters():
            torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_resume_a_non_flat_single_parameter_instance_at_one_rank() -> None:
    """Saved at 2 ranks, where the inner instance's parameter is sharded flat; resumed at 1, where it keeps its
    (4, 4) shape: its state was handed back flat, and every optimizer but plain SGD failed at the first step."""
    saved = run_distributed(_mid_run_save_body, 2, "single")[0]
    run_distributed(_mid_run_resume_body, 1, "single", saved)


def _uncollected_model() -> FSDP:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), FSDP(nn.Linear(6, 3), no_broadcast_optim_state=True))
    return FSDP(net)


def _uncollected_refused_body(rank: int, world_size: int, saved: Tuple[Dict[str, Any], Any, Dict[str, Tensor]]) -> None:
    fsdp = _uncollected_model()
    fsdp.load_state_dict(saved[0])
    with pytest.raises(ValueError, match="no_broadcast_optim_state=True.*saved as one rank's shard at another world"):
        fsdp.get_shard_from_optim_state_dict(saved[1])


def test_uncollected_instance_state_saved_whole_resumes_sharded() -> None:
    """A no_broadcast_optim_state instance saved on one rank (its state whole) resumes at two ranks, each rank with
    its shard of that state (it was handed back whole, accepted, and the first step failed on the shapes)."""
    saved = run_distributed(_mid_run_save_body, 1, "uncollected")[0]
    run_distributed(_mid_run_resume_body, 2, "uncollected", saved)


def test_uncollected_instance_shard_at_another_world_size_is_refused() -> None:
    """Saved at two ranks the state is rank 0's shard: at one rank it cannot be the whole parameter's state, so
    the re-sharding refuses it (before: accepted, and the first step failed on the shapes)."""
    saved = run_distributed(_mid_run_save_body, 2, "uncollected")[0]
    run_distributed(_uncollected_refused_body, 1, saved)


# ------------------------------------------------------------------------------------------------------ helpers


def test_format_helpers_on_cpu() -> None:
    assert is_singleton_tensor(torch.tensor(1.0)) and not is_singleton_tensor(torch.ones(1))
    assert not is_singleton_tensor(1.0)
    assert param_id_runs({0: 0, 1: 0, 2: 1, 3: 2, 4: 2}) == 3
    full = {
        "state": {
            0: {"step": 2.0, "m": torch.ones(2, 2), "s": [torch.tensor(1.0), torch.tensor(2.0)]},
            1: {"step": 2.0, "m": torch.zeros(3), "s": [torch.tensor(1.0), torch.tensor(2.0)]},
            2: {"step": 2.0, "m": torch.full((2,), 5.0), "s": [torch.tensor(3.0), torch.tensor(4.0)]},
        },
        "param_groups": [{"lr": 0.5, "params": [0, 1, 2]}],
        "param_id_map": {0: 0, 1: 0, 2: 1},
        "uncollected_local_ids": [],
        "extra": "kept",
    }
    kept = copy.deepcopy(full)
    flat = flatten_optim_state_dict(full)
    assert _same(full, kept), "flatten_optim_state_dict modified its input"
    assert sorted(flat) == ["extra", "param_groups", "state"]
    assert flat["param_groups"] == [{"lr": 0.5, "params": [0, 1]}]
    assert torch.equal(flat["state"][0]["m"], torch.tensor([1.0, 1, 1, 1, 0, 0, 0]))
    assert flat["state"][0]["step"] == 2.0 and flat["state"][1]["s"][1].item() == 4.0
    check_param_counts_before_sharding(full, 2)
    with pytest.raises(ValueError, match="has 2 flat parameters .* the model has 3"):
        check_param_counts_before_sharding(full, 3)
    shared = {id(v) for e in full["state"].values() for v in e.values() if isinstance(v, (Tensor, list))}
    assert not any(id(v) in shared for e in flat["state"].values() for v in e.values()), "shares the input's values"
    # Bare 0-dim tensors of 0-dim parameters are their state (the format writes shared 0-dim state as per-rank
    # lists); a flat parameter of 0-dim parameters only keeps one element each. ``step`` stays shared.
    scalars = {
        "state": {0: {"step": torch.tensor(3.0), "m": torch.tensor(1.0)}, 1: {"step": 3.0, "m": torch.tensor(2.0)}},
        "param_groups": [{"lr": 0.5, "params": [0, 1]}],
        "param_id_map": {0: 0, 1: 0},
    }
    merged = flatten_optim_state_dict(scalars)["state"][0]
    assert torch.equal(merged["m"], torch.tensor([1.0, 2.0])) and torch.equal(merged["step"], torch.tensor(3.0))
    del full["state"][1]["m"]
    with pytest.raises(ValueError, match="state 'm' is a tensor for some parameters only"):
        flatten_optim_state_dict(full)


def test_resume_a_scalar_parameter_instance_saved_at_one_rank() -> None:
    """A flatten_parameters=False instance of one 0-dim parameter, saved at one rank (not sharded): its 0-dim Adam
    moments were gathered as per-rank lists, like a shared scalar, and the resume at two ranks (a 1-element shard)
    failed at the first step on the shapes (found by a fuzz, session 43). They are 0-dim tensors, as torch's."""
    saved = run_distributed(_mid_run_save_body, 1, "scalar")[0]
    moments = saved[1]["state"][2]
    assert all(isinstance(moments[k], Tensor) and moments[k].dim() == 0 for k in ("exp_avg", "exp_avg_sq")), moments
    run_distributed(_mid_run_resume_body, 2, "scalar", saved)
