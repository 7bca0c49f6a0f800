# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Developer tooling (not public API): test helpers and the multi-process test engine."""
