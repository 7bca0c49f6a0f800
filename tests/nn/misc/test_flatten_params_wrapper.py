# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Tests for FlattenParamsWrapper and FlatParameter (single process, CPU; accelerator variants when present)."""

import contextlib
import copy
import pickle
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from fairscale.internal.device import current_accelerator_device
from fairscale.nn.misc import FlatParameter, FlattenParamsWrapper, _enable_pre_load_state_dict_hook
from fairscale.nn.misc.flatten_params_wrapper import fpw_pre_load_hook_disabled

_ACCEL = current_accelerator_device()
# (device, dtype) combinations for the numerical parity tests. fp16 only on an accelerator, where it is native.
CONFIGS: List[Tuple[str, torch.dtype]] = [("cpu", torch.float32), ("cpu", torch.float64)]
if _ACCEL is not None:
    CONFIGS += [(str(_ACCEL), torch.float32), (str(_ACCEL), torch.float16)]
CONFIG_IDS = [f"{d}-{str(t).split('.')[-1]}" for d, t in CONFIGS]


# ------------------------------------------------------------------------------------------------------ models


class Tied(nn.Module):
    """Two linears sharing one weight (``b.weight = a.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2, bias=False)
        self.b = nn.Linear(2, 2, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.relu(self.a(x)))


class Rich(nn.Module):
    """Embedding, transformer layer (attention reads its weights as attributes), conv, batch norm, tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.layer(self.embed(tokens))
        h = self.bn(self.conv(h.transpose(1, 2))).transpose(1, 2)
        return self.head(h)


def make_seq() -> Any:
    return nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.Linear(3, 1)))


def make_rich(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return Rich().to(device=device, dtype=dtype)


def rich_input(device: str = "cpu", seed: int = 1) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (3, 5), generator=g).to(device)


def wrap_copy(module: nn.Module, **kwargs: Any) -> Tuple[Any, Any]:
    """A reference module and a wrapped deep copy of it (identical values)."""
    return module, FlattenParamsWrapper(copy.deepcopy(module), **kwargs)


def assert_state_dicts_equal(a: Dict[str, Tensor], b: Dict[str, Tensor]) -> None:
    assert list(a.keys()) == list(b.keys())
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------------------------- flattening layouts


def test_full_flattening_keys_and_sizes() -> None:
    ref, fpw = wrap_copy(make_seq())
    assert [n for n, _ in fpw.named_parameters()] == ["flat_param_0"]
    assert list(fpw.state_dict().keys()) == ["0.weight", "0.bias", "1.0.weight", "1.0.bias"]
    flat_sd = fpw.flat_state_dict()
    assert list(flat_sd.keys()) == ["flat_param_0"] and flat_sd["flat_param_0"].numel() == 13
    assert fpw.num_params_managed == 4 and fpw.is_flattened
    assert isinstance(fpw.flat_param, FlatParameter) and fpw.flat_param_names == ["flat_param_0"]
    expected = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    assert torch.equal(fpw.flat_param.detach(), expected)
    # The data is a copy, not an alias of the original parameters.
    assert all(fpw.flat_param.data_ptr() != p.data_ptr() for p in ref.parameters())


def test_partial_flattening() -> None:
    module: Any = make_rich()
    ref = copy.deepcopy(module)
    chosen = [module.layer.linear1.weight, module.layer.linear1.bias, module.conv.weight]
    fpw: Any = FlattenParamsWrapper(module, param_list=chosen)
    assert fpw.num_params_managed == 3
    assert fpw.flat_param.numel() == sum(p.numel() for p in chosen)
    names = [n for n, _ in fpw.named_parameters()]
    assert names[0] == "flat_param_0"
    assert "_fpw_module.conv.bias" in names and "_fpw_module.layer.linear2.weight" in names
    assert "_fpw_module.conv.weight" not in names and "_fpw_module.layer.linear1.bias" not in names
    # Non-flattened params stay ordinary Parameters; flattened names are plain tensor views now.
    assert isinstance(module.conv.bias, nn.Parameter) and not isinstance(module.conv.weight, nn.Parameter)
    x = rich_input()
    assert torch.equal(fpw(x), ref(x))
    # Unflattening restores each module's original parameter order (upstream moved flattened params last).
    sd, ref_sd = fpw.state_dict(), ref.state_dict()
    keys = list(sd.keys())
    assert keys == list(ref_sd.keys())
    assert_state_dicts_equal(dict(sorted(sd.items())), dict(sorted(ref_sd.items())))


def test_two_groups_keys_order_and_sizes() -> None:
    module: Any = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    ref = copy.deepcopy(module)
    fpw: Any = FlattenParamsWrapper(module, param_list=[[module[0].weight, module[1].weight], [module[0].bias]])
    flat_sd = fpw.flat_state_dict()
    assert list(flat_sd.keys()) == ["flat_param_0", "flat_param_1", "1.bias"]
    assert flat_sd["flat_param_0"].numel() == 9 and flat_sd["flat_param_1"].numel() == 3
    assert isinstance(module[1].bias, nn.Parameter)
    # Re-registration on unflatten changes the order inside module 1, exactly as upstream.
    assert list(fpw.state_dict().keys()) == ["0.weight", "0.bias", "1.weight", "1.bias"]  # upstream: 1.bias first
    assert fpw.num_params_managed == 3 and len(fpw.flat_params) == 2
    with pytest.raises(RuntimeError, match="exactly one flat parameter"):
        fpw.flat_param
    x = torch.randn(4, 2)
    assert torch.equal(fpw(x), ref(x))


