# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FSDP behaviour that the issue checklists ask for and no other test covered (found by the test audit).

State-dict options (``state_dict_on_rank_0_only``, ``state_dict_device``, pure fp16, fp32 buffers of a nested
mixed-precision instance, before the first forward), ``no_pre_load_state_dict_hook``, a plain parent module holding
FSDP children, ``state_dict()`` inside ``summon_full_params()``, ``load_state_dict(strict=False)``, the MoE rules
(``clip_grad_norm_`` refusal and the automatic ``no_broadcast_optim_state``), ``clear_autocast_cache`` and gradients
after ``.double()``. Every case runs as a sub-test of one 2-rank world.
"""

import weakref
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from _models import (
    MIXED,
    ModelWithBatchNorm,
    NestedWrappedModule,
    assert_idle,
    build,
    full_params,
    global_batch,
    local_slice,
    scaled_loss,
    wrap_model,
)
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal import collectives
from fairscale.internal.collectives import count_collectives
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import get_fsdp_instances, no_pre_load_state_dict_hook

Case = Tuple[str, Callable[[], Any]]


def _assert_same_sd(actual: Dict[str, Tensor], expected: Dict[str, Tensor], what: str) -> None:
    assert list(actual) == list(expected), f"{what}: keys {list(actual)} != {list(expected)}"
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, f"{what} {key}: dtype {actual[key].dtype} != {value.dtype}"
        assert torch.equal(actual[key], value), f"{what} {key}: values differ"


def _all_equal_across_ranks(value: Any) -> bool:
    gathered = collectives.all_gather_object(value)
    return all(v == gathered[0] for v in gathered)


# ------------------------------------------------------------------------------------------------------ state dicts


def _rank_0_only(rank: int) -> None:
    """Spec 1.2 #21: empty dict on every global rank but 0; every rank still takes part in the gathers."""
    model, _ = build(NestedWrappedModule)
    normal = wrap_model(model, {}, "nested")
    model, _ = build(NestedWrappedModule)
    only0 = wrap_model(model, {"state_dict_on_rank_0_only": True}, "nested")
    expected = normal.state_dict()
    with count_collectives() as counter:
        sd = only0.state_dict()
    if rank == 0:
        _assert_same_sd(sd, expected, "rank 0 with state_dict_on_rank_0_only")
    else:
        assert sd == {}, f"rank {rank} got {list(sd)}"
    assert counter.count("all_gather") == 3 and _all_equal_across_ranks(counter.summary()), counter.summary()
    # By *global* rank: rank 1's instance has a 1-rank group in which it is rank 0, and still gets nothing.
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())]
    torch.manual_seed(0)
    own = FSDP(nn.Linear(3, 3), process_group=solo[rank], state_dict_on_rank_0_only=True)
    assert own.rank == 0
    sd = own.state_dict()
    assert (sorted(sd) == ["bias", "weight"]) if rank == 0 else (sd == {}), (rank, list(sd))
    # Under a plain parent module the other ranks lose this instance's entries only: clearing the shared dict dropped
    # the parent's entries written before the instance and kept those after it.
    parent = nn.Sequential(nn.Linear(3, 3), FSDP(nn.Linear(3, 3), state_dict_on_rank_0_only=True), nn.Linear(3, 2))
    sd = parent.state_dict()
    plain = ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert sorted(sd) == (sorted(plain + ["1.bias", "1.weight"]) if rank == 0 else plain), (rank, list(sd))


def _state_dict_device() -> None:
    """Spec 1.2 #16: the values go to ``state_dict_device`` (default: the compute device); the model is untouched."""
    model, ref = build(NestedWrappedModule)
    default = wrap_model(model, {}, "nested")
    assert all(m.state_dict_device == m.compute_device for m in get_fsdp_instances(default))
    model, _ = build(NestedWrappedModule)
    meta = wrap_model(model, {"state_dict_device": torch.device("meta")}, "nested")
    sd = meta.state_dict()
    assert list(sd) == list(ref.state_dict())
    assert all(v.device.type == "meta" for v in sd.values()), {k: v.device for k, v in sd.items()}
    assert all(p.device.type == "cpu" for p in meta.parameters())
    x = torch.randn(2, 7)
    torch.testing.assert_close(meta(x), ref(x))


