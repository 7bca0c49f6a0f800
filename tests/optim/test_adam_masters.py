# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""fairscale.optim.Adam's fp32 masters (``MIXED_PRECISION``) follow the fp16 parameters.

Upstream built the masters once, at construction: weights loaded into the model afterwards (the usual resume order)
or any other write to a parameter outside the optimizer was overwritten by the next step, and a group added with
``add_param_group`` had no masters (the next step raised ``IndexError``). Each behaviour is compared with a
reference built fresh on the same values: an optimizer constructed after the write, or with the group given at
construction.
"""

import copy
from typing import Callable, Dict, List

import pytest
import torch
from torch import Tensor, nn

from fairscale.optim import Adam, Precision

KWARGS = dict(lr=1e-2, eps=1e-3, weight_decay=0.1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)).half()


def _params(optim: Adam) -> List[Tensor]:
    return [p for group in optim.param_groups for p in group["params"]]


def _masters(optim: Adam) -> List[Tensor]:
    return [m for group in optim.fp32_param_groups for m in group["params"]]


def _step(optim: Adam, step: int) -> None:
    """One step with gradients that depend only on ``step`` and the parameters' shapes."""
    gen = torch.Generator().manual_seed(1000 + step)
    for p in _params(optim):
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    optim.step()


def _assert_same(optim: Adam, reference: Adam) -> None:
    """Bit-identical parameters, masters and moments."""
    assert len(_params(optim)) == len(_params(reference)) and len(_masters(optim)) == len(_masters(reference))
    for p, q in zip(_params(optim), _params(reference)):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optim.state[p][key], reference.state[q][key])
    for m, n in zip(_masters(optim), _masters(reference)):
        assert torch.equal(m, n)


def _has_extra_precision(optim: Adam) -> bool:
    return any(not torch.equal(m, m.half().float()) for m in _masters(optim))


@pytest.mark.parametrize("layout", ["separate", "views-of-one-buffer"])
def test_plain_training_keeps_masters_bit_identical(layout: str) -> None:
    # Views of one buffer share a version counter: each write-back also moves the other parameters' versions, which
    # must not look like a write from outside the optimizer.
    gen = torch.Generator().manual_seed(7)
    buf = torch.randn(20, generator=gen).half()
    if layout == "separate":
        params = [nn.Parameter(buf[:12].clone().view(3, 4)), nn.Parameter(buf[12:].clone())]
    else:
        params = [nn.Parameter(buf[:12].view(3, 4)), nn.Parameter(buf[12:])]
    optim = Adam(params, **KWARGS)
    # The masters follow the same updates as fp32 parameters under FULL_PRECISION, exactly.
    reference = Adam([nn.Parameter(p.detach().float()) for p in params], precision=Precision.FULL_PRECISION, **KWARGS)
    for step in range(5):
        _step(optim, step)
        gen = torch.Generator().manual_seed(1000 + step)
        for p in _params(reference):
            p.grad = torch.randn(p.shape, generator=gen).half().float()
        reference.step()
        for p, m, r in zip(params, _masters(optim), _params(reference)):
            assert torch.equal(m, r) and torch.equal(p, r.half())
    assert _has_extra_precision(optim)


def test_resume_order_steps_from_the_loaded_weights() -> None:
    trained = _model()
    optim = Adam(trained.parameters(), **KWARGS)
    for step in range(3):
        _step(optim, step)
    model_state = copy.deepcopy(trained.state_dict())
    optim_state = copy.deepcopy(optim.state_dict())

    # The usual order: model and optimizer built, then both loaded.
    resumed = _model()
    resumed_optim = Adam(resumed.parameters(), **KWARGS)
    resumed.load_state_dict(model_state)
    resumed_optim.load_state_dict(optim_state)
    # Reference: the optimizer built on the loaded model.
    reference = _model()
    reference.load_state_dict(model_state)
    reference_optim = Adam(reference.parameters(), **KWARGS)
    reference_optim.load_state_dict(optim_state)

    _assert_same(resumed_optim, reference_optim)
    for step in range(3, 6):
        _step(resumed_optim, step)
        _step(reference_optim, step)
        _assert_same(resumed_optim, reference_optim)


