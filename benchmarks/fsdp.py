#!/usr/bin/env python3
# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The main job: train a small GPT-style LM with this fork's FullyShardedDataParallel and its peers side by side.

Run ``python benchmarks/fsdp.py`` (2 CPU ranks, gloo, about a minute), ``--help`` for the options, or under
``torchrun --nproc-per-node N benchmarks/fsdp.py`` to use the ranks torchrun starts. See docs/benchmarks.rst.
"""

import os
import sys

# The profiler of the probe step warns about tensors allocated before it started; that is expected here.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fsdp_bench.main import main  # noqa: E402
from oss_scenario import run as run_oss_scenario  # noqa: E402
from oss_scenario import split_scenario  # noqa: E402
from tp_scenario import run as run_tp_scenario  # noqa: E402
from tp_scenario import split_scenario as split_tp_scenario  # noqa: E402
from pipe_scenario import run as run_pipe_scenario  # noqa: E402
from pipe_scenario import split_scenario as split_pipe_scenario  # noqa: E402
from overlap_scenario import run as run_overlap_scenario  # noqa: E402
from overlap_scenario import split_scenario as split_overlap_scenario  # noqa: E402

if __name__ == "__main__":
    # `--scenario oss` (OSS / ShardedDataParallel vs DDP and ZeroRedundancyOptimizer) runs in benchmarks/oss_scenario.py.
    fsdp_args, oss_args = split_scenario(sys.argv[1:])
    # `--scenario tp` (fairscale vs PyTorch tensor parallelism) runs in benchmarks/tp_scenario.py.
    fsdp_args, tp_args = split_tp_scenario(fsdp_args) if fsdp_args is not None else (None, None)
    # `--scenario pipe` (Pipe / AsyncPipe vs torch.distributed.pipelining) runs in benchmarks/pipe_scenario.py.
    fsdp_args, pipe_args = split_pipe_scenario(fsdp_args) if fsdp_args is not None else (None, None)
    # `--scenario overlap` (step time vs simulated link bandwidth, prefetch off/on, FSDP2) runs in
    # benchmarks/overlap_scenario.py.
    fsdp_args, overlap_args = split_overlap_scenario(fsdp_args) if fsdp_args is not None else (None, None)
    code = main(fsdp_args) if fsdp_args is not None else 0
    code = code or (run_oss_scenario(oss_args) if oss_args is not None else 0)
    code = code or (run_tp_scenario(tp_args) if tp_args is not None else 0)
    code = code or (run_pipe_scenario(pipe_args) if pipe_args is not None else 0)
    sys.exit(code or (run_overlap_scenario(overlap_args) if overlap_args is not None else 0))