def _pure_fp16() -> None:
    """Spec 2.2: values are fp16 in pure fp16 mode (compute_dtype=fp16 on fp16 parameters)."""
    model, ref = build(NestedWrappedModule)
    fsdp = wrap_model(model.half(), {"compute_dtype": torch.float16}, "nested")
    _assert_same_sd(fsdp.state_dict(), ref.half().state_dict(), "pure fp16")


def _mixed_precision_buffers_in_fp32() -> None:
    """Spec 2.2: buffers are fp32 in the state dict, also those of a nested instance; the live ones stay fp16."""
    model, ref = build(ModelWithBatchNorm)
    fsdp = wrap_model(model, MIXED["fp16"], "nested")  # bn is a nested instance
    batch = global_batch(ref, 0, 4)
    fsdp(*batch)
    ref(*batch)
    bn = fsdp.module.module.bn.module.module
    assert bn.running_mean.dtype == torch.float16
    sd = fsdp.state_dict()
    for key, value in ref.state_dict().items():
        assert sd[key].dtype == value.dtype, f"{key}: {sd[key].dtype}"
        torch.testing.assert_close(sd[key], value, rtol=2e-2, atol=2e-3, msg=key)
    assert torch.equal(sd["bn.running_mean"], bn.running_mean.float())
    assert bn.running_mean.dtype == torch.float16 and bn.running_var.dtype == torch.float16  # restored


def _mixed_precision_before_first_forward() -> None:
    """Upstream's test topic "state dict before forward (fp32 dtype)", in mixed precision with buffers."""
    model, ref = build(ModelWithBatchNorm)
    fsdp = wrap_model(model, MIXED["bf16"], "nested")
    _assert_same_sd(fsdp.state_dict(), ref.state_dict(), "mixed precision, before the first forward")
    assert all(m._is_root is None for m in get_fsdp_instances(fsdp)), "lazy init was not undone"


def _raw_dict(fsdp: FSDP) -> Dict[str, Tensor]:
    """A dict with the raw module paths (``_fpw_module.``, ``_fsdp_wrapped_module.``), relative to the root's FPW."""
    with fsdp.summon_full_params():
        return {n: p.detach().clone() for n, p in nn.Module.named_parameters(fsdp.module)}


def _no_pre_load_hook(flatten: bool) -> None:
    """Spec 2.4/1.19: the context disables the prefix rewrite of FSDP *and* FlattenParamsWrapper (fork: both)."""
    model, _ = build(NestedWrappedModule)
    fsdp = wrap_model(model, {"flatten_parameters": flatten}, "nested")
    model, _ = build(NestedWrappedModule, seed=5)
    source = wrap_model(model, {"flatten_parameters": flatten}, "nested")
    raw, clean = _raw_dict(source), source.state_dict()
    assert any("_fsdp_wrapped_module." in k for k in raw) and all(k.startswith("_fpw_module.") for k in raw)
    before = full_params(fsdp)
    with pytest.raises(
        RuntimeError, match="name FullyShardedDataParallel's internal wrappers .*no_pre_load_state_dict"
    ):
        fsdp.load_state_dict(raw)  # the hooks add prefixes a raw dict already has
    assert all(torch.equal(before[k], v) for k, v in full_params(fsdp).items()), "a failed load changed the model"
    with no_pre_load_state_dict_hook():
        with pytest.raises(RuntimeError, match="Missing key"):
            fsdp.load_state_dict(clean)  # no prefix is added now, for either wrapper
        result = fsdp.load_state_dict(raw)
    assert result.missing_keys == [] and result.unexpected_keys == []
    _assert_same_sd(full_params(fsdp), full_params(source), "after loading raw keys")
    fsdp.load_state_dict(clean)  # the hooks are back on after the context