def _load_state_dict(model: nn.Module, new: Dict[str, Tensor]) -> None:
    model.load_state_dict(new)


def _copy_under_no_grad(model: nn.Module, new: Dict[str, Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(new[name])


def _replace_data(model: nn.Module, new: Dict[str, Tensor]) -> None:
    for name, p in model.named_parameters():
        p.data = new[name].clone()


@pytest.mark.parametrize(
    "write", [_load_state_dict, _copy_under_no_grad, _replace_data], ids=["load_state_dict", "copy_", "data="]
)
def test_parameters_written_outside_the_optimizer_are_read(
    write: Callable[[nn.Module, Dict[str, Tensor]], None],
) -> None:
    model = _model()
    optim = Adam(model.parameters(), **KWARGS)
    for step in range(2):
        _step(optim, step)
    assert _has_extra_precision(optim)
    # New values that differ from the current ones in every element: the whole master must be re-read.
    new = {name: (p.detach() + 3).half() for name, p in model.named_parameters()}
    write(model, new)

    reference = _model()
    reference.load_state_dict(new)
    reference_optim = Adam(reference.parameters(), **KWARGS)
    reference_optim.load_state_dict(copy.deepcopy(optim.state_dict()))
    for step in range(2, 4):
        _step(optim, step)
        _step(reference_optim, step)
        _assert_same(optim, reference_optim)


def test_partial_and_value_preserving_writes_keep_the_other_masters_exact() -> None:
    model = _model()
    optim = Adam(model.parameters(), **KWARGS)
    for step in range(2):
        _step(optim, step)
    before = [m.clone() for m in _masters(optim)]
    assert _has_extra_precision(optim)
    masks = [torch.arange(p.numel()).view(p.shape) % 2 == 0 for p in model.parameters()]
    with torch.no_grad():
        for p, mask in zip(model.parameters(), masks):
            saved = p.clone()
            p.fill_(1.0)  # swapped out and back (as an EMA for evaluation): the values are unchanged
            p.copy_(saved)
            p.mul_(mask)  # pruned: half of the elements are now 0
    optim.zero_grad(set_to_none=True)
    optim.step()  # no gradients: the masters are only brought up to date
    for m, old, mask in zip(_masters(optim), before, masks):
        assert torch.equal(m, torch.where(mask, old, torch.zeros_like(old)))


def test_load_state_dict_rereads_every_master() -> None:
    model = _model()
    optim = Adam(model.parameters(), **KWARGS)
    for step in range(2):
        _step(optim, step)
    # An in-place write through .data bypasses the version counter (documented): reloading re-reads the masters.
    for p in model.parameters():
        p.data.mul_(-1)
    optim.load_state_dict(optim.state_dict())
    for p, m in zip(model.parameters(), _masters(optim)):
        assert torch.equal(m, p.float())


def test_parameter_of_another_shape_raises() -> None:
    p = nn.Parameter(torch.ones(3, dtype=torch.float16))
    optim = Adam([p])
    p.data = torch.ones(5, dtype=torch.float16)
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="no longer fit"):
        optim.step()
    with pytest.raises(RuntimeError, match="no longer fit"):
        optim.load_state_dict(optim.state_dict())


def _added_and_constructed() -> List[Adam]:
    """The same two groups, the second one added with add_param_group or given at construction."""
    a, b = (p.detach() for p in _model().parameters() if p.dim() == 2)
    added = Adam([nn.Parameter(a.clone())], **KWARGS)
    added.add_param_group({"params": [nn.Parameter(b.clone())], "lr": 0.5})
    constructed = Adam(
        [{"params": [nn.Parameter(a.clone())]}, {"params": [nn.Parameter(b.clone())], "lr": 0.5}], **KWARGS
    )
    return [added, constructed]


def test_add_param_group_builds_masters_like_the_constructor() -> None:
    added, constructed = _added_and_constructed()
    assert added.precision is Precision.MIXED_PRECISION and len(added.fp32_param_groups) == 2
    for g, h in zip(added.fp32_param_groups, constructed.fp32_param_groups):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in h.items() if k != "params"}
        assert all(m.dtype == torch.float32 and m.grad is not None and not m.grad.any() for m in g["params"])
    for step in range(3):
        _step(added, step)
        _step(constructed, step)
        _assert_same(added, constructed)

    # The state dict of either round-trips into either.
    saved = copy.deepcopy(added.state_dict())
    loaded = _added_and_constructed()
    for optim in loaded:
        with torch.no_grad():
            for p, q in zip(_params(optim), _params(added)):
                p.copy_(q)
        optim.load_state_dict(saved)
        assert [g["lr"] for g in optim.param_groups] == [1e-2, 0.5]
    for step in range(3, 6):
        for optim in loaded:
            _step(optim, step)
        _assert_same(loaded[0], loaded[1])


