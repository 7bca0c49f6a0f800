# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Names as the user sees them: module paths and state-dict keys without the wrappers FSDP inserts.

FullyShardedDataParallel puts its module under ``_fsdp_wrapped_module`` and FlattenParamsWrapper puts the user's
module under ``_fpw_module``; every name FSDP shows (state-dict keys, metadata, messages) drops those components so
it is the unwrapped model's name.
"""

WRAPPER_COMPONENTS = ("_fsdp_wrapped_module", "_fpw_module")


def clean_path(path: str) -> str:
    """``path`` (dotted) without wrapper components (and without empty components)."""
    return ".".join(c for c in path.split(".") if c and c not in WRAPPER_COMPONENTS)


def join_path(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` when the prefix is empty (the root)."""
    return f"{prefix}.{name}" if prefix else name


def clean_text(text: str) -> str:
    """Drop wrapper components from every path inside a free text (an error message, a key list)."""
    return text.replace("_fsdp_wrapped_module.", "").replace("_fpw_module.", "")
