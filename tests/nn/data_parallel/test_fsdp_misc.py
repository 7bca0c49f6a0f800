# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FSDP odds and ends: bad input, pickling, parameter names, extra_repr, divide factors, clip_grad_norm_,
reset_parameters, CPU offload flags and the dtypes of every tensor under each precision mode."""

import contextlib
import logging
import gc
import itertools
import pickle
import weakref
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from _models import (
    MIXED,
    DtypeRecorder,
    NestedWrappedModule,
    assert_close_dict,
    assert_idle,
    build,
    full_params,
    gather_full_grads,
    global_batch,
    local_slice,
    ref_params,
    scaled_loss,
    train_and_compare,
    wrap_model,
)
from torch import Tensor, nn

from fairscale.fair_dev.testing.testing import DummyProcessGroup
from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.internal.parallel import ProcessGroupName
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import TrainingState, get_fsdp_instances

# ------------------------------------------------------------------------------------------------------ bad input


def _constructor_rejects_bad_input_with_clear_messages_body(rank: int, ws: int) -> None:
    with pytest.raises(ValueError, match="fp16"):
        FSDP(nn.Linear(3, 3), compute_dtype=torch.float16)  # pure fp16 needs fp16 parameters
    # Mixed precision keeps fp32 masters: the message names the ways that work (it advised mixed_precision=True).
    with pytest.raises(ValueError, match=r"must be fp32 .* model.float\(\) before wrapping.*'pure fp16'"):
        FSDP(nn.Linear(3, 3).half(), mixed_precision=True)
    with pytest.raises(ValueError, match=r"bfloat16 parameter.*\.bfloat16\(\)\) wrap the fp32 model and convert"):
        FSDP(nn.Linear(3, 3).to(torch.bfloat16))  # pure bf16 parameters are refused at wrapping (as upstream)
    with pytest.raises(ValueError, match="mixed_precision"):
        FSDP(nn.Linear(3, 3), fp32_reduce_scatter=True)
    # A parameter already owned by another (non-nested) instance: skipped at construction as upstream (so
    # append_shared_param can declare it), but the first forward says what is wrong instead of failing deep
    # inside autograd on a shard-shaped weight.
    shared = nn.Linear(3, 3)
    FSDP(shared, flatten_parameters=False)
    borrower = FSDP(nn.Sequential(shared, nn.Linear(3, 3)))
    with pytest.raises(ValueError, match="owned \\(sharded\\) by another instance.*append_shared_param"):
        borrower(torch.randn(2, 3))
    # Names in a tie error are relative to the instance, which is named by its path in the tree (session 38): with
    # many instances a bare 'weight' said neither which tie nor which instance.
    owner = nn.Linear(3, 3)
    tied = nn.Linear(3, 3)
    tied.weight = owner.weight
    model = FSDP(nn.Sequential(FSDP(owner), nn.Sequential(FSDP(tied))))
    with pytest.raises(ValueError, match="instance at '1.0' \\(names relative to it\\)"):
        model(torch.randn(2, 3))
    # Still fine: fp16 parameters with pure fp16, fp32 with mixed precision, bf16 compute.
    FSDP(nn.Linear(3, 3).half(), compute_dtype=torch.float16)
    FSDP(nn.Linear(3, 3), mixed_precision=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=True)


def test_constructor_rejects_bad_input_with_clear_messages() -> None:
    run_distributed(_constructor_rejects_bad_input_with_clear_messages_body, 2)


def test_needs_an_initialised_process_group() -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        FSDP(nn.Linear(2, 2))


class CallsInForward(nn.Module):
    """Calls ``what(owner)`` inside its forward, to check methods that are illegal there."""

    def __init__(self, what: Any) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.what = what
        self.owner: Any = None

    def forward(self, x: Tensor) -> Tensor:
        self.what(self.owner)
        return self.linear(x)


def _calls_in_the_wrong_state_or_place_raise_body(rank: int, ws: int) -> None:
    inner = FSDP(nn.Linear(3, 3))
    root = FSDP(nn.Sequential(inner, nn.Linear(3, 3)))
    root(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="root"):
        with inner.no_sync():
            pass
    with pytest.raises(RuntimeError, match="root"):
        inner.clip_grad_norm_(1.0)
    illegal_in_forward = {
        "no_sync": lambda m: m.no_sync().__enter__(),
        "summon_full_params": lambda m: m.summon_full_params().__enter__(),
        "clip_grad_norm_": lambda m: m.clip_grad_norm_(1.0),
        ".half()": lambda m: m.half(),
        "set_gradient_divide_factors": lambda m: m.set_gradient_divide_factors(1.0, 2.0, True),
    }
    for name, what in illegal_in_forward.items():
        module = CallsInForward(what)
        fsdp = FSDP(module)
        module.owner = fsdp
        with pytest.raises((RuntimeError, ValueError), match="FORWARD|forward|IDLE|idle"):
            fsdp(torch.randn(2, 3))
        # The failed forward leaves the instance usable (and the next call fails the same clear way).
        assert fsdp.training_state == TrainingState.IDLE, name
    with pytest.raises(RuntimeError, match="allow_reset_parameters"):
        FSDP(nn.Linear(3, 3)).reset_parameters()


def test_calls_in_the_wrong_state_or_place_raise() -> None:
    run_distributed(_calls_in_the_wrong_state_or_place_raise_body, 2)


# ------------------------------------------------------------------------------------------------------ API surface


def _pickling_replaces_process_groups_body(rank: int, ws: int) -> None:
    model, _ = build(NestedWrappedModule)
    fsdp = wrap_model(model, dict(flatten_parameters=False), "nested")
    x = torch.randn(2, 7)
    fsdp(x).sum().backward()
    before = full_params(fsdp)
    clone = pickle.loads(pickle.dumps(fsdp))
    for original, copy in zip(get_fsdp_instances(fsdp), get_fsdp_instances(clone)):
        assert copy.process_group == "MISSING" and copy.process_group_reduce_scatter == "MISSING"
        assert original.process_group != "MISSING"  # the live object is untouched
        for p, q in zip(original.params, copy.params):
            assert q._is_sharded == p._is_sharded and q._orig_size == p._orig_size
            assert torch.equal(q.data, p.data)
    # The live model keeps training after being pickled.
    fsdp(x).sum().backward()
    assert_idle(fsdp)
    assert_close_dict(full_params(fsdp), before, "params", rtol=0, atol=0)


def test_pickling_replaces_process_groups() -> None:
    run_distributed(_pickling_replaces_process_groups_body, 2)


def test_pickling_with_a_dummy_group_needs_no_world() -> None:
    fsdp = FSDP(
        nn.Linear(3, 3),
        process_group=DummyProcessGroup(rank=0, size=1),
        process_group_reduce_scatter=ProcessGroupName.default,
    )
    clone = pickle.loads(pickle.dumps(fsdp))
    assert clone.process_group == "MISSING" and clone.world_size == 1
    assert torch.equal(clone.params[0], fsdp.params[0])


def test_clip_grad_norm_with_one_stand_in_group_per_instance() -> None:
    """On one process, nested instances each given their own DummyProcessGroup (groups of one rank differ in
    identity only) clip as torch clips the plain model; before, the different group objects were refused."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))

    def group() -> Dict[str, Any]:
        return dict(
            process_group=DummyProcessGroup(rank=0, size=1), process_group_reduce_scatter=ProcessGroupName.default
        )

    plain, model = build(), build()
    model[1] = FSDP(model[1], **group())
    fsdp = FSDP(model, **group())
    x = torch.randn(3, 4)
    for m in (plain, fsdp):
        (m(x) ** 2).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    got = fsdp.clip_grad_norm_(0.1)
    torch.testing.assert_close(got, want)
    # The gradients were scaled as torch scaled the plain model's (the values, compared in sorted order since the
    # flat parameters hold them in another order).
    clipped = torch.cat([p.grad.reshape(-1) for p in fsdp.parameters()])  # type: ignore[union-attr]
    reference = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])  # type: ignore[union-attr]
    torch.testing.assert_close(clipped.sort().values, reference.sort().values)


