# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""State dicts at any point of a step (fork contract section 3, issue 9), on CPU with gloo.

Model A calls ``state_dict()`` / ``local_state_dict()`` / ``summon_full_params()`` between forwards and their
backwards (and between microbatches of a no_sync window); its twin B never calls anything. The calls must return the
idle values, and A must end every backward and step bitwise equal to B, with the same handle states and buffers.
"""

import contextlib
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.checkpoint import checkpoint_wrapper
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import TrainingState, get_fsdp_instances, zero2_groups
from fairscale.nn.data_parallel._fsdp.state import HandleState

TIMEOUT = 150.0
BATCH = 2
DIM_IN, DIM, DIM_OUT = 5, 7, 3
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# "summon" may write (non-volatile): when idle it may drop compute copies gathered before (they could be stale), so
# only there the handle states may go from FULL to SHARDED. "summon_volatile" must leave everything as it was.
CALLS = ("state_dict", "local_state_dict", "summon", "summon_volatile")


# ------------------------------------------------------------------------------------------------------ model


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM + 2)
        self.b = nn.Linear(DIM + 2, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM_IN, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, DIM_OUT)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, DIM))  # a buffer state dicts must carry

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(torch.tanh(self.inp(x)) + self.shift))


def cfg(**overrides: Any) -> Dict[str, Any]:
    base = dict(
        prec="fp32",
        raf=True,
        root_reshards=False,
        flatten=True,
        cpu=False,
        obc=False,
        zero2=False,
        nested=True,
        ckpt=False,  # checkpoint_wrapper around each block, inside its unit: backward recomputes from the views
    )
    base.update(overrides)
    return base


def build(c: Dict[str, Any], zero2: Any) -> FSDP:
    torch.manual_seed(0)
    net = Net()
    kwargs: Dict[str, Any] = dict(
        mixed_precision=c["prec"] != "fp32",
        compute_dtype=DTYPES[c["prec"]] if c["prec"] != "fp32" else None,
        reshard_after_forward=c["raf"],
        flatten_parameters=c["flatten"],
        move_params_to_cpu=c["cpu"],
        optimize_backward_concat=c["obc"],
        zero2_process_group=zero2 if c["zero2"] else None,
    )
    if c["ckpt"]:
        for i in range(len(net.blocks)):
            net.blocks[i] = checkpoint_wrapper(net.blocks[i])
    if c["nested"]:
        for i in range(len(net.blocks)):
            net.blocks[i] = FSDP(net.blocks[i], **kwargs)
    return FSDP(net, disable_reshard_on_root=not c["root_reshards"], **kwargs)


def batch(step: int, mb: int, rank: int) -> Tensor:
    return torch.randn(BATCH, DIM_IN, generator=torch.Generator().manual_seed(1000 * step + 10 * mb + rank))


def mb_loss(out: Tensor) -> Tensor:
    return out.float().pow(2).sum()


# ------------------------------------------------------------------------------------------------------ snapshots


def snapshot(model: FSDP, with_ptrs: bool = False) -> List[Any]:
    """Training states, handle states and which buffers are allocated (with data pointers if asked)."""
    out: List[Any] = []
    for m in get_fsdp_instances(model):
        out.append(("instance", m.training_state))
        for h in m._handles:
            full = h.full_padded
            full_bytes = None if full is None else full.untyped_storage().size()
            entry = [
                h.name,
                h.state,
                full_bytes,
                None if h.zero2_slice is None else (h.zero2_slice.numel(), h.zero2_slice.dtype),
                None if h.grad_accum_flat is None else (h.grad_accum_flat.numel(), h.grad_accum_flat.dtype),
                None if h.saved_grad_shard is None else tuple(h.saved_grad_shard.shape),
                None if h.param.grad is None else (tuple(h.param.grad.shape), h.param.grad.dtype),
                h.param.data.data_ptr() == h.fp32_shard.data_ptr() if h.fp32_shard is not None else None,
                tuple(h.param.data.shape),
            ]
            if with_ptrs:
                entry.append(None if not full_bytes else full.data_ptr())  # type: ignore[union-attr]
                entry.append(None if h.zero2_slice is None else h.zero2_slice.data_ptr())
                entry.append(None if h.grad_accum_flat is None else h.grad_accum_flat.data_ptr())
            out.append(tuple(entry))
    return out


def grads_of(model: FSDP) -> List[Optional[Tensor]]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def accumulated(model: FSDP) -> List[Optional[Tensor]]:
    """Everything a no_sync window has accumulated so far: p.grad and the optimize_backward_concat buffers."""
    out = grads_of(model)
    for m in get_fsdp_instances(model):
        for h in m._handles:
            out.append(None if h.grad_accum_flat is None else h.grad_accum_flat.clone())
    return out


def assert_same(a: List[Optional[Tensor]], b: List[Optional[Tensor]], what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} tensors"
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x is None) == (y is None), f"{what}: tensor {i} is None on one side only"
        if x is not None:
            assert y is not None and x.dtype == y.dtype and x.shape == y.shape, f"{what}: tensor {i} dtype/shape"
            assert torch.equal(x, y), f"{what}: tensor {i} differs (max {(x.float() - y.float()).abs().max()})"


def assert_same_dict(got: Dict[str, Any], want: Dict[str, Any], what: str) -> None:
    assert list(got) == list(want), f"{what}: keys {list(got)} != {list(want)}"
    for k, v in want.items():
        if isinstance(v, Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, f"{what}: {k} dtype/shape"
            assert torch.equal(got[k].cpu(), v.cpu()), f"{what}: {k} differs from the idle value"
        else:
            assert got[k] == v, f"{what}: {k}"


# ------------------------------------------------------------------------------------------------------ the calls


def take(model: FSDP, kind: str) -> Dict[str, Any]:
    """One checkpoint-style call; returns its values (cloned, so later steps cannot change them)."""
    if kind == "state_dict":
        return {k: v.clone() for k, v in model.state_dict().items()}
    if kind == "local_state_dict":
        return {k: v.clone() if isinstance(v, Tensor) else v for k, v in model.local_state_dict().items()}
    with model.summon_full_params(volatile=kind == "summon_volatile"):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def call_and_check(model: FSDP, kind: str, idle: Dict[str, Any], where: str, pending: bool) -> None:
    """The call returns the idle values and leaves states, buffers and their storages exactly as they were."""
    before = snapshot(model, with_ptrs=True)
    acc_before = accumulated(model)
    got = take(model, kind)
    assert_same_dict(got, idle, f"{kind} {where}")
    after = snapshot(model, with_ptrs=True)
    if kind == "summon" and not pending:
        before, after = [_forget_full_copies(before), _forget_full_copies(after)]
    assert after == before, f"{kind} {where}: states or buffers changed:\n{before}\n{after}"
    assert_same(accumulated(model), acc_before, f"{kind} {where}: accumulated gradients changed")
    if pending:
        check_loads_refused(model, where)


def _forget_full_copies(snap: List[Any]) -> List[Any]:
    """A snapshot where a FULL handle reads as a SHARDED one with its full buffer freed."""
    out = []
    for entry in snap:
        if entry[0] != "instance" and entry[1] == HandleState.FULL and entry[2]:
            entry = (entry[0], HandleState.SHARDED, 0) + entry[3:-3] + (None,) + entry[-2:]
        out.append(entry)
    return out


def check_loads_refused(model: FSDP, where: str) -> None:
    """Contract 3.3: loading between a forward and its backward raises and changes nothing."""
    shards = [p.detach().clone() for p in model.parameters()]
    before = snapshot(model, with_ptrs=True)
    full = {k: v + 1 for k, v in model.state_dict().items()}
    local = {k: v + 1 if isinstance(v, Tensor) else v for k, v in model.local_state_dict().items()}
    for name, load in (
        ("load_state_dict", model.load_state_dict),
        ("load_local_state_dict", model.load_local_state_dict),
    ):
        try:
            load(full if name == "load_state_dict" else local)  # type: ignore[operator]
        except RuntimeError as e:
            assert "between a forward and its backward" in str(e), f"{name} {where}: unclear error: {e}"
        else:
            raise AssertionError(f"{name} {where}: loading between a forward and its backward did not raise")
    assert_same([p.detach() for p in model.parameters()], shards, f"parameters after a refused load {where}")
    assert snapshot(model, with_ptrs=True) == before, f"refused load {where}: states or buffers changed"


# ------------------------------------------------------------------------------------------------------ runs


POINTS = ("nosync_pending", "between_microbatches", "sync_pending")


def run(c: Dict[str, Any], zero2: Any, rank: int, kind: Optional[str]) -> List[Any]:
    """Two steps of a 2-microbatch window; with ``kind`` the call is made at every point of ``POINTS``.

    Returns what the no-call twin must match: snapshots and gradients after every backward, params after every step.
    """
    model = build(c, zero2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trace: List[Any] = []
    for step in range(2):
        idle = take(model, kind) if kind else {}
        for mb in range(2):
            ctx = model.no_sync() if mb == 0 else contextlib.nullcontext()
            with ctx:
                loss = mb_loss(model(batch(step, mb, rank)))
                if kind:
                    call_and_check(model, kind, idle, f"step {step} {POINTS[2 * mb]}", pending=True)
                loss.backward()
            trace.append((f"step {step} mb {mb}", snapshot(model), accumulated(model), loss.item()))
            if kind and mb == 0:
                call_and_check(model, kind, idle, f"step {step} {POINTS[1]}", pending=False)
        for m in get_fsdp_instances(model):
            assert m.training_state == TrainingState.IDLE
        opt.step()
        opt.zero_grad(set_to_none=True)
        trace.append((f"step {step} params", snapshot(model), [p.detach().clone() for p in model.parameters()], 0.0))
    return trace


def compare_traces(a: List[Any], b: List[Any], what: str) -> None:
    assert len(a) == len(b)
    for (where, snap_a, tensors_a, loss_a), (_, snap_b, tensors_b, loss_b) in zip(a, b):
        assert snap_a == snap_b, f"{what}, {where}: states/buffers differ from the run without calls"
        assert_same(tensors_a, tensors_b, f"{what}, {where}")
        assert loss_a == loss_b, f"{what}, {where}: loss"


CONFIGS: List[Tuple[str, Dict[str, Any]]] = [
    ("root_keeps_full_params", cfg()),
    ("every_instance_reshards", cfg(root_reshards=True)),
    ("no_reshard", cfg(raf=False)),
    ("unnested_root_reshards", cfg(nested=False, root_reshards=True)),
    ("zero2_g1", cfg(zero2=True)),
    ("zero2_g1_root_reshards_bf16", cfg(zero2=True, root_reshards=True, prec="bf16")),
    ("fp16", cfg(prec="fp16")),
    ("bf16", cfg(prec="bf16")),
    ("move_params_to_cpu", cfg(cpu=True)),
    ("move_params_to_cpu_fp16", cfg(cpu=True, prec="fp16")),
    ("optimize_backward_concat", cfg(obc=True)),
    ("optimize_backward_concat_bf16_zero2", cfg(obc=True, prec="bf16", zero2=True)),
    ("flatten_false", cfg(flatten=False)),
    # A checkpointed region recomputed by the pending backward read the views that leaving the summon made (of the
    # summoned fp32 copy): a dtype error under bf16, gradients lost or wrong with optimize_backward_concat.
    ("checkpoint_bf16", cfg(ckpt=True, prec="bf16")),
    ("checkpoint_optimize_backward_concat", cfg(ckpt=True, obc=True)),
    ("checkpoint_unnested_optimize_backward_concat", cfg(ckpt=True, obc=True, nested=False)),
]


def _anytime(rank: int, world_size: int) -> None:
    zero2 = zero2_groups(1)

    def case(c: Dict[str, Any]) -> None:
        baseline = run(c, zero2, rank, None)
        for kind in CALLS:
            compare_traces(run(c, zero2, rank, kind), baseline, kind)

    run_cases((name, lambda c=c: case(c)) for name, c in CONFIGS)


def test_calls_between_forward_and_backward() -> None:
    """Contract 3.1-3.3 in every configuration: idle values, identical training, loads refused."""
    run_distributed(_anytime, 2, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ hooks


def _forward_hook_cases(rank: int, world_size: int) -> None:
    zero2 = zero2_groups(1)

    def case(c: Dict[str, Any], kind: str, swallow: bool) -> None:
        """state_dict from a forward hook of a submodule: a clear error, or correct; never a corruption."""
        twin = build(c, zero2)
        model = build(c, zero2)
        idle = take(model, kind)
        seen: List[BaseException] = []
        target = [m for m in model.modules() if isinstance(m, Block)][0].a

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            try:
                assert_same_dict(take(model, kind), idle, f"{kind} from a forward hook")
            except RuntimeError as e:
                seen.append(e)
                if not swallow:
                    raise

        handle = target.register_forward_hook(hook)
        try:
            mb_loss(model(batch(0, 0, rank))).backward()
        except RuntimeError as e:
            assert not swallow and seen and e is seen[0]
        handle.remove()
        for e in seen:
            assert "forward" in str(e).lower() and ("summon" in str(e) or "state_dict" in str(e)), f"unclear: {e}"
        if not swallow and seen:
            # The failed step is abandoned: the model must still train exactly like the twin.
            for m in get_fsdp_instances(model):
                assert m.training_state == TrainingState.IDLE, m.training_state
            mb_loss(model(batch(0, 0, rank))).backward()
        mb_loss(twin(batch(0, 0, rank))).backward()
        assert_same(grads_of(model), grads_of(twin), f"{kind} hook: gradients")
        for opt_model in (model, twin):
            torch.optim.SGD(opt_model.parameters(), lr=0.1).step()
        assert_same_dict(model.state_dict(), twin.state_dict(), f"{kind} hook: params after the step")

    cases = []
    for name, c in (("fp32", cfg()), ("zero2_bf16", cfg(zero2=True, prec="bf16")), ("obc", cfg(obc=True))):
        for kind in CALLS:
            for swallow in (True, False):
                cases.append((f"{name},{kind},swallow={swallow}", lambda c=c, k=kind, s=swallow: case(c, k, s)))
    run_cases(cases)


def test_state_dict_from_a_forward_hook() -> None:
    run_distributed(_forward_hook_cases, 2, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ idle cases


def _idle_cases(rank: int, world_size: int) -> None:
    def before_first_forward() -> None:
        """Contract 3.4: state_dict before the first forward, then the model is still movable and trains."""
        torch.manual_seed(0)
        ref = Net()
        model = build(cfg(), None)
        sd = model.state_dict()
        assert_same_dict(sd, ref.state_dict(), "state_dict before the first forward")
        model = model.to(torch.float64).to(torch.float32)  # still movable: lazy init was undone
        twin = build(cfg(), None)
        for m in (model, twin):
            mb_loss(m(batch(0, 0, rank))).backward()
        assert_same(grads_of(model), grads_of(twin), "gradients after a state_dict before the first forward")

    def load_when_idle() -> None:
        """Loading when idle (after a backward) works as upstream."""
        model, twin = build(cfg(), None), build(cfg(), None)
        mb_loss(twin(batch(0, 0, rank))).backward()
        torch.optim.SGD(twin.parameters(), lr=0.1).step()
        mb_loss(model(batch(0, 1, rank))).backward()
        model.load_state_dict(twin.state_dict())
        assert_same([p.detach() for p in model.parameters()], [p.detach() for p in twin.parameters()], "load")

    def modules_keep_their_tensors() -> None:
        """state_dict() and summon_full_params() between steps leave the modules' tensors as they were: leaving the
        summon used to give them views of the gathered fp32 copy, which stayed alive until the next forward."""
        model = build(cfg(root_reshards=True), None)
        mb_loss(model(batch(0, 0, rank))).backward()

        def held() -> List[int]:
            # Between steps the modules hold stand-ins for their views (the full buffers are freed).
            return [id(m.__dict__[n]) for m in model.modules() for n in ("weight", "bias") if n in m.__dict__]

        before = held()
        assert before, "the modules hold stand-ins for their views between steps"
        model.state_dict()
        assert held() == before, "state_dict() changed what the modules hold"
        with model.summon_full_params():
            pass
        assert held() == before, "summon_full_params() changed what the modules hold"
        mb_loss(model(batch(0, 1, rank))).backward()  # the views of the last forward come back for it, new ones made

    run_cases(
        [
            ("before_first_forward", before_first_forward),
            ("load_when_idle", load_when_idle),
            ("modules_keep_their_tensors", modules_keep_their_tensors),
        ]
    )


def test_idle_state_dict_and_load() -> None:
    run_distributed(_idle_cases, 2, timeout=TIMEOUT)
