# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Checks of user input that must hold in every mode: layers built before ``initialize_model_parallel``, and a
sample of MoE / model-parallel / OffloadModel / wgit checks run under ``python -O`` (which strips bare asserts).

Before these checks were explicit raises, a model-parallel layer built before ``initialize_model_parallel`` under
``python -O`` asked ``torch.distributed`` for the size of group ``None``, i.e. the whole world, and silently
sharded its weight over every rank; ``top2gating`` and ``MOELayer`` accepted input they cannot route.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

import pytest

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.model_parallel import initialize as mpu
from fairscale.nn.model_parallel import layers

REPO_ROOT = Path(__file__).resolve().parents[3]


def _layers_before_initialize_body(rank: int, world_size: int) -> List[str]:
    """Every parallel layer and getter refuses to run before the groups exist, saying what to call."""
    messages = []
    builders = [
        lambda: layers.ColumnParallelLinear(4, 4),
        lambda: layers.RowParallelLinear(4, 4),
        lambda: layers.VocabParallelEmbedding(4, 4),
        lambda: layers.ParallelEmbedding(4, 4),
        mpu.get_model_parallel_world_size,
        mpu.get_data_parallel_rank,
        mpu.get_pipeline_parallel_ranks,
    ]
    for build in builders:
        with pytest.raises(AssertionError) as info:
            build()
        assert isinstance(info.value, RuntimeError), type(info.value)
        messages.append(str(info.value))
    return messages


def test_layers_before_initialize_model_parallel_raise() -> None:
    for messages in run_distributed(_layers_before_initialize_body, 2, timeout=60):
        for message in messages:
            # Upstream's leading text, then what to do.
            assert "parallel group is not initialized" in message, message
            assert "call fairscale.nn.model_parallel.initialize_model_parallel(" in message, message


# Runs in a fresh interpreter under -O: every case must still raise an AssertionError (or the named type).
_OPTIMIZED_SAMPLE = textwrap.dedent("""
    import json, os, sys, tempfile
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    assert sys.flags.optimize, "run me with python -O"  # stripped under -O: the check below is the real one
    if not sys.flags.optimize:
        raise SystemExit("not running under -O")

    results = {}

    def case(name, fn):
        try:
            fn()
        except Exception as e:
            results[name] = [type(e).__name__, isinstance(e, AssertionError), str(e)]
        else:
            results[name] = None

    from fairscale.nn.model_parallel import initialize as mpu
    from fairscale.nn.model_parallel import layers, utils
    from fairscale.nn.moe import MOELayer, Top2Gate
    from fairscale.nn.moe.top2gate import one_hot, top2gating

    case("initialize_without_process_group", lambda: mpu.initialize_model_parallel(1))
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    case("top2gating_tokens_not_multiple", lambda: top2gating(torch.randn(6, 4)))
    case("top2gating_no_tokens", lambda: top2gating(torch.randn(0, 4)))
    case("top2gating_1d_logits", lambda: top2gating(torch.randn(8)))
    case("one_hot_no_classes", lambda: one_hot(torch.tensor([0]), 0))
    moe = MOELayer(Top2Gate(4, 1), nn.Identity())
    case("moe_two_inputs", lambda: moe(torch.randn(2, 2, 4), torch.randn(2, 2, 4)))
    case("moe_2d_input", lambda: moe(torch.randn(4, 4)))
    moe2 = MOELayer(Top2Gate(4, 2), nn.ModuleList([nn.Identity(), nn.Identity()]))
    case("moe_first_dim_not_multiple_of_local_experts", lambda: moe2(torch.randn(3, 2, 4)))
    case("column_parallel_before_initialize", lambda: layers.ColumnParallelLinear(4, 4))
    case("vocab_parallel_before_initialize", lambda: layers.VocabParallelEmbedding(4, 4))
    case("get_model_parallel_group_before_initialize", mpu.get_model_parallel_group)
    case("ensure_divisibility", lambda: utils.ensure_divisibility(7, 2))
    mpu.initialize_model_parallel(1)
    case("initialize_twice", lambda: mpu.initialize_model_parallel(1))
    mpu.destroy_model_parallel()

    from fairscale.experimental.nn.offload import OffloadModel

    seq = lambda: nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    case("offload_zero_slices", lambda: OffloadModel(seq(), torch.device("cpu"), num_slices=0))
    case("offload_zero_microbatches", lambda: OffloadModel(seq(), torch.device("cpu"), num_microbatches=0))

    from pathlib import Path
    from fairscale.experimental.wgit.sha1_store import SHA1_Store

    root = Path(tempfile.mkdtemp())
    case("sha1_store_missing", lambda: SHA1_Store(root / "missing"))
    store = SHA1_Store(root / "store", init=True)
    case("sha1_store_bad_key", lambda: store.get("../../" + "0" * 34))
    case("sha1_store_bad_input", lambda: store.add(3))

    from fairscale.experimental.wgit.signal_sparsity import random_sparse_mask
    from fairscale.experimental.wgit.signal_sparsity_profiling import EnergyConcentrationProfile

    case("random_sparse_mask_percent", lambda: random_sparse_mask(torch.ones(4), 0, 0))
    case("energy_profile_not_increasing", lambda: EnergyConcentrationProfile(0, [50, 10]))
    case("energy_profile_integer_tensor", lambda: EnergyConcentrationProfile(0, [50]).measure(torch.ones(3).long()))

    json.dump(results, sys.stdout)
    dist.destroy_process_group()
    """)

