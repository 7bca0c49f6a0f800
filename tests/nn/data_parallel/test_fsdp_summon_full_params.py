# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""summon_full_params: full fp32 parameters with their original names, write-back unless volatile, freed after."""

import contextlib
import functools
import gc
import itertools
import time
from typing import Any, Dict

import pytest
import torch
from _models import (
    MIXED,
    NestedWrappedModule,
    assert_close_dict,
    assert_idle,
    build,
    full_params,
    gather_full_grads,
    ref_params,
    wrap_model,
)
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import TrainingState, get_fsdp_instances


def _exposes_full_fp32_params(rank: int, ws: int, kwargs: Dict[str, Any], mode: str) -> None:
    model, ref = build(NestedWrappedModule)
    fsdp = wrap_model(model, kwargs, mode)
    x = torch.randn(3, 7)
    fsdp(x).sum().backward()  # summon after training steps, not only on a fresh model
    fsdp.zero_grad()
    with fsdp.summon_full_params():
        names = dict(fsdp.named_parameters())
        assert sorted(names) == sorted(dict(ref.named_parameters()))
        for name, p in ref.named_parameters():
            assert names[name].shape == p.shape and names[name].dtype == torch.float32, name
            torch.testing.assert_close(names[name], p.detach())
        # The user module holds real parameters with their original shapes.
        first = fsdp.module.module.layers[0]
        assert isinstance(first.weight, nn.Parameter) and first.weight.shape == (5, 7)
    assert_idle(fsdp)
    # The model still trains the same after the summon.
    fsdp(x).sum().backward()
    ref.zero_grad()
    ref(x).sum().backward()
    tol = dict(rtol=2e-2, atol=2e-3) if kwargs.get("mixed_precision") else dict(rtol=1e-5, atol=1e-6)
    assert_close_dict(gather_full_grads(fsdp), {n: p.grad for n, p in ref.named_parameters()}, "grad", **tol)


def _summon_exposes_full_fp32_params_body(rank: int, ws: int) -> None:
    run_cases(
        (
            f"{mp},flatten={flatten},{mode}",
            lambda kw=dict(flatten_parameters=flatten, **MIXED[mp]), m=mode: _exposes_full_fp32_params(rank, ws, kw, m),
        )
        for mp, flatten, mode in itertools.product(("fp32", "fp16", "bf16"), (True, False), ("one", "nested"))
    )


def test_summon_exposes_full_fp32_params() -> None:
    run_distributed(_summon_exposes_full_fp32_params_body, 3)


def _write_back(rank: int, ws: int, volatile: bool, flatten: bool, after_forward: bool) -> None:
    model, ref = build(NestedWrappedModule)
    fsdp = wrap_model(model, dict(flatten_parameters=flatten), "nested")
    x = torch.randn(2, 7)
    if after_forward:
        # The root keeps its full compute copy after a finished step; an edit must not be hidden by it.
        fsdp(x).sum().backward()
        fsdp.zero_grad()
        ref.zero_grad()
    before = full_params(fsdp)
    with fsdp.summon_full_params(volatile=volatile):
        with torch.no_grad():
            for name, p in fsdp.named_parameters():
                p.add_(float(rank + 1))  # rank-dependent edit: each rank writes back only its own shard
    assert_idle(fsdp)
    after = full_params(fsdp)
    if volatile:
        assert_close_dict(after, before, "volatile summon", rtol=0, atol=0)
        return
    # Element i of a full tensor comes from the rank whose shard holds it; check the whole edit pattern.
    for name in after:
        torch.testing.assert_close(after[name], before[name] + _owner_ranks(fsdp, name) + 1, msg=name)
    # Forward uses the edited values.
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(after[name])
    torch.testing.assert_close(fsdp(x), ref(x))


