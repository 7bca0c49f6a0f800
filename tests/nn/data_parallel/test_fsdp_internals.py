# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The internal objects of FullyShardedDataParallel (docs/architecture.rst): the unit, its frozen config, the checked
training-state transitions, and the link between a front and its unit across copies."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import TrainingState
from fairscale.nn.data_parallel._fsdp.unit import unit_of


def _nested() -> FSDP:
    torch.manual_seed(0)
    return FSDP(nn.Sequential(nn.Linear(4, 4), FSDP(nn.Linear(4, 4)), nn.Linear(4, 2)))


def _transitions_body(rank: int, world_size: int) -> None:
    model = _nested()
    unit = model._fsdp_unit
    assert unit_of(model) is unit and unit.owner is model
    with pytest.raises(RuntimeError, match="cannot go from IDLE to BACKWARD_POST"):
        unit.transition(TrainingState.BACKWARD_POST)  # a post-backward point without a pre-backward one
    assert model.training_state == TrainingState.IDLE  # a refused transition changes nothing
    with model.summon_full_params():
        with pytest.raises(RuntimeError, match="SUMMON_FULL_PARAMS"):
            model(torch.randn(2, 4))
        with pytest.raises(RuntimeError, match="cannot go from SUMMON_FULL_PARAMS to FORWARD"):
            unit.transition(TrainingState.FORWARD)
    # The lifecycle itself only makes legal moves: a training step ends with every unit idle.
    model(torch.randn(2, 4)).sum().backward()
    assert all(u.training_state == TrainingState.IDLE for u in unit.tree_units())


def test_training_state_transitions_are_checked() -> None:
    run_distributed(_transitions_body, 1)


def _config_body(rank: int, world_size: int) -> None:
    model = _nested()
    inner = model.module.module[1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        model._config.bucket_cap_mb = 0  # type: ignore[misc]
    # Upstream's attributes read the config, and assigning one replaces the config for every reader.
    assert model.bucket_cap_mb == 25 and model.world_size == 1 and model.mixed_precision is False
    model.bucket_cap_mb = 0
    assert model._fsdp_unit.config.bucket_cap_mb == 0
    model(torch.randn(2, 4)).sum().backward()
    tree = model._tree
    assert tree is not None and tree.bucketer.bucket_cap_mb == 0
    # reshard_after_forward is derived, not rewritten: the root (disable_reshard_on_root) keeps its parameters.
    assert model.reshard_after_forward is False and model._orig_reshard_after_forward is True
    assert inner.reshard_after_forward is True
    # .half()/.float() change the compute dtype by replacing the config too.
    model.half()
    assert model.compute_dtype == torch.float16 and model._fsdp_unit.config.compute_dtype == torch.float16


def test_config_is_frozen_and_attributes_write_through() -> None:
    run_distributed(_config_body, 1)


def _copy_body(rank: int, world_size: int) -> None:
    model = _nested()
    model(torch.randn(2, 4)).sum().backward()
    clone = copy.deepcopy(model)
    units = [m._fsdp_unit for m in clone.modules() if isinstance(m, FSDP)]
    assert [u.owner for u in units] == [m for m in clone.modules() if isinstance(m, FSDP)]
    assert all(u is not m._fsdp_unit for u, m in zip(units, (m for m in model.modules() if isinstance(m, FSDP))))
    assert clone._fsdp_unit.is_root is None  # a copy is initialised again at its first use
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(clone(x), model(x))


def test_copy_relinks_every_unit_to_its_own_module() -> None:
    run_distributed(_copy_body, 1)


def _tree_walk_body(rank: int, world_size: int) -> None:
    """tree_units() lists the units in modules() order, a module registered twice once, and skips None children."""
    torch.manual_seed(0)
    shared = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    shared[0].register_module("absent", None)  # a child registered as None (nn.Linear never iterates children)
    first = FSDP(nn.Sequential(nn.Linear(4, 4), shared))
    deep = FSDP(nn.Sequential(FSDP(nn.Linear(4, 4)), nn.Sequential(FSDP(nn.Linear(4, 4)))))
    model = FSDP(nn.Sequential(first, shared, deep))
    expected = [unit_of(m) for m in model.modules() if unit_of(m) is not None]
    assert len(expected) == 5
    assert model._fsdp_unit.tree_units() == expected
    assert deep._fsdp_unit.tree_units() == expected[2:]
    model(torch.randn(2, 4)).sum().backward()  # the walk also runs in every root forward and end of backward
    assert all(u.training_state == TrainingState.IDLE for u in expected)
    # Handle transitions stay checked too: a FULL handle cannot be asked for FULL again.
    handle = first._fsdp_unit.handles[0]
    from fairscale.nn.data_parallel._fsdp.state import HandleState

    with pytest.raises(RuntimeError, match="cannot go from SHARDED to ZERO2_SLICE"):
        handle.set_state(HandleState.ZERO2_SLICE)
    assert handle.state is HandleState.SHARDED


def test_tree_walk_matches_modules_order() -> None:
    run_distributed(_tree_walk_body, 1)
