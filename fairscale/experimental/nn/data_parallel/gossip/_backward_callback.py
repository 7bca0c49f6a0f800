# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""One callback at the end of each backward through the model's output, queued by hooks on that output.

SlowMo averages the gradients inside the node once the whole backward is done (DDP does it bucket by bucket as the
gradients become ready). The autograd engine runs a queued callback when the graph is done, so a hook on every output
tensor that requires grad queues the callback, once per backward.
"""

import functools
from typing import Any, Callable, List

from torch import Tensor
from torch.autograd import Variable

__all__ = ["BackwardCallback", "output_tensors"]


def output_tensors(output: Any) -> List[Tensor]:
    """The tensors of ``output``, also those nested in lists, tuples and dict values."""
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in output_tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in output_tensors(o)]
    return []


class BackwardCallback:
    """Runs a callback once at the end of each backward that reaches a hooked output.

    The callback is passed to :meth:`attach` rather than kept here: the model owns this object, so a bound method of
    the model kept here would tie the two together for good; the hooks hold the callback only while the output's
    graph lives.
    """

    def __init__(self) -> None:
        self.queued = False  # the callback is queued for the running backward

    def reset(self) -> None:
        """Forget a callback queued by a backward that raised (the engine dropped it without running it)."""
        self.queued = False

    def attach(self, output: Any, callback: Callable[[], None]) -> None:
        """Hook the tensors of ``output`` that require grad so that their backward ends with ``callback()``."""
        hook = functools.partial(self._queue, callback)
        for t in output_tensors(output):
            if t.requires_grad:
                t.register_hook(hook)

    def _queue(self, callback: Callable[[], None], grad: Tensor) -> Tensor:
        # Once per backward, at its end: the engine runs queued callbacks when the graph is done.
        if not self.queued:
            self.queued = True
            Variable._execution_engine.queue_callback(functools.partial(self._run, callback))
        return grad

    def _run(self, callback: Callable[[], None]) -> None:
        self.queued = False
        callback()
