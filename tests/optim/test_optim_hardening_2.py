# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""fairscale.optim under input that used to hang, crash late or train silently wrong (second probe).

* OSS: ``consolidate_state_dict`` with another ``recipient_rank`` on each rank hung; ranks built with another
  optimizer class or other hyper-parameters (or adding a group with other ones) trained apart silently; a state dict
  of another optimizer class raised from deep inside torch after part of it was loaded, or was accepted and ignored;
  badly typed state dicts gave ``AttributeError``; ``clip_grad_norm`` accepted a negative or NaN ``max_norm`` and
  ``norm_type`` 0 or ``-inf``, and clipped silently apart when one rank passed another ``norm_type`` or
  ``max_norm``.
* AdaScale accepted an infinite scale, a fractional accumulation count and smoothing factors outside ``[0, 1)``,
  loaded a plain optimizer's state dict only to fail at the next ``gain()``, and hung when one rank changed its
  accumulation count.
* LayerwiseGradientScaler scaled or unscaled twice when its calls came out of order, and divided by a scale of 0.
* GradScaler / ShardedGradScaler accepted an ``init_scale`` of 0 or below and turned the weights into NaN.

Multi-rank bodies run on real gloo worlds and return each rank's message, so the tests see every rank's error.
"""

import copy
import functools
import math
import re
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.device import device_generic_amp_scaler
from fairscale.fair_dev.testing.testing import SGDWithPausingCompute
from fairscale.optim import OSS, AdaScale
from fairscale.optim._oss.describe import declared_hyper_parameters
from fairscale.optim.grad_scaler import GradScaler, ShardedGradScaler
from fairscale.optim.layerwise_gradient_scaler import LayerwiseGradientScaler

# Short: several of the failures these tests guard against were hangs.
TIMEOUT = 60.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model: nn.Module, oss: OSS, rank: int, world_size: int, steps: range) -> None:
    for step in steps:
        oss.zero_grad()
        model(_data(step, rank)).pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        oss.step()


def _same(a: Any, b: Any) -> bool:
    """Nested equality with exact tensor comparison."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _snapshot(oss: OSS) -> Tuple[Any, Any]:
    """The wrapped optimizer's state dict and OSS's hyper-parameters, deep-copied."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in oss.param_groups]
    return copy.deepcopy(oss.optim.state_dict()), copy.deepcopy(groups)


# ------------------------------------------------------------------------------------------------------------------
# OSS.consolidate_state_dict with another recipient on each rank


def _recipient_body(rank: int, world_size: int) -> str:
    model = _model()
    oss = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    _train(model, oss, rank, world_size, range(1))
    try:
        oss.consolidate_state_dict(recipient_rank=rank)
        message = "no error"
    except RanksDisagreeError as e:
        message = str(e)
    # Nothing was gathered, and the ranks are in step: an agreed recipient works as before.
    oss.consolidate_state_dict(recipient_rank=1)
    if rank == 1:
        assert sorted(oss.state_dict()["state"]) == [0, 1, 2, 3]
    return message


def test_consolidate_with_another_recipient_on_each_rank_raises_on_every_rank() -> None:
    messages = run_distributed(_recipient_body, 2, timeout=TIMEOUT)
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("OSS.consolidate_state_dict: the recipient rank"), messages[0]
    assert "('recipient_rank', 0) vs ('recipient_rank', 1)" in messages[0]


# ------------------------------------------------------------------------------------------------------------------
# OSS.load_state_dict of different dicts on different ranks


def _different_dicts_body(rank: int, world_size: int) -> List[str]:
    model = _model()
    oss = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    _train(model, oss, rank, world_size, range(1))
    saved = _trained_state(torch.optim.Adam, 0, world_size)  # the same on every rank
    before = _snapshot(oss)
    messages = []
    # Another learning rate on rank 1: loaded apart silently before (each rank trained with its own).
    other_lr = copy.deepcopy(saved)
    if rank == 1:
        other_lr["param_groups"][0]["lr"] = 0.5
    with pytest.raises(RanksDisagreeError) as info:
        oss.load_state_dict(other_lr)
    messages.append(str(info.value))
    # State that fails the checks on rank 1 only: rank 0 used to load it and go on.
    bad_shape = copy.deepcopy(saved)
    if rank == 1:
        bad_shape["state"][0]["exp_avg"] = torch.zeros(3)
    with pytest.raises((RuntimeError, ValueError)) as failure:
        oss.load_state_dict(bad_shape)
    messages.append(type(failure.value).__name__)
    assert _same(_snapshot(oss), before), "a refused load changed the optimizer"
    # The same dict on every rank loads, also a second time (a load empties the entries of the other ranks'
    # parameters in the caller's dict, so the ranks' copies differ there afterwards).
    same = copy.deepcopy(saved)
    oss.load_state_dict(same)
    oss.load_state_dict(same)
    assert oss.param_groups[0]["lr"] == saved["param_groups"][0]["lr"]
    return messages


def test_ranks_loading_different_state_dicts_raise_on_every_rank() -> None:
    results = run_distributed(_different_dicts_body, 2, timeout=TIMEOUT)
    assert results[0][0] == results[1][0] and "('group 0', 'lr', '0.01') vs ('group 0', 'lr', '0.5')" in results[0][0]
    # Rank 1 raises its own check's error, rank 0 names rank 1's failure.
    assert results[0][1] == "RuntimeError" and results[1][1] == "FairscaleValueError", results


# ------------------------------------------------------------------------------------------------------------------
# OSS.load_state_dict of another optimizer's state dict


def _trained_state(optim: Any, rank: int, world_size: int, **kwargs: Any) -> Dict[str, Any]:
    model = _model()
    oss = OSS(model.parameters(), optim=optim, lr=0.01, **kwargs)
    _train(model, oss, rank, world_size, range(2))
    return copy.deepcopy(oss.state_dict(all_ranks=True))


def _foreign_state_body(rank: int, world_size: int, case: str) -> str:
    """Load a dict that does not fit (``state``), then one of the same class that does (``valid``): the checks must
    not refuse valid checkpoints, AdamW's into Adam and amsgrad state included."""
    if case == "sgd_into_adam":
        state, target, kwargs = _trained_state(torch.optim.SGD, rank, world_size, momentum=0.9), torch.optim.Adam, {}
        valid = _trained_state(torch.optim.AdamW, rank, world_size)  # the same state names as Adam's
    elif case == "plain_sgd_into_adam":  # no per-parameter state at all: only the groups tell
        state, target, kwargs = _trained_state(torch.optim.SGD, rank, world_size), torch.optim.Adam, {}
        valid = _trained_state(torch.optim.Adam, rank, world_size)
    elif case == "adam_into_sgd":
        state, target, kwargs = _trained_state(torch.optim.Adam, rank, world_size), torch.optim.SGD, {"momentum": 0.9}
        valid = _trained_state(torch.optim.SGD, rank, world_size, momentum=0.9, nesterov=True)
    elif case == "step_missing":
        valid, target, kwargs = _trained_state(torch.optim.Adam, rank, world_size), torch.optim.Adam, {}
        state = copy.deepcopy(valid)
        for entry in state["state"].values():
            del entry["step"]
    elif case == "amsgrad_moment_missing":
        valid = _trained_state(torch.optim.Adam, rank, world_size, amsgrad=True)
        target, kwargs = torch.optim.Adam, {"amsgrad": True}
        state = copy.deepcopy(valid)
        del state["state"][2]["max_exp_avg_sq"]
    else:  # "rmsprop_step_missing": a class whose state names OSS does not know; torch's loader raises KeyError
        valid, target, kwargs = _trained_state(torch.optim.RMSprop, rank, world_size), torch.optim.RMSprop, {}
        state = copy.deepcopy(valid)
        for entry in state["state"].values():
            del entry["step"]

    model, twin_model = _model(), _model()
    oss = OSS(model.parameters(), optim=target, lr=0.05, **kwargs)
    twin = OSS(twin_model.parameters(), optim=target, lr=0.05, **kwargs)
    _train(model, oss, rank, world_size, range(1))
    _train(twin_model, twin, rank, world_size, range(1))
    before = _snapshot(oss)
    try:
        oss.load_state_dict(state)
        message = "no error"
    except ValueError as e:
        message = f"{str(e)} | caused by {type(e.__cause__).__name__}"
    assert _same(_snapshot(oss), before), "a refused state dict changes nothing"
    # And training goes on exactly as with an optimizer that never saw the dict.
    _train(model, oss, rank, world_size, range(1, 3))
    _train(twin_model, twin, rank, world_size, range(1, 3))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))
    oss.load_state_dict(copy.deepcopy(valid))  # as upstream, the load empties the entries this rank does not own
    assert oss.param_groups[0]["lr"] == 0.01 and _same(oss.state_dict(all_ranks=True)["state"], valid["state"])
    _train(model, oss, rank, world_size, range(3, 4))
    return message


