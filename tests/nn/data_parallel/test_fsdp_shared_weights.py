# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Shared (tied) parameters: inside one instance, and between sibling instances through append_shared_param."""

import copy
import functools
import itertools
from typing import Any, Dict, List

import pytest
import torch
from _models import (
    FailInBackward,
    MIXED,
    TransformerWithSharedParams,
    assert_close_dict,
    assert_idle,
    full_params,
    gather_full_grads,
    make_optim,
    ref_params,
    train_and_compare,
)
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.nn.checkpoint import checkpoint_wrapper
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP


class TiedInsideBlock(nn.Module):
    """``block`` holds two linears sharing weight and bias; the root holds its own tied pair."""

    NESTED = ("block",)
    LEAF = ("block",)
    BATCH_DEPENDENT = False

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)
        self.b.weight = self.a.weight
        self.block = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5))
        self.block[2].weight = self.block[0].weight
        self.block[2].bias = self.block[0].bias

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.block(torch.tanh(self.a(x))))

    @staticmethod
    def sample(n: int, gen: torch.Generator) -> Any:
        return (torch.randn(n, 5, generator=gen),)

    @staticmethod
    def per_sample_loss(out: Tensor) -> Tensor:
        return (out.float() - 0.5).pow(2).sum(-1)


def _tied_parameters_inside_instances_body(rank: int, ws: int) -> None:
    cases = []
    for model_cls, mp, flatten, mode in itertools.product(
        (TiedInsideBlock, TransformerWithSharedParams), ("fp32", "fp16"), (True, False), ("one", "nested")
    ):
        kwargs = dict(flatten_parameters=flatten, **MIXED[mp])
        name = f"{model_cls.__name__},{mp},flatten={flatten},{mode}"
        cases.append((name, lambda c=model_cls, k=kwargs, m=mode: _tied_case(rank, ws, c, k, m)))
    run_cases(cases)


def test_tied_parameters_inside_instances() -> None:
    run_distributed(_tied_parameters_inside_instances_body, 2)


def _tied_case(rank: int, ws: int, model_cls: Any, kwargs: Any, mode: str) -> None:
    fsdp = train_and_compare(rank, ws, model_cls, kwargs, mode)
    # The tie survives training: both names still see the same values.
    if model_cls is TiedInsideBlock:
        # named_parameters() lists a tied parameter once; the state dict keeps every name, with equal values.
        assert "b.weight" not in full_params(fsdp)
        sd = fsdp.state_dict()
        assert torch.equal(sd["a.weight"], sd["b.weight"])
        assert torch.equal(sd["block.0.weight"], sd["block.2.weight"])
        assert torch.equal(sd["block.0.bias"], sd["block.2.bias"])
        with fsdp.summon_full_params():
            user = fsdp.module.module
            assert user.a.weight is user.b.weight
    else:
        with fsdp.summon_full_params():
            user = fsdp.module.module
            assert user.output_proj.weight is user.embed_tokens.weight


