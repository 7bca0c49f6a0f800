# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The check of the ``StateDictOptions`` that fairscale's DCP state-dict functions take (FSDP's and OSS's).

Both make sharded state dicts only: each rank's dict holds its own part, so the options that ask for a full or a
flattened dict (``full_state_dict``, ``broadcast_from_rank0``, ``flatten_optimizer_state_dict``) are refused, each
module saying what to use instead.
"""

from typing import Any

try:  # torch >= 2.2
    from torch.distributed.checkpoint.state_dict import StateDictOptions
except ImportError:  # pragma: no cover - old torch: the callers say what they need
    StateDictOptions = None  # type: ignore[assignment,misc]

__all__ = ["checked_options", "UNSUPPORTED_OPTIONS"]

UNSUPPORTED_OPTIONS = ("full_state_dict", "broadcast_from_rank0", "flatten_optimizer_state_dict")


def checked_options(options: Any, what: str, available: bool, needs: str, unsupported_why: str) -> Any:
    """``options`` (a new ``StateDictOptions()`` for ``None``), checked for a sharded state dict.

    Args:
        options: what the caller was given.
        what: the calling function's name, for messages.
        available: whether the caller's torch imports succeeded (else ``ImportError`` saying ``needs``).
        needs: what the caller needs of torch, e.g. ``"torch.distributed.checkpoint.state_dict (torch >= 2.2)"``.
        unsupported_why: the end of the message for an unsupported option (what to use instead).

    Raises:
        ImportError: ``available`` is false.
        TypeError: ``options`` is not a ``StateDictOptions``.
        NotImplementedError: an option of :data:`UNSUPPORTED_OPTIONS` is set.
    """
    if not available or StateDictOptions is None:  # pragma: no cover - old torch
        raise ImportError(f"{what} needs {needs}")
    opts = options if options is not None else StateDictOptions()
    if not isinstance(opts, StateDictOptions):
        raise TypeError(f"{what}: options must be a StateDictOptions, got {type(opts).__name__}")
    unsupported = [name for name in UNSUPPORTED_OPTIONS if getattr(opts, name, False)]
    if unsupported:
        raise NotImplementedError(
            f"{what}: StateDictOptions({', '.join(f'{n}=True' for n in unsupported)}) is not supported{unsupported_why}"
        )
    return opts
