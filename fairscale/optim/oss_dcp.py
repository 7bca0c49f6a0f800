# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""PyTorch distributed checkpoints (DCP) of :class:`~fairscale.optim.OSS` optimizer state, keyed by parameter name.

The functions mirror :mod:`torch.distributed.checkpoint.state_dict` and :mod:`fairscale.nn.data_parallel.dcp`
(same names, same arguments), for a model that OSS does not shard (plain, DistributedDataParallel or
ShardedDataParallel: every rank holds all parameters)::

    import torch.distributed.checkpoint as dcp
    from fairscale.optim import oss_dcp

    model_sd, optim_sd = oss_dcp.get_state_dict(model, oss)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id="ckpt/step-100")

    # later, at any world size:
    model_sd, optim_sd = oss_dcp.get_state_dict(model, oss)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id="ckpt/step-100")
    oss_dcp.set_state_dict(model, oss, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

The optimizer state dict is torch's: ``{"state": {name: {state name: value}}, "param_groups": [{..., "params":
[names]}]}``, names as torch's helpers make them. Each rank's dict holds the state of the parameters it owns only,
so DCP writes every parameter's state once, from its owner, without any gather; loading, each rank reads the state
of the parameters it owns now, whatever the world size of the save. A checkpoint written by torch's helpers for the
same model with a plain optimizer loads into OSS, and the reverse.
"""

from typing import Any, Dict, Optional, Tuple

from torch import nn

from fairscale.nn.data_parallel._fsdp.dcp_options import checked_options

from ._oss import dcp as _dcp
from .oss import OSS

try:  # torch >= 2.2
    from torch.distributed.checkpoint import state_dict as _torch_dsd
    from torch.distributed.checkpoint.state_dict import StateDictOptions
except ImportError:  # pragma: no cover - old torch
    StateDictOptions = None  # type: ignore[assignment,misc]

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "get_state_dict",
    "set_state_dict",
]


def _options(options: Any, what: str) -> Any:
    return checked_options(
        options,
        what,
        StateDictOptions is not None,
        "torch.distributed.checkpoint.state_dict (torch >= 2.2)",
        " for OSS; each rank's dict holds its own parameters' state (for a full dict use "
        "OSS.state_dict(all_ranks=True))",
    )


def _oss(optimizer: Any, what: str) -> OSS:
    if not isinstance(optimizer, OSS):
        raise TypeError(
            f"{what}: optimizer must be a fairscale.optim.OSS, got {type(optimizer).__name__}. For a plain optimizer "
            "use torch.distributed.checkpoint.state_dict's functions; for FullyShardedDataParallel, "
            "fairscale.nn.data_parallel.dcp's."
        )
    return optimizer


def get_model_state_dict(model: nn.Module, *, options: Optional[Any] = None) -> Dict[str, Any]:
    """The model's state dict for DCP: torch's ``get_model_state_dict`` of the model without its wrappers.

    Torch's function removes DistributedDataParallel's ``module.`` prefix but not ShardedDataParallel's; this one
    removes both, so the keys match :func:`get_optimizer_state_dict`'s names and a checkpoint of the plain model.

    Args:
        model: the module OSS optimizes, plain or wrapped in DistributedDataParallel or ShardedDataParallel.
        options: a ``torch.distributed.checkpoint.state_dict.StateDictOptions``, passed to torch.

    Returns:
        ``{name: tensor}``; every rank holds the whole (replicated) model, DCP writes each value once. The tensors are
        the model's own (as torch's): ``dcp.load`` into this dict loads the model at once (clone the values first to
        keep the model unchanged should a later ``set_state_dict`` refuse the optimizer's dict).
    """
    _options(options, "get_model_state_dict")
    result: Dict[str, Any] = _torch_dsd.get_model_state_dict(_dcp.unwrap(model), options=options)
    return result


def set_model_state_dict(model: nn.Module, model_state_dict: Dict[str, Any], *, options: Optional[Any] = None) -> Any:
    """Load a state dict made by :func:`get_model_state_dict` (torch's ``set_model_state_dict``, unwrapped).

    Args:
        model: the module, plain or wrapped in DistributedDataParallel or ShardedDataParallel.
        model_state_dict: ``{name: tensor}``.
        options: ``StateDictOptions``, passed to torch (``strict``).

    Returns:
        torch's ``_IncompatibleKeys``.
    """
    _options(options, "set_model_state_dict")
    return _torch_dsd.set_model_state_dict(_dcp.unwrap(model), model_state_dict, options=options)


def get_optimizer_state_dict(model: nn.Module, optimizers: OSS, *, options: Optional[Any] = None) -> Dict[str, Any]:
    """This rank's part of the OSS optimizer state, keyed by parameter name, for ``torch.distributed.checkpoint``.

    Rank-local (no communication), but call it on every rank: each rank's dict holds the state of the parameters it
    owns, and DCP needs every rank's to save the whole state. Like torch's, an OSS whose wrapped optimizer has no
    state yet (before its first step) first takes one step of it over zero gradients at learning rate 0 on this
    rank's parameters, which creates the state and changes no parameter, so that ``dcp.load`` has something to fill.

    Args:
        model: the module OSS optimizes (plain, DistributedDataParallel or ShardedDataParallel).
        optimizers: the OSS optimizer (one; the name is torch's).
        options: ``StateDictOptions``; ``cpu_offload`` puts the values on the CPU. ``full_state_dict``,
            ``broadcast_from_rank0`` and ``flatten_optimizer_state_dict`` are not supported.

    Returns:
        ``{"state": {name: {state name: value}}, "param_groups": [{..., "params": [names]}]}``: copies of the state
        of the parameters this rank owns (parameters never stepped have none), and every group with every name.

    Raises:
        TypeError: ``optimizers`` is not an OSS, or ``model`` not a module.
        ValueError: a parameter of the optimizer is not the model's.
        NotImplementedError: an unsupported option.
    """
    what = "get_optimizer_state_dict"
    opts = _options(options, what)
    oss = _oss(optimizers, what)
    names = _dcp.param_names(model, oss.param_groups, what)
    _dcp.init_state(oss)
    return _dcp.build_state_dict(oss, names, bool(opts.cpu_offload))


def set_optimizer_state_dict(
    model: nn.Module, optimizers: OSS, optim_state_dict: Dict[str, Any], *, options: Optional[Any] = None
) -> None:
    """Load a name-keyed optimizer state dict into OSS, at any world size (collective over OSS's group).

    Each rank loads the state of the parameters it owns now and ignores the others' entries, so the dict may be
    :func:`get_optimizer_state_dict`'s after ``dcp.load`` (only the owned parameters), or a whole torch-format dict
    (torch's helpers with a plain optimizer). The parameter groups' hyper-parameters (``lr``...) are restored.
    All-or-nothing: every rank checks its dict (groups and names, state shapes; an owned parameter that has state
    must get state with the same entries) and the ranks agree in one small ``all_gather_object``; if any rank's dict
    is wrong, or the ranks' hyper-parameters differ, every rank raises the same error and nothing changes.

    Args:
        model: the module OSS optimizes.
        optimizers: the OSS optimizer.
        optim_state_dict: ``{"state": ..., "param_groups": ...}`` keyed by parameter name.
        options: ``StateDictOptions`` (no option changes the load).

    Raises:
        ValueError: other parameter groups or names, state shaped for other parameters, missing state (named).
        TypeError: a dict not in torch's format, ``optimizers`` not an OSS.
    """
    _set(model, optimizers, None, optim_state_dict, options, "set_optimizer_state_dict")


def _set(
    model: nn.Module,
    optimizers: OSS,
    model_state_dict: Optional[Dict[str, Any]],
    optim_state_dict: Dict[str, Any],
    options: Optional[Any],
    what: str,
) -> Any:
    """Check both dicts on every rank, agree, then load the optimizer's and the model's (torch's load)."""
    opts = _options(options, what)
    oss = _oss(optimizers, what)
    names = _dcp.param_names(model, oss.param_groups, what)
    error: Optional[Exception] = None
    hyper: Any = []
    owned: Dict[str, Any] = {}
    try:
        if model_state_dict is not None:
            current = _torch_dsd.get_model_state_dict(_dcp.unwrap(model))  # torch's names; values not copied
            _dcp.check_model_loadable(current, model_state_dict, bool(opts.strict), what)
        hyper, owned = _dcp.check_loadable(oss, names, optim_state_dict, what)
    except Exception as e:  # every rank must reach the agreement, whatever went wrong here
        error = e
    _dcp.agree(oss, what, error, hyper)
    _dcp.commit(oss, names, hyper, owned)
    if model_state_dict is None:
        return None
    return _torch_dsd.set_model_state_dict(_dcp.unwrap(model), model_state_dict, options=options)


def get_state_dict(
    model: nn.Module, optimizers: OSS, *, options: Optional[Any] = None
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(get_model_state_dict(model), get_optimizer_state_dict(model, optimizers))``.

    Args:
        model: the module OSS optimizes.
        optimizers: the OSS optimizer.
        options: ``StateDictOptions``, for both.

    Returns:
        The model and the optimizer state dicts.
    """
    return (
        get_model_state_dict(model, options=options),
        get_optimizer_state_dict(model, optimizers, options=options),
    )


def set_state_dict(
    model: nn.Module,
    optimizers: OSS,
    *,
    model_state_dict: Dict[str, Any],
    optim_state_dict: Dict[str, Any],
    options: Optional[Any] = None,
) -> Any:
    """Load both state dicts (collective); all-or-nothing for the pair.

    Both dicts are checked on every rank (the model's: keys with ``strict``, shapes) and the ranks agree before
    anything is written: a wrong model dict leaves the optimizer unchanged too, and the reverse.

    Args:
        model: the module OSS optimizes.
        optimizers: the OSS optimizer.
        model_state_dict: see :func:`set_model_state_dict`.
        optim_state_dict: see :func:`set_optimizer_state_dict`.
        options: ``StateDictOptions``, for both.

    Returns:
        The model's incompatible keys (torch's ``_IncompatibleKeys``).
    """
    if not isinstance(model_state_dict, dict):
        raise TypeError(f"set_state_dict: model_state_dict must be a dict, got {type(model_state_dict).__name__}")
    return _set(model, optimizers, model_state_dict, optim_state_dict, options, "set_state_dict")
