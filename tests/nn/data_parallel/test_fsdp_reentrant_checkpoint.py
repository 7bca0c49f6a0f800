# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` around part of an FSDP unit under mixed precision.

With ``mixed_precision=True`` the first backward failed with "setStorage: ... out of bounds for storage of size 0":
the unit asked the engine whether the outer backward accumulates into its parameters through the parameter's
current accumulator node, but pointing ``param.data`` back at the fp32 shard after a bf16 forward makes autograd
drop that node, so the forward's graph reached the parameter through another one, the engine answered no, and the
checkpoint's nested backward freed the full parameters that the outer backward still read.

Layouts: every layer checkpointed under one FSDP unit ("layers"), one checkpointed sub-layer in each block of
nested units ("sub-layer"), and the same blocks each wrapped as ``FSDP(checkpoint_wrapper(block))`` ("sub-layer in
checkpoint_wrapper": the inner checkpoint's backward runs nested in the recomputation's backward, which also uses the
unit's parameters; with flattened parameters it freed them under the recomputation's backward). Each case trains 2 SGD steps on 2 gloo ranks, each rank on its own half of the batch:

* fp32: compared with the plain module trained on the whole batch (mean loss), within fp32 rounding;
* bf16: compared with the same FSDP model trained without checkpointing. The recomputation repeats the same bf16
  operations on the same inputs, and the gradient pieces of the nested and the outer backward cover disjoint parts
  of the flat gradient (the other entries are exact zeros), so the parameters are expected to be bitwise equal; an
  fp32 reference would differ by bf16 rounding and could not tell a missing gradient piece from rounding.
