# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Private machinery of :class:`fairscale.optim.AdaScale`: argument checks, gradient hooks, statistics."""