def _parent_holding_fsdp_children(seed: int) -> Tuple[nn.Module, nn.Module]:
    """A plain (unwrapped) parent whose blocks are FSDP roots of their own, flattened and not; and its reference."""
    model, ref = build(NestedWrappedModule, seed)
    model.layers[1] = FSDP(model.layers[1])
    model.layers[2] = FSDP(model.layers[2], flatten_parameters=False)
    return model, ref


def _plain_parent_saves_clean_keys() -> None:
    """Spec 2.2: a plain parent module holding FSDP children saves the unwrapped module's keys and values, and
    trains like the reference (each child is its own root; the same batch on every rank)."""
    parent, ref = _parent_holding_fsdp_children(1)
    _assert_same_sd(parent.state_dict(), ref.state_dict(), "plain parent")
    opt, ref_opt = torch.optim.SGD(parent.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    x = global_batch(ref, 0, 4)[0]
    for m, o in ((parent, opt), (ref, ref_opt)):
        NestedWrappedModule.per_sample_loss(m(x)).mean().backward()
        o.step()
    got = parent.state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _state_dict_inside_summon() -> None:
    model, _ = build(NestedWrappedModule)
    fsdp = wrap_model(model, {}, "nested")
    fsdp(torch.randn(2, 7)).sum().backward()
    outside = fsdp.state_dict()
    with fsdp.summon_full_params():
        inside = fsdp.state_dict()
        _assert_same_sd(inside, outside, "state_dict inside summon_full_params")
        for value in inside.values():
            value.add_(100.0)  # copies: the summoned parameters (written back at exit) must not change
        with pytest.raises(RuntimeError, match="local_state_dict"):
            fsdp.local_state_dict()
    _assert_same_sd(fsdp.state_dict(), outside, "after editing a dict taken inside summon_full_params")
    assert_idle(fsdp)


def _load_non_strict() -> None:
    model, _ = build(NestedWrappedModule)
    fsdp = wrap_model(model, {}, "nested")
    model, _ = build(NestedWrappedModule, seed=4)
    source = wrap_model(model, {}, "nested").state_dict()
    partial = {k: v for k, v in source.items() if k != "layers.1.0.bias"}
    partial["extra.weight"] = torch.zeros(1)
    before = fsdp.state_dict()
    result = fsdp.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["layers.1.0.bias"] and result.unexpected_keys == ["extra.weight"], result
    after = fsdp.state_dict()
    for key in source:
        want = before[key] if key == "layers.1.0.bias" else source[key]
        assert torch.equal(after[key], want), key


# ------------------------------------------------------------------------------------------------------ MoE


def _moe_rules(rank: int, ws: int) -> None:
    """Spec 1.6/1.17: an expert on a 1-rank group gets no_broadcast_optim_state automatically, and clip_grad_norm_
    refuses trees whose instances are on different groups (upstream test topic "MoE incl. grad-clip failure")."""
    solo = [dist.new_group([r]) for r in range(ws)]
    torch.manual_seed(0)
    expert = FSDP(nn.Linear(4, 4), process_group=solo[rank])
    root = FSDP(nn.Sequential(nn.Linear(4, 4), expert, nn.Linear(4, 2)))
    assert not expert.no_broadcast_optim_state  # decided at lazy init, by the root
    root(torch.randn(2, 4)).sum().backward()
    assert expert.no_broadcast_optim_state and not root.no_broadcast_optim_state
    assert root.children_share_process_group is False
    assert [e["no_broadcast_optim_state"] for e in root.local_metadata_dict()["param_metadata"]] == [False, True]
    optim = torch.optim.Adam(root.parameters())
    optim.step()
    full = root.gather_full_optim_state_dict(optim)
    assert (full is None) if rank else (full["uncollected_local_ids"] == [1]), full
    grads = [p.grad.clone() for p in root.parameters()]  # type: ignore[union-attr]
    with pytest.raises(NotImplementedError, match="different process groups"):
        root.clip_grad_norm_(1e-3)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, root.parameters())), "a refused clip changed grads"
    # A tree on one group: the rule does not apply.
    plain = FSDP(nn.Sequential(nn.Linear(4, 4), FSDP(nn.Linear(4, 4)), nn.Linear(4, 2)))
    plain(torch.randn(2, 4)).sum().backward()
    assert plain.children_share_process_group is True
    assert not any(m.no_broadcast_optim_state for m in get_fsdp_instances(plain))


