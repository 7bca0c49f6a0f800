# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A typed entry point to ``nn.Module``'s state-dict hooks.

torch declares the registration methods without annotations, so strict mypy rejects every direct call. The casts
here state the signatures torch documents, once, so that callers stay fully typed.
"""

from typing import Any, Callable, Dict, List, TypeVar, cast

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["register_state_dict_hooks"]

M = TypeVar("M", bound=nn.Module)


def register_state_dict_hooks(
    module: M,
    post_state_dict: Callable[[M, Dict[str, Any], str, Any], None],
    pre_load: Callable[[M, Dict[str, Any], str, Any, bool, List[str], List[str], List[str]], None],
    post_load: Callable[[M, Any], None],
) -> List[RemovableHandle]:
    """Install the three hooks that make a wrapper's state dict look like the wrapped module's.

    Args:
        module: the module the hooks belong to.
        post_state_dict: ``hook(module, state_dict, prefix, local_metadata)``, run after ``state_dict()``
            filled in the module's entries (edits the dict in place).
        pre_load: ``hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
            error_msgs)``, run before the module loads its entries (registered with the module, so it is passed).
        post_load: ``hook(module, incompatible_keys)``, run after ``load_state_dict`` of the module; may edit
            ``incompatible_keys.missing_keys`` / ``unexpected_keys`` in place.

    Returns:
        The three handles, in the order above (``handle.remove()`` uninstalls one).
    """
    # The private state-dict hook API is used because the public one only exists from torch 2.2 on.
    add_post_state_dict = cast(Callable[[Callable[..., None]], RemovableHandle], module._register_state_dict_hook)
    add_pre_load = cast(
        Callable[[Callable[..., None], bool], RemovableHandle], module._register_load_state_dict_pre_hook
    )
    add_post_load = cast(Callable[[Callable[..., None]], RemovableHandle], module.register_load_state_dict_post_hook)
    return [add_post_state_dict(post_state_dict), add_pre_load(pre_load, True), add_post_load(post_load)]
