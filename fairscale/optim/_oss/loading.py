# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Loading a consolidated state dict into OSS: check, agree across ranks, load the shard, undo on any failure.

The protocol of :meth:`fairscale.optim.OSS.load_state_dict` (documented there): every rank checks the whole dict,
the ranks agree on the outcome and on the dict's layout (two small all-gathers), each rank loads the state of the
parameters it owns, and a load that fails on any rank puts OSS and its wrapped optimizer back on every rank.
"""

from typing import Any, Callable, Dict, List, Optional, Protocol, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from fairscale.internal.agreement import (
    RanksDisagreeError,
    check_gathered_agree,
    check_outcome_agrees,
    gather_from_ranks,
)

from . import describe as _describe
from . import state_hooks
from . import state_dict as _state

__all__ = ["load_on_every_rank", "keeps_saved_dtypes", "restore_saved_dtypes"]


class _OSSLike(Protocol):
    """What the load reads and writes of ``OSS`` (described structurally: the front imports this module)."""

    optim: Optimizer
    group: Any
    rank: int
    param_groups: List[Dict[str, Any]]

    def _params_device(self) -> Optional[torch.device]: ...

    def partition_parameters(self) -> List[List[Dict[str, Any]]]: ...

    @property
    def _param_to_index(self) -> Dict[int, int]: ...

    @property
    def _param_to_rank(self) -> Dict[torch.Tensor, int]: ...

    @staticmethod
    def _sync_param_groups(source: List[Dict[Any, Any]], destination: List[Dict[Any, Any]]) -> None: ...


def load_on_every_rank(oss: _OSSLike, state_dict: Dict[str, Any], load_own: Callable[[Dict[str, Any]], None]) -> None:
    """:meth:`OSS.load_state_dict` (see there for what is checked and raised).

    ``load_own`` is the next ``load_state_dict`` after OSS's in the instance's class order (``super()``'s, usually
    torch's ``Optimizer.load_state_dict``; a mixin's in a subclass): it loads OSS's own groups and state. torch's
    load hooks registered on OSS run around the whole load, not inside ``load_own`` (see :mod:`.state_hooks`).
    """
    optimizer = cast(Optimizer, oss)
    with state_hooks.held_back(optimizer, state_hooks.LOAD_PRE, state_hooks.LOAD_POST) as (pre, post):
        if pre:  # on a shallow copy, as torch's load does
            state_dict = state_hooks.run_returning(optimizer, pre, dict(state_dict))
        _load_agreed(oss, state_dict, load_own)
    state_hooks.run_post_load(optimizer, post)


def _load_agreed(oss: _OSSLike, state_dict: Dict[str, Any], load_own: Callable[[Dict[str, Any]], None]) -> None:
    device = oss._params_device()
    error: Optional[Exception] = None
    try:
        _state.check_loadable(state_dict, oss.param_groups)
        _state.check_inner_state(state_dict, type(oss.optim))
        # The wrapped optimizer's own checks, against all parameters: its load below only sees this rank's
        # shard, and a check that fails on the owning rank alone would leave the other ranks going on with the
        # old state.
        inner_check = getattr(type(oss.optim), "_check_loadable_state_dict", None)
        if inner_check is not None:
            inner_check(state_dict, oss.param_groups)
    except Exception as e:  # noqa: B902  # re-raised below, once every rank knows
        error = e
    # Ranks given different dicts (another learning rate, another checkpoint) raised on some ranks only, or
    # loaded apart silently: the outcome of the checks and the dict's layout are agreed on first (two small
    # all-gathers per load, none at world size 1).
    check_outcome_agrees("OSS.load_state_dict: the checks of the state dict", error, oss.group, device=device)
    # The per-parameter state rides in the same gather, as cheap checksums: a rank given another checkpoint (a stale
    # file on one node, an emptied state) kept the state of the parameters it owns from its own dict, and the
    # optimizer was a mix of two checkpoints, silently.
    hint = "Load the same state dict on every rank (e.g. the one consolidate_state_dict() wrote)."
    try:
        digests: Optional[Dict[Any, Optional[int]]] = _state.state_digests(state_dict)
    except Exception:  # noqa: B902  # a rank that cannot read them compares nothing, rather than skip the gather
        digests = None
    gathered = gather_from_ranks(
        (_state.describe_for_agreement(state_dict, _describe.comparable), digests),
        oss.group,
        device=device,
    )
    check_gathered_agree(
        "OSS.load_state_dict: the state dicts' parameter groups (sizes and hyper-parameters)",
        [groups for groups, _ in gathered],
        oss.group,
        hint,
    )
    differing = _state.disagreeing_state([d for _, d in gathered if d is not None])
    if differing is not None:
        raise RanksDisagreeError(
            f"OSS.load_state_dict: the state dicts hold another state for parameter {differing[0]!r} on some ranks "
            f"(checksum per rank: {differing[1]}; 'none': no state, 'any': emptied by an earlier load of that dict). "
            f"{hint} Nothing was loaded."
        )
    # What the loads below replace or change in place, to put back if one of them raises on any rank (an
    # optimizer whose state names are not known here can still refuse the dict in its own loader, after torch
    # changed part of it, and only on the ranks that own the parameters concerned).
    own_attributes = dict(oss.__dict__)
    inner_attributes = dict(oss.optim.__dict__)
    own_groups = [dict(group) for group in oss.param_groups]
    inner_groups = [dict(group) for group in oss.optim.param_groups]
    error = None
    try:
        _load_checked(oss, state_dict, load_own)
    except Exception as e:  # noqa: B902  # every rank puts its optimizer back below
        error = e
    try:
        check_outcome_agrees("OSS.load_state_dict", error, oss.group, device=device)
    except Exception as failure:
        for obj, attributes in ((oss, own_attributes), (oss.optim, inner_attributes)):
            obj.__dict__.clear()
            obj.__dict__.update(attributes)
        for group, saved in zip(oss.param_groups + oss.optim.param_groups, own_groups + inner_groups):
            group.clear()
            group.update(saved)
        if failure is not error or isinstance(error, (ValueError, TypeError)):
            raise  # another rank's failure (its rank and error named), or a clear error of the loader
        # Typically a KeyError from deep inside torch (a state name the optimizer's loader expects): say where.
        raise ValueError(
            f"OSS.load_state_dict: the wrapped optimizer ({_describe.callable_name(type(oss.optim))}) could not "
            f"load its part of the state dict ({type(error).__name__}: {error}); the state dict does not fit it, "
            "load one written by the same optimizer class. Nothing was changed, on any rank."
        ) from error
    _empty_entries_of_other_ranks(oss, state_dict)


def _load_checked(oss: _OSSLike, state_dict: Dict[str, Any], load_own: Callable[[Dict[str, Any]], None]) -> None:
    """The load itself, once the dict passed the checks."""
    saved_groups = state_dict["param_groups"]
    saved_ids = [pid for g in saved_groups for pid in g["params"]]
    shard = _state.shard_for_rank(state_dict, oss.partition_parameters()[oss.rank], oss._param_to_index, saved_ids)
    oss.optim.load_state_dict(shard)
    if keeps_saved_dtypes(oss.optim):
        restore_saved_dtypes(oss.optim, shard)
    # OSS's own state keeps only what belongs to no parameter (a wrapper's entry): per-parameter state lives
    # in the shard, and a duplicate here would be stale after the next step.
    own_state = {k: v for k, v in state_dict["state"].items() if not isinstance(k, int)}
    held_groups = oss.param_groups
    load_own({"state": own_state, "param_groups": saved_groups})
    # torch's load builds new group dicts. Other objects may hold the old ones: an LR scheduler of the optimizer
    # whose groups OSS was built from (Lightning's sharded strategies do that), or user code. Update the held
    # dicts in place and keep them, so that a schedule set on them still reaches OSS after a resume.
    for held, loaded in zip(held_groups, oss.param_groups):
        for key, value in loaded.items():
            if key != "params":  # the same parameters, in the same order (check_loadable made sure)
                held[key] = value
    oss.param_groups = held_groups
    # The wrapped optimizer loaded the same groups and has the last word: its own loader may fix a key up (torch's
    # AdamW sets decoupled_weight_decay=True over an Adam dict's False; copied back over it, OSS stepped AdamW with
    # coupled weight decay, silently; a fuzz of torch 2.x optimizer flags, session 49).
    oss._sync_param_groups(oss.optim.param_groups, oss.param_groups)


def keeps_saved_dtypes(optim: Optimizer) -> bool:
    """Whether the loaded state keeps the dtype it was saved in (upstream's rule: it assigned each state tensor as
    saved, moved to the parameter's device) rather than the parameter's dtype (torch's loader casts).

    Clients rely on upstream's rule: fairseq's memory-efficient fp16/bf16 keeps fp32 moments for fp16/bf16
    parameters and switches its own repair of torch's cast off under OSS, so a cast silently lost the moments'
    precision at every resume (an fp32 second moment of 1e-8 is 0 in fp16). Two exceptions: an optimizer with its
    own ``load_state_dict`` (fairscale's Adam) decides its state dtype itself, and torch's own optimizers, whose
    kernels need state in the parameter's dtype (torch's Adam fails at the next step otherwise, as under upstream),
    keep torch's cast.
    """
    cls = type(optim)
    if cls.load_state_dict is not Optimizer.load_state_dict:
        return False
    return not any(c is not Optimizer and c.__module__.startswith("torch.optim") for c in cls.__mro__)


def restore_saved_dtypes(optim: Optimizer, shard: Dict[str, Any]) -> None:
    """Give every floating state tensor that torch's loader cast its saved dtype back (on the device torch chose)."""
    local_ids = [i for group in shard["param_groups"] for i in group["params"]]
    params = [p for group in optim.param_groups for p in group["params"]]
    for local_id, param in zip(local_ids, params):
        saved, loaded = shard["state"].get(local_id), optim.state.get(param)
        if not isinstance(saved, dict) or not isinstance(loaded, dict):
            continue
        for key, value in saved.items():
            current = loaded.get(key)
            if (
                isinstance(value, Tensor)
                and isinstance(current, Tensor)
                and value.is_floating_point()
                and current.dtype != value.dtype
            ):
                loaded[key] = value.to(device=current.device)


def _empty_entries_of_other_ranks(oss: _OSSLike, state_dict: Dict[str, Any]) -> None:
    """Upstream's side effect of a load, made once every rank loaded: the per-parameter entries of the
    parameters other ranks own become ``{}`` in the caller's dict (a failed load leaves the dict intact)."""
    index_to_param = _state.global_index_map(state_dict["param_groups"], oss.param_groups)
    for key in list(state_dict["state"]):
        if isinstance(key, int) and oss._param_to_rank[index_to_param[key]] != oss.rank:
            state_dict["state"][key] = {}
