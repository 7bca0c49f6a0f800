# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Where MEVO's tiles put the weight gradient.

Each tile's backward computes its piece of the weight gradient. Upstream added the pieces by hand into
``proj_weight.grad`` and gave autograd no gradient for the weight at all. That only works while the weight is a
leaf seen by nobody else: under FlattenParamsWrapper or FSDP's flattening the weight is a view of a flat parameter,
whose ``.grad`` nothing reads (the gradient was lost, silently); DDP's and FSDP's hooks on the weight's
``AccumulateGrad`` never fired for it; and ``autograd.grad(loss, input)`` or ``backward(inputs=[input])`` changed
``proj_weight.grad`` although only the input's gradient was asked for.

So a forward of MEVO collects the pieces through a :class:`WeightGradSink` of its own, and the backward of
:class:`~fairscale.experimental.nn.mevo.BackwardTriggerFn` (the node through which every tile reads the weight,
which autograd runs after all of them) hands autograd the weight's gradient: it reaches the weight as any gradient
does, or nowhere when the weight's gradient was not asked for. Low-precision weights are summed in fp32 and cast
once (adding bf16 pieces tile after tile lost up to 3x the precision of plain bf16 autograd).

The public tile Functions may also be called, as upstream's, with the MEVO module itself as ``kernel_obj``: the
pieces then go into ``proj_weight.grad`` by hand, as upstream's did.
"""

import weakref
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["WeightGradSink", "ForwardKernel", "weight_grad_wanted", "accumulate_weight_grad", "accumulate_row_grads"]


class WeightGradSink:
    """Where one forward's tiles add their weight-gradient pieces, decided once per backward (graph task):

    * nowhere, when this backward does not ask for the weight's gradient (``autograd.grad(loss, input)``,
      ``backward(inputs=[input])``): the tiles then skip computing the pieces;
    * straight into ``proj_weight.grad`` when the weight is a leaf that has a gradient of its own dtype already
      (gradient accumulation, fp32/fp64) and no tensor hook: no weight-sized buffer, as upstream; the trigger then
      hands autograd a zero gradient that costs no memory, so the weight's ``AccumulateGrad`` hooks still run;
    * else into a buffer (fp32 for a low-precision weight) that the trigger hands to autograd, which takes it as the
      weight's gradient without a copy when there was none.
    """

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight
        self.sum_dtype = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        self.buffer: Optional[Tensor] = None
        self.node: Optional["weakref.ref[Any]"] = None  # the trigger's backward node (weak: it holds this sink)
        self._task = -1  # the graph task the choice below was made for
        self._wanted = True
        self._direct = False

    def watch(self, trigger_output: Tensor) -> None:
        """Remember the trigger's node: whether the running backward will execute it tells whether it wants the
        weight's gradient."""
        self.node = weakref.ref(trigger_output.grad_fn)

    def _decide(self) -> None:
        task = torch._C._current_graph_task_id()
        if task == self._task:
            return
        self._task = task
        node = self.node() if self.node is not None else None
        self._wanted = node is not None and bool(torch._C._will_engine_execute_node(node))
        w = self.weight
        grad = w.grad if w.is_leaf else None
        self._direct = (
            self._wanted
            and grad is not None
            and grad.layout == torch.strided
            and grad.shape == w.shape
            and grad.device == w.device
            and grad.dtype == w.dtype == self.sum_dtype
            and not getattr(w, "_backward_hooks", None)
            and _accumulates_into(node)
        )

    def wanted(self) -> bool:
        """Whether the running backward asks for the weight's gradient."""
        self._decide()
        return self._wanted

    def target(self) -> Optional[Tensor]:
        """The tensor to add pieces into (``None``: this backward does not want them)."""
        self._decide()
        if not self._wanted:
            return None
        if self._direct:
            return self.weight.grad
        if self.buffer is None:
            self.buffer = torch.zeros(self.weight.shape, dtype=self.sum_dtype, device=self.weight.device)
        return self.buffer

    def take(self) -> Optional[Tensor]:
        """What the trigger hands autograd as the weight's gradient (the sink is empty after, for a second backward
        through a retained graph)."""
        self._decide()
        buffer, self.buffer = self.buffer, None
        if self._direct:
            w = self.weight
            return torch.zeros((), dtype=w.dtype, device=w.device).expand(w.shape)
        return None if buffer is None else buffer.to(self.weight.dtype)