class TiedHead(nn.Module):
    """Output layer that reuses an embedding owned elsewhere (not registered here: it belongs to a sibling)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(embedding.num_embeddings))
        self._embedding: List[nn.Embedding] = [embedding]  # a plain list, so it is not a registered submodule

    def forward(self, h: Tensor) -> Tensor:
        return nn.functional.linear(h, self._embedding[0].weight, self.bias)


class SiblingShare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = TiedHead(self.embed)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def _sibling_instances_share_a_parameter_body(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    model, ref = SiblingShare(), SiblingShare()
    ref.load_state_dict(model.state_dict())
    ref.head._embedding = [ref.embed]
    model.embed = FSDP(model.embed, flatten_parameters=False)
    shared = model.embed.module.module.weight
    model.head = FSDP(model.head, flatten_parameters=False)
    model.head.append_shared_param(shared)
    fsdp = FSDP(model)
    opt, ref_opt = make_optim(fsdp.parameters(), "sgd"), make_optim(ref.parameters(), "sgd")
    for step in range(3):
        ids = torch.randint(11, (2 * ws, 4), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss = fsdp(ids.tensor_split(ws)[rank]).float().pow(2).mean()
        loss.backward()
        assert_idle(fsdp)
        ref_opt.zero_grad()
        ref(ids).pow(2).mean().backward()
        expected = {n: p.grad for n, p in ref.named_parameters()}
        assert_close_dict(gather_full_grads(fsdp), expected, f"step {step} grad", rtol=1e-5, atol=1e-6)
        opt.step()
        ref_opt.step()
    # The owner exposes the shared parameter in summon_full_params (and so in state dicts) like any other.
    assert_close_dict(full_params(fsdp), ref_params(ref), "param", rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sibling_instances_share_a_parameter(world_size: int) -> None:
    run_distributed(_sibling_instances_share_a_parameter_body, world_size)


def _sibling_share(variant: str) -> Any:
    torch.manual_seed(0)
    model, ref = SiblingShare(), SiblingShare()
    ref.load_state_dict(model.state_dict())
    ref.head._embedding = [ref.embed]
    kwargs: Dict[str, Any] = dict(flatten_parameters=False, reshard_after_forward="raf=False" not in variant)
    if "fp16" in variant:
        kwargs["mixed_precision"] = True
    if "optimize_backward_concat" in variant:
        kwargs["optimize_backward_concat"] = True
    model.embed = FSDP(model.embed, **kwargs)
    model.head = FSDP(checkpoint_wrapper(model.head) if "checkpointed" in variant else model.head, **kwargs)
    model.head.append_shared_param(model.embed.module.module.weight)
    return FSDP(model, **kwargs), ref


def _shared_parameter_case(rank: int, ws: int, order: str, variant: str) -> None:
    """The borrowed weight's gradient sums every use and every backward of the step, like other gradients.

    The owner's and the borrower's handles each keep a reduced shard of the step: the second synchronizing backward
    of a step (or the backward of a second forward) used to hand ``p.grad`` one of them only, silently. With mixed
    precision (the parameter changes dtype between the two forwards, so it gets a second autograd accumulator) or a
    checkpointed borrower (its recomputation accumulates in a backward of its own), the borrower's part arrives
    before the owner's backward began: that raised "no output of this FullyShardedDataParallel's forward got a
    gradient hook".
    """
    fsdp, ref = _sibling_share(variant)
    batches = [torch.randint(11, (2 * ws, 4), generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)]

    def loss(ids: Tensor) -> Tensor:
        return fsdp(ids.tensor_split(ws)[rank]).float().pow(2).mean()

    if order == "fb":
        batches = batches[:1]
        loss(batches[0]).backward()
    elif order == "fb fb fb":
        for ids in batches:
            loss(ids).backward()
    elif order == "ff bb, fb":
        first, second = loss(batches[0]), loss(batches[1])
        first.backward()
        second.backward()
        loss(batches[2]).backward()
    else:  # "no_sync fb, fb fb": a window, its synchronizing backward, then one more
        with fsdp.no_sync():
            loss(batches[0]).backward()
        loss(batches[1]).backward()
        loss(batches[2]).backward()
    assert_idle(fsdp)
    for ids in batches:
        ref(ids).pow(2).mean().backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}
    rtol, atol = (1e-2, 1e-3) if "fp16" in variant else (1e-5, 1e-6)  # fp16 compute against an fp32 reference
    assert_close_dict(gather_full_grads(fsdp), expected, "grad", rtol=rtol, atol=atol)


_ORDERS = ("fb", "fb fb fb", "ff bb, fb", "no_sync fb, fb fb")
_VARIANTS = (
    "fp32",
    "fp32 raf=False",
    "fp32 optimize_backward_concat",
    "fp16",
    "fp16 optimize_backward_concat",
    "checkpointed borrower",
    "fp16 checkpointed borrower",
)


def _shared_parameter_body(rank: int, ws: int) -> None:
    run_cases(
        [
            (f"{order}, {variant}", functools.partial(_shared_parameter_case, rank, ws, order, variant))
            for order in _ORDERS
            for variant in _VARIANTS
        ]
    )


def test_shared_parameter_with_several_backwards_mixed_precision_or_checkpointing() -> None:
    run_distributed(_shared_parameter_body, 2)


class _FailingSiblingShare(SiblingShare):
    fail = False

    def forward(self, ids: Tensor) -> Tensor:
        h = FailInBackward.apply(self.embed(ids), self.fail)
        return self.head(torch.tanh(self.mid(h)))


def _failing_share(variant: str) -> FSDP:
    torch.manual_seed(0)
    model = _FailingSiblingShare()
    kwargs: Dict[str, Any] = dict(flatten_parameters=False, mixed_precision="fp16" in variant)
    model.embed = FSDP(model.embed, **kwargs)
    model.head = FSDP(checkpoint_wrapper(model.head) if "checkpointed" in variant else model.head, **kwargs)
    model.head.append_shared_param(model.embed.module.module.weight)
    return FSDP(model, **kwargs)


def _retry_after_failed_backward(rank: int, ws: int, variant: str) -> None:
    """The step's first backward raises after the borrower's part of the shared gradient arrived (mixed precision or
    a checkpointed borrower: it waits in ``p.grad`` for the owner's part), before the owner's backward: the retried
    step's gradients are the retry's alone, as for the other parameters (the failed part was kept and reduced with
    the retry's). A deep copy of the model hooks the shared parameter as the model does: same reductions."""
    ids = [
        torch.randint(11, (2 * ws, 4), generator=torch.Generator().manual_seed(s)).tensor_split(ws)[rank]
        for s in (1, 2)
    ]
    model = _failing_share(variant)
    model.module.module.fail = True
    with pytest.raises(RuntimeError, match="injected"):
        model(ids[0]).float().pow(2).mean().backward()
    model.module.module.fail = False
    with pytest.warns(UserWarning, match="did not finish"):
        loss = model(ids[1]).float().pow(2).mean()  # this forward recovers from the aborted backward
    loss.backward()
    counts = []
    for fresh in (_failing_share(variant), copy.deepcopy(_failing_share(variant))):
        with count_collectives() as counter:
            fresh(ids[1]).float().pow(2).mean().backward()
        counts.append(counter.total_bytes("reduce_scatter", phase="backward"))
        got, expected = gather_full_grads(model), gather_full_grads(fresh)
        assert sorted(got) == sorted(expected)
        for name in expected:
            assert torch.equal(got[name], expected[name]), name
    assert counts[0] == counts[1], counts


def _retry_body(rank: int, ws: int) -> None:
    run_cases(
        [
            (variant, functools.partial(_retry_after_failed_backward, rank, ws, variant))
            for variant in ("fp32", "fp16", "checkpointed borrower", "fp16 checkpointed borrower")
        ]
    )


def test_shared_parameter_after_a_failed_backward_and_in_a_copy() -> None:
    run_distributed(_retry_body, 2)


def _append_shared_param_bad_input_body(rank: int, ws: int) -> None:
    owner = FSDP(nn.Linear(3, 3), flatten_parameters=False)
    shared = owner.module.module.weight
    with pytest.raises(RuntimeError, match="flatten_parameters=False"):
        FSDP(nn.Linear(3, 3)).append_shared_param(shared)
    with pytest.raises(ValueError, match="already sharded"):
        FSDP(nn.Linear(3, 3), flatten_parameters=False).append_shared_param(nn.Parameter(torch.ones(3)))
    started = FSDP(nn.Linear(3, 3), flatten_parameters=False)
    started(torch.randn(1, 3))
    with pytest.raises(RuntimeError, match="before the first forward"):
        started.append_shared_param(shared)


def test_append_shared_param_bad_input() -> None:
    run_distributed(_append_shared_param_bad_input_body, 2)


class RegisteredInBoth(nn.Module):
    """Four linears, ``l1`` and ``l3`` sharing one weight registered in both (the model of upstream's shared-weights
    test): ``l1`` owns it in FSDP, ``l3`` declares it with ``append_shared_param``."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(4, 4) for _ in range(4))
        self.l3.weight = self.l1.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(self.l0(x))))))


def _wrap_registered_in_both(model: RegisteredInBoth) -> FSDP:
    model.l1 = FSDP(model.l1, flatten_parameters=False)
    model.l2 = FSDP(model.l2, flatten_parameters=False)
    model.l3 = FSDP(model.l3, flatten_parameters=False)
    model.l3.append_shared_param(model.l1.module.module.weight)
    return FSDP(model, flatten_parameters=False)


def _registered_in_both_state_dict_body(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    ref = RegisteredInBoth()
    fsdp = _wrap_registered_in_both(RegisteredInBoth())
    fsdp.load_state_dict(ref.state_dict())
    # Before any step, after steps, and between a forward and its backward: both names, full, equal to the reference.
    expected = ref.state_dict()
    assert_close_dict(fsdp.state_dict(), expected, "before training", rtol=0, atol=0)
    opt, ref_opt = make_optim(fsdp.parameters(), "sgd"), make_optim(ref.parameters(), "sgd")
    for step in range(2):
        x = torch.randn(2 * ws, 4, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        out = fsdp(x.tensor_split(ws)[rank])
        sd = fsdp.state_dict()  # a backward is pending
        assert_close_dict(sd, ref.state_dict(), f"step {step}, mid-step", rtol=1e-5, atol=1e-6)
        out.pow(2).mean().backward()
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        opt.step()
        ref_opt.step()
    sd = fsdp.state_dict()
    assert sd["l3.weight"].shape == (4, 4) and torch.equal(sd["l1.weight"], sd["l3.weight"])
    assert_close_dict(sd, ref.state_dict(), "after training", rtol=1e-5, atol=1e-6)
    # The borrower summoned alone shows the full shared weight, and an edit of it reaches the owner's shard.
    with fsdp.l3.summon_full_params(recurse=False):
        assert fsdp.l3.module.module.weight.shape == (4, 4)
        fsdp.l3.module.module.weight.data.fill_(0.25)
    sd = fsdp.state_dict()
    assert torch.equal(sd["l1.weight"], torch.full((4, 4), 0.25)) and torch.equal(sd["l3.weight"], sd["l1.weight"])
    # A full dict round trip through another wrapping.
    other = _wrap_registered_in_both(RegisteredInBoth())
    other.load_state_dict(sd)
    assert_close_dict(other.state_dict(), sd, "loaded", rtol=0, atol=0)


def test_a_parameter_registered_in_both_siblings_is_full_under_both_names() -> None:
    """Found by running upstream's shared-weights test: the borrower's state_dict listed the shared weight as this
    rank's flat shard (shape (8,) instead of (4, 4))."""
    run_distributed(_registered_in_both_state_dict_body, 2)


class _LateTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 5, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def _tied_after_wrapping_case(nested: bool) -> None:
    torch.manual_seed(0)
    net = _LateTied()
    if nested:  # the two weights in different instances
        net.head = FSDP(net.head)  # type: ignore[assignment]
    model = FSDP(net)
    user = model.module
    head = user.head.module.module if nested else user.head  # the Linear (a wrapper refuses the assignment)
    head.weight = user.emb.weight  # what a tie_weights() after wrapping does
    with pytest.raises(ValueError, match=r"tied after wrapping \(head\.weight = emb\.weight\).*before wrapping"):
        model(torch.arange(4))
    # Tied before wrapping, the same model trains tied.
    torch.manual_seed(0)
    net = _LateTied()
    net.head.weight = net.emb.weight
    model = FSDP(net)
    model(torch.arange(4)).sum().backward()
    with model.summon_full_params():
        assert model.module.head.weight is model.module.emb.weight


def _tied_after_wrapping_body(rank: int, ws: int) -> None:
    run_cases([(f"nested={nested}", functools.partial(_tied_after_wrapping_case, nested)) for nested in (False, True)])


def test_weights_tied_after_wrapping_are_refused_at_the_first_forward() -> None:
    """Found by a fuzz of init patterns (session 42): with flatten_parameters=True a tie made after wrapping
    (`head.weight = emb.weight`, a tie_weights() call) was overwritten by the next forward's views, silently, and
    the model trained untied."""
    run_distributed(_tied_after_wrapping_body, 2)