def _clip_grad_norm_root_group_counts_body(rank: int, ws: int) -> None:
    # Children on one-rank groups (each rank's gradients its own) under a root without parameters on the world group:
    # the norm would be combined over the root's group, mixing independent models. Refused, gradients unchanged.
    kw = dict(process_group_reduce_scatter=ProcessGroupName.default)
    solo_a = [dist.new_group([r]) for r in range(ws)]
    solo_b = [dist.new_group([r]) for r in range(ws)]
    for second in (solo_a, solo_b):  # children on two groups, then both on the same one
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model[0] = FSDP(model[0], process_group=solo_a[rank], **kw)
        model[1] = FSDP(model[1], process_group=second[rank], **kw)
        root = FSDP(model)
        (root(torch.randn(3, 4) * (1 + rank)) ** 2).sum().backward()
        grads = [p.grad.clone() for p in root.parameters()]  # type: ignore[union-attr]
        with pytest.raises(NotImplementedError, match="different process groups"):
            root.clip_grad_norm_(1e-3)
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, root.parameters()))


def test_clip_grad_norm_counts_the_roots_group() -> None:
    run_distributed(_clip_grad_norm_root_group_counts_body, 2)


def _named_parameters_and_repr_body(rank: int, ws: int) -> None:
    model, ref = build(NestedWrappedModule)
    flat = wrap_model(model, {}, "nested")
    assert [n for n, _ in flat.named_parameters()] == [
        "_fsdp_wrapped_module.flat_param_0",
        "_fsdp_wrapped_module._fpw_module.layers.1._fsdp_wrapped_module.flat_param_0",
        "_fsdp_wrapped_module._fpw_module.layers.2._fsdp_wrapped_module.flat_param_0",
    ]
    with flat.summon_full_params():
        assert sorted(n for n, _ in flat.named_parameters()) == sorted(n for n, _ in ref.named_parameters())
    model, _ = build(NestedWrappedModule)
    plain = wrap_model(model, dict(flatten_parameters=False), "nested")
    assert sorted(n for n, _ in plain.named_parameters()) == sorted(n for n, _ in ref.named_parameters())
    # extra_repr: the essentials always, details with verbose=True.
    short = flat.extra_repr()
    assert f"world_size={ws}" in short and "flatten_parameters=True" in short and "mixed_precision=False" in short
    verbose = FSDP(nn.Linear(2, 2), verbose=True, mixed_precision=True).extra_repr()
    for key in ("reshard_after_forward", "compute_dtype=torch.float16", "move_params_to_cpu", "bucket_cap_mb"):
        assert key in verbose, verbose
    assert "world_size" in str(flat)
    # Other surface: module, __getitem__, params_with_grad, get_fsdp_instances(skip_empty).
    assert flat.module is flat._fsdp_wrapped_module and flat.module.module is flat.module._fpw_module
    assert isinstance(plain.module.module.layers[1], FSDP)
    seq = FSDP(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert isinstance(seq[1], nn.ReLU)
    assert seq.params_with_grad == []
    seq(torch.randn(1, 2)).sum().backward()
    assert seq.params_with_grad == seq.params
    empty = FSDP(nn.Sequential(FSDP(nn.Linear(2, 2)), nn.ReLU()))
    assert len(get_fsdp_instances(empty)) == 2 and len(get_fsdp_instances(empty, skip_empty=True)) == 1
    assert FSDP(nn.Linear(2, 2)).compute_device == torch.device("cpu")
    offloaded = FSDP(nn.Linear(2, 2), cpu_offload=True)
    assert offloaded.cpu_offload and offloaded.move_params_to_cpu and offloaded.move_grads_to_cpu


def test_named_parameters_and_repr() -> None:
    run_distributed(_named_parameters_and_repr_body, 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(move_grads_to_cpu=True), "move_grads_to_cpu=True needs move_params_to_cpu=True"),
        (dict(move_params_to_cpu=True, move_grads_to_cpu=False), "gradients must too"),
    ],
)
def test_gradient_and_parameter_placement_must_agree_on_accelerators(kwargs: Any, message: str) -> None:
    """With an accelerator compute device, a CPU gradient on a device shard (or the reverse) would fail at the end of
    the first backward (p.grad must live on p's device): refused at construction. Constructing touches no device."""
    group = dict(process_group=DummyProcessGroup(rank=0, size=2), process_group_reduce_scatter=ProcessGroupName.default)
    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=message):
        FSDP(nn.Linear(2, 2), compute_device=cuda, **group, **kwargs)
    FSDP(nn.Linear(2, 2), compute_device=torch.device("cpu"), **group, **kwargs)  # on CPU both live on the CPU
    FSDP(nn.Linear(2, 2), compute_device=cuda, move_params_to_cpu=True, **group)  # both offloaded: accepted