def _owner_ranks(fsdp: FSDP, name: str) -> Tensor:
    """Rank whose shard holds each element of parameter ``name`` (chunk-and-pad of the flat or single tensor)."""
    for m in get_fsdp_instances(fsdp):
        prefix = [n for n, mod in fsdp.named_modules() if mod is m][0]
        for i, p in enumerate(m.params):
            if i < m._num_flatten_params:
                names, shapes, numels = m.module.metadata(i)
            else:
                names, shapes, numels = [m._param_name_groups[i][0]], [p._orig_size], [p._orig_size.numel()]
            shard_numel = p.data.numel()  # outside summon: this rank's padded shard
            offset = 0
            for local, shape, numel in zip(names, shapes, numels):
                if _clean(f"{prefix}.{local}") == name:
                    return (torch.arange(offset, offset + numel) // shard_numel).view(shape).float()
                offset += numel
    raise KeyError(name)


def _clean(path: str) -> str:
    return ".".join(c for c in path.split(".") if c and c not in ("_fsdp_wrapped_module", "_fpw_module"))


def _summon_writes_back_unless_volatile_body(rank: int, ws: int) -> None:
    run_cases(
        (
            f"volatile={v},flatten={f},after_forward={a}",
            lambda v=v, f=f, a=a: _write_back(rank, ws, v, f, a),
        )
        for v, f, a in itertools.product((False, True), (True, False), (False, True))
    )


def test_summon_writes_back_unless_volatile() -> None:
    run_distributed(_summon_writes_back_unless_volatile_body, 3)


def _summon_recurse_false_and_communication_body(rank: int, ws: int) -> None:
    model, _ = build(NestedWrappedModule)
    fsdp = wrap_model(model, dict(mixed_precision=True, bucket_cap_mb=0), "nested")
    block = fsdp.module.module.layers[1]
    with count_collectives() as counter:
        with fsdp.summon_full_params(recurse=False):
            assert fsdp.training_state == TrainingState.SUMMON_FULL_PARAMS
            assert block.training_state == TrainingState.IDLE
            assert fsdp.module.module.layers[0].weight.shape == (5, 7)
            assert all(p.dim() == 1 for p in block.params), "inner instance must stay sharded"
    # One fp32 gather of the root's flat parameter (58 elements padded to 58 at world size 2).
    assert counter.count("all_gather", phase="summon") == 1, counter.summary()
    assert counter.total_bytes("all_gather", phase="summon") == 58 * 4
    # Before any forward: lazy init runs no collective (the cross-rank check waits for the first forward).
    assert [(r.kind, r.phase, r.dtype) for r in counter.records] == [("all_gather", "summon", torch.float32)]
    with count_collectives() as counter:
        with fsdp.summon_full_params():
            assert all(m.training_state == TrainingState.SUMMON_FULL_PARAMS for m in get_fsdp_instances(fsdp))
    assert counter.count("all_gather", phase="summon") == 3 and counter.count() == 3, counter.summary()
    assert counter.total_bytes() == (58 + 104 + 30) * 4
    assert_idle(fsdp)


def test_summon_recurse_false_and_communication() -> None:
    run_distributed(_summon_recurse_false_and_communication_body, 2)


def _summon_frees_its_full_tensors_body(rank: int, ws: int) -> None:
    model, _ = build(NestedWrappedModule)
    fsdp = wrap_model(model, dict(flatten_parameters=False), "nested")
    shard_ptrs = {id(p): p.data.data_ptr() for p in fsdp.parameters()}
    full_storages = []
    with fsdp.summon_full_params():
        for p in fsdp.parameters():
            assert p.data.data_ptr() != shard_ptrs[id(p)]
            full_storages.append(p.data.untyped_storage()._weak_ref())
    assert_idle(fsdp)
    for p in fsdp.parameters():
        assert p.data.data_ptr() == shard_ptrs[id(p)] and p.dim() == 1
    # Nothing keeps the gathered tensors alive (weak references only). gloo's worker thread may drop its reference
    # to a finished collective's work (and so to its output) a moment after wait() returned: allow it that moment.
    deadline = time.monotonic() + 2.0
    while True:
        gc.collect()
        alive = [s for s in full_storages if not torch.UntypedStorage._expired(s)]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not alive, f"{len(alive)} full tensor(s) gathered by summon_full_params still alive"


def test_summon_frees_its_full_tensors() -> None:
    run_distributed(_summon_frees_its_full_tensors_body, 2)


class SummonsInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.owner: Any = None

    def forward(self, x: Tensor) -> Tensor:
        with self.owner.summon_full_params():
            pass
        return self.linear(x)


def _summon_in_the_wrong_state_raises_body(rank: int, ws: int) -> None:
    inner = SummonsInForward()
    fsdp = FSDP(inner)
    inner.owner = fsdp
    with pytest.raises(RuntimeError, match="summon_full_params"):
        fsdp(torch.randn(2, 3))
    model = FSDP(nn.Linear(3, 3))
    with model.summon_full_params():
        with pytest.raises(RuntimeError, match="forward"):
            model(torch.randn(2, 3))
    assert_idle(model)
    model(torch.randn(2, 3)).sum().backward()  # still usable
    assert_idle(model)


def test_summon_in_the_wrong_state_raises() -> None:
    run_distributed(_summon_in_the_wrong_state_raises_body, 2)


def _summon_between_forward_and_backward_body(rank: int, ws: int) -> None:
    for reshard in (True, False):
        model, ref = build(NestedWrappedModule)
        fsdp = wrap_model(model, dict(reshard_after_forward=reshard), "nested")
        x = torch.randn(2, 7)
        loss = fsdp(x).sum()
        with fsdp.summon_full_params():
            seen = {n: p.detach().clone() for n, p in fsdp.named_parameters()}
        assert_close_dict(seen, ref_params(ref), "summoned", rtol=0, atol=0)
        assert_idle(fsdp, after_forward=True)
        loss.backward()
        ref(x).sum().backward()
        assert_close_dict(gather_full_grads(fsdp), {n: p.grad for n, p in ref.named_parameters()}, "grad")
        assert_idle(fsdp)


def test_summon_between_forward_and_backward() -> None:
    """Fork behaviour: allowed (e.g. a state_dict mid-step) and harmless to the pending backward."""

    run_distributed(_summon_between_forward_and_backward_body, 2)


def _summon_edit_after_a_forward_without_backward_body(rank: int, ws: int) -> None:
    cases = []
    for grad_enabled in (False, True):

        def case(grad_enabled: bool = grad_enabled) -> None:
            model, ref = build(NestedWrappedModule)
            fsdp = wrap_model(model, {}, "nested")
            x = torch.randn(2, 7)
            with torch.set_grad_enabled(grad_enabled):
                fsdp(x)  # output dropped: no backward follows
            with fsdp.summon_full_params():
                with torch.no_grad():
                    for p in fsdp.parameters():
                        p.mul_(2.0)
            with torch.no_grad():
                for p in ref.parameters():
                    p.mul_(2.0)
            torch.testing.assert_close(fsdp(x), ref(x))
            fsdp(x).sum().backward()
            assert_idle(fsdp)

        cases.append((f"grad_enabled={grad_enabled}", case))
    run_cases(cases)


def test_summon_edit_after_a_forward_without_backward() -> None:
    """An evaluation pass, or a grad-enabled forward whose output is dropped, must not make the next forward use
    the full parameters gathered before a summon_full_params edit."""

    run_distributed(_summon_edit_after_a_forward_without_backward_body, 2)


def _assigning_a_forwarded_name_raises_body(rank: int, ws: int) -> None:
    cases = []
    for flatten, in_summon in itertools.product((True, False), (True, False)):

        def case(flatten: bool = flatten, in_summon: bool = in_summon) -> None:
            model, ref = build(NestedWrappedModule)
            fsdp = wrap_model(model, dict(flatten_parameters=flatten), "leaf")
            leaf = fsdp.module.module.layers[0] if flatten else fsdp.module.layers[0]
            assert isinstance(leaf, FSDP)
            x = torch.randn(2, 7)
            with fsdp.summon_full_params() if in_summon else contextlib.nullcontext():
                # `leaf.weight` reads the Linear's weight. Assigning a Parameter failed in torch with
                # KeyError("attribute 'weight' already exists"); a tensor was stored on the wrapper, where it hid
                # the real weight from every later read while the Linear kept its own.
                for value in (nn.Parameter(torch.zeros(5, 7)), torch.zeros(5, 7)):
                    with pytest.raises(AttributeError, match="cannot assign .* to 'weight': it belongs to the wrapped"):
                        leaf.weight = value
                with pytest.raises(AttributeError, match="to 'layers'"):
                    fsdp.layers = nn.ModuleList()
                # Names the wrapped module does not have, or plain values, are stored on the wrapper as before.
                leaf.my_tensor = torch.ones(1)
                leaf.weight_decay_note = "none"
                assert leaf.__dict__["my_tensor"] is not None and leaf.weight_decay_note == "none"
                if in_summon:
                    # What the message says to do instead: rebind on the owner (written back on exit).
                    # (FSDP always wraps the module in a FlattenParamsWrapper, flattening or not.)
                    with pytest.raises(AttributeError, match="`model.module.module.weight = ...`"):
                        leaf.weight = torch.zeros(5, 7)
                    owner = leaf.module.module
                    owner.weight = nn.Parameter(torch.full((5, 7), 0.5))
                    with torch.no_grad():
                        ref.layers[0].weight.fill_(0.5)
            assert "weight" not in leaf.__dict__
            torch.testing.assert_close(fsdp(x), ref(x))

        cases.append((f"flatten={flatten},in_summon={in_summon}", case))
    run_cases(cases)


def test_assigning_a_forwarded_name_raises() -> None:
    run_distributed(_assigning_a_forwarded_name_raises_body, 2)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.emb(x))


