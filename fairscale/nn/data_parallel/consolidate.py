# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Offline tools for sharded FSDP checkpoints: consolidate per-rank files into one, or re-shard one for another size.

A sharded checkpoint is one file per rank, each a dict holding that rank's ``model.local_state_dict()`` under
``"weights"`` and ``model.local_metadata_dict()`` under ``"meta"`` (fairseq's ``"model"`` / ``"shard_metadata"``
are accepted too). The rank is read from the file name (``...rank-3...``, ``rank_3``, ``rank3`` or ``shard3``).
Nothing here needs a process group or a GPU::

    # directory of per-rank files -> one full state dict (loads into the unwrapped module, or any FSDP wrapping)
    python -m fairscale.nn.data_parallel.consolidate consolidate CKPT_DIR full.pt

    # full state dict -> per-rank local checkpoints for 3 ranks (wrapping taken from any old rank file)
    python -m fairscale.nn.data_parallel.consolidate reshard full.pt --meta CKPT_DIR/ckpt-rank-0.pt \\
        --world-size 3 --out-dir NEW_DIR

The same from Python: :func:`consolidate_checkpoint_dir` and :func:`reshard_checkpoint` / :func:`save_resharded`.

Files are read with ``torch.load(weights_only=True)``: tensors and plain containers only, never code from a file.
A file that cannot be used (empty, truncated, not a checkpoint, holding other objects, or of another layout) raises
:class:`CheckpointFileError` naming it; the command line prints ``error: <file>: <problem>`` and exits with 1.
"""

import argparse
import glob
import math
import os
import pickle
import re
import sys
import warnings
from typing import Any, Dict, List, Mapping, NoReturn, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fairscale.internal.pickle_scan import PickleScanError, UnreadableFileError, load_torch_file

from ._fsdp import identity
from ._fsdp.metadata import consolidate_shard_weights, reshard_full_state_dict

__all__ = [
    "CheckpointFileError",
    "consolidate_checkpoint_dir",
    "find_rank_files",
    "load_rank_checkpoints",
    "main",
    "reshard_checkpoint",
    "save_resharded",
]

_RANK_IN_NAME = re.compile(r"(?:rank|shard)[-_]?(\d+)", re.IGNORECASE)
_KEY_PAIRS = (("weights", "meta"), ("model", "shard_metadata"))
# torch names the first global its weights-only unpickler refused like this.
_REFUSED_GLOBAL = re.compile(r"(?:GLOBAL|Unsupported class) ([\w.]+)")  # newer torch | torch 2.1


class CheckpointFileError(ValueError):
    """A file this tool cannot use; ``str()`` is ``"<path>: <problem>"``.

    Attributes:
        path (str): the file (or directory) as given.
        problem (str): what is wrong with it and, where it helps, what to do.
    """

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


def _load_file(path: str) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU after a scan of its pickle
    (:func:`fairscale.internal.pickle_scan.load_torch_file`), every failure turned into a :class:`CheckpointFileError`.

    The scan refuses what the weights-only loader would do at the file's word past what its bytes hold: a tuple shared
    at every level as a dict key (``2**depth`` hashing steps: a 1 KB file hung the tool), a legacy tensor constructor
    of the size the file names, calls ``torch.save`` never writes.
    """
    if os.path.isdir(path):
        raise CheckpointFileError(path, "is a directory, not a checkpoint file")
    if not os.path.exists(path):
        raise CheckpointFileError(path, "no such file")
    try:
        if os.path.getsize(path) == 0:
            raise CheckpointFileError(path, "empty file (0 bytes): not a torch.save checkpoint")
        # torch warns about pickle protocols on stderr; the command line's contract is one error line there.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_torch_file(path)
    except CheckpointFileError:
        raise
    except UnreadableFileError as e:
        _unreadable(path, e.reason)
    except PickleScanError as e:
        raise CheckpointFileError(path, f"refused: {e.reason}. {_NEVER}") from None
    except pickle.UnpicklingError as e:
        _refuse(path, e)
    except EOFError:
        raise CheckpointFileError(path, "truncated or corrupt: the file ends before the checkpoint does") from None
    except OSError as e:
        raise CheckpointFileError(path, f"cannot read it ({e.strerror or e})") from None
    except RuntimeError as e:
        if "zip archive" in str(e) or "PytorchStreamReader" in str(e):
            raise CheckpointFileError(
                path, "truncated or corrupt: not a complete torch.save zip archive (was the copy or save cut short?)"
            ) from None
        raise CheckpointFileError(path, f"not a readable torch.save checkpoint ({_first_line(e)})") from None
    except Exception as e:  # noqa: B902  # anything torch.load raises on a bad file is this file's problem
        raise CheckpointFileError(
            path, f"truncated or corrupt, or not a torch.save checkpoint ({type(e).__name__}: {_first_line(e)})"
        ) from None


