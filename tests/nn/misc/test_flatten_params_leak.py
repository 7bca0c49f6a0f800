# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A dropped FlattenParamsWrapper (bare or inside FSDP) frees its flat parameters and wrapped modules.

The views a module holds between forwards carry an autograd graph back to the flat parameter, whose
``_param_infos`` hold the modules: a ring through C++ that Python's cycle collector cannot free. These tests drop the
wrapper (with and without a training step, copies included) and check through weak references that everything is
gone after ``gc.collect()``.
"""

import copy
import gc
import pickle
import weakref
from typing import Any, Callable, List

import pytest
import torch
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.misc.flatten_params_wrapper import FlattenParamsWrapper


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.Linear(4, 3))


def _refs(wrapper: nn.Module, modules: List[nn.Module]) -> List["weakref.ReferenceType[Any]"]:
    """Weak references to the wrapper, its parameters (the flat parameters) and ``modules``."""
    return [weakref.ref(x) for x in [wrapper, *wrapper.parameters(), *modules]]


def _alive(refs: List["weakref.ReferenceType[Any]"]) -> List[str]:
    return [type(r()).__name__ for r in refs if r() is not None]


def _train_step(model: nn.Module, n_in: int = 6) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, n_in)).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("step", [False, True], ids=["no_forward", "after_step"])
def test_dropped_wrapper_frees_flat_params_and_modules(step: bool) -> None:
    net = _net()
    modules = list(net.modules())
    wrapper = FlattenParamsWrapper(net)
    del net
    assert wrapper.module[0].weight.grad_fn is not None  # the views keep their graph while the wrapper lives
    if step:
        _train_step(wrapper)
    refs = _refs(wrapper, modules)
    del wrapper, modules
    gc.collect()
    assert not _alive(refs), f"still alive after the wrapper was dropped: {_alive(refs)}"


def test_dropped_under_a_fake_tensor_mode_is_freed() -> None:
    """A wrapper collected while torch.compile traces (a FakeTensorMode active): the finalizer's detach() went to
    that mode and failed ("Exception ignored"), and the wrapper's flat parameters leaked."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    wrapper = FlattenParamsWrapper(_net())
    wrapper(torch.randn(2, 6))
    refs = _refs(wrapper, [])
    with FakeTensorMode():
        del wrapper
    gc.collect()
    assert not _alive(refs), f"still alive after the wrapper was dropped: {_alive(refs)}"


def test_dropped_wrapper_is_freed_by_reference_counting() -> None:
    """No cycle collection needed: the objects go as soon as the last reference does."""
    net = _net()
    modules = list(net.modules())
    wrapper = FlattenParamsWrapper(net)
    del net
    _train_step(wrapper)
    refs = _refs(wrapper, modules)
    gc.collect()
    gc.disable()
    try:
        del wrapper, modules
        alive = _alive(refs)
    finally:
        gc.enable()
    assert not alive, f"not freed by reference counting: {alive}"


def test_dropped_wrapper_with_groups_and_tied_weights_is_freed() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    net[1].weight = net[0].weight  # a tied weight: a shared name aliasing its first owner's view
    modules = list(net.modules())
    wrapper = FlattenParamsWrapper(net, param_list=[[net[0].weight, net[0].bias], [net[2].weight, net[2].bias]])
    del net
    assert len(wrapper.flat_params) == 2
    _train_step(wrapper, n_in=4)
    refs = _refs(wrapper, modules)
    del wrapper, modules
    gc.collect()
    assert not _alive(refs), f"still alive: {_alive(refs)}"


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_dropped_copies_are_freed(how: str) -> None:
    original = FlattenParamsWrapper(_net())
    clone = copy.deepcopy(original) if how == "deepcopy" else pickle.loads(pickle.dumps(original))
    _train_step(clone)
    clone_refs = _refs(clone, list(clone.module.modules()))
    del clone
    gc.collect()
    assert not _alive(clone_refs), f"clone still alive: {_alive(clone_refs)}"
    # The original is untouched by its clone's death and is freed in turn.
    assert original.module[0].weight.grad_fn is not None
    _train_step(original)
    refs = _refs(original, list(original.module.modules()))
    del original
    gc.collect()
    assert not _alive(refs), f"original still alive: {_alive(refs)}"


def test_shallow_copy_keeps_the_graph_of_the_survivor() -> None:
    """A shallow copy shares the flat parameters and modules: its death must not detach the views the other still
    computes with (a checkpointed region would recompute with them in the backward); the last one out frees all."""
    wrapper = FlattenParamsWrapper(_net())
    twin = copy.copy(wrapper)
    loss = wrapper(torch.randn(3, 6)).sum()
    del twin
    gc.collect()
    view = wrapper.module[0].weight
    assert view.grad_fn is not None
    # The view the module holds still leads to the flat parameter.
    (grad,) = torch.autograd.grad(view.sum(), [wrapper.flat_param])
    assert grad[: view.numel()].eq(1).all() and grad[view.numel() :].eq(0).all()
    loss.backward()
    assert wrapper.flat_param.grad is not None
    refs = _refs(wrapper, list(wrapper.module.modules()))
    del wrapper, loss, view, grad
    gc.collect()
    assert not _alive(refs), f"still alive: {_alive(refs)}"


def test_module_kept_by_the_user_keeps_its_values() -> None:
    """A module the user kept outlives its wrapper with detached aliases of its last views (same values)."""
    wrapper = FlattenParamsWrapper(_net())
    inner = wrapper.module
    _train_step(wrapper)
    expected = {n: v.detach().clone() for n, v in wrapper.state_dict().items()}
    flat_ref = weakref.ref(wrapper.flat_param)
    del wrapper
    gc.collect()
    assert flat_ref() is None
    got = {f"{i}.{n}": getattr(m, n) for i, m in enumerate(inner) for n in ("weight", "bias") if hasattr(m, n)}
    assert got.keys() == expected.keys() and len(got) == 6
    for name, value in got.items():
        assert value.grad_fn is None and torch.equal(value, expected[name]), name
    assert inner(torch.randn(2, 6)).shape == (2, 3)


# --------------------------------------------------------------------------------------------------------- FSDP


def _fsdp_cases() -> List[Callable[[], nn.Module]]:
    def flat() -> nn.Module:
        return FSDP(_net())

    def nested() -> nn.Module:
        net = _net()
        net[2] = FSDP(net[2])
        return FSDP(net)

    def concat() -> nn.Module:
        net = _net()
        net[0] = FSDP(net[0], optimize_backward_concat=True)
        return FSDP(net, optimize_backward_concat=True)

    return [flat, nested, concat]


def _fsdp_dropped_model_body(rank: int, world_size: int) -> None:
    for make in _fsdp_cases():
        for step in (False, True):
            torch.manual_seed(0)
            model = make()
            modules = [m for m in model.modules() if not isinstance(m, (FSDP, FlattenParamsWrapper))]
            if step:
                _train_step(model)
                if make.__name__ == "concat":
                    with model.no_sync():  # type: ignore[operator]
                        model(torch.randn(3, 6)).sum().backward()
                    _train_step(model)
            refs = _refs(model, modules)
            del model, modules
            gc.collect()
            alive = _alive(refs)
            if alive:  # not an assert: a spawned rank imports this module without pytest's rewriting (python -O)
                raise AssertionError(f"{make.__name__}, step={step}: still alive after the model was dropped: {alive}")


def test_dropped_fsdp_model_frees_flat_params_and_modules() -> None:
    run_distributed(_fsdp_dropped_model_body, 2)