# ------------------------------------------------------------------------------------------------------ other options


def _clear_autocast_cache() -> None:
    """Spec 1.2 #17: with the flag the autocast cache is cleared after the forward, so the cached bf16 copy of a
    leaf input does not outlive its graph; without it the copy stays cached until autocast exits."""
    alive = {}
    for flag in (False, True):
        torch.manual_seed(0)
        model = FSDP(nn.Linear(8, 8), clear_autocast_cache=flag)
        copies: List[Any] = []

        def pack(t: Tensor) -> Tensor:
            if t.dtype == torch.bfloat16 and t.shape == (2, 8):
                copies.append(weakref.ref(t))
            return t

        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = model(torch.randn(2, 8, requires_grad=True))
            assert out.dtype == torch.bfloat16 and copies, "autocast did not cast the input"
            del out
            alive[flag] = any(ref() is not None for ref in copies)
    assert alive == {False: True, True: False}, alive


def _double_after_training_grads(rank: int, ws: int) -> None:
    """``.double()`` after training: fp64 gradients equal the fp64 reference's (test_fsdp_misc only checked that
    they exist). Gathered here in fp64 (the shared helper gathers in fp32)."""
    model, ref = build(NestedWrappedModule)
    fsdp = wrap_model(model, {}, "nested")
    batch = global_batch(ref, 0, 2 * ws)
    scaled_loss(NestedWrappedModule, fsdp(*local_slice(batch, rank, ws)), 2 * ws, ws).backward()
    fsdp.zero_grad()
    fsdp.double()
    ref.double()
    batch = tuple(t.double() for t in global_batch(ref, 1, 2 * ws))
    scaled_loss(NestedWrappedModule, fsdp(*local_slice(batch, rank, ws)), 2 * ws, ws).backward()
    scaled_loss(NestedWrappedModule, ref(*batch), 2 * ws, 1).backward()
    assert_idle(fsdp)
    got: List[Tensor] = []
    for m in get_fsdp_instances(fsdp):
        for p in m.params:
            assert p.grad is not None and p.grad.dtype == torch.float64
            full = torch.empty(p.grad.numel() * m.world_size, dtype=torch.float64)
            collectives.all_gather_into_flat(full, p.grad.detach().contiguous(), m.process_group)
            got.append(full[: p._orig_size.numel()])  # type: ignore[attr-defined]
    # Flattening order: root (layers.0, layers.3), then each nested instance.
    order = ["layers.0.", "layers.3.", "layers.1.", "layers.2."]
    grads = dict(ref.named_parameters())
    expected = torch.cat([grads[n].grad.reshape(-1) for o in order for n in grads if n.startswith(o)])  # type: ignore
    torch.testing.assert_close(torch.cat(got), expected, rtol=1e-12, atol=1e-14)


def _body(rank: int, ws: int) -> None:
    cases: List[Case] = [
        ("state_dict_on_rank_0_only", lambda: _rank_0_only(rank)),
        ("state_dict_device", _state_dict_device),
        ("pure_fp16_state_dict", _pure_fp16),
        ("mixed_precision_nested_buffers_fp32", _mixed_precision_buffers_in_fp32),
        ("mixed_precision_before_first_forward", _mixed_precision_before_first_forward),
        ("no_pre_load_state_dict_hook,flatten", lambda: _no_pre_load_hook(True)),
        ("no_pre_load_state_dict_hook,no_flatten", lambda: _no_pre_load_hook(False)),
        ("plain_parent_saves_clean_keys", _plain_parent_saves_clean_keys),
        ("state_dict_inside_summon", _state_dict_inside_summon),
        ("load_state_dict_strict_false", _load_non_strict),
        ("moe_rules", lambda: _moe_rules(rank, ws)),
        ("clear_autocast_cache", _clear_autocast_cache),
        ("double_after_training_grads", lambda: _double_after_training_grads(rank, ws)),
    ]
    run_cases(cases)


