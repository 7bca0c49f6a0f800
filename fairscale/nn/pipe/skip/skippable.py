# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The user interface of skip connections: ``@skippable``, ``stash``, ``pop`` and ``verify_skippables``."""

from itertools import chain
from typing import (
    Any,
    Callable,
    ClassVar,
    Dict,
    FrozenSet,
    Generator,
    Iterable,
    List,
    Optional,
    Set,
    Tuple,
    Type,
    TypeVar,
    Union,
    cast,
)

from torch import Tensor, nn

from ..microbatch import Batch
from .namespace import Namespace
from .tracker import current_skip_tracker

__all__ = ["skippable", "stash", "pop", "verify_skippables"]

Tensors = Tuple[Tensor, ...]
TensorOrTensors = Union[Tensor, Tensors]

StashPop = Union["stash", "pop"]
StashPopGenerator = Generator[StashPop, Optional[Tensor], TensorOrTensors]
SkippableModule = nn.Module

T = TypeVar("T", bound="Skippable")


class Skippable(nn.Module):
    """The base of every ``@skippable`` class: wraps the user's module (as child ``module``) and drives it.

    Do not instantiate directly; use :func:`skippable`.
    """

    module_cls: ClassVar[Type[SkippableModule]]
    stashable_names: ClassVar[FrozenSet[str]]
    poppable_names: ClassVar[FrozenSet[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: Dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickling (torch.save of a model, spawn) finds a class by module and qualified name: the decorated class
        # carries the user's, and the wrapped module is rebuilt from its state through ``module_cls``, whose name
        # (now the decorated class's) cannot be looked up. Before, saving any model holding a skippable layer
        # failed ("Can't pickle <class ...Save>: attribute lookup Save on fairscale.nn.pipe.skip.skippable failed").
        state = dict(self.__dict__)
        modules = dict(state["_modules"])
        inner = modules.pop("module")
        state["_modules"] = modules
        return (_restore_skippable, (type(self), state, inner.__getstate__()))

    def namespaced(self, name: str) -> Tuple[Namespace, str]:
        """``(namespace of name or None, name)``."""
        ns = self.namespaces.get(name)
        return (cast(Namespace, ns), name)

    def stashable(self) -> Iterable[Tuple[Namespace, str]]:
        """The namespaced names this layer may stash."""
        for name in self.stashable_names:
            yield self.namespaced(name)

    def poppable(self) -> Iterable[Tuple[Namespace, str]]:
        """The namespaced names this layer may pop."""
        for name in self.poppable_names:
            yield self.namespaced(name)

    def isolate(self: T, ns: Namespace, *, only: Optional[Iterable[str]] = None) -> T:
        """Put the skip names of this layer (all, or only those in ``only``) into namespace ``ns``.

        Returns the layer itself, so it can be used inline::

            ns = Namespace()
            model = nn.Sequential(Stash().isolate(ns), Pop().isolate(ns))
        """
        names: Iterable[str] = only if only is not None else chain(self.stashable_names, self.poppable_names)
        for name in names:
            self.namespaces[name] = ns
        return self

    def dispatch(
        self,
        input: TensorOrTensors,
        handle_stash: Callable[[str, Optional[Tensor]], None],
        handle_pop: Callable[[str], Optional[Tensor]],
    ) -> TensorOrTensors:
        """Run the wrapped module, serving its ``yield stash(...)`` / ``yield pop(...)`` commands."""
        generator = self.module(input)
        if not isinstance(generator, Generator):
            return cast(TensorOrTensors, generator)
        try:
            op = next(generator)
            while True:
                if isinstance(op, stash):
                    handle_stash(op.name, op.tensor)
                    op = next(generator)
                elif isinstance(op, pop):
                    op = generator.send(handle_pop(op.name))
                else:
                    raise TypeError("%r is not a command from @skippable" % op)
        except StopIteration as stop:
            if not stop.args:
                raise IndexError(
                    f"the forward of @skippable {type(self.module).__name__} returned no output; "
                    "a generator forward must end with `return output`"
                ) from None
            return cast(TensorOrTensors, stop.args[0])

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        skip_tracker = current_skip_tracker()
        stashed: Dict[str, Optional[Tensor]] = {}

        # Load every declared skip now: the load ties the input to the stash side in autograd.
        batch = Batch(input, skip_tracker.index)
        poppable: Dict[str, Optional[Tensor]] = {}
        for ns, name in self.poppable():
            try:
                poppable[name] = skip_tracker.load(batch, ns, name)
            except KeyError:
                raise RuntimeError(f"'{name}' has not been stashed") from None
        input = batch.value

        def handle_stash(name: str, tensor: Optional[Tensor]) -> None:
            if name not in self.stashable_names:
                raise RuntimeError(f"'{name}' has not been declared as stashable")
            stashed[name] = tensor

        def handle_pop(name: str) -> Optional[Tensor]:
            if name not in self.poppable_names:
                raise RuntimeError(f"'{name}' has not been declared as poppable")
            return poppable.pop(name)

        output = self.dispatch(input, handle_stash, handle_pop)

        not_stashed = self.stashable_names - stashed.keys()
        if not_stashed:
            raise RuntimeError(f"{_quoted(not_stashed)} must be stashed but have not")
        if poppable:
            raise RuntimeError(f"{_quoted(poppable.keys())} must be popped but have not")

        batch = Batch(output, skip_tracker.index)
        for ns, name in self.stashable():
            skip_tracker.save(batch, ns, name, stashed[name])
        return batch.value


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(f"'{name}'" for name in names)


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[Type[SkippableModule]], Type[Skippable]]:
    """The class decorator that makes a module able to stash and pop skip tensors.

    The decorated class keeps its name; instances wrap an instance of the original class. Its ``forward`` may be a
    generator that yields :class:`stash` and :class:`pop` commands and returns the output::

        @skippable(stash=["1to3"])
        class Layer1(nn.Module):
            def forward(self, input):
                yield stash("1to3", input)
                return f1(input)

        @skippable(pop=["1to3"])
        class Layer3(nn.Module):
            def forward(self, input):
                skip_1to3 = yield pop("1to3")
                return f3(input) + skip_1to3

    Args:
        stash (Iterable[str]): the names the layer stashes.
        pop (Iterable[str]): the names the layer pops.
    """
    stashable_names = frozenset(stash)
    poppable_names = frozenset(pop)

    def extend_skippable(module_cls: Type[SkippableModule]) -> Type[Skippable]:
        # The user's module and name, for pickling (see Skippable.__reduce_ex__).
        attrs = {
            "module_cls": module_cls,
            "stashable_names": stashable_names,
            "poppable_names": poppable_names,
            "__module__": module_cls.__module__,
            "__qualname__": module_cls.__qualname__,
            "__doc__": module_cls.__doc__,
        }
        return cast(Type[Skippable], type(module_cls.__name__, (Skippable,), attrs))

    return extend_skippable


def _restore_skippable(cls: Type[Skippable], state: Dict[str, Any], inner_state: Any) -> Skippable:
    """Unpickle a skippable layer (see :meth:`Skippable.__reduce_ex__`)."""
    layer = cls.__new__(cls)
    inner = cls.module_cls.__new__(cls.module_cls)
    inner.__setstate__(inner_state)
    state["_modules"] = {**state["_modules"], "module": inner}
    layer.__dict__.update(state)
    return layer


class stash:
    """The command to stash a skip tensor: ``yield stash(name, tensor)`` (``tensor`` may be ``None``)."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Optional[Tensor]) -> None:
        self.name = name
        self.tensor = tensor


class pop:
    """The command to pop a skip tensor: ``tensor = yield pop(name)``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def verify_skippables(module: nn.Sequential) -> None:
    """Check that every stash in ``module`` (its direct children) has exactly one matching pop.

    Raises:
        TypeError: listing every mismatch, e.g. a name stashed twice without namespace isolation, a pop of a name
            never stashed, or a stash never popped.
    """
    stashed: Set[Tuple[Namespace, str]] = set()
    popped: Set[Tuple[Namespace, str]] = set()
    msgs: List[str] = []

    for layer_name, layer in module.named_children():
        if not isinstance(layer, Skippable):
            continue
        for name in sorted(layer.stashable_names & layer.poppable_names):
            msgs.append(f"'{layer_name}' declared '{name}' both as stashable and as poppable")
        for ns, name in layer.stashable():
            if name in layer.poppable_names:
                continue
            if (ns, name) in stashed:
                msgs.append(f"'{layer_name}' redeclared '{name}' as stashable but not isolated by namespace")
                continue
            stashed.add((ns, name))
        for ns, name in layer.poppable():
            if name in layer.stashable_names:
                continue
            if (ns, name) in popped:
                msgs.append(f"'{layer_name}' redeclared '{name}' as poppable but not isolated by namespace")
                continue
            if (ns, name) not in stashed:
                msgs.append(f"'{layer_name}' declared '{name}' as poppable but it was not stashed")
                continue
            popped.add((ns, name))

    for _, name in stashed - popped:
        msgs.append(f"no module declared '{name}' as poppable but stashed")

    if msgs:
        raise TypeError("one or more pairs of stash and pop do not match:\n\n" + "\n".join(f"* {m}" for m in msgs))
