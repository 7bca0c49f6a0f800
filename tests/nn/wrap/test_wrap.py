# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Tests of fairscale.nn.wrap: enable_wrap / wrap / auto_wrap and the auto-wrap policies.

The wrapper class here is a transparent module that records the keyword arguments it was built with,
so the tests see exactly which modules got wrapped and with what configuration. FSDP-based variants
live with the FSDP tests.
"""

import functools
from typing import Any, Dict, Iterator, List

import pytest
import torch
from torch import nn

from fairscale.fair_dev.testing import run_distributed
from fairscale.nn.wrap import auto_wrap, config_auto_wrap_policy, default_auto_wrap_policy, enable_wrap, wrap
from fairscale.nn.wrap.auto_wrap import ConfigAutoWrap


class Recorder(nn.Module):
    """Stand-in wrapper: forwards to the wrapped module and remembers its constructor kwargs."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.module: Any = module
        self.kwargs = kwargs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def size_policy(min_num_params: int, **kwargs: Any) -> Any:
    return functools.partial(default_auto_wrap_policy, min_num_params=min_num_params, **kwargs)


def nested_model() -> Any:
    # Linear(5, 5) has 30 parameters, the inner Sequential 60, the whole model 120.
    return nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5)))


@pytest.fixture(autouse=True)
def no_leftover_context() -> Iterator[None]:
    yield
    # Every test must leave the class-level state clean, whatever happened inside it.
    assert not ConfigAutoWrap.in_autowrap_context
    assert ConfigAutoWrap.wrapper_cls is None and ConfigAutoWrap.kwargs == {}


def test_wrap_inside_context_uses_context_kwargs() -> None:
    with enable_wrap(wrapper_cls=Recorder, flatten_parameters=False, mixed_precision=True):
        layer = wrap(nn.Linear(5, 5))
    assert isinstance(layer, Recorder)
    assert isinstance(layer.module, nn.Linear)
    assert layer.kwargs == {"flatten_parameters": False, "mixed_precision": True}


def test_auto_wrap_refuses_what_is_not_a_module() -> None:
    # A list of layers failed with "'list' object has no attribute 'named_modules'" (session 38).
    with enable_wrap(wrapper_cls=Recorder):
        with pytest.raises(TypeError, match="auto_wrap: expected the model"):
            auto_wrap([nn.Linear(5, 5)])  # type: ignore[arg-type]


def test_wrap_and_auto_wrap_are_noops_outside_context() -> None:
    linear = nn.Linear(5, 5)
    assert wrap(linear, flatten_parameters=True) is linear
    model = nested_model()
    assert auto_wrap(model, auto_wrap_policy=size_policy(1)) is model
    assert not any(isinstance(m, Recorder) for m in model.modules())


def test_override_precedence_context_then_wrapper_config_then_explicit() -> None:
    linear = nn.Linear(5, 5)
    linear.wrapper_config = {"a": "config", "b": "config"}  # type: ignore[assignment]
    with enable_wrap(wrapper_cls=Recorder, a="context", b="context", c="context"):
        layer = wrap(linear, b="explicit")
    assert layer.kwargs == {"a": "config", "b": "explicit", "c": "context"}


def test_wrapper_config_must_be_a_dict() -> None:
    linear = nn.Linear(5, 5)
    linear.wrapper_config = ["not", "a", "dict"]  # type: ignore[assignment]
    with enable_wrap(wrapper_cls=Recorder):
        with pytest.raises(TypeError, match="wrapper_config must be a dict"):
            wrap(linear)


def test_wrapper_cls_may_be_a_factory_function() -> None:
    with enable_wrap(wrapper_cls=lambda m, **kw: Recorder(m, via="factory", **kw), x=1):
        layer = wrap(nn.Linear(2, 2))
    assert isinstance(layer, Recorder) and layer.kwargs == {"via": "factory", "x": 1}


def test_auto_wrap_by_size() -> None:
    model = nested_model()
    with enable_wrap(wrapper_cls=Recorder, flatten_parameters=False):
        wrapped = auto_wrap(model, auto_wrap_policy=size_policy(40))
    # Inner Sequential (60 >= 40) is wrapped; its 30-parameter children are not. The root is then
    # left with 60 unwrapped parameters, which is enough to wrap it as well.
    assert isinstance(wrapped, Recorder) and wrapped.kwargs == {"flatten_parameters": False}
    root = wrapped.module
    assert isinstance(root[0], nn.Linear) and isinstance(root[1], nn.Linear)
    assert isinstance(root[2], Recorder) and isinstance(root[2].module, nn.Sequential)
    assert all(isinstance(m, nn.Linear) for m in root[2].module)


