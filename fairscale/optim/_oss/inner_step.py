# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The wrapped optimizer's step, without torch's global optimizer hooks a second time.

torch (2.0 and later) runs the hooks registered with ``torch.optim.optimizer.register_optimizer_step_pre_hook`` and
``..._post_hook`` around every optimizer's ``step``. ``OSS.step`` is one, and the wrapped optimizer's ``step`` inside
it was another: a global hook ran twice per step, and one that edits gradients (halves them, clips them) was applied
twice to the owned gradients, silently (a fuzz of torch 2.x optimizer features, session 49). The user's optimizer is
OSS: global hooks see it once. Hooks registered on the wrapped optimizer itself still run around its step, in torch's
order; so do its profiler range and profiling hook.
"""

from typing import Any, Callable, Optional, Tuple, cast

import torch
from torch.optim import Optimizer


def step_without_global_hooks(optim: Optimizer, **kwargs: Any) -> Optional[float]:
    """``optim.step(**kwargs)`` as torch runs it, less the global hooks (see the module docstring)."""
    raw: Optional[Callable[..., Any]] = getattr(type(optim).step, "__wrapped__", None)
    if raw is None or not getattr(type(optim).step, "hooked", False) or "step" in vars(optim):
        # Not torch's hooked step: a class that replaced it, or a step set on the instance (torch.compile'd, patched
        # by a library): called as it is, global hooks and all.
        return cast(Optional[float], optim.step(**kwargs))
    args: Tuple[Any, ...] = (optim,)
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optim).__name__}.step"):
        for pre_hook in list(optim._optimizer_step_pre_hooks.values()):
            result = pre_hook(optim, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"{pre_hook} must return None or a tuple of (new_args, new_kwargs), got {result}"
                    )
                args, kwargs = result
        out = raw(*args, **kwargs)
        optim._optimizer_step_code()
        for post_hook in list(optim._optimizer_step_post_hooks.values()):
            post_hook(optim, args, kwargs)
    return cast(Optional[float], out)
