# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The load of a DCP checkpoint directory (:func:`fairscale.nn.data_parallel.dcp.load`), without exchanges.

``dcp.load`` reads straight into *staging* tensors, one per flat parameter shard and per optimizer state of it
(dtype and device of the live one), presented as ``ShardedTensor`` s whose local shards are this rank's boxes of them
(:func:`.dcp_views.staging_views`, the layout :func:`.dcp_views.sharded_views` saves): a checkpoint of the same
layout is read chunk for chunk, one of another world size, wrapping or FSDP2's ``Shard(0)`` chunks is resharded by
DCP's planner (it intersects the saved chunks with the local boxes). Nothing live is touched until DCP succeeded on
every rank (it raises on every rank otherwise) and :func:`.dcp_state.set_state_dict` checked the values and the ranks
agreed; its commit then copies each box into its place in the live flat shard or optimizer state, locally. So a load
holds one staging copy of the shards beyond what DCP's reader holds (one saved chunk at a time with the default
reader, :class:`_Reader`), and a failed one changes nothing: its staging is dropped.
"""

import contextlib
import dataclasses
import io
import itertools
import os
import stat
from typing import Any, BinaryIO, Dict, List, Optional, Tuple, Union, cast

import torch

from fairscale.internal import collectives
from fairscale.internal.pickle_scan import FileWindow, PickleScanError, load_torch_file, scan_torch_save

from . import dcp_metadata, dcp_state
from .state_dict import _check_loadable
from .unit import FSDPUnit

try:  # torch >= 2.2
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
except ImportError:  # pragma: no cover - old torch: dcp._options refuses every call first
    FileSystemReader = object  # type: ignore[assignment,misc]
    DefaultLoadPlanner = object  # type: ignore[assignment,misc]

__all__ = ["MODEL_KEY", "OPTIMIZER_KEY", "METADATA_FILE", "CheckpointNotFoundError", "load", "error_summary"]

PathLike = Union[str, "os.PathLike[str]"]

# Top-level keys of the checkpoints that save()/load() write and read (torch's DCP tutorials use the same).
MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
# The file DCP writes last, once every rank's data is written: a directory without it holds no checkpoint.
METADATA_FILE = ".metadata"


class CheckpointNotFoundError(FileNotFoundError):
    """No complete DCP checkpoint at the path given to ``load`` (its ``.metadata`` file is missing)."""


def metadata_path(checkpoint_id: PathLike) -> str:
    return os.path.join(os.fspath(checkpoint_id), METADATA_FILE)


def load(
    unit: FSDPUnit,
    optims: Tuple[torch.optim.Optimizer, ...],
    checkpoint_id: PathLike,
    storage_reader: Optional[Any],
    strict: bool,
    process_group: Optional[Any] = None,
) -> Tuple[List[str], List[str]]:
    """See :func:`fairscale.nn.data_parallel.dcp.load`; returns the model's ``(missing, unexpected)`` keys.
    ``process_group``: the ranks that read this checkpoint (``None``: the world)."""
    # Before anything: creating a fresh optimizer's state below takes a step, which writes the parameters in place (a
    # pending backward then failed, though the load itself was refused later).
    _check_loadable(unit, "load")
    reader = storage_reader if storage_reader is not None else _Reader(os.fspath(checkpoint_id))
    saved_keys = _saved_keys(unit, checkpoint_id, reader if storage_reader is None else None, process_group)
    model_keys = {k[len(MODEL_KEY) + 1 :] for k in saved_keys if k.startswith(MODEL_KEY + ".")}
    if optims and not any(k.startswith(OPTIMIZER_KEY + ".") for k in saved_keys):
        raise RuntimeError(
            f"load: the checkpoint {os.fspath(checkpoint_id)!r} holds no optimizer state (it was saved without "
            "optimizers); pass optimizers=None to load the model alone. Nothing was loaded."
        )
    # What dcp.load reads into: staging copies of the shards, in this model's own layout (no communication).
    msd = dcp_state.get_model_state_dict(unit, False, False, dcp_state.STAGING, "load")
    missing = [k for k in msd if k not in model_keys]
    unexpected = sorted(model_keys - set(msd))
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"load: the checkpoint {os.fspath(checkpoint_id)!r} does not match this model (missing key(s): "
            f"{missing}; unexpected key(s): {unexpected}); it was saved from another model. Pass strict=False to load "
            "the matching keys only. Nothing was loaded."
        )
    for key in missing:
        del msd[key]
    state: Dict[str, Any] = {MODEL_KEY: msd}
    fresh = [not o.state for o in optims]
    if optims:
        had_grads = any(p.grad is not None for o in optims for g in o.param_groups for p in g["params"])
        osd = dcp_state.get_optimizer_state_dict(unit, optims, False, False, values=dcp_state.STAGING, what="load")
        state[OPTIMIZER_KEY] = osd
        saved_groups = _saved_group_count(saved_keys)
        if saved_groups is not None and saved_groups != len(osd["param_groups"]):
            # DCP failed on the first hyper-parameter of a group the checkpoint lacks ("Missing key in checkpoint
            # state_dict: optimizer.param_groups.1.lr"; a fuzz of DCP, session 45).
            _forget_created_state(optims, fresh)
            raise RuntimeError(
                f"load: the checkpoint's optimizer has {saved_groups} parameter group(s) but {_kinds(optims)} has "
                f"{len(osd['param_groups'])}: build the optimizer with the parameter groups it was saved with, or "
                "pass optimizers=None to load the model alone. Nothing was loaded."
            )
        prefix = f"{OPTIMIZER_KEY}.state."
        saved_state = {k[len(prefix) :].rsplit(".", 1)[0] for k in saved_keys if k.startswith(prefix)}
        # Parameters the checkpoint has no optimizer state for (an instance that had no gradient yet when it was
        # saved, or new layers loaded with strict=False): nothing to read, and DCP refused the whole load for them
        # ("Missing key in checkpoint state_dict"). They are left out, and get no state, as torch's
        # Optimizer.load_state_dict leaves a parameter the dict has no state for.
        for name in set(osd["state"]) - saved_state:
            del osd["state"][name]
        without = sorted(saved_state - set(osd["state"]))
        if without:
            _forget_created_state(optims, fresh)
            why = (
                "its parameters have gradients but no step was taken yet (an optimizer state is only created without "
                "gradients). Call optimizer.zero_grad(set_to_none=True) first."
                if had_grads
                else f"{_kinds(optims)} keeps no state for them after a step: the checkpoint was saved by another "
                "optimizer type or with other settings (e.g. SGD with momentum). Build the optimizer the checkpoint "
                "was saved with, or pass optimizers=None to load the model alone."
            )
            raise RuntimeError(
                f"load: the checkpoint has optimizer state for {without[:4]}{'...' if len(without) > 4 else ''} but "
                f"the optimizers have none to load it into: {why} Nothing was loaded."
            )
        other = _other_state_kinds(saved_keys, prefix, osd["state"])
        if other:
            _forget_created_state(optims, fresh)
            name, saved_leaves, live_leaves = other
            raise RuntimeError(
                f"load: the checkpoint's optimizer state for {name!r} holds {saved_leaves} but {_kinds(optims)} "
                f"keeps {live_leaves}: it was saved by another optimizer type or with other settings (e.g. momentum, "
                "amsgrad). Build the optimizer the checkpoint was saved with, or pass optimizers=None to load the "
                "model alone. Nothing was loaded."
            )
    try:
        # DCP's default planner drops a ShardedTensor without local shards (a parameter that lies in other ranks'
        # shards only), and a key of the checkpoint that is then absent from the dict makes it flatten the dict as
        # torch 2.3 did, which no longer matches the checkpoint. Such tensors are only read by the ranks that hold them.
        planner = _SizeCheckingPlanner(flatten_sharded_tensors=False)
        with _plain_tensor_attributes():
            _dcp_load(
                state, checkpoint_id=checkpoint_id, storage_reader=reader, planner=planner, process_group=process_group
            )
    except (Exception, CheckpointException) as e:
        _forget_created_state(optims, fresh)
        raise RuntimeError(
            f"load: reading the checkpoint {os.fspath(checkpoint_id)!r} into this model failed; nothing was loaded. "
            f"{error_summary(e)}"
        ) from e
    # Every rank read its staging; set_state_dict checks it, the ranks agree, and only then is it copied in.
    try:
        if not optims:
            return dcp_state.set_state_dict(unit, (), state[MODEL_KEY], None, strict, "set_model_state_dict")
        return dcp_state.set_state_dict(unit, optims, state[MODEL_KEY], state[OPTIMIZER_KEY], strict, "set_state_dict")
    except BaseException:
        _forget_created_state(optims, fresh)
        raise


class _SizeCheckingPlanner(DefaultLoadPlanner):
    """DCP's default load planner, refusing a saved tensor whose size differs from the live one's, as torch 2.6 and
    later do: torch 2.5's read the overlap of the saved and the live boxes and left the rest as it was, without a
    word (a checkpoint of another model loaded partly; found by the torch 2.5 run)."""

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()  # (it may flatten self.state_dict for a checkpoint of older torch)
        saved = self.metadata.state_dict_metadata if self.metadata is not None else {}
        for fqn, obj in self.state_dict.items():
            md = saved.get(fqn)
            if isinstance(md, TensorStorageMetadata) and isinstance(obj, torch.Tensor) and md.size != obj.size():
                raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
            if isinstance(md, BytesStorageMetadata) and isinstance(obj, torch.Tensor):
                raise ValueError(f"the checkpoint saved {fqn} as an object, but the model's {fqn} is a tensor")
        return plan

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # DCP's planner reads a saved object (an optimizer's lr or betas, any non-tensor entry) with
        # torch.load(weights_only=False): a checkpoint from someone else would run code on every rank that loads it.
        # Read it with the restricted unpickler, after a scan of its pickle (torch's weights-only loader hashed a tuple
        # shared at every level as a dict key 2**depth times: a 1 KB object hung every rank), and hand DCP's planner
        # that object, saved again by torch.save, so it files it where it belongs (its private mappings differ between
        # torch releases).
        try:
            # On the device it was saved from, as DCP's planner loads it (a capturable optimizer's lr tensor).
            obj = load_torch_file(value, map_location=None)
        except PickleScanError as e:
            raise dcp_metadata.UntrustedCheckpointError(
                f"refusing the saved object {read_item.dest_index.fqn!r}: it is not plain data (tensors, numbers, "
                f"strings and their containers) of its size: {e.reason}. fairscale scans each saved object, then loads "
                "it with torch.load(weights_only=True), and never runs code from a checkpoint"
            ) from None
        except Exception as e:
            raise dcp_metadata.UntrustedCheckpointError(
                f"refusing the saved object {read_item.dest_index.fqn!r}: it is not plain data (tensors, numbers, "
                f"strings and their containers) and fairscale never runs code from a checkpoint ({e})"
            ) from None
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


class _Reader(FileSystemReader):
    """DCP's reader of a directory, which reads its ``.metadata`` once for :func:`_saved_keys` and ``dcp.load``, with
    a restricted unpickler (:mod:`.dcp_metadata`), and reads each file's chunks large and small in turn.

    The metadata lists every saved chunk (for a box-chunked checkpoint, up to ``2 * ndim - 1`` per tensor and rank):
    unpickling it twice would cost a tenth of a load. DCP's reader loads every saved chunk whole and holds the last one
    until the next is loaded, so two large chunks in a row (a parameter's ``exp_avg``, then its ``exp_avg_sq``) would
    both be held, on top of the staging copy.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._metadata: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        # Never torch's pickle.load: the file could name code to run (see dcp_metadata).
        if args or kwargs:  # another file (a rank's own metadata)
            return dcp_metadata.read_metadata(self, kwargs.get("rank", args[0] if args else None))
        if self._metadata is None:
            self._metadata = dcp_metadata.read_metadata(self)
        elif getattr(self._metadata, "storage_meta", None) is not None:
            self._metadata.storage_meta.load_id = self.load_id  # as a fresh read would (reset() draws a new one)
        return self._metadata

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        """The view of one saved entry, scanned: DCP's reader loads each (a tensor too: DCP saves each with
        ``torch.save``) with ``torch.load(weights_only=True)``, which hashed a tuple shared at every level as a
        dict key ``2**depth`` times: a 1 KB entry hung every rank (a review, session 50)."""
        view = super()._slice_file(file, sinfo)
        if getattr(sinfo, "transform_descriptors", None):
            raise dcp_metadata.UntrustedCheckpointError(
                f"the checkpoint's data file {sinfo.relative_path!r} holds an entry stored through transforms "
                f"({list(sinfo.transform_descriptors)[:3]}, e.g. compression), which fairscale's reader does not scan "
                "and load; fairscale's saves never write them. For a checkpoint you trust, pass "
                "storage_reader=torch.distributed.checkpoint.FileSystemReader(path)"
            )
        try:
            scan_torch_save(cast(BinaryIO, FileWindow(file, sinfo.offset, sinfo.length)), int(sinfo.length))
        except PickleScanError as e:
            raise dcp_metadata.UntrustedCheckpointError(
                f"refusing the entry of the checkpoint's data file {sinfo.relative_path!r} at byte {sinfo.offset}: "
                f"{e.reason}. fairscale scans each entry before torch.load(weights_only=True) reads it"
            ) from None
        view.seek(0)
        return view

    def read_data(self, plan: Any, planner: Any) -> Any:
        per_file: Dict[str, List[Any]] = {}  # DCP reads file by file, in the plan's order within each
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            end = max(
                self.storage_data[item.storage_index].offset + self.storage_data[item.storage_index].length
                for item in items
            )
            _check_data_file(os.fspath(self.path), relative_path, end)
        order: List[Any] = []
        for items in per_file.values():
            # Only a tensor replaces the chunk DCP holds (objects are read apart): they go first, in their order.
            order.extend(item for item in items if item.type != LoadItemType.TENSOR)
            tensors = [item for item in items if item.type == LoadItemType.TENSOR]
            by_size = sorted(tensors, key=lambda item: self.storage_data[item.storage_index].length, reverse=True)
            half = (len(by_size) + 1) // 2
            pairs = itertools.zip_longest(by_size[:half], reversed(by_size[half:]))  # largest, smallest, 2nd largest
            order.extend(item for pair in pairs for item in pair if item is not None)
        return super().read_data(dataclasses.replace(plan, items=order), planner)


def _check_data_file(directory: str, relative_path: Any, end: int) -> None:
    """Raise unless ``relative_path`` (from the checkpoint's metadata) names a regular file of ``directory`` itself, at
    least ``end`` bytes long.

    DCP's reader opens whatever the metadata names: ``../x``, an absolute path or a symlink read another file into the
    model, a pipe or ``/dev/stdin`` blocked the load, and ``/dev/zero`` with a huge length filled the memory. DCP's
    writer only ever writes plain file names into the checkpoint's directory.
    """
    name = relative_path if isinstance(relative_path, str) else None
    if name is None or name in ("", ".", "..") or "\0" in name or os.path.basename(name) != name or "\\" in name:
        raise dcp_metadata.UntrustedCheckpointError(
            f"refusing the data file {relative_path!r} named by the checkpoint's metadata: DCP writes plain file names "
            "inside the checkpoint directory, never a path"
        )
    path = os.path.join(directory, name)
    try:
        info = os.lstat(path)
    except OSError as e:
        raise dcp_metadata.UntrustedCheckpointError(
            f"the checkpoint's data file {name!r} cannot be read: {e}"
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise dcp_metadata.UntrustedCheckpointError(
            f"refusing the checkpoint's data file {name!r}: it is not a regular file (a symlink, pipe or device)"
        )
    if info.st_size < end:
        raise dcp_metadata.UntrustedCheckpointError(
            f"the checkpoint's data file {name!r} has {info.st_size} bytes, but its metadata reads up to byte {end}: "
            "the checkpoint is truncated or damaged"
        )


def _plain_tensor_attributes() -> Any:
    """A context in which a ``ShardedTensor``'s ``size()`` and ``device`` are the wrapper tensor's own.

    Its ``__torch_function__`` answers them otherwise, warning of its deprecation and validating its arguments on every
    call: DCP asks a few times per tensor, a third of a load's CPU time. The wrapper holds the same global size (and
    its device is not ``meta``, the only one DCP looks for); the local shards DCP reads into are plain tensors.
    """
    disable = getattr(torch._C, "DisableTorchFunctionSubclass", None)
    return disable() if disable is not None else contextlib.nullcontext()


def _saved_keys(unit: FSDPUnit, checkpoint_id: PathLike, reader: Optional[Any], group: Optional[Any]) -> List[str]:
    """The (flattened) keys of the checkpoint's ``.metadata`` (read with ``reader``, by default a new :class:`_Reader`);
    the same error on every rank of ``group`` (the checkpoint's; ``None``: the world) if it cannot be read. Ranks in
    the messages are ranks of ``group``."""
    path = os.fspath(checkpoint_id)
    keys: List[str] = []
    problem: Optional[str] = None
    if not os.path.exists(metadata_path(path)):
        problem = "missing"
    else:
        try:
            metadata = (reader if reader is not None else _Reader(path)).read_metadata()
            keys = list(metadata.state_dict_metadata)
            problem = dcp_metadata.coverage_problem(metadata)
            unsafe = dcp_metadata.storage_problem(metadata)  # for a caller's reader too, which opens what it names
            if unsafe is not None:
                problem = f"{dcp_metadata.UntrustedCheckpointError.__name__}: refusing {METADATA_FILE}: {unsafe}"
        except Exception as e:  # a truncated or foreign file: every rank must learn it, not only this one
            problem = f"{type(e).__name__}: {e}"
    with unit.device.as_current():  # NCCL object collectives allocate on the current device
        problems = collectives.all_gather_object(problem, group)
    if "missing" in problems:
        raise CheckpointNotFoundError(
            f"load: no complete checkpoint at {path!r}: {METADATA_FILE} is missing on rank(s) "
            f"{[r for r, p in enumerate(problems) if p == 'missing']} (the path is wrong, or the save was interrupted "
            "or has not finished: DCP writes it last). Nothing was loaded."
        )
    bad = [(r, p) for r, p in enumerate(problems) if p is not None]
    untrusted = [(r, p) for r, p in bad if p.startswith(dcp_metadata.UntrustedCheckpointError.__name__)]
    if untrusted:
        raise dcp_metadata.UntrustedCheckpointError(
            f"load: {'; '.join(f'rank {r}: {p}' for r, p in untrusted)}. Nothing was loaded."
        )
    if bad:
        raise RuntimeError(
            f"load: the {METADATA_FILE} of {path!r} is not usable ({'; '.join(f'rank {r}: {p}' for r, p in bad)}); "
            "it is not a complete DCP checkpoint. Nothing was loaded."
        )
    return keys


def _kinds(optims: Tuple[torch.optim.Optimizer, ...]) -> str:
    return "this optimizer (" + ", ".join(type(o).__name__ for o in optims) + ")"


def _saved_group_count(saved_keys: List[str]) -> Optional[int]:
    """How many parameter groups the checkpoint's optimizer has (``None``: its keys do not say)."""
    prefix = f"{OPTIMIZER_KEY}.param_groups."
    indices = {key[len(prefix) :].split(".", 1)[0] for key in saved_keys if key.startswith(prefix)}
    return 1 + max(int(i) for i in indices) if indices and all(i.isdigit() for i in indices) else None


def _other_state_kinds(
    saved_keys: List[str], prefix: str, live: Dict[str, Any]
) -> Optional[Tuple[str, List[str], List[str]]]:
    """The first parameter whose saved optimizer state has other entries than the live optimizer keeps for it, with
    both lists of entries; ``None`` if all match.

    DCP reads only what the live state asks for: without this an Adam checkpoint failed in SGD's ``momentum_buffer``
    with DCP's bare "Missing key", and a saved entry the live optimizer lacks (``max_exp_avg_sq`` of ``amsgrad``) was
    left unread without a word.
    """
    saved: Dict[str, List[str]] = {}
    for key in saved_keys:
        if key.startswith(prefix):
            name, leaf = key[len(prefix) :].rsplit(".", 1)
            saved.setdefault(name, []).append(leaf)
    for name in sorted(saved):
        entries = live.get(name)
        if isinstance(entries, dict) and set(entries) != set(saved[name]):
            return name, sorted(saved[name]), sorted(entries)
    return None


def _forget_created_state(optims: Tuple[torch.optim.Optimizer, ...], fresh: List[bool]) -> None:
    """Optimizers that had no state before get none back (their state was only created for ``dcp.load`` to fill)."""
    for o, was_fresh in zip(optims, fresh):
        if was_fresh:
            o.state.clear()


def error_summary(error: BaseException) -> str:
    """A DCP ``CheckpointException``'s failures, one per failing rank (any other error: its type and message)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, pair in sorted(failures.items()):
            exc = pair[0] if isinstance(pair, tuple) else pair
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return "; ".join(parts)
    return f"{type(error).__name__}: {error}"
