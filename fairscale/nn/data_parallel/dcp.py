# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""PyTorch distributed checkpoints (DCP) of FullyShardedDataParallel models, in FSDP2's layout.

The functions mirror :mod:`torch.distributed.checkpoint.state_dict` (same names, same arguments), so that the dicts
go straight to ``torch.distributed.checkpoint.save`` / ``load``::

    import torch.distributed.checkpoint as dcp
    from fairscale.nn.data_parallel import dcp as fsdp_dcp

    state = {
        "model": fsdp_dcp.get_model_state_dict(model),
        "optimizer": fsdp_dcp.get_optimizer_state_dict(model, optim),
    }
    dcp.save(state, checkpoint_id="ckpt/step-100")

    # later, at any world size, with any wrapping:
    state = {
        "model": fsdp_dcp.get_model_state_dict(model),
        "optimizer": fsdp_dcp.get_optimizer_state_dict(model, optim),
    }
    dcp.load(state, checkpoint_id="ckpt/step-100")
    fsdp_dcp.set_model_state_dict(model, state["model"])
    fsdp_dcp.set_optimizer_state_dict(model, optim, state["optimizer"])

:func:`save`, :func:`async_save` and :func:`load` do this in one call each, with the checks a checkpoint directory
needs. :func:`save` does not build those dicts: it hands DCP the pieces of every parameter that lie in this rank's flat
shard, as views (``ShardedTensor``), without copy or exchange. The checkpoint then has other chunk boundaries than
FSDP2's, which ``dcp.load`` reshards like any others: it loads wherever the dicts' checkpoint loads. :func:`load`
does not build them either: it reads into a staging copy of this rank's flat shards, presented in the same pieces,
and copies it in once every rank read it and the values were checked, without exchange.

