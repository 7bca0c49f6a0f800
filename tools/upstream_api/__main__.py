# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Command line: ``python -m tools.upstream_api {dump,compare,check}`` (run from the repository root).

* ``dump OUT.json``: the public surface of the fairscale this interpreter imports (from the repository
  root: this checkout).
* ``compare A.json B.json [--allowlist FILE] [--additions]``: differences of B from A; exit status 1 if a
  difference is not allowed (without ``--allowlist`` every difference counts).
* ``check``: dump this checkout and compare it with the recorded upstream snapshot and the allow-list
  (what the CI test does).
"""

import argparse
import json
import sys
import tempfile
from typing import List, Optional

from . import compare as cmp
from . import surface


def _compare(reference_path: str, candidate_path: str, allowlist: Optional[str], show_additions: bool) -> int:
    with open(reference_path) as f:
        reference = json.load(f)
    with open(candidate_path) as f:
        candidate = json.load(f)
    diffs = cmp.compare(reference, candidate)
    entries = cmp.read_allowlist(allowlist) if allowlist else []
    bad, allowed = cmp.split_allowed(diffs, entries)
    stale, pending = cmp.unused_entries(entries)
    print(
        f"{reference_path} (fairscale {reference.get('fairscale_version')}) -> {candidate_path} "
        f"(fairscale {candidate.get('fairscale_version')}): {len(diffs)} difference(s), {len(allowed)} allowed"
    )
    if show_additions:
        added = cmp.additions(reference, candidate)
        print(f"{len(added)} addition(s):")
        print("\n".join(f"  {a}" for a in added))
    text = cmp.report(bad, stale, reference, allowlist or "the allow-list")
    if pending:
        print(f"{len(pending)} 'not yet ported' allow-list entr(y/ies) match nothing now (prune them):")
        print("\n".join(f"  {e}" for e in pending))
    if text:
        print(text)
    return 1 if bad or stale else 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.upstream_api", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dump = sub.add_parser("dump", help="write the public surface of the importable fairscale to OUT.json")
    dump.add_argument("out")
    comp = sub.add_parser("compare", help="differences of CANDIDATE from REFERENCE")
    comp.add_argument("reference")
    comp.add_argument("candidate")
    comp.add_argument("--allowlist", default=None, help="allow-list file (default: none, every difference counts)")
    comp.add_argument("--additions", action="store_true", help="also list what CANDIDATE adds")
    sub.add_parser("check", help="compare this checkout with the upstream snapshot and the allow-list")
    args = parser.parse_args(argv)
    if args.command == "dump":
        return surface.main([args.out])
    if args.command == "compare":
        return _compare(args.reference, args.candidate, args.allowlist, args.additions)
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/checkout.json"
        surface.dump(out)
        return _compare(cmp.SNAPSHOT, out, cmp.ALLOWLIST, False)


if __name__ == "__main__":
    sys.exit(main())
