# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``auto_wrap_bn``: every batch-norm layer in its own fp32, non-flat, non-resharding FSDP instance.

Tagging and argument checks run in one process; wrapping and training run on a 2-rank gloo world.
"""

import copy
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from _models import assert_close_dict, assert_idle, assert_update_close, full_params, local_slice, ref_params
from torch import Tensor, nn

import fairscale.nn.data_parallel
from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal import collectives
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import get_fsdp_instances
from fairscale.nn.data_parallel._fsdp.batchnorm_wrap import auto_wrap_bn
from fairscale.nn.wrap import auto_wrap, config_auto_wrap_policy, enable_wrap

WS = 2
TIMEOUT = 120.0
DEFAULT_CONFIG = {
    "mixed_precision": False,
    "flatten_parameters": False,
    "reshard_after_forward": False,
    "bucket_cap_mb": 0,
    "force_input_to_fp32": False,
}


class ConvNet(nn.Module):
    """conv -> BN2d -> relu -> [linear -> BN1d] -> linear; BN layers at two depths."""

    def __init__(self) -> None:
        super().__init__()
        # No bias before a batch norm (it would cancel out): its gradient is zero up to rounding.
        self.conv = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.bn2d = nn.BatchNorm2d(4)
        self.trunk = nn.Sequential(nn.Linear(4 * 3 * 3, 7, bias=False), nn.BatchNorm1d(7))
        self.head = nn.Linear(7, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.bn2d(self.conv(x)))
        return self.head(torch.tanh(self.trunk(h.flatten(1))))


BN_PATHS = ["bn2d", "trunk.1"]


def _sample(step: int, n: int) -> Tensor:
    return torch.randn(n, 2, 3, 3, generator=torch.Generator().manual_seed(10 + step))


def _loss(out: Tensor, global_n: int, scale: int) -> Tensor:
    return (out.float() - 0.2).pow(2).sum() * (scale / global_n)


# ------------------------------------------------------------------------------------------------------ no world


def test_exported_from_data_parallel() -> None:
    # The public path of upstream; this distribution keeps the implementation in _fsdp/batchnorm_wrap.py.
    assert getattr(fairscale.nn.data_parallel, "auto_wrap_bn", None) is auto_wrap_bn


def test_wrap_it_false_only_tags_batchnorm_layers() -> None:
    model = ConvNet()
    sync_bn = nn.SyncBatchNorm(3)
    model.add_module("extra", sync_bn)
    before = copy.deepcopy(model.state_dict())
    out = auto_wrap_bn(model, wrap_it=False)
    assert out is model
    tagged = {name for name, m in model.named_modules() if hasattr(m, "wrapper_config")}
    assert tagged == set(BN_PATHS) | {"extra"}, "every _BatchNorm (incl. SyncBatchNorm), nothing else"
    for name in tagged:
        config = model.get_submodule(name).wrapper_config
        assert config == dict(DEFAULT_CONFIG, process_group=None)
    # One dict per layer: editing one layer's config must not change another's.
    assert model.bn2d.wrapper_config is not model.trunk[1].wrapper_config
    assert not any(isinstance(m, FSDP) for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_collision_raises_unless_allowed() -> None:
    model = ConvNet()
    setattr(model.trunk[1], "wrapper_config", {"mixed_precision": True})
    with pytest.raises(ValueError, match=r"'trunk\.1' already has a wrapper_config.*assert_on_collision=False"):
        auto_wrap_bn(model, wrap_it=False)
    auto_wrap_bn(model, wrap_it=False, assert_on_collision=False)
    assert model.trunk[1].wrapper_config == dict(DEFAULT_CONFIG, process_group=None)


def test_custom_fsdp_config_is_used_as_given() -> None:
    model = ConvNet()
    auto_wrap_bn(model, wrap_it=False, fsdp_config={"mixed_precision": True, "flatten_parameters": True})
    assert model.bn2d.wrapper_config == {"mixed_precision": True, "flatten_parameters": True}


def test_bad_arguments_raise_clear_errors() -> None:
    with pytest.raises(TypeError, match="expects an nn.Module"):
        auto_wrap_bn("not a module")
    with pytest.raises(TypeError, match="fsdp_config must be a dict"):
        auto_wrap_bn(ConvNet(), fsdp_config=[("mixed_precision", False)])
    with pytest.raises(ValueError, match="either single_rank_pg=True .* or a process_group"):
        auto_wrap_bn(ConvNet(), single_rank_pg=True, process_group=object(), wrap_it=False)
    with pytest.raises(ValueError, match="fsdp_config names a process_group"):
        auto_wrap_bn(ConvNet(), process_group=object(), fsdp_config={"process_group": object()}, wrap_it=False)
    with pytest.raises(RuntimeError, match="needs torch.distributed to be initialized"):
        auto_wrap_bn(ConvNet(), single_rank_pg=True, wrap_it=False)


def test_inside_enable_wrap_needs_wrap_it_false() -> None:
    model = ConvNet()
    with enable_wrap(wrapper_cls=nn.Identity):
        with pytest.raises(NotImplementedError, match="inside an enable_wrap"):
            auto_wrap_bn(model)
        # Tagging alone is fine inside a context: the enclosing auto_wrap honours the tags later.
        assert auto_wrap_bn(model, wrap_it=False) is model
    assert hasattr(model.bn2d, "wrapper_config")


# ------------------------------------------------------------------------------------------------------ gloo world


def _check_bn_instance(inst: FSDP, expected_group: Any) -> None:
    assert isinstance(inst.module.module, nn.modules.batchnorm._BatchNorm)
    assert inst.mixed_precision is False and inst.flatten_parameters is False
    assert inst.reshard_after_forward is False and inst.bucket_cap_mb == 0 and inst.force_input_to_fp32 is False
    assert inst.process_group is expected_group
    assert all(p.dtype == torch.float32 for p in inst.params)


def _wraps_every_bn_and_nothing_else(rank: int) -> None:
    model = auto_wrap_bn(ConvNet())
    wrapped = {name for name, m in model.named_modules() if isinstance(m, FSDP)}
    assert wrapped == set(BN_PATHS), wrapped
    assert isinstance(model, ConvNet), "the root is not a batch-norm layer, so it stays unwrapped"
    for path in BN_PATHS:
        _check_bn_instance(model.get_submodule(path), get_fsdp_instances(model)[0].process_group)
        assert model.get_submodule(path).world_size == WS
    # A batch-norm root is wrapped itself.
    root = auto_wrap_bn(nn.BatchNorm1d(5))
    assert isinstance(root, FSDP) and isinstance(root.module.module, nn.BatchNorm1d)
    # An explicit group is used as given.
    group = dist.new_group(ranks=list(range(WS)))
    model = auto_wrap_bn(ConvNet(), process_group=group)
    for path in BN_PATHS:
        _check_bn_instance(model.get_submodule(path), group)


def _tags_then_user_auto_wrap(rank: int) -> None:
    """wrap_it=False: the user's own auto_wrap with config_auto_wrap_policy wraps the tagged layers."""
    model = auto_wrap_bn(ConvNet(), wrap_it=False)
    with enable_wrap(config_auto_wrap_policy, wrapper_cls=FSDP, mixed_precision=True):
        model = auto_wrap(model)
    for path in BN_PATHS:
        inst = model.get_submodule(path)
        assert isinstance(inst, FSDP)
        # The layer's wrapper_config overrides the context's mixed_precision=True.
        assert inst.mixed_precision is False and inst.flatten_parameters is False


