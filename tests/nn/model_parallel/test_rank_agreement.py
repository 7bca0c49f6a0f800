# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The parallel layers' first-forward check: ranks of a model-parallel group that built a layer with other arguments,
or call it with an input of another shape, all raise the same ``RanksDisagreeError`` naming what differs.

Without the check, another ``in_features`` on one rank returned an output of the right shape and wrong values on
every rank, another ``out_features`` or ``gather_output`` aborted one rank's process inside gloo (the peer returned
or raised on its own), and another batch size gave garbage on the surviving rank. The check costs one object gather
per layer, at its first forward, over the model-parallel group only (none at model-parallel size 1).
"""

import functools
from typing import Callable, Dict, List, Tuple

import pytest
import torch

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.collectives import count_collectives
from fairscale.nn.model_parallel import initialize as mpu
from fairscale.nn.model_parallel.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)


def _on(rank: int, usual: int, other: int) -> int:
    """``other`` on rank 1, ``usual`` elsewhere: the value one rank gets wrong."""
    return other if rank == 1 else usual


def _disagreeing_calls(rank: int) -> List[Tuple[str, str, Callable[[], torch.Tensor]]]:
    """``(case, what the message names, the call)``: each call differs on rank 1 in one respect."""
    x4, ids = torch.ones(2, 4), torch.tensor([[1, 2, 3]])
    return [
        (
            "column_in_features",
            "in_features",
            lambda: ColumnParallelLinear(_on(rank, 4, 6), 6)(torch.ones(2, _on(rank, 4, 6))),
        ),
        ("column_out_features", "out_features", lambda: ColumnParallelLinear(4, _on(rank, 6, 8))(x4)),
        (
            "column_gather_output",
            "gather_output",
            lambda: ColumnParallelLinear(4, 6, gather_output=rank == 0)(x4),
        ),
        ("column_bias", "bias", lambda: ColumnParallelLinear(4, 6, bias=rank == 0)(x4)),
        ("column_stride", "stride", lambda: ColumnParallelLinear(4, 8, stride=_on(rank, 1, 2))(x4)),
        ("column_batch_size", "input shape", lambda: ColumnParallelLinear(4, 6)(torch.ones(_on(rank, 2, 3), 4))),
        ("column_input_dtype", "input dtype", lambda: ColumnParallelLinear(4, 6)(x4.to(_dtype(rank)))),
        ("column_dtype", "dtype", lambda: ColumnParallelLinear(4, 6).to(_dtype(rank))(x4.to(_dtype(rank)))),
        # A first forward under no_grad on rank 1 only (an evaluation): rank 0's backward waited in its all-reduce.
        ("column_grad_mode", "input gradient", lambda: _in_grad_mode(rank != 1, ColumnParallelLinear(4, 6))),
        (
            "row_in_features",
            "in_features",
            lambda: RowParallelLinear(_on(rank, 4, 6), 6)(torch.ones(2, _on(rank, 4, 6))),
        ),
        ("row_out_features", "out_features", lambda: RowParallelLinear(4, _on(rank, 6, 8))(x4)),
        (
            "row_input_is_parallel",
            "input_is_parallel",
            lambda: RowParallelLinear(4, 6, input_is_parallel=rank == 1)(torch.ones(2, _on(rank, 4, 2))),
        ),
        (
            "row_parallel_input_batch_size",
            "input shape",
            lambda: RowParallelLinear(4, 6, input_is_parallel=True)(torch.ones(_on(rank, 2, 5), 2)),
        ),
        ("vocab_num_embeddings", "num_embeddings", lambda: VocabParallelEmbedding(_on(rank, 8, 10), 4)(ids)),
        ("vocab_embedding_dim", "embedding_dim", lambda: VocabParallelEmbedding(8, _on(rank, 4, 6))(ids)),
        ("vocab_ids_shape", "input shape", lambda: VocabParallelEmbedding(8, 4)(ids.expand(_on(rank, 1, 2), 3))),
        ("embedding_dim", "embedding_dim", lambda: ParallelEmbedding(8, _on(rank, 4, 6))(ids)),
        ("embedding_padding_idx", "padding_idx", lambda: ParallelEmbedding(8, 4, padding_idx=rank)(ids)),
        ("embedding_ids_shape", "input shape", lambda: ParallelEmbedding(8, 4)(ids[:, : _on(rank, 3, 2)])),
    ]


def _in_grad_mode(enabled: bool, layer: torch.nn.Module) -> torch.Tensor:
    with torch.set_grad_enabled(enabled):
        return layer(torch.ones(2, 4, requires_grad=True))


def _dtype(rank: int) -> torch.dtype:
    return torch.float64 if rank == 1 else torch.float32


def _expect_disagreement(call: Callable[[], torch.Tensor], messages: Dict[str, str], case: str) -> None:
    with pytest.raises(RanksDisagreeError) as info:
        call()
    messages[case] = str(info.value)


def _disagreement_body(rank: int, world_size: int) -> Dict[str, str]:
    mpu.initialize_model_parallel(world_size)
    messages: Dict[str, str] = {}
    cases = _disagreeing_calls(rank)
    # Each case raises on every rank before any tensor collective: the next one starts on a clean group.
    run_cases((case, functools.partial(_expect_disagreement, call, messages, case)) for case, _, call in cases)
    # The group still works: a layer built alike on both ranks runs.
    torch.manual_seed(0)
    out = ColumnParallelLinear(4, 6)(torch.ones(2, 4))
    assert out.shape == (2, 6), out.shape
    mpu.destroy_model_parallel()
    return messages


def test_ranks_that_disagree_raise_the_same_error() -> None:
    per_rank = run_distributed(_disagreement_body, 2, timeout=120)
    assert per_rank[0] == per_rank[1], "every rank raises the same message"
    named = {case: what for case, what, _ in _disagreeing_calls(0)}
    assert sorted(per_rank[0]) == sorted(named)
    for case, message in per_rank[0].items():
        assert f"('{named[case]}', " in message, (case, message)
        assert "global rank 1 differs from global rank 0" in message, message
        assert "the same arguments on every rank of the model-parallel group" in message, message


def _layers(p: int) -> List[torch.nn.Module]:
    """A model-parallel MLP and both embeddings, built alike on every rank (under the engine's common seed)."""
    return [
        VocabParallelEmbedding(8 * p, 4 * p),
        ParallelEmbedding(8 * p, 4 * p),
        ColumnParallelLinear(4 * p, 6 * p, gather_output=False),
        RowParallelLinear(6 * p, 4 * p, input_is_parallel=True),
        ColumnParallelLinear(4 * p, 2 * p),
    ]


def _forward(layers: List[torch.nn.Module], batch: int, seq: int) -> torch.Tensor:
    ids = torch.arange(batch * seq).reshape(batch, seq) % layers[0].num_embeddings
    h = layers[0](ids) + layers[1](ids)
    for layer in layers[2:]:
        h = layer(h)
    return h


def _collectives_body(rank: int, world_size: int) -> Dict[str, List[int]]:
    """Object gathers per forward, at model-parallel size 2 (two data-parallel replicas with their own batch size)
    and 1 (no communication at all)."""
    counts: Dict[str, List[int]] = {}
    for p in (2, 1):
        mpu.initialize_model_parallel(p)
        layers = _layers(p)
        gathers = []
        # The first forward's batch differs between the data-parallel replicas (each model-parallel group agrees);
        # later forwards change the batch size and length (KV-cache decoding): no further check.
        first_batch = 2 + mpu.get_data_parallel_rank()
        for batch, seq in ((first_batch, 5), (first_batch, 1), (1, 1)):
            with count_collectives() as counter:
                out = _forward(layers, batch, seq)
            assert out.shape == (batch, seq, 2 * p), out.shape
            gathers.append(counter.count("all_gather_object"))
            if p > 1:  # all over the model-parallel group
                assert counter.count("all_gather_object", group_size=p) == gathers[-1]
        counts[f"mp{p}"] = gathers
        mpu.destroy_model_parallel()
    return counts


def test_one_object_gather_per_layer_at_the_first_forward_only() -> None:
    for counts in run_distributed(_collectives_body, 4, timeout=120):
        assert counts == {"mp2": [5, 0, 0], "mp1": [0, 0, 0]}, counts
