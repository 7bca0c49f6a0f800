# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Suite-wide pytest settings.

* A default per-test timeout, so that no hang can stall a CI run.
* The pytest process itself stays off the GPU: ``FAIRSCALE_CPU_ONLY=1`` (unless set otherwise) makes fairscale's
  device layer ignore accelerators here, so in-process tests run on CPU exactly as in CPU-only CI, and no test
  creates a CUDA context in this process (after which a forked rank could not be trusted, and every CPU world would
  have to be spawned). GPU code runs in CUDA worlds (``run_distributed(..., device="cuda")``), whose ranks drop
  the flag. A test that initialises CUDA here anyway fails, naming itself. ``FAIRSCALE_CPU_ONLY=0`` opts out
  (in-process tests then use the GPU, and the CPU worlds after the first CUDA use are spawned).
"""

import os
import re
import sys
from typing import Iterator, List

import pytest
import torch

from fairscale.internal.device import CPU_ONLY_ENV

os.environ.setdefault(CPU_ONLY_ENV, "1")

# Forked ranks inherit this process's imports. The first optimizer built in a process imports torch._dynamo (about
# 2.5 s of CPU, far more on a loaded machine); importing it once here saves that in every rank of every forked world.
import torch._dynamo  # noqa: E402,F401

# FAIRSCALE_CPU_ONLY=0 lets in-process tests use the GPU (.ci/cuda-checks' first step); CPU worlds then start from
# the fork server (or spawn, once this process created a CUDA context).
_PARENT_OFF_GPU = os.environ[CPU_ONLY_ENV] not in ("", "0")

# Generous on purpose: it only has to turn a hang outside the multi-process engine (which has its own
# per-world timeout) into a failure. A test's own @pytest.mark.timeout or --timeout wins.
DEFAULT_TEST_TIMEOUT_S = 900


# FAIRSCALE_ACCELERATOR_TESTS_ONLY=1 keeps only the tests that need a GPU to run fully (.ci/cuda-checks' first step):
# by name, or by a skip condition whose reason names CUDA, a GPU or an accelerator.
ACCELERATOR_TESTS_ONLY_ENV = "FAIRSCALE_ACCELERATOR_TESTS_ONLY"
_ACCELERATOR_WORDS = re.compile(r"cuda|gpu|accelerator|offload_to_cpu_frees|as_current", re.IGNORECASE)


def _needs_accelerator(item: pytest.Item) -> bool:
    if _ACCELERATOR_WORDS.search(item.nodeid):
        return True
    return any(_ACCELERATOR_WORDS.search(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    if sys.flags.optimize:
        # CI reruns the tests of errors under python -O to prove that no check of user input is an assert. Tests
        # marked skip_under_python_O check none (and cost minutes): the first run covers them.
        skip = pytest.mark.skip(reason="checks no user input; covered by the run without -O")
        for item in items:
            if item.get_closest_marker("skip_under_python_O") is not None:
                item.add_marker(skip)
    if os.environ.get(ACCELERATOR_TESTS_ONLY_ENV, "") not in ("", "0"):
        kept = [item for item in items if _needs_accelerator(item)]
        config.hook.pytest_deselected(items=[item for item in items if not _needs_accelerator(item)])
        items[:] = kept
    if not config.pluginmanager.hasplugin("timeout"):
        return
    if config.getoption("timeout", None) is not None or config.getini("timeout"):
        return
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TEST_TIMEOUT_S))


@pytest.fixture(autouse=True)
def _no_cuda_context_in_the_pytest_process(request: pytest.FixtureRequest) -> Iterator[None]:
    before = torch.cuda.is_initialized()  # a flag read: initialises nothing
    yield
    if _PARENT_OFF_GPU and not before and torch.cuda.is_initialized():
        pytest.fail(
            f"{request.node.nodeid} initialised CUDA in the pytest process; run its CUDA part in a CUDA world "
            f"(run_distributed(body, 1, device='cuda')) so that later tests can still fork their CPU worlds",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def torch_sees_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every in-process test: hide the GPU from torch itself while this process stays off it.

    FAIRSCALE_CPU_ONLY reaches fairscale's device layer, not torch, and torch creates a CUDA context on its own
    wherever a GPU is visible: the compiler saves the CUDA generator's state, and from torch 2.13 the step of most
    optimizers (Adam, AdamW, RMSprop, ...) asks for the accelerator's current stream
    (``Optimizer._cuda_graph_capture_health_check``), on CPU parameters too, so an in-process test that stepped one
    failed next to a GPU. Both of torch's answers
    are hidden (``torch.cuda`` and, where it exists, ``torch.accelerator``); the test engine counts devices with
    ``device_count()`` (NVML), which stays true, so CUDA worlds and the fork server still start. Tests may still
    name the fixture (it is a no-op where ``FAIRSCALE_CPU_ONLY=0``).
    """
    if _PARENT_OFF_GPU:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "is_available"):
            monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)


# torch's own gaps, not fairscale's: torch 2.1 has no fp16 matrix multiply on the CPU, and torch 2.1 and 2.2 no fp16
# layer norm there. A test whose every failure is one of this torch's missing kernels (an fp16 case of a parity
# matrix, an fp16 model on the CPU) is reported as skipped; a test that also fails otherwise stays failed, and on a
# torch with the kernels nothing changes.
_CPU_HALF_KERNELS = {
    "addmm_impl_cpu_": lambda x: x @ x,
    "LayerNormKernelImpl": lambda x: torch.nn.functional.layer_norm(x, (2,)),
}
_missing_cpu_half_kernels: List[List[str]] = []


def missing_cpu_half_kernels() -> List[str]:
    """The errors of this torch's missing CPU fp16 kernels (``"addmm_impl_cpu_" not implemented for 'Half'``)."""
    if not _missing_cpu_half_kernels:
        missing = []
        for name, run in _CPU_HALF_KERNELS.items():
            try:
                run(torch.ones(2, 2, dtype=torch.float16))
            except RuntimeError:
                missing.append(f"\"{name}\" not implemented for 'Half'")
        _missing_cpu_half_kernels.append(missing)
    return _missing_cpu_half_kernels[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    missing = missing_cpu_half_kernels()
    if report.when != "call" or not report.failed or not missing:
        return
    text = str(report.longrepr)
    error_lines = [line for line in text.splitlines() if re.search(r"\b\w*(Error|Exception)\b: ", line)]
    seen = {error for error in missing if any(error in line for line in error_lines)}
    if seen and all(any(error in line for error in seen) or "cases failed" in line for line in error_lines):
        report.outcome = "skipped"
        report.longrepr = (
            str(item.path),
            item.location[1] or 0,
            f"Skipped: torch {torch.__version__} " + "; ".join(sorted(seen)),
        )
