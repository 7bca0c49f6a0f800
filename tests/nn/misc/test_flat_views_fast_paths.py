# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The per-forward fast paths of a flattened module's views (issue 28: per-unit CPU cost).

* ``FlatParamViews`` cuts each view with one ``as_strided`` from the flat storage (layout cached per flat parameter)
  when the flat parameter is contiguous, and with ``split`` + ``view`` otherwise: both give the elements, shapes and
  strides of upstream's split views, as non-view aliases sharing the flat parameter's version counter.
* ``_set_plain_tensor`` stores a plain tensor view without ``nn.Module.__setattr__`` only when that would do the same;
  a module class with its own ``__setattr__``, or a Parameter value, still goes through ``setattr``.
"""

import copy
import pickle
from typing import Any, List

import torch
import torch.nn as nn
from torch import Tensor

from fairscale.nn.misc import FlattenParamsWrapper
from fairscale.nn.misc._flatten.forward_views import forward_views
from fairscale.nn.misc.flatten_params_wrapper import _set_plain_tensor


class _Net(nn.Module):
    """Parameters of several ranks (2-D, 1-D, 0-D, 3-D) and a module that records its attribute assignments."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.cube = nn.Parameter(torch.arange(24.0).view(2, 3, 4))
        self.rec = _Recording()

    def forward(self, x: Tensor) -> Tensor:
        return self.rec(self.lin(x) * self.scale + self.cube.sum())


class _Recording(nn.Module):
    """Keeps the names assigned through its own ``__setattr__``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "assigned":
            self.__dict__.setdefault("assigned", []).append(name)
        super().__setattr__(name, value)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w


def _check_like_split_views(views: List[Tensor], flat: Tensor) -> None:
    reference = list(flat.get_param_views())
    assert len(views) == len(reference)
    for v, r in zip(views, reference):
        assert (v.shape, v.stride(), v.storage_offset(), v.data_ptr()) == (
            r.shape,
            r.stride(),
            r.storage_offset(),
            r.data_ptr(),
        )
        assert v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert not v._is_view()  # an in-place change is an ordinary op on a function output
    before = flat._version
    with torch.no_grad():
        views[1].mul_(1)
    assert flat._version == before + 1  # one shared version counter


def test_views_match_split_views_contiguous_and_strided() -> None:
    torch.manual_seed(0)
    model = FlattenParamsWrapper(_Net())
    flat = model.flat_param
    _check_like_split_views(forward_views(flat), flat)  # contiguous: the as_strided path
    numels, shapes, layout = flat._fpw_view_layout  # the layout it cut them with, cached
    assert numels is flat._param_numels and shapes is flat._param_shapes
    assert [(size, offset) for size, _, offset in layout] == [
        (shape, sum(flat._param_numels[:i])) for i, shape in enumerate(flat._param_shapes)
    ]
    # A strided flat parameter (every other element of a larger buffer): the split + view path.
    base = torch.zeros(2 * flat.numel())
    base[::2].copy_(flat.detach())
    flat.data = base[::2]
    assert flat.stride(0) == 2
    views = forward_views(flat)
    _check_like_split_views(views, flat)
    assert all(torch.equal(v, r) for v, r in zip(views, flat.get_param_views()))


def test_layout_cache_follows_replaced_layout_lists() -> None:
    torch.manual_seed(0)
    model = FlattenParamsWrapper(_Net())
    x = torch.randn(5, 4)
    expected = model(x)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        flat = clone.flat_param
        assert flat._param_shapes is not model.flat_param._param_shapes
        _check_like_split_views(forward_views(flat), flat)
        assert torch.equal(clone(x), expected)


def test_set_plain_tensor_keeps_module_setattr_semantics() -> None:
    torch.manual_seed(0)
    model = FlattenParamsWrapper(_Net())
    rec = model.module.rec
    rec.__dict__["assigned"] = []
    model(torch.randn(2, 4)).sum().backward()
    assert rec.assigned == ["w"]  # its own __setattr__ saw the view assignment
    lin = model.module.lin
    assert type(lin.__dict__["weight"]) is Tensor and "weight" not in lin._parameters
    # A Parameter value is registered, as nn.Module.__setattr__ does.
    p = nn.Parameter(torch.ones(1))
    holder = nn.Module()
    _set_plain_tensor(holder, "p", p)
    assert holder._parameters["p"] is p
    # A plain tensor under a registered buffer name replaces the buffer, as nn.Module.__setattr__ does.
    holder.register_buffer("b", torch.zeros(1))
    t = torch.ones(1)
    _set_plain_tensor(holder, "b", t)
    assert holder._buffers["b"] is t and "b" not in holder.__dict__
