# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The benchmarks' CPU ranks hide a machine's GPUs from torch itself, not only from fairscale.

From torch 2.13 an AdamW step asks for the accelerator's current stream wherever torch sees a GPU, for CPU
parameters too: ``benchmarks/fsdp.py --device cpu`` on a GPU machine opened a CUDA context in every rank.
"""

import os
import sys
from typing import Tuple

import pytest
import torch

from fairscale.internal.device import CPU_ONLY_ENV, accelerator_available, torch_sees_no_accelerator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_DIR = os.path.join(ROOT, "benchmarks")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from _fsdp_bench.config import BenchConfig  # noqa: E402
from _fsdp_bench.launch import _device  # noqa: E402
from _fsdp_bench.worlds import run_function  # noqa: E402


def _torch_answers_are_hidden() -> bool:
    hidden = torch.cuda.is_available is torch_sees_no_accelerator
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "is_available"):
        hidden = hidden and torch.accelerator.is_available is torch_sees_no_accelerator
    return hidden


def _keep_torch_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let monkeypatch put torch's answers and the environment back after a call that hides them for good."""
    monkeypatch.setattr(torch.cuda, "is_available", torch.cuda.is_available)
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "is_available"):
        monkeypatch.setattr(torch.accelerator, "is_available", torch.accelerator.is_available)
    monkeypatch.delenv(CPU_ONLY_ENV, raising=False)


def test_main_job_cpu_device_hides_devices_from_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device cpu`` (the main job's rank set-up, here in-process and undone afterwards)."""
    _keep_torch_answers(monkeypatch)
    assert _device(BenchConfig(device="cpu"), 0) == torch.device("cpu")
    assert os.environ[CPU_ONLY_ENV] == "1" and not accelerator_available()
    assert _torch_answers_are_hidden() and not torch.cuda.is_available()


def _rank_answers(rank: int, world_size: int) -> Tuple[bool, bool]:
    return _torch_answers_are_hidden(), torch.cuda.is_initialized()


def test_benchmark_cpu_worlds_hide_devices_from_torch() -> None:
    """The ranks of ``run_function``'s CPU worlds (collectives, DCP and OSS scenarios)."""
    assert run_function(_rank_answers, 2, timeout=120) == [(True, False)] * 2
