# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``top2gating`` against hand-computed routing, capacity drops and ``l_aux``; upstream's golden numbers."""

from typing import Any

import pytest
import torch
from torch import Tensor

from fairscale.nn import Top2Gate
from fairscale.nn.moe import top2gate
from fairscale.nn.moe.top2gate import one_hot, top2gating


def _assert_close(actual: Tensor, expected: Tensor, atol: float = 1e-5, rtol: float = 1e-5, what: str = "") -> None:
    """``torch.testing.assert_close`` without its one-time import cost (about 2 s in every forked rank)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (what, actual.shape, expected.shape)
    diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert torch.allclose(actual, expected, atol=atol, rtol=rtol), f"{what} not close: max abs diff {diff}"


def test_create() -> None:
    gate = Top2Gate(4, 8)
    assert list(gate.state_dict()) == ["wg.weight"] and gate.wg.weight.shape == (8, 4)


def test_forward_cpu() -> None:
    torch.manual_seed(3)
    input = torch.randn(12, 4)
    gate = Top2Gate(4, 6)
    l_aux, combine_weights, dispatch_mask = gate(input)
    assert pytest.approx(l_aux.item(), rel=0.01) == 0.0267
    assert combine_weights.shape == dispatch_mask.shape == (12, 6, 4)
    assert torch.all(combine_weights >= 0.0) and torch.all(combine_weights <= 1.0)
    assert combine_weights.sum().item() == pytest.approx(12.0)
    assert dispatch_mask.dtype == torch.bool and torch.equal(dispatch_mask, combine_weights != 0)


def test_expert1_overflow() -> None:
    num_tokens, num_experts = 8, 4
    logits = torch.randn(num_tokens, num_experts)
    logits[:, 0] = torch.max(logits, dim=1).values + 1
    _, _, dispatch_mask = top2gating(logits)
    capacity = 2 * num_tokens // num_experts
    for i in range(num_tokens):
        if i < capacity:
            assert torch.equal(dispatch_mask[i, 0], one_hot(torch.tensor(i), capacity).bool())
        else:
            assert not dispatch_mask[i, 0].any()


def test_hand_computed_routing(monkeypatch: Any) -> None:
    """4 tokens, 4 experts, capacity 2; no noise, so the second choice is the second-largest logit.

    First choices: tokens 0, 1, 2 -> expert 0 (token 2 overflows), token 3 -> expert 1. Second choices: tokens
    0, 1, 2 -> expert 1 after its one first choice (slots 1, 2, 3: only token 0 fits), token 3 -> expert 2.
    """
    monkeypatch.setattr(top2gate, "gumbel_rsample", lambda shape, device: torch.zeros(shape))
    logits = torch.tensor(
        [[3.0, 2.0, 0.0, -1.0], [2.5, 1.0, 0.5, 0.0], [1.0, 0.5, 0.0, -2.0], [0.0, 2.0, 1.0, -1.0]],
        requires_grad=True,
    )
    gates = torch.softmax(logits.detach(), dim=1)
    l_aux, combine, dispatch = top2gating(logits)
    # me = mean gate probability per expert, ce = fraction of first choices (before dropping)
    ce = torch.tensor([0.75, 0.25, 0.0, 0.0])
    _assert_close(l_aux, (gates.mean(0) * ce).mean())
    expected = torch.zeros(4, 4, 2)
    g0 = gates[0, 0] + gates[0, 1]
    expected[0, 0, 0], expected[0, 1, 1] = gates[0, 0] / g0, gates[0, 1] / g0
    expected[1, 0, 1] = 1.0  # its second choice (expert 1, slot 2) was dropped: all weight on the first
    g3 = gates[3, 1] + gates[3, 2]
    expected[3, 1, 0], expected[3, 2, 0] = gates[3, 1] / g3, gates[3, 2] / g3
    _assert_close(combine, expected)  # token 2 lost both choices: all zeros
    assert torch.equal(dispatch, expected != 0)
    (combine.sum() + l_aux).backward()
    assert logits.grad is not None


def test_single_expert_routes_twice() -> None:
    l_aux, combine, _ = top2gating(torch.randn(6, 1))
    assert l_aux.item() == pytest.approx(1.0)
    assert combine.shape == (6, 1, 12) and torch.allclose(combine.sum(-1), torch.ones(6, 1))
    assert torch.allclose(combine[combine != 0], torch.full((12,), 0.5))


def test_bad_token_counts() -> None:
    with pytest.raises(AssertionError, match="0 tokens"):
        top2gating(torch.zeros(0, 4))  # capacity would be 0
    with pytest.raises(AssertionError, match=r"tokens \(6\) must be a multiple of the number of experts \(4\)"):
        top2gating(torch.randn(6, 4))
    with pytest.raises(AssertionError, match="num_classes must be a positive integer"):
        one_hot(torch.tensor([0]), 0)
    with pytest.raises(TypeError, match="logits must be floating point, got torch.int64"):
        top2gating(torch.ones(4, 2, dtype=torch.long))  # the combine weights were cast back to int64: all 0


def test_gumbel_matches_torch_distribution() -> None:
    """Same draws as upstream's ``torch.distributions.gumbel.Gumbel(0, 1).rsample`` (RNG streams stay aligned)."""
    from torch.distributions.gumbel import Gumbel

    dist = Gumbel(torch.tensor(0.0), torch.tensor(1.0))
    for seed in range(3):
        torch.manual_seed(seed)
        expected = dist.rsample((13, 5))
        torch.manual_seed(seed)
        assert torch.equal(top2gate.gumbel_rsample((13, 5), torch.device("cpu")), expected)
