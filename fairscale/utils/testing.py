# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Upstream's test helpers under their name before fairscale 0.4.7 (now ``fairscale.fair_dev.testing.testing``).

``DummyProcessGroup`` is importable without pytest, because fairseq and metaseq use it to train on one process.
Every other name is ``fairscale.fair_dev.testing.testing``'s own object, imported (with pytest) on first use; without
pytest such a name is missing (``AttributeError``, so ``hasattr`` and ``getattr(..., default)`` work as usual).
"""

import typing as _typing
from types import ModuleType as _ModuleType

from fairscale.internal.dummy_process_group import DummyProcessGroup as DummyProcessGroup


def _helpers() -> _typing.Optional[_ModuleType]:
    """``fairscale.fair_dev.testing.testing``, or ``None`` where it cannot be imported (no pytest)."""
    try:
        from fairscale.fair_dev.testing import testing
    except ImportError:
        return None
    return testing


def __getattr__(name: str) -> _typing.Any:
    if name == "__all__":
        # `from fairscale.utils.testing import *`: what the helpers module would give, or what works without pytest.
        helpers = _helpers()
        public = [n for n in dir(helpers) if not n.startswith("_")] if helpers is not None else []
        return sorted(set(public) | {"DummyProcessGroup"})
    if name.startswith("__"):
        # The import system asks for __path__ and the like on every `from ... import`: not a helper's name.
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    helpers = _helpers()
    if helpers is None:
        raise AttributeError(
            f"module {__name__!r} has no attribute {name!r} here: fairscale's test helpers need pytest "
            "(pip install pytest); only DummyProcessGroup works without it"
        )
    try:
        return getattr(helpers, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> _typing.List[str]:
    return sorted(set(globals()) | set(__getattr__("__all__")))
