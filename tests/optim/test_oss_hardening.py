# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OSS under input that used to abort, hang or give silently wrong values (issue 26).

* Ranks with different parameters (shapes, dtypes, frozen flags) raise the same ``RanksDisagreeError`` on every rank
  at construction, ``add_param_group`` and ``refresh_trainable`` (gloo used to abort the process at the first step).
* ``OSS(optim=fairscale.optim.Adam)`` reloads its own consolidated state dict (``KeyError: 'optim_scale'`` before),
  with per-rank fp16 state scales brought to one.
* ``broadcast_fp16=True`` keeps values beyond the fp16 range exact instead of turning them into inf.

Real gloo worlds; each body catches the expected error and returns its message, so the test sees every rank's.
"""

import copy
import io
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.distributed as dist
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.collectives import count_collectives
from fairscale.optim import OSS, Adam, Precision

# Short: the failures these tests guard against were hangs.
TIMEOUT = 60.0


def _model(hidden: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 3))


def _data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model: nn.Module, oss: OSS, rank: int, world_size: int, steps: range) -> None:
    for step in steps:
        oss.zero_grad()
        model(_data(step, rank).to(next(model.parameters()).dtype)).float().pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        oss.step()


# ------------------------------------------------------------------------------------------------------------------
# Ranks that disagree


def _disagree_body(rank: int, world_size: int, case: str) -> str:
    model = _model(hidden=7 if case == "shape" and rank == 1 else 6)
    if case == "dtype" and rank == 1:
        model.double()
    if case == "frozen" and rank == 1:
        model[2].weight.requires_grad_(False)
    try:
        OSS(model.parameters(), lr=0.1)
    except RanksDisagreeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "case,where",
    [
        ("shape", "('group 0, parameter 0', (6, 4), 'torch.float32', True) vs ('group 0, parameter 0', (7, 4)"),
        (
            "dtype",
            "('group 0, parameter 0', (6, 4), 'torch.float32', True) vs "
            "('group 0, parameter 0', (6, 4), 'torch.float64'",
        ),
        (
            "frozen",
            "('group 0, parameter 2', (3, 6), 'torch.float32', True) vs "
            "('group 0, parameter 2', (3, 6), 'torch.float32', False)",
        ),
    ],
    ids=["shape", "dtype", "frozen"],
)
def test_construction_with_other_parameters_on_one_rank(case: str, where: str) -> None:
    messages = run_distributed(_disagree_body, 2, case, timeout=TIMEOUT)
    assert messages[0] == messages[1], "the same error on every rank"
    assert (
        "OSS: the parameters (shape, dtype, requires_grad), the optimizer, hyper-parameters and broadcast arguments "
        "differ between ranks" in messages[0]
    )
    assert "global rank 1" in messages[0] and "freeze or unfreeze on every rank alike" in messages[0]
    assert where in messages[0], messages[0]


def _later_disagreement_body(rank: int, world_size: int) -> List[str]:
    model = _model()
    head = nn.Linear(3, 5 if rank == 1 else 3)
    oss = OSS(model.parameters(), lr=0.1)
    messages = []
    try:
        oss.add_param_group({"params": head.parameters(), "lr": 0.01})
    except RanksDisagreeError as e:
        messages.append(str(e))
    assert len(oss.param_groups) == 1 and len(oss.optim.param_groups) == 1, "a refused group is not added"

    if rank == 1:
        model[0].bias.requires_grad_(False)
    try:
        oss.refresh_trainable()
    except RanksDisagreeError as e:
        messages.append(str(e))
    # Unfrozen again on rank 1: the ranks agree and train as before.
    model[0].bias.requires_grad_(True)
    oss.refresh_trainable()
    _train(model, oss, rank, world_size, range(2))
    gathered = [torch.empty(0)] * world_size
    dist.all_gather_object(gathered, [p.detach() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(gathered[0], gathered[1]))
    return messages


def test_add_param_group_and_refresh_trainable_that_differ_between_ranks() -> None:
    results = run_distributed(_later_disagreement_body, 2, timeout=TIMEOUT)
    assert results[0] == results[1] and len(results[0]) == 2
    added, refreshed = results[0]
    assert added.startswith("OSS.add_param_group: the parameters") and "group 1, parameter 0" in added
    assert refreshed.startswith("OSS.refresh_trainable: the parameters")
    assert (
        "('group 0, parameter 1', (6,), 'torch.float32', True) vs "
        "('group 0, parameter 1', (6,), 'torch.float32', False)" in refreshed
    )


# ------------------------------------------------------------------------------------------------------------------
# OSS(optim=fairscale.optim.Adam) checkpoints


def _adam_reload_body(rank: int, world_size: int) -> None:
    model = _model()
    oss = OSS(model.parameters(), optim=Adam, lr=0.01)
    _train(model, oss, rank, world_size, range(2))
    state = copy.deepcopy(oss.state_dict(all_ranks=True))
    assert state["optim_scale"] == 1.0

    twin_model = _model()
    twin_model.load_state_dict(model.state_dict())
    twin = OSS(twin_model.parameters(), optim=Adam, lr=0.5)
    twin.load_state_dict(state)
    assert twin.optim._optim_scale == 1.0 and twin.param_groups[0]["lr"] == 0.01
    _train(model, oss, rank, world_size, range(2, 4))
    _train(twin_model, twin, rank, world_size, range(2, 4))
    for a, b in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(a, b), "the reloaded optimizer continues exactly"


def _unscaled(state: Dict[str, Any]) -> Dict[Tuple[int, str], torch.Tensor]:
    return {
        (k, name): entry[name].float() / state["optim_scale"]
        for k, entry in state["state"].items()
        for name in ("exp_avg", "exp_avg_sq")
    }


def _pure_fp16_scales_body(rank: int, world_size: int) -> None:
    """PURE_FP16 keeps fp16 state multiplied by a per-rank scale. After rank 1's scale halved (as after an overflow
    of its state), the consolidated dict holds the smallest scale and every moment at that scale."""
    models = [_model().half() for _ in range(2)]
    opts = [OSS(m.parameters(), optim=Adam, lr=0.01, precision=Precision.PURE_FP16) for m in models]
    for m, o in zip(models, opts):
        _train(m, o, rank, world_size, range(2))
    reference = copy.deepcopy(opts[0].state_dict(all_ranks=True))
    if rank == 1:  # the same moments stored at half the scale (exact: a power of two)
        inner = opts[1].optim
        inner._optim_scale /= 2
        for entry in inner.state.values():
            for name in ("exp_avg", "exp_avg_sq"):
                entry[name] = (entry[name].float() / 2).half()
    state = copy.deepcopy(opts[1].state_dict(all_ranks=True))
    assert reference["optim_scale"] == 2.0**16 and state["optim_scale"] == 2.0**15
    want, got = _unscaled(reference), _unscaled(state)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    fresh = OSS(_model().half().parameters(), optim=Adam, lr=0.01, precision=Precision.PURE_FP16)
    fresh.load_state_dict(copy.deepcopy(state))
    assert fresh.optim._optim_scale == 2.0**15
    assert fresh.state_dict(all_ranks=True)["optim_scale"] == 2.0**15


def _adam_bad_state_body(rank: int, world_size: int) -> str:
    """State that only the owning rank's inner Adam could refuse is refused on every rank, before any change."""
    model = _model()
    oss = OSS(model.parameters(), optim=Adam, lr=0.01)
    _train(model, oss, rank, world_size, range(1))
    bad = copy.deepcopy(oss.state_dict(all_ranks=True))
    del bad["state"][3]["exp_avg_sq"]
    before = copy.deepcopy(oss.optim.state_dict())
    try:
        oss.load_state_dict(bad)
    except ValueError as e:
        after = oss.optim.state_dict()
        assert all(
            torch.equal(before["state"][k][n], after["state"][k][n])
            for k in before["state"]
            for n in ("exp_avg", "exp_avg_sq")
        )
        return str(e)
    return "no error"


