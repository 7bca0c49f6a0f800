# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``MOELayer`` when the ranks do not feed it alike: the same clear error on every rank, never a crashed all-to-all.

The all-to-all exchanges equal blocks whose size follows from each rank's token count, so ranks with different
token counts (or model dims, dtypes, expert counts) used to hand gloo mismatched buffers: the process aborted
(SIGABRT). A rank whose input failed a local check raised alone and left its peers waiting in the all-to-all.
"""

from typing import Dict, List, Optional

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal import collectives
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.nn import MOELayer, Top2Gate

MODEL_DIM = 8


class _Identity(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


def _layer(world_size: int, local_experts: int = 1) -> MOELayer:
    torch.manual_seed(0)
    experts = nn.ModuleList([_Identity() for _ in range(local_experts)])
    return MOELayer(Top2Gate(MODEL_DIM, world_size * local_experts), experts)


def _error_of(moe: MOELayer, x: Tensor) -> Optional[str]:
    """``"<type>: <message>"`` of the forward's exception, ``None`` when it ran."""
    try:
        moe(x)
    except Exception as e:  # noqa: B902  # the test compares what every rank raised
        return f"{type(e).__name__}: {e}"
    return None


def _uneven_tokens_body(rank: int, world_size: int) -> Dict[str, Optional[str]]:
    moe = _layer(world_size)
    seen: Dict[str, Optional[str]] = {}
    # 8 tokens on rank 0, 16 on the others: upstream's (and yesterday's) SIGABRT.
    tokens = 8 if rank == 0 else 16
    with pytest.raises(RanksDisagreeError) as info:
        moe(torch.randn(1, tokens, MODEL_DIM))
    assert isinstance(info.value, ValueError) and isinstance(info.value, AssertionError)
    seen["tokens"] = str(info.value)
    # Another model dim on the last rank only (the gate of that rank matches it, so each rank alone is fine).
    dim = MODEL_DIM * 2 if rank == world_size - 1 else MODEL_DIM
    other = MOELayer(Top2Gate(dim, world_size), _Identity())
    seen["model_dim"] = _error_of(other, torch.randn(1, 16, dim))
    # Another dtype on rank 0.
    dtype = torch.float64 if rank == 0 else torch.float32
    seen["dtype"] = _error_of(_layer(world_size).to(dtype), torch.randn(1, 16, MODEL_DIM, dtype=dtype))
    # A local check that fails on rank 1 only (7 tokens is not a multiple of the expert count): rank 1 raises its
    # own error, the others a RuntimeError that names rank 1 and that error, instead of waiting in the all-to-all.
    seen["local_failure"] = _error_of(moe, torch.randn(1, 7 if rank == 1 else 8, MODEL_DIM))
    # An evaluation forward under no_grad on rank 0 only: the training ranks' backward waited in the all-to-all.
    # (An input that requires grad: the dispatched block then does where grad is enabled.)
    with torch.set_grad_enabled(rank != 0):
        seen["grad_mode"] = _error_of(moe, torch.randn(1, 8, MODEL_DIM, requires_grad=True))
    # An input requiring grad on rank 0 only (experts trainable everywhere): only the first all-to-all's backward
    # differs; one flag for both missed it (found by a review).
    seen["input_grad"] = _error_of(moe, torch.randn(1, 8, MODEL_DIM, requires_grad=rank == 0))
    with torch.no_grad():  # every rank evaluating is fine
        assert moe(torch.randn(1, 8, MODEL_DIM)).shape == (1, 8, MODEL_DIM)
    # After all that, the layer still works: no collective was left half done.
    out = moe(torch.randn(2, 8, MODEL_DIM, requires_grad=True))
    assert out.shape == (2, 8, MODEL_DIM)
    out.sum().backward()
    return seen


