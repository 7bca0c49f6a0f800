# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What ``FlattenParamsWrapper.unflatten_params()`` hands to the modules, and what it takes back on exit.

Inside the context every flattened name holds a temporary ``nn.Parameter`` aliasing its slice of a flat parameter (or
of a tensor passed as ``flat_params``), so in-place edits reach the flat parameter at once. Anything else done to a
name would be lost when the views come back, so :func:`take_back` takes it back on exit, all or nothing:

* a rebind (``m.weight = nn.Parameter(t)``, ``m.weight.data = t``) is written into the slice when ``t`` has the
  parameter's shape; ``None`` or another shape is refused (:class:`UnwritableRebind`).

In the wrapper's own context (no ``flat_params``; FullyShardedDataParallel's summon passes its gathered parameters and
keeps its own rules, so these stay out of it):

* a rebind of a tied weight's further name (``b.weight`` where ``b.weight is a.weight``) is taken back like the first
  owner's; two names of one tied parameter rebound to different tensors are refused (the flat parameter holds one
  value for both);
* ``requires_grad_()`` on the temporary parameters carries over to a flat parameter whose parameters all agree; a
  change to part of one is refused (a flat parameter has one ``requires_grad``; in FSDP's summon any change is);
* ``.to()`` / ``.double()`` / ``.cuda()`` of the wrapper converts the flat parameters as well (:func:`converting`)
  and points the temporary parameters at them, so the cast survives the exit.

A copy made inside the context (``copy.deepcopy``, pickling) gets the state the exit gives the original:
:func:`record_of` describes the context in the copied state, and :func:`reflatten_copy` writes the copy's parameters
into its own flat parameters.
"""

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from .conversion import convert_flat_params
from .flat_parameter import FlatParameter
from .module_attrs import ViewSnapshot

__all__ = [
    "GivenParam",
    "TiedName",
    "OpenContext",
    "UnwritableRebind",
    "ContextRecord",
    "opened",
    "open_context",
    "take_back",
    "converting",
    "record_of",
    "reflatten_copy",
]


class GivenParam(NamedTuple):
    """A temporary parameter handed to a module (the first owner of a flattened parameter)."""

    name: str  # as the unwrapped module names it (for messages)
    module: nn.Module
    attr: str
    param: nn.Parameter
    view: Tensor  # its slice of the flat parameter (or of the external tensor)
    group: int  # index of its flat parameter


class TiedName(NamedTuple):
    """A further name of a flattened parameter (tied weights): it was given its first owner's temporary parameter."""

    name: str
    module: nn.Module
    attr: str
    first: int  # index of the first owner's entry in the GivenParam list


@dataclass
class OpenContext:
    """One ``unflatten_params()`` context in progress."""

    flats: List[FlatParameter]  # the wrapper's flat parameters (not registered while the context is open)
    flat_names: List[str]
    given: List[GivenParam]
    tied: List[TiedName]
    standalone: bool  # no flat_params were passed (see the module docstring)
    snapshot: Optional[ViewSnapshot]  # the views to give back on exit, or None for fresh ones


class UnwritableRebind(ValueError):
    """A parameter changed inside ``unflatten_params`` in a way that cannot be written back (FSDP's summon then writes
    back nothing either)."""


# Weak: an entry lives as long as its wrapper; copies of a wrapper never inherit one.
_OPEN: "weakref.WeakKeyDictionary[nn.Module, OpenContext]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def opened(wrapper: nn.Module, ctx: OpenContext) -> Iterator[None]:
    """Make ``ctx`` the open context of ``wrapper`` while the body runs."""
    _OPEN[wrapper] = ctx
    try:
        yield
    finally:
        _OPEN.pop(wrapper, None)


def open_context(wrapper: nn.Module) -> Optional[OpenContext]:
    """The context ``wrapper`` is inside, if any."""
    return _OPEN.get(wrapper)


def _current(module: nn.Module, attr: str) -> Any:
    """What ``module.<attr>`` holds now (a parameter set to ``None`` is ``None``)."""
    return module._parameters.get(attr, getattr(module, attr, None))


def _unfit(current: Any, view: Tensor) -> Optional[str]:
    """Why ``current`` cannot be written into ``view``, or ``None``."""
    if isinstance(current, Tensor) and current.shape == view.shape:
        return None
    shape = tuple(current.shape) if isinstance(current, Tensor) else type(current).__name__
    return f"{shape} where {tuple(view.shape)} was expected"


@torch.no_grad()
def take_back(ctx: OpenContext, write: bool = True) -> Tuple[List[str], bool]:
    """Take back what the user did to the names (module docstring); all or nothing.

    Args:
        ctx: the context being left.
        write: ``False`` only checks (before copying a wrapper inside the context).

    Returns:
        What cannot be taken back (then nothing was), and whether a flat parameter's ``requires_grad`` changed.
    """
    problems: List[str] = []
    writes: Dict[int, Tuple[str, Tensor]] = {}  # GivenParam index -> (name it came from, value)
    for i, g in enumerate(ctx.given):
        current = _current(g.module, g.attr)
        if current is g.param and current.data_ptr() == g.view.data_ptr() and current.shape == g.view.shape:
            continue  # untouched, or edited in place (already in the flat parameter)
        why = _unfit(current, g.view)
        if why is not None:
            problems.append(f"{g.name}: {why}")
            continue
        writes[i] = (g.name, current)
    # A further name of a tied parameter, rebound: its value goes to the first owner's view (FSDP's summon, which
    # passes flat_params, writes those views back into the shards).
    for t in ctx.tied:
        first = ctx.given[t.first]
        current = _current(t.module, t.attr)
        if current is first.param or (t.first in writes and current is writes[t.first][1]):
            continue  # still tied to the first owner's parameter (edits through it were taken above)
        why = _unfit(current, first.view)
        if why is not None:
            problems.append(f"{t.name}: {why}")
        elif t.first in writes:
            problems.append(
                f"{writes[t.first][0]} and {t.name}: one tied parameter, rebound to two different tensors (the "
                "flat parameter holds one value for both; rebind both names to the same tensor)"
            )
        else:
            writes[t.first] = (t.name, current)
    new_requires_grad: List[Tuple[FlatParameter, bool]] = []
    if ctx.standalone:
        new_requires_grad = _requires_grad_changes(ctx, problems)
    else:
        _refuse_requires_grad_changes(ctx, problems)
    if write and not problems:
        for i, (_, value) in writes.items():
            ctx.given[i].view.copy_(value.detach())
        for flat, requires_grad in new_requires_grad:
            flat.requires_grad_(requires_grad)
    return problems, bool(new_requires_grad) and not problems


def _refuse_requires_grad_changes(ctx: OpenContext, problems: List[str]) -> None:
    """FullyShardedDataParallel's summon (``flat_params`` given): ``requires_grad`` is fixed at wrapping there.

    A freeze inside the summon (``model.apply(freeze)``) was dropped at the exit, silently, and the parameters kept
    training (found by a fuzz of init patterns, session 42).
    """
    changed = [
        g.name
        for g in ctx.given
        if _current(g.module, g.attr) is g.param and g.param.requires_grad != ctx.flats[g.group].requires_grad
    ]
    if changed:
        problems.append(
            f"requires_grad of {', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''} changed, which "
            "FullyShardedDataParallel cannot honour after wrapping: freeze parameters before wrapping, whole FSDP "
            "instances at a time"
        )


def _requires_grad_changes(ctx: OpenContext, problems: List[str]) -> List[Tuple[FlatParameter, bool]]:
    """The flat parameters whose temporary parameters all changed ``requires_grad``; a partial change is a problem.

    Only the temporary parameters still in place count: a rebound value (``m.weight = nn.Parameter(t)``, which
    requires grad by default) is taken for its value, as the rebind rules say.
    """
    seen: List[Dict[bool, List[str]]] = [{} for _ in ctx.flats]
    for g in ctx.given:
        if _current(g.module, g.attr) is g.param:
            seen[g.group].setdefault(g.param.requires_grad, []).append(g.name)
    changes: List[Tuple[FlatParameter, bool]] = []
    for flat, name, flags in zip(ctx.flats, ctx.flat_names, seen):
        if len(flags) > 1:
            problems.append(
                f"requires_grad of part of flat parameter {name} changed ({', '.join(flags[True])} "
                f"require grad, {', '.join(flags[False])} do not): a flat parameter has one requires_grad; change "
                "it for all of them, or wrap with param_list putting the frozen parameters in a group of their own"
            )
        elif flags and next(iter(flags)) != flat.requires_grad:
            changes.append((flat, next(iter(flags))))
    return changes


@contextlib.contextmanager
def converting(wrapper: nn.Module, ctx: OpenContext, fn: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """Around torch's ``_apply`` of ``wrapper`` inside ``ctx``: the flat parameters are converted with the rest.

    They are converted as outside the context (see ``conversion.py``); afterwards each temporary parameter that was
    converted too is pointed at its slice of the converted flat parameter (the same values: the same conversion of
    the same elements), and the exit takes the others back by value.

    Raises:
        RuntimeError: the context was opened with ``flat_params``: the parameters are views of those tensors,
            which the wrapper does not own; nothing was converted.
    """
    if not ctx.standalone:
        raise RuntimeError(
            "FlattenParamsWrapper: .to()/.double()/.cuda() inside unflatten_params(flat_params=...) is not supported "
            "(the parameters are views of the tensors passed in); convert the wrapper outside the context. Nothing "
            "was converted."
        )
    names = [(g.module, g.attr, g.param) for g in ctx.given]
    names += [(t.module, t.attr, ctx.given[t.first].param) for t in ctx.tied]
    held = [_current(m, attr) is param for m, attr, param in names]
    before = [(f.untyped_storage().data_ptr(), f.dtype, f.device) for f in ctx.flats]
    yield
    # Under torch's overwrite setting the conversion registered new objects, one per name (a tied parameter's names
    # came apart, which the exit refused as two rebinds): the temporary parameters go back, pointed at the converted
    # flat parameters below, as the set_data conversion leaves them.
    restored = False
    for (m, attr, param), was_held in zip(names, held):
        if was_held and _current(m, attr) is not param:
            m._parameters[attr] = param
            restored = True
    # In place: ctx.flats is the list the exit flattens with.
    ctx.flats[:] = convert_flat_params(ctx.flats, fn)
    if restored or before != [(f.untyped_storage().data_ptr(), f.dtype, f.device) for f in ctx.flats]:
        _point_at_flats(ctx)


@torch.no_grad()
def _point_at_flats(ctx: OpenContext) -> None:
    views = [view for flat in ctx.flats for view in flat.get_param_views()]
    for i, (g, view) in enumerate(zip(ctx.given, views)):
        # The whole wrapper was converted: the view holds this parameter's elements, converted (also when the
        # parameter itself was left unconverted: the overwrite setting's new object was taken back).
        if g.param.data_ptr() != view.data_ptr() and _current(g.module, g.attr) is g.param:
            g.param.data = view
        ctx.given[i] = g._replace(view=view)
    ctx.snapshot = None  # the last forward's views alias the old storage


class ContextRecord(NamedTuple):
    """An open context as a copy of the wrapper needs it: which temporary parameter each name was given.

    It travels in the copied (or pickled) state, so the copy's record names the copy's modules and parameters.
    """

    given: List[Tuple[str, nn.Module, str, nn.Parameter, int]]
    tied: List[TiedName]


def record_of(ctx: OpenContext) -> ContextRecord:
    """What :func:`reflatten_copy` needs of ``ctx``, after checking that the exit could take everything back.

    Raises:
        RuntimeError: the context was opened with ``flat_params`` (a copy could not return to the wrapper's values).
        ValueError: a name holds what the exit could not take back.
    """
    if not ctx.standalone:
        raise RuntimeError(
            "FlattenParamsWrapper: cannot copy or pickle a wrapper inside unflatten_params(flat_params=...): its "
            "parameters are views of the tensors passed in; copy it outside the context"
        )
    problems, _ = take_back(ctx, write=False)
    if problems:
        raise UnwritableRebind(
            "FlattenParamsWrapper: cannot copy or pickle a wrapper inside unflatten_params() while parameters hold "
            f"what cannot be written back into its flat parameters ({'; '.join(problems)}); undo that first"
        )
    return ContextRecord([(g.name, g.module, g.attr, g.param, g.group) for g in ctx.given], list(ctx.tied))


def reflatten_copy(flats: List[FlatParameter], flat_names: List[str], record: ContextRecord) -> bool:
    """Write what a copy's modules hold (its copies of the temporary parameters, or rebinds) into its flat
    parameters, as the exit does for the original; the caller then flattens the copy.

    Returns:
        ``False`` for a shallow copy (``copy.copy``), which shares the original's modules: the original's exit
        flattens them, and nothing is done here.

    Raises:
        ValueError: the copied state holds what cannot be written back (a pickle edited after it was written).
    """
    if record.given and any(c.given and c.given[0].param is record.given[0][3] for c in list(_OPEN.values())):
        return False
    with torch.no_grad():
        views = [view for flat in flats for view in flat.get_param_views()]
    given = [GivenParam(n, m, a, p, view, group) for (n, m, a, p, group), view in zip(record.given, views)]
    ctx = OpenContext(flats, flat_names, given, record.tied, standalone=True, snapshot=None)
    problems, _ = take_back(ctx)
    if problems:
        raise UnwritableRebind(f"FlattenParamsWrapper: cannot rebuild the copy: {'; '.join(problems)}")
    return True
