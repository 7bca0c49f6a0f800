# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Checkpoint compatibility with upstream fairscale 0.4.13's OSS, through a fixture that upstream wrote.

``fixtures/oss_upstream_0.4.13.pt`` (see ``fixtures/README.md`` and ``fixtures/make_fixtures.py``) holds what
upstream's OSS produced on two gloo ranks: the parameter-to-rank assignment, each rank's shard, the consolidated
state dict and the trained parameters. This distribution's OSS replays the same run and must produce the same
assignment, the same dicts (structure, keys, values) and the same parameters, and it must load upstream's
consolidated dict at any world size.
"""

import copy
import os
from typing import Any, Dict, List

import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.optim import OSS

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "oss_upstream_0.4.13.pt")
OPTIMS = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam}


def _fixture() -> Dict[str, Any]:
    return torch.load(FIXTURE, weights_only=False)


# The model and data of fixtures/make_fixtures.py.
def _build_model(initial: Dict[str, torch.Tensor]) -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 5), nn.Linear(5, 2))
    model.load_state_dict(initial)
    model[2].bias.requires_grad_(False)
    return model


def _inputs(rank: int, step: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 12).view(4, 3) * (1 + rank) + 0.1 * step


def _param_groups(model: nn.Module, lr_head: float) -> List[Dict[str, Any]]:
    head = list(model[3].parameters())
    trunk = [p for p in model.parameters() if all(p is not h for h in head)]
    return [{"params": trunk}, {"params": head, "lr": lr_head}]


# The fixture's numbers were computed on another machine. Its float32 gradients are sums of products (Linear layers,
# summed losses, an all-reduce) that another CPU's kernels add in another order, so each value may differ by a few
# float32 ulps of the *terms* summed, which are about as large as the tensor's largest entry (small entries come
# from cancellation). Measured between two x86-64 machines: at most 10 ulps of the tensor's largest entry after
# three steps. Allowed: 64 ulps (float32 eps 1.19e-7) of the largest entry, no relative tolerance per element. A
# semantic difference (another gradient average, a missing momentum or bias correction, another learning rate)
# moves values by a large fraction of that scale.
_ULPS_OF_SCALE = 64


def _assert_close_across_machines(mine: torch.Tensor, theirs: torch.Tensor, msg: str) -> None:
    scale = theirs.abs().max().item() if theirs.numel() else 0.0
    atol = _ULPS_OF_SCALE * torch.finfo(theirs.dtype).eps * max(scale, torch.finfo(theirs.dtype).tiny)
    torch.testing.assert_close(mine, theirs, atol=atol, rtol=0.0, msg=msg)


_TORCH_VERSION_GROUP_KEYS = {"foreach", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay"}


def _assert_same_state_dict(ours: Dict[str, Any], theirs: Dict[str, Any], what: str) -> None:
    assert list(ours) == list(theirs), f"{what}: top-level keys {list(ours)} vs {list(theirs)}"
    assert len(ours["param_groups"]) == len(theirs["param_groups"]), f"{what}: number of param_groups"
    for i, (mine, recorded) in enumerate(zip(ours["param_groups"], theirs["param_groups"])):
        # Keys torch's optimizers added over its versions (torch 2.1 has no "fused" in SGD, say): only those may be
        # missing on one side; every other key, and the values of the common ones, must match.
        assert set(mine) ^ set(recorded) <= _TORCH_VERSION_GROUP_KEYS, f"{what}: keys of param_groups[{i}]"
        common = set(mine) & set(recorded)
        assert {k: mine[k] for k in common} == {k: recorded[k] for k in common}, f"{what}: param_groups[{i}] differ"
    assert list(ours["state"]) == list(theirs["state"]), f"{what}: state keys {list(ours['state'])}"
    for key, entry in theirs["state"].items():
        assert list(ours["state"][key]) == list(entry), f"{what}: entry {key} keys"
        for name, value in entry.items():
            mine = ours["state"][key][name]
            assert type(mine) is type(value), f"{what}: {key}/{name} type"
            if isinstance(value, torch.Tensor):
                assert mine.dtype == value.dtype and mine.shape == value.shape, f"{what}: {key}/{name}"
                if value.is_floating_point():
                    _assert_close_across_machines(mine, value, f"{what}: {key}/{name}")
                else:
                    assert torch.equal(mine, value), f"{what}: {key}/{name}"


def _replay_case(rank: int, world_size: int, fixture: Dict[str, Any], name: str) -> None:
    case = fixture["cases"][name]
    model = _build_model(fixture["initial_model"])
    oss = OSS(_param_groups(model, case["lr_head"]), OPTIMS[case["optim"]], **case["kwargs"])
    index = {id(p): i for i, p in enumerate(model.parameters())}
    owned = [[index[id(p)] for g in oss.partition_parameters()[r] for p in g["params"]] for r in range(world_size)]
    assert owned == case["owned"], f"parameter-to-rank assignment {owned} vs upstream {case['owned']}"
    for step in range(fixture["steps"]):
        oss.zero_grad()
        model(_inputs(rank, step)).pow(2).sum().backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world_size
        oss.step()
    _assert_same_state_dict(oss.optim.state_dict(), case["shards"][rank], f"{name} shard of rank {rank}")
    recipient = fixture["recipient_rank"]
    oss.consolidate_state_dict(recipient_rank=recipient)
    if rank == recipient:
        _assert_same_state_dict(oss.state_dict(), case["consolidated"], f"{name} consolidated")
    for mine, theirs in zip(model.parameters(), case["params_after"]):
        _assert_close_across_machines(mine.detach(), theirs, f"{name} parameters after training")


def _replay_body(rank: int, world_size: int) -> None:
    fixture = _fixture()
    assert fixture["world_size"] == world_size and fixture["fairscale_version"] == "0.4.13"
    run_cases([(name, lambda n=name: _replay_case(rank, world_size, fixture, n)) for name in fixture["cases"]])


def test_same_partition_and_state_dicts_as_upstream() -> None:
    run_distributed(_replay_body, 2)


def _load_case(rank: int, world_size: int, fixture: Dict[str, Any], name: str) -> None:
    """Load upstream's consolidated dict, take one more step, compare with a plain torch optimizer."""
    case = fixture["cases"][name]
    optim_cls = OPTIMS[case["optim"]]
    consolidated = case["consolidated"]
    model = _build_model(fixture["initial_model"])
    model.load_state_dict(dict(zip(fixture["initial_model"], case["params_after"])))
    ref = copy.deepcopy(model)
    oss = OSS(_param_groups(model, 9.0), optim_cls, lr=7.0)
    oss.load_state_dict(copy.deepcopy(consolidated))
    if world_size == fixture["world_size"]:
        _assert_same_state_dict(oss.optim.state_dict(), case["shards"][rank], f"{name} loaded shard")
    ref_opt = optim_cls(_param_groups(ref, 9.0), lr=7.0)
    ref_opt.load_state_dict(copy.deepcopy(consolidated))
    step = fixture["steps"]
    for net, opt in ((model, oss), (ref, ref_opt)):
        opt.zero_grad()
        for r in range(fixture["world_size"]):
            (net(_inputs(r, step)).pow(2).sum() / fixture["world_size"]).backward()
        opt.step()
    for mine, theirs in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(mine.detach(), theirs.detach(), atol=1e-6, rtol=1e-5)
    # And what we save from it is again upstream-shaped.
    saved = oss.state_dict(all_ranks=True)
    _assert_same_state_dict(saved, ref_opt.state_dict(), f"{name} saved after loading")


def _load_body(rank: int, world_size: int) -> None:
    fixture = _fixture()
    run_cases([(name, lambda n=name: _load_case(rank, world_size, fixture, n)) for name in fixture["cases"]])


def test_load_upstream_consolidated_state_dict() -> None:
    for world_size in (1, 2, 4):
        run_distributed(_load_body, world_size)