def test_audit_gaps_two_ranks() -> None:
    run_distributed(_body, 2, timeout=120)


def _plain_parent_loads_body(rank: int, ws: int) -> None:
    parent, ref = _parent_holding_fsdp_children(1)
    other, _ = _parent_holding_fsdp_children(2)
    other.load_state_dict(parent.state_dict())
    _assert_same_sd(other.state_dict(), ref.state_dict(), "plain parent after loading")


def _plain_parent_size_mismatch_names_user_keys_body(rank: int, ws: int) -> None:
    # torch words a wrong shape with the path it loads into; inside FSDP that was
    # `layers.1._fsdp_wrapped_module._fpw_module.0.weight`. The message now names the dict's key.
    parent, _ = _parent_holding_fsdp_children(1)
    sd = parent.state_dict()
    sd["layers.1.0.weight"] = torch.zeros(3, 3)  # in a flattened child
    sd["layers.2.0.weight"] = torch.zeros(3, 3)  # in a child with flatten_parameters=False
    with pytest.raises(RuntimeError) as info:
        parent.load_state_dict(sd)
    message = str(info.value)
    assert "size mismatch for layers.1.0.weight:" in message, message
    assert "size mismatch for layers.2.0.weight:" in message, message
    assert "_fsdp_wrapped_module" not in message and "_fpw_module" not in message, message
    # The parent still works (a plain parent's load is torch's, not all or nothing: the other keys loaded).
    NestedWrappedModule.per_sample_loss(parent(global_batch(parent, 0, 2)[0])).mean().backward()


def test_plain_parent_size_mismatch_names_user_keys() -> None:
    run_distributed(_plain_parent_size_mismatch_names_user_keys_body, 2)


def _expert_state_dicts_per_rank_body(rank: int, world_size: int) -> None:
    # Upstream's MoE layout: each rank's expert in an FSDP instance on a group of that rank alone, inside a root
    # sharded over the world; each rank saves and loads its own full state dict (fairseq's per-rank expert
    # checkpoints). The load's check that the ranks loaded the same values refused it: experts differ by design.
    solo = [dist.new_group([r]) for r in range(world_size)]
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    torch.manual_seed(100 + rank)
    expert = nn.Linear(4, 4)
    model = FSDP(nn.Sequential(shared, FSDP(expert, process_group=solo[rank])))
    model(torch.randn(2, 4)).sum().backward()
    saved = model.state_dict()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.load_state_dict(saved)
    _assert_same_sd(model.state_dict(), saved, f"rank {rank}'s own state dict")
    # The shared layer is still checked: ranks loading different values for it fail on every rank.
    other = dict(saved)
    other["0.weight"] = saved["0.weight"] + rank
    with pytest.raises(RuntimeError, match="the ranks loaded different full state dicts"):
        model.load_state_dict(other)
    _assert_same_sd(model.state_dict(), saved, "after the refused load")


def test_expert_state_dicts_per_rank() -> None:
    run_distributed(_expert_state_dicts_per_rank_body, 2)


def test_plain_parent_loads_full_state_dict_into_fsdp_children() -> None:
    """Issue 5: "a plain parent module holding FSDP children saves *and loads* the same clean keys".

    Known failure (audit): the parent's ``load_state_dict`` reaches the children through ``_load_from_state_dict``
    only, so their parameters are still shards (and flat) when torch copies the full tensors into them.
    """
    run_distributed(_plain_parent_loads_body, 2)