def test_add_param_group_that_fails_adds_no_masters() -> None:
    p = nn.Parameter(torch.ones(3, dtype=torch.float16))
    optim = Adam([p])
    with pytest.raises(ValueError, match="more than one"):
        optim.add_param_group({"params": [p]})
    assert len(optim.param_groups) == 1 and len(optim.fp32_param_groups) == 1
    full = Adam([nn.Parameter(torch.ones(3))])
    full.add_param_group({"params": [nn.Parameter(torch.ones(2))]})
    assert full.fp32_param_groups == []


def test_build_fp32_params_rebuilds_the_masters_as_upstream() -> None:
    # upstream's private helper (its tests call it): fp32 copies of the given fp16 parameters, with zero gradients,
    # in one group with the hyper-parameters; a step afterwards trains as a fresh optimizer from the same values.
    model = _model()
    optim = Adam(model.parameters(), **KWARGS)
    _step(optim, 0)
    with torch.no_grad():
        for p in _params(optim):
            p.mul_(0.5)  # the masters now differ from the parameters; rebuilding takes the parameters' values
    optim._build_fp32_params(model.parameters())
    masters = _masters(optim)
    assert len(optim.fp32_param_groups) == 1 and optim.fp32_param_groups[0]["lr"] == KWARGS["lr"]
    for p, m in zip(_params(optim), masters):
        assert m.dtype == torch.float32 and torch.equal(m, p.float()) and torch.equal(m.grad, torch.zeros_like(m))
    rebuilt = [m.detach().clone() for m in masters]
    fresh = Adam(_model().parameters(), **KWARGS)  # a fresh optimizer on the same (halved) values and state
    with torch.no_grad():
        for p, q in zip(_params(fresh), _params(optim)):
            p.copy_(q)
    fresh.load_state_dict(optim.state_dict())
    _step(optim, 1)
    _step(fresh, 1)
    _assert_same(optim, fresh)
    assert not torch.equal(_masters(optim)[0], rebuilt[0])  # the step moved the rebuilt masters


def test_build_fp32_params_needs_the_single_groups_parameters() -> None:
    model = _model()
    optim = Adam([{"params": model[0].parameters()}, {"params": model[1].parameters()}], **KWARGS)
    before = [m.clone() for m in _masters(optim)]
    with pytest.raises(ValueError, match=r"builds the masters of a single param group: .* \(this one has 2\)"):
        optim._build_fp32_params(model.parameters())
    single = Adam(model.parameters(), **KWARGS)
    with pytest.raises(ValueError, match=r"that group's parameters, in order \(2 given\)"):
        single._build_fp32_params(list(model.parameters())[:2])
    assert all(torch.equal(a, b) for a, b in zip(before, _masters(optim)))  # nothing changed


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_precision_masters_and_scale(how: str) -> None:
    # torch pickles only defaults, state and param_groups: a copy's step raised AttributeError.
    model = _model()
    optim = Adam(model.parameters(), **KWARGS)
    _step(optim, 0)
    optim._optim_scale = 4.0
    if how == "deepcopy":
        copied = copy.deepcopy(optim)
    else:
        import io

        buffer = io.BytesIO()
        torch.save(optim, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    assert copied.precision is Precision.MIXED_PRECISION and copied._optim_scale == 4.0
    assert _has_extra_precision(copied)  # the masters came along, with their bits below fp16's
    for step in (1, 2):
        _step(optim, step)
        _step(copied, step)
    _assert_same(copied, optim)