def _train_like_reference(rank: int, precision: str, steps: int = 3) -> None:
    """FSDP(auto_wrap_bn(model)) trains like the reference; BN weights, grads and statistics stay fp32."""
    mixed = {"fp32": {}, "bf16": {"mixed_precision": True, "compute_dtype": torch.bfloat16}}[precision]
    torch.manual_seed(7)
    ref = ConvNet()
    model = FSDP(auto_wrap_bn(copy.deepcopy(ref)), **mixed)
    init = ref_params(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    n = 8 * WS  # batch norm on a few rows amplifies bf16 rounding; 8 rows per rank keep it moderate
    for step in range(steps):
        batch = _sample(step, n)
        opt.zero_grad()
        _loss(model(local_slice((batch,), rank, WS)[0]), n, WS).backward()
        assert_idle(model)
        for inst in get_fsdp_instances(model)[1:]:
            assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in inst.params)
        opt.step()
        ref_opt.zero_grad()
        # Batch statistics are per rank: the reference sees the same per-rank pieces. Under bf16 it runs the same
        # conv/linear in bf16 through autocast: a batch-norm bias gradient is a sum of cancelling terms, whose bf16
        # rounding alone moves it by ~15% of its small update, on any implementation.
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            ref_loss = torch.stack([_loss(ref(piece), n, 1) for piece in batch.tensor_split(WS)]).sum()
        ref_loss.backward()
        ref_opt.step()
    for path in BN_PATHS:
        for name, buf in model.get_submodule(path).named_buffers():
            assert buf.dtype == (torch.float32 if buf.is_floating_point() else torch.int64), (path, name, buf.dtype)
    if precision == "fp32":
        assert_close_dict(full_params(model), ref_params(ref), "param", rtol=1e-4, atol=1e-5)
    else:
        assert_update_close(full_params(model), ref_params(ref), init, 0.02, "param")


