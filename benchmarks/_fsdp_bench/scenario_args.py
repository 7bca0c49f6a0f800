# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""How the main job hands a command line to a scenario that lives in its own module (oss, tp, pipe, overlap)."""

from typing import List, Optional, Sequence, Tuple


def split_scenario_args(argv: Sequence[str], scenario: str) -> Tuple[Optional[List[str]], Optional[List[str]]]:
    """Split the main job's command line: ``(argv for the rest of the job or None, argv for ``scenario`` or None)``.

    ``--scenario`` values are read up to the next option (comma-separated values allowed); ``scenario`` is removed
    from them. The scenario gets the rest of the command line, since model, world and step options are shared. The
    rest of the job gets nothing (``None``) when ``scenario`` was the only value.
    """
    args = list(argv)
    if "--scenario" not in args:
        return args, None
    start = args.index("--scenario") + 1
    end = start
    while end < len(args) and not args[end].startswith("--"):
        end += 1
    values = [v for chunk in args[start:end] for v in chunk.split(",") if v]
    if scenario not in values:
        return args, None
    others = [v for v in values if v != scenario]
    shared = args[: start - 1] + args[end:]
    return (shared + ["--scenario"] + others if others else None), shared