def test_auto_wrap_root_not_wrapped_when_children_took_the_parameters() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))  # 110 parameters each
    with enable_wrap(wrapper_cls=Recorder):
        wrapped = auto_wrap(model, auto_wrap_policy=size_policy(100))
    assert wrapped is model
    assert isinstance(model[0], Recorder) and isinstance(model[1], Recorder)


def test_auto_wrap_keeps_outputs_and_passes_kwargs() -> None:
    torch.manual_seed(0)
    model = nested_model()
    x = torch.randn(3, 5)
    expected = model(x)
    with enable_wrap(wrapper_cls=Recorder, a=1):
        wrapped = auto_wrap(model, auto_wrap_policy=size_policy(40), b=2)
    torch.testing.assert_close(wrapped(x), expected)
    recorders = [m for m in wrapped.modules() if isinstance(m, Recorder)]
    assert len(recorders) == 2 and all(r.kwargs == {"a": 1, "b": 2} for r in recorders)


def test_default_policy_threshold_is_1e8() -> None:
    model = nested_model()
    with enable_wrap(wrapper_cls=Recorder):
        assert auto_wrap(model) is model
    assert not any(isinstance(m, Recorder) for m in model.modules())


def test_skip_params_check_for_root() -> None:
    for skip in (False, True):
        model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))  # 110 parameters each
        with enable_wrap(wrapper_cls=Recorder):
            wrapped = auto_wrap(model, auto_wrap_policy=size_policy(100, skip_params_check_for_root=skip))
        # The children take every parameter; the root is wrapped around them only when its
        # (empty) remainder is not checked.
        assert isinstance(wrapped, Recorder) == skip
        assert sum(isinstance(m, Recorder) for m in wrapped.modules()) == 2 + int(skip)


def test_small_root_is_never_descended_into() -> None:
    model = nested_model()
    with enable_wrap(wrapper_cls=Recorder):
        wrapped = auto_wrap(model, auto_wrap_policy=size_policy(1000, skip_params_check_for_root=True))
    assert wrapped is model and not any(isinstance(m, Recorder) for m in model.modules())


def test_preset_exclude_wrap_module_list() -> None:
    model = nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)])
    with enable_wrap(wrapper_cls=Recorder):
        wrapped = auto_wrap(model, auto_wrap_policy=size_policy(40))
    # 60 parameters would be enough, but ModuleList has no forward and is never wrapped.
    assert wrapped is model and not any(isinstance(m, Recorder) for m in model.modules())


def test_preset_exclude_wrap_still_wraps_children() -> None:
    model = nn.ModuleDict({"big": nn.Linear(10, 10), "small": nn.Linear(2, 2)})
    with enable_wrap(wrapper_cls=Recorder):
        wrapped = auto_wrap(model, auto_wrap_policy=size_policy(40))
    assert wrapped is model
    assert isinstance(model["big"], Recorder) and isinstance(model["small"], nn.Linear)


def test_preset_force_leaf_multihead_attention() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.MultiheadAttention(100, 1))
    with enable_wrap(wrapper_cls=Recorder):
        wrapped = auto_wrap(model, auto_wrap_policy=size_policy(40))
    # The attention layer is not descended into, so neither it nor its out_proj is wrapped on its
    # own: its parameters stay with the root, which is therefore large enough to be wrapped.
    assert isinstance(wrapped, Recorder)
    assert isinstance(wrapped.module[0], Recorder)
    assert type(wrapped.module[1]) is nn.MultiheadAttention
    assert not isinstance(wrapped.module[1].out_proj, Recorder)


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.branch = nested_model()[2]  # Sequential with 60 parameters
        self.head = nn.Linear(5, 5)  # 30 parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.branch(x))


def test_custom_force_leaf_modules() -> None:
    with enable_wrap(wrapper_cls=Recorder):
        plain = auto_wrap(TwoBranches(), auto_wrap_policy=size_policy(40))
        leaf = auto_wrap(TwoBranches(), auto_wrap_policy=size_policy(40, force_leaf_modules={nn.Sequential}))
    # Default: the branch is wrapped, leaving 30 parameters, too few to wrap the root.
    assert isinstance(plain, TwoBranches) and isinstance(plain.branch, Recorder)
    # Sequential as a forced leaf: the branch is not handled on its own, the root takes all 90.
    assert isinstance(leaf, Recorder) and isinstance(leaf.module.branch, nn.Sequential)


