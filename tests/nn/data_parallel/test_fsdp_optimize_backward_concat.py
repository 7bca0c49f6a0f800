# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``optimize_backward_concat`` (fork contract section 1, issue 7), on CPU with gloo.

Every test compares the flag on against the flag off and/or a single-process big-batch reference, and also checks
something only the feature does (no ``SplitWithSizesBackward``/``cat`` in no_sync backwards, one flat accumulation
buffer per unit, ``flat_param.grad`` untouched during the window), so none of them passes with the feature removed.
"""

import contextlib
import copy
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn as nn
from _models import DTYPES, UPDATE_REL, assert_update_close
from torch import Tensor

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.nn.checkpoint import checkpoint_wrapper
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import get_fsdp_instances, zero2_groups

TIMEOUT = 150.0
BATCH = 3
DIM_IN, DIM, DIM_OUT = 5, 7, 3


# ------------------------------------------------------------------------------------------------------ model


class Block(nn.Module):
    """Two linears plus a gate linear that can be switched off (its params then get no gradient)."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM + 2)
        self.gate = nn.Linear(DIM, DIM + 2)
        self.b = nn.Linear(DIM + 2, DIM)
        if tie:  # a parameter shared inside one FlatParameter
            self.gate.weight = self.a.weight
        self.use_gate = True

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.a(x))
        if self.use_gate:
            h = h * torch.sigmoid(self.gate(x))
        return x + self.b(h)


