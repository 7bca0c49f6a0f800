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
"""

import argparse
import glob
import os
import re
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._fsdp import identity
from ._fsdp.metadata import consolidate_shard_weights, reshard_full_state_dict

__all__ = [
    "consolidate_checkpoint_dir",
    "find_rank_files",
    "load_rank_checkpoints",
    "main",
    "reshard_checkpoint",
    "save_resharded",
]

_RANK_IN_NAME = re.compile(r"(?:rank|shard)[-_]?(\d+)", re.IGNORECASE)
_KEY_PAIRS = (("weights", "meta"), ("model", "shard_metadata"))


def find_rank_files(directory: str, pattern: str = "*.pt") -> List[str]:
    """The per-rank files of a sharded checkpoint in ``directory``, ordered by rank (rank 0 first).

    Args:
        directory: the checkpoint directory.
        pattern: glob pattern of the per-rank files inside ``directory``.

    Raises:
        ValueError: no file matches, a file name carries no rank, or the ranks are not exactly ``0..n-1``.
    """
    paths = sorted(glob.glob(os.path.join(directory, pattern)))
    if not paths:
        raise ValueError(f"no file matches {pattern!r} in {directory!r}")
    by_rank: Dict[int, str] = {}
    for path in paths:
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
        raise ValueError(f"the per-rank files must cover ranks 0..{len(by_rank) - 1}; found ranks {sorted(by_rank)}")
    return [by_rank[r] for r in range(len(by_rank))]


def _split_checkpoint(ckpt: Any, path: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    if isinstance(ckpt, Mapping):
        for weights_key, meta_key in _KEY_PAIRS:
            if weights_key in ckpt and meta_key in ckpt:
                return ckpt[weights_key], ckpt[meta_key]
    keys = sorted(ckpt) if isinstance(ckpt, Mapping) else type(ckpt).__name__
    raise ValueError(
        f"{path!r} is not a per-rank FSDP checkpoint: expected a dict with 'weights' (local_state_dict()) and 'meta' "
        f"(local_metadata_dict()), got {keys}"
    )


def load_rank_checkpoints(paths: Sequence[str]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """Load per-rank files (in rank order) on the CPU; returns ``(weights per rank, metadata per rank)``."""
    weights, metas = [], []
    for path in paths:
        w, m = _split_checkpoint(torch.load(path, map_location="cpu", weights_only=True), path)
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
    """:func:`reshard_checkpoint` and save rank ``r``'s dict as ``out_dir/<prefix>-rank-<r>.pt``; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for rank, ckpt in enumerate(reshard_checkpoint(full_state_dict, metadata, world_size)):
        path = os.path.join(out_dir, f"{prefix}-rank-{rank}.pt")
        torch.save(ckpt, path)
        paths.append(path)
    return paths


def _load_full(path: str) -> Dict[str, Any]:
    full = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(full, Mapping) and "weights" in full and isinstance(full["weights"], Mapping):
        full = full["weights"]
    if not isinstance(full, Mapping):
        raise ValueError(f"{path!r} does not hold a state dict (got {type(full).__name__})")
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
    cons.add_argument("--non-strict", action="store_true", help="skip entries missing from the weights")
    resh = sub.add_parser("reshard", help="full state dict -> per-rank local checkpoints for another world size")
    resh.add_argument("full", help="a full state dict file (as written by 'consolidate' or torch.save(state_dict()))")
    resh.add_argument("--meta", required=True, help="any per-rank file of the old checkpoint (for the wrapping)")
    resh.add_argument("--world-size", type=int, required=True, help="the new number of ranks")
    resh.add_argument("--out-dir", required=True, help="directory for the new per-rank files")
    resh.add_argument("--prefix", default="checkpoint", help="file name prefix (default: checkpoint)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (non-zero, with the reason on stderr, on bad input)."""
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except (ValueError, KeyError, OSError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "consolidate":
        full = consolidate_checkpoint_dir(
            args.directory, args.pattern, with_module_buffers=not args.no_buffers, strict=not args.non_strict
        )
        torch.save(full, args.output)
        print(f"wrote {len(full)} entries to {args.output}")
        return 0
    weights, meta = _split_checkpoint(torch.load(args.meta, map_location="cpu", weights_only=True), args.meta)
    identity.check_pair(weights, meta, args.meta)  # its weights and metadata must be of one checkpoint
    paths = save_resharded(_load_full(args.full), meta, args.world_size, args.out_dir, args.prefix)
    print(f"wrote {len(paths)} per-rank files to {args.out_dir}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