def test_custom_exclude_wrap_modules() -> None:
    model = nn.ModuleList([nn.Linear(10, 10)])
    with enable_wrap(wrapper_cls=Recorder):
        wrapped = auto_wrap(model, auto_wrap_policy=size_policy(40, exclude_wrap_modules={nn.Linear}))
    assert isinstance(wrapped, Recorder) and isinstance(wrapped.module[0], nn.Linear)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"min_num_params": None}, TypeError, "min_num_params must be a number"),
        ({"min_num_params": "100"}, TypeError, "min_num_params must be a number"),
        ({"min_num_params": True}, TypeError, "min_num_params must be a number"),
        ({"min_num_params": -1}, ValueError, "min_num_params must be >= 0"),
        ({"min_num_params": float("nan")}, ValueError, "min_num_params must be >= 0"),
        ({"min_num_params": 40, "force_leaf_modules": nn.Linear}, TypeError, "a single class goes in a set"),
        ({"min_num_params": 40, "exclude_wrap_modules": nn.Linear}, TypeError, "a single class goes in a set"),
        ({"min_num_params": 40, "exclude_wrap_modules": {"Linear"}}, TypeError, "the classes, not names"),
        ({"min_num_params": 40, "force_leaf_modules": {nn.Linear(2, 2)}}, TypeError, "the classes, not names"),
    ],
)
def test_default_policy_refuses_bad_arguments_naming_them(kwargs: Dict[str, Any], error: type, match: str) -> None:
    # They failed deep inside auto_wrap with Python's own messages ("'>=' not supported between 'int' and
    # 'NoneType'", "'type' object is not iterable"), or, for a negative size, wrapped parameterless modules.
    with enable_wrap(wrapper_cls=Recorder):
        with pytest.raises(error, match=match):
            auto_wrap(nested_model(), auto_wrap_policy=functools.partial(default_auto_wrap_policy, **kwargs))
    with enable_wrap(wrapper_cls=Recorder):  # lists and tuples of classes are sets enough; 0 wraps every module
        wrapped = auto_wrap(nested_model(), auto_wrap_policy=size_policy(0, exclude_wrap_modules=[nn.Sequential]))
    assert isinstance(wrapped[0], Recorder) and isinstance(wrapped[2], nn.Sequential)


def test_default_sets_are_function_attributes_read_at_call_time() -> None:
    assert default_auto_wrap_policy.EXCLUDE_WRAP_MODULES == {nn.ModuleList, nn.ModuleDict}  # type: ignore
    assert default_auto_wrap_policy.FORCE_LEAF_MODULES == {nn.MultiheadAttention}  # type: ignore
    saved = set(default_auto_wrap_policy.EXCLUDE_WRAP_MODULES)  # type: ignore
    default_auto_wrap_policy.EXCLUDE_WRAP_MODULES.add(nn.Linear)  # type: ignore
    try:
        linear = nn.Linear(10, 10)
        with enable_wrap(wrapper_cls=Recorder):
            assert auto_wrap(linear, auto_wrap_policy=size_policy(40)) is linear
    finally:
        default_auto_wrap_policy.EXCLUDE_WRAP_MODULES = saved  # type: ignore


def test_custom_policy_sees_keyword_arguments() -> None:
    calls = []

    def linear_only(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool) -> bool:
        calls.append((type(module).__name__, recurse, unwrapped_params, module_is_root))
        return True if recurse else isinstance(module, nn.Linear)

    model = nested_model()
    with enable_wrap(wrapper_cls=Recorder):
        wrapped = auto_wrap(model, auto_wrap_policy=linear_only)
    assert wrapped is model
    assert sum(isinstance(m, Recorder) for m in model.modules()) == 4
    assert calls[0] == ("Sequential", True, 120, True)
    assert calls[-1] == ("Sequential", False, 0, True)  # all parameters were taken by the Linears


def test_policy_given_to_enable_wrap_is_the_default_of_auto_wrap() -> None:
    model = nested_model()
    with enable_wrap(auto_wrap_policy=size_policy(100), wrapper_cls=Recorder):
        wrapped = auto_wrap(model)
    assert isinstance(wrapped, Recorder) and sum(isinstance(m, Recorder) for m in wrapped.modules()) == 1
    model = nested_model()
    with enable_wrap(auto_wrap_policy=size_policy(100), wrapper_cls=Recorder):
        wrapped = auto_wrap(model, auto_wrap_policy=size_policy(10**9))
    assert wrapped is model


