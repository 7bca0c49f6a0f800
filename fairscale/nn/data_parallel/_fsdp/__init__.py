# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Private machinery of FullyShardedDataParallel, one concept per module (see docs/architecture)."""