The layout is FSDP2's (``torch.distributed.fsdp.fully_shard``): every original parameter is a DTensor with
``Shard(0)`` (rank ``r`` holds rows ``[r * C, (r + 1) * C)``, ``C = ceil(dim0 / W)``) over a 1-D DeviceMesh of the
model's process group, under its user-visible name (the keys of ``model.state_dict()``); buffers are plain tensors.
The optimizer state dict is keyed by the same names, per original parameter, as
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` makes it: per-parameter states are DTensors
laid out like their parameter, scalar states (``step``) plain tensors, and ``param_groups`` list parameter names.
So a checkpoint written here loads into an FSDP2 model with torch's own ``set_model_state_dict`` /
``set_optimizer_state_dict``, into a plain module, or here at another world size and wrapping; and one written by
FSDP2 loads here.

With hybrid sharding (``replicate_process_group``) the layout is FSDP2 HSDP's: DTensors with
``(Replicate(), Shard(0))`` (``(Replicate(), Replicate())`` for 0-dim) over a 2-D DeviceMesh with dimensions
``("replicate", "shard")``, ``mesh[i][j]`` the rank with replicate index ``i`` and shard index ``j``. DCP writes each
chunk once (from one replica), so the checkpoint is the size of one replica's, and it loads into any of the above
(full sharding, FSDP2 or FSDP2 HSDP, another hybrid layout) as well as the reverse.

Every function is collective: call it on every rank of the model's process group (with hybrid sharding, every rank of
the world), in the same order.
"""

import inspect
import os
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import nn

from fairscale.internal import collectives
from fairscale.internal.agreement import check_gathered_agree, check_outcome_agrees

from ._fsdp import dcp_files, dcp_layout, dcp_load, dcp_state, dcp_views, hybrid
from ._fsdp.dcp_load import METADATA_FILE, MODEL_KEY, OPTIMIZER_KEY, CheckpointNotFoundError
from ._fsdp.dcp_metadata import UntrustedCheckpointError
from ._fsdp.dcp_options import checked_options
from ._fsdp.unit import FSDPUnit, unit_of

try:  # torch >= 2.2
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.checkpoint.state_dict_saver import async_save as _dcp_async_save
    from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save
except ImportError:  # pragma: no cover - old torch
    StateDictOptions = None  # type: ignore[assignment,misc]
# Whether async_save takes a stager (torch >= 2.7): the snapshot state dict is staged already.
_ASYNC_STAGER = StateDictOptions is not None and "async_stager" in inspect.signature(_dcp_async_save).parameters

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "get_state_dict",
    "set_state_dict",
    "save",
    "async_save",
    "load",
    "CheckpointNotFoundError",
    "UntrustedCheckpointError",
]

Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer]]
# CheckpointNotFoundError (load's: no complete checkpoint at the path) and the keys and metadata file of a checkpoint
# directory (MODEL_KEY, OPTIMIZER_KEY, METADATA_FILE) come from ._fsdp.dcp_load, which raises it; it is public here.
CheckpointNotFoundError.__module__ = __name__
# UntrustedCheckpointError (load's: the .metadata names something to run) comes from ._fsdp.dcp_metadata.
UntrustedCheckpointError.__module__ = __name__


class IncompatibleKeys(NamedTuple):
    """What :func:`set_model_state_dict` did not load (as ``nn.Module.load_state_dict`` returns it)."""

    missing_keys: List[str]
    unexpected_keys: List[str]


def _root_unit(model: nn.Module, what: str) -> FSDPUnit:
    unit = unit_of(model)
    if unit is None:
        raise TypeError(
            f"{what}: model must be the root FullyShardedDataParallel instance, got {type(model).__name__}. For a "
            "module that fairscale does not shard, use torch.distributed.checkpoint.state_dict's functions."
        )
    return unit


def _options(options: Any, what: str, submodules: Any = None) -> Any:
    if StateDictOptions is not None and submodules is not None:
        raise NotImplementedError(f"{what}: submodules (deprecated in torch) is not supported; pass None")
    return checked_options(
        options,
        what,
        StateDictOptions is not None,
        "torch.distributed.checkpoint with async_save (torch >= 2.3)",
        "; sharded state dicts only (for a full state dict use model.state_dict() and gather_full_optim_state_dict())",
    )


# ---------------------------------------------------------------------------------------------------- model


def get_model_state_dict(
    model: nn.Module, *, submodules: Optional[Any] = None, options: Optional[Any] = None
) -> Dict[str, Any]:
    """The model's sharded state dict for ``torch.distributed.checkpoint`` (collective).

    Builds this rank's dim-0 chunk of every original parameter from the flat shards, one flat parameter (or a few
    small ones) at a time: the ranks exchange only the elements the other layout puts on another rank, so beyond the
    result a rank holds the exchange buffers of about one FSDP instance's full parameters, never the whole model.
    The values are copies: the dict can be saved asynchronously while training goes on, and loading into it
    (``dcp.load``) changes nothing in the model until :func:`set_model_state_dict`.

    Args:
        model: the root FullyShardedDataParallel instance.
        submodules: not supported (deprecated in torch); must be ``None``.
        options: a ``torch.distributed.checkpoint.state_dict.StateDictOptions``. ``cpu_offload`` puts the values
            on the CPU; ``ignore_frozen_params`` leaves out parameters that do not require gradients;
            ``full_state_dict``, ``broadcast_from_rank0`` and ``flatten_optimizer_state_dict`` are not supported.

    Returns:
        ``{name: value}`` with the keys of ``model.state_dict()``, in its order: parameters as DTensors
        (``Shard(0)``; ``Replicate`` for 0-dim ones) over a 1-D DeviceMesh of the model's process group (with hybrid
        sharding ``(Replicate(), Shard(0))`` over the 2-D ``("replicate", "shard")`` mesh), in the parameter dtype
        (fp32 in mixed precision); buffers as plain tensors (fp32 in mixed precision). Without an initialised
        ``torch.distributed`` (one process), plain full tensors.

    Raises:
        TypeError: ``model`` is not an FSDP instance.
        ValueError: ``model`` is a nested instance, or an instance shards over another group than the root's.
        NotImplementedError: an unsupported option.
    """
    what = "get_model_state_dict"
    opts = _options(options, what, submodules)
    return dcp_state.get_model_state_dict(_root_unit(model, what), opts.cpu_offload, opts.ignore_frozen_params)


def set_model_state_dict(
    model: nn.Module, model_state_dict: Dict[str, Any], *, options: Optional[Any] = None
) -> IncompatibleKeys:
    """Load a sharded (or full) model state dict into the model (collective, all-or-nothing).

    Every value may be a DTensor laid out as :func:`get_model_state_dict` makes it (e.g. after
    ``dcp.load(sd, ...)`` into that function's result, which reshards a checkpoint of any world size; or FSDP2's
    state dict at the same world size and group; with hybrid sharding, FSDP2 HSDP's ``(Replicate(), Shard(0))`` over
    the same shard groups), a ``Replicate`` DTensor, or a plain tensor of the full shape.

    Every rank first checks its dict against the model (keys, shapes, layouts) and the ranks agree; if any rank's
    dict is wrong, every rank raises the same error and nothing is changed. Only then are values exchanged and
    written, one flat parameter at a time.

    Args:
        model: the root FullyShardedDataParallel instance.
        model_state_dict: ``{name: value}`` with the keys of ``model.state_dict()``.
        options: ``StateDictOptions``; ``strict=False`` loads the matching keys and reports the others.

    Returns:
        ``IncompatibleKeys(missing_keys, unexpected_keys)`` (both empty with ``strict=True``).

    Raises:
        RuntimeError: with ``strict=True``, missing or unexpected keys (named); or the model is between a forward and
            its backward.
        ValueError: a value's shape or layout does not fit the model, or the ranks passed different kinds of values.
        TypeError: a value is not a tensor.
    """
    what = "set_model_state_dict"
    opts = _options(options, what)
    unit = _root_unit(model, what)
    missing, unexpected = dcp_state.set_state_dict(unit, (), model_state_dict, None, opts.strict, what)
    return IncompatibleKeys(missing, unexpected)


# ---------------------------------------------------------------------------------------------------- optimizers


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: Optional[Any] = None,
    options: Optional[Any] = None,
) -> Dict[str, Any]:
    """The sharded state dict of torch optimizers over the model's flat parameters (collective).

    The optimizers see FSDP's flat parameter shards; their state is cut back into one entry per original
    parameter, keyed by its name, as torch's ``get_optimizer_state_dict`` makes it for FSDP2. Like torch's, an
    optimizer without any state (before its first step) first takes one step with zero gradients at learning rate
    0, which creates its state and leaves the parameters unchanged, so that ``dcp.load`` has something to fill.

    Args:
        model: the root FullyShardedDataParallel instance.
        optimizers: one optimizer or several, each over parameters of ``model`` (``model.parameters()``).
        submodules: not supported; must be ``None``.
        options: ``StateDictOptions`` (``cpu_offload``, ``ignore_frozen_params``; see
            :func:`get_model_state_dict`).

    Returns:
        ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``: per-parameter states
        (``exp_avg``, ``momentum_buffer``...) as DTensors laid out like the parameter, scalar states (``step``)
        as plain tensors or numbers. Flat parameters without state (never stepped) have no entries.

    Raises:
        ValueError: an optimizer holds a parameter that is not the model's, or the ranks' optimizer states differ.
        NotImplementedError: a state that is neither element-wise nor scalar (e.g. factored second moments).
    """
    what = "get_optimizer_state_dict"
    opts = _options(options, what, submodules)
    optims = dcp_state.as_optimizers(optimizers, what)
    return dcp_state.get_optimizer_state_dict(
        _root_unit(model, what), optims, opts.cpu_offload, opts.ignore_frozen_params
    )


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    optim_state_dict: Dict[str, Any],
    *,
    options: Optional[Any] = None,
) -> None:
    """Load a name-keyed optimizer state dict into torch optimizers over the model's flat parameters (collective).

    The values may be laid out as :func:`get_optimizer_state_dict` makes them (e.g. after ``dcp.load`` into its
    result), be FSDP2's at the same world size, or be full tensors. The original parameters that share one flat
    parameter must all have state, or none, and the same scalar states (``step``). The new flat state is built
    completely before ``optimizer.load_state_dict`` runs; a wrong dict on any rank raises the same error on every
    rank and changes nothing.

    Args:
        model: the root FullyShardedDataParallel instance.
        optimizers: the optimizer(s) the state dict was taken from (same parameter grouping by name).
        optim_state_dict: ``{"state": ..., "param_groups": ...}`` keyed by parameter name.
        options: ``StateDictOptions`` (no option changes the load).

    Raises:
        ValueError: missing or mismatching entries (named), or parameter groups that differ from the saved ones.
        TypeError: a value of the wrong type.
        NotImplementedError: a flattened optimizer state dict.
    """
    what = "set_optimizer_state_dict"
    opts = _options(options, what)
    optims = dcp_state.as_optimizers(optimizers, what)
    dcp_state.set_state_dict(_root_unit(model, what), optims, None, optim_state_dict, opts.strict, what)


def get_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: Optional[Any] = None,
    options: Optional[Any] = None,
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(get_model_state_dict(model), get_optimizer_state_dict(model, optimizers))`` (collective).

    Args:
        model: the root FullyShardedDataParallel instance.
        optimizers: one optimizer or several over the model's parameters.
        submodules: not supported; must be ``None``.
        options: ``StateDictOptions``, for both.

    Returns:
        The model and the optimizer state dicts.
    """
    return (
        get_model_state_dict(model, submodules=submodules, options=options),
        get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options),
    )


def set_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    model_state_dict: Dict[str, Any],
    optim_state_dict: Dict[str, Any],
    options: Optional[Any] = None,
) -> IncompatibleKeys:
    """Load both state dicts (collective); all-or-nothing for the pair.

    Both dicts are checked (and the ranks agree) before anything is written: a wrong model dict leaves the
    optimizers unchanged too, and the reverse.

    Args:
        model: the root FullyShardedDataParallel instance.
        optimizers: one optimizer or several over the model's parameters.
        model_state_dict: see :func:`set_model_state_dict`.
        optim_state_dict: see :func:`set_optimizer_state_dict`.
        options: ``StateDictOptions``, for both.

    Returns:
        The model's ``IncompatibleKeys``.
    """
    what = "set_state_dict"
    opts = _options(options, what)
    optims = dcp_state.as_optimizers(optimizers, what)
    unit = _root_unit(model, what)
    missing, unexpected = dcp_state.set_state_dict(unit, optims, model_state_dict, optim_state_dict, opts.strict, what)
    return IncompatibleKeys(missing, unexpected)


# ---------------------------------------------------------------------------------------------------- directories


def _agree_on_call(
    unit: FSDPUnit, process_group: Any, checkpoint_id: Any, flag: bool, settings: Dict[str, Any], what: str
) -> bool:
    """Check the call on every rank of the model, in one gather: whether ``flag`` holds on any of them.

    The gather runs over the model's own group (its shard group; the world with hybrid sharding), which every rank
    of the model shares whatever it passed: ``process_group`` must be the model's ranks on every rank (else each rank
    raises its check's error), the same communicator on every rank (a group of the same ranks created twice is
    another one), and the ``checkpoint_id`` and ``settings`` (overwrite, optimizers, strict) the same. A rank that
    passed another value got its own error, or went on into DCP's collectives while the others waited there: each
    rank raises the same error now, before anything is written or read. Ranks given other directories saved a
    checkpoint that cannot load (each rank's shards in its own directory, ``.metadata`` in rank 0's only), or loaded
    a model that was part one checkpoint, part another, without an error.

    Raises:
        ValueError: ``process_group`` does not hold exactly the model's ranks on some rank (on every rank).
        NotImplementedError: this torch's DCP cannot work over ``process_group`` (on every rank).
        RanksDisagreeError: the ranks passed other values (on every rank).
    """
    problem: Optional[Tuple[str, str]] = None
    try:
        dcp_layout.check_checkpoint_group(unit, process_group, what)
    except (ValueError, NotImplementedError) as e:
        problem = (type(e).__name__, str(e))
    call = {"checkpoint_id": os.fspath(checkpoint_id), "process_group": collectives.group_identity(process_group)}
    call.update(settings)
    model_group = hybrid.world_group() if unit.config.replicate_process_group is not None else unit.config.process_group
    with unit.device.as_current():  # NCCL object collectives allocate on the current device
        gathered = collectives.all_gather_object((problem, call, bool(flag)), model_group)
    ranks = collectives.group_ranks(model_group)
    problems = [(r, p) for r, (p, _, _) in zip(ranks, gathered) if p is not None]
    if problems:
        kind = NotImplementedError if problems[0][1][0] == "NotImplementedError" else ValueError
        raise kind("; ".join(f"rank {r}: {message}" for r, (_, message) in problems))
    for key in call:
        check_gathered_agree(
            f"{what}: the {key}",
            [c[key] for _, c, _ in gathered],
            model_group,
            hint="Pass the same on every rank of the model (the same checkpoint directory, reachable by every rank, "
            "the same process group object, options and optimizers).",
        )
    return any(f for _, _, f in gathered)


def _optimizer_kinds(optims: Tuple[torch.optim.Optimizer, ...]) -> List[str]:
    return [type(o).__name__ for o in optims]


def _checkpoint_state(model: nn.Module, optimizers: Tuple[torch.optim.Optimizer, ...], values: str) -> Dict[str, Any]:
    unit = _root_unit(model, "save")
    state: Dict[str, Any] = {MODEL_KEY: dcp_state.get_model_state_dict(unit, False, False, values, "save")}
    if optimizers:
        state[OPTIMIZER_KEY] = dcp_state.get_optimizer_state_dict(
            unit, optimizers, False, False, values=values, create_state=False, what="save"
        )
    return state


def _prepare_directory(
    model: nn.Module,
    optimizers: Optional[Optimizers],
    checkpoint_id: Union[str, "os.PathLike[str]"],
    overwrite: bool,
    group: Any,
    what: str,
) -> Tuple[torch.optim.Optimizer, ...]:
    """Check the arguments and the call on every rank, then refuse, or make unloadable, an existing checkpoint before
    anything of the new one is written; returns the optimizers as a tuple."""
    _options(None, what)
    optims = dcp_state.as_optimizers(optimizers, what) if optimizers is not None else ()
    unit = _root_unit(model, what)
    metadata = dcp_load.metadata_path(checkpoint_id)
    settings = {"overwrite": bool(overwrite), "optimizers": _optimizer_kinds(optims)}
    if not _agree_on_call(unit, group, checkpoint_id, os.path.exists(metadata), settings, what):
        dcp_files.remove_planted_entries(checkpoint_id)
        return optims
    if not overwrite:
        raise FileExistsError(
            f"{what}: {os.fspath(checkpoint_id)!r} already holds a checkpoint; save every checkpoint to a new "
            "directory (e.g. one per step), or pass overwrite=True"
        )
    # Overwriting in place: DCP rewrites the data files under the same names and writes .metadata last, so an
    # interrupted overwrite would leave the old .metadata pointing into half-rewritten files. Remove it first: until
    # the new one is complete, the directory holds no checkpoint. (Every rank enters DCP's planning, which gathers on
    # rank 0, before any rank writes, so the removal happens before the first write.)
    error: Optional[BaseException] = None
    if collectives.group_rank(group) == 0:
        try:
            os.remove(metadata)
        except FileNotFoundError:
            pass
        except OSError as e:
            error = e
    with unit.device.as_current():
        check_outcome_agrees(f"{what}: removing the old {METADATA_FILE}", error, group)
    dcp_files.remove_planted_entries(checkpoint_id)
    return optims


def save(
    model: nn.Module,
    optimizers: Optional[Optimizers] = None,
    *,
    checkpoint_id: Union[str, "os.PathLike[str]"],
    storage_writer: Optional[Any] = None,
    overwrite: bool = False,
    process_group: Optional[Any] = None,
) -> None:
    """Save the model (and optimizers) as a DCP checkpoint directory (collective).

    Writes the state of ``{"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model,
    optimizers)}`` with ``torch.distributed.checkpoint.save``, but without building those dicts: every original
    parameter (and every per-parameter optimizer state) goes to DCP as the pieces of it in this rank's flat shard, at
    most ``2 * ndim - 1`` boxes per rank, each a view of the shard (a ``ShardedTensor`` whose metadata every rank
    computes from the layout): no copy, no exchange. Padding is not written; with hybrid sharding one replica lists
    each tensor's pieces (round robin over the tensors), so each is written once. The chunks on disk are these
    pieces, not FSDP2's ``Shard(0)`` chunks; ``dcp.load`` reshards them like any others, so the checkpoint loads with
    :func:`load`, into :func:`get_model_state_dict`'s dicts, into FSDP2 or a plain module, at any world size.

    DCP writes ``.metadata`` after every rank's data: a save that is interrupted leaves a directory that :func:`load`
    (and ``dcp.load``) refuses.

    Args:
        model: the root FullyShardedDataParallel instance.
        optimizers: optimizer(s) over the model's parameters, or ``None`` for the model only.
        checkpoint_id: the checkpoint directory (created if needed), the same path on every rank.
        storage_writer: a ``torch.distributed.checkpoint.FileSystemWriter`` (or subclass) for that directory, to
            choose its options; by default DCP's for ``checkpoint_id``.
        overwrite: replace a checkpoint already in the directory. Its ``.metadata`` is removed first, so the
            directory holds no loadable checkpoint until the new one is complete.
        process_group: the ranks that write this checkpoint, exactly the model's: by default the world, which
            must then be the ranks the model is sharded (and, hybrid, replicated) over. A model sharded over a
            data-parallel group of tensor or pipeline parallelism passes that group here and a ``checkpoint_id``
            per group (e.g. ``f"ckpt/step-100/mp-{mp_rank}"``); every group writes its own checkpoint at once.

    Raises:
        ValueError: ``process_group`` (or the world) does not hold exactly the model's ranks, on some rank (raised
            on every rank).
        FileExistsError: the directory holds a checkpoint and ``overwrite`` is false (on every rank).
        RanksDisagreeError: the ranks passed another ``checkpoint_id``, ``process_group`` (communicator),
            ``overwrite`` or optimizers (on every rank, before anything is written).
        RuntimeError: DCP failed to write the checkpoint (on every rank; the message lists each failing rank's
            error). The directory then holds no loadable checkpoint.
    """
    optims = _prepare_directory(model, optimizers, checkpoint_id, overwrite, process_group, "save")
    state = _checkpoint_state(model, optims, dcp_state.VIEWS)
    try:
        _dcp_save(state, checkpoint_id=checkpoint_id, storage_writer=storage_writer, process_group=process_group)
    except CheckpointException as e:  # a BaseException in torch: make it an ordinary error
        raise RuntimeError(
            f"save: writing the checkpoint {os.fspath(checkpoint_id)!r} failed; DCP writes {METADATA_FILE} last, so "
            f"the directory does not load. {dcp_load.error_summary(e)}"
        ) from e


def async_save(
    model: nn.Module,
    optimizers: Optional[Optimizers] = None,
    *,
    checkpoint_id: Union[str, "os.PathLike[str]"],
    storage_writer: Optional[Any] = None,
    overwrite: bool = False,
    process_group: Optional[Any] = None,
) -> Any:
    """Like :func:`save`, but the files are written in the background (``torch.distributed.checkpoint.async_save``).

    The state is taken before this returns as in :func:`save`, but as views of one CPU copy of every flat shard
    (taken here, in place of DCP's staging, which cannot copy a ``ShardedTensor``), so training may go on at once.
    Wait for the result before the next save to the same directory, and before loading it; until then the directory
    has no ``.metadata`` and does not load.

    Args:
        model: the root FullyShardedDataParallel instance.
        optimizers: optimizer(s) over the model's parameters, or ``None``.
        checkpoint_id: the checkpoint directory, the same path on every rank.
        storage_writer: see :func:`save`.
        overwrite: see :func:`save`.
        process_group: see :func:`save`.

    Returns:
        What ``torch.distributed.checkpoint.async_save`` returns: a future (``.result()`` waits for the files).

    Raises:
        ValueError: see :func:`save`.
        FileExistsError: the directory holds a checkpoint and ``overwrite`` is false.
        RanksDisagreeError: the ranks passed another ``checkpoint_id``, ``process_group`` (communicator),
            ``overwrite`` or optimizers (on every rank, before anything is written).
    """
    optims = _prepare_directory(model, optimizers, checkpoint_id, overwrite, process_group, "async_save")
    if _ASYNC_STAGER:
        # A snapshot: ShardedTensors of one CPU copy of every flat shard, which DCP's stager cannot copy again.
        state = _checkpoint_state(model, optims, dcp_state.SNAPSHOT)
        return _dcp_async_save(
            state,
            checkpoint_id=checkpoint_id,
            storage_writer=storage_writer,
            process_group=process_group,
            async_stager=dcp_views.PreStaged(),
        )
    return _dcp_async_save(  # pragma: no cover - a torch without async_stager: copies, staged by DCP
        _checkpoint_state(model, optims, dcp_state.COPIES),
        checkpoint_id=checkpoint_id,
        storage_writer=storage_writer,
        process_group=process_group,
    )


def load(
    model: nn.Module,
    optimizers: Optional[Optimizers] = None,
    *,
    checkpoint_id: Union[str, "os.PathLike[str]"],
    storage_reader: Optional[Any] = None,
    strict: bool = True,
    process_group: Optional[Any] = None,
) -> IncompatibleKeys:
    """Load a DCP checkpoint directory written by :func:`save` (or the same layout by FSDP2) (collective).

    Any world size and wrapping: the checkpoint is read (``torch.distributed.checkpoint.load``) straight into a
    staging copy of this rank's flat shards and of their optimizer states, as the pieces of every parameter they hold
    (the boxes :func:`save` writes: a checkpoint of the same layout is read chunk for chunk, any other is resharded by
    DCP), then checked and copied in place, without any exchange between ranks: beyond the model it holds that one
    copy of the shards and what DCP reads at a time. All-or-nothing: an incomplete or missing checkpoint, a read error
    or a mismatch leaves model and optimizers as they were, on every rank.

    Args:
        model: the root FullyShardedDataParallel instance.
        optimizers: optimizer(s) to load too (the checkpoint must hold their state), or ``None``.
        checkpoint_id: the checkpoint directory, the same path on every rank.
        storage_reader: a ``torch.distributed.checkpoint.FileSystemReader`` for that directory; by default DCP's.
        strict: with ``False``, model keys missing from the checkpoint keep their values and keys of the
            checkpoint the model lacks are ignored (both reported); with ``True`` either raises before anything is
            read.
        process_group: the ranks that read this checkpoint (see :func:`save`): by default the world; the group of
            the model's shards with tensor or pipeline parallelism, each group reading its own directory. The
            checkpoint may have been written by a group of another size.

    Returns:
        The model's ``IncompatibleKeys``.

    Raises:
        ValueError: ``process_group`` (or the world) does not hold exactly the model's ranks, on some rank (raised
            on every rank).
        RanksDisagreeError: the ranks passed another ``checkpoint_id``, ``process_group`` (communicator),
            ``strict`` or optimizers (on every rank, before anything is read).
        CheckpointNotFoundError: no ``.metadata`` in the directory (no checkpoint, or a save that was interrupted
            or is still running); raised on every rank.
        UntrustedCheckpointError: the ``.metadata`` names something a DCP checkpoint never contains (code to run
            while unpickling it); it is read with a restricted unpickler, so nothing ran. Raised on every rank.
        RuntimeError: the checkpoint's keys do not match the model's (``strict``), it holds no optimizer state
            but optimizers were given, its optimizer state has other entries than these optimizers keep (saved by
            another optimizer type or with other settings), DCP could not read it into this model (other shapes; the
            message lists each failing rank's error), or the loaded state does not fit.
    """
    _options(None, "load")
    unit = _root_unit(model, "load")
    optims = dcp_state.as_optimizers(optimizers, "load") if optimizers is not None else ()
    settings = {"strict": bool(strict), "optimizers": _optimizer_kinds(optims)}
    _agree_on_call(unit, process_group, checkpoint_id, False, settings, "load")
    missing, unexpected = dcp_load.load(unit, optims, checkpoint_id, storage_reader, strict, process_group)
    return IncompatibleKeys(missing, unexpected)
