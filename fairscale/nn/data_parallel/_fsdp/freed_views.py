# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What the wrapped modules hold as their parameters while a flat parameter's full buffer is released.

With ``flatten_parameters=True`` each forward gives the wrapped modules views of the gathered full buffer as their
parameters (``module.weight``). After the forward (``reshard_after_forward``) and after the backward the buffer's
storage is released, and the views were left pointing at it: reading one between steps (logging a weight norm,
``model.get_input_embeddings().weight``, a plain parent's ``apply()`` of an init function) read freed memory, a segfault
on CPU (found by a fuzz of FSDP with ordinary torch code, session 41), an illegal memory access on CUDA.

While the buffer is released the modules hold a :class:`FreedParameter` instead: a tensor of the same shape, dtype
and device without data, whose every operation raises an error saying where to read the value. The views come back,
the same objects, when the buffer is allocated again (a checkpointed region recomputed in the backward reads the
views of its forward). Only attributes that still hold a view of this buffer are replaced, and only stand-ins still
in place are given back: whatever the user or another context (``summon_full_params``) put there is left alone.
"""

from typing import Any, Dict, List, Optional, Tuple, cast

import torch
from torch import Tensor, nn

from .naming import clean_path, join_path

__all__ = ["FreedParameter", "FreedViews"]


_TENSOR_REQUIRES_GRAD: Any = Tensor.requires_grad  # torch's C properties, which the stand-in's getters read
_TENSOR_DATA: Any = Tensor.data


def _cannot_freeze(name: str) -> str:
    return (
        f"FullyShardedDataParallel: {name} is a stand-in between steps; its requires_grad cannot freeze or unfreeze "
        "the parameter. Freeze parameters before wrapping, whole FSDP instances at a time (docs/fsdp.rst)."
    )


def _no_write(name: str) -> str:
    return (
        f"FullyShardedDataParallel: {name} is a stand-in: with flatten_parameters=True each rank keeps only its shard "
        "after construction and between steps, and the modules get new views of the full parameter at each forward. "
        "Read, copy or write it inside `with model.summon_full_params():`, load values with "
        "model.load_state_dict(), and save them from model.state_dict()."
    )


class FreedParameter(Tensor):
    """Shape, dtype and device of a parameter whose full value is not in memory now; any operation on it raises."""

    _fsdp_name: str
    _flat_view_stand_in = True  # FlattenParamsWrapper's foreign_values: what FSDP put in place of a view

    @staticmethod
    def __new__(cls, like: Tensor, name: str, device: Optional[Any] = None) -> "FreedParameter":
        # A wrapper subclass has metadata and no storage: .shape, .dtype, .device, .size() and .requires_grad (what
        # a freezing or counting loop over the modules reads) work, data never exists.
        t = Tensor._make_wrapper_subclass(
            cls,
            like.shape,
            dtype=like.dtype,
            device=like.device if device is None else device,
            strides=like.stride(),
            requires_grad=like.requires_grad,
        )
        t._fsdp_name = name
        return t

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch declares it as an attribute
        cls, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None
    ) -> Any:
        names = [a._fsdp_name for a in list(args) + list((kwargs or {}).values()) if isinstance(a, FreedParameter)]
        name = names[0] if names else "a parameter"
        raise RuntimeError(
            f"FullyShardedDataParallel: {name} is not in memory between steps (with flatten_parameters=True each "
            "rank keeps only its shard after construction and after each forward and backward). Read it inside "
            "`with model.summon_full_params():`, or take it from model.state_dict(); it is in place again during "
            "the forward and the backward of the FullyShardedDataParallel instance that owns it. (Raised inside a "
            "forward: the module was reached without that instance's forward, e.g. nn.MultiheadAttention reading "
            "its out_proj's weight wrapped on its own: wrap the module that reads it instead.)"
        )

    def requires_grad_(self, requires_grad: bool = True) -> "FreedParameter":
        # A flag set here would be lost at the next forward (new views of the flat parameter): refuse it loudly.
        raise RuntimeError(_cannot_freeze(self._fsdp_name))

    @property
    def requires_grad(self) -> bool:
        return bool(_TENSOR_REQUIRES_GRAD.__get__(self))

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        raise RuntimeError(_cannot_freeze(self._fsdp_name))

    @property
    def data(self) -> Tensor:
        return cast(Tensor, _TENSOR_DATA.__get__(self))  # a detach: raises in __torch_dispatch__

    @data.setter
    def data(self, value: Tensor) -> None:
        # torch's setter swaps the tensor's storage without a dispatch: the value would be lost at the next forward.
        raise RuntimeError(_no_write(self._fsdp_name))

    def data_ptr(self) -> int:
        # torch's answer, 0 for every stand-in, made storage-based tie detection (safetensors) see one storage.
        raise RuntimeError(_no_write(self._fsdp_name))

    def __reduce_ex__(self, protocol: Any) -> Any:
        # torch.save of a stand-in wrote a file that loads a stand-in of nothing.
        raise RuntimeError(_no_write(self._fsdp_name))

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FreedParameter({self._fsdp_name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


# (module holding the attribute, attribute name, "path (Class.attr)" for the error) of each of a flat parameter's
# views, tied names included.
_Slot = Tuple[nn.Module, str, str]


def _shown_name(path: str, m: nn.Module, n: str) -> str:
    return f"{clean_path(join_path(path, n))} ({type(m).__name__}.{n})"


def _slots(flat: Tensor) -> List[_Slot]:
    slots = [(m, n, _shown_name(path, m, n)) for path, m, n in getattr(flat, "_param_infos", None) or []]
    for path, _, m, n, _, _ in getattr(flat, "_shared_param_infos", None) or []:
        slots.append((m, n, _shown_name(path, m, n)))
    return slots


class FreedViews:
    """The stand-ins of one flat parameter's views while its full buffer is released (see the module doc).

    Runs at every free and gather of a full buffer: the slots and their stand-ins are made once per flat parameter
    (a stand-in costs about 4 us, a name a few more) and reused while the views keep their shape and dtype.
    """

    def __init__(self) -> None:
        self._flat: Optional[Tensor] = None  # whose slots these are
        self._buffer: Optional[Tensor] = None  # the buffer they were made for (the same tensor across free/regrow)
        self._slots: List[_Slot] = []
        # Per slot, one stand-in for views with and one for views without requires_grad (a no_grad forward's).
        self._stand_ins: List[List[Optional[FreedParameter]]] = []
        # (module, attribute, the view it held, the stand-in put there), for show().
        self._hidden: List[Tuple[nn.Module, str, Tensor, FreedParameter]] = []

    def __getstate__(self) -> Dict[str, Any]:
        # A copy of the model has no views until its first forward (its modules' views are left out of it).
        return {"_flat": None, "_buffer": None, "_slots": [], "_stand_ins": [], "_hidden": []}

    def hide(self, flat: Tensor, buffer: Tensor) -> None:
        """Replace the modules' views of ``buffer`` (``flat``'s full buffer, about to be released) by stand-ins."""
        # The buffer's memory: a view of it starts inside (data_ptr is one C call; the storage object is not made).
        start = buffer.data_ptr()
        end = start + buffer.numel() * buffer.element_size()
        if self._flat is not flat or self._buffer is not buffer:
            # A slot's views keep their shape, and the buffer its dtype and device, until the buffer is replaced.
            self._flat, self._buffer, self._slots = flat, buffer, _slots(flat)
            self._stand_ins = [[None, None] for _ in self._slots]
        stand_ins, hidden = self._stand_ins, self._hidden
        made: Dict[int, FreedParameter] = {}  # id() of a view -> its stand-in: tied names keep sharing one object
        for i, (m, n, name) in enumerate(self._slots):
            d = m.__dict__
            view = d.get(n)
            if type(view) is not Tensor or not start <= view.data_ptr() < end:
                continue  # nothing there, a stand-in already, or not a view of this buffer (the user's)
            stand_in = made.get(id(view))
            if stand_in is None:
                grad = int(view.requires_grad)
                stand_in = stand_ins[i][grad]
                if stand_in is None:
                    stand_in = stand_ins[i][grad] = FreedParameter(view, name)
                made[id(view)] = stand_in
            d[n] = stand_in
            hidden.append((m, n, view, stand_in))

    @staticmethod
    def retire(flat: Tensor, buffer: Tensor) -> None:
        """Replace the modules' views of ``buffer`` by stand-ins for good: the buffer is dropped, not released.

        At construction the views point at the tensor the flat parameter held before sharding. Left in place they
        kept the whole unsharded parameter in memory until the first forward (upstream frees it), and a write through
        one (an init after wrapping) went to memory no forward reads, silently. Nothing keeps the views: the first
        forward gives the modules new ones.
        """
        start = buffer.data_ptr()
        end = start + buffer.numel() * buffer.element_size()
        made: Dict[int, FreedParameter] = {}
        for m, n, name in _slots(flat):
            view = m.__dict__.get(n)
            if type(view) is Tensor and start <= view.data_ptr() < end:
                if id(view) not in made:
                    made[id(view)] = FreedParameter(view, name, flat.device)  # the shard may have moved
                m.__dict__[n] = made[id(view)]

    @staticmethod
    def install_missing(flat: Tensor) -> None:
        """Give stand-ins to the slots of ``flat`` that hold nothing: a copy's, before its first forward.

        A copy (``copy.deepcopy``, ``torch.save`` of the model) leaves the views out; its modules had no attribute
        at all, an ``AttributeError`` where the original has a stand-in. These have the parameters' shapes and the
        flat parameter's dtype (fp32 under mixed precision, where the original's show the compute dtype after a
        forward).
        """
        made: Dict[Tuple[int, str], FreedParameter] = {}
        for (path, m, n), shape in zip(getattr(flat, "_param_infos", []), getattr(flat, "_param_shapes", [])):
            if n not in m.__dict__ and n not in m._parameters:
                like = torch.empty(shape, dtype=flat.dtype, device="meta", requires_grad=flat.requires_grad)
                made[(id(m), n)] = m.__dict__[n] = FreedParameter(like, _shown_name(path, m, n), flat.device)
        for path, _, m, n, shared_m, shared_n in getattr(flat, "_shared_param_infos", None) or []:
            source = made.get((id(shared_m), shared_n))
            if source is not None and n not in m.__dict__ and n not in m._parameters:
                m.__dict__[n] = source

    def show(self) -> None:
        """Give the modules back the views :meth:`hide` took (the buffer holds memory again)."""
        if not self._hidden:
            return
        hidden, self._hidden = self._hidden, []
        for m, n, view, stand_in in hidden:
            d = m.__dict__
            if d.get(n) is stand_in:
                d[n] = view