def test_uneven_tokens_raise_the_same_error_on_every_rank() -> None:
    results: List[Dict[str, Optional[str]]] = run_distributed(_uneven_tokens_body, 2, timeout=60)
    first, second = results
    assert first["tokens"] == second["tokens"]
    message = first["tokens"]
    assert message is not None and "MOELayer" in message and "global rank 1" in message
    assert "('tokens', 8) vs ('tokens', 16)" in message and "pad" in message
    assert first["model_dim"] == second["model_dim"] and "RanksDisagreeError" in str(first["model_dim"])
    assert "'model_dim'" in str(first["model_dim"])
    assert first["dtype"] == second["dtype"] and "torch.float64" in str(first["dtype"])
    assert second["local_failure"] is not None and "must be a multiple of the number of experts" in str(
        second["local_failure"]
    )
    assert first["local_failure"] is not None and first["local_failure"].startswith("RuntimeError")
    assert "global rank 1" in first["local_failure"] and "multiple of the number of experts" in first["local_failure"]
    assert first["grad_mode"] == second["grad_mode"]
    assert "('backward (dispatch)', False) vs ('backward (dispatch)', True)" in str(first["grad_mode"])
    assert first["input_grad"] == second["input_grad"] and "'backward (dispatch)'" in str(first["input_grad"])
    assert "torch.no_grad()" in str(first["grad_mode"])


def _cost_body(rank: int, world_size: int) -> List[str]:
    torch.manual_seed(0)
    experts = nn.ModuleList([nn.Linear(MODEL_DIM, MODEL_DIM) for _ in range(2)])
    moe = MOELayer(Top2Gate(MODEL_DIM, world_size * 2), experts)
    moe(torch.randn(2, 8, MODEL_DIM))  # warm up the dispatch choices
    with collectives.count_collectives() as counter:
        out = moe(torch.randn(2, 8, MODEL_DIM, requires_grad=True))
    forward = [r.kind for r in counter.records]
    with collectives.count_collectives() as counter:
        out.sum().backward()
    return forward + [r.kind for r in counter.records]


def test_agreement_costs_one_tiny_collective_per_forward() -> None:
    """The check is one all-gather of a few integers per forward, beside the two all-to-alls; backward adds nothing."""
    kinds = run_distributed(_cost_body, 2, timeout=60)[0]
    assert kinds == ["all_gather", "all_to_all", "all_to_all", "all_to_all", "all_to_all"]


