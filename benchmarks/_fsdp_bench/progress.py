# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A dependency-free progress bar for rank 0: redrawn in place on a terminal, one line per run otherwise."""

import sys
from typing import TextIO


class ProgressBar:
    """Progress of one run's steps: ``label [#####-----] 5/10 loss 4.123 step 87.1 ms``.

    Args:
        label: the run's name.
        stream: where to draw (default stdout).
        width: characters of the bar.
    """

    def __init__(self, label: str, stream: TextIO = sys.stdout, width: int = 24) -> None:
        self.label = label
        self.stream = stream
        self.width = width
        self.live = stream.isatty()

    def __call__(self, done: int, total: int, loss: float, step_s: float) -> None:
        if not self.live and done < total:
            return
        filled = int(self.width * done / max(total, 1))
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"{self.label:<30.30} [{bar}] {done:>3}/{total} loss {loss:7.4f} step {step_s * 1e3:8.1f} ms"
        end = "\n" if done >= total else ""
        self.stream.write(("\r" if self.live else "") + line + end)
        self.stream.flush()


def silent(done: int, total: int, loss: float, step_s: float) -> None:
    """The progress callback of ranks other than 0."""
