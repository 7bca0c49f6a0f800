# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FSDP together with activation checkpointing, in both nesting orders, on CPU with gloo.

* ``FSDP(checkpoint_wrapper(m))``: FSDP gathers the parameters, the checkpointed module runs inside; the
  recomputation happens during this instance's backward, on the parameters its pre-backward hook gathered again.
* ``checkpoint_wrapper(FSDP(m))``: the whole FSDP forward (gather, compute, reshard) is checkpointed; it runs once
  without grad and once more, with grad, during backward.

Every training test also checks that the recomputation really happened (a forward pre-hook on the user module sees
``is_recomputing()``), so none of them would pass with checkpointing silently bypassed.
"""

import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from _models import (
    assert_close_dict,
    assert_idle,
    assert_update_close,
    full_params,
    local_slice,
    mean_over_ranks,
    ref_params,
)
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.nn.checkpoint import checkpoint_wrapper, is_checkpointing, is_recomputing
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import TrainingState, get_fsdp_instances
from fairscale.nn.data_parallel._fsdp.batchnorm_wrap import auto_wrap_bn
from fairscale.nn.data_parallel._fsdp.state import HandleState

Case = Tuple[str, Callable[[], Any]]
TIMEOUT = 180.0
WS = 2
LOCAL_BATCH = 3
# Where the checkpoint sits relative to FSDP: per block (the usual pattern) or around the whole (root) model.
ORDERS = ("fsdp(ckpt(block))", "ckpt(fsdp(block))", "fsdp(ckpt(model))", "ckpt(fsdp(model))")
PRECISIONS: Dict[str, Dict[str, Any]] = {
    "fp32": {},
    "bf16": {"mixed_precision": True, "compute_dtype": torch.bfloat16},
    "fp16": {"mixed_precision": True},
}
# (loss tolerance relative to the first loss, parameter error relative to the reference's total update or None for
# an elementwise fp32 comparison). 16-bit compute rounds, but a lost or doubled gradient is far outside these.
TOLERANCES: Dict[str, Tuple[float, Optional[float]]] = {"fp32": (1e-5, None), "fp16": (1e-2, 0.03), "bf16": (5e-2, 0.1)}


# ------------------------------------------------------------------------------------------------------ models


class Block(nn.Module):
    """Residual MLP block; odd sizes so that every flat parameter needs padding at world size 2."""

    def __init__(self, dim: int, batchnorm: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim + 1)
        self.bn = nn.BatchNorm1d(2 * dim + 1) if batchnorm else nn.Identity()
        self.fc2 = nn.Linear(2 * dim + 1, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.tanh(self.bn(self.fc1(x))))


class Net(nn.Module):
    """Linear(5, 6) -> blocks (each called ``calls_per_block`` times per forward) -> Linear(6, 3)."""

    def __init__(self, num_blocks: int = 2, dim: int = 6, batchnorm: bool = False, calls_per_block: int = 1) -> None:
        super().__init__()
        self.inp = nn.Linear(5, dim)
        self.blocks = nn.ModuleList([Block(dim, batchnorm) for _ in range(num_blocks)])
        self.out = nn.Linear(dim, 3)
        self.calls_per_block = calls_per_block

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        for block in self.blocks:
            for _ in range(self.calls_per_block):
                x = block(x)
        return self.out(x)


def wrap_with_checkpoint(model: Net, order: str, fsdp_kwargs: Dict[str, Any], bn: bool = False) -> nn.Module:
    """Checkpoint and shard ``model`` in ``order`` (see ``ORDERS``; ``"fsdp(block)"`` = no checkpointing).

    With ``bn=True`` the batch-norm layers first get their own fp32 instances (``auto_wrap_bn``).
    """
    if bn:
        auto_wrap_bn(model)
    if order in ("fsdp(ckpt(block))", "ckpt(fsdp(block))", "fsdp(block)"):
        for i, block in enumerate(model.blocks):
            if order == "fsdp(ckpt(block))":
                model.blocks[i] = FSDP(checkpoint_wrapper(block), **fsdp_kwargs)
            elif order == "ckpt(fsdp(block))":
                model.blocks[i] = checkpoint_wrapper(FSDP(block, **fsdp_kwargs))
            else:
                model.blocks[i] = FSDP(block, **fsdp_kwargs)
        return FSDP(model, **fsdp_kwargs)
    if order == "fsdp(ckpt(model))":
        return FSDP(checkpoint_wrapper(model), **fsdp_kwargs)
    if order == "ckpt(fsdp(model))":
        return checkpoint_wrapper(FSDP(model, **fsdp_kwargs))
    raise ValueError(f"unknown order {order!r}")


class PassLog:
    """Records, for every call of a user ``Block`` (seen at its first layer), which checkpoint pass it ran in."""

    def __init__(self, blocks: List[nn.Module]) -> None:
        self.passes: List[str] = []
        for block in blocks:
            block.register_forward_pre_hook(self._hook)

    def _hook(self, _module: nn.Module, _inputs: Any) -> None:
        if is_recomputing():
            self.passes.append("recompute")
        elif is_checkpointing():
            self.passes.append("checkpoint")
        else:
            self.passes.append("plain")

    def take(self) -> List[str]:
        out, self.passes = self.passes, []
        return out


def user_blocks(model: nn.Module) -> List[nn.Module]:
    """The first layer of every user block: its hooks fire inside the checkpointed region whatever the nesting
    (hooks of a module whose forward is checkpointed fire outside it, and only once)."""
    return [m.fc1 for m in model.modules() if type(m) is Block]


# ------------------------------------------------------------------------------------------------------ harness


def batch_for(step: int, n: int) -> Tensor:
    return torch.randn(n, 5, generator=torch.Generator().manual_seed(100 + step))


def loss_of(out: Tensor, global_n: int, scale: int) -> Tensor:
    """Sum of per-sample losses scaled so FSDP's gradient average equals the global-batch mean."""
    return (out.float() - 0.3).pow(2).sum() * (scale / global_n)