@pytest.mark.parametrize(
    "case,expected",
    [
        (
            "sgd_into_adam",
            "the state of parameter 0 holds ['momentum_buffer'], which torch.optim.adam.Adam does not use",
        ),
        ("plain_sgd_into_adam", "parameter group 0 of the state dict has no ['betas', 'eps']"),
        (
            "adam_into_sgd",
            "the state of parameter 0 holds ['exp_avg', 'exp_avg_sq', 'step'], which torch.optim.sgd.SGD does not use",
        ),
        ("step_missing", "the state of parameter 0 has no ['step']"),
        ("amsgrad_moment_missing", "the state of parameter 2 has no ['max_exp_avg_sq']"),
        ("rmsprop_step_missing", "could not load its part of the state dict (KeyError: 'step')"),
    ],
)
def test_state_dict_of_another_optimizer_is_refused_and_changes_nothing(case: str, expected: str) -> None:
    if case == "rmsprop_step_missing" and _torch_loads_rmsprop_without_step():
        pytest.skip(
            f"torch {torch.__version__}'s own RMSprop loader accepts a state without 'step' (OSS knows no names)"
        )
    messages = run_distributed(_foreign_state_body, 2, case, timeout=TIMEOUT)
    assert messages[0] == messages[1], messages
    if case == "plain_sgd_into_adam" and _plain_sgd_keeps_a_momentum_buffer():
        # Older torch (2.1) keeps momentum_buffer=None per parameter even without momentum: the state tells first.
        expected = "the state of parameter 0 holds ['momentum_buffer'], which torch.optim.adam.Adam does not use"
    assert expected in messages[0], messages[0]
    assert messages[0].endswith("KeyError" if case == "rmsprop_step_missing" else "NoneType")


