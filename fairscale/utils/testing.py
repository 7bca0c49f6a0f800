# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Upstream's test helpers under their name before fairscale 0.4.7 (now ``fairscale.fair_dev.testing.testing``).

``DummyProcessGroup`` is importable without pytest, because fairseq and metaseq use it to train on one process.
Every other name is ``fairscale.fair_dev.testing.testing``'s own object, imported (with pytest) on first use.
"""

from typing import Any

from fairscale.internal.dummy_process_group import DummyProcessGroup as DummyProcessGroup


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        # The import system asks for __path__ and the like on every `from ... import`: not a helper's name.
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # Imported here, not above: it needs pytest, which a training job need not have.
    from fairscale.fair_dev.testing import testing

    try:
        return getattr(testing, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
