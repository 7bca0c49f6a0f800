# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Full and local state dicts of FSDP: keys and values against the unwrapped reference, round trips, loading a
checkpoint at other world sizes, upstream-format fixtures, and all-or-nothing loads on bad input.

Most checks run as sub-cases inside one 2-rank world; the world-size matrix (1, 3, 4) reuses one world per size.
"""

import functools
import re
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from _models import (
    ModelWithBatchNorm,
    NestedWrappedModule,
    TransformerWithSharedParams,
    build,
    global_batch,
    local_slice,
    reference_loss,
    scaled_loss,
    wrap_model,
)
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import get_fsdp_instances

# name -> (model class, wrap mode, FSDP kwargs)
CONFIGS: Dict[str, Tuple[Callable[[], nn.Module], str, Dict[str, Any]]] = {
    "nested-flat": (NestedWrappedModule, "nested", {}),
    "nested-nonflat": (NestedWrappedModule, "nested", {"flatten_parameters": False}),
    "one-flat": (NestedWrappedModule, "one", {}),
    "leaf-flat": (NestedWrappedModule, "leaf", {}),
    "nested-mixed": (NestedWrappedModule, "nested", {"mixed_precision": True}),
    "bn-flat": (ModelWithBatchNorm, "nested", {}),
    "bn-mixed": (ModelWithBatchNorm, "one", {"mixed_precision": True}),
    "shared-flat": (TransformerWithSharedParams, "nested", {}),
}


def _make(name: str, seed: int = 1) -> Tuple[FSDP, nn.Module]:
    model_cls, mode, kwargs = CONFIGS[name]
    model, ref = build(model_cls, seed)
    return wrap_model(model, {"bucket_cap_mb": 0, **kwargs}, mode), ref


def _step_replicated(fsdp: FSDP, ref: nn.Module, opt: Any, ref_opt: Any, step: int) -> None:
    """One SGD step; every rank sees the whole batch, so FSDP, its buffers (BatchNorm) and the reference agree."""
    batch = global_batch(ref, step, 4)
    for model, optim in ((fsdp, opt), (ref, ref_opt)):
        optim.zero_grad()
        type(ref).per_sample_loss(model(*batch)).mean().backward()  # type: ignore[attr-defined]
        optim.step()


def _trained(name: str, steps: int = 1, seed: int = 1) -> Tuple[FSDP, nn.Module]:
    fsdp, ref = _make(name, seed)
    opt, ref_opt = torch.optim.SGD(fsdp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        _step_replicated(fsdp, ref, opt, ref_opt, step)
    return fsdp, ref


def _tol(name: str) -> Dict[str, float]:
    return {"rtol": 2e-2, "atol": 2e-2} if "mixed" in name else {"rtol": 1e-5, "atol": 1e-6}


def _assert_matches_reference(sd: Dict[str, Tensor], ref: nn.Module, name: str) -> None:
    expected = ref.state_dict()
    if name.startswith("shared"):
        # Tied weights: the order is checked by test_tied_weight_keys_keep_module_order.
        assert sorted(sd) == sorted(expected), f"{name}: keys {sorted(sd)} != unwrapped module's {sorted(expected)}"
    else:
        assert list(sd) == list(expected), f"{name}: keys {list(sd)} != unwrapped module's {list(expected)}"
    for key, value in expected.items():
        assert sd[key].dtype == value.dtype, f"{name} {key}: dtype {sd[key].dtype} != {value.dtype}"
        torch.testing.assert_close(sd[key], value, msg=lambda m: f"{name} {key}: {m}", **_tol(name))


def _assert_equal(actual: Dict[str, Tensor], expected: Dict[str, Tensor], what: str) -> None:
    assert list(actual) == list(expected), f"{what}: keys differ: {list(actual)} vs {list(expected)}"
    for key, value in expected.items():
        assert torch.equal(actual[key], value), f"{what}: {key} differs"


def _snapshot(fsdp: FSDP) -> Dict[str, Tensor]:
    """Every local shard and buffer, copied (what a failed load must leave untouched)."""
    return {k: v.clone() for k, v in fsdp.local_state_dict().items()}


# ------------------------------------------------------------------------------------------------------ 2 ranks


def _case_keys_and_values(name: str) -> None:
    fsdp, ref = _trained(name)
    first = fsdp.state_dict()
    _assert_matches_reference(first, ref, name)
    second = fsdp.state_dict()
    _assert_equal(second, first, f"{name}: second call")
    # Values are copies: editing the returned dict changes neither the model nor the next state dict.
    for value in first.values():
        value.add_(1)
    _assert_equal(fsdp.state_dict(), second, f"{name}: after editing a returned dict")


def _case_before_first_forward(name: str) -> None:
    fsdp, ref = _make(name)
    _assert_matches_reference(fsdp.state_dict(), ref, name)
    assert all(m._is_root is None for m in get_fsdp_instances(fsdp)), "lazy init was not undone"
    # Still movable: a dtype change goes through as before the first forward.
    fsdp, ref = fsdp.double(), ref.double()
    batch = tuple(t.double() if t.is_floating_point() else t for t in global_batch(ref, 0, 4))
    torch.testing.assert_close(fsdp(*batch), ref(*batch))
    assert all(v.dtype == torch.float64 for k, v in fsdp.state_dict().items() if v.is_floating_point())


def _case_full_round_trip(name: str) -> None:
    a, ref = _trained(name)
    b, _ = _make(name, seed=2)
    b.load_state_dict(a.state_dict())
    _assert_equal(b.state_dict(), a.state_dict(), f"{name}: full round trip")
    _assert_equal(b.local_state_dict(), a.local_state_dict(), f"{name}: shards after full round trip")
    # Training continues identically.
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    batch = global_batch(ref, 5, 4)
    for model, optim in ((a, opt_a), (b, opt_b)):
        optim.zero_grad()
        type(ref).per_sample_loss(model(*batch)).mean().backward()  # type: ignore[attr-defined]
        optim.step()
    _assert_equal(b.state_dict(), a.state_dict(), f"{name}: one step after the round trip")


def _case_local_round_trip(name: str) -> None:
    a, _ = _trained(name)
    b, _ = _make(name, seed=2)
    local = a.local_state_dict()
    b.load_local_state_dict(local)
    _assert_equal(b.local_state_dict(), local, f"{name}: local round trip")
    _assert_equal(b.state_dict(), a.state_dict(), f"{name}: full dict after local round trip")


def _case_into_plain_module(name: str) -> None:
    fsdp, ref = _trained(name)
    plain = CONFIGS[name][0]()
    plain.load_state_dict(fsdp.state_dict(), strict=True)
    _assert_matches_reference(plain.state_dict(), ref, name)


def _case_local_key_format() -> None:
    """Spec 2.3: ``[path.]flat_param_0`` padded 1-D shards, non-flattened params by name, buffers by name."""
    fsdp, _ = _make("bn-flat")  # root owns fc1/fc2, nested instance at "bn" with 3 buffers
    sd = fsdp.local_state_dict()
    expected = ["flat_param_0", "bn.flat_param_0", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    assert list(sd) == expected
    assert sd["flat_param_0"].shape == (42,) and sd["bn.flat_param_0"].shape == (8,)  # (48+8+24+3)=83 -> 42; 16 -> 8
    fsdp, _ = _make("nested-nonflat")
    sd = fsdp.local_state_dict()
    assert sd["layers.0.weight"].shape == (18,) and sd["layers.1.0.weight"].shape == (23,)  # 35 -> 18, 45 -> 23
    # Mixed precision keeps buffers in the compute dtype; both formats carry them in fp32, as upstream (the local
    # one carried fp16 buffers, and so did the full dict consolidate_shard_weights built from it).
    fsdp, _ = _make("bn-mixed")
    fsdp(torch.randn(4, 6)).float().sum().backward()  # casts the buffers at lazy init
    assert fsdp.module.bn.running_var.dtype == torch.float16
    for sd in (fsdp.local_state_dict(), fsdp.state_dict()):
        assert sd["bn.running_var"].dtype == sd["bn.running_mean"].dtype == torch.float32
    assert fsdp.module.bn.running_var.dtype == torch.float16  # the model keeps its own


def _bad_full_dicts(model: FSDP) -> List[Tuple[str, Dict[str, Tensor], str]]:
    """(what, bad full dict, the key the error must name) for NestedWrappedModule wrapped "nested"."""
    good = model.state_dict()
    missing = {k: v for k, v in good.items() if k != "layers.1.0.bias"}
    unexpected = dict(good, **{"layers.9.weight": torch.zeros(2)})
    wrong_shape = dict(good, **{"layers.2.0.weight": torch.zeros(5, 4)})
    return [
        ("missing key", missing, "layers.1.0.bias"),
        ("unexpected key", unexpected, "layers.9.weight"),
        ("wrong shape", wrong_shape, "layers.2.0.weight"),
    ]


def _case_bad_input_leaves_model_unchanged(name: str) -> None:
    fsdp, _ = _trained(name)
    other, _ = _make(name, seed=3)
    before, full_before = _snapshot(fsdp), fsdp.state_dict()
    local = other.local_state_dict()
    first_key = next(iter(local))
    bad_loads = [(what, functools.partial(fsdp.load_state_dict, bad), key) for what, bad, key in _bad_full_dicts(other)]
    bad_loads += [
        ("missing local key", functools.partial(fsdp.load_local_state_dict, _without(local, first_key)), first_key),
        (
            "unexpected local key",
            functools.partial(fsdp.load_local_state_dict, dict(local, extra=torch.zeros(3))),
            "extra",
        ),
    ]
    for what, load, key in bad_loads:
        with pytest.raises(RuntimeError, match=re.escape(key)):
            load()
        _assert_equal(_snapshot(fsdp), before, f"{name}: shards after a failed load ({what})")
        _assert_equal(fsdp.state_dict(), full_before, f"{name}: full dict after a failed load ({what})")


def _without(sd: Dict[str, Tensor], key: str) -> Dict[str, Tensor]:
    return {k: v for k, v in sd.items() if k != key}


def _case_between_forward_and_backward() -> None:
    """state_dict() is safe between a forward and its backward; loads then raise (docs/checkpointing.rst)."""
    fsdp, twin = _make("nested-flat")[0], _make("nested-flat")[0]
    batch = global_batch(NestedWrappedModule(), 0, 4)
    idle = fsdp.state_dict()
    loss = NestedWrappedModule.per_sample_loss(fsdp(*batch)).sum()
    _assert_equal(fsdp.state_dict(), idle, "state_dict between forward and backward")
    with pytest.raises(RuntimeError, match="between a forward and its backward"):
        fsdp.load_state_dict(idle)
    with pytest.raises(RuntimeError, match="between a forward and its backward"):
        fsdp.load_local_state_dict(fsdp.local_state_dict())
    loss.backward()
    NestedWrappedModule.per_sample_loss(twin(*batch)).sum().backward()
    for p, q in zip(fsdp.parameters(), twin.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), "the pending backward changed"
    fsdp.load_state_dict(idle)  # idle again: loading works


def _ws2_body(rank: int, world_size: int) -> None:
    cases: List[Tuple[str, Callable[[], Any]]] = []
    for name in CONFIGS:
        cases.append((f"keys_and_values[{name}]", functools.partial(_case_keys_and_values, name)))
    for name in ("nested-flat", "nested-nonflat", "one-flat"):
        cases.append((f"before_first_forward[{name}]", functools.partial(_case_before_first_forward, name)))
    for name in ("nested-flat", "nested-nonflat", "bn-mixed", "shared-flat"):
        cases.append((f"full_round_trip[{name}]", functools.partial(_case_full_round_trip, name)))
        cases.append((f"local_round_trip[{name}]", functools.partial(_case_local_round_trip, name)))
        cases.append((f"into_plain_module[{name}]", functools.partial(_case_into_plain_module, name)))
    for name in ("nested-flat", "nested-nonflat"):
        cases.append((f"bad_input[{name}]", functools.partial(_case_bad_input_leaves_model_unchanged, name)))
    cases.append(("local_key_format", _case_local_key_format))
    cases.append(("between_forward_and_backward", _case_between_forward_and_backward))
    run_cases(cases)


def test_state_dicts_two_ranks() -> None:
    run_distributed(_ws2_body, 2)


def _error_messages_body(rank: int, world_size: int) -> None:
    fsdp, _ = _make("nested-nonflat")
    cases: List[Tuple[str, Callable[[], Any]]] = []

    def expect(load: Callable[[], Any], key: str) -> None:
        with pytest.raises(RuntimeError) as info:
            load()
        message = str(info.value)
        assert key in message and "_fsdp_wrapped_module" not in message and "_fpw_module" not in message, message

    for what, bad, key in _bad_full_dicts(_make("nested-nonflat", seed=3)[0]):
        cases.append((what, functools.partial(expect, functools.partial(fsdp.load_state_dict, bad), key)))
    local = fsdp.local_state_dict()
    missing_local = functools.partial(fsdp.load_local_state_dict, _without(local, "layers.1.0.bias"))
    cases.append(("missing local key", functools.partial(expect, missing_local, "layers.1.0.bias")))
    flat, _ = _make("nested-flat")
    missing_flat = functools.partial(flat.load_local_state_dict, _without(flat.local_state_dict(), "flat_param_0"))
    cases.append(("missing local flat key", functools.partial(expect, missing_flat, "flat_param_0")))
    run_cases(cases)


def test_load_errors_name_the_clean_key() -> None:
    run_distributed(_error_messages_body, 2)


def _tied_order_body(rank: int, world_size: int) -> None:
    fsdp, ref = _make("shared-flat")
    assert list(fsdp.state_dict()) == list(ref.state_dict())


def test_tied_weight_keys_keep_module_order() -> None:
    """Spec 2.2: the unwrapped module's keys *in its order*, also for a tied weight (``output_proj.weight``)."""
    run_distributed(_tied_order_body, 1)


