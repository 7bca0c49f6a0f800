# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Private machinery of :class:`fairscale.nn.data_parallel.ShardedDataParallel`."""