def reference_loss(ref: nn.Module, batch: Tensor, batch_dependent: bool) -> Tensor:
    """Global-batch loss; per rank slice when batch norm makes the result depend on the batch split."""
    n = batch.shape[0]
    if not batch_dependent:
        return loss_of(ref(batch), n, 1)
    return sum((loss_of(ref(piece), n, 1) for piece in batch.tensor_split(WS)), torch.zeros(()))


def train_and_compare(
    rank: int,
    order: str,
    precision: str,
    steps: int = 3,
    calls_per_block: int = 1,
    net_kwargs: Optional[Dict[str, Any]] = None,
    fsdp_kwargs: Optional[Dict[str, Any]] = None,
) -> Tuple[nn.Module, nn.Module]:
    """Train the checkpointed FSDP model and the reference side by side; compare losses and final parameters.

    Also asserts that every block call was checkpointed and recomputed once in backward, and that every instance is
    idle with freed full parameters after each backward. Returns ``(fsdp_model, reference)``.
    """
    torch.manual_seed(3)
    model = Net(calls_per_block=calls_per_block, **(net_kwargs or {}))
    ref = copy.deepcopy(model)
    init = ref_params(ref)
    log = PassLog(user_blocks(model))
    kwargs = dict(PRECISIONS[precision], **(fsdp_kwargs or {}))
    fsdp = wrap_with_checkpoint(model, order, kwargs)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    loss_rtol, param_rel = TOLERANCES[precision]
    n = LOCAL_BATCH * WS
    calls = len(ref.blocks) * calls_per_block
    first_loss = None
    for step in range(steps):
        batch = batch_for(step, n)
        opt.zero_grad()
        loss = loss_of(fsdp(local_slice((batch,), rank, WS)[0]), n, WS)
        assert log.take() == ["checkpoint"] * calls, "the first pass of every block call must run checkpointed"
        loss.backward()
        assert log.take() == ["recompute"] * calls, "backward must recompute every checkpointed block call once"
        assert_idle(fsdp)
        opt.step()
        ref_opt.zero_grad()
        ref_loss = reference_loss(ref, batch, batch_dependent=False)
        ref_loss.backward()
        ref_opt.step()
        first_loss = abs(ref_loss.item()) if first_loss is None else first_loss
        got = mean_over_ranks(loss.item())
        assert abs(got - ref_loss.item()) <= loss_rtol * first_loss + 1e-6, f"step {step}: {got} vs {ref_loss.item()}"
    if param_rel is None:
        assert_close_dict(full_params(fsdp), ref_params(ref), "param", rtol=1e-4, atol=1e-5)
    else:
        assert_update_close(full_params(fsdp), ref_params(ref), init, param_rel, "param")
    return fsdp, ref