def test_oss_with_fairscale_adam_reloads_its_consolidated_state_dict() -> None:
    run_distributed(_adam_reload_body, 2, timeout=TIMEOUT)


def test_pure_fp16_state_scales_are_merged() -> None:
    run_distributed(_pure_fp16_scales_body, 2, timeout=TIMEOUT)


def test_inner_adam_checks_run_on_every_rank() -> None:
    messages = run_distributed(_adam_bad_state_body, 2, timeout=TIMEOUT)
    assert messages[0] == messages[1] and "state of parameter 3 has no ['exp_avg_sq']" in messages[0]


def _other_checkpoint_body(rank: int, world_size: int, kind: str) -> str:
    """A rank given another checkpoint (an older step's, an emptied state) kept the state of the parameters it owns
    from its own dict: the optimizer was a mix of two checkpoints, silently (found by a rank-disagreement fuzz,
    session 40). Every rank raises now, before any change; the same dict loaded twice still loads."""
    model = _model()
    oss = OSS(model.parameters(), optim=Adam, lr=0.01)
    _train(model, oss, rank, world_size, range(1))
    older = copy.deepcopy(oss.state_dict(all_ranks=True))
    _train(model, oss, rank, world_size, range(1, 2))
    state = copy.deepcopy(oss.state_dict(all_ranks=True))
    if kind == "same dict twice":
        oss.load_state_dict(state)  # replaces other ranks' entries by {} in the caller's dict (upstream's behaviour)
        oss.load_state_dict(state)
        return "loaded"
    if rank == 1:
        state = older if kind == "older step" else {**state, "state": {}}
    before = copy.deepcopy(oss.optim.state_dict())
    try:
        oss.load_state_dict(state)
    except RanksDisagreeError as e:
        after = oss.optim.state_dict()
        assert before["state"].keys() == after["state"].keys()
        for key, entry in before["state"].items():
            for name, value in entry.items():
                got = after["state"][key][name]
                assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, (key, name)
        return str(e).split(" (checksum")[0]
    return "no error"