def test_bad_construction_is_refused_with_what_to_do() -> None:
    """Checked before the process group is looked up, so no world is needed."""
    with pytest.raises(TypeError, match="wrap a list of experts in nn.ModuleList"):
        MOELayer(Top2Gate(MODEL_DIM, 2), [nn.Linear(MODEL_DIM, MODEL_DIM)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gate must be callable"):
        MOELayer(None, nn.Linear(MODEL_DIM, MODEL_DIM))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty ModuleList"):
        MOELayer(Top2Gate(MODEL_DIM, 2), nn.ModuleList())


class _Widen(nn.Module):
    """An expert that returns another model dim (a user bug): the second all-to-all must not see it."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x, x], dim=-1)


class _Double(nn.Module):
    """An expert that returns float64 (a user bug): the combining einsum failed with torch's bare dtype error."""

    def forward(self, x: Tensor) -> Tensor:
        return x.double()


def _bad_expert_or_group_body(rank: int, world_size: int) -> List[str]:
    seen = []
    torch.manual_seed(0)
    widening = MOELayer(Top2Gate(MODEL_DIM, world_size), _Widen())
    with pytest.raises(
        ValueError, match=r"local expert 0 returned \(.*16\) torch.float32 for an input of shape \(.*8\)"
    ):
        widening(torch.randn(2, 4, MODEL_DIM))
    seen.append("expert shape refused")
    doubling = MOELayer(Top2Gate(MODEL_DIM, world_size), _Double())
    with pytest.raises(ValueError, match=r"returned \(.*8\) torch.float64 for an input of shape \(.*8\) torch.float32"):
        doubling(torch.randn(2, 4, MODEL_DIM))
    seen.append("expert dtype refused")
    only_rank_0 = torch.distributed.new_group([0])
    if rank == 1:
        with pytest.raises(ValueError, match=r"global rank 1\) is not a member of `group`"):
            MOELayer(Top2Gate(MODEL_DIM, 1), _Identity(), group=only_rank_0)
        seen.append("non-member refused")
    else:
        out = MOELayer(Top2Gate(MODEL_DIM, 1), _Identity(), group=only_rank_0)(torch.randn(2, 4, MODEL_DIM))
        seen.append(f"member runs {tuple(out.shape)}")
    return seen


def test_expert_of_another_shape_and_non_member_group_are_refused() -> None:
    """An expert returning another shape aborted gloo in the second all-to-all (or failed in the combining einsum
    with a cryptic message); a layer built on a rank outside its group failed with "negative dimension -6"."""
    results = run_distributed(_bad_expert_or_group_body, 2, timeout=60)
    assert results == [
        ["expert shape refused", "expert dtype refused", "member runs (2, 4, 8)"],
        ["expert shape refused", "expert dtype refused", "non-member refused"],
    ]


def _function_gate_body(rank: int, world_size: int) -> None:
    # A plain function as the gate, as upstream allows (it was refused: "gate must be an nn.Module").
    moe = _layer(world_size)
    gate = moe.gate
    functional = MOELayer(lambda tokens: gate(tokens), moe.experts)  # type: ignore[arg-type]
    x = torch.randn(2, 4, MODEL_DIM, generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(1)  # the gate's Gumbel noise
    expected = moe(x)
    torch.manual_seed(1)
    assert torch.equal(functional(x), expected)


def test_a_function_gate() -> None:
    run_distributed(_function_gate_body, 1, timeout=60)


def _unreachable_gate(x: Tensor) -> None:
    raise AssertionError("the gate must not be reached")


def _zero_model_dim_body(rank: int, world_size: int) -> str:
    moe = MOELayer(_unreachable_gate, _Identity())  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"MOELayer: the input's model dimension \(its last\) is 0 \(shape \(2, 4, 0\)\)"
    ):
        moe(torch.randn(2, 4, 0))
    return "refused"


def test_zero_model_dim_is_refused() -> None:
    """torch's reshape(-1, 0) failed ("cannot reshape tensor of 0 elements ... ambiguous") before the gate ran."""
    assert run_distributed(_zero_model_dim_body, 1, timeout=60) == ["refused"]


class _Fp32Norm(nn.Module):
    """An expert ending in a LayerNorm as CUDA's autocast runs it: in fp32, whatever the input's dtype (CPU's autocast
    keeps layer_norm in bf16, so the cast is explicit here)."""

    def __init__(self, cast_back: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.proj = nn.Linear(MODEL_DIM, MODEL_DIM)
        self.cast_back = cast_back

    def forward(self, x: Tensor) -> Tensor:
        out = nn.functional.layer_norm(self.proj(x).float(), (MODEL_DIM,))
        return out.to(x.dtype) if self.cast_back else out


def _autocast_expert_body(rank: int, world_size: int) -> List[str]:
    x = torch.randn(2, 4, MODEL_DIM, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
    outputs, grads = [], []
    for cast_back in (False, True):
        torch.manual_seed(0)
        moe = MOELayer(Top2Gate(MODEL_DIM, world_size), _Fp32Norm(cast_back))
        x.grad = None
        torch.manual_seed(1)  # the gate's Gumbel noise
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = moe(x)
        out.float().sum().backward()
        outputs.append(out)
        grads.append(x.grad)
    # The fp32 output travels in the dispatched dtype: what an expert casting back itself gives, bit for bit.
    assert outputs[0].dtype == torch.bfloat16 and torch.equal(outputs[0], outputs[1])
    assert grads[0] is not None and grads[1] is not None and torch.equal(grads[0], grads[1])
    # Outside autocast another dtype is still a user bug, refused on every rank before the second all-to-all.
    moe = MOELayer(Top2Gate(MODEL_DIM, world_size).to(torch.bfloat16), _Fp32Norm(False).to(torch.bfloat16))
    return [str(_error_of(moe, x.detach().to(torch.bfloat16)))]


def test_an_expert_returning_fp32_under_autocast() -> None:
    """Under CUDA's autocast an expert ending in layer_norm or softmax returns fp32: every rank raised "an expert must
    return a tensor of its input's ... dtype" (the check added for user bugs did not know autocast)."""
    results = run_distributed(_autocast_expert_body, 2, timeout=60)
    assert results[0] == results[1]
    assert "local expert 0 returned (2, 1, 8, 8) torch.float32 for an input of shape" in results[0][0], results
