# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``python -m fairscale.experimental.wgit``."""

from .cli import main

if __name__ == "__main__":
    main()