# ------------------------------------------------------------------------------------------------------ divide factors

# Spec 1.2: (pre, post) for the default gradient_predivide_factor.
UPSTREAM_TABLE = {1: (1, 1), 2: (2, 1), 3: (2, 1.5), 4: (2, 2), 6: (4, 1.5), 8: (4, 2), 16: (4, 4), 32: (8, 4)}
UPSTREAM_TABLE.update({64: (8, 8), 128: (16, 8)})


def _rule(world_size: int) -> int:
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return factor


def test_default_divide_factor_table() -> None:
    for ws in range(1, 129):
        fsdp = FSDP(
            nn.Linear(1, 1),
            process_group=DummyProcessGroup(rank=0, size=ws),
            process_group_reduce_scatter=ProcessGroupName.default,
        )
        pre, post = fsdp.gradient_predivide_factor, fsdp.gradient_postdivide_factor
        assert pre == _rule(ws) and post == pytest.approx(ws / pre), ws
        if ws in UPSTREAM_TABLE:
            assert (pre, post) == pytest.approx(UPSTREAM_TABLE[ws]), ws
    custom = FSDP(
        nn.Linear(1, 1),
        process_group=DummyProcessGroup(rank=0, size=8),
        process_group_reduce_scatter=ProcessGroupName.default,
        gradient_predivide_factor=8.0,
    )
    assert (custom.gradient_predivide_factor, custom.gradient_postdivide_factor) == (8.0, 1.0)


