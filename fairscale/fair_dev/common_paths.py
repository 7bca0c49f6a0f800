# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Where tests cache downloaded datasets (a path relative to the working directory)."""

DATASET_CACHE_ROOT = "cached_datasets"
