# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Dump the public surface of the installed ``fairscale`` to JSON.

This file only uses the standard library and imports nothing from this repository, so that it can
be run by any interpreter against any installed fairscale, including upstream's in a throwaway
virtual environment::

    cd /tmp && /tmp/upstream-venv/bin/python /path/to/repo/tools/upstream_api/surface.py OUT.json

(run it outside the checkout: the current directory comes first on ``sys.path``, and the checkout's
``fairscale/`` would shadow the installed one). Inside the checkout, ``python -m tools.upstream_api
dump OUT.json`` does the same for this distribution.

What counts as the public surface of a module (every importable, non-private module under
``fairscale``): each name that does not start with an underscore (plus the names listed in
``__all__`` and ``__version__``) and that is either an object defined by fairscale (a class, a
function, an instance of a fairscale class) or a plain constant (``bool``, ``int``, ``float``,
``str``, ...). Modules and objects of other libraries that a module merely imports (``torch``,
``typing.Any``, ``enum.Enum``...) are recorded by name only, under ``other``. For each callable
the dump holds its parameters (name, kind, default); for each class its public members along the
fairscale part of its MRO, and for enums their member names.
"""

import enum
import importlib
import inspect
import io
import json
import pkgutil
import platform
import re
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout
from typing import Any, Dict, List, Optional

PACKAGE = "fairscale"
FORMAT = 1
_CONSTANT_TYPES = (bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset, type(None))
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# A module's repr names its file, which depends on the Python version and install (``<module 'math' from
# '/usr/lib/python3.12/lib-dynload/math.cpython-312-x86_64-linux-gnu.so'>``): the name alone is kept.
_MODULE_FILE = re.compile(r"(<module '[^']*') from '[^']*'>")
_FLAT_LIST = re.compile(r"\[[^\[\]{}]*\]")

Param = List[Any]  # [name, kind] or [name, kind, default repr]


def _is_fairscale(module_name: Optional[str]) -> bool:
    return isinstance(module_name, str) and (module_name == PACKAGE or module_name.startswith(PACKAGE + "."))


def _stable_repr(value: Any) -> str:
    """``repr`` without memory addresses, so two dumps of the same code compare equal."""
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not stop the dump
        text = f"<unrepresentable {type(value).__name__}: {type(exc).__name__}>"
    torch_module = sys.modules.get("torch")
    if isinstance(value, str) and torch_module is not None and value == getattr(torch_module, "__version__", None):
        return "torch.__version__"  # a default such as torch_version(version=torch.__version__) varies by build
    return stable_text(text)


def stable_text(text: str) -> str:
    """A default's repr without what varies between machines of the same code: memory addresses, module files.
    Applied to both sides of a comparison too, so that dumps written before a rule was added still compare."""
    return _MODULE_FILE.sub(r"\1>", _ADDRESS.sub("", text))


def signature_of(obj: Any) -> Optional[List[Param]]:
    """Parameters of ``obj`` as ``[name, kind]`` or ``[name, kind, default repr]``; ``None`` if unknown."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params: List[Param] = []
    for p in sig.parameters.values():
        entry: Param = [p.name, p.kind.name]
        if p.default is not inspect.Parameter.empty:
            entry.append(_stable_repr(p.default))
        params.append(entry)
    return params


def _member_entry(owner: type, name: str, raw: Any) -> Dict[str, Any]:
    if isinstance(raw, property):
        return {"kind": "property"}
    if isinstance(raw, staticmethod):
        return {"kind": "staticmethod", "signature": signature_of(raw.__func__)}
    if isinstance(raw, classmethod):
        return {"kind": "classmethod", "signature": signature_of(getattr(owner, name))}
    if inspect.isfunction(raw):
        return {"kind": "method", "signature": signature_of(raw)}
    if callable(raw):
        return {"kind": "callable", "signature": signature_of(raw)}
    return {"kind": "attribute", "type": type(raw).__name__}


