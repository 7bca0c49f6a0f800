# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Where a value goes: the consumer, which of its inputs, and which output of the producer."""

from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["DataConsumer"]

ConsumerType = TypeVar("ConsumerType")


@dataclass
class DataConsumer(Generic[ConsumerType]):
    """Output ``output_idx`` of a producer feeds input ``consumer_input_idx`` of ``consumer``."""

    consumer: ConsumerType
    consumer_input_idx: int  # indicates which input of the consumer module
    output_idx: int  # indicates which output of the producer module