# ------------------------------------------------------------------------------------------------------ parity


def _parity_cases(rank: int) -> List[Case]:
    cases: List[Case] = []
    for order in ORDERS:
        for precision in ("fp32", "bf16"):
            for reshard in (True, False):

                def case(order: str = order, precision: str = precision, reshard: bool = reshard) -> None:
                    train_and_compare(rank, order, precision, fsdp_kwargs={"reshard_after_forward": reshard})

                cases.append((f"{order},{precision},reshard={reshard}", case))
    # fp16 compute works on CPU too; one nesting order each is enough on top of the matrix above.
    for order in ("fsdp(ckpt(block))", "ckpt(fsdp(block))"):

        def fp16_case(order: str = order) -> None:
            train_and_compare(rank, order, "fp16")

        cases.append((f"{order},fp16", fp16_case))

    def no_flatten_case() -> None:
        train_and_compare(rank, "fsdp(ckpt(block))", "fp32", fsdp_kwargs={"flatten_parameters": False})

    cases.append(("fsdp(ckpt(block)),fp32,no-flatten", no_flatten_case))
    return cases


def _parity_both_nesting_orders_body(rank: int, world_size: int) -> None:
    run_cases(_parity_cases(rank))


def test_parity_both_nesting_orders() -> None:
    """Checkpointed FSDP models train like the unwrapped single-process reference, in every nesting order."""

    run_distributed(_parity_both_nesting_orders_body, WS, timeout=TIMEOUT)


def _checkpointed_module_called_several_times_body(rank: int, world_size: int) -> None:
    cases: List[Case] = []
    for order in ("fsdp(ckpt(block))", "ckpt(fsdp(block))", "fsdp(ckpt(model))"):
        for precision in ("fp32", "bf16"):

            def case(order: str = order, precision: str = precision) -> None:
                train_and_compare(rank, order, precision, calls_per_block=2)

            cases.append((f"{order},{precision}", case))
    run_cases(cases)