def _plain_sgd_keeps_a_momentum_buffer() -> bool:
    p = nn.Parameter(torch.ones(1))
    p.grad = torch.ones(1)
    sgd = torch.optim.SGD([p], lr=0.1)
    sgd.step()
    return bool(sgd.state_dict()["state"])


def _failed_load_body(rank: int, world_size: int, case: str) -> str:
    """A load that fails on one rank only (or on every rank) leaves the caller's dict intact on every rank."""
    valid = _trained_state(torch.optim.RMSprop, rank, world_size)
    state = copy.deepcopy(valid)
    if case == "step_missing_on_one_parameter":
        del state["state"][0]["step"]  # torch's RMSprop loader fails on the rank that owns parameter 0 only
    else:
        state["state"][3]["step"] = "x"
    given = copy.deepcopy(state)
    model = _model()
    oss = OSS(model.parameters(), optim=torch.optim.RMSprop, lr=0.05)
    _train(model, oss, rank, world_size, range(1))
    before = _snapshot(oss)
    try:
        oss.load_state_dict(state)
        message = "no error"
    except (ValueError, RuntimeError) as e:
        message = f"{type(e).__name__}: {e}"
    # Before: the ranks whose own load went through had emptied the entries they do not own in the caller's dict.
    assert _same(state, given), "a failed load changes the caller's dict"
    assert _same(_snapshot(oss), before), "a failed load changes the optimizer"
    return message


@pytest.mark.parametrize("case", ["step_missing_on_one_parameter", "step_not_a_number"])
def test_a_failed_load_leaves_the_dict_intact_on_every_rank(case: str) -> None:
    if case == "step_missing_on_one_parameter" and _torch_loads_rmsprop_without_step():
        pytest.skip(f"torch {torch.__version__}'s own RMSprop loader accepts a state without 'step'")
    messages = run_distributed(_failed_load_body, 2, case, timeout=TIMEOUT)
    assert all(m != "no error" for m in messages), messages
    if case == "step_not_a_number":
        # Before: "could not convert string to float: '<generator object ...>'" from inside torch, on one rank.
        for m in messages:
            assert "state 'step' of parameter 3 is 'x', but it must be a number or a one-element tensor" in m, m


