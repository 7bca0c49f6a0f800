# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Model-parallel layers under PyTorch's collective checker (``TORCH_DISTRIBUTED_DEBUG=DETAIL``).

The ranks of a model-parallel group exchange activations in every forward and backward, so they must pass batches of
the same shape and dtype. The layers compare the input's shape at their first forward only (later forwards would
cost a collective per layer, tests/nn/model_parallel/test_rank_agreement.py): ranks with other batch sizes at a
later step abort gloo ("Received data size doesn't match expected size", SIGABRT), or hang in the cross entropy's
all-reduce. docs/model_parallel.rst sends users to the checker to find such a rank; these worlds prove that the
layers and the cross entropy train under it unchanged (same losses as without it) and that other batch sizes are
then an error on every rank.
"""

import atexit
import functools
import os
from typing import Any, List

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import init_gloo_world, run_ranks
from fairscale.nn.model_parallel import initialize as mpu
from fairscale.nn.model_parallel.cross_entropy import vocab_parallel_cross_entropy
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear

WORLD, TIMEOUT, STEPS, VOCAB = 2, 90.0, 3, 10


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        ColumnParallelLinear(6, 8, gather_output=False),
        nn.Tanh(),
        RowParallelLinear(8, 6, input_is_parallel=True),
        ColumnParallelLinear(6, VOCAB, gather_output=False),  # vocab-parallel logits
    )


def _loss(model: nn.Module, batch: int, step: int) -> Tensor:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(batch, 6, generator=generator)
    target = torch.randint(0, VOCAB, (batch,), generator=generator)
    return vocab_parallel_cross_entropy(model(x), target).mean()


def _train_body(directory: str, detail: bool, rank: int) -> List[float]:
    init_gloo_world(directory, rank, WORLD, dist.DebugLevel.DETAIL if detail else dist.DebugLevel.OFF)
    mpu.initialize_model_parallel(WORLD)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, 4, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_layers_and_cross_entropy_train_unchanged_under_the_checker(tmp_path: Any) -> None:
    checked = run_ranks(functools.partial(_train_body, str(tmp_path / "on"), True), WORLD, timeout=TIMEOUT)
    plain = run_ranks(functools.partial(_train_body, str(tmp_path / "off"), False), WORLD, timeout=TIMEOUT)
    assert checked == plain  # the same collectives, only checked first: bit-identical on the same machine
    assert checked[0] == checked[1]  # both ranks of the model-parallel group see the one loss


def _other_batch_sizes_body(directory: str, rank: int) -> str:
    init_gloo_world(directory, rank, WORLD, dist.DebugLevel.DETAIL)
    # A group torn down after a failed collective can abort gloo at interpreter exit: end the rank after its report.
    atexit.register(os._exit, 0)
    mpu.initialize_model_parallel(WORLD)
    model = _model()
    _loss(model, 4, 0).backward()  # the layers' own first-forward check passes
    try:
        _loss(model, 3 + rank, 1).backward()  # the uneven last batch of a data loader split per rank
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_other_batch_sizes_are_an_error_on_every_rank_under_the_checker(tmp_path: Any) -> None:
    messages = run_ranks(functools.partial(_other_batch_sizes_body, str(tmp_path)), WORLD, timeout=TIMEOUT)
    for rank, message in enumerate(messages):
        assert "Detected mismatch between collectives" in message, f"rank {rank}: {message[:500]}"
        assert "Tensor shapes" in message, f"rank {rank}: {message[:800]}"


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
