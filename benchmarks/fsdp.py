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

if __name__ == "__main__":
    sys.exit(main())