def _torch_loads_rmsprop_without_step() -> bool:
    p = nn.Parameter(torch.ones(1))
    p.grad = torch.ones(1)
    rmsprop = torch.optim.RMSprop([p], lr=0.1)
    rmsprop.step()
    state = copy.deepcopy(rmsprop.state_dict())
    del state["state"][0]["step"]
    try:
        torch.optim.RMSprop([nn.Parameter(torch.ones(1))], lr=0.1).load_state_dict(state)
    except KeyError:
        return False
    return True


def _badly_typed_body(rank: int, world_size: int) -> List[str]:
    model = _model()
    oss = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    _train(model, oss, rank, world_size, range(1))
    good = copy.deepcopy(oss.state_dict(all_ranks=True))
    before = _snapshot(oss)
    messages = []
    for key, value in [
        ("state", [1, 2]),
        ("param_groups", {"a": 1}),
        ("param_groups", ["x"]),
        ("param_groups", [{**good["param_groups"][0], "params": "0123"}]),
    ]:
        bad = {**copy.deepcopy(good), key: value}
        with pytest.raises(TypeError) as info:
            oss.load_state_dict(bad)
        messages.append(str(info.value))
        assert _same(_snapshot(oss), before)
    return messages


def test_badly_typed_state_dicts_raise_type_error() -> None:
    messages = run_distributed(_badly_typed_body, 2, timeout=TIMEOUT)
    assert messages[0] == messages[1]
    state, groups, group, params = messages[0]
    assert "'state' must be a dict of per-parameter states, got list" in state
    assert "'param_groups' must be a list of parameter groups, got dict" in groups
    assert "parameter group 0 of the state dict must be a dict, got str" in group
    assert "'params' of parameter group 0 of the state dict must be a list of parameter indices, got str" in params


# ------------------------------------------------------------------------------------------------------------------
# OSS.clip_grad_norm arguments


def _clip_body(rank: int, world_size: int) -> List[str]:
    model = _model()
    oss = OSS(model.parameters(), lr=0.1)
    model(_data(0, 0)).pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    messages = []
    for max_norm, norm_type in [(-1.0, 2.0), (math.nan, 2.0), (1.0, 0), (1.0, -1.0), (1.0, -math.inf), (1.0, math.nan)]:
        with pytest.raises(ValueError) as info:
            oss.clip_grad_norm(max_norm, norm_type=norm_type)
        messages.append(str(info.value))
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads)), "nothing clipped"
    # Valid arguments as before: torch's total norm, and the owned gradients clipped to it.
    reference = _model()
    reference(_data(0, 0)).pow(2).mean().backward()
    for norm_type in (1.0, 2, math.inf):
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9, norm_type=norm_type)
        assert torch.allclose(oss.clip_grad_norm(1e9, norm_type=norm_type), want)
    return messages


def test_clip_grad_norm_refuses_negative_or_nan_max_norm_and_non_positive_norm_type() -> None:
    messages = run_distributed(_clip_body, 2, timeout=TIMEOUT)
    assert messages[0] == messages[1]
    assert messages[0][0] == "OSS.clip_grad_norm: max_norm must be a number >= 0, got -1.0"
    assert messages[0][1] == "OSS.clip_grad_norm: max_norm must be a number >= 0, got nan"
    for message, shown in zip(messages[0][2:], ["0.0", "-1.0", "-inf", "nan"]):
        assert message.startswith("OSS.clip_grad_norm: norm_type must be a positive number or inf"), message
        assert f"got {shown};" in message


def _clip_disagree_body(rank: int, world_size: int, case: str) -> str:
    model = _model()
    oss = OSS(model.parameters(), lr=0.1)
    model(_data(0, rank)).pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    max_norm, norm_type = 1e-3, 2.0
    if rank == 1:
        if case == "norm_type":  # its part would have joined a sum as a max
            norm_type = math.inf
        else:  # it would have clipped its shard by another factor
            max_norm = 1e-2
    try:
        oss.clip_grad_norm(max_norm, norm_type=norm_type)
        message = "no error"
    except RanksDisagreeError as e:
        message = str(e)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads)), "nothing clipped"
    # The ranks are still in step: the same call on every rank clips to the norm of all gradients.
    total = oss.clip_grad_norm(1e-3, norm_type=2.0)
    dist.all_reduce(total)
    assert total > 0
    return message


