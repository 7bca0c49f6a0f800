# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The ``wgit`` command line."""

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from fairscale.internal.errors import FairscaleRuntimeError, FairscaleTypeError

from .repo import Repo
from .safety import printable
from .version import __version_tuple__

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> None:
    """Run a wgit sub-command (``version``, ``init``, ``status``, ``add``, ``commit``, ``checkout``, ``log``).

    A refusal (see :mod:`fairscale.experimental.wgit.safety`), bad input, a file that cannot be read or a sub-command
    that is not implemented (``checkout``, as upstream) prints ``fatal: <reason>`` to stderr and exits with status 1.
    """
    desc = "WeiGit: A git-like tool for model weight tracking"
    parser = argparse.ArgumentParser(description=desc)
    subparsers = parser.add_subparsers(dest="command")
    subparsers.add_parser("version", description="Show the version")
    subparsers.add_parser("init", description="Initialize a weigit repo")
    subparsers.add_parser("status", description="Show the repo's current status")
    add_parser = subparsers.add_parser("add", description="Add a file to the staged changeset (default: none)")
    add_parser.add_argument("add", default="", type=str, metavar="FILE_PATH", help="add a file to the staged changeset")
    add_parser.add_argument("--no_per_tensor", action="store_true", help="Disable per-tensor adding")
    commit_parser = subparsers.add_parser("commit", description="Commits the staged changes")
    commit_parser.add_argument("-m", "--message", required=True, type=str, help="commit message")
    checkout_parser = subparsers.add_parser("checkout", description="checkout from a commit")
    checkout_parser.add_argument("checkout", default="", type=str, metavar="FILE_SHA1", help="checkout a commit")
    log_parser = subparsers.add_parser("log", description="Show the history log of the repo or optionally of a file.")
    log_parser.add_argument(
        "-f", "--file", default="", type=str, metavar="FILE_PATH", help="Show the history of a file"
    )
    args = parser.parse_args(argv)
    try:
        _run(args)
    except (ValueError, FairscaleTypeError, FairscaleRuntimeError, NotImplementedError) as e:
        # wgit's refusals (a planted link, a checkpoint that would run code, bad input) and its sub-commands that
        # do nothing yet (checkout): one line, like git's "fatal:" messages, instead of a traceback.
        sys.stderr.write(f"fatal: {printable(str(e))}\n")
        sys.exit(1)
    except ImportError as e:  # pygit2, which the plain install does not bring (the dev extra does)
        sys.stderr.write(f"fatal: {printable(str(e))}\n")
        sys.exit(1)
    except RecursionError:  # wgit bounds the nesting it walks; a traceback would hide what is wrong
        sys.stderr.write("fatal: wgit: the data is nested too deeply to process (Python's recursion limit)\n")
        sys.exit(1)
    except OSError as e:  # a file that cannot be read (missing, unreadable, a name too long): the system's reason
        sys.stderr.write(f"fatal: {printable(str(e))}\n")
        sys.exit(1)
    except Exception as e:  # noqa: B902  # only git's own errors are told here; anything else is a bug: traceback
        if not _is_git_error(e):
            raise
        # libgit2 refusing .wgit/.git: most often a lock left by an interrupted git or wgit, or a damaged index.
        sys.stderr.write(
            f"fatal: git refused an operation on .wgit/.git: {printable(str(e))}. A lock file (.wgit/.git/index.lock, a ref's "
            ".lock) left by an interrupted git or wgit can be removed once no git or wgit runs there\n"
        )
        sys.exit(1)


def _is_git_error(error: BaseException) -> bool:
    """Whether ``error`` is pygit2's (libgit2's) ``GitError``: pygit2 is imported only when a repository opens."""
    pygit2 = sys.modules.get("pygit2")
    return pygit2 is not None and isinstance(error, pygit2.GitError)


def _run(args: argparse.Namespace) -> None:
    if args.command == "version":
        print(".".join(str(x) for x in __version_tuple__))
        return
    if args.command is None:
        return
    if args.command == "init":
        Repo(Path.cwd(), init=True)
    elif args.command == "add":
        Repo(Path.cwd()).add(args.add, per_tensor=not args.no_per_tensor)
    elif args.command == "status":
        print(Repo(Path.cwd()).status())
    elif args.command == "commit":
        Repo(Path.cwd()).commit(args.message)
    elif args.command == "checkout":
        Repo(Path.cwd()).checkout(args.checkout)
    elif args.command == "log":
        Repo(Path.cwd()).log(args.file)
