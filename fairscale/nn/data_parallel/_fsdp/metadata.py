# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Sharded-checkpoint metadata and offline consolidation, in upstream's format.

A sharded checkpoint is, per rank, the rank's :meth:`local_state_dict` (padded 1-D shards) plus the rank's
:func:`local_metadata_dict`, which says how to cut those shards back into the original parameters. With both from
every rank, :func:`consolidate_shard_weights` rebuilds the full state dict on a CPU, without a process group, and
:func:`reshard_full_state_dict` goes the other way for any world size.

Metadata format (one entry per FSDP instance, ``named_modules()`` order, empty instances included)::

    {"param_metadata": [{"fsdp_path": "" or "a.b",
                         "params": {<backing name>: {"names": [...], "shapes": [...], "numels": [...],
                                                     "padding": int}},
                         "no_broadcast_optim_state": bool,
                         "shared_param_info": [(src, dst), ...]}],
     "buffer_names": [...],
     "checkpoint_identity": {"id": str, "rank": int, "world_size": int, "step": int}}

With hybrid sharding the identity also records ``replicate_rank`` and ``replicate_world_size``; ``rank`` and
``world_size`` are the shard group's. One replica's files (any one rank of each shard index) make a whole checkpoint.

``checkpoint_identity`` is this distribution's addition (upstream's consumers ignore it; upstream's files lack it and
are accepted): every shard of one checkpoint has the same ``id``, and consolidation rejects shards of different
checkpoints and a rank given twice, and puts shards given out of rank order back in rank order (see
:mod:`.identity`); upstream's files must be given in rank order.

Names are clean (no ``_fsdp_wrapped_module`` / ``_fpw_module``) and relative to the instance's ``fsdp_path``; the
per-backing dict keeps the key order names, shapes, numels, padding because upstream's consumer unpacks it
positionally.