def _mixed_dtype_clip_body(rank: int, world_size: int, low: torch.dtype, scale: float) -> Tuple[float, str, float]:
    # Each rank owning gradients of another dtype (OSS gives one rank the fp32 group, the other the low-precision
    # one): the total norm came back in each rank's own dtype, so the ranks clipped by other factors, an fp16 rank got
    # inf above 65504 and zeroed its gradients, and the returned norms differed (found by an OSS fuzz, session 40).
    torch.manual_seed(0)
    big = nn.Parameter(torch.randn(16, 8))
    small = nn.Parameter(torch.randn(8, 4).to(low))
    oss = OSS([{"params": [big]}, {"params": [small]}], optim=torch.optim.SGD, lr=0.1)
    owners = {id(p): r for r, groups in enumerate(oss.partition_parameters()) for g in groups for p in g["params"]}
    assert owners[id(big)] != owners[id(small)]
    g = torch.Generator().manual_seed(1)
    big.grad = torch.randn(16, 8, generator=g) * scale
    small.grad = torch.randn(8, 4, generator=g).to(low)
    ref = [nn.Parameter(torch.zeros_like(p.grad)) for p in (big, small)]
    for r, p in zip(ref, (big, small)):
        r.grad = p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    total = oss.clip_grad_norm(1.0)
    mine, expected = (big, ref[0]) if owners[id(big)] == rank else (small, ref[1])
    assert torch.isfinite(total) and torch.allclose(total.double(), want.double(), rtol=1e-6), (total, want)
    assert expected.grad is not None and mine.grad is not None
    error = ((mine.grad.float() - expected.grad.float()).abs().max() / expected.grad.float().abs().max()).item()
    return total.item(), str(total.dtype), error


