# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``MOELayer`` on real gloo worlds of 2 and 4 ranks against single-process references.

The reference routes the same tokens to the same experts: every rank can rebuild every rank's input (seeded by
rank) and the gate's noise (seeded per rank before each gating), so it computes, for each source rank,
``sum_e w[s, e] * expert_e(x_s)`` with dense copies of all experts. Expert weight gradients are the sum over all
source ranks; gate and input gradients are local. Upstream ran these only with CUDA/NCCL.
"""

import copy
import functools
import io
from typing import Any, List, Tuple

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal import collectives
from fairscale.nn import MOELayer, Top2Gate
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

MODEL_DIM, SEQ, TOKENS = 8, 4, 16
TOL = dict(atol=1e-5, rtol=1e-5)


def _assert_close(actual: Tensor, expected: Tensor, atol: float = 1e-5, rtol: float = 1e-5, what: str = "") -> None:
    """``torch.testing.assert_close`` without its one-time import cost (about 2 s in every forked rank)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (what, actual.shape, expected.shape)
    diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert torch.allclose(actual, expected, atol=atol, rtol=rtol), f"{what} not close: max abs diff {diff}"


def _input(rank: int, requires_grad: bool = False, device: str = "cpu") -> Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(SEQ, TOKENS, MODEL_DIM, generator=g).to(device).requires_grad_(requires_grad)


def _experts(num: int) -> List[nn.Linear]:
    torch.manual_seed(7)
    return [nn.Linear(MODEL_DIM, MODEL_DIM) for _ in range(num)]


