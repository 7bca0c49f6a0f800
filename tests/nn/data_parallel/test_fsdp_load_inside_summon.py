# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``load_state_dict`` inside the instance's own ``summon_full_params()``, as upstream allowed.

fairseq's wav2vec2 fine-tuning loads its FSDP encoder layers one at a time that way (``with layer.summon_full_params():
layer.load_state_dict(layer_dict)``, then ``layer._reset_lazy_init()``); it was refused ("needs every FSDP instance
idle"). The load writes the summoned parameters, which the summon writes back on exit; a refused or failed load leaves
the model as it was. World size 2, compared with the same load made outside the summon.
"""

from typing import Callable, Dict, List

import pytest
import torch
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP


def _model(seed: int) -> FSDP:
    torch.manual_seed(seed)
    return FSDP(nn.Sequential(nn.Linear(4, 6), FSDP(nn.Linear(6, 6)), nn.BatchNorm1d(6), nn.Linear(6, 3)))


def _full(model: FSDP) -> Dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_equal(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for key in got:
        assert torch.equal(got[key], expected[key]), key


def _case_load_inside_summon_equals_load_outside(rank: int) -> None:
    source = _full(_model(1))
    outside = _model(2)
    outside.load_state_dict(source)
    inside = _model(2)
    with inside.summon_full_params():
        result = inside.load_state_dict(source)
    assert result.missing_keys == [] and result.unexpected_keys == []
    _assert_equal(_full(inside), _full(outside))
    # And it trains on from there like the other.
    for model in (inside, outside):
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
    _assert_equal(_full(inside), _full(outside))


def _case_inner_instance_then_reset(rank: int) -> None:
    # fairseq: an inner layer loads its own keys inside its summon, then forgets its lazy init.
    source = _model(1)
    layer_dict = {k: v.clone() for k, v in source.module[1].state_dict().items()}
    expected = _model(2)
    expected.module[1].load_state_dict(layer_dict)
    model = _model(2)
    layer = model.module[1]
    with layer.summon_full_params():
        layer.load_state_dict(layer_dict)
    layer._reset_lazy_init()
    _assert_equal(_full(model), _full(expected))


def _case_failed_load_leaves_the_model(rank: int) -> None:
    model = _model(2)
    before = _full(model)
    bad = _full(_model(1))
    bad["3.weight"] = torch.zeros(4, 4)  # wrong shape: nn.Module copies the other keys first, then raises
    with model.summon_full_params():
        with pytest.raises(RuntimeError, match="size mismatch"):
            model.load_state_dict(bad)
    _assert_equal(_full(model), before)


def _case_refused_where_the_load_would_be_lost(rank: int) -> None:
    model = _model(2)
    before = _full(model)
    source = _full(_model(1))
    with model.summon_full_params(volatile=True):
        with pytest.raises(RuntimeError, match="volatile"):
            model.load_state_dict(source)
    with model.summon_full_params(recurse=False):
        with pytest.raises(RuntimeError, match="recurse=True"):
            model.load_state_dict(source)
    _assert_equal(_full(model), before)


def _case_other_dict_on_one_rank(rank: int) -> None:
    """Found by a rank-disagreement review: outside a summon a different dict on one rank raises on every rank, but
    inside one each rank wrote back its slice of its own dict (the model was part one dict, part the other)."""
    model = _model(2)
    before = _full(model)
    source = {k: v + rank if v.is_floating_point() else v for k, v in _full(_model(1)).items()}  # rank 1's differs
    with model.summon_full_params():
        with pytest.raises(RuntimeError, match="the ranks loaded different full state dicts"):
            model.load_state_dict(source)
    _assert_equal(_full(model), before)
    layer = model.module[1]  # an inner instance in its own summon, as fairseq loads them
    with layer.summon_full_params():
        with pytest.raises(RuntimeError, match="the ranks loaded different full state dicts"):
            layer.load_state_dict({k[2:]: v for k, v in source.items() if k.startswith("1.")})
    _assert_equal(_full(model), before)


def _body(rank: int, world_size: int) -> None:
    cases: Dict[str, Callable[[], None]] = {
        "load_inside_summon_equals_load_outside": lambda: _case_load_inside_summon_equals_load_outside(rank),
        "inner_instance_then_reset": lambda: _case_inner_instance_then_reset(rank),
        "failed_load_leaves_the_model": lambda: _case_failed_load_leaves_the_model(rank),
        "refused_where_the_load_would_be_lost": lambda: _case_refused_where_the_load_would_be_lost(rank),
        "other_dict_on_one_rank": lambda: _case_other_dict_on_one_rank(rank),
    }
    run_cases(list(cases.items()))


def test_load_inside_summon() -> None:
    run_distributed(_body, 2, timeout=120)
