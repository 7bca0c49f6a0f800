# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FlattenParamsWrapper: present a module's parameters as one (or a few) flat parameters.

Public front: :class:`FlatParameter`, :class:`FlattenParamsWrapper`, ``_enable_pre_load_state_dict_hook`` and the
:func:`fpw_pre_load_hook_disabled` context manager. The machinery lives in :mod:`fairscale.nn.misc._flatten`.
"""

import contextlib
import copy
from itertools import chain
from typing import Any, Callable, Dict, Generator, Iterator, List, Mapping, Optional, Sequence, Tuple, cast

import torch
import torch.nn as nn
from torch import Tensor

from fairscale.internal.dry_load import dry_run_load
from fairscale.internal.errors import FairscaleRuntimeError
from fairscale.internal.forwarding import refuse_shadowing_assignment
from fairscale.internal.module_hooks import register_state_dict_hooks
from fairscale.internal.state_dict import replace_by_prefix_ as replace_by_prefix_  # upstream imported it here

from ._flatten.conversion import converted_apart
from ._flatten.flat_parameter import FlatParameter, ParamInfo, SharedParamInfo
from ._flatten.foreign_values import refuse_foreign_values
from ._flatten.forward_views import forward_views
from ._flatten.grouping import check_flat_param_names, locate_groups, normalize_param_groups, user_param_name
from ._flatten.module_attrs import ViewSnapshot, drop_attr, restore_views, snapshot_views, stash_views
from ._flatten.module_attrs import set_plain_tensor as _set_plain_tensor  # tests import it from here
from ._flatten.state_dict_hooks import (
    _enable_pre_load_state_dict_hook,
    errors_named_by_keys,
    fpw_pre_load_hook_disabled,
    post_load_state_dict_hook,
    post_state_dict_hook,
    pre_load_state_dict_hook,
    refuse_flat_key_names,
    with_wrapper_level_metadata,
)
from ._flatten.unflatten_context import (
    ContextRecord,
    GivenParam,
    OpenContext,
    TiedName,
    UnwritableRebind,
    converting,
    open_context,
    opened,
    record_of,
    reflatten_copy,
    take_back,
)
from ._flatten.view_release import release_views_on_collection

__all__ = ["FlatParameter", "FlattenParamsWrapper", "_enable_pre_load_state_dict_hook", "fpw_pre_load_hook_disabled"]

ViewBuilder = Callable[[FlatParameter], List[Tensor]]

# Names of the context machinery that FSDP's summon imports from here.
_UnwritableRebind = UnwritableRebind
_ViewSnapshot = ViewSnapshot

# Key, in a copied or pickled state, of the open context's record (see FlattenParamsWrapper._reflatten_copy).
_CONTEXT_RECORD = "_fpw_context_record"


class FlattenParamsWrapper(nn.Module):
    """A wrapper that flattens the parameters of a module into one or more :class:`FlatParameter`.

    The flat parameters are registered on the wrapper as ``flat_param_<name>``; the original parameters are
    removed from their modules. At every forward the wrapped module's parameter attributes are set to fresh
    views into the flat parameters (plain tensors, not Parameters), so gradients flow into the flat parameters
    and an optimizer only needs to see ``wrapper.parameters()``. Parameters shared by several modules (tied
    weights) are flattened once and every owner sees the same view. ``state_dict()`` returns the keys of the
    unwrapped module by default; :meth:`flat_state_dict` returns the flat form, and :meth:`load_state_dict`
    accepts either. A parent module containing the wrapper also loads either form (original names are folded
    into the flat entry by the load pre hook), and missing/unexpected keys are reported under the names of the
    given dict. Use :func:`fpw_pre_load_hook_disabled` to load dicts holding the raw ``_fpw_module.`` paths.
    When the wrapper is freed, the views its modules hold are replaced by detached aliases, so that the flat
    parameters and modules are freed with it (a wrapped module kept alone keeps its values but no longer sends
    gradients to a flat parameter). ``.to()``, ``.double()``, ``.cuda()`` and the like give the modules views of the
    converted flat parameters at once. Convert the wrapper, not ``wrapper.module``: the flat parameters are the
    wrapper's, and the wrapped module's own ``.to()`` reaches only its buffers and unflattened parameters.

    Build the optimizer after wrapping, on ``wrapper.parameters()``: the original parameters are copied into the flat
    parameters and no longer train, so an optimizer built on them before wrapping changes nothing, silently (as
    upstream; :class:`~fairscale.nn.data_parallel.FullyShardedDataParallel` refuses that at the first step, a bare
    wrapper does not check, to keep the optimizer step free of checks).

    ``state_dict()`` lists the module versions of its ``_metadata`` under the unwrapped paths (and under the internal
    ``_fpw_module.`` paths, which loads into a wrapper read), and the wrapper's :meth:`load_state_dict` reads a plain
    module's; so versioned modules (BatchNorm, quantized layers) exchange checkpoints with the unwrapped module. A
    parent module loading a plain module's dict into a wrapper nested in it cannot pass those versions on (torch
    gives nested modules no metadata to rewrite): such modules see no version there, as upstream.

    Args:
        module (nn.Module): the module to wrap.
        param_list (Optional[list]): which parameters to flatten. ``None`` (default): all of them into one
            flat parameter. A list of parameters: those, into one flat parameter. A list of lists: one flat
            parameter per (non-empty) inner list. An empty list: flatten nothing. Parameters left out stay
            ordinary parameters of their modules. Within a flat parameter the order is the module traversal
            order, not the list order.
        flat_param_names (Optional[List[str]]): one name per group; the flat parameters are registered as
            ``flat_param_<name>``. Default: ``"0", "1", ...``.
        optimize_backward_concat (bool): accumulate gradients without the per-microbatch concatenation of the
            flat gradient. Only has an effect under :class:`FullyShardedDataParallel`'s ``no_sync()``; a bare
            wrapper just stores it. Default: ``False``.

    Raises:
        ValueError: ``param_list`` holds something that is not a parameter of ``module``, a parameter in two
            groups, an already flattened parameter, or a group mixing dtypes, devices or ``requires_grad``;
            or ``flat_param_names`` does not give one unique name per group.
        TypeError: ``module`` is not an ``nn.Module`` or ``optimize_backward_concat`` is not a bool.
    """

    def __init__(
        self,
        module: nn.Module,
        param_list: Optional[Sequence[Any]] = None,
        flat_param_names: Optional[Sequence[str]] = None,
        optimize_backward_concat: bool = False,
    ):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FlattenParamsWrapper wraps an nn.Module, got {type(module).__name__}")
        if not isinstance(optimize_backward_concat, bool):
            raise TypeError(f"optimize_backward_concat must be a bool, got {optimize_backward_concat!r}")
        refuse_flat_key_names(module)
        self._fpw_module = module
        self.is_flattened = False
        self.optimize_backward_concat = optimize_backward_concat
        # state_dict() returns the original (unflattened) keys unless this is False (see flat_state_dict()).
        self._auto_unflatten_state_dict = True
        # When set (by FullyShardedDataParallel), replaces the default view construction of _views_for_forward.
        self._view_builder: Optional[ViewBuilder] = None

        groups = normalize_param_groups(module, param_list)
        layouts = locate_groups(self, groups)
        self.flat_param_names: List[str] = check_flat_param_names(flat_param_names, len(layouts))
        self.flat_params: List[FlatParameter] = []
        for layout in layouts:
            params = layout.params()
            flat = FlatParameter(params, requires_grad=params[0].requires_grad)
            flat._param_infos = layout.param_infos
            flat._shared_param_infos = layout.shared_param_infos
            self.flat_params.append(flat)
        # Distinct parameters taken over (a tied weight counts once); the optimizer utilities read this.
        self.num_params_managed = sum(len(layout.param_infos) for layout in layouts)

        self._flatten_params(self.flat_params)
        # The views' autograd graph holds the flat parameters, which hold the modules, from C++: the cycle collector
        # cannot free them, so the views are detached when the wrapper goes (see _flatten/view_release.py).
        release_views_on_collection(self)

        register_state_dict_hooks(self, post_state_dict_hook, pre_load_state_dict_hook, post_load_state_dict_hook)

    # ------------------------------------------------------------------------------------------------ properties

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fpw_module

    @property
    def flat_param(self) -> FlatParameter:
        """The flat parameter, for the common case of exactly one group.

        Raises:
            RuntimeError: the wrapper has zero or several flat parameters (use ``flat_params`` then).
        """
        if len(self.flat_params) != 1:
            raise RuntimeError(
                f"flat_param needs exactly one flat parameter but this wrapper has {len(self.flat_params)} "
                f"({self.flat_param_names}); use .flat_params instead"
            )
        return self.flat_params[0]

    @property
    def _param_infos(self) -> List[ParamInfo]:
        return list(chain.from_iterable(p._param_infos for p in self.flat_params))

    @property
    def _shared_param_infos(self) -> List[SharedParamInfo]:
        return list(chain.from_iterable(p._shared_param_infos for p in self.flat_params))

    # ---------------------------------------------------------------------------------------- flatten / unflatten

    def _flatten_params(self, flat_params: List[FlatParameter]) -> None:
        """Register ``flat_params`` on the wrapper, drop the per-parameter attributes, and install views."""
        if self.is_flattened:
            raise RuntimeError("FlattenParamsWrapper is already flattened")
        self.flat_params = flat_params
        if not hasattr(self, "_orig_param_order"):
            # Remember each module's parameter order so unflattening restores it (state_dict key order).
            self._orig_param_order: Dict[str, List[str]] = {}
            for mname, m, _ in self._param_infos:
                self._orig_param_order.setdefault(mname, list(m._parameters.keys()))
            for mname, _, m, _, _, _ in self._shared_param_infos:
                self._orig_param_order.setdefault(mname, list(m._parameters.keys()))
        for name, flat in zip(self.flat_param_names, flat_params):
            self.register_parameter(name, flat)
        for _, m, n in self._param_infos:
            drop_attr(m, n)
        for _, _, m, n, _, _ in self._shared_param_infos:
            drop_attr(m, n)
        self.is_flattened = True
        self._unflatten_params_as_views()

    def _unflatten_params(
        self, external_data: Optional[List[Tensor]] = None
    ) -> Tuple[List[GivenParam], List[TiedName]]:
        """Give the wrapped module real ``nn.Parameter`` objects again, aliasing the flat data (or ``external_data``)
        and remove the flat parameters from the wrapper.

        Returns:
            What each first owner and each further (tied) name was given (see ``_flatten/unflatten_context.py``).
        """
        if not self.is_flattened:
            raise RuntimeError("FlattenParamsWrapper is not flattened")
        with torch.no_grad():
            views = list(self.get_param_views(external_data))
        groups = chain.from_iterable([(i, flat)] * len(flat._param_infos) for i, flat in enumerate(self.flat_params))
        given: List[GivenParam] = []
        first_index: Dict[Tuple[int, str], int] = {}
        for (mname, m, n), view, (group, flat) in zip(self._param_infos, views, groups):
            drop_attr(m, n)
            param = nn.Parameter(view, requires_grad=flat.requires_grad)
            m.register_parameter(n, param)
            first_index[(id(m), n)] = len(given)
            given.append(GivenParam(user_param_name(mname, n), m, n, param, view, group))
        tied: List[TiedName] = []
        for mname, _, m, n, shared_m, shared_n in self._shared_param_infos:
            drop_attr(m, n)
            m.register_parameter(n, getattr(shared_m, shared_n))
            first = first_index.get((id(shared_m), shared_n))
            if first is not None:  # always, for the layouts this wrapper builds
                tied.append(TiedName(user_param_name(mname, n), m, n, first))
        self._restore_param_order()
        drop_attr(self._fpw_module, "_unflattened_param_views")
        for name in self.flat_param_names:
            delattr(self, name)
        self.is_flattened = False
        return given, tied

    def _restore_param_order(self) -> None:
        """Put re-registered parameters back in their original order in each module (upstream did not)."""
        order = getattr(self, "_orig_param_order", {})
        modules = {mname: m for mname, m, _ in self._param_infos}
        modules.update({mname: m for mname, _, m, _, _, _ in self._shared_param_infos})
        for mname, names in order.items():
            m = modules.get(mname)
            if m is None:
                continue
            params = m._parameters
            ordered = {k: params[k] for k in names if k in params}
            ordered.update({k: v for k, v in params.items() if k not in ordered})
            params.clear()
            params.update(ordered)

    def _views_for_forward(self, flat_param: FlatParameter) -> List[Tensor]:
        """The tensors the wrapped module will use as its parameters, one per ``flat_param._param_infos`` entry.

        This is the single place where forward views are made, so the gradient path can be changed here (or by
        setting ``self._view_builder``, which replaces the default when not ``None``).

        Default (:func:`~fairscale.nn.misc._flatten.forward_views.forward_views`): the views
        ``flat_param.split(numels)[i].view(shape)``, detached, as outputs of one autograd function computed from the
        FlatParameter object itself (not from ``.data``; inside FSDP ``.data`` holds the gathered full parameter at
        this point). Autograd therefore records, for all views of one flat parameter::

            FlatParamViewsBackward -> AccumulateGrad(flat_param)

        ``FlatParamViewsBackward`` waits for the gradients of all views of this flat parameter and concatenates
        them (zeros for views that got none) into one flat gradient, which ``AccumulateGrad`` writes or adds into
        ``flat_param.grad``; hooks on that ``AccumulateGrad`` node therefore run after the concatenation. This is
        upstream's ``ViewBackward0 -> SplitWithSizesBackward0`` path with the same arithmetic, except that a module
        may change a view in place (``nn.Embedding(max_norm=...)`` does), which split views do not allow.
        """
        if self._view_builder is not None:
            views = list(self._view_builder(flat_param))
        else:
            views = forward_views(flat_param)
        if len(views) != len(flat_param._param_infos):
            raise RuntimeError(
                f"the view builder returned {len(views)} views for a flat parameter of "
                f"{len(flat_param._param_infos)} parameters"
            )
        return views

    def _unflatten_params_as_views(self) -> None:
        """Point every managed attribute at a fresh view (plain tensor) of its flat param; tied names share one.

        All views are listed, in flattening order, in ``module._unflattened_param_views`` (read by checkpoint_wrapper).
        """
        if not self.is_flattened:
            raise RuntimeError("views can only be made while the parameters are flattened")
        refuse_foreign_values(self, self._fpw_module.__dict__.get("_unflattened_param_views"))
        all_views: List[Tensor] = []
        for flat in self.flat_params:
            views = self._views_for_forward(flat)
            for (_, m, n), view in zip(flat._param_infos, views):
                _set_plain_tensor(m, n, view)
            for _, _, m, n, shared_m, shared_n in flat._shared_param_infos:
                _set_plain_tensor(m, n, getattr(shared_m, shared_n))
            all_views.extend(views)
        # setattr: a plain attribute on the user's module (nn.Module's typed __setattr__ does not know it).
        setattr(self._fpw_module, "_unflattened_param_views", all_views)

    @contextlib.contextmanager
    def unflatten_params(self, flat_params: Optional[List[Tensor]] = None) -> Generator[None, None, None]:
        """Context manager: the wrapped module has its original ``nn.Parameter`` attributes inside.

        The parameters alias the flat parameters' storage (or ``flat_params``), so in-place changes made inside
        are kept; a parameter rebound inside (``m.weight.data = t``, ``m.weight = nn.Parameter(t)``) is copied back
        when ``t`` has its shape. On exit (also on an exception) the original flat parameters are restored and the
        module gets views again: the views of the last forward that recorded a graph, when there was one, so that a
        checkpointed region recomputed by its pending backward still sends its gradients to the flat parameters
        (also when the context ran under ``no_grad``, as ``state_dict()`` does). A forward with autograd inside is
        refused (its gradients would be lost). Does nothing when the wrapper is already unflattened.

        Without ``flat_params``, also taken back on exit: a rebind of a tied weight's further name, a
        ``requires_grad_()`` that covers every parameter of a flat parameter, and ``.to()`` / ``.double()`` of the
        wrapper (the flat parameters are converted with it). A copy or pickle made inside is a flattened wrapper
        with the values the exit gives this one.

        Args:
            flat_params (Optional[List[Tensor]]): one tensor per flat parameter, each with the flat parameter's
                number of elements, to make the parameters from instead (e.g. gathered full parameters).

        Raises:
            ValueError: ``flat_params`` is given while the wrapper is not flattened, or has the wrong length or
                sizes; or, on exit, a parameter was replaced by a value of another shape (or ``None``), two names
                of one tied parameter by different tensors, or ``requires_grad`` changed for part of a flat
                parameter: nothing of that kind is written back then.
        """
        if flat_params is not None and not self.is_flattened:
            raise ValueError("unflatten_params(flat_params) needs a flattened wrapper; this one is unflattened")
        if not self.is_flattened:
            yield
            return
        standalone = flat_params is None
        last = self._fpw_module.__dict__.get("_unflattened_param_views")
        # Any view with a graph (see _forward_without_grad). FSDP's summon, passing flat_params, keeps them itself.
        snapshot = self._snapshot_views() if standalone and last and any(v.grad_fn is not None for v in last) else None
        orig_flat_params = self.flat_params
        given, tied = self._unflatten_params(flat_params)
        ctx = OpenContext(orig_flat_params, list(self.flat_param_names), given, tied, standalone, snapshot)
        self.__dict__["_unflattened_by_context"] = True
        try:
            with opened(self, ctx):
                yield
        finally:
            self.__dict__["_unflattened_by_context"] = False
            try:
                problems, requires_grad_changed = take_back(ctx)
            finally:  # flattened again whatever happens (a rebind to a tensor copy_ cannot cast, say)
                self._flatten_params(orig_flat_params)
            if ctx.snapshot is not None and not requires_grad_changed:
                self._restore_views(ctx.snapshot)
        if problems:
            raise UnwritableRebind(
                "unflatten_params: parameters were changed inside the context in ways that cannot be written back "
                f"into the flat parameters ({'; '.join(problems)}); none of those changes was written back. Edit "
                "parameters in place (p.copy_(...)), or replace them by tensors of the same shape."
            )

    def get_param_views(self, external_data_list: Optional[Sequence[Optional[Tensor]]] = None) -> Iterator[Tensor]:
        """Views of the original shapes into every flat parameter (or into ``external_data_list``), in order.

        Raises:
            ValueError: ``external_data_list`` does not have one tensor (or ``None``) per flat parameter, or a
                tensor has the wrong number of elements.
        """
        if external_data_list is None:
            external_data_list = [None for _ in self.flat_params]
        if len(external_data_list) != len(self.flat_params):
            raise ValueError(
                f"expected one external tensor per flat parameter ({len(self.flat_params)}), "
                f"got {len(external_data_list)}"
            )
        return chain.from_iterable(p.get_param_views(d) for p, d in zip(self.flat_params, external_data_list))

    def metadata(self, flat_param_idx: int) -> Any:
        """``(names, shapes, numels)`` of the parameters in flat parameter ``flat_param_idx``."""
        if not 0 <= flat_param_idx < len(self.flat_params):
            raise ValueError(
                f"flat_param_idx {flat_param_idx} is out of range; this wrapper has {len(self.flat_params)} "
                "flat parameters"
            )
        return self.flat_params[flat_param_idx].metadata()

    # ----------------------------------------------------------------------------------------------- forwarding

    def forward(self, *inputs: Any, **kwinputs: Any) -> Any:
        """Refresh the views (so autograd connects them to the flat parameters) and run the wrapped module."""
        if self.is_flattened:
            if not torch.is_grad_enabled():
                return self._forward_without_grad(inputs, kwinputs)
            self._unflatten_params_as_views()
        elif self.__dict__.get("_unflattened_by_context") and torch.is_grad_enabled():
            # The module holds temporary Parameters here: their gradients would never reach the flat parameters.
            raise RuntimeError(
                "FlattenParamsWrapper: forward with autograd inside unflatten_params(): the gradients would go to "
                "temporary parameters and be lost. Run the forward outside the context (or under torch.no_grad())."
            )
        return self.module(*inputs, **kwinputs)

    def _forward_without_grad(self, inputs: Tuple[Any, ...], kwinputs: Dict[str, Any]) -> Any:
        """A forward under ``no_grad`` (an evaluation or logging pass), with fresh views, after which the modules get
        back the views of the last forward that recorded a graph.

        A checkpointed region (``checkpoint_wrapper``) recomputes its forward in the backward from the views its
        modules hold then. Left with this forward's views, which have no path to the flat parameters, an evaluation
        between a training forward and its backward made the region's gradients vanish silently (zero, or ``None``
        for a unit holding only checkpointed layers).
        """
        views = self._fpw_module.__dict__.get("_unflattened_param_views")
        # Any view with a graph: a frozen flat parameter's have none (asking the first alone lost the checkpointed
        # layers' gradients behind a frozen first group, silently).
        kept = self._snapshot_views() if views and any(v.grad_fn is not None for v in views) else None
        self._unflatten_params_as_views()
        try:
            return self.module(*inputs, **kwinputs)
        finally:
            if kept is not None:
                self._restore_views(kept)

    def __getattr__(self, name: str) -> Any:
        """Forward unknown attributes to the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_fpw_module":  # not yet set (construction, unpickling): do not recurse
                raise
            return getattr(self.module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        wrapped = self._modules.get("_fpw_module") if "_modules" in self.__dict__ else None
        if wrapped is not None:
            refuse_shadowing_assignment(self, wrapped, name, value, "FlattenParamsWrapper")
        super().__setattr__(name, value)

    def __getitem__(self, key: Any) -> Any:
        """Forward indexing to the wrapped module (e.g. an ``nn.Sequential``)."""
        return cast(Any, self.module)[key]

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "FlattenParamsWrapper":
        """``.to()``, ``.double()``...: convert (flat parameters by ``_flatten/conversion.py``'s rules, in a context
        too), then give the modules views of the converted flat parameters (old views: stale reads, lost writes)."""
        ctx = open_context(self)
        if ctx is not None:
            with converting(self, ctx, fn):
                cast(Any, super())._apply(fn, recurse)
            return self
        before = [(f.untyped_storage().data_ptr(), f.dtype, f.device) for f in self.flat_params]
        with converted_apart(self._parameters, self.flat_param_names, self.flat_params, fn) as flats:
            cast(Any, super())._apply(fn, recurse)
        self.flat_params = flats
        if before != [(f.untyped_storage().data_ptr(), f.dtype, f.device) for f in self.flat_params]:
            # Only then: views made now have a graph only under grad mode, and a checkpointed region's pending
            # backward needs the last forward's (a .to() of what is already there changes nothing).
            self._rebuild_default_views()
        return self

    def __deepcopy__(self, memo: Dict[int, Any]) -> "FlattenParamsWrapper":
        # The forward views are autograd non-leaves, which refuse deepcopy (and copying them would duplicate the
        # flat storage). Take them out for the copy, put them back, and give the copy its own views.
        state = dict(self.__dict__)
        ctx = open_context(self)
        if ctx is not None and ctx.standalone:  # FSDP's summon: copied as it is (full weights), as before
            state[_CONTEXT_RECORD] = record_of(ctx)  # the copy's record then names the copy's modules
        stash = self._stash_views()
        try:
            new = type(self).__new__(type(self))
            memo[id(self)] = new
            copied = copy.deepcopy(state, memo)
        finally:
            for attrs, name, value in stash:
                attrs[name] = value
        record = copied.pop(_CONTEXT_RECORD, None)
        new.__dict__.update(copied)
        new._reflatten_copy(record)
        release_views_on_collection(new)
        new._rebuild_default_views()
        return new

    def __getstate__(self) -> Dict[str, Any]:
        # nn.Module.__getstate__ is unannotated in torch; the cast states its signature.
        state = cast(Callable[[], Dict[str, Any]], super().__getstate__)()
        ctx = open_context(self)
        if ctx is not None and ctx.standalone:
            state = dict(state, **{_CONTEXT_RECORD: record_of(ctx)})
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # Unpickled views alias a storage that is not the new flat parameter's (FlatParameter is rebuilt by
        # copying its data), so make fresh ones.
        state = dict(state)
        record = state.pop(_CONTEXT_RECORD, None)
        # nn.Module.__setstate__ is unannotated in torch; the cast states its signature.
        cast(Callable[[Dict[str, Any]], None], super().__setstate__)(state)
        self._reflatten_copy(record)
        release_views_on_collection(self)
        self._rebuild_default_views()

    def _reflatten_copy(self, record: Optional[ContextRecord]) -> None:
        """A copy made inside :meth:`unflatten_params` (``record`` set), which has no context to leave: flatten it."""
        if record is None or not self.__dict__.get("_unflattened_by_context"):
            return
        if reflatten_copy(self.flat_params, self.flat_param_names, record):
            self.__dict__["_unflattened_by_context"] = False
            self._flatten_params(self.flat_params)  # FSDP, whose view builder this would call, refuses such copies

    def _rebuild_default_views(self) -> None:
        """Install default views after a copy, where ``_view_builder`` may belong to a half-built owner.

        Skipped when a flat parameter does not hold its full size (a shard inside FSDP): the owner's next forward
        builds the views.
        """
        if not self.is_flattened or any(f.numel() != sum(f._param_numels) for f in self.flat_params):
            return
        builder, self._view_builder = self._view_builder, None
        try:
            self._unflatten_params_as_views()
        finally:
            self._view_builder = builder

    def _snapshot_views(self) -> ViewSnapshot:
        """The tensors the wrapped modules hold under their flattened names (the views the last forward made)."""
        return snapshot_views(self._param_infos, self._shared_param_infos, self._fpw_module)

    def _restore_views(self, snapshot: ViewSnapshot) -> None:
        """Give the modules back the views of :meth:`_snapshot_views`."""
        restore_views(snapshot, self._fpw_module)

    def _stash_views(self) -> List[Tuple[Dict[str, Any], str, Any]]:
        """Remove the view attributes from the wrapped modules; return ``(module.__dict__, name, value)``."""
        if not self.is_flattened:
            return []
        slots = [(m, n) for _, m, n in self._param_infos] + [(m, n) for _, _, m, n, _, _ in self._shared_param_infos]
        return stash_views(slots, self._fpw_module)

    # ------------------------------------------------------------------------------------------------ state dict

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's state dict with its original keys (or the flat form, see :meth:`flat_state_dict`).

        Values alias the flat parameters' storage, as ``nn.Module.state_dict`` values alias parameters.
        """
        if self.is_flattened and self._auto_unflatten_state_dict:
            with self.unflatten_params():
                return super().state_dict(*args, **kwargs)
        return super().state_dict(*args, **kwargs)

    def flat_state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """The flat form: ``flat_param_<name>`` entries plus non-flattened parameters and buffers.

        Raises:
            RuntimeError: called while unflattened (inside :meth:`unflatten_params`).
        """
        if not self.is_flattened:
            # Also an AssertionError, as upstream.
            raise FairscaleRuntimeError(
                "flat_state_dict() needs a flattened wrapper; do not call it inside unflatten_params()"
            )
        auto = self._auto_unflatten_state_dict
        self._auto_unflatten_state_dict = False
        try:
            return cast(Dict[str, Any], self.state_dict(*args, **kwargs))
        finally:
            self._auto_unflatten_state_dict = auto

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load either form; a dict with no ``flat_param*`` key is taken to hold the original names.

        All or nothing: the load is first tried on shape-only tensors (:func:`fairscale.internal.dry_load`), so a
        size mismatch, a value that is not a tensor or (``strict``) a missing or unexpected key raises before any
        value changes (``nn.Module.load_state_dict`` copies the entries that fit first). The module versions of a
        plain module's dict (its ``_metadata``) reach the wrapped modules.

        Raises:
            ValueError: ``assign=True`` (the wrapped parameters must stay inside the flat parameters).
            RuntimeError: the dict does not fit the module (torch's message); nothing was loaded.
        """
        return self._load_state_dict(with_wrapper_level_metadata(state_dict), strict, assign, checked=True)

    def _load_state_dict(self, state_dict: Mapping[str, Any], strict: bool, assign: bool, checked: bool) -> Any:
        """:meth:`load_state_dict`; without ``checked``, no dry run (FSDP restores its shards itself on failure)."""
        if assign:
            raise ValueError(
                "FlattenParamsWrapper.load_state_dict does not support assign=True: parameters must stay views "
                "into the flat parameters; load with assign=False"
            )
        has_flat_keys = any(k == "flat_param" or k.startswith("flat_param_") for k in state_dict)
        unflatten = self.num_params_managed > 0 and self.is_flattened and not has_flat_keys
        context = self.unflatten_params() if unflatten and self._auto_unflatten_state_dict else contextlib.nullcontext()
        with context, errors_named_by_keys():
            if checked:
                dry_run_load(self, lambda: nn.Module.load_state_dict(self, state_dict, strict))
            return super().load_state_dict(state_dict, strict)