def _clip_with_a_rank_without_grads_body(rank: int, world_size: int) -> Tuple[str, float]:
    # One bf16 parameter, so one rank owns nothing: its norm (a plain fp32 zero) has no say in the dtype, which stays
    # the model's on every rank (found by the session's review: the fp32 zero made every rank return fp32).
    weight = nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)).bfloat16())
    oss = OSS([weight], optim=torch.optim.SGD, lr=0.1)
    weight.grad = torch.ones(8, 4, dtype=torch.bfloat16)
    total = oss.clip_grad_norm(1.0)
    return str(total.dtype), total.item()


def test_clip_with_a_rank_that_owns_no_gradient_keeps_the_models_dtype() -> None:
    results = run_distributed(_clip_with_a_rank_without_grads_body, 2, timeout=TIMEOUT)
    assert results[0] == results[1] and results[0][0] == "torch.bfloat16", results


@pytest.mark.parametrize("low, scale", [(torch.bfloat16, 1.0), (torch.float16, 1.0), (torch.float16, 1e4)])
def test_clip_with_ranks_owning_other_dtypes(low: torch.dtype, scale: float) -> None:
    results = run_distributed(_mixed_dtype_clip_body, 2, low, scale, timeout=TIMEOUT)
    assert results[0][:2] == results[1][:2] == (results[0][0], "torch.float32")
    assert all(error <= 1e-3 for _, _, error in results), results


class _Tracker:
    """Per-parameter bookkeeping an optimizer may keep in its state: picklable, with the default repr (an address)."""

    def __init__(self) -> None:
        self.n = 0


class _SGDWithTracker(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("tracker", _Tracker()).n += 1
        return out


def _objects_in_state_body(rank: int, world_size: int) -> str:
    # The checksums compared each non-tensor value's repr: an object's default repr holds its address, so the same
    # checkpoint differed on every rank (found by the session's review). Only numbers, strings and None are compared
    # by value now, anything else by type.
    model = _model()
    oss = OSS(model.parameters(), optim=_SGDWithTracker, lr=0.1, momentum=0.9)
    _train(model, oss, rank, world_size, range(1))
    oss.load_state_dict(copy.deepcopy(oss.state_dict(all_ranks=True)))
    return "loaded"


def test_objects_in_the_state_compare_by_type() -> None:
    assert run_distributed(_objects_in_state_body, 2, timeout=TIMEOUT) == ["loaded", "loaded"]


@pytest.mark.parametrize("kind", ["older step", "emptied state", "same dict twice"])
def test_ranks_given_other_checkpoints_raise_alike(kind: str) -> None:
    messages = run_distributed(_other_checkpoint_body, 2, kind, timeout=TIMEOUT)
    assert messages[0] == messages[1]
    if kind == "same dict twice":
        assert messages[0] == "loaded"
    else:
        assert "the state dicts hold another state for parameter 0 on some ranks" in messages[0], messages[0]


# ------------------------------------------------------------------------------------------------------------------
# broadcast_fp16 and values beyond the fp16 range


def _frozen_without_refresh_body(rank: int, world_size: int) -> List[bool]:
    # A layer frozen after OSS was built, without refresh_trainable() (the docs ask for it after unfreezing only):
    # it stayed in its owner's broadcast bucket and was rounded to fp16 at every step, although nothing trains it
    # (found by an OSS fuzz, session 40). Such a bucket travels in its own dtype until the refresh.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, broadcast_fp16=True)
    frozen = model[1].weight
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()
    oss.step()
    return [torch.equal(frozen, before)]


def test_a_layer_frozen_without_refresh_keeps_its_value_with_fp16_broadcasts() -> None:
    assert run_distributed(_frozen_without_refresh_body, 2, timeout=TIMEOUT) == [[True], [True]]


def _closure_after_unfreezing_body(rank: int, world_size: int, wrapped: bool) -> str:
    # The torch closure idiom (forward and backward inside step's closure) under ShardedDataParallel with
    # auto_refresh_trainable: after an unfreezing, OSS.step refused before running the closure, whose forward is
    # where the wrapper takes the change in (found by an OSS fuzz, session 40). Without the wrapper (nothing
    # refreshes), the closure's step is still refused, before the wrapped optimizer changes anything.
    from fairscale.nn.data_parallel import ShardedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    net = ShardedDataParallel(model, oss) if wrapped else model
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))

    def closure() -> Tensor:
        oss.zero_grad()
        loss = net(x).pow(2).mean()
        loss.backward()
        if not wrapped:
            for p in model.parameters():
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad)
        return loss

    model[2].requires_grad_(False)
    oss.refresh_trainable()
    oss.step(closure)
    model[2].requires_grad_(True)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        oss.step(closure)
    except RuntimeError as e:
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before)), "refused after stepping"
        return "refused: " + str(e).split(";")[0]
    assert model[2].weight.grad is not None and not torch.equal(model[2].weight, before[2])
    return "stepped"