def test_flat_param_names() -> None:
    fpw: Any = FlattenParamsWrapper(nn.Linear(2, 2), flat_param_names=["x"])
    assert list(fpw.flat_state_dict().keys()) == ["flat_param_x"]
    assert fpw.flat_param_names == ["flat_param_x"] and fpw.flat_param is fpw.flat_param_x


def test_flatten_nothing() -> None:
    ref, fpw = wrap_copy(make_seq(), param_list=[])
    assert fpw.flat_params == [] and fpw.num_params_managed == 0
    assert [n for n, _ in fpw.named_parameters()] == ["_fpw_module." + n for n, _ in ref.named_parameters()]
    assert fpw.module._unflattened_param_views == []
    assert_state_dicts_equal(fpw.state_dict(), ref.state_dict())
    assert_state_dicts_equal(fpw.flat_state_dict(), ref.state_dict())
    x = torch.randn(4, 2)
    assert torch.equal(fpw(x), ref(x))
    with fpw.unflatten_params():
        assert not fpw.is_flattened
    assert fpw.is_flattened
    fpw.load_state_dict(make_seq().state_dict())  # no flat keys, nothing managed: loads as is
    with pytest.raises(RuntimeError, match="exactly one flat parameter"):
        fpw.flat_param


def test_empty_module() -> None:
    fpw: Any = FlattenParamsWrapper(nn.Sequential(nn.ReLU(), nn.Identity()))
    assert fpw.flat_params == [] and list(fpw.parameters()) == [] and fpw.state_dict() == {}
    x = torch.randn(3)
    assert torch.equal(fpw(x), torch.relu(x))


def test_duplicates_in_group_and_empty_groups_ignored() -> None:
    m: Any = make_seq()
    fpw: Any = FlattenParamsWrapper(m, param_list=[[m[0].weight, m[0].weight], []])
    assert fpw.num_params_managed == 1 and fpw.flat_param_names == ["flat_param_0"]


# ---------------------------------------------------------------------------------------------- shared params


def test_shared_params_flattened_once_and_step_updates_both_names() -> None:
    ref, fpw = wrap_copy(Tied())
    assert fpw.flat_param.numel() == 4 and fpw.num_params_managed == 1
    assert list(fpw.state_dict().keys()) == ["a.weight", "b.weight"]
    assert fpw.module.a.weight is fpw.module.b.weight  # one view object for both names
    (shared,) = fpw._shared_param_infos
    assert shared[0] == "_fpw_module.b" and shared[1] == "_fpw_module.a" and shared[3] == shared[5] == "weight"

    x = torch.randn(5, 2)
    opt = torch.optim.SGD(fpw.parameters(), lr=0.1)
    fpw(x).sum().backward()
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x).sum().backward()
    ref_opt.step()
    sd = fpw.state_dict()
    assert torch.equal(sd["a.weight"], sd["b.weight"])
    assert torch.equal(sd["a.weight"], ref.a.weight.detach())
    with fpw.unflatten_params():
        assert fpw.module.a.weight is fpw.module.b.weight and isinstance(fpw.module.b.weight, nn.Parameter)


# --------------------------------------------------------------------------------------- numerical parity


@pytest.mark.parametrize("device,dtype", CONFIGS, ids=CONFIG_IDS)
def test_outputs_and_grads_equal_bitwise(device: str, dtype: torch.dtype) -> None:
    ref = make_rich(device, dtype)
    fpw: Any = FlattenParamsWrapper(copy.deepcopy(ref))
    x = rich_input(device)
    out, ref_out = fpw(x), ref(x)
    assert out.dtype == dtype and torch.equal(out, ref_out)
    out.float().square().sum().backward()
    ref_out.float().square().sum().backward()
    grad = fpw.flat_param.grad
    assert grad is not None and grad.shape == fpw.flat_param.shape
    ref_grads = [p.grad for p in ref.parameters()]  # parameters() order == flattening order (module pre-order)
    assert all(g is not None for g in ref_grads)
    for view_grad, ref_grad in zip(grad.split(fpw.flat_param._param_numels), ref_grads):
        assert torch.equal(view_grad, ref_grad.reshape(-1))


@pytest.mark.parametrize("device,dtype", CONFIGS[:2] + CONFIGS[2:3], ids=CONFIG_IDS[:2] + CONFIG_IDS[2:3])
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
        lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False),
    ],
    ids=["sgd", "adam"],
)
def test_optimizer_steps_equal(device: str, dtype: torch.dtype, make_opt: Callable[[Any], Any]) -> None:
    ref = make_rich(device, dtype)
    fpw: Any = FlattenParamsWrapper(copy.deepcopy(ref))
    opt, ref_opt = make_opt(fpw.parameters()), make_opt(ref.parameters())
    for step in range(3):
        x = rich_input(device, seed=step)
        for model, optim in ((fpw, opt), (ref, ref_opt)):
            optim.zero_grad()
            model(x).float().square().mean().backward()
            optim.step()
    torch.testing.assert_close(fpw.state_dict(), ref.state_dict(), rtol=0, atol=0)
    x = rich_input(device, seed=9)
    assert torch.equal(fpw(x), ref(x))


def test_forward_uses_data_swapped_into_flat_param() -> None:
    # FSDP's usage: it puts a (gathered) tensor into flat_param.data right before the forward.
    ref, fpw = wrap_copy(make_seq())
    new = torch.randn(13)
    fpw.flat_param.data = new.clone()
    with torch.no_grad():
        for p, v in zip(ref.parameters(), new.split([6, 3, 3, 1])):
            p.copy_(v.view_as(p))
    x = torch.randn(4, 2)
    out = fpw(x)
    assert torch.equal(out, ref(x))
    out.sum().backward()
    assert fpw.flat_param.grad is not None and fpw.flat_param.grad.shape == (13,)


