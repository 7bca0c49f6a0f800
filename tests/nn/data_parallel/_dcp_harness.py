# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The frame of the DCP checkpoint tests: ``test_fsdp_dcp.py``, ``test_fsdp_dcp_hybrid.py`` and
``tests/optim/test_oss_dcp.py``.

Each of them trains a reference world that saves a DCP checkpoint into a module-scoped directory and goes on
uninterrupted (:class:`Saved` records both); every other world resumes from that checkpoint and compares, bit-exactly
where the math is the same as the reference's (:func:`assert_same`, :func:`assert_same_optim`) and to rounding where
the gradients sum in another order (:func:`assert_close`). The cases of one world run as named subtests
(:func:`run_named_cases`), so one failing case does not hide the others and the world starts once.
"""

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Sequence

import torch
from torch import Tensor

from fairscale.fair_dev.testing.engine import run_cases

CASE_PREFIX = "_case_"


@dataclass
class Saved:
    """The reference run of a test module: its checkpoint directory and the full states it recorded."""

    root: str
    model: Dict[str, Any]  # the model at the checkpoint (full tensors by name; OSS: per optimizer kind)
    optim: Dict[str, Any]  # the optimizer state at the checkpoint, by parameter name, with each name's group
    after: Dict[str, Any]  # the model after the uninterrupted run

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)


def assert_same(actual: Dict[str, Tensor], expected: Dict[str, Tensor], what: str) -> None:
    """Same keys, bit-identical values."""
    assert sorted(actual) == sorted(expected), f"{what}: keys {sorted(actual)} != {sorted(expected)}"
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, f"{what}: {key} dtype {actual[key].dtype} != {value.dtype}"
        assert torch.equal(actual[key], value), f"{what}: {key} differs by {(actual[key] - value).abs().max()}"


def assert_close(actual: Dict[str, Tensor], expected: Dict[str, Tensor], what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: keys differ"
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {key}: {m}")


def assert_same_optim(actual: Dict[str, Any], expected: Dict[str, Any], what: str) -> None:
    """``{name: {key: value}}`` optimizer states: same names and keys, bit-identical tensors, equal other values."""
    assert sorted(actual) == sorted(expected), f"{what}: parameters {sorted(actual)} != {sorted(expected)}"
    for name, entry in expected.items():
        assert sorted(actual[name]) == sorted(entry), f"{what}: {name} keys {sorted(actual[name])} != {sorted(entry)}"
        for key, value in entry.items():
            got = actual[name][key]
            same = torch.equal(got, value) if isinstance(value, Tensor) else got == value
            assert same, f"{what}: {name}[{key!r}] = {got} != {value}"


def run_named_cases(cases: Sequence[Callable[..., None]], *args: Any) -> None:
    """Run every ``_case_<name>(*args)`` of ``cases`` as the subtest ``<name>`` (see ``run_cases``)."""
    for case in cases:
        assert case.__name__.startswith(CASE_PREFIX), case.__name__  # the subtest name is the rest of it
    run_cases([(case.__name__[len(CASE_PREFIX) :], functools.partial(case, *args)) for case in cases])
