# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Refuse a flattened name that holds a tensor the wrapper did not put there, before a forward overwrites it.

Between forwards each flattened name holds the view the last forward made (listed in the wrapped module's
``_unflattened_param_views``) or, under FullyShardedDataParallel, a stand-in of it (a class with
``FLAT_VIEW_STAND_IN`` set). Anything else was put there by the user's code: ``torch.func.functional_call`` (which
swaps the given tensors in for the call), ``module.weight = tensor`` after wrapping. The forward replaced it by its
own view, so the given values were silently not used; functional_call then wrote that view back into the caller's
dict, and under FSDP reading it after the next step read freed memory (a crash; found by a fuzz of FSDP with torch
utilities, session 42).
"""

from typing import Any, List, Optional

from torch import Tensor

from .grouping import user_param_name

__all__ = ["FLAT_VIEW_STAND_IN", "refuse_foreign_values"]

#: Set (True) on a class whose instances stand in for a view between forwards (FSDP's ``FreedParameter``).
FLAT_VIEW_STAND_IN = "_flat_view_stand_in"


def refuse_foreign_values(wrapper: Any, last_views: Optional[List[Tensor]]) -> None:
    """Raise ``ValueError`` if a flattened name of ``wrapper``'s flat parameters holds a tensor that is not the
    wrapper's, or a flat parameter's name on the wrapper holds another tensor than that flat parameter.

    ``last_views``: the wrapped module's ``_unflattened_param_views`` (``None`` before any views were made: nothing
    to compare with). One dict lookup and one set lookup per name.
    """
    flats: List[Any] = wrapper.flat_params
    registered = wrapper._parameters
    for name, flat in zip(wrapper.flat_param_names, flats):
        # torch.func.functional_call with the flat name, an assignment or a parametrization of it: the forward made
        # its views from the list it keeps, so the given tensor was ignored and got no gradient, silently; an
        # optimizer over wrapper.parameters() then held a parameter that never trained (a fuzz, session 46).
        if registered.get(name) is not flat:
            raise ValueError(
                f"FlattenParamsWrapper: {name} is not the flat parameter the wrapper made (replaced by an "
                "assignment, a parametrization or torch.func.functional_call). The forward computes with the "
                "wrapper's own flat parameter and would ignore it, silently. Load values with load_state_dict() or "
                "copy them into the flat parameter in place (with torch.no_grad(): w.flat_params[0].copy_(values))."
            )
    if not last_views:
        return
    known = {id(v) for v in last_views}
    for flat in flats:
        # A tied weight's further names hold their first name's view: checked too (a review, session 43).
        slots = [(path, m, n) for path, m, n in flat._param_infos]
        slots += [(path, m, n) for path, _, m, n, _, _ in flat._shared_param_infos]
        for path, m, n in slots:
            value = m.__dict__.get(n)
            if value is None or id(value) in known or getattr(type(value), FLAT_VIEW_STAND_IN, False):
                continue  # a name re-registered as a parameter is refused by set_plain_tensor, with its own message
            raise ValueError(
                f"FlattenParamsWrapper: {user_param_name(path, n)} ({type(m).__name__}.{n}) holds a tensor the wrapper did not put "
                "there (torch.func.functional_call, or an assignment after wrapping). Its forward computes with the "
                f"flattened parameters and would ignore it, silently. Remove it (del module.{n}: the next forward "
                "puts the wrapper's view back), then load values with load_state_dict() or assign them inside "
                "unflatten_params() (FSDP: summon_full_params()); functional_call cannot reach flattened parameters."
            )