Unlike upstream, every instance's ``shared_param_info`` is applied, each relative to its own instance (upstream
used only the last instance's list, with paths relative to that instance), and non-flattened instances list their
tied parameters too.
"""

from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import torch
from torch import Tensor, nn

from fairscale.internal.parallel import chunk_and_pad

from . import identity
from .naming import clean_path as _clean
from .naming import join_path as _join
from .unit import FSDPUnit

__all__ = [
    "consolidate_shard_weights",
    "local_metadata_dict",
    "reshard_full_state_dict",
]


# ---------------------------------------------------------------------------------------------------- metadata


def local_metadata_dict(unit: FSDPUnit) -> Dict[str, Any]:
    """This rank's sharding metadata for :func:`consolidate_shard_weights` (upstream's format, see module doc).

    Needs no communication. Call it on the instance whose :meth:`local_state_dict` is saved (the root).
    """
    return {
        "param_metadata": [_instance_entry(u, _clean(path)) for path, u in unit.named_units()],
        "buffer_names": _persistent_buffer_names(unit.owner),
        # An extra key: upstream's consumers read only the two above.
        identity.IDENTITY_KEY: unit.checkpoint_identity(),
    }


def _instance_entry(m: FSDPUnit, fsdp_path: str) -> Dict[str, Any]:
    fpw: Any = m.wrapped
    params: Dict[str, Dict[str, Any]] = {}
    owned = [(i, h) for i, h in enumerate(m.handles) if not h.borrowed]
    flat_params = list(getattr(fpw, "flat_params", []))
    for i, h in owned:
        if i < len(flat_params):
            names, shapes, numels = flat_params[i].metadata()
            backing = fpw.flat_param_names[i]
            names = [_clean(n) for n in names]
        else:
            backing = m.param_name_groups[i][0]
            names, shapes, numels = [backing], [h.orig_size], [h.numel]
        # Key order matters: upstream's consumer unpacks these values positionally.
        params[backing] = {
            "names": list(names),
            "shapes": [torch.Size(s) for s in shapes],
            "numels": [int(n) for n in numels],
            "padding": int(h.padding),
        }
    shared = _shared_param_pairs(m, flat_params)
    return {
        "fsdp_path": fsdp_path,
        "params": params,
        "no_broadcast_optim_state": m.config.no_broadcast_optim_state,
        "shared_param_info": shared,
    }


def _shared_param_pairs(m: FSDPUnit, flat_params: List[Any]) -> List[Tuple[str, str]]:
    """``(src, dst)`` pairs, relative to the instance: ``dst`` is another name of the parameter saved as ``src``."""
    if flat_params:
        tied = [
            (_clean(_join(src_mod, src_name)), _clean(_join(dst_mod, dst_name)))
            for flat in flat_params
            for dst_mod, src_mod, _, dst_name, _, src_name in flat._shared_param_infos
        ]
        return list(dict.fromkeys(tied + _repeated_module_aliases(m.wrapped, flat_params)))
    # Non-flattened: the FlattenParamsWrapper does not track aliases, so find the names under which an owned
    # parameter appears more than once (tied weights), skipping nested instances, which report their own.
    owned = {id(h.param) for h in m.handles if not h.borrowed}
    first: Dict[int, str] = {}
    pairs: List[Tuple[str, str]] = []
    for name, p in m.wrapped.named_parameters(remove_duplicate=False):
        if id(p) not in owned or "_fsdp_wrapped_module" in name.split("."):
            continue
        clean = _clean(name)
        if id(p) in first:
            pairs.append((first[id(p)], clean))
        else:
            first[id(p)] = clean
    return pairs


def _repeated_module_aliases(fpw: nn.Module, flat_params: List[Any]) -> List[Tuple[str, str]]:
    """``(src, dst)`` pairs for the further paths of submodules registered under two names.

    A state dict holds such a module's parameters under each of its paths (torchscale's shared embeddings:
    ``decoder.embed_tokens`` is ``encoder.embed_tokens``), but the flattening records each module once
    (``named_modules()`` drops repeats).
    """
    paths: Dict[int, List[str]] = {}
    for mod_path, sub in fpw.named_modules(remove_duplicate=False):
        if "_fsdp_wrapped_module" not in mod_path.split("."):  # nested instances report their own
            paths.setdefault(id(sub), []).append(mod_path)
    aliases: List[Tuple[str, str]] = []
    for flat in flat_params:
        # (module, the path the flattening recorded for it, the parameter's name there, the name saved as source)
        holders = [(mod, path, name, _join(path, name)) for path, mod, name in flat._param_infos]
        holders += [
            (mod, path, name, _join(src_path, src_name))
            for path, src_path, mod, name, _, src_name in flat._shared_param_infos
        ]
        for owner, recorded, name, src in holders:
            others = [other for other in paths.get(id(owner), []) if other != recorded]
            aliases += [(_clean(src), _clean(_join(other, name))) for other in others]
    return aliases


def _persistent_buffer_names(fsdp: nn.Module) -> List[str]:
    """Clean names of every buffer a state dict of ``fsdp`` contains (non-persistent buffers are not saved)."""
    names: List[str] = []
    for mod_path, mod in fsdp.named_modules(remove_duplicate=False):
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                clean = _clean(_join(mod_path, name))
                if clean not in names:
                    names.append(clean)
    return names


# ---------------------------------------------------------------------------------------------------- consolidation


def consolidate_shard_weights(
    shard_weights: Sequence[Mapping[str, Any]],
    shard_metadata: Sequence[Mapping[str, Any]],
    with_module_buffers: bool = True,
    strict: bool = True,
) -> Dict[str, Tensor]:
    """Rebuild the full state dict from every rank's local state dict and metadata (no process group needed).

    Args:
        shard_weights: every rank's :meth:`local_state_dict`. In rank order for files without a checkpoint identity
            (upstream's); shards that carry one may come in any order (they are put back in rank order).
        shard_metadata: every rank's :meth:`local_metadata_dict`, in the same order as ``shard_weights``.
        with_module_buffers: also copy the buffers (taken from rank 0).
        strict: raise on a parameter or buffer that the metadata lists but rank 0's weights lack, and on shards
            of some ranks only; with ``False`` such entries are skipped and some ranks' shards are consolidated
            (what they hold whole: one MoE expert file, as fairseq's and metaseq's scripts do; a tensor they cannot
            make whole raises ``ValueError``), as upstream.

    Returns:
        The full state dict: the unwrapped module's keys (parameters first, then buffers), full shapes, values
        copied (they do not alias the inputs). Tied parameters appear under each of their names, as in
        :meth:`state_dict`.

    Raises:
        ValueError: the two lists differ in length or are empty; a rank's metadata does not describe the same
            model as rank 0's; the shards do not add up to the sizes the metadata gives (shards of another
            model, or not every rank's shards); or their checkpoint identities show shards of different
            checkpoints, a rank given twice or missing ranks.
        KeyError: with ``strict=True``, a listed entry is missing from rank 0's weights, or any rank lacks a
            shard that rank 0 has.
    """
    for what, given in (("shard_weights", shard_weights), ("shard_metadata", shard_metadata)):
        if isinstance(given, Mapping) or not isinstance(given, Sequence):
            # One rank's dict passed as is: its keys would be counted as ranks.
            raise TypeError(
                f"consolidate_shard_weights: {what} must be a list with one dict per rank, in rank order (e.g. "
                f"[ckpt['weights'] for ckpt in per_rank_checkpoints]), got a {type(given).__name__}"
            )
    if len(shard_weights) != len(shard_metadata) or len(shard_weights) == 0:
        raise ValueError(
            "consolidate_shard_weights needs one local state dict and one metadata dict per rank, in rank order; got "
            f"{len(shard_weights)} state dicts and {len(shard_metadata)} metadata dicts"
        )
    _check_metadata(shard_metadata)
    order = identity.check_shards(shard_weights, shard_metadata, "consolidate_shard_weights", partial_ok=not strict)
    if order is not None:  # files that say which rank saved them: use them in rank order, whatever order was given
        shard_weights = [shard_weights[pos] for pos in order]
        shard_metadata = [shard_metadata[pos] for pos in order]
    entries = list(shard_metadata[0]["param_metadata"])
    out: Dict[str, Tensor] = {}
    for idx, entry in enumerate(entries):
        path = entry["fsdp_path"]
        for backing, info in entry["params"].items():
            local_key = _join(path, backing)
            if local_key not in shard_weights[0]:
                if strict:
                    raise KeyError(
                        f"consolidate_shard_weights: rank 0's weights have no {local_key!r}, which its metadata lists "
                        "(pass strict=False to skip missing parameters)"
                    )
                continue
            names, shapes, numels = info["names"], info["shapes"], [int(n) for n in info["numels"]]
            ranks: Sequence[int] = range(len(shard_weights))
            if entry["no_broadcast_optim_state"]:
                # Upstream's rank 0 only: such an instance (MoE experts) is on a group of one rank, and each rank's
                # tensor is whole. One sharded over several ranks all the same stopped at rank 0's shard with an
                # error saying to pass every rank's files, which the caller had (found by a fuzz): those are used.
                first = _unpadded_piece(shard_weights, shard_metadata, 0, idx, backing, local_key)
                ranks = [0] if first.numel() == sum(numels) else ranks
            pieces = [_unpadded_piece(shard_weights, shard_metadata, r, idx, backing, local_key) for r in ranks]
            full = torch.cat(pieces)
            if full.numel() != sum(numels):
                raise ValueError(
                    f"consolidate_shard_weights: the shards of {local_key!r} given{identity.ranks_given(shard_metadata)} "
                    f"hold {full.numel()} elements after removing padding, but the metadata's parameters {names} need "
                    f"{sum(numels)}. Pass the local state dict and metadata of every rank of one checkpoint, in rank "
                    "order, and metadata written by the same model."
                )
            _check_padding_layout(local_key, [shard_weights[r][local_key].numel() for r in ranks], pieces, sum(numels))
            for name, shape, piece in zip(names, shapes, torch.split(full, numels)):
                out[_join(path, name)] = piece.view(shape).clone()
    for entry in entries:
        _copy_shared(out, entry, strict)
    if with_module_buffers:
        for name in shard_metadata[0]["buffer_names"]:
            if name not in shard_weights[0]:
                if strict:
                    raise KeyError(
                        f"consolidate_shard_weights: rank 0's weights have no buffer {name!r}, which its metadata "
                        "lists (pass strict=False to skip missing buffers)"
                    )
                continue
            value = shard_weights[0][name]
            out[name] = value.clone() if isinstance(value, Tensor) else value
    return out


def _check_metadata(shard_metadata: Sequence[Mapping[str, Any]]) -> None:
    """Every rank's metadata must describe the same instances and parameters as rank 0's."""
    for r, meta in enumerate(shard_metadata):
        if not isinstance(meta, Mapping) or "param_metadata" not in meta or "buffer_names" not in meta:
            raise ValueError(
                f"consolidate_shard_weights: shard_metadata[{r}] is not a local_metadata_dict() result (it needs "
                "'param_metadata' and 'buffer_names')"
            )
    reference = _layout(shard_metadata[0])
    for r, meta in enumerate(shard_metadata[1:], start=1):
        if _layout(meta) != reference:
            raise ValueError(
                f"consolidate_shard_weights: the metadata of rank {r} describes other instances or parameters than "
                "rank 0's; all metadata must come from the same model and checkpoint"
            )


def _layout(meta: Mapping[str, Any]) -> List[Any]:
    """What must agree between ranks: instance paths, backing names, parameter names and shapes."""
    return [
        (e["fsdp_path"], [(k, list(v["names"]), [tuple(s) for s in v["shapes"]]) for k, v in e["params"].items()])
        for e in meta["param_metadata"]
    ]


def _unpadded_piece(
    shard_weights: Sequence[Mapping[str, Any]],
    shard_metadata: Sequence[Mapping[str, Any]],
    rank: int,
    entry_idx: int,
    backing: str,
    local_key: str,
) -> Tensor:
    if local_key not in shard_weights[rank]:
        raise KeyError(
            f"consolidate_shard_weights: rank {rank}'s weights have no {local_key!r} but rank 0's do; the state dicts "
            "must all come from the same checkpoint"
        )
    shard = shard_weights[rank][local_key]
    padding = int(shard_metadata[rank]["param_metadata"][entry_idx]["params"][backing]["padding"])
    flat = shard.reshape(-1)
    if not 0 <= padding <= flat.numel():
        raise ValueError(
            f"consolidate_shard_weights: rank {rank}'s metadata says {local_key!r} has {padding} padding elements "
            f"but its shard has {flat.numel()} elements; metadata and weights are from different checkpoints"
        )
    piece: Tensor = flat[: flat.numel() - padding]
    return piece


def _check_padding_layout(local_key: str, shard_numels: List[int], pieces: List[Tensor], total: int) -> None:
    """Each rank's padding is decided by the flat size and the world size (equal shards, the padding at the end): a
    metadata file whose paddings are moved between ranks (they still add up) put a padding zero among the weights and
    dropped a weight."""
    if len(pieces) < 2:
        return
    size = shard_numels[0]
    for rank, (numel, piece) in enumerate(zip(shard_numels, pieces)):
        expected = min(max(total - rank * size, 0), size)
        if numel != size or piece.numel() != expected:
            raise ValueError(
                f"consolidate_shard_weights: rank {rank}'s shard of {local_key!r} keeps {piece.numel()} of its {numel} "
                f"elements after removing the padding its metadata gives, but {len(pieces)} equal shards of "
                f"{total} elements keep {expected} there (shards of {size}); the metadata does not belong to these "
                "weights. Pass the local state dict and metadata of every rank of one checkpoint, in rank order."
            )


def _copy_shared(out: Dict[str, Tensor], entry: Mapping[str, Any], strict: bool) -> None:
    path = entry["fsdp_path"]
    for src, dst in entry.get("shared_param_info", []):
        src_key, dst_key = _join(path, src), _join(path, dst)
        if src_key not in out:
            if strict:
                raise KeyError(f"consolidate_shard_weights: shared parameter {dst_key!r} aliases missing {src_key!r}")
            continue
        out[dst_key] = out[src_key]  # the same tensor under both names, as state_dict() returns tied weights


# ---------------------------------------------------------------------------------------------------- resharding


def reshard_full_state_dict(
    full_state_dict: Mapping[str, Any], metadata: Mapping[str, Any], world_size: int
) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """Cut a full state dict into the local state dicts of ``world_size`` ranks (no process group needed).

    The wrapping (which parameters each instance flattens, in which order) is read from ``metadata``, any rank's
    :meth:`local_metadata_dict` of a model wrapped the same way, at any world size. Each result loads with
    :meth:`load_local_state_dict` into that model wrapped at ``world_size``, as if it had been saved there.
    Instances with ``no_broadcast_optim_state`` keep the full tensor on every rank (upstream's reading: such an
    instance, MoE experts, is on a group of one rank); its files do not load into one sharded over several ranks.

    Args:
        full_state_dict: a full state dict (:meth:`state_dict` or :func:`consolidate_shard_weights` output).
        metadata: a local metadata dict describing the wrapping.
        world_size: the number of ranks to shard for.

    Returns:
        ``(weights, metadata)``: one local state dict and one metadata dict per rank.

    Raises:
        ValueError: ``world_size < 1``, or a parameter of another shape than the metadata records.
        TypeError: a parameter that is not a tensor.
        KeyError: a parameter or buffer the metadata lists is missing from ``full_state_dict``.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"reshard_full_state_dict: world_size must be a positive int, got {world_size!r}")
    if identity.of_weights(full_state_dict) is not None:
        raise ValueError(
            "reshard_full_state_dict: the state dict given is one rank's local_state_dict() (it carries a checkpoint "
            "identity), not a full state dict; consolidate the checkpoint first"
        )
    old_identity = identity.check_pair({}, metadata, "reshard_full_state_dict: metadata")
    # A new checkpoint: its own id, shared by its shards; the step carries over from the metadata's, if known.
    token, step = identity.new_token(), int(old_identity["step"]) if old_identity else 0
    weights: List[Dict[str, Any]] = [OrderedDict() for _ in range(world_size)]
    metas: List[Dict[str, Any]] = [
        {
            "param_metadata": [],
            "buffer_names": list(metadata["buffer_names"]),
            identity.IDENTITY_KEY: identity.make_identity(token, step, r, world_size),
        }
        for r in range(world_size)
    ]
    for r in range(world_size):
        identity.attach_to_weights(weights[r], metas[r][identity.IDENTITY_KEY])
    for entry in metadata["param_metadata"]:
        path = entry["fsdp_path"]
        per_rank: List[Dict[str, Any]] = [{} for _ in range(world_size)]
        for backing, info in entry["params"].items():
            full = torch.cat(
                [_full_param(full_state_dict, _join(path, n), shape) for n, shape in zip(info["names"], info["shapes"])]
            )
            if entry["no_broadcast_optim_state"] or world_size == 1:
                # Unsharded: every rank holds the whole tensor; a non-flattened parameter keeps its shape.
                unflattened = len(info["names"]) == 1 and backing == info["names"][0]
                whole = full.view(info["shapes"][0]) if unflattened else full
                pieces, paddings = [whole.clone() for _ in range(world_size)], [0] * world_size
            else:
                pieces, paddings = _shard_all(full, world_size)
            for r in range(world_size):
                weights[r][_join(path, backing)] = pieces[r]
                per_rank[r][backing] = {
                    "names": list(info["names"]),
                    "shapes": list(info["shapes"]),
                    "numels": list(info["numels"]),
                    "padding": paddings[r],
                }
        for r in range(world_size):
            metas[r]["param_metadata"].append({**entry, "params": per_rank[r]})
            # A non-flattened instance's tied parameters are in its local dicts under each name (the same shard),
            # and its loads want them all: left out, every rank refused the shards (a fuzz of checkpoints, s. 45).
            # A flattened one's ties live inside its flat parameter: their names are not keys of its local dicts.
            for src, dst in entry.get("shared_param_info", []):
                if _join(path, src) in weights[r]:
                    weights[r][_join(path, dst)] = weights[r][_join(path, src)]
    for name in metadata["buffer_names"]:
        value = _full_value(full_state_dict, name)
        for r in range(world_size):
            weights[r][name] = value.clone() if isinstance(value, Tensor) else value
    return weights, metas