def _accumulates_into(trigger_node: Any) -> bool:
    """Whether the running backward accumulates into the weight's ``.grad`` (a ``backward()``), rather than returning
    its gradient (``autograd.grad``, which must leave ``.grad`` alone) or skipping it."""
    edges = trigger_node.next_functions if trigger_node is not None else ()
    accumulate = edges[0][0] if edges else None
    if accumulate is None or type(accumulate).__name__ != "AccumulateGrad":
        return False
    try:
        return bool(torch._C._will_engine_execute_node(accumulate))
    except RuntimeError:  # torch refuses to answer for a leaf under autograd.grad(): that is the answer
        return False


class ForwardKernel:
    """What one forward's tiles receive as ``kernel_obj``: the MEVO module's settings, and that forward's sink."""

    def __init__(self, module: Any, sink: Optional[WeightGradSink]) -> None:
        self.module = module
        self.sink = sink

    def __getattr__(self, name: str) -> Any:  # fp_max, margin, scale, proj_weight...: the module's
        return getattr(self.__dict__["module"], name)


def weight_grad_wanted(kernel_obj: Any) -> bool:
    """Whether the tiles should compute their weight-gradient pieces in the running backward."""
    if isinstance(kernel_obj, ForwardKernel):
        return kernel_obj.sink is not None and kernel_obj.sink.wanted()
    return True  # upstream's path: kernel_obj is the module itself


def _target_tensor(kernel_obj: Any) -> Optional[Tensor]:
    """The tensor to add weight-gradient pieces into, or ``None`` when the weight takes no gradient."""
    if isinstance(kernel_obj, ForwardKernel):
        return kernel_obj.sink.target() if kernel_obj.sink is not None else None
    weight: Tensor = kernel_obj.proj_weight
    if not weight.requires_grad:
        # A frozen weight (a tied embedding the user froze) gets no gradient, as autograd gives none: written here,
        # an optimizer holding it would have changed it. (Upstream asserted requires_grad.)
        return None
    if weight.grad is None:  # upstream's path: kernel_obj is the module itself
        weight.grad = torch.zeros_like(weight)
    return weight.grad


def accumulate_weight_grad(kernel_obj: Any, w_grad: Tensor, w_idx: int, w_split_size: int) -> None:
    """Add the gradient of weight tile ``w_idx`` (rows ``w_idx * w_split_size`` on)."""
    target = _target_tensor(kernel_obj)
    if target is None:
        return
    start = w_idx * w_split_size
    target[start : start + w_grad.shape[0]] += w_grad.to(target.dtype)


def accumulate_row_grads(kernel_obj: Any, rows_grad: Tensor, target: Tensor) -> None:
    """Add each token's target-row gradient at its row.

    Autograd through ``w[target]`` would build a zero (vocab x d) gradient and scatter into it (800 MiB for a
    50k x 4096 fp32 head, on top of the gradient itself). Here repeated targets are summed first in the rows'
    precision (fp32 under ``fp_target``, as autograd summed them), then one ``index_add_`` writes the unique rows.

    Every shape here is the token count's, none depends on the targets' values: ``torch.unique`` (whose output size
    does) made the host wait for the GPU once per backward. The distinct targets are found by a stable sort instead
    and summed into one slot per token; the slots no target uses stay zero and add zero to row 0. Each row's tokens
    are summed in token order, as before.
    """
    grad = _target_tensor(kernel_obj)
    if grad is None:
        return
    target = target.reshape(-1)
    ordered, order = torch.sort(target, stable=True)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    slot_of_sorted = starts.cumsum(0) - 1  # the slot of each distinct target, in sorted order
    slot = torch.empty_like(slot_of_sorted).scatter_(0, order, slot_of_sorted)  # each token's slot
    rows = torch.zeros_like(ordered).scatter_(0, slot_of_sorted, ordered)  # each slot's row (unused slots: 0)
    sums = rows_grad.new_zeros(rows_grad.shape).index_add_(0, slot, rows_grad)
    grad.index_add_(0, rows, sums.to(grad.dtype))