# --------------------------------------------------------------------------------------------- autograd path


def test_view_autograd_path_is_one_views_node_then_accumulategrad() -> None:
    fpw: Any = FlattenParamsWrapper(make_seq())
    fpw(torch.randn(2, 2))
    view = fpw.module[0].weight
    assert not isinstance(view, nn.Parameter) and view.requires_grad
    assert view.grad_fn is not None and view.grad_fn.name() == "FlatParamViewsBackward"
    assert view.data_ptr() == fpw.flat_param.data_ptr()  # the same storage, as a split view
    acc_node = view.grad_fn.next_functions[0][0]
    assert acc_node.name().endswith("AccumulateGrad") and acc_node.variable is fpw.flat_param
    # Every view of one flat parameter hangs off the same node.
    for v in fpw.module._unflattened_param_views:
        assert v.grad_fn is view.grad_fn


def _flat_grads(fpw: Any, create_graph: bool) -> Tensor:
    torch.manual_seed(0)
    x = torch.randn(3, 2, requires_grad=create_graph)
    loss = fpw(x).pow(2).sum()
    if create_graph:  # a gradient penalty: double backward through the parameters' views
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        loss = loss + gx.pow(2).sum()
    loss.backward()
    grad = fpw.flat_param.grad.clone()
    fpw.flat_param.grad = None
    return grad


@pytest.mark.parametrize("create_graph", [False, True])
def test_views_gradient_equals_the_split_path(create_graph: bool) -> None:
    """The same flat gradient, bit for bit, as upstream's split views (their path rebuilt here by hand)."""
    fpw: Any = FlattenParamsWrapper(make_seq())
    ours = _flat_grads(fpw, create_graph)
    fpw._view_builder = lambda flat: list(flat.get_param_views())  # upstream's split views
    theirs = _flat_grads(fpw, create_graph)
    assert torch.equal(ours, theirs)