@pytest.mark.parametrize(
    "case,where",
    [
        ("norm_type", "('norm_type', 2.0) vs ('norm_type', inf)"),
        ("max_norm", "('max_norm', 0.001) vs ('max_norm', 0.01)"),
    ],
)
def test_clip_grad_norm_with_another_norm_type_or_max_norm_on_one_rank(case: str, where: str) -> None:
    messages = run_distributed(_clip_disagree_body, 2, case, timeout=TIMEOUT)
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("OSS.clip_grad_norm: (norm_type, max_norm) differ between ranks"), messages[0]
    assert where in messages[0], messages[0]


# ------------------------------------------------------------------------------------------------------------------
# OSS construction and add_param_group with another optimizer or other hyper-parameters on one rank


def _construct_body(rank: int, world_size: int, case: str) -> str:
    model = _model()
    params: Any = model.parameters()
    optim: Any = torch.optim.SGD
    kwargs: Dict[str, Any] = {"lr": 0.1}
    if case == "lr":
        kwargs["lr"] = 0.1 * (rank + 1)
    elif case == "optim":
        optim = torch.optim.SGD if rank == 0 else torch.optim.Adam
    elif case == "group_lr":
        params = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01 * (rank + 1)}]
    elif case == "tensor_lr":  # a tensor's repr rounds to 4 digits: compared by value
        # Equal values, tensors and factories included, are accepted.
        OSS(model.parameters(), optim=functools.partial(torch.optim.SGD, momentum=0.9), lr=torch.tensor(0.1))
        kwargs["lr"] = torch.tensor(0.1 + 1e-6 * rank)
    try:
        OSS(params, optim=optim, **kwargs)
    except RanksDisagreeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "case,where",
    [
        ("lr", "('group 0 hyper-parameters', (('lr', '0.1'),)) vs ('group 0 hyper-parameters', (('lr', '0.2'),))"),
        ("optim", "('argument optim', 'torch.optim.sgd.SGD') vs ('argument optim', 'torch.optim.adam.Adam')"),
        ("group_lr", "('group 1 hyper-parameters', (('lr', '0.01'),)) vs ('group 1 hyper-parameters', (('lr', '0.02')"),
        ("tensor_lr", "tensor(0.10000000149011612, dtype=torch.float32)'),)) vs"),
    ],
)
def test_construction_with_another_optimizer_or_hyper_parameters_on_one_rank(case: str, where: str) -> None:
    messages = run_distributed(_construct_body, 2, case, timeout=TIMEOUT)
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("OSS: the parameters (shape, dtype, requires_grad), the optimizer, hyper-parameters")
    assert where in messages[0], messages[0]


def _add_group_body(rank: int, world_size: int) -> List[str]:
    model = _model()
    oss = OSS(model[0].parameters(), lr=0.1)
    messages = []
    try:
        oss.add_param_group({"params": model[2].parameters(), "lr": 0.1 * (rank + 1)})
    except RanksDisagreeError as e:
        messages.append(str(e))
    assert len(oss.param_groups) == 1 and len(oss.optim.param_groups) == 1, "a refused group is not added"
    for bad, error in [({"lr": 0.2}, ValueError), ([model[2].weight], TypeError)]:
        with pytest.raises(error) as info:
            oss.add_param_group(bad)  # type: ignore[arg-type]
        messages.append(str(info.value))
    # The same group on every rank is added as before.
    oss.add_param_group({"params": model[2].parameters(), "lr": 0.05})
    assert [g["lr"] for g in oss.param_groups] == [0.1, 0.05]
    _train(model, oss, rank, world_size, range(1))
    return messages


def test_add_param_group_with_other_hyper_parameters_or_without_params() -> None:
    messages = run_distributed(_add_group_body, 2, timeout=TIMEOUT)
    assert messages[0] == messages[1], messages
    disagree, no_params, not_dict = messages[0]
    assert disagree.startswith("OSS.add_param_group: the parameters (shape, dtype, requires_grad) and hyper-parameters")
    assert "('group 1 hyper-parameters', (('lr', '0.1'),)) vs ('group 1 hyper-parameters', (('lr', '0.2'),))" in (
        disagree
    )
    assert no_params.startswith("OSS.add_param_group: the group has no 'params' entry (it has ['lr'])")
    assert not_dict.startswith("OSS.add_param_group expects a dict")


