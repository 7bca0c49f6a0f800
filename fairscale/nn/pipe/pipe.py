# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The GPipe front: :class:`Pipe` splits an ``nn.Sequential`` over devices and pipelines micro-batches."""

import warnings
from collections import OrderedDict
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union, cast

import torch
from torch import Tensor, nn

from fairscale.internal.compiler import call_outside_compiler
from fairscale.internal.dry_load import load_state_dict_all_or_nothing
from fairscale.internal.device import accelerator_device_count
from fairscale.internal.version import torch_version as torch_version

from . import microbatch
from ._checks import balance_entries
from .batchnorm import DeferredBatchNorm, count_plain_batch_norms_once
from .checkpoint import guard_checkpointed
from .pipeline import Pipeline
from .skip.layout import check_nested_skips, inspect_skip_layout
from .skip.skippable import verify_skippables
from .stream import AbstractStream, new_stream

__all__ = ["Pipe", "BalanceError"]

Device = Union[torch.device, int, str]
Devices = Union[Iterable[Device], List[Device]]
Tensors = Tuple[Tensor, ...]
TensorOrTensors = Union[Tensor, Tensors]

_MOVING_DENIED_MESSAGE = "denied to move parameters and buffers, because Pipe should manage device placement"
MOVING_DENIED = TypeError(_MOVING_DENIED_MESSAGE)

_CHECKPOINT_MODES = ("always", "except_last", "never")


def recommend_auto_balance(message: str) -> str:
    """Append a recommendation to use the automatic balancing tools to an error ``message``."""
    return f"""{message}

If your model is still under development, its optimal balance would change
frequently. In this case, we highly recommend 'fairscale.nn.pipe.balance' for
naive automatic balancing:

  from fairscale.nn import Pipe
  from fairscale.nn.pipe.balance import balance_by_time

  partitions = torch.cuda.device_count()
  sample = torch.empty(...)
  balance = balance_by_time(partitions, model, sample)

  model = Pipe(model, balance, ...)
"""


def verify_module(module: nn.Sequential) -> None:
    """Raise unless ``module`` is an ``nn.Sequential`` whose children are distinct objects."""
    if not isinstance(module, nn.Sequential):
        raise TypeError("module must be nn.Sequential to be partitioned")
    named_children = list(module.named_children())
    if len(named_children) != len(module):
        raise ValueError("module with duplicate children is not supported")


def verify_splitting(
    module: nn.Sequential, partitions: List[nn.Sequential], balance: Iterable[int], devices: List[torch.device]
) -> None:
    """Raise if a parameter shared between layers ended up in partitions on different devices."""
    num_parameters = len(list(module.parameters()))
    num_child_parameters = sum(len(list(child.parameters())) for child in module.children())
    if num_parameters == num_child_parameters:
        return
    for i in range(len(partitions)):
        for j in range(i + 1, len(partitions)):
            if devices[i] == devices[j]:
                continue
            params_i = {id(p) for p in partitions[i].parameters()}
            if any(id(q) in params_i for q in partitions[j].parameters()):
                raise ValueError("module with duplicate parameters on distinct devices is not supported")


class BalanceError(ValueError):
    pass


def check_split(module: nn.Sequential, balance: Iterable[int], devices: Sequence[torch.device]) -> List[int]:
    """The checks of :func:`split_module`, which change nothing: ``Pipe`` runs them before it converts anything in
    the user's module (a failed constructor left its batch norms converted to ``DeferredBatchNorm``).

    Returns:
        List[int]: the balance, as a list.
    """
    balance = balance_entries(balance, BalanceError)
    if len(module) != sum(balance):
        raise BalanceError(
            "module and sum of balance have different length "
            f"(module: {len(module)}, sum of balance: {sum(balance)})"
        )
    if any(x <= 0 for x in balance):
        raise BalanceError(f"all balance numbers must be positive integer (balance: {balance})")
    if len(balance) > len(devices):
        raise IndexError(
            "too few devices to hold given partitions " f"(devices: {len(devices)}, partitions: {len(balance)})"
        )
    return balance