# ------------------------------------------------------------------------------------------------------ other sizes


def _train_sliced(fsdp: FSDP, ref: nn.Module, rank: int, world_size: int, steps: range) -> List[float]:
    """Data-parallel steps: each rank its slice of the global batch, the reference the whole batch."""
    opt, ref_opt = torch.optim.SGD(fsdp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for step in steps:
        batch = global_batch(ref, step, 12)
        opt.zero_grad()
        scaled_loss(type(ref), fsdp(*local_slice(batch, rank, world_size)), 12, world_size).backward()
        opt.step()
        ref_opt.zero_grad()
        ref_loss = reference_loss(ref, batch, world_size)
        ref_loss.backward()
        ref_opt.step()
        losses.append(ref_loss.item())
    return losses


def _save_at_ws2(rank: int, world_size: int) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    fsdp, ref = _make("nested-flat")
    _train_sliced(fsdp, ref, rank, world_size, range(2))
    _assert_matches_reference(fsdp.state_dict(), ref, "ws2 checkpoint")
    return fsdp.state_dict(), fsdp.local_state_dict()


def _resume_body(rank: int, world_size: int, full: Dict[str, Tensor], ws2_local: Dict[str, Tensor]) -> None:
    def resume(name: str) -> None:
        fsdp, _ = _make(name, seed=5)
        ref = CONFIGS[name][0]()
        ref.load_state_dict(full)
        fsdp.load_state_dict(full)
        _assert_matches_reference(fsdp.state_dict(), ref, f"{name} loaded at {world_size} ranks")
        _train_sliced(fsdp, ref, rank, world_size, range(2, 4))
        _assert_matches_reference(fsdp.state_dict(), ref, f"{name} trained at {world_size} ranks after loading")

    def wrong_world_size_local() -> None:
        fsdp, _ = _make("nested-flat", seed=5)
        before = _snapshot(fsdp)
        with pytest.raises(RuntimeError, match=r"(?s)another world size.*flat_param_0: got \(29,\)"):
            fsdp.load_local_state_dict(ws2_local)
        _assert_equal(_snapshot(fsdp), before, "shards after loading a local dict of another world size")

    def buffers(name: str) -> None:
        fsdp, ref = _trained(name, steps=2)
        _assert_matches_reference(fsdp.state_dict(), ref, f"{name} at {world_size} ranks")

    cases: List[Tuple[str, Callable[[], Any]]] = [
        ("resume[nested-flat]", functools.partial(resume, "nested-flat")),
        ("resume[nested-nonflat]", functools.partial(resume, "nested-nonflat")),
        ("keys_and_values[bn-flat]", functools.partial(buffers, "bn-flat")),
        ("keys_and_values[shared-flat]", functools.partial(buffers, "shared-flat")),
    ]
    if world_size > 1:
        cases.append(("wrong_world_size_local", wrong_world_size_local))
    run_cases(cases)


def test_checkpoint_from_two_ranks_resumes_at_other_world_sizes() -> None:
    full, local = run_distributed(_save_at_ws2, 2)[0]
    for world_size in (1, 3, 4):
        run_distributed(_resume_body, world_size, full, local)


# ------------------------------------------------------------------------------------------------------ fixtures


def _upstream_fixture(world_size: int, rank: int) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    """(full dict, this rank's local dict) of ModelWithBatchNorm wrapped "nested", written from spec 2.2/2.3."""
    gen = torch.Generator().manual_seed(11)
    full = {
        "fc1.weight": torch.randn(8, 6, generator=gen),
        "fc1.bias": torch.randn(8, generator=gen),
        "bn.weight": torch.randn(8, generator=gen),
        "bn.bias": torch.randn(8, generator=gen),
        "bn.running_mean": torch.randn(8, generator=gen),
        "bn.running_var": torch.rand(8, generator=gen) + 0.5,
        "bn.num_batches_tracked": torch.tensor(3),
        "fc2.weight": torch.randn(3, 8, generator=gen),
        "fc2.bias": torch.randn(3, generator=gen),
    }

    def shard(names: List[str]) -> Tensor:
        flat = torch.cat([full[n].reshape(-1) for n in names])
        size = -(-flat.numel() // world_size)
        piece = flat[rank * size : (rank + 1) * size]
        return torch.cat([piece, piece.new_zeros(size - piece.numel())])

    local = {
        "flat_param_0": shard(["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]),  # 83 elements
        "bn.flat_param_0": shard(["bn.weight", "bn.bias"]),
        "bn.running_mean": full["bn.running_mean"],
        "bn.running_var": full["bn.running_var"],
        "bn.num_batches_tracked": full["bn.num_batches_tracked"],
    }
    return full, local


def _fixture_body(rank: int, world_size: int) -> None:
    full, local = _upstream_fixture(world_size, rank)
    fsdp, _ = _make("bn-flat", seed=4)
    fsdp.load_local_state_dict(local)
    sd = fsdp.state_dict()
    assert sorted(sd) == sorted(full)
    for key, value in full.items():
        assert torch.equal(sd[key], value), key
    fsdp, _ = _make("bn-flat", seed=4)
    fsdp.load_state_dict(full)
    _assert_equal(fsdp.local_state_dict(), local, "local dict after loading the full fixture")


def test_upstream_format_fixture_loads() -> None:
    run_distributed(_fixture_body, 3)  # 83 elements over 3 ranks: 28 + 28 + 27 (+1 padding)
