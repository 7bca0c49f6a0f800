# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""MEVO and its helpers reject bad input with explicit errors (ValueError, TypeError, each also an AssertionError as
upstream's bare asserts were) that name the call and say what to do."""

from typing import Any, Callable, Tuple, Type

import pytest
import torch
import torch.nn as nn

from fairscale.experimental.nn.mevo import BackwardTrigger, BaselineSoftmax, GetMaxFunction, GetSumFunction
from fairscale.experimental.nn.mevo import MemoryEfficientVocabOutput as MEVO
from fairscale.experimental.nn.mevo import get_data


def _data(tokens: int = 6, d: int = 3, vocab: int = 5) -> Tuple[torch.Tensor, nn.Parameter, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d, generator=g).requires_grad_()
    w = nn.Parameter(torch.randn(vocab, d, generator=g))
    y = torch.randint(vocab, (tokens,), generator=g)
    return x, w, y


def _get_data_shape() -> None:
    get_data(((4, 3), (4, 7)), dtype=torch.float32, device="cpu")


def _get_data_dtype() -> None:
    get_data(((4, 3), (3, 7)), dtype=torch.float64, device="cpu")


def _get_max_split_dim() -> None:
    x, w, y = _data()
    get_max: Any = GetMaxFunction  # apply() is untyped in torch's stubs
    get_max.apply(x, w, y[:0], MEVO(w), 0, 5, 1)


def _get_sum_split_dim() -> None:
    x, w, y = _data()
    get_sum: Any = GetSumFunction
    get_sum.apply(x, w, y[:0], torch.zeros(6), MEVO(w), 0, 5, 1)


def _trigger_of_plain_tensor() -> None:
    BackwardTrigger(torch.ones(3, 2))


def _mevo_reduction() -> None:
    MEVO(_data()[1], reduction="none")


def _mevo_tile_factor(value: Any) -> Callable[[], None]:
    # 0 divided by zero in the first forward, 2.5 failed inside ('float' has no bit_length), -1 was taken silently.
    return lambda: MEVO(_data()[1], tile_factor=value)


def _forward_input_not_tensor() -> None:
    _, w, y = _data()
    MEVO(w)([[1.0, 2.0, 3.0]], y)


def _forward_target_none_in_training() -> None:
    x, w, _ = _data()
    MEVO(w).train()(x, None)


def _forward_input_without_grad() -> None:
    x, w, y = _data()
    MEVO(w)(x.detach(), y)


def _forward_width_mismatch() -> None:
    x, w, y = _data()
    MEVO(w)(torch.randn(6, 4, requires_grad=True), y)


def _forward_4d_input() -> None:
    x, w, y = _data()
    MEVO(w)(torch.randn(1, 2, 3, 3, requires_grad=True), y)


def _forward_0d_target() -> None:
    x, w, y = _data()
    MEVO(w)(torch.randn(1, 3, requires_grad=True), y[0])


def _mevo_1d_weight() -> None:
    MEVO(nn.Parameter(torch.randn(5)))


def _forward_token_mismatch() -> None:
    x, w, y = _data()
    MEVO(w)(x, y[:4])


def _forward_negative_target() -> None:
    # -1 (a common padding id) indexed the weight from its end: it scored the last vocabulary row, silently.
    x, w, y = _data()
    y[3] = -1
    MEVO(w)(x, y)


def _forward_target_past_vocab() -> None:
    x, w, y = _data()
    y[0] = 5
    MEVO(w)(x, y)


def _forward_float_target() -> None:
    x, w, y = _data()
    MEVO(w)(x, y.float())


def _forward_uint8_target() -> None:
    # Indexing reads a uint8 tensor as a mask: a silently wrong loss.
    x, w, y = _data()
    MEVO(w)(x, y.to(torch.uint8))


def _baseline_fp32_input_fp16_weight() -> None:
    x, w, y = _data()
    BaselineSoftmax(nn.Parameter(w.detach().half()))(x, y)


