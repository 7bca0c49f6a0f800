# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
""":class:`FlatParameter`: one ``nn.Parameter`` holding several parameters back to back.

The class is public (re-exported from :mod:`fairscale.nn.misc.flatten_params_wrapper`); it lives here so
that the grouping code can recognise it without importing the wrapper front.
"""

import copy
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["FlatParameter", "ParamInfo", "SharedParamInfo"]

# (module_name, module, param_name): the first owner of a flattened parameter. ``module_name`` is relative to
# the FlattenParamsWrapper, so it starts with ``_fpw_module``.
ParamInfo = Tuple[str, nn.Module, str]
# (module_name, shared_module_name, module, param_name, shared_module, shared_param_name): a further name
# under which an already-flattened parameter is reachable (tied weights); the ``shared_*`` entries name the
# first owner, whose view this name aliases.
SharedParamInfo = Tuple[str, str, nn.Module, str, nn.Module, str]

# The state restored by ``__setstate__``: numels, shapes, param infos, shared param infos.
_FlatState = Tuple[List[int], List[torch.Size], List[ParamInfo], List[SharedParamInfo]]


class FlatParameter(nn.Parameter):
    """A parameter holding the concatenation of several tensors, flattened to 1-D.

    The data is a new storage: the inputs are copied, never aliased. The per-parameter layout (numels and
    shapes, in concatenation order) is kept so that views of the original shapes can be cut out again with
    :meth:`get_param_views`.

    Args:
        params (Sequence[Tensor]): non-empty list or tuple of parameters/tensors, all with the same dtype and
            device. FlatParameters cannot be nested.
        requires_grad (bool): whether the flat parameter requires grad. Default: ``True``.

    Attributes:
        _param_numels (List[int]): number of elements of each original tensor.
        _param_shapes (List[torch.Size]): shape of each original tensor.
        _param_infos (List[ParamInfo]): ``(module_name, module, param_name)`` of each original parameter, filled
            in by :class:`FlattenParamsWrapper` (module names are relative to the wrapper).
        _shared_param_infos (List[SharedParamInfo]): ``(module_name, shared_module_name, module, param_name,
            shared_module, shared_param_name)`` for every further name of a shared (tied) parameter.
    """

    # Pickles name the public path, so a checkpoint that pickles the module stays loadable by upstream fairscale
    # (and upstream pickles load here). The public module re-exports this class, which makes the name resolvable.
    __module__ = "fairscale.nn.misc.flatten_params_wrapper"

    _param_numels: List[int]
    _param_shapes: List[torch.Size]
    _param_infos: List[ParamInfo]
    _shared_param_infos: List[SharedParamInfo]

    def __new__(cls, params: Sequence[Tensor], requires_grad: bool = True) -> "FlatParameter":
        _check_inputs(params)
        with torch.no_grad():
            data = torch.cat([p.detach().reshape(-1) for p in params], 0)
        return super().__new__(cls, data, requires_grad=requires_grad)

    def __init__(self, params: Sequence[Tensor], requires_grad: bool = True):
        self._param_numels = [p.numel() for p in params]
        self._param_shapes = [p.size() for p in params]
        self._param_infos = []
        self._shared_param_infos = []

    def get_param_views(self, external_data: Optional[Tensor] = None) -> Iterator[Tensor]:
        """Views of the original shapes into this flat parameter (or into ``external_data``).

        The split is done eagerly (when this method is called), each ``view`` lazily (when the iterator is
        consumed). Split from the FlatParameter object itself, the views are autograd-connected to it.

        Args:
            external_data (Optional[Tensor]): a tensor with the same number of elements to cut the views
                from instead (e.g. a gathered full parameter).

        Returns:
            An iterator over one view per original parameter, in flattening order.

        Raises:
            ValueError: ``external_data`` does not have ``sum(_param_numels)`` elements.
        """
        data: Tensor = self if external_data is None else external_data
        expected = sum(self._param_numels)
        if not isinstance(data, Tensor) or data.numel() != expected:
            got = f"{data.numel()} elements" if isinstance(data, Tensor) else type(data).__name__
            raise ValueError(
                f"external_data must be a tensor with {expected} elements (the flat parameter's size), got {got}"
            )
        splits = torch.split(data, self._param_numels)
        return (t.view(shape) for t, shape in zip(splits, self._param_shapes))

    def metadata(self) -> Tuple[List[str], List[torch.Size], List[int]]:
        """Names (``"<module_name>.<param_name>"``), shapes and numels of the flattened parameters."""
        names = [f"{mname}.{pname}" if mname else pname for mname, _, pname in self._param_infos]
        return names, list(self._param_shapes), list(self._param_numels)

    def _flat_state(self) -> _FlatState:
        return (self._param_numels, self._param_shapes, self._param_infos, self._shared_param_infos)

    def __setstate__(self, state: _FlatState) -> None:
        """Restore the layout lists after unpickling (see :meth:`__reduce_ex__`)."""
        self._param_numels, self._param_shapes, self._param_infos, self._shared_param_infos = state

    def __reduce_ex__(self, proto: Any) -> Tuple[Any, ...]:
        """Pickle as "a FlatParameter of this data" plus the layout lists.

        ``nn.Parameter``'s own reduction would rebuild a plain ``Parameter`` and lose the layout.
        """
        return (type(self), ([self.data], self.requires_grad), self._flat_state())

    def __deepcopy__(self, memo: Dict[int, Any]) -> "FlatParameter":
        # nn.Parameter.__deepcopy__ would call ``type(self)(tensor, requires_grad)``, which is not our signature.
        if id(self) in memo:
            return cast("FlatParameter", memo[id(self)])
        # Unlike pickling (which keeps upstream's format), a deep copy also carries attributes that owners such as
        # FSDP attach to the parameter, as a deep copy of a plain nn.Parameter's tensor does.
        result = type(self)([self.data], self.requires_grad)
        memo[id(self)] = result
        result.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return result


def _check_inputs(params: Sequence[Tensor]) -> None:
    if not isinstance(params, (list, tuple)) or len(params) == 0:
        raise ValueError(
            f"FlatParameter needs a non-empty list or tuple of tensors, got {type(params).__name__}"
            + (" of length 0" if isinstance(params, (list, tuple)) else "")
        )
    for i, p in enumerate(params):
        if isinstance(p, FlatParameter):
            raise ValueError(
                f"params[{i}] is already a FlatParameter; FlatParameters cannot be nested. Flatten the original "
                "parameters instead (e.g. leave already-flattened parameters out of param_list)."
            )
        if not isinstance(p, Tensor):
            raise ValueError(f"params[{i}] must be a tensor or parameter, got {type(p).__name__}")
    dtypes = {p.dtype for p in params}
    devices = {p.device for p in params}
    if len(dtypes) > 1 or len(devices) > 1:
        raise ValueError(
            "all tensors of a FlatParameter must share dtype and device, got "
            f"dtypes {sorted(str(d) for d in dtypes)} and devices {sorted(str(d) for d in devices)}"
        )