def _undeclared_per_rank_body(rank: int, world_size: int) -> Tuple[List[float], List[str]]:
    # upstream's tests pass each process's `rank` to SGDWithPausingCompute through OSS (it takes it by **kwargs):
    # a keyword the optimizer does not declare may differ between ranks; SGD's own `lr` still may not.
    model = _model()
    oss = OSS(model[0].parameters(), optim=SGDWithPausingCompute, lr=0.1, rank=rank)
    oss.add_param_group({"params": model[2].parameters(), "rank": rank, "tag": f"rank {rank}"})
    _train(model, oss, rank, world_size, range(2))
    weights = [p.detach().sum().item() for p in model.parameters()]
    messages = []
    for kwargs in ({"lr": 0.1 * (rank + 1), "rank": rank}, {"lr": 0.1, "momentum": 0.5 * rank}):
        try:
            OSS(_model().parameters(), optim=SGDWithPausingCompute, **kwargs)
        except RanksDisagreeError as e:
            messages.append(str(e))
    return weights, messages


def test_undeclared_per_rank_keywords_may_differ() -> None:
    results = run_distributed(_undeclared_per_rank_body, 2, timeout=TIMEOUT)
    (weights0, messages0), (weights1, messages1) = results
    assert weights0 == weights1  # the replicas trained alike: the per-rank keyword changed nothing shared
    assert messages0 == messages1 and len(messages0) == 2, messages0
    assert "(('lr', '0.1')" in messages0[0] and "(('lr', '0.2')" in messages0[0], messages0[0]
    assert "('momentum', '0.0')" in messages0[1] and "('momentum', '0.5')" in messages0[1], messages0[1]
    assert "'rank'" not in messages0[0], messages0[0]


def test_declared_hyper_parameters() -> None:
    sgd = declared_hyper_parameters(torch.optim.SGD)
    assert sgd is not None and {"lr", "momentum", "weight_decay"} <= sgd and "params" not in sgd
    assert declared_hyper_parameters(SGDWithPausingCompute) == sgd  # a subclass passing **kwargs on declares SGD's
    partial = declared_hyper_parameters(functools.partial(torch.optim.Adam, lr=1.0))
    assert partial is not None and {"betas", "eps"} <= partial
    # Nothing declared by name: every key is compared, as before.
    assert declared_hyper_parameters(lambda params, **kw: torch.optim.SGD(params, **kw)) is None
    assert declared_hyper_parameters(_KwargsOnly) is None


class _KwargsOnly(torch.optim.Optimizer):
    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, kwargs)


def test_hyper_parameter_descriptions_are_exact_and_free_of_addresses() -> None:
    from fairscale.optim._oss.describe import comparable as _comparable

    assert _comparable(torch.tensor(0.1)) != _comparable(torch.tensor(0.1 + 1e-6))
    assert _comparable(0.1) == "0.1"

    def schedule() -> None:  # pragma: no cover - described, never called
        pass

    # Each process has its own addresses: a function's repr without its address compares equal across ranks.
    assert re.search("0x[0-9a-fA-F]", _comparable(schedule)) is None and "schedule at 0x...>" in _comparable(schedule)
    assert _comparable(torch.zeros(100)) == "tensor(shape=(100,), dtype=torch.float32)"


# ------------------------------------------------------------------------------------------------------------------
# AdaScale


def _adascale(**kwargs: Any) -> Tuple[nn.Linear, AdaScale]:
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    return model, AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), world_size=1, **kwargs)


