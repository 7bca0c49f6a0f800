# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Parameters that torch swapped (``set_swap_module_params_on_conversion(True)``) since the reducer hooked them."""

from typing import Dict, Sequence

import torch

__all__ = ["revive_swapped_hooks"]


def revive_swapped_hooks(params: Sequence[torch.Tensor], hooked: Dict[int, int]) -> None:
    """Make the hooks of parameters torch swapped since they were hooked fire again.

    ``torch.utils.swap_tensors`` (a conversion under ``set_swap_module_params_on_conversion(True)``) leaves the
    Python dicts of a tensor's hooks (``register_hook``, ``register_post_accumulate_grad_hook``) on the parameter but
    their C++ registration on the old contents: a hook added since only goes into the dict, and never fires (every
    gradient stayed local, silently). Assigning a dict again registers it on the current contents (the user's own
    hooks in it fire again too).
    """
    for param in params:
        impl = hooked.get(id(param))
        if impl is None or impl == param._cdata:
            continue
        for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            hooks = getattr(param, name, None)
            if hooks is not None:
                setattr(param, name, hooks)