def _divide_factors_do_not_change_the_average_body(rank: int, ws: int) -> None:
    cases = []
    # 0.5 and 8.0 (more than the world size: a post factor below 1) were silently not divided by upstream's rule.
    for pre, mp in list(itertools.product((1.0, 2.0, 4.0), ("fp32", "fp16"))) + [(0.5, "fp32"), (8.0, "fp32")]:
        kwargs = dict(gradient_predivide_factor=pre, **MIXED[mp])
        cases.append(
            (f"pre={pre},{mp}", lambda k=kwargs: train_and_compare(rank, ws, NestedWrappedModule, k, "nested"))
        )

    def set_later() -> None:
        model, ref = build(NestedWrappedModule)
        fsdp = wrap_model(model, {}, "nested")
        fsdp.set_gradient_divide_factors(1.0, float(ws), recursive=True)
        assert all(
            (m.gradient_predivide_factor, m.gradient_postdivide_factor) == (1.0, ws) for m in get_fsdp_instances(fsdp)
        )
        fsdp.set_gradient_divide_factors(1.0, 1.0, recursive=False)  # root only: a sum over ranks, not an average
        batch = global_batch(ref, 0, 2 * ws)
        scaled_loss(NestedWrappedModule, fsdp(*local_slice(batch, rank, ws)), 2 * ws, ws).backward()
        scaled_loss(NestedWrappedModule, ref(*batch), 2 * ws, 1).backward()
        grads = gather_full_grads(fsdp)
        for name, p in ref.named_parameters():
            scale = float(ws) if name.startswith(("layers.0.", "layers.3.")) else 1.0
            torch.testing.assert_close(grads[name], p.grad * scale, msg=name)

    cases.append(("set_gradient_divide_factors", set_later))
    run_cases(cases)


def test_divide_factors_do_not_change_the_average() -> None:
    run_distributed(_divide_factors_do_not_change_the_average_body, 4)


