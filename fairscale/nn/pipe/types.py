# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Types shared by the multi-process pipeline: queue ids, messages and lazily built layers."""

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

__all__ = [
    "ACTIVATIONS_GRADS_QUEUE",
    "SKIP_TENSOR_QUEUE",
    "PORTAL_QUEUE",
    "EVENT_LOOP_QUEUE",
    "EVENT_LOOP_ACTIVATIONS_QUEUE",
    "EVENT_LOOP_GRADIENTS_QUEUE",
    "MESSAGE_GENERATION_START",
    "MessageGeneration",
    "LazyModule",
    "PipeMessage",
    "InputDevice",
    "Tensors",
    "TensorOrTensors",
]

ACTIVATIONS_GRADS_QUEUE = 0
SKIP_TENSOR_QUEUE = 1
PORTAL_QUEUE = 2
EVENT_LOOP_QUEUE = 3
EVENT_LOOP_ACTIVATIONS_QUEUE = 4
EVENT_LOOP_GRADIENTS_QUEUE = 5
MESSAGE_GENERATION_START = 6

#: The next free message tag of this process (tags below it are the queue ids).
MessageGeneration = MESSAGE_GENERATION_START

Tensors = Tuple[Tensor, ...]
TensorOrTensors = Union[Tensor, Tensors]

InputDevice = Union[None, int, str, torch.device]


class LazyModule:
    """A layer built only on the stage that holds it: ``LazyModule(lambda: nn.Linear(10, 10))``."""

    def __init__(self, function: Callable[[], nn.Module]) -> None:
        self.function = function

    def __call__(self) -> nn.Module:
        return self.function()


@dataclass(init=False)
class PipeMessage:
    """A message between stages: a header (``args``) and tensors.

    ``tag`` comes from the process-wide :data:`MessageGeneration` counter, which then advances by the number of
    tensors (or ``tensor_count`` when ``tensors`` is ``None``), so tensor ``k`` of a message can travel with the
    unique tag ``tag + k``.
    """

    src: int
    dest: int
    queue_name: int
    args: Any
    tensors: Tensors
    tensor_shapes: List[torch.Size] = field(default_factory=list)
    tensor_dtypes: List[torch.dtype] = field(default_factory=list)
    tag: int = 0

    def __init__(
        self,
        src: int,
        dest: int,
        queue_name: int,
        args: Any = None,
        tensors: Optional[Tensors] = None,
        tensor_count: int = 0,
    ) -> None:
        global MessageGeneration
        self.src = src
        self.dest = dest
        self.queue_name = queue_name
        self.args = args
        self.tensors = tensors if tensors is not None else tuple()
        self.tensor_shapes = []
        self.tensor_dtypes = []
        self.tag = MessageGeneration
        MessageGeneration += len(tensors) if tensors is not None else tensor_count