def split_module(
    module: nn.Sequential, balance: Iterable[int], devices: List[torch.device]
) -> Tuple[nn.ModuleList, List[int], List[torch.device]]:
    """Split ``module`` into partitions of the sizes in ``balance``, each moved to its device.

    The layers keep their names inside their partition. ``devices`` is truncated (in place) to the number of
    partitions.

    Raises:
        BalanceError: wrong balance (an entry that is not a positive int, or a sum other than ``len(module)``).
        TypeError: ``balance`` is not iterable.
        IndexError: fewer devices than partitions.
    """
    balance = check_split(module, balance, devices)

    j = 0
    partitions = []
    layers: "OrderedDict[str, nn.Module]" = OrderedDict()
    for name, layer in module.named_children():
        layers[name] = layer
        if len(layers) == balance[j]:
            partition = nn.Sequential(layers)
            partition.to(devices[j])
            partitions.append(partition)
            layers.clear()
            j += 1

    del devices[j:]
    return nn.ModuleList(partitions), balance, devices


_COMPILE_WARNING = (
    "torch.compile reached a fairscale Pipe: the pipeline's schedule runs outside the compiler, and so do its "
    "partitions unless they were compiled themselves. Compile the partitions (the layers of the nn.Sequential) "
    "before building the Pipe to get compiled code."
)