def _single_rank_groups(rank: int) -> None:
    """single_rank_pg=True: BN params unsharded and trained per rank (gradients are not averaged)."""
    torch.manual_seed(7)
    local_ref = ConvNet()
    model = FSDP(auto_wrap_bn(copy.deepcopy(local_ref), single_rank_pg=True))
    for path in BN_PATHS:
        inst = model.get_submodule(path)
        assert inst.world_size == 1 and inst.rank == 0
        assert dist.get_process_group_ranks(inst.process_group) == [rank]
        assert all(not p._is_sharded for p in inst.params)
    x = _sample(0, 4) + rank  # different data per rank
    _loss(model(x), 4, 1).backward()
    _loss(local_ref(x), 4, 1).backward()
    grads: Dict[str, List[Tensor]] = {}
    for path in BN_PATHS:
        inst = model.get_submodule(path)
        names = [n for n, _ in local_ref.get_submodule(path).named_parameters()]
        for name, p in zip(names, inst.params):
            expected = local_ref.get_submodule(path).get_parameter(name).grad
            # This rank's own gradient, not the average over ranks.
            torch.testing.assert_close(p.grad, expected)
            gathered = torch.empty(WS * p.grad.numel())
            collectives.all_gather_into_flat(gathered, p.grad.reshape(-1), None)
            grads[f"{path}.{name}"] = list(gathered.chunk(WS))
    assert any(not torch.equal(g[0], g[1]) for g in grads.values()), "per-rank data must give per-rank BN grads"


def _auto_wrap_bn_on_gloo_world_body(rank: int, world_size: int) -> None:
    cases: List[Tuple[str, Any]] = [
        ("wraps every BN and nothing else", lambda: _wraps_every_bn_and_nothing_else(rank)),
        ("tags then user auto_wrap", lambda: _tags_then_user_auto_wrap(rank)),
        ("trains like reference fp32", lambda: _train_like_reference(rank, "fp32")),
        ("trains like reference bf16", lambda: _train_like_reference(rank, "bf16")),
        ("single_rank_pg", lambda: _single_rank_groups(rank)),
    ]
    run_cases(cases)


def test_auto_wrap_bn_on_gloo_world() -> None:
    run_distributed(_auto_wrap_bn_on_gloo_world_body, WS, timeout=TIMEOUT)
