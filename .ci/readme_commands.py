#!/usr/bin/env python3
# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Print set-up command N of README.md, exactly as a user would copy it (the README is their single source).

The README's "## Set-up" section has one ```bash block of numbered comments, each followed by its command line:

    # 1. install and run the main job ...
    pip install ... && python benchmarks/fsdp.py

Usage: ``python .ci/readme_commands.py N`` prints command N; ``--count`` prints how many there are. Exits non-zero
when the README does not have that shape, so that CI fails instead of running something else.
"""

import os
import re
import sys
from typing import List

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def setup_commands(text: str) -> List[str]:
    """The command lines of the README's set-up block, in order (numbered ``# N.`` comments before each)."""
    section = re.search(r"^## Set-up\n(.*?)(?=^## )", text, re.S | re.M)
    if section is None:
        raise SystemExit("README.md has no '## Set-up' section")
    block = re.search(r"^```bash\n(.*?)^```", section.group(1), re.S | re.M)
    if block is None:
        raise SystemExit("README.md's set-up section has no ```bash block")
    commands: List[str] = []
    expected = 1
    lines = block.group(1).splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"# {expected}\. ", line):
            command = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if not command or command.startswith("#"):
                raise SystemExit(f"README.md: set-up step {expected} has no command line after its comment")
            commands.append(command)
            expected += 1
    if not commands:
        raise SystemExit("README.md's set-up block has no '# 1.' step")
    return commands


def main(argv: List[str]) -> int:
    with open(README) as f:
        commands = setup_commands(f.read())
    if argv == ["--count"]:
        print(len(commands))
        return 0
    if len(argv) != 1 or not argv[0].isdigit() or not 1 <= int(argv[0]) <= len(commands):
        print(f"usage: readme_commands.py N (1..{len(commands)}) | --count", file=sys.stderr)
        return 2
    print(commands[int(argv[0]) - 1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