def test_config_auto_wrap_policy_wraps_only_tagged_modules() -> None:
    model = nested_model()
    model[1].wrapper_config = {"flatten_parameters": False}
    model[2][0].wrapper_config = {}
    with enable_wrap(wrapper_cls=Recorder, mixed_precision=True):
        wrapped: Any = auto_wrap(model, auto_wrap_policy=config_auto_wrap_policy)
    assert wrapped is model
    assert isinstance(model[0], nn.Linear)
    assert isinstance(model[1], Recorder) and model[1].kwargs == {"mixed_precision": True, "flatten_parameters": False}
    assert isinstance(model[2][0], Recorder) and model[2][0].kwargs == {"mixed_precision": True}
    assert isinstance(model[2][1], nn.Linear)


def test_nested_enable_wrap_raises_and_keeps_outer_context() -> None:
    with enable_wrap(wrapper_cls=Recorder, a=1):
        with pytest.raises(NotImplementedError, match="nested"):
            with enable_wrap(wrapper_cls=Recorder, a=2):
                pass
        assert ConfigAutoWrap.in_autowrap_context and ConfigAutoWrap.kwargs == {"a": 1}
    assert not ConfigAutoWrap.in_autowrap_context


def test_context_is_reset_after_an_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with enable_wrap(wrapper_cls=Recorder):
            raise RuntimeError("boom")
    linear = nn.Linear(2, 2)
    assert wrap(linear) is linear


def test_missing_or_bad_wrapper_cls() -> None:
    with pytest.raises(ValueError, match="wrapper_cls"):
        with enable_wrap(flatten_parameters=True):
            pass
    with pytest.raises(TypeError, match="wrapper_cls must be a class or callable"):
        with enable_wrap(wrapper_cls=3):
            pass


def test_auto_wrap_refuses_already_wrapped_trees() -> None:
    with enable_wrap(wrapper_cls=Recorder):
        inner = wrap(nn.Linear(5, 5))
        model = nn.Sequential(nn.Linear(5, 5), inner)
        with pytest.raises(ValueError, match=r"submodule '1' \(Recorder\) is already wrapped"):
            auto_wrap(model, auto_wrap_policy=size_policy(1))
        with pytest.raises(ValueError, match="the root module"):
            auto_wrap(inner, auto_wrap_policy=size_policy(1))
    # Parameters marked as sharded belong to a wrapper of another kind (e.g. FSDP made by another factory, as vissl
    # does): that subtree is left alone (neither looked into nor wrapped again), the rest is wrapped.
    model = nested_model()
    for p in model[2].parameters():
        p._is_sharded = True
    inner_before = list(model[2].modules())
    with enable_wrap(wrapper_cls=Recorder):
        wrapped = auto_wrap(model, auto_wrap_policy=size_policy(1))
    assert isinstance(wrapped[0], Recorder) and isinstance(wrapped[1], Recorder)
    assert list(wrapped[2].modules()) == inner_before  # untouched


def test_sharded_parameters_do_not_count_towards_the_size() -> None:
    model = nested_model()
    for p in model[2].parameters():
        p._is_sharded = True
    sizes: Dict[int, int] = {}

    def record(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool) -> bool:
        sizes.setdefault(id(module), unwrapped_params)
        return False

    with enable_wrap(wrapper_cls=Recorder):
        ConfigAutoWrap.recursive_wrap(model, auto_wrap_policy=record, module_is_root=True)
    assert sizes[id(model)] == 60


def test_move_module_cuda_half_is_not_a_wrapper_argument() -> None:
    with enable_wrap(wrapper_cls=Recorder, move_module_cuda_half=True, a=1):
        assert ConfigAutoWrap.move_module_cuda_half is True
        assert ConfigAutoWrap.kwargs == {"a": 1}
    assert ConfigAutoWrap.move_module_cuda_half is False


def _move_module_cuda_half(rank: int, world_size: int) -> None:
    with enable_wrap(wrapper_cls=Recorder, move_module_cuda_half=True):
        layer: Any = wrap(nn.Linear(5, 5))
    assert layer.module.weight.is_cuda and layer.module.weight.dtype == torch.float16
    assert layer.kwargs == {}


