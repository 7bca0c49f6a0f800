# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
__version_tuple__ = (0, 0, 1)