CASES = [
    pytest.param(_get_data_shape, ValueError, r"get_data: incorrect shape 3 vs 4", id="get_data-shape"),
    pytest.param(
        _get_data_dtype,
        ValueError,
        r"get_data: unsupported dtype torch.float64; pass torch.float16 or torch.float32",
        id="get_data-dtype",
    ),
    pytest.param(
        _get_max_split_dim,
        ValueError,
        r"GetMaxFunction: only splitting along dim 0 is supported, got split_dim=1",
        id="get_max-split_dim",
    ),
    pytest.param(
        _get_sum_split_dim,
        ValueError,
        r"GetSumFunction: only splitting along dim 0 is supported, got split_dim=1",
        id="get_sum-split_dim",
    ),
    pytest.param(
        _trigger_of_plain_tensor, TypeError, r"BackwardTrigger needs an nn.Parameter, got Tensor", id="trigger-param"
    ),
    pytest.param(_mevo_reduction, ValueError, r"MEVO: reduction must be 'sum' or 'mean', got 'none'", id="reduction"),
    *[
        pytest.param(
            _mevo_tile_factor(v), ValueError, rf"MEVO: tile_factor must be a positive integer, got {v}", id=f"tf={v}"
        )
        for v in (0, -1, 2.5)
    ],
    pytest.param(_forward_input_not_tensor, TypeError, r"MEVO.forward: input must be a tensor, got list", id="input"),
    pytest.param(
        _forward_target_none_in_training,
        TypeError,
        r"MEVO.forward: target must be a tensor \(required in training mode\), got NoneType",
        id="target-none",
    ),
    pytest.param(
        _forward_input_without_grad,
        ValueError,
        r"MEVO.forward: input must require grad in training",
        id="input-requires-grad",
    ),
    pytest.param(
        _forward_width_mismatch,
        ValueError,
        r"MEVO.forward: incorrect shape 4 vs 3: the input's last dimension \(4\) must equal the weight's d_model",
        id="d_model",
    ),
    pytest.param(
        _forward_4d_input,
        ValueError,
        r"MEVO.forward: input must be 2-D \(tokens, d_model\) or 3-D \(batch, seq, d_model\), got shape \(1, 2, 3, 3\)",
        id="input-rank",
    ),
    pytest.param(
        _forward_0d_target,
        ValueError,
        r"MEVO.forward: target must be 1-D \(tokens\) or 2-D \(batch, seq\), got shape \(\)",
        id="target-rank",
    ),
    pytest.param(
        _mevo_1d_weight,
        ValueError,
        r"MEVO: proj_weight must be a 2-D \(vocab, d_model\) parameter, got \(5,\)",
        id="weight-rank",
    ),
    pytest.param(
        _forward_token_mismatch,
        ValueError,
        r"MEVO.forward: incorrect shape 6 vs 4: the input has 6 tokens but the target has 4",
        id="tokens",
    ),
    pytest.param(
        _forward_negative_target,
        ValueError,
        r"MEVO.forward: target -1 is out of bounds: class indices must be in \[0, 5\)",
        id="target-negative",
    ),
    pytest.param(
        _forward_target_past_vocab,
        ValueError,
        r"MEVO.forward: target 5 is out of bounds: class indices must be in \[0, 5\)",
        id="target-past-vocab",
    ),
    pytest.param(
        _forward_float_target,
        TypeError,
        r"MEVO.forward: target must hold integer class indices \(int64 or int32\), got dtype torch.float32",
        id="target-dtype",
    ),
    pytest.param(
        _forward_uint8_target,
        TypeError,
        r"MEVO.forward: target must hold integer class indices \(int64 or int32\), got dtype torch.uint8",
        id="target-uint8",
    ),
    pytest.param(
        _baseline_fp32_input_fp16_weight,
        TypeError,
        r"BaselineSoftmax.forward: input must be fp16 when the weight is fp16, got torch.float32",
        id="baseline-fp16",
    ),
]


@pytest.mark.parametrize("call, error, match", CASES)
def test_mevo_rejects(call: Callable[[], None], error: Type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        call()
    assert isinstance(info.value, AssertionError), "code written for upstream catches AssertionError"


def test_input_without_grad_is_fine_under_no_grad() -> None:
    """The requires-grad check applies only while autograd is enabled (as upstream's assert did)."""
    x, w, y = _data()
    with torch.no_grad():
        loss = MEVO(w)(x.detach(), y)
    assert torch.isfinite(loss)