def _full_value(full_state_dict: Mapping[str, Any], key: str) -> Any:
    if key not in full_state_dict:
        raise KeyError(f"reshard_full_state_dict: the full state dict has no {key!r}, which the metadata lists")
    return full_state_dict[key]


def _full_param(full_state_dict: Mapping[str, Any], key: str, shape: Any) -> Tensor:
    """The flattened value of parameter ``key``, which must be a tensor of the shape the metadata records (another
    shape was cut into shards that disagree with their metadata, a checkpoint no load accepts)."""
    value = _full_value(full_state_dict, key)
    if not isinstance(value, Tensor):
        raise TypeError(
            f"reshard_full_state_dict: {key!r} of the full state dict is a {type(value).__name__}, not a tensor; "
            "pass the model's full state dict"
        )
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"reshard_full_state_dict: {key!r} of the full state dict has shape {tuple(value.shape)}, but the metadata "
            f"records {tuple(shape)}; the full state dict and the metadata are of different models"
        )
    return value.reshape(-1)


def _shard_all(full: Tensor, world_size: int) -> Tuple[List[Tensor], List[int]]:
    """Every rank's chunk-and-pad shard of a 1-D tensor, and each rank's padding."""
    chunks = chunk_and_pad(full, world_size)
    shard_numel = chunks[0].numel()
    real = [max(0, min(shard_numel, full.numel() - r * shard_numel)) for r in range(world_size)]
    return [c.clone() for c in chunks], [shard_numel - n for n in real]