def test_views_may_be_changed_in_place_in_forward() -> None:
    """Split views cannot be used after an in-place change ('a function that returns multiple views');
    ``nn.Embedding(max_norm=...)`` renormalises its weight in place in every forward. The flat gradient then equals
    the plain module's."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(5, 3, max_norm=0.5), nn.Linear(3, 2))
    fpw: Any = FlattenParamsWrapper(copy.deepcopy(plain))
    tokens = torch.tensor([[0, 1, 4], [4, 2, 2]])
    fpw(tokens).pow(2).sum().backward()
    plain(tokens).pow(2).sum().backward()
    expected = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])  # type: ignore[union-attr]
    assert torch.equal(fpw.flat_param.grad, expected)


def test_views_are_fresh_every_forward() -> None:
    fpw: Any = FlattenParamsWrapper(make_seq())
    before = list(fpw.module._unflattened_param_views)
    fpw(torch.randn(2, 2))
    after = fpw.module._unflattened_param_views
    assert len(after) == 4 and all(a is not b for a, b in zip(after, before))
    assert after[0] is fpw.module[0].weight and after[3] is fpw.module[1][0].bias


def test_view_builder_replaces_default_views() -> None:
    fpw: Any = FlattenParamsWrapper(make_seq())
    calls: List[FlatParameter] = []

    def detached_views(flat: FlatParameter) -> List[Tensor]:
        calls.append(flat)
        with torch.no_grad():
            return [v.requires_grad_() for v in flat.get_param_views()]

    fpw._view_builder = detached_views
    fpw(torch.randn(2, 2)).sum().backward()
    assert calls == [fpw.flat_param]
    # The builder cut the autograd link: the views got gradients, the flat parameter none.
    assert fpw.flat_param.grad is None and fpw.module[0].weight.grad_fn is None
    fpw._view_builder = lambda flat: []
    with pytest.raises(RuntimeError, match="returned 0 views"):
        fpw(torch.randn(2, 2))


# ------------------------------------------------------------------------------------------------ state dicts


def test_state_dict_equality_both_forms() -> None:
    ref, fpw = wrap_copy(make_rich())
    fpw(rich_input())
    ref(rich_input())  # same buffer updates (batch norm statistics)
    assert_state_dicts_equal(fpw.state_dict(), ref.state_dict())
    flat_sd = fpw.flat_state_dict()
    assert list(flat_sd.keys()) == ["flat_param_0", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    expected = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    assert torch.equal(flat_sd["flat_param_0"], expected)
    assert fpw.is_flattened and fpw._auto_unflatten_state_dict
    fpw._auto_unflatten_state_dict = False
    assert list(fpw.state_dict().keys()) == list(flat_sd.keys())


def test_load_original_state_dict() -> None:
    fpw: Any = FlattenParamsWrapper(make_rich(seed=0))
    other = make_rich(seed=1)
    fpw.load_state_dict(other.state_dict())
    assert fpw.is_flattened
    assert_state_dicts_equal(fpw.state_dict(), other.state_dict())
    x = rich_input()
    assert torch.equal(fpw(x), other(x))


def test_load_flat_state_dict() -> None:
    fpw: Any = FlattenParamsWrapper(make_rich(seed=0))
    src: Any = FlattenParamsWrapper(make_rich(seed=1))
    fpw.load_state_dict(src.flat_state_dict())
    assert_state_dicts_equal(fpw.state_dict(), src.state_dict())
    x = rich_input()
    assert torch.equal(fpw(x), src(x))


def test_load_wrong_keys_reports_them() -> None:
    fpw: Any = FlattenParamsWrapper(make_seq())
    sd = make_seq().state_dict()
    sd["extra"] = torch.zeros(1)
    del sd["0.bias"]
    # Reported in the names of the dict that was given, not the internal _fpw_module paths.
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "0.bias".*\n.*Unexpected.*: "extra"'):
        fpw.load_state_dict(sd)
    result = fpw.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["0.bias"] and result.unexpected_keys == ["extra"]
    parent: Any = nn.Sequential(nn.Linear(1, 1), FlattenParamsWrapper(make_seq()))
    sd = parent.state_dict()
    del sd["1.1.0.weight"]
    result = parent.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["1.1.0.weight"] and result.unexpected_keys == []
    assert torch.equal(parent[1].module[0].bias, sd["1.0.bias"])  # the present names were loaded
    sd["1.0.bias"] = torch.zeros(4)
    with pytest.raises(
        RuntimeError, match=r"size mismatch for 1\.0\.bias: copying a param with shape torch\.Size\(\[4\]\)"
    ):
        parent.load_state_dict(sd, strict=False)
    with pytest.raises(ValueError, match="assign=True"):
        fpw.load_state_dict(make_seq().state_dict(), assign=True)


@pytest.mark.parametrize("flat", [False, True])
def test_a_meta_value_is_refused_before_anything_is_loaded(flat: bool) -> None:
    # A meta tensor (a shape without data) passed the shape-only dry run, and the real load failed partway ("Cannot
    # copy out of meta tensor") after copying the entries before it.
    fpw: Any = FlattenParamsWrapper(make_seq())
    before = {k: v.clone() for k, v in fpw.state_dict().items()}
    if flat:  # the flat parameter's key, first, then the original names of the rest
        sd = {"flat_param_0": torch.empty(fpw.flat_param.numel(), device="meta")}
        sd.update({k: v + 1 for k, v in before.items() if k in dict(fpw.named_buffers())})
    else:  # the original names, the last one without data
        sd = {k: v + 1 for k, v in before.items()}
        last = list(sd)[-1]
        sd[last] = torch.empty_like(sd[last], device="meta")
    with pytest.raises(RuntimeError, match=r"the state dict holds a meta tensor"):
        fpw.load_state_dict(sd)
    for key, value in fpw.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_parent_load_with_assign_is_refused_before_the_wrapper_changes() -> None:
    # torch would register the loaded tensor in place of the flat parameter, unseen by the wrapper's views: the
    # load was lost silently ("All keys matched"). Refused with a message; the wrapper keeps its parameters.
    parent: Any = nn.Sequential(FlattenParamsWrapper(make_seq()))
    flat = parent[0].flat_param
    before = flat.detach().clone()
    source = nn.Sequential(make_seq()).state_dict()
    with pytest.raises(ValueError, match="assign=True.*FlattenParamsWrapper at '0'"):
        parent.load_state_dict({k: torch.zeros_like(v) for k, v in source.items()}, assign=True)
    assert parent[0].flat_param is flat and parent[0]._parameters["flat_param_0"] is flat
    assert torch.equal(flat, before)
    parent.load_state_dict({k: torch.zeros_like(v) for k, v in source.items()})  # assign=False loads
    assert not flat.any()


class _WithScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.scale = nn.Parameter(torch.tensor(2.0))


def test_nested_in_parent_checks_values_as_nn_module_does() -> None:
    # A 0-dim parameter accepts a 1-dim value (torch's rule for old checkpoints); a non-tensor value and a wrong shape
    # give nn.Module's own messages.
    def build(wrap: bool) -> Any:
        torch.manual_seed(0)
        inner = _WithScalar()
        return nn.Sequential(FlattenParamsWrapper(inner) if wrap else inner)

    plain, wrapped = build(False), build(True)
    sd = {k: v.clone() for k, v in plain.state_dict().items()}
    sd["0.scale"] = torch.tensor([5.0])
    for model in (plain, wrapped):
        model.load_state_dict(dict(sd))
    assert_state_dicts_equal(wrapped.state_dict(), plain.state_dict())
    assert wrapped.state_dict()["0.scale"].item() == 5.0
    for bad, message in ((3.0, "expected torch.Tensor or Tensor-like object"), (torch.zeros(2, 3), "size mismatch")):
        errors = []
        for model in (plain, wrapped):
            with pytest.raises(RuntimeError, match=message) as info:
                model.load_state_dict({**sd, "0.linear.weight": bad})
            errors.append(str(info.value))
        assert errors[0] == errors[1]


def test_legacy_flat_param_key_loads() -> None:
    src: Any = FlattenParamsWrapper(make_seq())
    legacy = {"flat_param": src.flat_state_dict()["flat_param_0"]}
    fpw: Any = FlattenParamsWrapper(make_seq())
    fpw.load_state_dict(legacy)
    assert torch.equal(fpw.flat_param, src.flat_param)
    # Also when the wrapper sits inside a parent module (the key then carries the parent's prefix).
    parent: Any = nn.Sequential(FlattenParamsWrapper(make_seq()))
    parent.load_state_dict({"0.flat_param": legacy["flat_param"]})
    assert torch.equal(parent[0].flat_param, src.flat_param)


def test_nested_in_parent_round_trip_both_forms() -> None:
    def build(seed: int) -> Any:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(2, 2), FlattenParamsWrapper(make_seq()), nn.BatchNorm1d(1))

    a, b = build(0), build(1)
    sd = a.state_dict()
    assert list(sd.keys())[:6] == ["0.weight", "0.bias", "1.0.weight", "1.0.bias", "1.1.0.weight", "1.1.0.bias"]
    b.load_state_dict(sd)  # original keys folded into the flat entry by the load pre hook
    assert_state_dicts_equal(b.state_dict(), sd)
    a[1]._auto_unflatten_state_dict = False
    flat: Any = a.state_dict()
    assert "1.flat_param_0" in flat and "1.0.weight" not in flat
    c: Any = build(2)
    c.load_state_dict(flat)
    assert torch.equal(c[1].flat_param, a[1].flat_param)


@pytest.mark.parametrize("given", ["both", "first only", "second only"])
def test_nested_in_parent_tied_names_load_as_nn_module_does(given: str) -> None:
    # A checkpoint of an untied model (two values) into a tied one: nn.Module loads each name in turn, the last
    # present wins, and a name absent from the dict is reported missing even when its tied twin gave the value.
    def build(wrap: bool) -> Any:
        torch.manual_seed(0)
        tied = Tied()
        return nn.Sequential(FlattenParamsWrapper(tied) if wrap else tied)

    plain, wrapped = build(False), build(True)
    names = [k for k, _ in plain.named_parameters(remove_duplicate=False) if k.endswith("weight")]
    assert len(names) == 2 and plain.get_parameter(names[0]) is plain.get_parameter(names[1])
    values = {names[0]: torch.full_like(plain.get_parameter(names[0]), 1.0)}
    values[names[1]] = torch.full_like(values[names[0]], 2.0)
    dropped = {"first only": [names[1]], "second only": [names[0]]}.get(given, [])
    sd = {k: v.clone() for k, v in plain.state_dict().items()}
    sd.update(values)
    for k in dropped:
        del sd[k]
    results = [m.load_state_dict(dict(sd), strict=False) for m in (plain, wrapped)]
    assert sorted(results[1].missing_keys) == sorted(results[0].missing_keys) == sorted(dropped)
    assert results[1].unexpected_keys == results[0].unexpected_keys == []
    assert_state_dicts_equal(wrapped.state_dict(), plain.state_dict())
    assert plain.get_parameter(names[0])[0, 0].item() == (1.0 if given == "first only" else 2.0)


@pytest.mark.parametrize("bad", ["first", "second"])
def test_nested_in_parent_tied_names_are_each_checked(bad: str) -> None:
    # Every tied name present is checked, and a mismatch is reported under its own name, as nn.Module does.
    def build(wrap: bool) -> Any:
        torch.manual_seed(0)
        tied = Tied()
        return nn.Sequential(FlattenParamsWrapper(tied) if wrap else tied)

    plain, wrapped = build(False), build(True)
    sd = {k: v.clone() for k, v in plain.state_dict().items()}
    key = "0.a.weight" if bad == "first" else "0.b.weight"
    sd[key] = torch.zeros(3, 3)
    for model in (plain, wrapped):
        with pytest.raises(RuntimeError, match=f"size mismatch for {key}:"):
            model.load_state_dict(dict(sd))
    # Missing names in module order, as nn.Module lists them (a bias present, so the group is loaded by name).
    for model in (plain, wrapped):
        inner = model[0].module if isinstance(model[0], FlattenParamsWrapper) else model[0]
        assert inner.a.bias is None
    torch.manual_seed(0)
    with_bias = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, bias=False))
    with_bias[1].weight = with_bias[0].weight
    twins = [nn.Sequential(copy.deepcopy(with_bias)), nn.Sequential(FlattenParamsWrapper(copy.deepcopy(with_bias)))]
    partial = {"0.0.bias": torch.ones(2)}
    results = [m.load_state_dict(dict(partial), strict=False) for m in twins]
    assert results[1].missing_keys == results[0].missing_keys == ["0.0.weight", "0.1.weight"]


def _twice_registered() -> nn.Module:
    # One linear under two names ("0" and "2"): nn.Module saves and loads it under both.
    torch.manual_seed(0)
    shared = nn.Linear(2, 2)
    return nn.Sequential(nn.Sequential(shared, nn.ReLU(), shared))


@pytest.mark.parametrize("given", ["both", "first only", "second only"])
def test_nested_in_parent_twice_registered_submodule_loads_as_nn_module_does(given: str) -> None:
    plain = _twice_registered()
    wrapped: Any = _twice_registered()
    wrapped[0] = FlattenParamsWrapper(wrapped[0])
    assert (
        list(wrapped.state_dict()) == list(plain.state_dict()) == ["0.0.weight", "0.0.bias", "0.2.weight", "0.2.bias"]
    )
    sd = {k: torch.full_like(v, float(i + 1)) for i, (k, v) in enumerate(plain.state_dict().items())}
    for k in {"first only": ["0.2.weight", "0.2.bias"], "second only": ["0.0.weight", "0.0.bias"]}.get(given, []):
        del sd[k]
    results = [m.load_state_dict(dict(sd), strict=False) for m in (plain, wrapped)]
    assert results[1].missing_keys == results[0].missing_keys
    assert results[1].unexpected_keys == results[0].unexpected_keys == []
    assert_state_dicts_equal(wrapped.state_dict(), plain.state_dict())
    x = torch.randn(3, 2)
    assert torch.equal(wrapped(x), plain(x))


def test_nested_in_parent_absent_group_reported_by_original_names() -> None:
    # Two flat groups, the dict (original names) holds only the first: the second is reported as nn.Module would
    # report it (its original names), not as a missing flat entry, and keeps its values.
    def build(wrap: bool) -> Any:
        torch.manual_seed(0)
        seq = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
        if wrap:
            seq = FlattenParamsWrapper(seq, param_list=[list(seq[0].parameters()), list(seq[1].parameters())])
        return nn.Sequential(seq)

    plain, wrapped = build(False), build(True)
    before = {k: v.clone() for k, v in wrapped.state_dict().items()}
    sd = {k: torch.ones_like(v) for k, v in plain.state_dict().items() if k.startswith("0.0.")}
    results = [m.load_state_dict(dict(sd), strict=False) for m in (plain, wrapped)]
    assert results[1].missing_keys == results[0].missing_keys == ["0.1.weight", "0.1.bias"]
    assert results[1].unexpected_keys == results[0].unexpected_keys == []
    assert_state_dicts_equal(wrapped.state_dict(), plain.state_dict())
    assert torch.equal(wrapped.state_dict()["0.1.weight"], before["0.1.weight"])
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"0\.1\.weight\", \"0\.1\.bias\""):
        wrapped.load_state_dict(dict(sd))
    # A dict without any of the wrapper's names still reports the flat entries (nothing says which form it has).
    assert wrapped.load_state_dict({}, strict=False).missing_keys == ["0.flat_param_0", "0.flat_param_1"]


def test_pre_load_hook_can_be_disabled() -> None:
    fpw: Any = FlattenParamsWrapper(make_seq(), param_list=[])
    src: Any = make_seq()
    raw = {"_fpw_module." + k: v for k, v in src.state_dict().items()}
    assert _enable_pre_load_state_dict_hook()
    with fpw_pre_load_hook_disabled():
        assert not _enable_pre_load_state_dict_hook()
        fpw.load_state_dict(raw)
        with pytest.raises(RuntimeError, match="Missing key"):
            fpw.load_state_dict(src.state_dict())
    assert _enable_pre_load_state_dict_hook()
    assert_state_dicts_equal(fpw.state_dict(), src.state_dict())


# -------------------------------------------------------------------------------------------- unflatten_params


def test_unflatten_params_exposes_parameters_and_keeps_edits() -> None:
    fpw: Any = FlattenParamsWrapper(make_seq())
    flat: Any = fpw.flat_param
    with fpw.unflatten_params():
        assert not fpw.is_flattened
        assert [n for n, _ in fpw.named_parameters()] == [
            "_fpw_module.0.weight",
            "_fpw_module.0.bias",
            "_fpw_module.1.0.weight",
            "_fpw_module.1.0.bias",
        ]
        assert isinstance(fpw.module[0].weight, nn.Parameter) and fpw.module[0].weight.shape == (3, 2)
        assert not hasattr(fpw.module, "_unflattened_param_views")
        with torch.no_grad():
            fpw.module[0].bias.fill_(7.0)
        with pytest.raises(RuntimeError, match="needs a flattened wrapper"):
            fpw.flat_state_dict()
    assert fpw.is_flattened and fpw.flat_param is flat and [n for n, _ in fpw.named_parameters()] == ["flat_param_0"]
    assert torch.equal(flat[6:9].detach(), torch.full((3,), 7.0))


def test_unflatten_params_with_external_data() -> None:
    fpw: Any = FlattenParamsWrapper(make_seq())
    before = fpw.flat_param.detach().clone()
    external = torch.arange(13, dtype=torch.float32)
    with fpw.unflatten_params(flat_params=[external]):
        assert torch.equal(fpw.module[0].weight, external[:6].view(3, 2))
        assert torch.equal(fpw.module[1][0].bias, external[12:])
        with torch.no_grad():
            fpw.module[0].bias.zero_()  # writes go to the external tensor
    assert torch.equal(external[6:9], torch.zeros(3))
    assert torch.equal(fpw.flat_param.detach(), before)
    with pytest.raises(ValueError, match="13 elements"):
        with fpw.unflatten_params(flat_params=[torch.zeros(12)]):
            pass
    assert fpw.is_flattened
    with pytest.raises(ValueError, match="one external tensor per flat parameter"):
        with fpw.unflatten_params(flat_params=[external, external]):
            pass
    with fpw.unflatten_params():
        with pytest.raises(ValueError, match="needs a flattened wrapper"):
            with fpw.unflatten_params(flat_params=[external]):
                pass


def test_unflatten_params_restores_on_exception() -> None:
    fpw: Any = FlattenParamsWrapper(make_seq())
    flat: Any = fpw.flat_param
    with pytest.raises(KeyError):
        with fpw.unflatten_params():
            raise KeyError("boom")
    assert fpw.is_flattened and fpw.flat_param is flat
    assert [n for n, _ in fpw.named_parameters()] == ["flat_param_0"]
    assert not isinstance(fpw.module[0].weight, nn.Parameter)
    fpw(torch.randn(2, 2)).sum().backward()
    assert flat.grad is not None


# -------------------------------------------------------------------------------------- pickling and copying


def test_flat_parameter_pickle_round_trip() -> None:
    fpw: Any = FlattenParamsWrapper(make_seq())
    flat: Any = pickle.loads(pickle.dumps(fpw.flat_param))
    assert type(flat) is FlatParameter and flat.requires_grad
    assert torch.equal(flat, fpw.flat_param)
    assert flat._param_numels == [6, 3, 3, 1] and flat._param_shapes == fpw.flat_param._param_shapes
    assert [(m, n) for m, _, n in flat._param_infos] == [(m, n) for m, _, n in fpw.flat_param._param_infos]
    frozen = pickle.loads(pickle.dumps(FlatParameter([torch.ones(2)], requires_grad=False)))
    assert not frozen.requires_grad and frozen._param_numels == [2]
    assert type(frozen).__module__ == "fairscale.nn.misc.flatten_params_wrapper"


def test_wrapper_pickle_round_trip() -> None:
    ref, fpw = wrap_copy(make_rich())
    clone: Any = pickle.loads(pickle.dumps(fpw))
    assert_state_dicts_equal(clone.state_dict(), fpw.state_dict())
    # The views of the unpickled wrapper alias its own flat parameter, even before the first forward.
    storage = clone.flat_param.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == storage for v in clone.module._unflattened_param_views)
    x = rich_input()
    out = clone(x)
    assert torch.equal(out, ref(x))
    out.sum().backward()
    assert clone.flat_param.grad is not None


def test_deepcopy() -> None:
    ref, fpw = wrap_copy(make_rich())
    clone: Any = copy.deepcopy(fpw)
    assert clone.flat_param.data_ptr() != fpw.flat_param.data_ptr()
    x = rich_input()
    assert torch.equal(clone(x), ref(x)) and torch.equal(fpw(x), ref(x))
    assert clone.module.head.weight is clone.module.embed.weight
    clone(x).sum().backward()
    assert clone.flat_param.grad is not None and fpw.flat_param.grad is None
    lone: Any = FlatParameter([torch.ones(2, 2), torch.zeros(3)], requires_grad=False)
    lone.extra_tag = "kept"  # attributes owners attach (e.g. FSDP's) survive a deep copy
    lone_copy: Any = copy.deepcopy(lone)
    assert type(lone_copy) is FlatParameter and not lone_copy.requires_grad and torch.equal(lone_copy, lone)
    assert lone_copy._param_shapes == [torch.Size([2, 2]), torch.Size([3])]
    assert getattr(lone_copy, "extra_tag") == "kept"


# ------------------------------------------------------------------------------------ API surface and errors


def test_forwarding_and_metadata() -> None:
    fpw: Any = FlattenParamsWrapper(make_seq(), optimize_backward_concat=True)
    assert fpw.optimize_backward_concat is True and fpw._view_builder is None
    assert fpw[0] is fpw.module[0] and fpw.module is fpw._fpw_module
    assert fpw.training is True and fpw[1][0].in_features == 3  # attribute forwarding via indexing
    names, shapes, numels = fpw.metadata(0)
    assert names == ["_fpw_module.0.weight", "_fpw_module.0.bias", "_fpw_module.1.0.weight", "_fpw_module.1.0.bias"]
    assert shapes == [torch.Size([3, 2]), torch.Size([3]), torch.Size([1, 3]), torch.Size([1])]
    assert numels == [6, 3, 3, 1]
    assert [v.shape for v in fpw.get_param_views()] == shapes
    assert [v.shape for v in fpw.get_param_views([torch.zeros(13)])] == shapes
    with pytest.raises(ValueError, match="out of range"):
        fpw.metadata(1)
    with pytest.raises(AttributeError):
        fpw.no_such_attribute


def test_getattr_forwards_to_wrapped_module() -> None:
    class WithAttr(nn.Linear):
        custom = "hello"

    fpw: Any = FlattenParamsWrapper(WithAttr(2, 2))
    assert fpw.custom == "hello" and fpw.in_features == 2


def test_flat_parameter_validation() -> None:
    with pytest.raises(ValueError, match="non-empty list or tuple"):
        FlatParameter([])
    with pytest.raises(ValueError, match="non-empty list or tuple"):
        FlatParameter(torch.ones(3))  # type: ignore[arg-type]
    flat: Any = FlatParameter([torch.ones(2), torch.ones(3)])
    with pytest.raises(ValueError, match="cannot be nested"):
        FlatParameter([flat])
    with pytest.raises(ValueError, match="5 elements"):
        list(flat.get_param_views(torch.zeros(4)))
    with pytest.raises(ValueError, match="share dtype"):
        FlatParameter([torch.ones(2), torch.ones(2, dtype=torch.float64)])
    assert flat._param_numels == [2, 3] and flat._param_infos == [] and flat._shared_param_infos == []
    assert flat.metadata() == ([], [torch.Size([2]), torch.Size([3])], [2, 3])


def test_wrapper_validation_errors_name_the_params() -> None:
    m: Any = make_seq()
    with pytest.raises(ValueError, match=r"'0\.weight' is listed in param_list groups 0 and 1"):
        FlattenParamsWrapper(m, param_list=[[m[0].weight], [m[0].weight, m[0].bias]])
    m = make_seq()
    m[1][0].double()
    with pytest.raises(
        ValueError, match=r"mixes dtypes: 0\.weight \(torch\.float32\).*1\.0\.weight \(torch\.float64\)"
    ):
        FlattenParamsWrapper(m)
    m = make_seq()
    m[0].bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"mixes requires_grad: .*0\.bias \(False\)"):
        FlattenParamsWrapper(m)
    m = make_seq()
    with pytest.raises(ValueError, match="not a parameter of the wrapped module"):
        FlattenParamsWrapper(m, param_list=[nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="not a mix"):
        FlattenParamsWrapper(m, param_list=[m[0].weight, [m[0].bias]])
    with pytest.raises(ValueError, match=r"not a mapping; pass list\(d.values\(\)\)"):
        FlattenParamsWrapper(m, param_list=dict(m.named_parameters()))  # was "not a mix ... ['str']"
    with pytest.raises(ValueError, match="2 entries but there are 1"):
        FlattenParamsWrapper(make_seq(), flat_param_names=["a", "b"])
    with pytest.raises(ValueError, match="unique"):
        m = make_seq()
        FlattenParamsWrapper(m, param_list=[[m[0].weight], [m[0].bias]], flat_param_names=["a", "a"])
    with pytest.raises(TypeError, match="optimize_backward_concat must be a bool"):
        FlattenParamsWrapper(make_seq(), optimize_backward_concat=1)  # type: ignore[arg-type]


def test_nested_wrapper_rejected_unless_excluded() -> None:
    inner: Any = FlattenParamsWrapper(nn.Linear(2, 2))
    outer_module = nn.Sequential(inner, nn.Linear(2, 1))
    with pytest.raises(ValueError, match="already a FlatParameter"):
        FlattenParamsWrapper(outer_module)
    outer: Any = FlattenParamsWrapper(outer_module, param_list=list(outer_module[1].parameters()))
    x = torch.randn(3, 2)
    expected = outer_module[1](inner(x))
    assert torch.equal(outer(x), expected)
    assert list(outer.state_dict().keys()) == ["0.weight", "0.bias", "1.weight", "1.bias"]


@pytest.mark.parametrize("unflattened", [False, True])
def test_assigning_a_forwarded_name_raises(unflattened: bool) -> None:
    # fpw.weight reads the wrapped Linear's weight; assigning there failed with torch's KeyError (a Parameter) or
    # stored a tensor on the wrapper that hid the real weight from later reads.
    torch.manual_seed(0)
    ref = nn.Linear(3, 2)
    fpw = FlattenParamsWrapper(copy.deepcopy(ref))
    x = torch.randn(4, 3)
    with fpw.unflatten_params() if unflattened else contextlib.nullcontext():
        for value in (nn.Parameter(torch.zeros(2, 3)), torch.zeros(2, 3)):
            with pytest.raises(AttributeError, match="FlattenParamsWrapper: cannot assign .* to 'weight'"):
                fpw.weight = value
        fpw.extra = torch.ones(1)  # not a name of the wrapped module: stored on the wrapper, as before
    assert "weight" not in fpw.__dict__ and torch.equal(fpw.extra, torch.ones(1))
    torch.testing.assert_close(fpw(x), ref(x))


class _CheckpointedPair(nn.Module):
    def __init__(self, reentrant: bool = True) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.reentrant = reentrant

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(self.b, self.a(x), use_reentrant=self.reentrant)


def test_no_grad_forward_before_the_backward_keeps_checkpointed_gradients() -> None:
    # The checkpointed layer is recomputed in the backward from the views its module holds then; a no_grad forward in
    # between left it views without a path to the flat parameter, and its gradient was lost (zero), silently.
    torch.manual_seed(0)
    ref = _CheckpointedPair()
    fpw = FlattenParamsWrapper(copy.deepcopy(ref))
    x, other = torch.randn(4, 3), torch.randn(2, 3)
    for model in (ref, fpw):
        out = model(x)
        with torch.no_grad():
            model(other)
        out.pow(2).sum().backward()
    flat_grad = fpw.flat_param.grad
    expected = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    assert torch.count_nonzero(flat_grad[-12:]) > 0  # b's weight and bias: the checkpointed layer
    torch.testing.assert_close(flat_grad, expected)


@pytest.mark.parametrize("between", ["forward", "state_dict"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_no_grad_forward_before_the_backward_with_a_frozen_first_group(reentrant: bool, between: str) -> None:
    # Several flat parameters, the first frozen (frozen embeddings): whether to keep the training forward's views was
    # asked of the first view alone, which has no graph then, so the checkpointed layers lost their gradients
    # (reentrant: None, silently) or torch's non-reentrant checkpoint raised CheckpointError (found by a fuzz of FSDP
    # with ordinary torch code, session 41).
    torch.manual_seed(0)
    ref = _CheckpointedPair(reentrant)
    ref.a.requires_grad_(False)
    module = copy.deepcopy(ref)
    fpw = FlattenParamsWrapper(module, param_list=[list(module.a.parameters()), list(module.b.parameters())])
    x = torch.randn(4, 3, requires_grad=True)  # the reentrant checkpoint needs an input that requires grad
    for model in (ref, fpw):
        out = model(x)
        with torch.no_grad():
            if between == "forward":
                model(torch.randn(2, 3))
            else:  # the same decision in unflatten_params(), which state_dict() uses (found by a review)
                model.state_dict()
        out.pow(2).sum().backward()
    assert fpw.flat_params[0].grad is None
    torch.testing.assert_close(fpw.flat_params[1].grad, torch.cat([p.grad.reshape(-1) for p in ref.b.parameters()]))


class _NamedLikeAFlatParameter(nn.Module):
    def __init__(self, kind: str, name: str) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        if kind == "parameter":
            self.register_parameter(name, nn.Parameter(torch.randn(3)))
        elif kind == "buffer":
            self.register_buffer(name, torch.randn(3))
        else:
            self.add_module(name, nn.Linear(3, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x)


@pytest.mark.parametrize("kind", ["parameter", "buffer", "module"])
@pytest.mark.parametrize("name", ["flat_param", "flat_param_x", "flat_param_0"])
def test_members_named_like_flat_parameters_are_refused(kind: str, name: str) -> None:
    # The wrapper's state dict keys name the module's top-level members beside its flat parameters: such a member
    # was taken for a flat parameter when loading (the wrapper could not load its own state_dict()), or clashed at
    # construction ("KeyError: attribute 'flat_param_0' already exists").
    with pytest.raises(ValueError, match=rf"member\(s\) named \['{name}'\].*rename them"):
        FlattenParamsWrapper(_NamedLikeAFlatParameter(kind, name))
    holder = nn.Sequential(_NamedLikeAFlatParameter(kind, name))  # one level down the keys carry a prefix: fine
    wrapper = FlattenParamsWrapper(holder)
    wrapper.load_state_dict(copy.deepcopy(wrapper.state_dict()))
