# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""fairscale.internal.agreement: ranks that differ raise the same error on every rank, never hang."""

from typing import Optional

import pytest
import torch

from fairscale.fair_dev.testing import run_distributed
from fairscale.internal.agreement import RanksDisagreeError, check_outcome_agrees, check_ranks_agree, describe_tensors


def _agree_body(rank: int, world_size: int, differ_on: Optional[int]) -> str:
    value = describe_tensors([("w", torch.zeros(3 if rank == differ_on else 2))])
    try:
        check_ranks_agree("the parameters", value, hint="Build the same model on every rank.")
    except RanksDisagreeError as e:
        assert isinstance(e, AssertionError) and isinstance(e, ValueError)
        return str(e)
    return "ok"


def test_equal_values_pass() -> None:
    assert run_distributed(_agree_body, 2, None) == ["ok", "ok"]


def test_different_values_raise_same_error_on_every_rank() -> None:
    messages = run_distributed(_agree_body, 2, 1)
    assert messages[0] == messages[1]
    assert "global rank 1" in messages[0] and "(3,)" in messages[0] and "(2,)" in messages[0]
    assert "Build the same model on every rank." in messages[0]


def _outcome_body(rank: int, world_size: int) -> str:
    error = KeyError("boom") if rank == 1 else None
    try:
        check_outcome_agrees("the step", error)
    except KeyError:
        return "own"
    except RuntimeError as e:
        return str(e)
    return "ok"


def test_failure_on_one_rank_fails_every_rank() -> None:
    results = run_distributed(_outcome_body, 2)
    assert results[1] == "own"
    assert "the step failed on global rank 1" in results[0] and "KeyError" in results[0]


def test_world_size_one_without_distributed() -> None:
    check_ranks_agree("x", [1, 2])
    with pytest.raises(KeyError):
        check_outcome_agrees("x", KeyError("k"))