def _accumulate(model: nn.Linear, optim: AdaScale, steps: int = 2) -> None:
    for step in range(steps):
        optim.zero_grad()
        for micro in range(2):
            x = torch.randn(3, 2, generator=torch.Generator().manual_seed(10 * step + micro))
            (model(x).pow(2).mean() / 2).backward()
        optim.step()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_gradients_to_accumulate": 2, "scale": math.inf}, "Scale must be a finite number >= 1, got inf"),
        ({"num_gradients_to_accumulate": 2.5}, "num_gradients_to_accumulate must be a whole number"),
        ({"num_gradients_to_accumulate": 2, "smoothing": 2.0}, r"smoothing must be in \[0, 1\)"),
        ({"num_gradients_to_accumulate": 2, "smoothing": -1.0}, r"smoothing must be in \[0, 1\)"),
        ({"num_gradients_to_accumulate": 2, "smoothing": math.nan}, r"smoothing must be in \[0, 1\)"),
        ({"num_gradients_to_accumulate": 2, "smoothing": 1.0}, "1 is allowed with debias_ewma=False only"),
    ],
)
def test_adascale_refuses_bad_scale_accumulation_and_smoothing(kwargs: Dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _adascale(**kwargs)


def test_adascale_setters_refuse_infinite_scale_and_fractional_accumulation() -> None:
    model, optim = _adascale(num_gradients_to_accumulate=2)
    with pytest.raises(ValueError, match="finite"):
        optim.set_scale(math.inf)
    with pytest.raises(AssertionError, match="whole number"):  # upstream asserted on this argument
        optim.set_num_gradients_to_accumulate(2.5)
    assert optim.scale == 2 and optim._num_grads_to_accum == 2, "nothing changed"
    # Valid values as before: an integral float, smoothing 1 as a running mean without debiasing.
    optim.set_num_gradients_to_accumulate(2.0)
    _accumulate(model, optim)
    _, running = _adascale(num_gradients_to_accumulate=2, smoothing=1.0, debias_ewma=False)
    assert running.smoothing == 1.0


def test_adascale_loads_a_plain_optimizer_state_dict_with_fresh_statistics() -> None:
    model, optim = _adascale(num_gradients_to_accumulate=2)
    plain_model = nn.Linear(2, 2)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    plain_model(torch.ones(1, 2)).sum().backward()
    plain.step()
    _accumulate(model, optim)  # statistics that the load must not keep
    with pytest.warns(UserWarning, match="no AdaScale statistics"):
        optim.load_state_dict(plain.state_dict())
    assert optim.gain() == 1.0
    # From here on it measures like a new AdaScale over the same weights.
    fresh_model, fresh = _adascale(num_gradients_to_accumulate=2)
    fresh_model.load_state_dict(model.state_dict())
    _accumulate(model, optim)
    _accumulate(fresh_model, fresh)
    assert optim.gain() == fresh.gain() and optim.gain() > 1.0


def _window_body(rank: int, world_size: int) -> List[str]:
    # set_num_gradients_to_accumulate(2) on rank 1 only: its all-reduce of statistics came one backward later than
    # rank 0's, paired statistics of different windows silently and left one all-reduce unmatched (a hang).
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    optim = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=1)
    # The same data on both ranks stands in for DDP's averaged gradients (AdaScale reads the reduced ones).
    x = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    model(x).sum().backward()  # the same window on both ranks: statistics as before
    optim.step()
    gain = optim.gain()
    optim.zero_grad()
    if rank == 1:
        optim.set_num_gradients_to_accumulate(2)
        model(x).sum().backward()  # still accumulating: no all-reduce yet
    with pytest.raises(RanksDisagreeError, match="num_gradients_to_accumulate differs between ranks") as info:
        model(x).sum().backward()
    assert optim.gain() == gain, "statistics of mismatched windows were used"
    return [f"{gain:.12g}", str(info.value)]


def test_adascale_window_length_differing_between_ranks_raises_on_every_rank() -> None:
    results = run_distributed(_window_body, 2, timeout=TIMEOUT)
    assert results[0][0] == results[1][0], "the ranks' gains differ before the mismatch"
    assert "this rank has 1, the mean over the 2 ranks is 1.5" in results[0][1]
    assert "this rank has 2, the mean over the 2 ranks is 1.5" in results[1][1]


# ------------------------------------------------------------------------------------------------------------------
# LayerwiseGradientScaler


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Identity())


def _grads(model: nn.Module) -> List[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_layerwise_scaler_refuses_calls_out_of_order() -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    reference = _net()
    reference(x).sum().backward()
    want = _grads(reference)

    model = _net()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LayerwiseGradientScaler(model, {"0": 4.0, "2": 2.0})
    with pytest.raises(RuntimeError, match="scale\\(\\) was not called before"):
        scaler.unscale()
    scaler.scale()
    with pytest.raises(RuntimeError, match="already called, and unscale\\(\\) not since"):
        scaler.scale()
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="the gradients are still scaled"):
        scaler.step(optim)
    scaler.unscale()
    got = _grads(model)
    for a, b in zip(got, want):  # one set of hooks: the gradients come back exactly once unscaled
        torch.testing.assert_close(a, b)
    with pytest.raises(RuntimeError, match="already called since the last scale\\(\\)"):
        scaler.unscale()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), got)), "not divided again"
    assert all(not hooks[0] and not hooks[1] for _, hooks in scaler.get_backward_hooks())
    scaler.step(optim)
    # The next iteration runs as usual.
    optim.zero_grad()
    scaler.scale()
    model(x).sum().backward()
    scaler.unscale()
    scaler.step(optim)


