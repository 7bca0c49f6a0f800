# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Parameters shared between FSDP instances: which ties FSDP can honour, and which it must refuse.

Each FSDP instance keeps its own shard of every parameter it owns, so a parameter used by two instances is only
honoured in one case: it is owned (sharded, ``flatten_parameters=False``) by a sibling and the user declared it with
:meth:`FullyShardedDataParallel.append_shared_param`. Every other form of sharing would give each instance its own
copy, and the copies would drift apart silently during training. They are detected here, at construction, and
reported at the first forward with a ``ValueError`` (as the undeclared sibling tie always was):

* a parameter that an FSDP instance with ``flatten_parameters=True`` has flattened, still registered in a module
  outside that instance (a sibling, the parent, or a separate root): the original ``nn.Parameter`` object is no
  longer the one that is trained, the flat parameter is;
* a parameter owned by a nested FSDP instance and also registered in a module of its parent outside the nested
  instance: the parent would read the nested instance's shard (a 1-D slice) as if it were the full weight.
"""

from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from torch import nn

from .naming import clean_path, join_path

# Set on the original parameters an FSDP instance flattened: they are dead copies from then on.
_FLATTENED_ATTR = "_fsdp_flattened_away"


# Set on the modules whose parameters an FSDP instance flattened: their weights are views of that instance's flat
# parameter, valid only inside its forward.
_FLATTENED_MODULE_ATTR = "_fsdp_params_flattened_away"


def is_flattened_away(param: object) -> bool:
    """Whether ``param`` is an original parameter that an FSDP instance copied into a flat parameter."""
    return bool(getattr(param, _FLATTENED_ATTR, False))


def mark_flattened(params: Iterable[nn.Parameter], modules: Iterable[nn.Module] = (), sharded: bool = True) -> None:
    """Remember that ``params`` (held by ``modules``) were copied into a flat parameter (their objects no longer
    train, and the modules' weights become views of the flat parameter, freed outside the owner's forward when it
    is ``sharded``; at world size 1 they alias the whole parameter, which stays, so using them elsewhere works)."""
    for p in params:
        setattr(p, _FLATTENED_ATTR, True)
    if sharded:
        for m in modules:
            setattr(m, _FLATTENED_MODULE_ATTR, True)


def _modules_outside_nested(module: nn.Module, fsdp_cls: type) -> List[Tuple[str, nn.Module]]:
    """``(path, module)`` of ``module`` and its descendants, not descending into nested FSDP instances."""
    if isinstance(module, fsdp_cls):
        # FSDP(FSDP(m)): the wrapped instance owns everything it holds (its own flat parameters included).
        return []
    out: List[Tuple[str, nn.Module]] = []
    stack: List[Tuple[str, nn.Module]] = [("", module)]
    seen: Set[int] = set()
    while stack:
        path, m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append((path, m))
        for name, child in m.named_children():
            if not isinstance(child, fsdp_cls):
                stack.append((f"{path}.{name}" if path else name, child))
    return out


def find_unhonourable_ties(module: nn.Module, nested_owned: Set[int], fsdp_cls: type) -> List[str]:
    """Describe every parameter of ``module`` shared with another FSDP instance in a way FSDP cannot honour.

    Args:
        module: the module an FSDP instance is about to wrap.
        nested_owned: ``id()`` of every parameter owned by an FSDP instance nested in ``module``.
        fsdp_cls: the FSDP class (to stop at nested instances).

    Returns:
        One readable line per offending parameter name (empty when there is none).
    """
    problems: List[str] = []
    for path, m in _modules_outside_nested(module, fsdp_cls):
        # Read from the module itself: getattr passes through wrappers' __getattr__ (torch.compile's
        # OptimizedModule, torch's CheckpointWrapper) and FSDP's down to a flattened module inside a nested instance,
        # a false "already wrapped" error.
        if m.__dict__.get(_FLATTENED_MODULE_ATTR, False):
            # FSDP(n) twice, or one module in two sibling instances: its parameters already left it (flattened into
            # the first instance), so nothing here would own them and its forward would read a freed view.
            problems.append(
                f"module {path or '<root>'!r} ({type(m).__name__}) is already wrapped by another "
                "FullyShardedDataParallel instance, which flattened its parameters: wrap each module in one "
                "instance only (nest the instances instead, or share weights with append_shared_param)"
            )
            continue
        for name, p in m._parameters.items():
            if p is None:
                continue
            full = f"{path}.{name}" if path else name
            if getattr(p, _FLATTENED_ATTR, False):
                problems.append(
                    f"{full!r} is a parameter that another FullyShardedDataParallel instance flattened "
                    "(flatten_parameters=True): this instance would train a separate copy"
                )
            elif id(p) in nested_owned:
                problems.append(
                    f"{full!r} is owned by a FullyShardedDataParallel instance nested in this one, but used by a "
                    "module outside it: outside the nested instance's forward it is a 1-D shard"
                )
    return problems


def raise_for_ties(problems: List[str], undeclared: List[str], where: Optional[str] = None) -> None:
    """Raise the ``ValueError`` of the first forward for ties FSDP cannot honour or that were not declared.

    ``where``: the instance's path in the root's tree (``""`` for the root); the names are relative to it.
    """
    lines: List[str] = []
    if where is not None:
        lines.append(f"in the FullyShardedDataParallel instance at {where or '<root>'!r} (names relative to it):")
    if undeclared:
        lines.append(
            f"parameters {undeclared} of this FullyShardedDataParallel instance are owned (sharded) by another "
            "instance outside it (tied weights between siblings). Call append_shared_param(p) on this instance "
            "before its first forward (needs flatten_parameters=False), or wrap the tied modules in one instance."
        )
    if problems:
        lines.append(
            "tied weights FullyShardedDataParallel cannot honour: "
            + "; ".join(problems)
            + ". Wrap every module that uses a shared weight in one FSDP instance (e.g. the common parent), or give "
            "the owner flatten_parameters=False and declare the weight with append_shared_param() on the sibling "
            "that borrows it."
        )
    raise ValueError("\n".join(lines))


def check_borrowed_in_tree(handles_per_unit: List[List[Any]]) -> None:
    """Every parameter declared with ``append_shared_param`` must be owned by an instance of the same tree.

    ``handles_per_unit`` holds the handles of every FSDP instance of the tree.

    A parameter borrowed from a separate root would be gathered by the borrower while its owner's hooks, state and
    reductions belong to another tree; raise instead (at the root's first forward).
    """
    owned = {id(h.param) for handles in handles_per_unit for h in handles if not h.borrowed}
    for handles in handles_per_unit:
        for h in handles:
            if h.borrowed and id(h.param) not in owned:
                raise ValueError(
                    "a parameter declared with append_shared_param() is owned by a FullyShardedDataParallel instance "
                    "outside this root's tree (a separate root): sharing a weight between separate roots is not "
                    "supported. Wrap both models under one root FSDP instance."
                )


def raise_for_unmanaged(owner: nn.Module) -> None:
    """Raise when a parameter of ``owner``'s tree is managed by no FSDP instance.

    The constructor checks it; a parameter added after wrapping (a replaced classifier head, a registered scale)
    was neither sharded nor reduced, so every rank trained its own copy on its own batch, silently. Checked at each
    lazy init of a root (the first forward, and after a move resets it).
    """
    # nn.Module's walk: FSDP's own named_parameters() runs lazy init, which calls this.
    late = [name for name, p in nn.Module.named_parameters(owner) if not hasattr(p, "_is_sharded")]
    if late:
        raise ValueError(
            f"FullyShardedDataParallel: {len(late)} parameter(s) were added to the wrapped module after it was "
            f"wrapped ({', '.join(late[:5])}{', ...' if len(late) > 5 else ''}); no instance shards or reduces "
            "them, so every rank would train its own copy. Add parameters (or replace modules) before wrapping, "
            "or wrap the new module in its own FullyShardedDataParallel instance"
        )


def raise_for_late_ties(units: List[Any], paths: Dict[int, str]) -> None:
    """Raise when a flattened weight's attribute holds another one's value: a tie made after wrapping.

    With ``flatten_parameters=True`` the modules' weights are attributes FSDP points at views of the flat parameter
    at each forward: ``head.weight = emb.weight`` after wrapping (what a ``tie_weights()`` does) was overwritten at
    the next forward and the model trained untied, silently. Checked with :func:`raise_for_unmanaged`; ``paths``
    maps ``id()`` of each module of the tree to its name. Ties declared at construction are not attributes checked.
    """
    first_slot: Dict[int, str] = {}
    late: List[str] = []
    for u in units:
        for h in u.handles:
            for path, m, n in getattr(h.param, "_param_infos", None) or []:
                value = m.__dict__.get(n)
                if value is None:
                    continue
                name = clean_path(join_path(paths.get(id(u.owner), ""), join_path(path, n)))
                first = first_slot.setdefault(id(value), name)
                if first != name:
                    late.append(f"{name} = {first}")
    if late:
        raise ValueError(
            f"FullyShardedDataParallel: weights were tied after wrapping ({', '.join(late[:5])}); with "
            "flatten_parameters=True FSDP sets the modules' weights to views of its flat parameter at each forward, "
            "so the tie would be dropped and the weights trained apart. Tie them before wrapping (FSDP keeps the "
            "ties it sees at construction), e.g. call tie_weights() before FullyShardedDataParallel(model)."
        )


def merge_borrowed_grads(handles_per_unit: List[List[Any]]) -> None:
    """End of a synchronizing backward: give the owner of each borrowed parameter what the borrower reduced.

    The owner's handle and the borrower's handle (``append_shared_param``) wrap the same parameter, and each keeps
    its own reduced shard gradient of the step: the first of the two units whose pre-backward runs parks the
    gradient of the step's earlier backwards, and the end of backward reduces a gradient left in ``p.grad`` through
    the first of the two units it reaches. Each handle then handed its own shard to ``p.grad``, the second
    overwriting the first: with one backward per step only one of them held anything, but a second synchronizing
    backward in a step (or two forwards before their backwards) lost the earlier backwards' gradient, silently. The
    owner now hands over the sum.

    Args:
        handles_per_unit: the handles of every FSDP instance of the tree (after the step's reductions completed).
    """
    owners = {id(h.param): h for handles in handles_per_unit for h in handles if not h.borrowed}
    for handles in handles_per_unit:
        for h in handles:
            owner = owners.get(id(h.param)) if h.borrowed else None
            # An owner that never ran a forward hands nothing over: the borrower then hands its own shard, as before.
            if owner is not None and owner.materialized and h.saved_grad_shard is not None:
                owner.accumulate_reduced(h.saved_grad_shard)
                h.saved_grad_shard = None


def units_sharing_params(units: List[Any]) -> Dict[int, List[Any]]:
    """``id()`` of every parameter declared with ``append_shared_param`` -> the units that wrap it, owner first."""
    sharing: Dict[int, List[Any]] = {}
    for u in units:
        for h in u.handles:
            if h.borrowed:
                sharing.setdefault(id(h.param), [])
    if not sharing:
        return sharing
    for borrowed in (False, True):  # owners first
        for u in units:
            for h in u.handles:
                if h.borrowed == borrowed and id(h.param) in sharing:
                    sharing[id(h.param)].append(u)
    return sharing


def grad_is_a_borrowers_part(unit: Any, param: Any) -> bool:
    """Whether the gradient that reached the owner's shared ``param`` before the owner's backward began is the part of
    a borrower whose backward has begun.

    Only the owner's handle hooks the shared parameter. With one autograd accumulator for it (fp32, no checkpointing)
    its gradient arrives once, after both units' backward began. But a change of the parameter's dtype between the two
    forwards (mixed precision: the full parameter is half, the shard fp32) gives it a second accumulator, and a
    checkpointed borrower accumulates inside its recomputation's own backward: the borrower's part then arrives on its
    own, before the owner's backward began, and the owner's hook raised "no output of this FullyShardedDataParallel's
    forward got a gradient hook". The part now stays in ``p.grad``: the owner's own part adds to it and the owner
    reduces the sum once (or the end of backward reduces it when the owner was not used).
    """
    tree = unit.tree
    if tree is None or not tree.sharing:
        return False
    others = tree.sharing.get(id(param), ())
    return any(u is not unit and u.pre_backward_ran for u in others)
