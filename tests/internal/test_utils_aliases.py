# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``fairscale.utils``: the helper modules under their names before 0.4.7 (fairseq's and metaseq's imports)."""

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

import fairscale.utils
from fairscale.fair_dev.testing import testing as dev_testing

# A fresh interpreter's prologue: `import pytest` fails, as on a training machine, and "pytest" stays out of
# sys.modules (fairscale, like upstream, looks there; sys.modules["pytest"] = None would put it in).
_WITHOUT_PYTEST = textwrap.dedent("""
    import sys

    class _NoPytest:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("pytest", "_pytest"):
                raise ImportError(f"{name} is not installed here")
            return None

    sys.meta_path.insert(0, _NoPytest())
""")


@pytest.mark.parametrize("old_name", sorted(fairscale.utils.MOVED_MODULES))
def test_old_name_is_the_moved_module_itself(old_name: str) -> None:
    new_name = fairscale.utils.MOVED_MODULES[old_name]
    moved = importlib.import_module(new_name)
    old = importlib.import_module(f"fairscale.utils.{old_name}")
    assert old is moved and getattr(fairscale.utils, old_name) is moved
    # The alias leaves the module's identity alone: pickles, reload() and repr keep naming the new place. (Not
    # reloaded here: that would make new classes and functions under the other tests' feet.)
    assert moved.__name__ == new_name and moved.__spec__ is not None and moved.__spec__.name == new_name


def test_package_exports_torch_version() -> None:
    from fairscale.internal.version import torch_version
    from fairscale.utils import torch_version as old

    assert old is torch_version


def test_classes_are_shared_across_the_two_names() -> None:
    from fairscale.internal.reduce_scatter_bucketer import ReduceScatterBucketer as New
    from fairscale.utils.reduce_scatter_bucketer import ReduceScatterBucketer as Old

    assert Old is New


def test_names_that_never_existed_still_fail() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fairscale.utils.no_such_module")
    with pytest.raises(ImportError):
        exec("from fairscale.utils.testing import no_such_helper", {})


def test_testing_forwards_upstream_helpers() -> None:
    from fairscale.utils import testing

    assert testing.DummyProcessGroup is dev_testing.DummyProcessGroup
    assert testing.dist_init is dev_testing.dist_init and testing.objects_are_equal is dev_testing.objects_are_equal


_WITHOUT_PYTEST_CHECKS = textwrap.dedent("""
    import importlib
    import fairscale.utils
    from fairscale.utils.testing import DummyProcessGroup
    assert DummyProcessGroup(rank=0, size=1).size() == 1
    assert "fairscale.fair_dev.testing.engine" not in sys.modules
    from fairscale.utils import testing
    # A helper needs pytest: missing, the way hasattr/getattr(default) expect, with a message that says why.
    assert not hasattr(testing, "dist_init") and getattr(testing, "dist_init", None) is None
    try:
        testing.dist_init
    except AttributeError as e:
        assert "need pytest" in str(e), e
    try:
        from fairscale.utils.testing import dist_init
    except ImportError:
        pass  # the import system words it ("cannot import name"); getattr gives the reason
    else:
        raise AssertionError("dist_init imported without pytest")
    namespace = {}
    exec("from fairscale.utils.testing import *", namespace)
    assert [n for n in namespace if not n.startswith("__")] == ["DummyProcessGroup"], sorted(namespace)
    import fairscale.fair_dev.testing as dev
    assert not hasattr(dev, "run_distributed") and "run_distributed" in dir(dev)
    # The package's other old modules need no pytest either, and are attributes of the package on first use.
    import fairscale.utils.golden_testing_data
    assert fairscale.utils.containers is importlib.import_module("fairscale.internal.containers")
    finders = len(sys.meta_path)
    importlib.reload(fairscale.utils)
    assert len(sys.meta_path) == finders, "a reload added a second finder"
    print("ok")
""")


def test_without_pytest() -> None:
    # metaseq imports DummyProcessGroup inside the try that decides whether FSDP is available: without pytest (a
    # training machine) the import must still work, and must not drag in the test tooling.
    code = _WITHOUT_PYTEST + _WITHOUT_PYTEST_CHECKS
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_star_import_and_dir_with_pytest() -> None:
    namespace: Dict[str, Any] = {}
    exec("from fairscale.utils.testing import *", namespace)
    assert namespace["DummyProcessGroup"] is dev_testing.DummyProcessGroup
    assert namespace["dist_init"] is dev_testing.dist_init
    from fairscale.utils import testing

    assert {"DummyProcessGroup", "dist_init", "objects_are_equal"} <= set(dir(testing))


# fairseq's fsdp_enable_wrap on one process without torch.distributed: process_group=DummyProcessGroup(0, 1), and the
# default process_group_reduce_scatter (which asked torch.distributed for a group, upstream as well). Source text, so
# that it runs the same here (unwrapped, the reference) and in a fresh interpreter without pytest (wrapped).
_ONE_PROCESS_TRAINING = textwrap.dedent("""
    import torch
    from torch import nn
    from fairscale.nn import FullyShardedDataParallel as FSDP
    from fairscale.utils.testing import DummyProcessGroup

    def one_process_training(wrap):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        if wrap:
            model = FSDP(model, process_group=DummyProcessGroup(rank=0, size=1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
        assert not torch.distributed.is_initialized()
        return {k: v.clone() for k, v in model.state_dict().items()}
""")


def test_fsdp_on_one_process_with_the_dummy_group_trains_as_the_plain_model(tmp_path: Path) -> None:
    # In a fresh interpreter without pytest: fairscale (as upstream) returns no reduce-scatter group when
    # torch.distributed is off and pytest is imported, so a run inside pytest would not see the failure.
    code = (
        _WITHOUT_PYTEST
        + _ONE_PROCESS_TRAINING
        + f"torch.save(one_process_training(True), {str(tmp_path / 'fsdp.pt')!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    wrapped = torch.load(tmp_path / "fsdp.pt")
    namespace: Dict[str, Any] = {}
    exec(_ONE_PROCESS_TRAINING, namespace)
    plain = namespace["one_process_training"](False)
    assert wrapped.keys() == plain.keys()
    for key, value in plain.items():
        torch.testing.assert_close(wrapped[key], value)