@pytest.mark.parametrize(
    "scale,error",
    [(0.0, ValueError), (-4.0, ValueError), (math.nan, ValueError), (math.inf, ValueError), ("4", TypeError)],
)
def test_layerwise_scaler_refuses_scales_that_are_not_positive_finite_numbers(scale: Any, error: type) -> None:
    with pytest.raises(error, match="the scale of layer '0' must be a"):
        LayerwiseGradientScaler(_net(), {"0": scale})


# ------------------------------------------------------------------------------------------------------------------
# GradScaler / ShardedGradScaler


@pytest.mark.parametrize("scaler_class", [GradScaler, ShardedGradScaler])
@pytest.mark.parametrize("init_scale", [0.0, -4.0, math.nan, math.inf])
def test_grad_scalers_refuse_an_init_scale_that_is_not_positive_and_finite(
    scaler_class: Any, init_scale: float
) -> None:
    with pytest.raises(ValueError, match=f"{scaler_class.__name__}: init_scale must be a positive finite number"):
        scaler_class(init_scale=init_scale, device="cpu")
    # A disabled scaler never uses it (as torch's); a valid one is built as before.
    scaler_class(init_scale=init_scale, enabled=False, device="cpu")
    if device_generic_amp_scaler():  # torch < 2.3: CPU scalers are disabled (scale 1.0), as torch's are
        assert scaler_class(init_scale=8.0, device="cpu").get_scale() == 8.0


@pytest.mark.parametrize("scaler_class", [GradScaler, ShardedGradScaler])
@pytest.mark.parametrize(
    "setting,value,error,message",
    [
        ("backoff_factor", 0.0, ValueError, "backoff_factor must be in \\(0, 1\\)"),
        ("backoff_factor", -0.5, ValueError, "backoff_factor must be in \\(0, 1\\)"),
        ("growth_factor", 0.5, ValueError, "growth_factor must be at least 1"),
        ("growth_interval", 2.5, TypeError, "growth_interval must be an integer"),
        ("init_scale", 1e39, ValueError, "init_scale must be a positive finite number within float32's range"),
        ("growth_factor", math.inf, TypeError, "growth_factor must be a finite real number"),
    ],
)
def test_grad_scalers_refuse_settings_their_state_dict_could_not_load(
    scaler_class: Any, setting: str, value: Any, error: type, message: str
) -> None:
    # Before: accepted (as torch and upstream do); backoff_factor=0 zeroed the scale at the first overflow and every
    # later step wrote NaN into the weights, and the scaler's own state dict was refused by its load_state_dict.
    with pytest.raises(error, match=f"{scaler_class.__name__}: {message}"):
        scaler_class(device="cpu", **{setting: value})
    scaler_class(enabled=False, device="cpu", **{setting: value})  # a disabled scaler never uses them (as torch's)
    if device_generic_amp_scaler():  # torch < 2.3: CPU scalers are disabled, as torch's are
        scaler = scaler_class(device="cpu", growth_interval=-1, backoff_factor=0.25, growth_factor=3.0)
        scaler_class(device="cpu").load_state_dict(scaler.state_dict())  # what it accepts, it loads back


# ------------------------------------------------------------------------------------------------------------------
# Schedulers that read optimizer.defaults


def _one_cycle_body(rank: int, world_size: int) -> None:
    # OSS.defaults held only the arguments given (upstream): OneCycleLR(cycle_momentum=True) and CyclicLR refused
    # OSS(optim=AdamW) ("optimizer must support momentum or beta1").
    model, reference = _model(), _model()
    oss = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    schedulers = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.01, total_steps=10) for o in (oss, plain)]
    for step in range(3):
        for m, o, s in ((model, oss, schedulers[0]), (reference, plain, schedulers[1])):
            o.zero_grad()
            m(_data(step, 0)).pow(2).mean().backward()
            o.step()
            s.step()
    assert oss.param_groups[0]["betas"] == plain.param_groups[0]["betas"]
    assert oss.param_groups[0]["lr"] == plain.param_groups[0]["lr"]
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


def test_one_cycle_lr_on_oss_of_adamw() -> None:
    run_distributed(_one_cycle_body, 2, timeout=TIMEOUT)
