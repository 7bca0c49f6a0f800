# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Track upstream fairscale's public API: dump a surface, compare two, check this checkout (docs/maintaining.rst)."""