class Pipe(nn.Module):
    """Wraps an ``nn.Sequential`` to train it with pipeline parallelism on several devices of one host (GPipe).

    The module is split into partitions of consecutive layers (``balance`` says how many layers each gets),
    partition ``j`` is moved to ``devices[j]``, and each mini-batch is split into ``chunks`` micro-batches that
    flow through the partitions concurrently, one worker thread per device. Activations are recomputed in the
    backward pass (checkpointing) to save memory, as ``checkpoint`` says. Outputs and gradients are those of the
    plain sequential module; devices may also be CPUs (several partitions may share a device)::

        model = nn.Sequential(a, b, c, d)
        model = Pipe(model, balance=[2, 2], devices=["cuda:0", "cuda:1"], chunks=8)
        output = model(input.to("cuda:0"))  # output on cuda:1

    Args:
        module (nn.Sequential): the model; its layers are moved to their devices (in place).
        balance (Iterable[int]): number of layers of each partition (see :mod:`fairscale.nn.pipe.balance`).

    Keyword Args:
        devices (Iterable[Device]): one device per partition (extra devices are ignored); default: every CUDA
            device. The input must be on ``devices[0]``; the output is on ``devices[-1]``.
        chunks (int): number of micro-batches (default ``1``).
        checkpoint (str): ``'always'``, ``'except_last'`` (default) or ``'never'``: which micro-batches are
            checkpointed (indices below ``chunks``, ``chunks - 1`` and ``0`` respectively; none in eval mode).
        deferred_batch_norm (bool): replace every batch norm by :class:`DeferredBatchNorm`, which tracks running
            statistics over the whole mini-batch (default ``False``).

    Raises:
        TypeError: the module is not an ``nn.Sequential``, or its skip connections do not match.
        ValueError: invalid arguments (balance, chunks, checkpoint, duplicate children or parameters).
        IndexError: fewer devices than partitions.
    """

    #: The number of layers in each partition.
    balance: List[int] = []
    #: The devices of the partitions; ``devices[-1]`` is the output device.
    devices: List[torch.device] = []
    #: The number of micro-batches.
    chunks: int = 1
    #: The checkpoint mode.
    checkpoint: str = "except_last"

    def __init__(
        self,
        module: nn.Sequential,
        balance: Optional[Iterable[int]] = None,
        *,
        devices: Optional[Devices] = None,
        chunks: int = chunks,
        checkpoint: str = checkpoint,
        deferred_batch_norm: bool = False,
    ) -> None:
        super().__init__()
        warnings.warn(
            "fairscale.nn.Pipe has been upstreamed to PyTorch as torch.distributed.pipeline.sync.Pipe. "
            "It is now deprecated and will be removed in a future version of fairscale. "
            "(Upstream's notice, kept for filters that match it: this fairscale keeps Pipe working. PyTorch removed "
            "torch.distributed.pipeline again in 2.4; its successor is torch.distributed.pipelining, another API.)",
            DeprecationWarning,
        )
        chunks = int(chunks)
        checkpoint = str(checkpoint)

        if balance is None:
            raise ValueError(recommend_auto_balance("balance is required"))
        if chunks <= 0:
            raise ValueError("number of chunks must be positive integer")
        if checkpoint not in _CHECKPOINT_MODES:
            raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")

        verify_module(module)
        # Check skip connections before the module is split: a mismatch is a model bug, not a balance problem.
        verify_skippables(module)

        self.chunks = chunks
        self.checkpoint = checkpoint

        if devices is None:
            devices = range(accelerator_device_count())
        device_list = [torch.device(d) for d in devices]
        try:
            # Checked before anything in the user's module is converted (a failed constructor must leave it as it
            # was: its batch norms were left as DeferredBatchNorm, silently changing their statistics later).
            balance = check_split(module, balance, device_list)
        except BalanceError as exc:
            raise ValueError(recommend_auto_balance(str(exc))) from None
        check_nested_skips(module, balance)

        if deferred_batch_norm:
            module = DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)
        if checkpoint != "never":
            count_plain_batch_norms_once(module)
        self.partitions, self.balance, self.devices = split_module(module, balance, device_list)

        verify_splitting(module, cast(List[nn.Sequential], list(self.partitions)), self.balance, self.devices)

        self._copy_streams: List[List[AbstractStream]] = [[new_stream(d) for _ in range(chunks)] for d in self.devices]
        self._skip_layout = inspect_skip_layout(cast(List[nn.Sequential], list(self.partitions)))

        checkpoint_stop = {"always": self.chunks, "except_last": self.chunks - 1, "never": 0}[self.checkpoint]
        self.pipeline = Pipeline(
            cast(List[nn.Sequential], list(self.partitions)),
            self.devices,
            self._copy_streams,
            self._skip_layout,
            checkpoint_stop,
        )

    def __getstate__(self) -> Dict[str, Any]:
        # The pipeline recreates its copy streams (and worker threads) when it is copied or unpickled; this
        # reference to the original's streams is taken back from it in __setstate__.
        state = dict(self.__dict__)
        state.pop("_copy_streams", None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self._copy_streams = self.pipeline.copy_streams

    def __len__(self) -> int:
        """The number of layers of all partitions together."""
        return sum(len(cast(nn.Sequential, p)) for p in self.partitions)

    def __getitem__(self, index: int) -> nn.Module:
        """The ``index``-th layer (negative indices count from the end)."""
        partitions: Iterable[nn.Module] = self.partitions
        if index < 0:
            partitions = reversed(list(self.partitions))
        for partition in partitions:
            seq = cast(nn.Sequential, partition)
            try:
                layer: nn.Module = seq[index]
                return layer
            except IndexError:
                pass
            shift = len(seq)
            if index < 0:
                index += shift
            else:
                index -= shift
        raise IndexError

    def __iter__(self) -> Iterator[nn.Module]:
        """The layers of all partitions, in order."""
        for partition in self.partitions:
            yield from cast(nn.Sequential, partition)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, all or nothing: tried on shape-only tensors first, so that a load that fails
        leaves the model as it was (torch's load copies every entry that fits before raising about the others).
        """
        return load_state_dict_all_or_nothing(self, state_dict, strict, assign)

    # Pipe places the partitions on their devices; moving them afterwards would break the pipeline.
    def cuda(self, device: Optional[Device] = None) -> "Pipe":
        raise TypeError(_MOVING_DENIED_MESSAGE)

    def cpu(self) -> "Pipe":
        raise TypeError(_MOVING_DENIED_MESSAGE)

    def to(self, *args: Any, **kwargs: Any) -> "Pipe":
        """Like ``nn.Module.to``, but only dtype and memory-format conversions are allowed."""
        if "device" in kwargs or "tensor" in kwargs:
            raise TypeError(_MOVING_DENIED_MESSAGE)
        if args and isinstance(args[0], (torch.device, int, str, Tensor)):
            raise TypeError(_MOVING_DENIED_MESSAGE)
        return super().to(*args, **kwargs)

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        """Run the pipeline on a mini-batch.

        Args:
            input (torch.Tensor or Tuple[torch.Tensor, ...]): the mini-batch, on ``devices[0]``; split along dim 0.

        Returns:
            The output (a new tensor or tuple of tensors) on ``devices[-1]``.

        Raises:
            TypeError: the input (or a partition's output) is not a tensor or a tuple of tensors.
        """
        # The schedule (micro-batches on worker threads, phony dependencies) cannot be traced: under torch.compile
        # it runs outside the compiler (it failed with the compiler's internal error), and partitions compiled on
        # their own still run compiled.
        return call_outside_compiler(self._forward, input, warning=_COMPILE_WARNING)

    def _forward(self, input: TensorOrTensors) -> TensorOrTensors:
        microbatch.check(input)
        if not self.devices:
            # An empty sequential module is an identity.
            return input
        batches = microbatch.scatter(input, self.chunks)
        self.pipeline.run(batches)
        # The pipeline's own condition for checkpointing (the first partition's mode, not the Pipe's own flag).
        if self.pipeline.checkpoint_stop > 0 and self.pipeline.partitions[0].training and torch.is_grad_enabled():
            guard_checkpointed(batches)
        return microbatch.gather(batches)
