# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Micro-batches: split a mini-batch into :class:`Batch` objects and concatenate them back.

A batch value is a tensor ("atomic") or a tuple of tensors. Lists are never accepted: a tuple is the one
container the pipeline forwards through every partition boundary.
"""

import typing
from typing import Any, Callable, Iterator, List, Tuple, Union, cast

import torch
from torch import Tensor

__all__ = ["Batch", "check", "scatter", "gather", "Tensors", "TensorOrTensors", "Function"]

Tensors = Tuple[Tensor, ...]
TensorOrTensors = Union[Tensor, Tensors]
Function = Callable[[TensorOrTensors], TensorOrTensors]


class Batch:
    """One micro-batch: a tensor or a tuple of tensors, and its index in the mini-batch.

    Args:
        value (TensorOrTensors): the micro-batch data.
        index (int): the micro-batch number, ``0`` for the first one.
    """

    def __init__(self, value: TensorOrTensors, index: int) -> None:
        self.value = value
        self.atomic = torch.is_tensor(value)
        self.__index = index

    @property
    def index(self) -> int:
        """The micro-batch number (read only)."""
        return self.__index

    @property
    def tensor(self) -> Tensor:
        """The tensor of an atomic batch."""
        if not self.atomic:
            raise AttributeError("not atomic batch")
        return cast(Tensor, self.value)

    @property
    def tensors(self) -> Tensors:
        """The tuple of a non-atomic batch."""
        if self.atomic:
            raise AttributeError("batch is atomic")
        return cast(Tensors, self.value)

    @property
    def tensor_or_tensors(self) -> TensorOrTensors:
        """The value, whatever its kind."""
        return self.value

    def call(self, function: Function) -> "Batch":
        """Return ``Batch(function(value), index)``; the value is passed as one argument."""
        return Batch(function(self.value), self.index)

    def __repr__(self) -> str:
        return f"Batch[atomic={self.atomic!r}]({self.value!r})"

    def __iter__(self) -> Iterator[Tensor]:
        if self.atomic:
            yield cast(Tensor, self.value)
        else:
            yield from cast(Tensors, self.value)

    def __len__(self) -> int:
        return 1 if self.atomic else len(cast(Tensors, self.value))

    def __getitem__(self, index: int) -> Tensor:
        if not self.atomic:
            return cast(Tensors, self.value)[index]
        if index != 0:
            raise IndexError("atomic batch allows index 0 only")
        return cast(Tensor, self.value)

    @typing.overload
    def __setitem__(self, index: int, value: Tensor) -> None: ...  # noqa: E704

    @typing.overload
    def __setitem__(self, index: slice, value: Tensors) -> None: ...  # noqa: E704

    def __setitem__(self, index: Union[int, slice], value: Any) -> None:
        if isinstance(index, int):
            self._set_one(index, value)
        else:
            self._set_all(index, value)

    def _set_one(self, index: int, value: Tensor) -> None:
        if self.atomic:
            if index != 0:
                raise IndexError("atomic batch allows index 0 only")
            self.value = value
            return
        items = list(cast(Tensors, self.value))
        items[index] = value
        self.value = tuple(items)

    def _set_all(self, index: slice, value: Tensors) -> None:
        if (index.start, index.stop, index.step) != (None, None, None):
            raise NotImplementedError("only slice [:] supported")
        if not self.atomic:
            self.value = value
            return
        if len(value) != 1:
            raise IndexError("atomic batch cannot be replaced with multiple tensors")
        self.value = value[0]


def check(input: Any) -> None:
    """Raise ``TypeError`` unless ``input`` is a tensor or a (possibly nested) tuple of tensors."""
    if isinstance(input, tuple):
        for x in input:
            check(x)
        return
    if not isinstance(input, Tensor):
        raise TypeError(f"expected Tensor, but got {input.__class__.__name__}")


def scatter(input: TensorOrTensors, chunks: int) -> List[Batch]:
    """Split ``input`` along dim 0 into at most ``chunks`` micro-batches (``torch.chunk`` sizes).

    Each tensor of a tuple is chunked on its own and the pieces are zipped position-wise (tensors of other batch
    sizes are allowed, as upstream, while they split into as many chunks).

    Raises:
        TypeError: a nested tuple (an element that is not a tensor).
        ValueError: an empty tuple or a 0-d tensor; the tensors of a tuple split into different numbers of chunks (upstream zipped them and dropped
            the rows past the shortest, silently: an 8-row and a 2-row input at ``chunks=4`` gave 4 rows of output).
    """
    tensors = (input,) if isinstance(input, Tensor) else tuple(input)
    # Both failed later with errors naming nothing of the input: torch's chunk error, an IndexError in gather.
    if not tensors:
        raise ValueError("the input is an empty tuple: pass a tensor or a tuple of tensors to split into micro-batches")
    nested = [i for i, t in enumerate(tensors) if not isinstance(t, Tensor)]
    if nested:
        # check() lets nested tuples through (partitions may pass them between each other); they cannot be split.
        raise TypeError(
            f"the input's element(s) {nested} are {type(tensors[nested[0]]).__name__}s, not tensors: the input is "
            "split into micro-batches as a tensor or a flat tuple of tensors; flatten the nested tuple"
        )
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("an input tensor is 0-d: inputs are split into micro-batches along dim 0 (the batch)")
    if isinstance(input, Tensor):
        pieces: List[TensorOrTensors] = list(input.chunk(chunks))
    else:
        per_tensor = [t.chunk(chunks) for t in input]
        counts = [len(c) for c in per_tensor]
        if len(set(counts)) > 1:
            sizes = [t.size(0) for t in input]
            raise ValueError(
                f"the input tensors have {sizes} rows and split into {counts} micro-batches at chunks={chunks}; they "
                "must split into as many (give them the same batch size), or rows past the shortest would be dropped"
            )
        pieces = list(zip(*per_tensor))
    return [Batch(piece, i) for i, piece in enumerate(pieces)]


def gather(outputs: List[Batch]) -> TensorOrTensors:
    """Concatenate micro-batches back into one mini-batch (a tensor or a tuple of tensors)."""
    if outputs[0].atomic:
        return torch.cat([b.tensor for b in outputs])
    columns = zip(*(b.tensors for b in outputs))
    return tuple(torch.cat(column) for column in columns)
