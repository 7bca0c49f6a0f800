# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``fsdp_optim_utils.build_unflat_state_dict``: upstream's builder of the full optimizer state dict.

The expected outputs are what upstream 0.4.13's function returned for the same inputs (run as a black box on CPU):
padding removed per rank, pieces split into the original shapes, singleton state on each instance's last parameter,
``param_id_map`` with ``None`` for parameters without state, and ``original_sd`` updated in place.
"""

import copy
import functools
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel.fsdp_optim_utils import build_unflat_state_dict

ORIGINAL = {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}], "loss_scale": 7}


def _instances() -> List[Any]:
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    inner = FSDP(nn.Linear(3, 2))
    root = FSDP(nn.Sequential(nn.Linear(2, 3), inner))
    return [m for m in root.modules() if isinstance(m, FSDP)]  # root: weight (3, 2), bias (3); inner: (2, 3), (2)


def _values(out: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
    return {g: {k: v.tolist() if torch.is_tensor(v) else v for k, v in e.items()} for g, e in out["state"].items()}


def _one_rank() -> None:
    insts = _instances()
    original = copy.deepcopy(ORIGINAL)
    state = {0: {"exp_avg": [torch.arange(9.0)]}, 1: {"exp_avg": [torch.arange(8.0)]}}
    singles = {0: {"step": [torch.tensor(1.0)]}, 1: {"step": [torch.tensor(2.0)]}}
    out = build_unflat_state_dict(insts, [[[0], [0]]], state, singles, {}, original)
    assert out is original
    got = _values(out)
    assert got[0] == {"exp_avg": [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]}
    assert got[1]["exp_avg"] == [6.0, 7.0, 8.0] and got[1]["step"] == [torch.tensor(1.0)]
    assert got[2] == {"exp_avg": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]}
    assert got[3]["exp_avg"] == [6.0, 7.0] and got[3]["step"] == [torch.tensor(2.0)]
    assert out["param_groups"] == [{"lr": 0.1, "params": [0, 1, 2, 3]}] and out["loss_scale"] == 7
    assert out["param_id_map"] == {0: 0, 1: 0, 2: 1, 3: 1} and out["uncollected_local_ids"] == []


def _two_ranks_with_padding() -> None:
    state = {
        0: {"exp_avg": [torch.arange(5.0), torch.arange(10.0, 15.0)]},
        1: {"exp_avg": [torch.arange(4.0), torch.arange(10.0, 14.0)]},
    }
    out = build_unflat_state_dict(
        _instances(), [[[1], [0]], [[0], [0]]], state, {0: {}, 1: {}}, {}, copy.deepcopy(ORIGINAL)
    )
    assert _values(out) == {
        0: {"exp_avg": [[0.0, 1.0], [2.0, 3.0], [10.0, 11.0]]},
        1: {"exp_avg": [12.0, 13.0, 14.0]},
        2: {"exp_avg": [[0.0, 1.0, 2.0], [3.0, 10.0, 11.0]]},
        3: {"exp_avg": [12.0, 13.0]},
    }


def _uncollected_and_empty() -> None:
    uncollected = {1: {"exp_avg": torch.arange(8.0), "step": torch.tensor(5.0), "f": 1.5}}
    state = {0: {"exp_avg": [torch.arange(9.0)]}}
    out = build_unflat_state_dict(
        _instances(), [[[0], [0]]], state, {0: {}, 1: {}}, uncollected, copy.deepcopy(ORIGINAL)
    )
    got = _values(out)
    assert got[2] == {"exp_avg": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]}
    assert got[3] == {"exp_avg": [6.0, 7.0], "step": [torch.tensor(5.0)]}  # as upstream: "f" is dropped
    assert out["param_id_map"] == {0: 0, 1: 0, 2: 1, 3: 1} and out["uncollected_local_ids"] == [1]

    empty = build_unflat_state_dict(_instances(), [[[0], [0]]], {}, {}, {}, copy.deepcopy(ORIGINAL))
    assert empty["state"] == {} and empty["param_id_map"] == {0: None, 1: None, 2: None, 3: None}

    both = {1: {"exp_avg": [torch.arange(8.0)]}}
    with pytest.raises(ValueError, match="both gathered and uncollected") as info:
        build_unflat_state_dict(_instances(), [[[0], [0]]], both, {}, {1: {}}, copy.deepcopy(ORIGINAL))
    assert isinstance(info.value, AssertionError)  # upstream asserted
    with pytest.raises(ValueError, match="has 7 elements once unpadded"):
        build_unflat_state_dict(
            _instances(), [[[1], [0]]], {0: {"exp_avg": [torch.arange(8.0)]}}, {}, {}, {"param_groups": [{}]}
        )


def _world(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("one rank", _one_rank),
            ("two ranks' shards with padding", _two_ranks_with_padding),
            ("uncollected and empty state", _uncollected_and_empty),
        ]
    )


def test_build_unflat_state_dict_matches_upstream() -> None:
    run_distributed(functools.partial(_world), 1, timeout=60)