@pytest.mark.parametrize("wrapped", [True, False])
def test_a_closure_step_after_unfreezing(wrapped: bool) -> None:
    results = run_distributed(_closure_after_unfreezing_body, 2, wrapped, timeout=TIMEOUT)
    assert results[0] == results[1]
    assert results[0] == "stepped" if wrapped else results[0].startswith("refused"), results


def _fp16_overflow_body(rank: int, world_size: int, dtype: torch.dtype) -> Tuple[int, List[List[float]]]:
    model = _model().to(dtype)
    big = model[0].weight
    with torch.no_grad():
        # Beyond fp16's largest value (65504): inf in fp16. In bf16, 65536 is the next value above the limit (and
        # what the limit rounds to in bf16 arithmetic).
        if dtype == torch.float32:
            big[0, 0] = 70000.5
            big[1, 1] = -1.0e6
        else:
            big[1, 1] = -65536.0
    expected = big.detach().clone()
    oss = OSS(model.parameters(), torch.optim.SGD, lr=0.0, broadcast_fp16=True)
    model(_data(0, rank).to(dtype)).float().pow(2).mean().backward()
    with count_collectives() as counter:
        oss.step()
    # One small all-reduce tells every rank which buckets cannot travel as fp16.
    assert counter.count("all_reduce") == 1 and counter.count("broadcast") == world_size, counter.summary()
    for p in model.parameters():
        assert torch.isfinite(p).all(), "no value becomes inf"
        if p is big:
            assert torch.equal(p, expected), "the bucket beyond the fp16 range travels exactly"
        elif oss._param_to_rank[p] != oss._param_to_rank[big]:
            assert torch.equal(p, p.half().to(dtype)), "the other buckets still travel as fp16"
    assert all(b.buffer.dtype == dtype for per in oss.buckets.values() for b in per.values())
    return oss._param_to_rank[big], [p.detach().float().flatten().tolist() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_broadcast_fp16_keeps_values_beyond_the_fp16_range(dtype: torch.dtype) -> None:
    results = run_distributed(_fp16_overflow_body, 2, dtype, timeout=TIMEOUT)
    assert results[0] == results[1], "the ranks stay identical"


# ------------------------------------------------------------------------------------------------------------------
# Crafted layouts


def _crafted_layout_body(rank: int, world_size: int) -> None:
    """Per-element state of the right shape but a crafted layout (one element seen through stride 0, a transposed
    copy) is given the parameter's layout before the wrapped optimizer gets it: fused kernels walk the memory of
    a parameter and its state in step."""
    model = _model()
    oss = OSS(model.parameters(), torch.optim.Adam, lr=0.01)
    _train(model, oss, rank, world_size, range(1))
    state = copy.deepcopy(oss.state_dict(all_ranks=True))
    weight = model[0].weight
    expanded = torch.full((1, 1), 0.25).expand(6, 4)  # 24 elements over one float of memory
    transposed = torch.arange(24.0).reshape(4, 6).t()  # (6, 4) with strides (1, 6)
    state["state"][0]["exp_avg"] = expanded
    state["state"][0]["exp_avg_sq"] = transposed
    oss.load_state_dict(state)
    loaded = oss.optim.state[weight]
    for name, want in (("exp_avg", expanded), ("exp_avg_sq", transposed)):
        assert loaded[name].stride() == weight.stride(), name
        assert torch.equal(loaded[name], want), name
    _train(model, oss, rank, world_size, range(1, 2))


def test_state_with_a_crafted_layout_gets_the_parameters_layout() -> None:
    run_distributed(_crafted_layout_body, 1, timeout=TIMEOUT)


class _RecordingLoad(torch.optim.Optimizer):
    """A mixin between OSS and torch's Optimizer in a subclass's class order, with its own load_state_dict."""

    loads: List[List[str]] = []

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        type(self).loads.append(sorted(state_dict))
        super().load_state_dict(state_dict)


class _OSSWithMixin(OSS, _RecordingLoad):
    pass


def _mixin_load_body(rank: int, ws: int) -> None:
    model = nn.Linear(2, 2)
    oss = _OSSWithMixin(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    model(torch.ones(3, 2)).sum().backward()
    oss.step()
    oss.consolidate_state_dict(recipient_rank=-1)
    _RecordingLoad.loads.clear()
    oss.load_state_dict(oss.state_dict())
    # OSS loads its own groups through the next load_state_dict in the class order (the mixin's), as super() does.
    assert _RecordingLoad.loads == [["param_groups", "state"]], _RecordingLoad.loads


def test_load_goes_through_a_subclass_mixin() -> None:
    run_distributed(_mixin_load_body, 2, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------------------
# Copies (0.4.13's copies kept only torch's defaults, state and param_groups, and failed at their first step)


def _copy_body(rank: int, world_size: int) -> None:
    model = _model()
    oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    _train(model, oss, rank, world_size, range(2))
    for attempt in (lambda: copy.deepcopy(oss), lambda: copy.copy(oss), lambda: torch.save(oss, io.BytesIO())):
        with pytest.raises(TypeError, match=r"OSS cannot be copied or pickled.*state_dict\(all_ranks=True\)"):
            attempt()
    # What the message says to do: the consolidated state loaded into an OSS over the copied model goes on as the
    # original does, bit for bit.
    clone = copy.deepcopy(model)
    clone_oss = OSS(clone.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    clone_oss.load_state_dict(oss.state_dict(all_ranks=True))
    _train(model, oss, rank, world_size, range(2, 4))
    _train(clone, clone_oss, rank, world_size, range(2, 4))
    for got, want in zip(clone.parameters(), model.parameters()):
        assert torch.equal(got, want)


def test_copies_with_a_process_group_are_refused_and_the_state_dict_carries_the_state() -> None:
    run_distributed(_copy_body, 2, timeout=TIMEOUT)


def test_copies_without_torch_distributed_train_as_the_original() -> None:
    # No process group (this process never initializes torch.distributed): everything is local, and a copy of the
    # model with its optimizer (one deepcopy, so the copy's optimizer holds the copy's parameters), or a pickled and
    # reloaded one, trains bit for bit as the original, with its momentum.
    assert not dist.is_initialized()
    model = _model()
    oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    _train_alone(model, oss, range(2))
    buffer = io.BytesIO()
    torch.save((model, oss), buffer)
    buffer.seek(0)
    copies = [copy.deepcopy((model, oss)), torch.load(buffer, weights_only=False)]
    _train_alone(model, oss, range(2, 4))
    for clone, clone_oss in copies:
        assert clone_oss.param_groups[0]["params"][0] is next(clone.parameters())
        _train_alone(clone, clone_oss, range(2, 4))
        for got, want in zip(clone.parameters(), model.parameters()):
            assert torch.equal(got, want)


def _train_alone(model: nn.Module, oss: OSS, steps: range) -> None:
    for step in steps:
        oss.zero_grad()
        model(_data(step, 0)).pow(2).mean().backward()
        oss.step()
