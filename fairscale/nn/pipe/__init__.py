# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Pipeline parallelism: :class:`Pipe` (GPipe on one host) and :class:`AsyncPipe` (one process per stage)."""

from . import microbatch
from .async_pipe import AsyncPipe as AsyncPipe  # exported, outside __all__ as upstream
from .checkpoint import is_checkpointing, is_recomputing
from .pipe import Pipe
from .rpc import PipeRPCWrapper as PipeRPCWrapper  # exported, outside __all__ as upstream
from .types import LazyModule

__all__ = ["Pipe", "is_checkpointing", "is_recomputing", "LazyModule"]