def class_entry(cls: type) -> Dict[str, Any]:
    """A class: its constructor signature, bases, and public fairscale-defined members (enums: member names)."""
    entry: Dict[str, Any] = {"kind": "class", "mro": [f"{k.__module__}.{k.__qualname__}" for k in cls.__mro__[1:]]}
    if issubclass(cls, enum.Enum):
        entry["kind"] = "enum"
        entry["enum_members"] = list(cls.__members__)
        return entry
    entry["signature"] = signature_of(cls)
    members: Dict[str, Any] = {}
    for name in sorted(dir(cls)):
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        # Members inherited from other libraries (nn.Module's ...) are found through "mro" when comparing.
        if not name.startswith("_") and owner is not None and _is_fairscale(owner.__module__):
            members[name] = _member_entry(owner, name, vars(owner)[name])
    entry["members"] = members
    return entry


def object_entry(obj: Any) -> Optional[Dict[str, Any]]:
    """The entry of a public API object, or ``None`` if the object is not part of fairscale's API."""
    if inspect.ismodule(obj):
        return None
    if inspect.isclass(obj):
        return class_entry(obj) if _is_fairscale(obj.__module__) else None
    if callable(obj) and _is_fairscale(getattr(obj, "__module__", None)):
        return {"kind": "function", "signature": signature_of(obj)}
    if isinstance(obj, _CONSTANT_TYPES):
        return {"kind": "value", "type": type(obj).__name__}
    if _is_fairscale(type(obj).__module__):
        return {"kind": "instance", "type": type(obj).__qualname__}
    return None


def module_entry(module: Any) -> Dict[str, Any]:
    listed = getattr(module, "__all__", None)
    candidates = {n for n in vars(module) if not n.startswith("_")} | {"__version__", "__version_tuple__"}
    if isinstance(listed, (list, tuple)):
        candidates |= {n for n in listed if isinstance(n, str)}
    names: Dict[str, Any] = {}
    other: List[str] = []
    for name in sorted(candidates):
        if not hasattr(module, name):
            continue
        entry = object_entry(getattr(module, name))
        if entry is None:
            other.append(name)
        else:
            names[name] = entry
    return {"names": names, "other": other}


def _import_quietly(name: str) -> Any:
    """Import a module, swallowing its prints and warnings (some modules print on import)."""
    with warnings.catch_warnings(), redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def _error_text(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:300]


def walk(package: str = PACKAGE) -> Dict[str, Dict[str, Any]]:
    """Every non-private module under ``package``: its entry, or ``{"error": ...}`` if it does not import."""
    modules: Dict[str, Dict[str, Any]] = {}
    pending = [package]
    while pending:
        name = pending.pop()
        try:
            module = _import_quietly(name)
        except BaseException as exc:  # ImportError, but also SystemExit from modules that exit on import
            if isinstance(exc, KeyboardInterrupt):
                raise
            modules[name] = {"error": _error_text(exc)}
            continue
        modules[name] = module_entry(module)
        for info in pkgutil.iter_modules(getattr(module, "__path__", None) or []):
            if not info.name.startswith("_"):
                pending.append(f"{name}.{info.name}")
    return dict(sorted(modules.items()))


def dump(path: str) -> Dict[str, Any]:
    """Write the surface of the installed fairscale to ``path`` (JSON) and return it."""
    modules = walk()
    top = sys.modules.get(PACKAGE)
    data: Dict[str, Any] = {
        "format": FORMAT,
        "fairscale_version": str(getattr(top, "__version__", "unknown")),
        "torch_version": str(getattr(sys.modules.get("torch"), "__version__", "not imported")),
        "python": platform.python_version(),
        "modules": modules,
    }
    with open(path, "w") as f:
        f.write(to_json(data))
    return data


def to_json(data: Any) -> str:
    """Indented JSON with each innermost list (a parameter, a list of names) on one line: reviewable diffs."""
    text = json.dumps(data, indent=1, sort_keys=True)
    return _FLAT_LIST.sub(lambda m: json.dumps(json.loads(m.group(0))), text) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: surface.py OUT.json", file=sys.stderr)
        return 2
    data = dump(args[0])
    broken = sorted(n for n, m in data["modules"].items() if "error" in m)
    print(f"fairscale {data['fairscale_version']}: {len(data['modules'])} modules written to {args[0]}")
    if broken:
        print(f"{len(broken)} did not import: " + ", ".join(broken))
    return 0


if __name__ == "__main__":
    sys.exit(main())