def _tied_full(model: FSDP) -> Dict[str, Tensor]:
    with model.summon_full_params():
        return {"emb": model.module.emb.weight.detach().clone(), "out": model.module.out.weight.detach().clone()}


def _tied_rebind_case(flatten: bool, volatile: bool) -> None:
    torch.manual_seed(0)
    ref = _Tied()
    model = FSDP(_Tied(), flatten_parameters=flatten)
    x = torch.tensor([[1, 2], [3, 4]])
    model(x)  # initialised, as a user's summon between steps
    before = _tied_full(model)
    with model.summon_full_params(volatile=volatile):
        model.module.out.weight = nn.Parameter(torch.full((5, 4), 0.5))  # the tied weight's second name
    got = _tied_full(model)
    want = before["emb"] if volatile else torch.full((5, 4), 0.5)
    assert torch.equal(got["emb"], want) and torch.equal(got["out"], want), got
    if volatile:
        # Two names rebound apart: a volatile summon writes nothing back, so nothing is refused either (it was with
        # flattening only).
        with model.summon_full_params(volatile=True):
            model.module.emb.weight = nn.Parameter(torch.full((5, 4), 1.0))
            model.module.out.weight = nn.Parameter(torch.full((5, 4), 2.0))
        assert torch.equal(_tied_full(model)["emb"], want)
        return
    # Both names rebound to different tensors: one flat value cannot hold both; refused, nothing written.
    with pytest.raises(ValueError, match="one tied parameter, rebound to two different tensors"):
        with model.summon_full_params():
            model.module.emb.weight = nn.Parameter(torch.full((5, 4), 1.0))
            model.module.out.weight = nn.Parameter(torch.full((5, 4), 2.0))
    again = _tied_full(model)
    assert torch.equal(again["emb"], want) and torch.equal(again["out"], want)
    # And it trains like the plain tied module with that value.
    with torch.no_grad():
        ref.emb.weight.fill_(0.5)
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
    torch.testing.assert_close(_tied_full(model)["emb"], ref.emb.weight.detach())


def _tied_rebind_body(rank: int, ws: int) -> None:
    run_cases(
        (f"flatten={flatten}, volatile={volatile}", functools.partial(_tied_rebind_case, flatten, volatile))
        for flatten in (True, False)
        for volatile in (False, True)
    )


def test_a_rebind_of_a_tied_second_name_inside_summon_is_written_back() -> None:
    """``m.out.weight = nn.Parameter(t)`` inside ``summon_full_params()`` where ``out.weight`` is tied to
    ``emb.weight`` was dropped silently with flattening (the first name's rebind was kept); both are kept now, as the
    standalone FlattenParamsWrapper context keeps them (session 37)."""
    run_distributed(_tied_rebind_body, 2)
