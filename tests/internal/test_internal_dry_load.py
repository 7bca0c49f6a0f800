# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The all-or-nothing load's dry run: what it refuses before anything is copied, and what it leaves to torch."""

import pickle

import pytest
import torch
from torch import nn

from fairscale.internal.dry_load import load_state_dict_all_or_nothing
from fairscale.optim._oss.dcp import _LoadedInPlace


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model[1].register_buffer("scratch", torch.zeros(2), persistent=False)
    return model


def test_a_meta_value_is_refused_before_anything_is_copied() -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v + 1 if v.is_floating_point() else v for k, v in before.items()}
    state["1.running_var"] = torch.empty(2, device="meta")  # after entries that fit
    with pytest.raises(RuntimeError, match="1.running_var: the state dict holds a meta tensor"):
        load_state_dict_all_or_nothing(model, state, True, False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_what_torch_loads_or_ignores_is_left_to_it() -> None:
    # assign=True puts meta tensors in place (nothing is copied): allowed, as torch allows it.
    model = _model()
    meta = {k: torch.empty_like(v, device="meta") for k, v in model.state_dict().items()}
    load_state_dict_all_or_nothing(model, meta, True, True)
    assert model[0].weight.is_meta
    # A value under a non-persistent buffer's name is ignored by torch (an unexpected key): not refused.
    model = _model()
    state = dict(model.state_dict())
    state["1.scratch"] = torch.empty(2, device="meta")
    result = load_state_dict_all_or_nothing(model, state, False, False)
    assert result.unexpected_keys == ["1.scratch"]
    # The dry run's hooks are gone afterwards.
    assert all(not m._load_state_dict_pre_hooks for m in model.modules())


def test_the_torch_2_3_dcp_dict_pickles_as_a_plain_dict() -> None:
    # torch.save of OSS's optimizer dict on torch 2.3 must not name fairscale's class (weights_only loads refuse it).
    loaded = pickle.loads(pickle.dumps(_LoadedInPlace({"state": {}, "param_groups": [{"lr": 0.1}]})))
    assert type(loaded) is dict and loaded == {"state": {}, "param_groups": [{"lr": 0.1}]}


def test_a_failed_assign_load_leaves_a_meta_model_as_it_was() -> None:
    # The dry run of an assign=True load put the state dict's tensors into the meta model (its tensors were not
    # swapped, so not put back): a load that then failed left the model partly assigned.
    source = _model()
    with torch.device("meta"):
        model = _model()
    state = dict(source.state_dict())
    state["2.weight"] = torch.zeros(2)  # unexpected key: the strict load fails
    with pytest.raises(RuntimeError, match="Unexpected key"):
        load_state_dict_all_or_nothing(model, state, True, True)
    assert all(t.is_meta for t in model.state_dict().values())
    del state["2.weight"]
    load_state_dict_all_or_nothing(model, state, True, True)
    assert model[0].weight.data_ptr() == source[0].weight.data_ptr()  # assigned, not copied


class _Counter(nn.Linear):
    """A module with extra state (a step count) that checks the value it is given."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.step = {"n": 0}

    def get_extra_state(self) -> dict:
        return self.step  # the live object: the dry run must copy it

    def set_extra_state(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise ValueError("bad extra state")
        self.step.update(state)


def test_a_failed_load_leaves_extra_state_as_it_was() -> None:
    # The dry run called set_extra_state for real: a load failing in a later module kept the rejected step count.
    model = nn.Sequential(_Counter(), nn.Linear(2, 2))
    state = dict(model.state_dict())
    state["0._extra_state"] = {"n": 123}
    state["1.weight"] = torch.zeros(3, 3)  # size mismatch after the extra state
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_state_dict_all_or_nothing(model, state, True, False)
    assert model[0].step == {"n": 0}
    assert "set_extra_state" not in model[0].__dict__
    # A bad value is still refused before anything is copied, and a good load sets it once.
    state["1.weight"] = torch.zeros(2, 2)
    state["0._extra_state"] = 5
    with pytest.raises(ValueError, match="bad extra state"):
        load_state_dict_all_or_nothing(model, state, True, False)
    assert not torch.equal(model[1].weight, torch.zeros(2, 2))
    state["0._extra_state"] = {"n": 7}
    load_state_dict_all_or_nothing(model, state, True, False)
    assert model[0].step == {"n": 7} and torch.equal(model[1].weight, torch.zeros(2, 2))
