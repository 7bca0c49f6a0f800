# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The identity every shard of a sharded checkpoint carries, and the checks that use it.

A sharded checkpoint is one ``(local_state_dict(), local_metadata_dict())`` pair per rank. Nothing in upstream's
format says which checkpoint (or which rank) a pair belongs to, so shards of two different checkpoints, or shards in
the wrong order, consolidated into a plausible-looking but wrong model. Every pair now carries::

    {"id": str, "rank": int, "world_size": int, "step": int}

plus, with hybrid sharding (``replicate_process_group``), ``"replicate_rank"`` and ``"replicate_world_size"``:
``rank`` and ``world_size`` are then those of the shard group, which is all a shard's layout depends on (every
replica holds the same shards, so any one replica's files make the whole checkpoint, and they load into any model
sharded over ``world_size`` ranks, hybrid or not).

* in the metadata dict under the extra top-level key ``"checkpoint_identity"`` (upstream's consumers read only
  ``"param_metadata"`` and ``"buffer_names"`` and ignore it);
* in the local state dict's ``_metadata`` (the per-module version table torch keeps next to every state dict and
  ``torch.save`` preserves) under ``"__fsdp_checkpoint_identity__"``, which no module prefix can equal, so loaders
  (upstream's included) never look at it.

``id`` is the same on every rank of one checkpoint without any communication at save time: it is a token the ranks
agreed on at the root's first forward (and again at every load), followed by ``step``, the number of
gradient-synchronizing backward passes the model has completed (restored by a load of a local checkpoint). Files
without an identity (upstream's, or older ones) are accepted as before.
"""

import uuid
from typing import Any, Dict, List, Mapping, Optional, Sequence

IDENTITY_KEY = "checkpoint_identity"
WEIGHTS_IDENTITY_KEY = "__fsdp_checkpoint_identity__"
_FIELDS = ("id", "rank", "world_size", "step")


def new_token() -> str:
    """A fresh random token (rank 0's wins when the ranks agree on one)."""
    return uuid.uuid4().hex[:16]


def make_identity(
    token: Optional[str], step: int, rank: int, world_size: int, replicate_rank: int = 0, replicate_world_size: int = 1
) -> Dict[str, Any]:
    """The identity of a shard taken now: same ``id`` on every rank that agreed on ``token`` and is at ``step``.

    The replicate fields are recorded only with hybrid sharding (``replicate_world_size > 1``), so that files of
    plain sharding keep their format.
    """
    ident = {
        "id": f"{token or 'untrained'}-{int(step)}",
        "rank": int(rank),
        "world_size": int(world_size),
        "step": step,
    }
    if replicate_world_size > 1:
        ident["replicate_rank"] = int(replicate_rank)
        ident["replicate_world_size"] = int(replicate_world_size)
    return ident


def attach_to_weights(state_dict: Any, identity: Mapping[str, Any]) -> None:
    """Record ``identity`` in a state dict's ``_metadata`` table (created if the dict has none)."""
    table = getattr(state_dict, "_metadata", None)
    if table is None:
        try:
            from collections import OrderedDict

            table = OrderedDict()
            state_dict._metadata = table
        except AttributeError:  # a plain dict: nowhere to put it
            return
    table[WEIGHTS_IDENTITY_KEY] = dict(identity)


def of_weights(state_dict: Any) -> Optional[Dict[str, Any]]:
    """The identity recorded in a local state dict, ``None`` when it carries none."""
    table = getattr(state_dict, "_metadata", None)
    value = table.get(WEIGHTS_IDENTITY_KEY) if isinstance(table, Mapping) else None
    return dict(value) if isinstance(value, Mapping) else None


def of_metadata(meta: Any) -> Optional[Dict[str, Any]]:
    """The identity recorded in a local metadata dict, ``None`` when it carries none."""
    value = meta.get(IDENTITY_KEY) if isinstance(meta, Mapping) else None
    return dict(value) if isinstance(value, Mapping) else None


def ranks_given(shard_metadata: Sequence[Any]) -> str:
    """`` (ranks [1] of 2: ranks [0] missing)`` for shards that carry identities, else ``""`` (for messages)."""
    idents = [of_metadata(meta) for meta in shard_metadata]
    if not idents or any(ident is None for ident in idents):
        return ""
    ranks = sorted(int(ident["rank"]) for ident in idents if ident is not None)
    world_size = int(idents[0]["world_size"]) if idents[0] is not None else len(ranks)
    missing = sorted(set(range(world_size)) - set(ranks))
    return f" (ranks {ranks} of {world_size}{f': ranks {missing} missing' if missing else ''})"


def _describe(ident: Mapping[str, Any]) -> str:
    return f"rank {ident.get('rank')} of checkpoint {ident.get('id')!r} (step {ident.get('step')})"


def check_pair(weights: Any, meta: Any, what: str) -> Optional[Dict[str, Any]]:
    """The identity of one rank's ``(weights, metadata)``; they must not come from different checkpoints.

    Raises:
        ValueError: a malformed identity, or weights and metadata of different checkpoints.
    """
    from_meta, from_weights = of_metadata(meta), of_weights(weights)
    for ident in (from_meta, from_weights):
        if ident is not None and not _well_formed(ident):
            raise ValueError(
                f"{what}: the checkpoint identity is malformed (it needs a string 'id' and whole numbers 'rank' "
                f"< 'world_size' and 'step'): {ident!r}"
            )
    if from_meta is not None and from_weights is not None and from_meta != from_weights:
        raise ValueError(
            f"{what}: the weights are {_describe(from_weights)} but the metadata is {_describe(from_meta)}: pass "
            "each rank's local_state_dict() and local_metadata_dict() at the same position of the two lists, and "
            "save them together"
        )
    return from_meta if from_meta is not None else from_weights


def _well_formed(ident: Mapping[str, Any]) -> bool:
    if any(field not in ident for field in _FIELDS) or not isinstance(ident["id"], str):
        return False
    numbers: List[int] = [ident[f] for f in ("rank", "world_size", "step")]
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
        return False
    rank, world_size, step = numbers
    return bool(0 <= rank < world_size and step >= 0)


def check_shards(
    shard_weights: Sequence[Any], shard_metadata: Sequence[Any], what: str, partial_ok: bool = False
) -> Optional[List[int]]:
    """Shards given for one checkpoint must be every rank's of the same one, each once (some ranks' only with
    ``partial_ok``).

    Their order does not matter when they carry identities: each says which rank saved it, so files listed in any
    order (a directory listing, e.g. ``glob("worker*_model.pt")``) are put back in rank order by the caller. Files
    without an identity (upstream's) cannot be told apart and must be given in rank order.

    Args:
        shard_weights: the local state dicts, in the order given.
        shard_metadata: the metadata dicts, in the order given.
        what: the caller's name, for the messages.
        partial_ok: accept shards of some ranks only (``consolidate_shard_weights(strict=False)``, as upstream:
            fairseq's and metaseq's scripts consolidate one MoE expert file, a rank's, that way).

    Returns:
        ``order``, where ``order[r]`` is the position of rank ``r``'s shard in the lists given; ``None`` for shards
        without identities (to be used in the order given).

    Raises:
        ValueError: a malformed identity; a rank's weights and metadata from different checkpoints; some shards with
            an identity and some without; shards of different checkpoints; a rank given twice; or not as many shards
            as the checkpoint's world size.
    """
    idents = [
        check_pair(weights, meta, f"{what}: shard {pos}")
        for pos, (weights, meta) in enumerate(zip(shard_weights, shard_metadata))
    ]
    # Only a pair whose weights and metadata both say which rank saved them may be moved: reordering both lists by
    # the identities of one of them would pair the other list's entries with the wrong ranks (e.g. weights copied
    # into plain dicts, which drops their identity, given in rank order beside metadata in another order).
    both_carry = all(
        of_weights(weights) is not None and of_metadata(meta) is not None
        for weights, meta in zip(shard_weights, shard_metadata)
    )
    present = [pos for pos, ident in enumerate(idents) if ident is not None]
    if not present:
        return None  # upstream's (or older) files: nothing to check
    if len(present) != len(idents):
        missing = [pos for pos, ident in enumerate(idents) if ident is None]
        raise ValueError(
            f"{what}: shards {missing} carry no checkpoint identity but shards {present} do: these files come from "
            "different checkpoints (e.g. an upstream fairscale checkpoint mixed with this one's)"
        )
    known = [ident for ident in idents if ident is not None]
    if len({ident["id"] for ident in known}) > 1:
        listing = "; ".join(f"shard {pos}: {_describe(ident)}" for pos, ident in enumerate(known))
        raise ValueError(
            f"{what}: the shards come from different checkpoints ({listing}). Pass every rank's files of one "
            "checkpoint."
        )
    ranks = [int(ident["rank"]) for ident in known]
    for rank in sorted(set(ranks)):
        positions = [pos for pos, r in enumerate(ranks) if r == rank]
        if len(positions) > 1:
            replicas = sorted({int(known[pos].get("replicate_rank", 0)) for pos in positions})
            if len(replicas) > 1:  # hybrid sharding: every replica holds the same shards
                raise ValueError(
                    f"{what}: rank {rank}'s shard is given {len(positions)} times (shards {positions}), from replicas "
                    f"{replicas} of a hybrid-sharded checkpoint: pass one replica's files (e.g. those whose "
                    "identity has replicate_rank 0), which hold every shard"
                )
            raise ValueError(
                f"{what}: rank {rank}'s shard is given {len(positions)} times (shards {positions}): the same file "
                "was passed more than once, or the files' metadata was copied from one rank's (a resharding script "
                "does that: remove 'checkpoint_identity' from each metadata dict, and pass the files in rank order)"
            )
    sizes = sorted({int(ident["world_size"]) for ident in known})
    if len(sizes) > 1:
        raise ValueError(f"{what}: the shards' identities disagree on the world size ({sizes}): malformed files")
    world_size = sizes[0]
    if len(known) != world_size and not partial_ok:
        raise ValueError(
            f"{what}: the checkpoint was saved by {world_size} ranks but {len(known)} shards were given "
            f"(ranks {ranks}); pass the files of every rank (or, from Python, strict=False to consolidate what some "
            "ranks hold whole, such as one MoE expert file)"
        )
    if not set(ranks) <= set(range(world_size)) or (sorted(ranks) != list(range(world_size)) and not partial_ok):
        raise ValueError(
            f"{what}: the checkpoint was saved by ranks 0..{world_size - 1} but the shards given are ranks {ranks}"
        )
    order = sorted(range(len(ranks)), key=lambda pos: ranks[pos])
    if order != list(range(len(ranks))) and not both_carry:
        raise ValueError(
            f"{what}: the shards are given in the order of ranks {ranks}, and not all of them carry their identity in "
            "both the weights and the metadata (a local state dict copied into a plain dict loses it), so they "
            "cannot be put back in rank order safely: pass them in rank order, shard r being rank r's"
        )
    return order


def check_loadable_here(ident: Optional[Mapping[str, Any]], rank: int, world_size: int) -> None:
    """A local state dict that says which rank saved it must be loaded on that rank of a world of that size."""
    if ident is None:
        return
    if int(ident.get("world_size", -1)) != world_size or int(ident.get("rank", -1)) != rank:
        raise RuntimeError(
            f"load_local_state_dict: this is {_describe(ident)}, saved by {ident.get('world_size')} ranks, but it is "
            f"loaded on rank {rank} of {world_size}. Load each rank's own file, or consolidate / re-shard the "
            "checkpoint for another world size."
        )
