# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""fairscale.internal.agreement: ranks that differ raise the same error on every rank, never hang."""

import datetime
from typing import Optional, Tuple

import pytest
import torch
from torch.distributed.distributed_c10d import _get_default_store

from fairscale.fair_dev.testing import run_distributed
from fairscale.internal import collectives
from fairscale.internal.agreement import (
    RanksDisagreeError,
    check_outcome_agrees,
    check_ranks_agree,
    check_world_agrees_through_store,
    describe_tensors,
    first_device,
)
from fairscale.internal.errors import FairscaleRuntimeError


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


def test_first_device() -> None:
    assert first_device([]) is None
    assert first_device(["not a tensor", torch.zeros(1, device="meta"), torch.zeros(1)]) == torch.device("meta")


def _on_cpu_device_body(rank: int, world_size: int) -> str:
    check_ranks_agree("the settings", [1, 2], device="cpu")
    try:
        check_ranks_agree("the settings", [rank], device=torch.device("cpu"))
    except RanksDisagreeError as e:
        check_outcome_agrees("the step", None, device="cpu")
        return str(e)
    return "ok"


def test_device_argument_on_cpu() -> None:
    messages = run_distributed(_on_cpu_device_body, 2)
    assert messages[0] == messages[1] and "global rank 1" in messages[0]


def _cuda_current_device_zero_body(rank: int, world_size: int) -> str:
    # A process that never selected its GPU: the current device is cuda:0 on every rank, while its tensors (and its
    # NCCL communicator) are on cuda:<rank>. Without the device argument both ranks' object gather would allocate on
    # cuda:0 and NCCL would reject the duplicate GPU (or hang).
    torch.cuda.set_device(0)
    mine = torch.device("cuda", rank)
    check_ranks_agree("the settings", [1, 2], device=mine)
    check_outcome_agrees("the step", None, device=mine)
    try:
        check_ranks_agree("the settings", [rank], device=mine)
    except RanksDisagreeError as e:
        return str(e)
    return "ok"


def test_cuda_gather_uses_the_given_device_not_the_current_one() -> None:
    messages = run_distributed(_cuda_current_device_zero_body, 2, device="cuda", timeout=120.0)
    assert messages[0] == messages[1] and "global rank 1" in messages[0]


def _through_store_body(rank: int, world_size: int, differ_on: Optional[int]) -> Tuple[str, int]:
    value = [2, "gloo", None, rank == differ_on]
    with collectives.count_collectives() as counter:
        try:
            check_world_agrees_through_store("the arguments", value, hint="Pass the same.")
            outcome = "ok"
        except RanksDisagreeError as e:
            outcome = str(e)
    # No collective: the check is the same on an NCCL group whose ranks have not selected their GPUs yet.
    return outcome, counter.count()


def test_through_store_equal_values_pass_without_a_collective() -> None:
    assert run_distributed(_through_store_body, 3, None) == [("ok", 0)] * 3


def test_through_store_different_values_raise_the_same_error_on_every_rank() -> None:
    results = run_distributed(_through_store_body, 3, 2)
    assert [count for _, count in results] == [0, 0, 0]
    message = results[0][0]
    assert all(outcome == message for outcome, _ in results)
    assert "the arguments differ between ranks: global rank 2" in message and "entry 3: False vs True" in message
    assert message.endswith("Pass the same.")


def _a_rank_that_never_calls_body(rank: int, world_size: int) -> str:
    if rank == 1:
        return "did not call"
    store = _get_default_store()
    store.set_timeout(datetime.timedelta(seconds=2))
    try:
        check_world_agrees_through_store("initialize_something: the arguments", [1])
    except FairscaleRuntimeError as e:
        return str(e)
    return "no error"


def test_through_store_a_rank_that_never_calls_is_named_at_the_store_timeout() -> None:
    message = run_distributed(_a_rank_that_never_calls_body, 2)[0]
    assert message.startswith("initialize_something: the arguments: global rank 1's call did not arrive"), message
    assert "every rank of the default group must make this call" in message