def test_checkpointed_module_called_several_times() -> None:
    """A checkpointed block called twice per forward is recomputed twice and its gradients add up correctly."""

    run_distributed(_checkpointed_module_called_several_times_body, WS, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ eval


def _eval_case(rank: int, order: str, precision: str) -> None:
    fsdp, ref = train_and_compare(rank, order, precision, steps=2)
    log = PassLog(user_blocks(fsdp))
    atol = 1e-5 if precision == "fp32" else 5e-2
    batch = batch_for(99, LOCAL_BATCH * WS)
    local = local_slice((batch,), rank, WS)[0]
    fsdp.eval()
    ref.eval()
    # Inference: grad disabled, so checkpointing is bypassed and nothing waits for a backward.
    with torch.no_grad():
        out = fsdp(local)
    assert set(log.take()) == {"plain"}, "a no-grad forward must not checkpoint"
    torch.testing.assert_close(out.float(), ref(local), atol=atol, rtol=atol)
    for m in get_fsdp_instances(fsdp):
        assert m.training_state == TrainingState.IDLE
        assert m._tree is None or not m._tree.backward_pending
    # Eval mode with grad (e.g. computing input saliency): checkpointing is active again and gradients are right.
    # The input is given in the compute dtype (the root's cast is then a no-op): its gradient is compared as is.
    fsdp.zero_grad()
    ref.zero_grad()
    inp = local.detach().to(PRECISIONS[precision].get("compute_dtype", torch.float32)).requires_grad_(True)
    loss_of(fsdp(inp), local.shape[0], 1).backward()
    assert "recompute" in log.take()
    assert_idle(fsdp)
    ref_local = local.detach().clone().requires_grad_(True)
    loss_of(ref(ref_local), local.shape[0], 1).backward()
    assert inp.grad is not None and ref_local.grad is not None
    torch.testing.assert_close(inp.grad.float(), ref_local.grad, atol=atol, rtol=atol)
    # Back to training: the next step still matches the reference update.
    fsdp.train()
    ref.train()
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    fsdp.zero_grad()
    ref.zero_grad()
    batch = batch_for(100, LOCAL_BATCH * WS)
    loss_of(fsdp(local_slice((batch,), rank, WS)[0]), batch.shape[0], WS).backward()
    opt.step()
    reference_loss(ref, batch, batch_dependent=False).backward()
    ref_opt.step()
    assert_idle(fsdp)
    if precision == "fp32":
        assert_close_dict(full_params(fsdp), ref_params(ref), "param after eval", rtol=1e-4, atol=1e-5)


def _eval_then_train_body(rank: int, world_size: int) -> None:
    run_cases(
        (f"{order},{precision}", lambda order=order, precision=precision: _eval_case(rank, order, precision))
        for order in ORDERS
        for precision in ("fp32", "bf16")
    )


def test_eval_then_train() -> None:
    """Eval (no grad, and with grad for input gradients) then training again, for both nesting orders."""

    run_distributed(_eval_then_train_body, WS, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ state machine


def _owner_of(root: nn.Module, block: nn.Module) -> FSDP:
    """The FSDP instance whose parameters ``block`` uses (the innermost instance containing it)."""
    owner = None
    for m in get_fsdp_instances(root):
        if any(sub is block for sub in m.modules()):
            owner = m
    assert owner is not None
    return owner


def _state_machine_case(rank: int, order: str, calls_per_block: int) -> None:
    torch.manual_seed(0)
    model = Net(calls_per_block=calls_per_block)
    fsdp = wrap_with_checkpoint(model, order, {"bucket_cap_mb": 0})
    seen: List[Tuple[str, TrainingState, List[HandleState]]] = []

    def record(block: nn.Module, _inputs: Any) -> None:
        owner = _owner_of(fsdp, block)
        phase = "recompute" if is_recomputing() else "checkpoint" if is_checkpointing() else "plain"
        seen.append((phase, owner.training_state, [h.state for h in owner._handles]))

    for block in user_blocks(fsdp):
        block.register_forward_pre_hook(record)
    for _ in range(2):
        fsdp(torch.randn(LOCAL_BATCH, 5)).sum().backward()
        # After every backward: all instances IDLE, every parameter back to its fp32 shard, full buffers freed, and
        # nothing left queued for a next backward.
        assert_idle(fsdp)
        root = get_fsdp_instances(fsdp)[0]
        assert root._tree is not None
        assert not root._tree.final_callback_queued and not root._tree.backward_pending
    calls = len(model.blocks) * calls_per_block * 2
    assert [s[0] for s in seen].count("checkpoint") == calls
    assert [s[0] for s in seen].count("recompute") == calls
    for phase, state, handles in seen:
        # Whatever the pass, a block always runs on gathered (full) parameters.
        assert handles and all(h == HandleState.FULL for h in handles), (phase, handles)
        if phase == "checkpoint" or order.startswith("ckpt("):
            # First pass, or the whole FSDP forward re-run by the recomputation.
            assert state == TrainingState.FORWARD, (phase, state)
        else:
            # FSDP(ckpt(block)): the recomputation runs inside this instance's backward, after its pre-backward
            # hook (BACKWARD_PRE) or, for a second call of the same block, after its first reduction (BACKWARD_POST).
            assert state in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST), (phase, state)
    if order == "fsdp(ckpt(block))" and calls_per_block == 1:
        assert all(s[1] == TrainingState.BACKWARD_PRE for s in seen if s[0] == "recompute")


def _state_machine_during_recomputation_body(rank: int, world_size: int) -> None:
    run_cases(
        (f"{order},calls={calls}", lambda order=order, calls=calls: _state_machine_case(rank, order, calls))
        for order in ORDERS
        for calls in (1, 2)
    )


def test_state_machine_during_recomputation() -> None:
    """Training states and handle states seen from inside the recomputed forward; all IDLE at the end."""

    run_distributed(_state_machine_during_recomputation_body, WS, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ batch norm


class RunningStatsOracle:
    """Expected batch-norm running statistics of this rank, built from the batch statistics of every call.

    A model with the reference's current parameters runs this rank's slice, a pre-hook records each batch-norm
    input, and the momentum update is applied once per call. ``reverse_calls``: per-block checkpoints recompute the
    calls of one block last-to-first in backward, which is when the statistics are updated, so the updates are
    applied in that order (it matters when a block runs twice per forward).
    """

    def __init__(self, model: Net, reverse_calls: bool) -> None:
        self.model = copy.deepcopy(model)
        self.reverse_calls = reverse_calls
        self.inputs: Dict[str, List[Tensor]] = {}
        self.expected: Dict[str, Tensor] = {n: b.clone() for n, b in model.named_buffers()}
        for name, layer in self.model.named_modules():
            if isinstance(layer, nn.BatchNorm1d):
                layer.register_forward_pre_hook(lambda _m, args, name=name: self.inputs[name].append(args[0].clone()))
                self.inputs[name] = []

    @torch.no_grad()
    def step(self, ref: nn.Module, local: Tensor) -> None:
        for p, p_ref in zip(self.model.parameters(), ref.parameters()):
            p.copy_(p_ref)
        self.model(local)
        for name, seen in self.inputs.items():
            for x in reversed(seen) if self.reverse_calls else seen:
                momentum = 0.1  # nn.BatchNorm1d's default
                for stat, value in (("running_mean", x.mean(0)), ("running_var", x.var(0, unbiased=True))):
                    key = f"{name}.{stat}"
                    self.expected[key] = (1 - momentum) * self.expected[key] + momentum * value
                self.expected[f"{name}.num_batches_tracked"] += 1
            seen.clear()


def _bn_case(rank: int, order: str, precision: str, bn_own_instance: bool, calls_per_block: int) -> None:
    """BN inside checkpointed blocks: running statistics updated exactly once per call, as in the reference."""
    torch.manual_seed(5)
    model = Net(batchnorm=True, calls_per_block=calls_per_block)
    ref = copy.deepcopy(model)
    oracle = RunningStatsOracle(model, reverse_calls=order.endswith("(block))"))
    log = PassLog(user_blocks(model))
    fsdp = wrap_with_checkpoint(model, order, dict(PRECISIONS[precision]), bn=bn_own_instance)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    n, steps = LOCAL_BATCH * WS, 3
    for step in range(steps):
        batch = batch_for(step, n)
        local = local_slice((batch,), rank, WS)[0]
        oracle.step(ref, local)
        opt.zero_grad()
        loss_of(fsdp(local), n, WS).backward()
        opt.step()
        ref_opt.zero_grad()
        reference_loss(ref, batch, batch_dependent=True).backward()
        ref_opt.step()
    assert log.take().count("recompute") == steps * len(model.blocks) * calls_per_block
    assert_idle(fsdp)
    got = {_clean(name): b for name, b in fsdp.named_buffers()}
    assert sorted(got) == sorted(oracle.expected)
    # 16-bit compute feeds the (fp32) batch norm rounded inputs; the statistics are then close, not equal.
    tol = 1e-5 if precision == "fp32" else 3e-2
    for name, expected in oracle.expected.items():
        if name.endswith("num_batches_tracked"):
            assert got[name].item() == expected.item() == steps * calls_per_block, f"{name}: {got[name].item()}"
            continue
        if bn_own_instance:
            assert got[name].dtype == torch.float32, f"{name} must stay fp32 in its own instance"
        torch.testing.assert_close(got[name].float(), expected, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")
    if precision == "fp32":
        assert_close_dict(full_params(fsdp), ref_params(ref), "param", rtol=1e-4, atol=1e-5)


def _clean(name: str) -> str:
    return ".".join(c for c in name.split(".") if c not in ("_fsdp_wrapped_module", "_fpw_module"))


def _batchnorm_running_stats_updated_once_body(rank: int, world_size: int) -> None:
    cases: List[Case] = []
    for order in ("fsdp(ckpt(block))", "ckpt(fsdp(block))", "ckpt(fsdp(model))"):
        for bn_own, precision in ((False, "fp32"), (True, "fp32"), (True, "bf16")):
            for calls in (1, 2):

                def case(order: str = order, precision: str = precision, bn: bool = bn_own, c: int = calls) -> None:
                    _bn_case(rank, order, precision, bn, c)

                cases.append((f"{order},{precision},auto_wrap_bn={bn_own},calls={calls}", case))
    run_cases(cases)


def test_batchnorm_running_stats_updated_once() -> None:
    """Running statistics move once per call (not twice) whichever way checkpoint and FSDP are nested."""

    run_distributed(_batchnorm_running_stats_updated_once_body, WS, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ memory


def saved_activation_bytes(model: nn.Module, x: Tensor) -> Tuple[int, Tensor]:
    """Bytes of batch-sized tensors autograd keeps from the forward until the backward, and the output.

    Every tensor saved for backward passes through the pack hook; parameters are excluded by shape (only tensors
    with the batch as first dimension count), and a tensor saved by several nodes is counted once.
    """
    seen: Dict[Tuple[int, Tuple[int, ...]], int] = {}

    def pack(t: Tensor) -> Tensor:
        if t.dim() > 0 and t.shape[0] == x.shape[0]:
            seen[(t.data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    return sum(seen.values()), out


def _memory_case(order: str) -> Tuple[int, int]:
    """(bytes saved with the checkpointed model, bytes saved without checkpointing)."""
    batch, dim, num_blocks = 16, 24, 4
    x = torch.randn(batch, 5)
    sizes = []
    for chosen in (order, "fsdp(block)"):
        torch.manual_seed(0)
        fsdp = wrap_with_checkpoint(Net(num_blocks=num_blocks, dim=dim), chosen, {})
        saved, out = saved_activation_bytes(fsdp, x)
        out.sum().backward()  # the saved tensors are consumed; the model must still be usable
        assert_idle(fsdp)
        sizes.append(saved)
    with_ckpt, without = sizes
    row = batch * dim * 4
    # Each checkpointed block keeps only its input (``row`` bytes); without checkpointing each block also keeps its
    # wide hidden activation (the tanh output, 2 dim + 1 wide, which the second linear saves too).
    hidden = batch * (2 * dim + 1) * 4
    assert with_ckpt <= (num_blocks + 1) * row + batch * 5 * 4, (order, with_ckpt, without)
    assert without >= num_blocks * (row + hidden), (order, with_ckpt, without)
    assert with_ckpt * 2 < without, (order, with_ckpt, without)
    return with_ckpt, without


def _saved_activations_smaller_with_checkpointing_body(rank: int, world_size: int) -> None:
    run_cases((order, lambda order=order: _memory_case(order)) for order in ("fsdp(ckpt(block))", "ckpt(fsdp(block))"))


def test_saved_activations_smaller_with_checkpointing() -> None:
    """Measured with saved_tensors_hooks: checkpointing keeps only block inputs between forward and backward."""

    run_distributed(_saved_activations_smaller_with_checkpointing_body, WS, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ communication


def _collective_counts(order: str, reshard: bool) -> Dict[str, int]:
    """Collectives of one training step (after a warm-up step), by kind and phase."""
    torch.manual_seed(0)
    fsdp = wrap_with_checkpoint(Net(num_blocks=2), order, {"bucket_cap_mb": 0, "reshard_after_forward": reshard})
    x = torch.randn(LOCAL_BATCH, 5)
    fsdp(x).sum().backward()
    with count_collectives() as counter:
        fsdp(x).sum().backward()
    return {
        "gather/forward": counter.count("all_gather", "forward"),
        "gather/backward": counter.count("all_gather", "backward"),
        "reduce_scatter": counter.count("reduce_scatter"),
    }


def _communication_case(reshard: bool) -> None:
    plain = _collective_counts("fsdp(block)", reshard)
    # FSDP outside the checkpoint: the recomputation uses the parameters the pre-backward hook gathered anyway.
    assert _collective_counts("fsdp(ckpt(block))", reshard) == plain
    # Checkpoint outside FSDP: the recomputed FSDP forward gathers again; at most one extra gather per block.
    outer = _collective_counts("ckpt(fsdp(block))", reshard)
    assert outer["reduce_scatter"] == plain["reduce_scatter"] and outer["gather/backward"] == plain["gather/backward"]
    assert plain["gather/forward"] <= outer["gather/forward"] <= plain["gather/forward"] + 2, (outer, plain)


def _communication_of_checkpointed_blocks_body(rank: int, world_size: int) -> None:
    run_cases((f"reshard={r}", lambda r=r: _communication_case(r)) for r in (True, False))


def test_communication_of_checkpointed_blocks() -> None:
    """What docs/wrap_and_checkpoint.rst promises about the two nesting orders' all-gathers and reduce-scatters."""

    run_distributed(_communication_of_checkpointed_blocks_body, WS, timeout=TIMEOUT)