class _Identity(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


class _Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        assert x.dim() == 4 and x.shape[1] == 1  # [world, 1, capacity, model] per local expert
        return x * self.factor


class _RoundRobinGate(nn.Module):
    """Token i -> expert i mod E, slot i div E, weight 1."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        s, e = x.shape[0], self.num_experts
        combine = torch.zeros(s, e, s // e)
        for i in range(s):
            combine[i, i % e, i // e] = 1.0
        return torch.tensor(0.0), combine, combine.bool()


def _expert_params(rank: int, world: int) -> None:
    experts = nn.ModuleList(_experts(2))
    moe = MOELayer(Top2Gate(MODEL_DIM, 2 * world), experts)
    assert all(getattr(p, "expert", False) is True for p in moe.experts.parameters())
    assert all(not hasattr(p, "expert") for p in moe.gate.parameters())
    assert moe.world_size == world and moe.num_local_experts == 2
    single = MOELayer(Top2Gate(MODEL_DIM, world), nn.Linear(MODEL_DIM, MODEL_DIM))
    assert single.num_local_experts == 1 and isinstance(single.experts, nn.ModuleList)


def _identity(rank: int, world: int) -> None:
    moe = MOELayer(Top2Gate(MODEL_DIM, world), _Identity())
    x = _input(rank)
    out = moe(x)
    assert out.shape == x.shape
    kept = out != 0  # a token that lost both of its choices comes back as zeros
    assert kept.float().mean() > 0.9
    _assert_close(out[kept], x[kept])


def _forward_multi(rank: int, world: int) -> None:
    """Upstream's test_forward_multi: 4 local identity experts, 4 * world experts, model dim 4."""
    local, dim = 4, 4
    moe = MOELayer(Top2Gate(dim, local * world), nn.ModuleList([_Identity() for _ in range(local)]))
    x = torch.randn(16, 16, dim, generator=torch.Generator().manual_seed(rank))
    out = moe(x)
    assert out.shape == x.shape
    assert (out != 0).float().mean() > 0.9  # tokens that lost both choices come back as zeros
    positive = out > 0
    _assert_close(out[positive], x[positive])


def _backward(rank: int, world: int) -> None:
    """Upstream's test_backward: an identity Linear expert reproduces the input, so MSE and its gradient are 0."""
    expert = nn.Linear(MODEL_DIM, MODEL_DIM, bias=False)
    with torch.no_grad():
        expert.weight.copy_(torch.eye(MODEL_DIM))
    moe = MOELayer(Top2Gate(MODEL_DIM, world), expert)
    x = torch.randn(4, 16, MODEL_DIM, generator=torch.Generator().manual_seed(rank))
    out = moe(x)
    kept = (out != 0).all(dim=-1, keepdim=True)  # a token that lost both choices contributes x itself
    loss = torch.nn.functional.mse_loss(out * kept, x * kept)
    loss.backward()
    assert loss.item() < 1e-10
    assert torch.allclose(expert.weight.grad, torch.zeros_like(expert.weight), atol=1e-6)


def _routing(rank: int, world: int, local: int) -> None:
    experts = nn.ModuleList([_Scale(rank * local + i + 1.0) for i in range(local)])
    num_experts = world * local
    moe = MOELayer(_RoundRobinGate(num_experts), experts)
    x = _input(rank)
    flat_in, flat_out = x.reshape(-1, MODEL_DIM), moe(x).reshape(-1, MODEL_DIM)
    for i in range(flat_in.shape[0]):
        _assert_close(flat_out[i], flat_in[i] * (i % num_experts + 1))


def _dense_reference(
    gate: Top2Gate, experts: List[nn.Linear], world: int, device: str
) -> Tuple[List[Tensor], List[Tensor]]:
    """Per source rank: output and input gradient, with gradients accumulated into gate/expert copies."""
    outputs, input_grads = [], []
    for q in range(world):
        x = _input(q, requires_grad=True, device=device)
        tokens = x.reshape(-1, MODEL_DIM)
        torch.manual_seed(1000 + q)  # the gate's Gumbel noise of rank q (same values on every device of a type)
        l_aux, combine, _ = gate(tokens)
        weights = combine.sum(-1)  # [tokens, experts]
        out = sum(weights[:, e : e + 1] * experts[e](tokens) for e in range(len(experts)))
        out = out.reshape(x.shape)
        (out.square().mean() + l_aux).backward()
        outputs.append(out.detach())
        input_grads.append(x.grad)
    return outputs, input_grads


def _parity(rank: int, world: int, local: int, device: str = "cpu") -> None:
    num_experts = world * local
    all_experts = [e.to(device) for e in _experts(num_experts)]
    torch.manual_seed(3)
    gate = Top2Gate(MODEL_DIM, num_experts).to(device)
    ref_gate, ref_experts = copy.deepcopy(gate), copy.deepcopy(all_experts)
    mine = nn.ModuleList(all_experts[rank * local : (rank + 1) * local])
    moe = MOELayer(gate, mine)
    x = _input(rank, requires_grad=True, device=device)
    torch.manual_seed(1000 + rank)
    out = moe(x)
    (out.square().mean() + moe.l_aux).backward()
    ref_outputs, ref_input_grads = _dense_reference(ref_gate, ref_experts, world, device)
    _assert_close(out, ref_outputs[rank], **TOL)
    _assert_close(x.grad, ref_input_grads[rank], **TOL)
    for i, expert in enumerate(mine):
        ref = ref_experts[rank * local + i]
        _assert_close(expert.weight.grad, ref.weight.grad, **TOL)
        _assert_close(expert.bias.grad, ref.bias.grad, **TOL)
    # The gate's gradient is local (not reduced): compare with this rank's own term.
    solo_gate = copy.deepcopy(gate)
    solo_gate.zero_grad()
    solo_experts = copy.deepcopy(all_experts)
    tokens = _input(rank, device=device).reshape(-1, MODEL_DIM)
    torch.manual_seed(1000 + rank)
    l_aux, combine, _ = solo_gate(tokens)
    weights = combine.sum(-1)
    solo = sum(weights[:, e : e + 1] * solo_experts[e](tokens) for e in range(num_experts))
    (solo.square().mean() + l_aux).backward()
    _assert_close(gate.wg.weight.grad, solo_gate.wg.weight.grad, **TOL)
    _assert_close(moe.l_aux, l_aux.detach(), **TOL)


def _all_to_all_strategies(rank: int, world: int) -> None:
    """The collective and its fallbacks (torch list variant, all-gather) give the same exchange."""
    inp = torch.arange(world * 3.0).reshape(world, 3) + 100 * rank
    expected = torch.stack([torch.arange(3.0) + 3 * rank + 100 * q for q in range(world)])
    for strategy in ("tensor", "list", "all_gather"):
        out = torch.empty_like(inp)
        with collectives._force_strategy("all_to_all", strategy), collectives.count_collectives() as counter:
            try:
                collectives.all_to_all_single(out, inp)
            except RuntimeError as e:  # torch 2.1's gloo has no list all_to_all: every rank finds the same gap
                if strategy == "list" and "does not support" in str(e):
                    continue
                raise
        assert torch.equal(out, expected), strategy
        assert counter.count("all_to_all") == 1 and counter.total_bytes("all_to_all") == inp.numel() * 4
    # bf16 blocks through fp32 (torch 2.1's gloo has no bf16 all-to-all: the natural choice there): exact.
    out = torch.empty_like(inp, dtype=torch.bfloat16)
    with collectives._force_strategy("all_to_all", "fp32", torch.bfloat16):
        collectives.all_to_all_single(out, inp.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.to(torch.bfloat16))
    with pytest.raises(ValueError, match="must divide into"):
        collectives.all_to_all_single(torch.empty(world + 1), torch.empty(world + 1))
    # The MoE layer through the all-gather fallback equals the default path.
    moe = MOELayer(Top2Gate(MODEL_DIM, world), nn.ModuleList(_experts(1)))
    torch.manual_seed(5)
    default = moe(_input(rank))
    torch.manual_seed(5)
    with collectives._force_strategy("all_to_all", "all_gather"):
        fallback = moe(_input(rank))
    _assert_close(fallback, default)


def _bad_input(rank: int, world: int) -> None:
    moe = MOELayer(Top2Gate(MODEL_DIM, world + 1), _Identity())
    with pytest.raises(ValueError, match=f"routes to {world + 1} experts but the group has {world} ranks"):
        moe(torch.randn(2, world + 1, MODEL_DIM))
    moe = MOELayer(Top2Gate(MODEL_DIM, world), _Identity())
    with pytest.raises(AssertionError, match="only single input Tensor supported"):
        moe(torch.randn(2, 4, MODEL_DIM), torch.randn(2, 4, MODEL_DIM))
    with pytest.raises(AssertionError, match=r"input Tensor must have dimensions: \(s\)equence"):
        moe(torch.randn(8, MODEL_DIM))
    # bf16 inputs work here (upstream's float32 dispatch mask raised a dtype mismatch).
    moe = MOELayer(Top2Gate(MODEL_DIM, world), nn.ModuleList(_experts(1))).to(torch.bfloat16)
    out = moe(_input(rank).to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (SEQ, TOKENS, MODEL_DIM)


class _Fp32Router(nn.Module):
    """A gate kept in fp32 for low-precision inputs (a router in full precision)."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.gate = Top2Gate(MODEL_DIM, world)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        return self.gate(x.float())


def _fp32_gate_for_low_precision_inputs(rank: int, world: int) -> None:
    # The combine weights stayed fp32: after both all-to-alls, every rank failed in the combining einsum ("expected
    # m1 and m2 to have the same dtype"). They take the experts' dtype, as the dispatch mask does.
    router = _Fp32Router(world)
    moe = MOELayer(router, nn.ModuleList([e.to(torch.bfloat16) for e in _experts(1)]))
    x = _input(rank).to(torch.bfloat16)
    out = moe(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    out.float().sum().backward()
    assert router.gate.wg.weight.grad is not None and router.gate.wg.weight.grad.dtype == torch.float32
    with pytest.raises(TypeError, match="group must be a process group, got list"):
        MOELayer(router, _Identity(), group=list(range(world)))
    # A checkpoint of another world size (a gate over more experts): torch replaced the experts, then raised.
    moe = MOELayer(Top2Gate(MODEL_DIM, world), nn.ModuleList(_experts(1)))
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    other = MOELayer(Top2Gate(MODEL_DIM, 2 * world), nn.ModuleList(_experts(1))).state_dict()
    other = {k: v + 1 for k, v in other.items()}
    with pytest.raises(RuntimeError, match="size mismatch for gate.wg.weight"):
        moe.load_state_dict(other)
    assert all(torch.equal(v, before[k]) for k, v in moe.state_dict().items()), "the failed load changed the layer"


def _moe_body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("expert_params", lambda: _expert_params(rank, world_size)),
            ("forward", lambda: _identity(rank, world_size)),
            ("forward_routing", lambda: _routing(rank, world_size, 1)),
            ("forward_routing_multi", lambda: _routing(rank, world_size, 4)),
            ("forward_multi", lambda: _forward_multi(rank, world_size)),
            ("backward", lambda: _backward(rank, world_size)),
            ("parity", lambda: _parity(rank, world_size, 1)),
            ("parity_multi", lambda: _parity(rank, world_size, 2)),
            ("all_to_all_strategies", lambda: _all_to_all_strategies(rank, world_size)),
            ("bad_input", lambda: _bad_input(rank, world_size)),
            ("fp32_gate", lambda: _fp32_gate_for_low_precision_inputs(rank, world_size)),
        ]
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_moe_layer(world_size: int) -> None:
    run_distributed(_moe_body, world_size)


class _ReturnsAux(nn.Module):
    """An MoE block returning its load-balancing loss with its output (read inside the checkpointed forward)."""

    def __init__(self, moe: MOELayer) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return self.moe(x), self.moe.l_aux


def _aux_loss_body(rank: int, world_size: int) -> None:
    # Under checkpoint_wrapper the first pass runs without autograd: moe.l_aux read after the wrapper returned carried
    # no gradient, and `loss + w * moe.l_aux` trained nothing through it, silently (found by a fuzz of MoE under FSDP,
    # session 40). Reading it there warns now; returned from inside the checkpointed forward it keeps its gradient.
    import warnings

    from fairscale.nn.checkpoint import checkpoint_wrapper

    def build() -> MOELayer:
        torch.manual_seed(0)
        return MOELayer(Top2Gate(MODEL_DIM, 4 * world_size), nn.ModuleList(_experts(4)))

    x = _input(rank, requires_grad=True)
    plain = build()
    plain(x)
    plain.l_aux.backward()
    want = plain.gate.wg.weight.grad
    assert want is not None and want.abs().sum() > 0
    wrapped = checkpoint_wrapper(build())
    wrapped(x)
    with pytest.warns(UserWarning, match="carries no gradient"):
        assert not wrapped.l_aux.requires_grad
    returning = checkpoint_wrapper(_ReturnsAux(build()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning where the value keeps its gradient
        _, aux = returning(x)
        aux.backward()
    got = returning.moe.gate.wg.weight.grad
    assert got is not None
    _assert_close(got, want, what="the gate's gradient of l_aux returned through the checkpoint")
    del wrapped.l_aux  # frees the graph it holds, as upstream's plain attribute allowed
    assert wrapped.l_aux is None


def test_aux_loss_under_checkpointing() -> None:
    run_distributed(_aux_loss_body, 2)


class _MoENet(nn.Module):
    """A shared input projection, then an MoE layer with one expert per rank."""

    def __init__(self, world: int, expert: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.inp = nn.Linear(MODEL_DIM, MODEL_DIM)
        self.moe = MOELayer(Top2Gate(MODEL_DIM, world), expert)

    def forward(self, x: Tensor) -> Tensor:
        return self.moe(torch.tanh(self.inp(x)))


def _train(net: nn.Module, rank: int, steps: int, average: Any) -> torch.optim.Optimizer:
    optim = torch.optim.Adam(net.parameters(), lr=0.01)
    for step in range(steps):
        x = _input(rank) + step
        torch.manual_seed(1000 * step + rank)  # the gate's noise
        out = net(x)
        (out.square().mean() + net.moe.l_aux).backward()  # FSDP forwards attribute access to the module
        average(net)
        optim.step()
        optim.zero_grad()
    return optim


def _average_shared_grads(net: nn.Module) -> None:
    """What FSDP over the world does to the non-expert gradients; expert gradients stay local."""
    for p in net.parameters():
        if not getattr(p, "expert", False):
            collectives.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())


def _fsdp_moe_body(rank: int, world_size: int) -> None:
    singletons = [dist.new_group([r]) for r in range(world_size)]  # new_group is collective: all ranks, all groups
    expert = FSDP(copy.deepcopy(_experts(world_size)[rank]), process_group=singletons[rank])
    model = FSDP(_MoENet(world_size, expert))
    optim = _train(model, rank, 2, lambda net: None)
    assert expert.no_broadcast_optim_state and not model.no_broadcast_optim_state
    ref = _MoENet(world_size, copy.deepcopy(_experts(world_size)[rank]))
    _train(ref, rank, 2, _average_shared_grads)
    state = model.state_dict()
    assert list(state) == list(ref.state_dict())
    for key, value in ref.state_dict().items():
        _assert_close(state[key], value, what=key)

    # Clipping such a tree is refused (as upstream), saying how to clip by hand.
    with pytest.raises(NotImplementedError, match="Clip yourself"):
        model.clip_grad_norm_(1.0)

    with collectives.count_collectives() as counter:
        full = model.gather_full_optim_state_dict(optim)
    # Only the shared instance's state crosses ranks; the expert's stays rank-local.
    assert all(r.group_size in (1, world_size) for r in counter.records)
    if rank != 0:
        assert full is None
        return
    expert_local = [i for i, p in enumerate(optim.param_groups[0]["params"]) if p is expert.params[0]]
    assert full["uncollected_local_ids"] == expert_local
    gids = sorted(g for g, local in full["param_id_map"].items() if local == expert_local[0])
    mine = optim.state[expert.params[0]]
    # Rank 0's own expert state, split per original parameter (as upstream): together, its flat state.
    pieces = [full["state"][g]["exp_avg"].reshape(-1) for g in gids]
    assert torch.equal(torch.cat(pieces), mine["exp_avg"])
    assert len(full["state"]) == len(list(ref.parameters()))  # one entry per parameter of the unwrapped model


def test_fsdp_moe_no_broadcast_optim_state() -> None:
    run_distributed(_fsdp_moe_body, 2)


def _expert_precision_body(rank: int, world_size: int) -> str:
    # An expert wrapped without the root's mixed_precision on one rank: its dtype error on that rank left the others
    # in the second all-to-all until the timeout (found by a fuzz of MoE under FSDP, session 40). The first forward's
    # agreement check compares one-rank instances' mixed_precision and compute_dtype now.
    from fairscale.internal.agreement import RanksDisagreeError

    singletons = [dist.new_group([r]) for r in range(world_size)]
    expert = FSDP(copy.deepcopy(_experts(world_size)[rank]), process_group=singletons[rank], mixed_precision=rank == 0)
    model = FSDP(_MoENet(world_size, expert), mixed_precision=True)
    with pytest.raises(RanksDisagreeError, match="mixed_precision: True vs False"):
        model(_input(rank))
    # A rank-local module on a group of one rank (not an expert) may still differ.
    dtype = torch.bfloat16 if rank == 0 else torch.float32
    probe = FSDP(
        nn.Linear(MODEL_DIM, 2), process_group=singletons[rank], mixed_precision=rank == 0, compute_dtype=dtype
    )
    FSDP(_WithProbe(probe, dtype))(_input(rank)).sum().backward()
    return "raised"


class _WithProbe(nn.Module):
    """A layer, and a rank-local probe of its output (logged only) in a dtype of the rank's choosing."""

    def __init__(self, probe: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.body = nn.Linear(MODEL_DIM, MODEL_DIM)
        self.probe = probe
        self.dtype = dtype

    def forward(self, x: Tensor) -> Tensor:
        h = self.body(x)
        with torch.no_grad():
            self.last_probe = self.probe(h.detach().to(self.dtype)).float()
        return h


def test_experts_with_other_precision_settings_raise_on_every_rank() -> None:
    assert run_distributed(_expert_precision_body, 2, timeout=60.0) == ["raised", "raised"]


def _cuda_body(rank: int, world_size: int) -> None:
    device = f"cuda:{torch.cuda.current_device()}"
    run_cases(
        [
            ("parity", lambda: _parity(rank, world_size, 1, device)),
            ("parity_multi", lambda: _parity(rank, world_size, 2, device)),
        ]
    )


@pytest.mark.parametrize("world_size", [1, 2])
def test_moe_layer_cuda(world_size: int) -> None:
    """CUDA/NCCL variant (skipped without enough GPUs): all-to-all over NCCL, Gumbel noise from the CUDA generator."""
    run_distributed(_cuda_body, world_size, device="cuda", timeout=240.0)


def _copies_case(explicit_group: bool) -> None:

    rank = dist.get_rank()
    group = dist.new_group([0, 1]) if explicit_group else None
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(MODEL_DIM, MODEL_DIM), MOELayer(Top2Gate(MODEL_DIM, 2), _experts(1)[0], group))
    model.eval()  # deterministic routing: the copies must route and compute the same way
    x = _input(rank)
    with torch.no_grad():
        want = model(x)
        ema = copy.deepcopy(model)  # upstream: TypeError "cannot pickle ... ProcessGroup"
        assert ema[1].group is model[1].group, "the copy must exchange tokens over the same group"
        _assert_close(ema(x), want, what="deep copy")
        next(ema[1].experts.parameters()).add_(1.0)  # the copy is independent
        _assert_close(model(x), want, what="original after editing the copy")
        if not explicit_group:  # a process group itself never crosses processes: only the default group pickles
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=False)  # our own object, written just above
            _assert_close(loaded(x), want, what="torch.save / torch.load of the whole model")
    # After a training forward the layer holds l_aux, an output of the autograd graph: torch cannot copy that (deepcopy
    # raised "Only Tensors created explicitly by the user ... support the deepcopy protocol", upstream too). The copy
    # holds its value without the graph, and the original's still trains the gate.
    model.train()
    out = model(x)
    ema = copy.deepcopy(model)
    assert ema[1].l_aux.grad_fn is None and torch.equal(ema[1].l_aux, model[1].l_aux.detach())
    (out.sum() + model[1].l_aux).backward()
    assert model[1].gate.wg.weight.grad is not None and ema[1].gate.wg.weight.grad is None


def _copies_body(rank: int, world_size: int) -> None:
    run_cases(
        [
            (name, functools.partial(_copies_case, explicit))
            for name, explicit in (("default", False), ("explicit", True))
        ]
    )


def test_moe_layer_can_be_deep_copied_and_saved_whole() -> None:
    """An EMA or teacher copy of a model holding an MOELayer, and ``torch.save(model)``, failed with "cannot pickle
    ProcessGroup" (upstream stored ``dist.group.WORLD``): the default group is looked up at each call now, and a copy
    shares an explicit group (found by a randomized sequence of API calls)."""
    run_distributed(_copies_body, 2)
