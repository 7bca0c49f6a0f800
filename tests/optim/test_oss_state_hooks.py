# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""torch's optimizer state-dict hooks registered on OSS see, and may replace, the whole dict, as on torch's optimizer.

A post hook saw no per-parameter state and its edits were not in ``OSS.state_dict()``; a load pre hook ran after the
wrapped optimizer had loaded its shard (found by a fuzz of OSS, session 44). Two gloo ranks; torch's Adam over the
same parameters is the reference.
"""

from typing import Any, Dict, List

import torch
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.optim import OSS

WORLD = 2
TIMEOUT = 120.0


def _trained(optimizer_of) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = optimizer_of(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _oss(params: Any) -> OSS:
    return OSS(params, optim=torch.optim.Adam, lr=0.1)


def _case_state_dict_post_hook_sees_and_changes_the_whole_dict() -> None:
    seen: List[int] = []

    def to_bf16(optimizer: Any, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        seen.append(len(state_dict["state"]))
        for entry in state_dict["state"].values():
            entry["exp_avg"] = entry["exp_avg"].to(torch.bfloat16)
        return state_dict

    _, reference = _trained(lambda p: torch.optim.Adam(p, lr=0.1))
    reference.register_state_dict_post_hook(to_bf16)
    want = reference.state_dict()
    _, optimizer = _trained(_oss)
    optimizer.register_state_dict_post_hook(to_bf16)
    got = optimizer.state_dict(all_ranks=True)
    assert seen == [4, 4], seen  # the reference's call, then OSS's: every parameter's state
    assert sorted(got["state"]) == sorted(want["state"])
    for index, entry in want["state"].items():
        assert got["state"][index]["exp_avg"].dtype == torch.bfloat16
        torch.testing.assert_close(got["state"][index]["exp_avg"], entry["exp_avg"])


def _case_load_pre_hook_changes_what_is_loaded() -> None:
    calls: List[str] = []

    def zero_moments(optimizer: Any, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        calls.append(f"pre {len(state_dict['state'])}")
        fresh = {"param_groups": state_dict["param_groups"], "state": {}}
        for index, entry in state_dict["state"].items():
            fresh["state"][index] = dict(entry, exp_avg=torch.zeros_like(entry["exp_avg"]))
        return fresh

    _, source = _trained(_oss)
    saved = source.state_dict(all_ranks=True)
    _, optimizer = _trained(_oss)
    optimizer.register_load_state_dict_pre_hook(zero_moments)
    optimizer.register_load_state_dict_post_hook(lambda opt: calls.append("post"))
    optimizer.load_state_dict(saved)
    assert calls == ["pre 4", "post"], calls
    owned = [p for group in optimizer.optim.param_groups for p in group["params"]]
    assert owned  # this rank owns some parameters
    for p in owned:
        state = optimizer.optim.state[p]
        assert torch.count_nonzero(state["exp_avg"]) == 0
        assert torch.count_nonzero(state["exp_avg_sq"]) > 0  # the rest of the dict was loaded


def _body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("state_dict post hook", _case_state_dict_post_hook_sees_and_changes_the_whole_dict),
            ("load pre hook", _case_load_pre_hook_changes_what_is_loaded),
        ]
    )


def test_oss_state_dict_hooks() -> None:
    run_distributed(_body, WORLD, timeout=TIMEOUT)