# Cases that upstream asserted on: an AssertionError (subclass) here too. The others name their own type.
_EXPECTED: Dict[str, str] = {
    "initialize_without_process_group": "torch.distributed must be initialized",
    "top2gating_tokens_not_multiple": "must be a multiple of the number of experts",
    "top2gating_no_tokens": "0 tokens",
    "top2gating_1d_logits": "must be a 2-D",
    "one_hot_no_classes": "num_classes must be a positive integer",
    "moe_two_inputs": "only single input Tensor supported",
    "moe_2d_input": "input Tensor must have dimensions",
    "moe_first_dim_not_multiple_of_local_experts": "num tokens must be order of number of local experts",
    "column_parallel_before_initialize": "call fairscale.nn.model_parallel.initialize_model_parallel(",
    "vocab_parallel_before_initialize": "call fairscale.nn.model_parallel.initialize_model_parallel(",
    "get_model_parallel_group_before_initialize": "model parallel group is not initialized",
    "ensure_divisibility": "7 is not divisible by 2",
    "initialize_twice": "data parallel group is already initialized",
    "random_sparse_mask_percent": "percent must be in (0, 100]",
    "energy_profile_not_increasing": "strictly increasing",
    "energy_profile_integer_tensor": "floating point",
    "sha1_store_missing": "missing",
    "sha1_store_bad_input": "incorrect input",
}
_NOT_ASSERTIONS = {
    "offload_zero_slices": ("ValueError", "num_slices"),
    "offload_zero_microbatches": ("ValueError", "num_microbatches"),
    "sha1_store_bad_key": ("ValueError", "not a SHA1"),
}


@pytest.mark.skip_under_python_O
def test_checks_hold_under_python_O(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = tmp_path / "sample.py"
    script.write_text(_OPTIMIZED_SAMPLE)
    done = subprocess.run(
        [sys.executable, "-O", str(script)], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for name, text in _EXPECTED.items():
        assert results[name] is not None, f"{name}: no error under python -O"
        kind, is_assertion, message = results[name]
        assert is_assertion, f"{name}: {kind} is not an AssertionError: {message}"
        assert text in message, f"{name}: {message!r} does not say {text!r}"
    for name, (kind_expected, text) in _NOT_ASSERTIONS.items():
        assert results[name] is not None, f"{name}: no error under python -O"
        kind, _, message = results[name]
        assert kind_expected in kind and text in message, f"{name}: {kind}: {message}"


def _stride_and_fraction_body(rank: int, world_size: int) -> List[str]:
    messages = []
    with pytest.raises(ValueError, match=r"whole number >= 1, got 1\.5"):
        mpu.initialize_model_parallel(1.5)  # was truncated to 1, silently
    mpu.initialize_model_parallel(2.0)  # an integral float, as upstream accepted
    try:
        with pytest.raises(ValueError, match=r"must be a multiple of the stride \(3\)") as info:
            layers.ColumnParallelLinear(8, 4, stride=3)  # the message named the world size (2) as the divisor
        messages.append(str(info.value))
        for bad in (0, -1):  # were ZeroDivisionError and torch's "split expects split_size be non-negative"
            with pytest.raises(ValueError, match="stride must be a positive int"):
                layers.RowParallelLinear(8, 4, stride=bad)
        assert layers.ColumnParallelLinear(8, 4, stride=2).weight.shape == (2, 8)
    finally:
        mpu.destroy_model_parallel()
    return messages


def test_stride_and_fractional_model_parallel_size_are_refused_clearly() -> None:
    assert run_distributed(_stride_and_fraction_body, 2, timeout=60)[0]


def _pipeline_length_and_stride_at_size_one_body(rank: int, world_size: int) -> List[str]:
    messages = []
    # A float failed in a reshape and a string in a comparison, with Python's words naming neither (upstream the same).
    for bad in (1.5, "2", 0, True):
        with pytest.raises(ValueError, match=f"pipeline_length must be a whole number >= 1, got {bad!r}"):
            mpu.initialize_model_parallel(1, pipeline_length=bad)
    mpu.initialize_model_parallel(1, pipeline_length=2.0)  # an integral float, as model_parallel_size_ takes it
    try:
        assert mpu.get_pipeline_parallel_group() is not None and len(mpu.get_pipeline_parallel_ranks()) == 2
        # At model-parallel size 1 the stride was not checked, and get_master_weight() failed with torch's words.
        for bad in (0, 2.5):
            with pytest.raises(ValueError, match="stride must be a positive int") as info:
                layers.ColumnParallelLinear(4, 8, stride=bad)
            messages.append(str(info.value))
        assert layers.ColumnParallelLinear(4, 8, stride=2).get_master_weight().shape == (8, 4)
    finally:
        mpu.destroy_model_parallel()
    return messages


def test_pipeline_length_and_stride_at_size_one_are_refused_clearly() -> None:
    assert run_distributed(_pipeline_length_and_stride_at_size_one_body, 2, timeout=60)[0]