"""

import functools
import itertools
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.nn.checkpoint import checkpoint_wrapper
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import zero2_groups
from fairscale.nn.data_parallel._fsdp.state import HandleState

WORLD = 2
TIMEOUT = 120.0
BATCH = 4  # per rank


class _Layers(nn.Module):
    """Every layer after the input layer checkpointed, all under one unit (HuggingFace's layout)."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)  # not checkpointed: the checkpoints' input requires grad
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = torch_checkpoint.checkpoint(layer, x, use_reentrant=True) if self.checkpointed else layer(x)
        return x


class _Block(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.inner = nn.Linear(8, 8)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        return x + (
            torch_checkpoint.checkpoint(self.inner, h, use_reentrant=True) if self.checkpointed else self.inner(h)
        )


class _TwoCheckpoints(nn.Module):
    """Every parameter inside one of two reentrant checkpoints: two nested backwards, one after the other, each use
    part of the unit's parameters, and its own backward task none (the first used to free them under the second)."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.checkpointed:
            return x + self.b(torch.tanh(self.a(x)))
        h = torch_checkpoint.checkpoint(self.a, x, use_reentrant=True)
        return x + torch_checkpoint.checkpoint(self.b, torch.tanh(h), use_reentrant=True)


def _model(layout: str, checkpointed: bool) -> nn.Module:
    """The plain module, initialized the same way every time."""
    torch.manual_seed(0)
    if layout == "layers":
        return _Layers(checkpointed)
    block = _TwoCheckpoints if layout.startswith("two checkpoints") else _Block
    return nn.Sequential(nn.Linear(8, 8), *[block(checkpointed) for _ in range(2)])


def _wrap(layout: str, module: nn.Module, fsdp_kwargs: Dict[str, object]) -> FSDP:
    if layout != "layers":
        assert isinstance(module, nn.Sequential)
        for i in range(1, len(module)):
            block = checkpoint_wrapper(module[i]) if layout.endswith("in checkpoint_wrapper") else module[i]
            module[i] = FSDP(block, **fsdp_kwargs)
    return FSDP(module, **fsdp_kwargs)


def _batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s half of step ``step``'s batch (``rank=-1``: the whole batch)."""
    whole = torch.randn(WORLD * BATCH, 8, generator=torch.Generator().manual_seed(100 + step))
    return whole if rank < 0 else whole[rank * BATCH : (rank + 1) * BATCH]


def _train(model: nn.Module, rank: int, steps: int = 2, eval_between: bool = False) -> Dict[str, torch.Tensor]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        out = model(_batch(step, rank))
        if eval_between:  # an evaluation (or logging) forward before the training forward's backward
            with torch.no_grad():
                model(_batch(step + 50, rank))
        out.float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    if isinstance(model, FSDP):
        handles = [h for m in model.modules() if isinstance(m, FSDP) for h in m._fsdp_unit.handles]
        assert all(
            h.full_padded is None or h.full_padded.untyped_storage().nbytes() == 0 for h in handles
        ), "full parameters kept after the step"
        with model.summon_full_params():
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _case(layout: str, mixed_precision: bool) -> None:
    rank = dist.get_rank()
    kwargs: Dict[str, object] = {}
    if mixed_precision:
        kwargs = {"mixed_precision": True, "compute_dtype": torch.bfloat16}
    got = _train(_wrap(layout, _model(layout, True), kwargs), rank)
    if mixed_precision:
        expected = _train(_wrap(layout, _model(layout, False), kwargs), rank)
        rtol, atol = 0.0, 0.0  # the same bf16 computation (see the module docstring)
    else:
        # Each rank's FSDP gradient is the mean over its half; FSDP averages the two halves: the whole batch's mean.
        expected = _train(_model(layout, False), -1)
        rtol, atol = 1e-5, 1e-6
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _body(rank: int, world_size: int) -> None:
    cases = []
    for layout in (
        "layers",
        "sub-layer",
        "sub-layer in checkpoint_wrapper",
        "two checkpoints",
        "two checkpoints in checkpoint_wrapper",
    ):
        for mixed in (False, True):
            name = f"reentrant checkpoint of {layout}, mixed_precision={mixed}"
            cases.append((name, functools.partial(_case, layout, mixed)))
    run_cases(cases)


def test_reentrant_checkpoint_of_part_of_a_unit() -> None:
    run_distributed(_body, WORLD, timeout=TIMEOUT)


def _reduced_once_case(flatten: bool) -> None:
    """``FSDP(checkpoint_wrapper(block))`` with a reentrant checkpoint inside ``block``: the recomputation's backward
    and the one nested in it both reach the unit's parameters; the unit reduces their sum once, in the outer of the
    two (the inner one used to reduce and free the full parameters the outer one still read)."""
    kwargs: Dict[str, object] = dict(flatten_parameters=flatten, bucket_cap_mb=0)  # one reduction per parameter
    model = _wrap("sub-layer in checkpoint_wrapper", _model("sub-layer", True), kwargs)
    params = len(list(model.parameters()))  # flat parameters, or each weight and bias
    with count_collectives() as counter:
        model(_batch(0, dist.get_rank())).float().pow(2).mean().backward()
    assert counter.count("reduce_scatter", phase="backward") == params, counter.summary()
    full_gradient_bytes = 4 * sum(p.numel() for p in _model("sub-layer", True).parameters())
    assert counter.total_bytes("reduce_scatter", phase="backward") == full_gradient_bytes, counter.summary()


def _reduced_once_body(rank: int, world_size: int) -> None:
    run_cases([(f"flatten={f}", functools.partial(_reduced_once_case, f)) for f in (True, False)])


def test_checkpoint_inside_checkpoint_wrapper_reduces_each_unit_once() -> None:
    run_distributed(_reduced_once_body, WORLD, timeout=TIMEOUT)


def _eval_between_case(layout: str, fsdp_kwargs: Dict[str, object]) -> None:
    # The recomputation in the backward reads the views the modules hold then. A no_grad forward in between left
    # them its own views, which have no path to the flat parameters: the checkpointed layers' gradients were lost
    # silently (zero under one unit, None for a unit holding only checkpointed layers).
    rank = dist.get_rank()
    expected = _train(_wrap(layout, _model(layout, True), fsdp_kwargs), rank)
    got = _train(_wrap(layout, _model(layout, True), fsdp_kwargs), rank, eval_between=True)
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{name}: max diff {(got[name] - value).abs().max()}"


def _eval_between_body(rank: int, world_size: int) -> None:
    cases = []
    for layout in ("layers", "sub-layer"):
        for mixed, obc, raf in itertools.product((False, True), (False, True), (True, False)):
            kwargs: Dict[str, object] = dict(reshard_after_forward=raf, optimize_backward_concat=obc)
            if mixed:
                kwargs.update(mixed_precision=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=True)
            cases.append(
                (f"{layout},mixed={mixed},obc={obc},raf={raf}", functools.partial(_eval_between_case, layout, kwargs))
            )
    run_cases(cases)


def test_no_grad_forward_before_the_backward_keeps_checkpointed_gradients() -> None:
    run_distributed(_eval_between_body, WORLD, timeout=TIMEOUT)


class _ReturnsItsParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), self.scale


class _ScaledByBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = _ReturnsItsParameter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, scale = self.block(self.inp(x))
        return y * scale


def _hooks_per_step_body(rank: int, world_size: int) -> List[int]:
    """The recomputation's outputs are hooked to follow its backward; a parameter the block returns as it is is a
    leaf, which keeps its hooks: it got one more each step."""
    torch.manual_seed(0)
    model = _ScaledByBlock()
    scale = model.block.scale
    model.block = FSDP(checkpoint_wrapper(model.block), flatten_parameters=False)
    fsdp = FSDP(model, flatten_parameters=False)
    counts = []
    for step in range(3):
        fsdp(_batch(step, rank)).pow(2).mean().backward()
        counts.append(len(scale._backward_hooks or {}))
    return counts


def test_recomputed_parameter_output_gets_no_hook_per_step() -> None:
    for counts in run_distributed(_hooks_per_step_body, WORLD, timeout=TIMEOUT):
        assert counts == [counts[0]] * 3, counts


class _CheckpointedUnits(_Layers):
    """HuggingFace's gradient checkpointing with FSDP-wrapped layers: a reentrant checkpoint around each unit."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(False)
        self.layers = nn.ModuleList([_Block(False) for _ in range(3)])


def _checkpointed_units_case(flatten: bool) -> None:
    # The recomputation (a forward with grad on inside the backward) was taken for a training forward: resharded
    # after it, so the unit's backward gathered it again (two gathers per unit, the first tagged "forward"; a fuzz of
    # real-world architectures, session 45).
    rank = dist.get_rank()
    expected = _train(_CheckpointedUnits(), -1)
    net = _CheckpointedUnits()
    net.checkpointed = True
    net.layers = nn.ModuleList([FSDP(b, flatten_parameters=flatten) for b in net.layers])
    model = FSDP(net, flatten_parameters=flatten)
    out = model(_batch(0, rank))
    with count_collectives() as counter:
        out.pow(2).mean().backward()
    per_unit = 1 if flatten else 4  # each weight and bias of a block
    assert counter.count("all_gather") == counter.count("all_gather", phase="backward"), counter.summary()
    assert counter.count("all_gather", phase="backward") == len(net.layers) * per_unit, counter.summary()
    model.zero_grad(set_to_none=True)
    got = _train(model, rank)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _checkpointed_units_body(rank: int, world_size: int) -> None:
    run_cases([(f"flatten={f}", functools.partial(_checkpointed_units_case, f)) for f in (True, False)])


def test_reentrant_checkpoint_around_units_gathers_each_once() -> None:
    run_distributed(_checkpointed_units_body, WORLD, timeout=TIMEOUT)


def _first_pass_case(kind: str) -> None:
    # Torch's reentrant first pass runs without grad; taken for an evaluation, the unit freed what it should keep:
    # its zero2 slice (the backward gathered over the whole group) or, with reshard_after_forward=False, its full
    # parameters (one more gather per step). A fuzz of the fork's features, session 45.
    kwargs: Dict[str, object] = {"zero2_process_group": zero2_groups(1)} if kind == "zero2" else {}
    if kind == "keep":
        kwargs["reshard_after_forward"] = False
    expected = _train(_CheckpointedUnits(), -1)
    net = _CheckpointedUnits()
    net.checkpointed = True
    net.layers = nn.ModuleList([FSDP(b, **kwargs) for b in net.layers])
    model = FSDP(net, **kwargs)
    got = _train(model, dist.get_rank())
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    out = model(_batch(5, dist.get_rank()))
    with count_collectives() as counter:
        out.pow(2).mean().backward()
    gathers = [r.group_size for r in counter.records if r.kind == "all_gather" and r.phase == "backward"]
    assert gathers == ([1] * len(net.layers) if kind == "zero2" else []), counter.summary()
    # An evaluation through the same checkpoints (no_grad: its arguments need no grad) keeps nothing gathered (a
    # review found the first version holding full parameters and zero2 slices after it).
    with torch.no_grad():
        model(_batch(6, dist.get_rank()))
    states = {h.state for m in model.modules() if isinstance(m, FSDP) for h in m._fsdp_unit.handles}
    assert states == {HandleState.SHARDED}, states


def _first_pass_body(rank: int, world_size: int) -> None:
    run_cases([(kind, functools.partial(_first_pass_case, kind)) for kind in ("zero2", "keep")])


def test_reentrant_first_pass_is_not_an_evaluation() -> None:
    run_distributed(_first_pass_body, WORLD, timeout=TIMEOUT)