class Net(nn.Module):
    """input linear -> two blocks (the last can be skipped) -> head; odd sizes so every shard is padded."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM_IN, DIM)
        self.blocks = nn.ModuleList([Block(tie), Block(tie)])
        self.head = nn.Linear(DIM, DIM_OUT)
        self.skip_last = False

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        for i, blk in enumerate(self.blocks):
            if not (self.skip_last and i == len(self.blocks) - 1):
                h = blk(h)
        return self.head(h)


class Knobs:
    """Per-microbatch switches applied identically to the FSDP model and the reference."""

    def __init__(self, nets: List[Net], gate_off: Tuple[int, ...] = (), skip_last: Tuple[int, ...] = ()) -> None:
        self.nets = nets
        self.gate_off = gate_off
        self.skip_last = skip_last

    def set(self, mb: int) -> None:
        for net in self.nets:
            net.skip_last = mb in self.skip_last
            for blk in _raw_blocks(net):
                blk.use_gate = mb not in self.gate_off


def _raw_blocks(net: Net) -> List[Block]:
    return [m for m in net.modules() if isinstance(m, Block)]


def cfg(**overrides: Any) -> Dict[str, Any]:
    base = dict(
        nested=True,
        raf=True,
        prec="fp32",
        fp32rs=False,
        tie=False,
        ckpt="none",
        zero2=None,
        flatten=True,
        pattern="sequential",
        gate_off=(),
        skip_last=(),
        bucket=25,
    )
    base.update(overrides)
    return base


def build(c: Dict[str, Any], flag: bool) -> Tuple[FSDP, Net, Net]:
    """(fsdp model, its user module, unwrapped reference) from the same seed on every rank."""
    torch.manual_seed(0)
    net = Net(tie=c["tie"])
    ref = copy.deepcopy(net)
    kwargs: Dict[str, Any] = dict(
        reshard_after_forward=c["raf"],
        mixed_precision=c["prec"] != "fp32",
        compute_dtype=DTYPES[c["prec"]] if c["prec"] != "fp32" else None,
        fp32_reduce_scatter=c["fp32rs"],
        flatten_parameters=c["flatten"],
        optimize_backward_concat=flag,
        bucket_cap_mb=c["bucket"],
        zero2_process_group=c["zero2"],
    )
    if c["nested"]:
        for i, blk in enumerate(net.blocks):
            if c["ckpt"] == "inner":
                net.blocks[i] = FSDP(checkpoint_wrapper(blk), **kwargs)
            elif c["ckpt"] == "outer":
                net.blocks[i] = checkpoint_wrapper(FSDP(blk, **kwargs))
            else:
                net.blocks[i] = FSDP(blk, **kwargs)
    elif c["ckpt"] != "none":
        for i, blk in enumerate(net.blocks):
            net.blocks[i] = checkpoint_wrapper(blk)
    # Without nesting the root is the only instance: let it reshard so reshard_after_forward matters.
    model = FSDP(net, disable_reshard_on_root=c["nested"] or not c["raf"], **kwargs)
    return model, net, ref


def batch(step: int, mb: int, rank: int) -> Tensor:
    return torch.randn(BATCH, DIM_IN, generator=torch.Generator().manual_seed(1000 * step + 10 * mb + rank))


def mb_loss(out: Tensor) -> Tensor:
    return out.float().pow(2).sum()


# ------------------------------------------------------------------------------------------------------ runners


def run_window(
    model: FSDP, knobs: Knobs, step: int, num_mb: int, rank: int, pattern: str, probe: Callable[[], None]
) -> None:
    """One accumulation window: microbatches 0..M-2 forward *and* backward inside no_sync, the last outside.

    ``probe`` runs after the no_sync microbatches, before the synchronizing one.
    """
    if pattern == "fwd_fwd":  # several forwards before their backwards, inside the window
        with model.no_sync():
            losses = []
            for mb in range(num_mb - 1):
                knobs.set(mb)
                losses.append(mb_loss(model(batch(step, mb, rank))))
            for loss in losses:
                loss.backward()
    else:
        for mb in range(num_mb - 1):
            knobs.set(mb)
            with model.no_sync():
                mb_loss(model(batch(step, mb, rank))).backward()
    probe()
    knobs.set(num_mb - 1)
    mb_loss(model(batch(step, num_mb - 1, rank))).backward()


def train_fsdp(c: Dict[str, Any], flag: bool, num_mb: int, steps: int, rank: int) -> Tuple[List[Tensor], Dict]:
    """Grad shards after the first window, and the full state dict after ``steps`` SGD steps."""
    model, net, _ = build(c, flag)
    knobs = Knobs([net], c["gate_off"], c["skip_last"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    first_grads: List[Tensor] = []
    probe = (lambda: check_window_buffers(model, num_mb > 1 and c["flatten"])) if flag else (lambda: None)
    for step in range(steps):
        run_window(model, knobs, step, num_mb, rank, c["pattern"], probe)
        if step == 0:
            first_grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
        for m in get_fsdp_instances(model):
            for h in m._handles:
                assert h.grad_accum_flat is None, f"{h.name}: accumulation buffer not released after the window"
        opt.step()
        opt.zero_grad(set_to_none=True)
    return first_grads, model.state_dict()


def check_window_buffers(model: FSDP, expect_some: bool) -> None:
    """What only the feature does: no flat-level gradient, one flat accumulation buffer per unit (if any)."""
    seen = 0
    for m in get_fsdp_instances(model):
        for h in m._handles[: len(m._fsdp_wrapped_module.flat_params)]:
            # No flat-level gradient of its own: p.grad shows the window's sum as a view of the buffer (so that
            # zero_grad() inside the window clears it, as with the flag off), or is None.
            g = h.param.grad
            buf = h.grad_accum_flat
            assert g is None or (
                buf is not None and g.data_ptr() == buf.data_ptr() and g.numel() == h.numel
            ), f"{h.name}: flat_param.grad was written during the window"
            if h.grad_accum_flat is not None:
                seen += 1
                padded = h.shard_numel * h.world_size if h.is_sharded else h.numel  # the reduce-scatter input, as is
                assert h.grad_accum_flat.numel() == padded, f"{h.name}: buffer of {h.grad_accum_flat.numel()}"
                assert not h.grad_accum_flat[h.numel :].any(), f"{h.name}: padding of the buffer is not zero"
                # The dtype flag-off accumulates flat_param.grad in (the compute dtype), so numerics never change.
                want = m.compute_dtype if m.mixed_precision else torch.float32
                assert h.grad_accum_flat.dtype == want, f"{h.name}: buffer dtype {h.grad_accum_flat.dtype}, not {want}"
    assert seen > 0 or not expect_some, "no accumulation buffer after the no_sync microbatches"


def train_reference(c: Dict[str, Any], num_mb: int, steps: int, world_size: int) -> Dict[str, Tensor]:
    """The same schedule on one process, every microbatch as one global batch (all ranks' slices)."""
    torch.manual_seed(0)
    ref = Net(tie=c["tie"])
    knobs = Knobs([ref], c["gate_off"], c["skip_last"])
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(steps):
        for mb in range(num_mb):
            knobs.set(mb)
            x = torch.cat([batch(step, mb, r) for r in range(world_size)])
            (mb_loss(ref(x)) / world_size).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ref.state_dict()


def initial_params(c: Dict[str, Any]) -> Dict[str, Tensor]:
    """The parameters every run starts from (same seed as :func:`build` and :func:`train_reference`)."""
    torch.manual_seed(0)
    return {k: v.float() for k, v in Net(tie=c["tie"]).state_dict().items()}


def assert_close_dicts(got: Dict[str, Tensor], want: Dict[str, Tensor], c: Dict[str, Any], what: str) -> None:
    """fp32: elementwise closeness; mixed precision: closeness relative to the reference's update of each parameter."""
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    if c["prec"] == "fp32":
        for k in want:
            torch.testing.assert_close(got[k].float(), want[k].float(), atol=1e-5, rtol=1e-5, msg=f"{what}: {k}")
        return
    got32 = {k: v.float() for k, v in got.items()}
    want32 = {k: v.float() for k, v in want.items()}
    assert_update_close(got32, want32, initial_params(c), UPDATE_REL[c["prec"]], what)


def check_parity(c: Dict[str, Any], rank: int, world_size: int, windows: Tuple[int, ...] = (1, 2, 4)) -> None:
    """Flag on == flag off bitwise (gradient shards after the first window, parameters after two steps) and both
    close to the big-batch reference, for M in ``windows``."""
    for num_mb in windows:
        grads_on, sd_on = train_fsdp(c, True, num_mb, 2, rank)
        ref = train_reference(c, num_mb, 2, world_size)
        assert_close_dicts(sd_on, ref, c, f"M={num_mb} flag on vs reference")
        grads_off, sd_off = train_fsdp(c, False, num_mb, 2, rank)
        # Both paths accumulate in the same dtype and add the same values in the same order: the flag is a pure
        # speed/memory option, in every configuration (mixed precision, fp32_reduce_scatter, zero2, ...).
        assert len(grads_on) == len(
            grads_off
        ), f"M={num_mb}: {len(grads_on)} grads with the flag, {len(grads_off)} without"
        for i, (g_on, g_off) in enumerate(zip(grads_on, grads_off)):
            what = f"M={num_mb} grad {i}: {g_on.shape}/{g_on.dtype} with the flag, {g_off.shape}/{g_off.dtype} without"
            assert g_on.shape == g_off.shape and g_on.dtype == g_off.dtype, what
            assert torch.equal(g_on, g_off), f"M={num_mb} grad {i}: max diff {(g_on - g_off).abs().max()}"
        for k in sd_off:
            assert torch.equal(sd_on[k], sd_off[k]), f"M={num_mb} param {k} differs between flag on and off"


def _matrix() -> List[Tuple[str, Dict[str, Any]]]:
    cases = []
    for nested in (True, False):
        for raf in (True, False):
            for prec, fp32rs in (("fp32", False), ("fp16", False), ("fp16", True), ("bf16", False), ("bf16", True)):
                c = cfg(nested=nested, raf=raf, prec=prec, fp32rs=fp32rs)
                cases.append((f"nested={nested},raf={raf},{prec},fp32rs={fp32rs}", c))
    return cases


def _special_cases(zero2_group: Any) -> List[Tuple[str, Dict[str, Any]]]:
    return [
        ("shared_params", cfg(tie=True)),
        ("shared_params_bf16", cfg(tie=True, prec="bf16", nested=False)),
        ("no_grad_views_some_mbs", cfg(gate_off=(0, 3))),
        ("no_grad_unit_in_a_no_sync_mb", cfg(skip_last=(1,), prec="bf16", windows=(4,))),
        ("no_grad_unit_in_sync_mb", cfg(skip_last=(3,), windows=(4,))),
        ("checkpoint_inner", cfg(ckpt="inner")),
        ("checkpoint_outer", cfg(ckpt="outer")),
        ("checkpoint_outer_fp16_no_reshard", cfg(ckpt="outer", prec="fp16", raf=False)),
        ("fwd_fwd_bwd_bwd", cfg(pattern="fwd_fwd")),
        ("fwd_fwd_bwd_bwd_no_reshard_bf16", cfg(pattern="fwd_fwd", raf=False, prec="bf16")),
        ("zero2_g1", cfg(zero2=zero2_group)),
        ("zero2_g1_fp16", cfg(zero2=zero2_group, prec="fp16", fp32rs=True)),
        ("no_bucket", cfg(bucket=0)),
    ]


# ------------------------------------------------------------------------------------------------------ parity


def _parity_world2(rank: int, world_size: int) -> None:
    g1 = zero2_groups(1)  # every rank creates every group, in the same order
    cases = _matrix() + _special_cases(g1)
    run_cases((name, lambda c=c: check_parity(c, rank, world_size, c.get("windows", (1, 2, 4)))) for name, c in cases)


def test_parity_matrix_world_size_2() -> None:
    """Contract 1.4/1.5: the matrix of item 5, M = 1, 2, 4, flag on == flag off == reference."""
    run_distributed(_parity_world2, 2, timeout=TIMEOUT)


def _parity_world1(rank: int, world_size: int) -> None:
    cases = [
        ("fp32_nested", cfg()),
        ("fp16_fp32rs", cfg(prec="fp16", fp32rs=True)),
        ("bf16_unnested", cfg(prec="bf16", nested=False)),
        ("bf16_no_reshard", cfg(prec="bf16", raf=False, windows=(4,))),
        ("gate_off", cfg(gate_off=(1,))),
    ]
    run_cases((name, lambda c=c: check_parity(c, rank, world_size, c.get("windows", (1, 2, 4)))) for name, c in cases)


def test_parity_world_size_1() -> None:
    run_distributed(_parity_world1, 1, timeout=TIMEOUT)


def _unit_unused_in_first_forward(rank: int, world_size: int) -> None:
    c = cfg(skip_last=(0,))
    run_cases((f"flag={flag}", lambda flag=flag: check_parity(c, rank, world_size, (2,))) for flag in (True, False))


def test_unit_unused_in_the_first_forward() -> None:
    """A nested unit that does not run in the very first microbatch (params without grads there)."""
    run_distributed(_unit_unused_in_first_forward, 2, timeout=TIMEOUT)


def _checkpointed_submodules(rank: int, world_size: int) -> None:
    cases = []
    # Mixed precision with fp32_reduce_scatter: the regions' gradients wait for the end of backward there, and the
    # flag's path reduced them in the compute dtype (the handle still on its full parameter) while the flag-off
    # path cast to fp32 first; bitwise parity with the flag off catches it.
    for prec, fp32rs in (("fp32", False), ("bf16", True), ("fp16", True)):
        for raf in (True, False):
            c = cfg(nested=False, ckpt="inner", raf=raf, prec=prec, fp32rs=fp32rs)
            cases.append((f"{prec},fp32rs={fp32rs},raf={raf}", lambda c=c: check_parity(c, rank, world_size, (1, 2))))
    run_cases(cases)


def test_checkpointed_submodules_inside_one_unit() -> None:
    """Several checkpoint_wrapper regions inside one FSDP unit (reentrant recomputation in backward).

    Each region's recomputation runs its own inner backward, which reaches the unit's flat-parameter node with
    only that region's gradients; freeing the full parameters there breaks the next region's recomputation.
    """
    run_distributed(_checkpointed_submodules, 2, timeout=TIMEOUT)


def _flatten_off(rank: int, world_size: int) -> None:
    """Contract 1.6: with flatten_parameters=False the flag is accepted and changes nothing."""
    c = cfg(flatten=False)
    check_parity(c, rank, world_size, windows=(3,))
    model, _, _ = build(c, True)
    with model.no_sync():
        mb_loss(model(batch(0, 0, rank))).backward()
    for m in get_fsdp_instances(model):
        assert not m._fsdp_wrapped_module.flat_params
        for h in m._handles:
            assert h.grad_accum_flat is None
            assert h.param.grad is not None and h.param.grad.shape == h.orig_size  # plain no_sync accumulation


def test_flatten_parameters_false_is_a_no_op() -> None:
    run_distributed(_flatten_off, 2, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ profiler


def _backward_op_counts(loss: Tensor) -> Dict[str, int]:
    # The autograd profiler (not torch.profiler) starts in milliseconds in a fresh process.
    with torch.autograd.profiler.profile() as prof:
        loss.backward()
    counts = {"cat": 0, "split_backward": 0}
    for e in prof.function_events:
        if e.name == "aten::cat":
            counts["cat"] += 1
        elif e.name in ("SplitWithSizesBackward0", "FlatParamViewsBackward"):  # the flat parameter's views node
            counts["split_backward"] += 1
    return counts


def _profile_window(c: Dict[str, Any], flag: bool, rank: int) -> Tuple[List[Dict[str, int]], Dict[str, int], int]:
    model, _, _ = build(c, flag)
    units = sum(len(m._fsdp_wrapped_module.flat_params) for m in get_fsdp_instances(model))
    per_mb = []
    for mb in range(3):
        with model.no_sync():
            loss = mb_loss(model(batch(0, mb, rank)))
            per_mb.append(_backward_op_counts(loss))
    sync = _backward_op_counts(mb_loss(model(batch(0, 3, rank))))
    return per_mb, sync, units


def _profiler_body(rank: int, world_size: int) -> None:
    def case(c: Dict[str, Any]) -> None:
        on, sync_on, units = _profile_window(c, True, rank)
        off, sync_off, _ = _profile_window(c, False, rank)
        assert units == 3
        for mb, (a, b) in enumerate(zip(on, off)):
            assert a == {"cat": 0, "split_backward": 0}, f"no_sync microbatch {mb} with the flag: {a}"
            assert b["split_backward"] >= units, f"no_sync microbatch {mb} without: {b}"
            # Without the flag the views node concatenates while flat_param.grad does not exist yet (the first
            # microbatch), then adds the view gradients into it in place (forward_views).
            assert (b["cat"] >= units) if mb == 0 else (b["cat"] == 0), f"no_sync microbatch {mb} without: {b}"
        # The fork's goal: no concat in the synchronizing microbatch either (the bucketer copies into its bucket).
        assert sync_on == {"cat": 0, "split_backward": 0}, f"synchronizing microbatch with the flag: {sync_on}"
        assert sync_off["split_backward"] >= units

    run_cases(
        [
            ("fp32", lambda: case(cfg())),
            ("bf16_fp32rs", lambda: case(cfg(prec="bf16", fp32rs=True))),
            ("no_reshard_fp16", lambda: case(cfg(raf=False, prec="fp16"))),
        ]
    )


def test_profiler_no_concat_in_no_sync_backward() -> None:
    """Contract 1.1/1.3: 0 cat / views node per no_sync backward with the flag; without, >= 1 views node per unit
    in every microbatch and >= 1 cat per unit in the first (later ones add into flat_param.grad in place)."""
    run_distributed(_profiler_body, 2, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ collectives


def _counted_window(c: Dict[str, Any], flag: bool, rank: int) -> Tuple[List[Dict], FSDP, List[Dict[str, Any]]]:
    """Collective summaries per microbatch (forward and backward counted separately) and buffer snapshots."""
    model, _, _ = build(c, flag)
    summaries: List[Dict] = []
    snapshots: List[Dict[str, Any]] = []
    for mb in range(4):
        ctx = model.no_sync() if mb < 3 else contextlib.nullcontext()
        with ctx:
            with count_collectives() as fwd:
                loss = mb_loss(model(batch(0, mb, rank)))
            with count_collectives() as bwd:
                loss.backward()
        summaries.append({"forward": fwd.summary(), "backward": bwd.summary(), "rs": bwd.count("reduce_scatter")})
        snapshots.append(_buffer_snapshot(model))
    return summaries, model, snapshots


def _buffer_snapshot(model: FSDP) -> Dict[str, Any]:
    out = {}
    for i, m in enumerate(get_fsdp_instances(model)):
        for h in m._handles:
            buf = h.grad_accum_flat
            out[f"instance {i} {h.name}"] = {
                "buf": None if buf is None else (buf.numel(), buf.dtype),
                "numel": h.numel,
                "padded": h.shard_numel * h.world_size if h.is_sharded else h.numel,
                "grad": None if h.param.grad is None else tuple(h.param.grad.shape),
                "grad_in_buffer": buf is not None
                and h.param.grad is not None
                and h.param.grad.data_ptr() == buf.data_ptr(),
                "state": h.state,
            }
    return out


def _collectives_body(rank: int, world_size: int) -> None:
    def case(c: Dict[str, Any], accum_dtype: torch.dtype) -> None:
        on, model, snaps_on = _counted_window(c, True, rank)
        off, _, snaps_off = _counted_window(c, False, rank)
        units = [h for m in get_fsdp_instances(model) for h in m._handles]
        for mb in range(3):
            assert on[mb] == off[mb], f"no_sync microbatch {mb}: flag on {on[mb]} != flag off {off[mb]}"
            assert on[mb]["rs"] == 0
            for key, s in snaps_on[mb].items():
                # One flat buffer per unit in the compute dtype, and no flat-level AccumulateGrad: p.grad shows the
                # window's sum as a view of the buffer, shaped as the flag-off path's full-size p.grad.
                assert s["buf"] == (s["padded"], accum_dtype), f"microbatch {mb}, {key}: buffer {s['buf']}"
                assert s["grad"] == (s["numel"],) and s["grad_in_buffer"], f"microbatch {mb}, {key}: flat grad {s}"
                assert s["state"] == snaps_off[mb][key]["state"], f"microbatch {mb}, {key}: handle states differ"
                assert snaps_off[mb][key]["buf"] is None and snaps_off[mb][key]["grad"] == (s["numel"],)
        # Synchronizing microbatch: exactly one reduce-scatter per unit (bucketing off), buffers released.
        assert on[3]["rs"] == len(units), f"reduce-scatters in the synchronizing backward: {on[3]}"
        assert on[3] == off[3], f"synchronizing microbatch: flag on {on[3]} != flag off {off[3]}"
        for key, s in snaps_on[3].items():
            assert s["buf"] is None, f"{key}: buffer still alive after the reduction"

    run_cases(
        [
            ("fp32", lambda: case(cfg(bucket=0), torch.float32)),
            ("bf16", lambda: case(cfg(bucket=0, prec="bf16"), torch.bfloat16)),
            ("fp16_fp32rs_no_reshard", lambda: case(cfg(bucket=0, prec="fp16", fp32rs=True, raf=False), torch.float16)),
        ]
    )


def test_collectives_and_buffers() -> None:
    """No extra collective in no_sync backwards, one reduce-scatter per unit when syncing, one buffer per unit."""
    run_distributed(_collectives_body, 2, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ errors


def _sync_before_no_sync_backward(rank: int) -> str:
    model, _, _ = build(cfg(), True)
    with model.no_sync():
        pending = mb_loss(model(batch(0, 0, rank)))
    mb_loss(model(batch(0, 1, rank))).backward()  # the synchronizing backward reduces the window ...
    try:
        pending.backward()  # ... so this no_sync gradient has nowhere to go
    except RuntimeError as e:
        return str(e)
    raise AssertionError("a no_sync backward after its window's synchronizing backward did not raise")


def _no_sync_backward_in_next_window(rank: int) -> str:
    model, _, _ = build(cfg(prec="bf16"), True)
    with model.no_sync():
        stale = mb_loss(model(batch(0, 0, rank)))
    mb_loss(model(batch(0, 1, rank))).backward()
    with model.no_sync():  # a new window starts and accumulates ...
        mb_loss(model(batch(1, 0, rank))).backward()
    try:
        stale.backward()  # ... and a leftover microbatch of the old window must not be added to it
    except RuntimeError as e:
        return str(e)
    raise AssertionError("a no_sync backward of an earlier window did not raise")


def _errors_body(rank: int, world_size: int) -> None:
    for fn in (_sync_before_no_sync_backward, _no_sync_backward_in_next_window):
        msg = fn(rank)
        assert "optimize_backward_concat" in msg and "no_sync" in msg and "Rule" in msg, msg


def test_wrong_order_raises_on_every_rank() -> None:
    """Contract 1.7: a broken order raises a clear error (never drops or double-counts a gradient)."""
    run_distributed(_errors_body, 2, timeout=TIMEOUT)


def _two_sync_backwards(rank: int, world_size: int) -> None:
    """Several forwards outside no_sync, then their backwards: every backward syncs; equal to the flag off."""

    def run(flag: bool) -> List[Tensor]:
        model, _, _ = build(cfg(), flag)
        losses = [mb_loss(model(batch(0, mb, rank))) for mb in range(2)]
        for loss in losses:
            counts = _backward_op_counts(loss)
            assert (counts["split_backward"] == 0) == flag, f"flag={flag}: {counts}"
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    on, off = run(True), run(False)
    for a, b in zip(on, off):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_forward_forward_backward_backward_outside_no_sync() -> None:
    run_distributed(_two_sync_backwards, 2, timeout=TIMEOUT)


def _forward_outside_backward_inside(rank: int, world_size: int) -> None:
    """A microbatch whose forward ran outside no_sync() and whose backward runs inside it accumulates, as with the flag
    off (before, its reduce-scatter was issued and the end of that backward failed with "call flush() first"); the
    next synchronizing microbatch reduces both. Bitwise equal to the flag off, for nested and root-only models."""
    for nested in (False, True):
        grads: Dict[bool, List[Tensor]] = {}
        for flag in (False, True):
            model, _, _ = build(cfg(nested=nested), flag)
            loss = mb_loss(model(batch(0, 0, rank)))
            with model.no_sync():
                loss.backward()
            mb_loss(model(batch(0, 1, rank))).backward()
            grads[flag] = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        for on, off in zip(grads[True], grads[False]):
            assert torch.equal(on, off), f"nested={nested}: flag on and off disagree"


def test_forward_outside_no_sync_backward_inside_accumulates() -> None:
    run_distributed(_forward_outside_backward_inside, 2, timeout=TIMEOUT)


def _forward_inside_backward_outside(rank: int, world_size: int) -> None:
    """The window's forwards all inside no_sync(), the last microbatch's backward outside it: the flag took the
    forward's context and did not reduce there, and the reduced shards came out wrong, silently (0.15 to 0.5 off;
    found by a fuzz of state dicts at any point, session 43). The backward's context decides, as with the flag off:
    bitwise equal to it, for one to three microbatches, nested and root-only."""
    for nested, microbatches in ((False, 1), (False, 2), (True, 2), (False, 3)):
        grads: Dict[bool, List[Tensor]] = {}
        for flag in (False, True):
            model, _, _ = build(cfg(nested=nested), flag)
            for mb in range(microbatches):
                with model.no_sync():
                    loss = mb_loss(model(batch(0, mb, rank)))
                with model.no_sync() if mb < microbatches - 1 else contextlib.nullcontext():
                    loss.backward()
            grads[flag] = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        for on, off in zip(grads[True], grads[False]):
            assert torch.equal(on, off), f"nested={nested}, {microbatches} microbatches: flag on and off disagree"


def test_forward_inside_no_sync_backward_outside_reduces() -> None:
    run_distributed(_forward_inside_backward_outside, 2, timeout=TIMEOUT)


def test_flatten_params_wrapper_rejects_non_bool() -> None:
    from fairscale.nn.misc import FlattenParamsWrapper

    with pytest.raises(TypeError, match="optimize_backward_concat must be a bool"):
        FlattenParamsWrapper(nn.Linear(2, 2), optimize_backward_concat="yes")  # type: ignore[arg-type]


def _partial_backward(rank: int, world_size: int) -> None:
    """backward(inputs=params) and autograd.grad(loss, params) do not reach the accumulation buffer's hook: the
    flag then answers exactly like the default path instead of silently returning no gradient."""
    results: Dict[Tuple[bool, str], List[Tensor]] = {}
    for flag in (False, True):
        for mode in ("inputs", "autograd_grad"):
            model, _, _ = build(cfg(nested=False), flag)
            loss = mb_loss(model(batch(0, 0, rank)))
            params = list(model.parameters())
            if mode == "inputs":
                loss.backward(inputs=params)
                grads = [p.grad for p in params]
            else:
                grads = list(torch.autograd.grad(loss, params, allow_unused=True))
            assert all(g is not None for g in grads), f"flag={flag} {mode}: a parameter got no gradient"
            results[(flag, mode)] = [g.detach().clone() for g in grads]  # type: ignore[union-attr]
    for mode in ("inputs", "autograd_grad"):
        for on, off in zip(results[(True, mode)], results[(False, mode)]):
            assert torch.equal(on, off), f"{mode}: flag on and off disagree"


def test_partial_backward_matches_the_default_path() -> None:
    run_distributed(_partial_backward, 2, timeout=TIMEOUT)


def _halve_and_record(seen: List[Optional[Tuple[int, ...]]], grad: Optional[Tensor]) -> Tensor:
    seen.append(None if grad is None else tuple(grad.shape))
    assert grad is not None, "a hook on the flat parameter got None for its gradient"
    return grad * 0.5


def _hooks_on_flat_parameters(rank: int, world_size: int) -> None:
    """``p.register_hook`` on FSDP's parameters sees (and may change) this rank's gradient with the flag as without
    it; the buffer's path handed the hook None (a fuzz, session 49). Hooks registered before training, or halfway
    through a window (its first microbatch took the buffer's path); gradients of a window of three, flag on and off."""
    for when in ("before", "in the window"):
        results: Dict[bool, Tuple[List[Tensor], List[Optional[Tuple[int, ...]]]]] = {}
        for flag in (False, True):
            model, _, _ = build(cfg(nested=True), flag)
            seen: List[Optional[Tuple[int, ...]]] = []
            for mb in range(3):
                if mb == (0 if when == "before" else 1):
                    for p in model.parameters():
                        p.register_hook(functools.partial(_halve_and_record, seen))
                with model.no_sync() if mb < 2 else contextlib.nullcontext():
                    mb_loss(model(batch(0, mb, rank))).backward()
            results[flag] = ([p.grad.clone() for p in model.parameters()], seen)  # type: ignore[union-attr]
        assert results[True][1] == results[False][1], f"{when}: the hooks saw {results[True][1]}, flag off saw more"
        for on, off in zip(results[True][0], results[False][0]):
            torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-6, msg=f"hooks {when}: flag on and off disagree")


def _record_none_or_halve(seen: List[Optional[Tuple[int, ...]]], grad: Optional[Tensor]) -> Optional[Tensor]:
    seen.append(None if grad is None else tuple(grad.shape))
    return None if grad is None else grad * 0.5


def _hook_between_forward_and_backward(rank: int, world_size: int) -> None:
    """A hook registered after a forward that took the buffer's path gets None for that backward, with a warning
    that says why (a raise there left the ranks that did not register it waiting in the reduction); from the next
    forward it sees the gradient (the default path), as with the flag off."""
    model, _, _ = build(cfg(nested=False), True)
    reference, _, _ = build(cfg(nested=False), False)
    seen: List[Optional[Tuple[int, ...]]] = []
    for m in (model, reference):
        loss = mb_loss(m(batch(0, 0, rank)))
        handles = [p.register_hook(functools.partial(_record_none_or_halve, seen)) for p in m.parameters()]
        if m is model:
            with pytest.warns(UserWarning, match="registered on FSDP parameter 'flat_param_0' .* between a forward"):
                loss.backward()
            assert seen == [None], seen
        else:
            loss.backward()
        m.zero_grad()
        mb_loss(m(batch(0, 1, rank))).backward()
        for h in handles:
            h.remove()
    assert seen[1] is not None and seen[1:] == [seen[1]] * (len(seen) - 1), seen
    for on, off in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(on.grad, off.grad, rtol=1e-5, atol=1e-6)


def test_hooks_on_flat_parameters_see_the_gradient() -> None:
    run_distributed(_hooks_on_flat_parameters, 2, timeout=TIMEOUT)


def test_a_hook_registered_between_forward_and_backward_is_warned_about() -> None:
    run_distributed(_hook_between_forward_and_backward, 2, timeout=TIMEOUT)


class _EmbeddingNet(nn.Module):
    """An embedding with ``max_norm`` (renormalised in place by every forward) and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # Rows far below max_norm: the renormalisation is an in-place op that changes no value, so the wrapped model
        # and the plain one compute the same (FSDP renormalises the gathered copy, not its shards).
        self.emb = nn.Embedding(11, 4, max_norm=100.0)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.emb(tokens)).sum(dim=1)


def _embedding_max_norm(rank: int, world_size: int, flag: bool) -> None:
    """``F.embedding(..., max_norm=...)`` modifies its weight in place (under no_grad): the weight is an output of a
    function returning several views of the flat parameter (split, or the flag's function), which autograd refused to
    use after an in-place change ("a function that returns multiple views") until the views were detached. Gradients
    of a window match the plain module's on the whole batch, flag on and off.
    """
    ref = _EmbeddingNet()
    model = FSDP(_EmbeddingNet(), optimize_backward_concat=flag)
    batches = [
        torch.randint(0, 11, (world_size * 2, 5), generator=torch.Generator().manual_seed(mb)) for mb in range(3)
    ]
    for mb, tokens in enumerate(batches):
        mine = tokens[rank * 2 : (rank + 1) * 2]
        ctx = model.no_sync() if mb < len(batches) - 1 else contextlib.nullcontext()
        with ctx:
            model(mine).pow(2).mean().backward()
        for r in range(world_size):  # the plain module sees every rank's slice; FSDP averages over the ranks
            (ref(tokens[r * 2 : (r + 1) * 2]).pow(2).mean() / world_size).backward()
    with torch.no_grad():
        flat_grad = model.params[0].grad
        assert flat_grad is not None, "no gradient after the window"
        full = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])  # type: ignore[union-attr]
        shard = full.new_zeros(flat_grad.numel() * world_size)
        shard[: full.numel()] = full
        expected = shard.chunk(world_size)[rank]
        assert torch.allclose(flat_grad, expected, rtol=1e-5, atol=1e-6), f"rank {rank}: gradient shard differs"


@pytest.mark.parametrize("flag", [False, True], ids=["flag off", "flag on"])
def test_embedding_with_max_norm(flag: bool) -> None:
    run_distributed(_embedding_max_norm, 2, flag, timeout=TIMEOUT)