def test_move_module_cuda_half() -> None:
    # Moves the module to CUDA: in a CUDA world (skipped without a GPU), off the pytest process.
    run_distributed(_move_module_cuda_half, 1, device="cuda")


def test_a_module_in_two_places_gets_one_wrapper() -> None:
    # named_children() lists a module registered twice once: Sequential(a, a) became [W(a), a] (the same layer run
    # wrapped and bare), and a child of two parents got two wrappers. Every place now holds the same wrapper.
    seen: List[int] = []

    def policy(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool) -> bool:
        seen.append(unwrapped_params)
        return recurse or (unwrapped_params >= 30 and not module_is_root)

    shared = nn.Linear(5, 5)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(5, 1))
    with enable_wrap(wrapper_cls=Recorder):
        wrapped = auto_wrap(model, auto_wrap_policy=policy)
    assert isinstance(wrapped[0], Recorder) and wrapped[0] is wrapped[2] and wrapped[0].module is shared
    assert min(seen) >= 0
    seen.clear()
    shared = nn.Linear(5, 5)
    model = nn.Sequential(nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared, nn.Tanh()))
    with enable_wrap(wrapper_cls=Recorder):
        wrapped = auto_wrap(model, auto_wrap_policy=policy)
    assert isinstance(wrapped[0][0], Recorder) and wrapped[0][0] is wrapped[1][0]
    # The shared layer's 30 parameters count once: nothing is left to the parents or the root (it was -30 there).
    assert min(seen) >= 0 and seen[-1] == 0, seen


def test_tied_modules_are_wrapped_by_wrappers_other_than_fsdp() -> None:
    """Only FSDP refuses a tie across wrappers: auto_wrap keeps tied modules together for it alone, and wraps them
    for any other wrapper (checkpoint_wrapper, say), as before (found in review, session 49)."""
    model = nn.Sequential(nn.Embedding(10, 5), nn.Linear(5, 5), nn.Linear(5, 10))
    model[2].weight = model[0].weight
    with enable_wrap(wrapper_cls=Recorder):
        wrapped = auto_wrap(model, auto_wrap_policy=size_policy(40))
    assert [type(m).__name__ for m in wrapped] == ["Recorder", "Linear", "Recorder"]


def _recorder_factory(module: nn.Module, **kwargs: Any) -> nn.Module:
    return Recorder(module, **kwargs)


def test_factories_keep_tied_modules_together() -> None:
    """A factory may return FSDP (vissl's wrappers do): tied modules stay together for it, as for FSDP (in review,
    session 49, the rule had been kept for FSDP classes only, and vissl's tied models broke again)."""
    for factory in (_recorder_factory, functools.partial(_recorder_factory)):
        model = nn.Sequential(nn.Embedding(10, 5), nn.Linear(5, 5), nn.Linear(5, 10))
        model[2].weight = model[0].weight
        with enable_wrap(wrapper_cls=factory):
            wrapped = auto_wrap(model, auto_wrap_policy=size_policy(40))
        inner = wrapped.module if isinstance(wrapped, Recorder) else wrapped  # the root holds them all
        assert [type(m).__name__ for m in inner] == ["Embedding", "Linear", "Linear"]


def test_a_tied_module_with_a_wrapper_config_warns_that_it_is_not_wrapped() -> None:
    """config_auto_wrap_policy wraps the modules a user marked with ``wrapper_config``; one tied to a module outside it
    stays with the enclosing instance (FSDP refuses a tie across instances). Its settings were dropped silently; now
    a warning says why (a review, session 50). An untied marked module is wrapped without a warning."""
    model = nn.Sequential(nn.Embedding(10, 5), nn.Linear(5, 5), nn.Linear(5, 10))
    model[2].weight = model[0].weight
    for layer in model:
        layer.wrapper_config = {"a": 1}
    with enable_wrap(wrapper_cls=_recorder_factory):
        with pytest.warns(UserWarning, match="that has a wrapper_config") as record:
            wrapped = auto_wrap(model, auto_wrap_policy=config_auto_wrap_policy)
    assert [type(m).__name__ for m in wrapped] == ["Embedding", "Recorder", "Linear"]
    assert wrapped[1].kwargs == {"a": 1}
    # The embedding and the output layer, nothing else.
    shown = [str(w.message).split(" that")[0] for w in record]
    assert shown == ["auto_wrap did not wrap a module (Embedding)", "auto_wrap did not wrap a module (Linear)"], shown