# ------------------------------------------------------------------------------------------------------ gradients


def _clip_case(rank: int, ws: int, norm_type: float, max_norm: float, flatten: bool, mp: str) -> None:
    model, ref = build(NestedWrappedModule)
    fsdp = wrap_model(model, dict(flatten_parameters=flatten, **MIXED[mp]), "nested")
    batch = global_batch(ref, 0, 2 * ws)
    scaled_loss(NestedWrappedModule, fsdp(*local_slice(batch, rank, ws)), 2 * ws, ws).backward()
    scaled_loss(NestedWrappedModule, ref(*batch), 2 * ws, 1).backward()
    unclipped = gather_full_grads(fsdp)
    total = fsdp.clip_grad_norm_(max_norm, norm_type)
    assert_idle(fsdp)
    expected_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    tol = dict(rtol=1e-5, atol=1e-6) if mp == "fp32" else dict(rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(total.float(), expected_total, **tol)
    clipped = gather_full_grads(fsdp)
    assert_close_dict(clipped, {n: p.grad for n, p in ref.named_parameters()}, "clipped grad", **tol)
    if max_norm > expected_total:
        assert_close_dict(clipped, unclipped, "unclipped grad", rtol=0, atol=0)


def _clip_grad_norm_matches_torch_body(rank: int, ws: int) -> None:
    run_cases(
        (f"norm={n},max={m},flatten={f},{mp}", lambda n=n, m=m, f=f, mp=mp: _clip_case(rank, ws, n, m, f, mp))
        for n, m, f, mp in itertools.product((2.0, float("inf"), 1.0), (0.05, 1e3), (True, False), ("fp32", "fp16"))
    )


def test_clip_grad_norm_matches_torch() -> None:
    run_distributed(_clip_grad_norm_matches_torch_body, 3)


def _reset_parameters_forwards_to_the_module_body(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(5, 7)
    fsdp = FSDP(nn.Linear(5, 7), allow_reset_parameters=True)
    torch.manual_seed(42)
    fsdp.reset_parameters()
    torch.manual_seed(42)
    ref.reset_parameters()
    assert_close_dict(full_params(fsdp), ref_params(ref), "after reset", rtol=0, atol=0)
    assert_idle(fsdp)


def test_reset_parameters_forwards_to_the_module() -> None:
    run_distributed(_reset_parameters_forwards_to_the_module_body, 3)


def _cpu_offload_flags_train_like_the_reference_body(rank: int, ws: int) -> None:
    cases = []
    for kwargs in (
        dict(move_grads_to_cpu=True),
        dict(move_params_to_cpu=True),
        dict(cpu_offload=True, mixed_precision=True),
    ):
        name = ",".join(f"{k}={v}" for k, v in kwargs.items())

        def case(kwargs: Dict[str, Any] = kwargs) -> None:
            fsdp = train_and_compare(rank, ws, NestedWrappedModule, kwargs, "nested")
            for p in fsdp.parameters():
                assert p.device.type == "cpu" and p.dtype == torch.float32

        cases.append((name, case))
    run_cases(cases)


def test_cpu_offload_flags_train_like_the_reference() -> None:
    run_distributed(_cpu_offload_flags_train_like_the_reference_body, 2)


# ------------------------------------------------------------------------------------------------------ dtypes


def _dtype_case(rank: int, ws: int, kwargs: Dict[str, Any], expect: Dict[str, torch.dtype], no_sync: bool) -> None:
    torch.manual_seed(0)
    param_dtype = expect["param"]
    recorder = DtypeRecorder().to(param_dtype)
    inner = FSDP(recorder, bucket_cap_mb=0, **kwargs)
    root = FSDP(nn.Sequential(nn.Linear(4, 4).to(param_dtype), inner), bucket_cap_mb=0, **kwargs)
    x = torch.randn(2, 4, dtype=param_dtype)
    with count_collectives() as counter:
        with root.no_sync() if no_sync else contextlib.nullcontext():
            out = root(x)
            out.float().sum().backward()
    seen = recorder.seen[-1]
    assert seen == {"input": expect["compute"], "weight": expect["compute"], "buffer": expect["buffer"]}, seen
    assert out.dtype == torch.promote_types(expect["compute"], expect["buffer"])  # the recorder multiplies by it
    reductions = {r.dtype for r in counter.records if r.kind == "reduce_scatter"}
    # World size 1 has nothing to reduce (the gradient is already the full average).
    assert reductions == (set() if no_sync or ws == 1 else {expect["reduce"]}), counter.records
    for m in get_fsdp_instances(root):
        for p in m.params:
            assert p.dtype == param_dtype
            if no_sync:  # unreduced, full size, in the compute dtype (upstream behaviour)
                assert p.grad.dtype == expect["compute"] and p.grad.shape == p._orig_size
            else:
                assert p.grad.dtype == param_dtype and p.grad.shape == p.shape
    assert_idle(root, after_forward=no_sync)  # after no_sync the root keeps its full parameters (upstream)


DTYPE_MODES = {
    "fp32": ({}, dict(param=torch.float32, compute=torch.float32, buffer=torch.float32, reduce=torch.float32)),
    "fp16": (
        MIXED["fp16"],
        dict(param=torch.float32, compute=torch.float16, buffer=torch.float16, reduce=torch.float16),
    ),
    "bf16": (
        MIXED["bf16"],
        dict(param=torch.float32, compute=torch.bfloat16, buffer=torch.bfloat16, reduce=torch.bfloat16),
    ),
    "fp16,fp32_reduce_scatter": (
        dict(mixed_precision=True, fp32_reduce_scatter=True),
        dict(param=torch.float32, compute=torch.float16, buffer=torch.float16, reduce=torch.float32),
    ),
    "fp16,buffer_dtype=fp32": (
        dict(mixed_precision=True, buffer_dtype=torch.float32),
        dict(param=torch.float32, compute=torch.float16, buffer=torch.float32, reduce=torch.float16),
    ),
    "pure_fp16": (
        dict(compute_dtype=torch.float16),
        dict(param=torch.float16, compute=torch.float16, buffer=torch.float16, reduce=torch.float16),
    ),
}


def _dtypes_of_params_buffers_grads_and_reductions_body(rank: int, ws: int) -> None:
    run_cases(
        (f"{name},no_sync={ns}", lambda k=k, e=e, ns=ns: _dtype_case(rank, ws, k, e, ns))
        for (name, (k, e)), ns in itertools.product(DTYPE_MODES.items(), (False, True))
    )


@pytest.mark.parametrize("world_size", [1, 2])
def test_dtypes_of_params_buffers_grads_and_reductions(world_size: int) -> None:
    run_distributed(_dtypes_of_params_buffers_grads_and_reductions_body, world_size)


def _to_dtype_after_wrapping_body(rank: int, ws: int) -> None:
    model, ref = build(NestedWrappedModule)
    fsdp = wrap_model(model, {}, "nested")
    torch.manual_seed(1)  # the same batch on every rank
    x = torch.randn(3, 7)
    fsdp(x).sum().backward()  # initialised first: _apply must redo lazy init
    fsdp.zero_grad()
    fsdp.double()
    ref.double()
    assert all(m.compute_dtype == torch.float64 for m in get_fsdp_instances(fsdp))
    out = fsdp(x.double())
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref(x.double()))
    out.sum().backward()
    ref(x.double()).sum().backward()
    # Every rank ran the same batch, so the averaged fp64 gradient equals the fp64 reference's.
    grads = gather_full_grads(fsdp)
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(grads) == set(want)
    for n, g in grads.items():
        torch.testing.assert_close(g, want[n].float(), msg=n)  # gather_full_grads returns fp32 copies
    for p in fsdp.parameters():
        assert p.dtype == torch.float64 and p.grad.dtype == torch.float64
    assert_idle(fsdp)


def test_to_dtype_after_wrapping() -> None:
    """``.double()`` on an idle model converts the shards; compute follows the new dtype (no mixed precision)."""

    run_distributed(_to_dtype_after_wrapping_body, 2)


def _collected_after_del(rank: int, ws: int) -> None:
    for obc in (False, True):
        net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        net[0] = FSDP(net[0], optimize_backward_concat=obc)
        model = FSDP(net, optimize_backward_concat=obc)
        with model.no_sync():
            model(torch.randn(3, 4)).sum().backward()
        model(torch.randn(3, 4)).sum().backward()
        instances = [weakref.ref(m) for m in get_fsdp_instances(model)]
        # The wrapped modules and flat parameters too: the views' autograd edge to their FlatParameter, whose
        # _param_infos point back at the modules, is cut when the wrapper goes (tests/nn/misc/test_flatten_params_leak).
        inner = [weakref.ref(m) for m in net.modules() if isinstance(m, nn.Linear)]
        flats = [weakref.ref(p) for p in model.parameters()]
        del model, net
        gc.collect()
        assert all(r() is None for r in instances), f"obc={obc}: an FSDP instance outlived its model"
        assert all(r() is None for r in inner + flats), f"obc={obc}: a wrapped module or flat parameter outlived it"


def test_dropped_model_is_garbage_collected() -> None:
    """Gradient hooks live in C++ where the garbage collector cannot see: they hold the instance weakly, so a dropped
    model (a sweep, a test) frees its FSDP state instead of leaking it."""
    run_distributed(_collected_after_del, 2)


class _SharedStatistic(nn.Module):
    """One buffer registered in two modules: ``a`` updates it in place, ``b`` reads it (and one fp64 buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        stat = torch.zeros(3)
        self.a.register_buffer("stat", stat)
        self.b.register_buffer("stat", stat)
        self.register_buffer("wide", torch.tensor([1 + 1e-12, 1e300], dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        self.a.stat.add_(1)
        return self.b(self.a(x)) + self.b.stat


def _mixed_precision_buffers_body(rank: int, world_size: int) -> None:
    # Lazy init and state_dict() cast each registration of a buffer to its own copy (the statistic b read stayed 0),
    # and state_dict() put fp64 buffers back through their fp32 copies (1e300 became inf in the live model).
    model = FSDP(_SharedStatistic(), mixed_precision=True, compute_dtype=torch.bfloat16, buffer_dtype=torch.float64)
    inner = model.module.module
    for step in range(2):
        model(torch.randn(2, 3)).float().sum().backward()
        wide = inner.wide
        sd = model.state_dict()
        assert sd["wide"].dtype == torch.float32 and sd["a.stat"].dtype == torch.float32  # upstream's format
        assert inner.wide is wide and inner.wide.dtype == torch.float64, "state_dict() replaced a live buffer"
        assert inner.wide.tolist() == [1 + 1e-12, 1e300]
        assert inner.a.stat is inner.b.stat and inner.b.stat.tolist() == [step + 1.0] * 3
    model.load_state_dict(sd)
    assert inner.a.stat is inner.b.stat and inner.b.stat.tolist() == [2.0] * 3


def test_mixed_precision_keeps_buffer_values_and_shared_buffers() -> None:
    run_distributed(_mixed_precision_buffers_body, 2)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _subgroup_reduce_scatter_warning_body(rank: int, world_size: int) -> None:
    # The default process_group_reduce_scatter is the world's: an instance on a subgroup (as the model-parallel docs
    # recommend) warned on every rank about an argument the user never set. A group the user passes still warns.
    groups = [dist.new_group([r]) for r in range(world_size)]
    records = _Warnings()
    logging.getLogger().addHandler(records)
    try:
        FSDP(nn.Linear(2, 2), process_group=groups[rank])
        assert not [m for m in records.messages if "process_group_reduce_scatter" in m], records.messages
        FSDP(nn.Linear(2, 2), process_group=groups[rank], process_group_reduce_scatter=dist.group.WORLD)
        assert [m for m in records.messages if "process_group_reduce_scatter has 2 ranks" in m], records.messages
    finally:
        logging.getLogger().removeHandler(records)


def test_default_reduce_scatter_group_on_a_subgroup_is_silent() -> None:
    run_distributed(_subgroup_reduce_scatter_warning_body, 2)