_NEVER = (
    "This tool scans files, then loads them with torch.load(weights_only=True), and never runs code from them; save "
    "checkpoints of tensors, dicts and lists only"
)


def _head(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def _unreadable(path: str, reason: str) -> NoReturn:
    """The scan found no readable torch.save file at ``path`` (``reason``: what it met instead)."""
    head = _head(path)
    if head.startswith(b"PK\x03\x04"):
        raise CheckpointFileError(
            path,
            f"truncated or corrupt (or crafted): not a readable torch.save zip archive ({reason})",
        ) from None
    if head.startswith(b"\x80"):  # a pickle's protocol marker: a plain pickle, or a legacy torch.save cut short
        raise CheckpointFileError(
            path, f"refused: a plain pickle, or a cut-short legacy torch.save file ({reason}). {_NEVER}"
        ) from None
    raise CheckpointFileError(
        path, f"truncated or corrupt, or not a torch.save checkpoint (neither a zip archive nor a pickle: {reason:.80})"
    ) from None


def _refuse(path: str, error: pickle.UnpicklingError) -> NoReturn:
    found = _REFUSED_GLOBAL.search(str(error))
    if found:
        raise CheckpointFileError(
            path, f"refused: it names {found.group(1)}, which is not a tensor or a plain container. {_NEVER}"
        ) from None
    if _head(path).startswith(b"\x80"):  # a pickle's protocol marker: a plain pickle torch would not read
        raise CheckpointFileError(
            path, f"refused: a plain pickle, not a torch.save checkpoint that weights_only loading accepts. {_NEVER}"
        ) from None
    raise CheckpointFileError(
        path,
        f"truncated or corrupt, or not a torch.save checkpoint (neither a zip archive nor a pickle: {error!s:.80})",
    ) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def find_rank_files(directory: str, pattern: str = "*.pt") -> List[str]:
    """The per-rank files of a sharded checkpoint in ``directory``, ordered by rank (rank 0 first).

    Args:
        directory: the checkpoint directory.
        pattern: glob pattern of the per-rank files inside ``directory``.

    Raises:
        ValueError: no file matches, a file name carries no rank, the ranks are not exactly ``0..n-1``, or a match
            leads out of ``directory`` (a symlink to a file elsewhere, a pattern with ``..``) or is not a file.
    """
    if not os.path.isdir(directory):  # said plainly (both read "no file matches '*.pt'")
        raise ValueError(
            f"{directory!r} {'is not a directory' if os.path.exists(directory) else 'does not exist'}: give the "
            "directory that holds the per-rank files"
        )
    paths = sorted(glob.glob(os.path.join(glob.escape(directory), pattern)))  # a folder named run[1] is literal
    if not paths:
        raise ValueError(f"no file matches {pattern!r} in {directory!r}")
    by_rank: Dict[int, str] = {}
    for path in paths:
        _check_inside(directory, path)
        found = _RANK_IN_NAME.findall(os.path.basename(path))
        if not found:
            raise ValueError(
                f"cannot tell the rank of {path!r}: name per-rank files like 'ckpt-rank-0.pt' (or pass a narrower "
                "pattern)"
            )
        rank = int(found[-1])
        if rank in by_rank:
            raise ValueError(f"two files for rank {rank}: {by_rank[rank]!r} and {path!r}")
        by_rank[rank] = path
    if sorted(by_rank) != list(range(len(by_rank))):
        # Named from the highest rank found: the files' identities (read later) would say the world size, but a
        # lost rank 0 was reported as "must cover ranks 0..0; found ranks [1]", which never said what is missing.
        missing = sorted(set(range(max(by_rank) + 1)) - set(by_rank))
        raise ValueError(
            f"the per-rank files must cover ranks 0..n-1 with none missing; found ranks {sorted(by_rank)}, missing "
            f"{missing[:20]}{' ...' if len(missing) > 20 else ''} (and any above {max(by_rank)}): put the lost files "
            "back, or pass a pattern that matches them"
        )
    return [by_rank[r] for r in range(len(by_rank))]


def _check_inside(directory: str, path: str) -> None:
    """Raise unless ``path`` is a regular file whose real location is inside ``directory``.

    A checkpoint directory received from someone else could hold ``ckpt-rank-1.pt`` as a symlink to a file of the
    user's own (another checkpoint, a key): it was read and merged into the output without a word.
    """
    real_dir = os.path.realpath(directory)
    real = os.path.realpath(path)
    if os.path.commonpath([real_dir, real]) != real_dir:
        raise CheckpointFileError(
            path,
            f"leads out of the checkpoint directory (to {real}); the per-rank files must be in {directory} itself: "
            "copy the file in if it is yours",
        )
    if not os.path.isfile(real):
        raise CheckpointFileError(path, "is not a regular file (a directory, pipe or device)")


def _split_checkpoint(ckpt: Any, path: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    if isinstance(ckpt, Mapping):
        for weights_key, meta_key in _KEY_PAIRS:
            if weights_key in ckpt and meta_key in ckpt:
                weights, meta = ckpt[weights_key], ckpt[meta_key]
                _check_layout(weights, meta, path, weights_key, meta_key)
                return weights, meta
    # A few short names: a key's str may be huge (a tuple tower of 963 bytes made a 100 MB line; a security review,
    # session 50).
    keys = _few(ckpt) if isinstance(ckpt, Mapping) else type(ckpt).__name__
    raise CheckpointFileError(
        path,
        "not a per-rank FSDP checkpoint: expected a dict with 'weights' (local_state_dict()) and 'meta' "
        f"(local_metadata_dict()), got {keys}",
    )


def _check_layout(weights: Any, meta: Any, path: str, weights_key: str, meta_key: str) -> None:
    """The structure consolidation reads, checked per file so that a bad file is named (not a traceback later)."""

    def bad(what: str) -> NoReturn:
        raise CheckpointFileError(path, f"{what}; this file was not written by local_state_dict/local_metadata_dict")

    if not isinstance(weights, Mapping) or not all(isinstance(k, str) for k in weights):
        bad(f"{weights_key!r} must be a dict of tensors keyed by name, got {type(weights).__name__}")
    if not isinstance(meta, Mapping):
        bad(f"{meta_key!r} must be a metadata dict, got {type(meta).__name__}")
    entries, buffers = meta.get("param_metadata"), meta.get("buffer_names")
    if not isinstance(entries, (list, tuple)) or not _is_str_list(buffers):
        bad(f"the metadata ({meta_key!r}) needs a 'param_metadata' list and a 'buffer_names' list of names")
    for i, entry in enumerate(entries):
        if not _is_entry(entry):
            bad(f"the metadata's param_metadata[{i}] is not an instance entry (fsdp_path, params, ...)")
    # One entry per instance: a list repeating one entry costs a few bytes per repeat in the file, and each repeat a
    # full consolidation pass (an hour for a 4 MB file; a security review, session 50).
    seen: Dict[str, int] = {}
    for i, entry in enumerate(entries):
        where = entry["fsdp_path"]
        if where in seen:
            bad(f"the metadata's param_metadata[{i}] repeats the instance at {where[:80]!r} (entry {seen[where]})")
        seen[where] = i
    ident = meta.get("checkpoint_identity")
    if ident is not None and not (
        isinstance(ident, Mapping) and all(isinstance(ident.get(k), int) for k in ("rank", "world_size"))
    ):
        bad("the metadata's checkpoint_identity is malformed")


def _few(mapping: Mapping[Any, Any]) -> str:
    names = [key if isinstance(key, str) else f"<a {type(key).__name__}>" for key in list(mapping)[:8]]
    shown = ", ".join(repr(name[:40] + "..." if len(name) > 40 else name) for name in sorted(names))
    return f"keys [{shown}{', ...' if len(mapping) > 8 else ''}]"


def _is_str_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


def _is_entry(entry: Any) -> bool:
    if not isinstance(entry, Mapping) or not isinstance(entry.get("fsdp_path"), str):
        return False
    params, shared = entry.get("params"), entry.get("shared_param_info", [])
    if not isinstance(params, Mapping) or not isinstance(entry.get("no_broadcast_optim_state", False), bool):
        return False
    if not isinstance(shared, (list, tuple)) or not all(_is_str_list(pair) and len(pair) == 2 for pair in shared):
        return False
    return all(isinstance(name, str) and _is_param_info(info) for name, info in params.items())


def _is_param_info(info: Any) -> bool:
    if not isinstance(info, Mapping) or not _is_str_list(info.get("names")):
        return False
    shapes, numels, padding = info.get("shapes"), info.get("numels"), info.get("padding")
    if not isinstance(shapes, (list, tuple)) or not isinstance(numels, (list, tuple)) or not isinstance(padding, int):
        return False
    if not len(info["names"]) == len(shapes) == len(numels):
        return False
    shapes_ok = all(isinstance(s, (list, tuple)) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes)
    if not (shapes_ok and all(isinstance(n, int) and n >= 0 for n in numels)):
        return False
    # Each shape holds its numel (a shape of 10^12 elements for 21 values failed deep in a reshape); names unique.
    return all(math.prod(s) == n for s, n in zip(shapes, numels)) and len(set(info["names"])) == len(info["names"])


def load_rank_checkpoints(paths: Sequence[str]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """Load per-rank files (in rank order) on the CPU; returns ``(weights per rank, metadata per rank)``.

    Raises:
        CheckpointFileError: a file is unreadable, holds objects other than tensors and plain containers, or is
            not a per-rank checkpoint of the expected layout.
    """
    weights, metas = [], []
    for path in paths:
        w, m = _split_checkpoint(_load_file(path), path)
        weights.append(w)
        metas.append(m)
    return weights, metas


def consolidate_checkpoint_dir(
    directory: str, pattern: str = "*.pt", with_module_buffers: bool = True, strict: bool = True
) -> Dict[str, Tensor]:
    """One full state dict from a directory of per-rank local checkpoints (see the module doc for the layout).

    Args:
        directory: the checkpoint directory.
        pattern: glob pattern of the per-rank files.
        with_module_buffers: also include the buffers (from rank 0).
        strict: see :meth:`FullyShardedDataParallel.consolidate_shard_weights`.

    Returns:
        The full state dict, with the unwrapped module's keys.
    """
    weights, metas = load_rank_checkpoints(find_rank_files(directory, pattern))
    return consolidate_shard_weights(weights, metas, with_module_buffers=with_module_buffers, strict=strict)


def reshard_checkpoint(
    full_state_dict: Mapping[str, Any], metadata: Mapping[str, Any], world_size: int
) -> List[Dict[str, Any]]:
    """Per-rank checkpoints ``{"weights", "meta"}`` of a full state dict for ``world_size`` ranks.

    Args:
        full_state_dict: a full state dict (e.g. from :func:`consolidate_checkpoint_dir` or ``state_dict()``).
        metadata: any rank's ``local_metadata_dict()`` of the model wrapped as it will be when loading.
        world_size: the new number of ranks.

    Returns:
        One dict per rank; rank ``r`` loads its ``"weights"`` with ``model.load_local_state_dict``.
    """
    weights, metas = reshard_full_state_dict(full_state_dict, metadata, world_size)
    return [{"weights": w, "meta": m} for w, m in zip(weights, metas)]


def save_resharded(
    full_state_dict: Mapping[str, Any],
    metadata: Mapping[str, Any],
    world_size: int,
    out_dir: str,
    prefix: str = "checkpoint",
) -> List[str]:
    """:func:`reshard_checkpoint` and save rank ``r``'s dict as ``out_dir/<prefix>-rank-<r>.pt``; returns the paths.

    Everything is computed before the first file is written, into a directory that holds no per-rank files of
    ``prefix`` yet (new files beside old ones of another world size would be consolidated together).

    Raises:
        ValueError: ``prefix`` is not a plain file name part, or ``out_dir`` already holds ``<prefix>-rank-*.pt``.
    """
    if not prefix or os.sep in prefix or (os.altsep and os.altsep in prefix) or prefix in (".", ".."):
        raise ValueError(f"the prefix must be a plain file name part (no directory), got {prefix!r}; use --out-dir")
    existing = sorted(glob.glob(os.path.join(glob.escape(out_dir), f"{glob.escape(prefix)}-rank-*.pt")))
    if existing:
        raise ValueError(
            f"{out_dir} already holds per-rank files of prefix {prefix!r} ({', '.join(map(os.path.basename, existing))}"
            "); write the new checkpoint to an empty directory (or remove those files): new files beside old ones "
            "would be consolidated together"
        )
    dicts = reshard_checkpoint(full_state_dict, metadata, world_size)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for rank, ckpt in enumerate(dicts):
        path = os.path.join(out_dir, f"{prefix}-rank-{rank}.pt")
        torch.save(ckpt, path)
        paths.append(path)
    return paths


def _load_full(path: str) -> Dict[str, Any]:
    full = _load_file(path)
    if isinstance(full, Mapping) and "weights" in full and isinstance(full["weights"], Mapping):
        full = full["weights"]
    if not isinstance(full, Mapping):
        raise CheckpointFileError(path, f"does not hold a state dict (got {type(full).__name__})")
    return dict(full)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fairscale.nn.data_parallel.consolidate",
        description="Consolidate or re-shard FullyShardedDataParallel checkpoints offline (CPU, no process group).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cons = sub.add_parser("consolidate", help="per-rank local checkpoints -> one full state dict")
    cons.add_argument("directory", help="directory of per-rank files {'weights': ..., 'meta': ...}")
    cons.add_argument("output", help="file to write the full state dict to")
    cons.add_argument("--pattern", default="*.pt", help="glob of the per-rank files (default: *.pt)")
    cons.add_argument("--no-buffers", action="store_true", help="leave the module buffers out")
    cons.add_argument(
        "--non-strict", action="store_true", help="skip entries missing from the weights (every rank's file is needed)"
    )
    resh = sub.add_parser("reshard", help="full state dict -> per-rank local checkpoints for another world size")
    resh.add_argument("full", help="a full state dict file (as written by 'consolidate' or torch.save(state_dict()))")
    resh.add_argument("--meta", required=True, help="any per-rank file of the old checkpoint (for the wrapping)")
    resh.add_argument("--world-size", type=int, required=True, help="the new number of ranks")
    resh.add_argument("--out-dir", required=True, help="directory for the new per-rank files")
    resh.add_argument("--prefix", default="checkpoint", help="file name prefix (default: checkpoint)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status.

    On input it cannot use it prints one line, ``error: <file>: <problem>``, to stderr and returns 1 (the file is
    the checkpoint directory when the files disagree with each other, and the output path when writing fails).
    """
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except CheckpointFileError as e:
        _error(e.path, e.problem)
    except OSError as e:
        # Writing the output (or reading a directory listing) failed.
        _error(str(e.filename) if e.filename else _target(args), e.strerror or str(e))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        # The files loaded and look like checkpoints but do not fit together (or the metadata does not fit the
        # weights): name what was being processed.
        _error(_target(args), e.args[0] if isinstance(e, KeyError) and e.args else str(e))
    return 1


def _target(args: argparse.Namespace) -> str:
    return str(args.directory if args.command == "consolidate" else args.full)


def _error(path: str, problem: str) -> None:
    # One line: a newline inside a message would break "one error line per failure" for scripts reading stderr.
    print(f"error: {path}: {' '.join(str(problem).split())}", file=sys.stderr)


def _check_output(output: str, inputs: Sequence[str]) -> None:
    """Before anything is read: the output must not replace an input file, and its directory must exist."""
    if os.path.realpath(output) in {os.path.realpath(p) for p in inputs}:
        raise CheckpointFileError(
            output, "is one of the per-rank files being consolidated; write the full state " "dict to another file"
        )
    parent = os.path.dirname(output) or "."
    if not os.path.isdir(parent):
        raise CheckpointFileError(output, f"its directory {parent} does not exist; create it first")


def _run(args: argparse.Namespace) -> int:
    if args.command == "consolidate":
        _check_output(args.output, find_rank_files(args.directory, args.pattern))
        full = consolidate_checkpoint_dir(
            args.directory, args.pattern, with_module_buffers=not args.no_buffers, strict=not args.non_strict
        )
        torch.save(full, args.output)
        print(f"wrote {len(full)} entries to {args.output}")
        return 0
    weights, meta = _split_checkpoint(_load_file(args.meta), args.meta)
    identity.check_pair(weights, meta, args.meta)  # its weights and metadata must be of one checkpoint
    paths = save_resharded(_load_full(args.full), meta, args.world_size, args.out_dir, args.prefix)
    print(f"wrote {len(paths)} per-rank files to {args.out_dir}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
