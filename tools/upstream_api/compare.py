# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Compare two surface dumps (see :mod:`surface`) and apply the reviewed allow-list.

A *reference* dump (upstream's) is compared with a *candidate* (this checkout, or a newer upstream).
The candidate is compatible when every module, name, enum member and class member of the reference
exists in it with the same kind, and every signature is compatible: the reference's parameters come
first, in the same order, with the same names, kinds and defaults; the candidate may add parameters
only after them, and only with defaults (or ``*args``/``**kwargs``).

Each difference has a key ``"<kind> <target>"`` (for example ``signature
fairscale.nn.checkpoint.checkpoint_activations:checkpoint_wrapper``). The allow-list file lists the
known, reviewed differences, one per line::

    <kind or *> <target pattern> -- <reason>

A pattern is an ``fnmatch`` pattern on the target; a pattern without ``:`` also matches every name
inside the modules it matches, and a pattern naming a class also matches its members. Lines starting with ``#`` are comments; ``## title`` starts a section.
"""

import fnmatch
import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .surface import stable_text

HERE = os.path.dirname(os.path.abspath(__file__))
SNAPSHOT = os.path.join(HERE, "upstream-0.4.13.json")
ALLOWLIST = os.path.join(HERE, "allowlist.txt")

KINDS = (
    "missing-module",  # the module does not exist (or is private) in the candidate
    "module-error",  # the module exists but does not import
    "missing-name",  # a public name of the module is absent
    "kind",  # the name is a different kind of object (class vs function, other value type ...)
    "signature",  # incompatible parameters
    "enum-member",  # an enum lacks a member
    "missing-member",  # a class lacks a public method/property
    "member-kind",  # e.g. a method became a property
    "member-signature",  # a method's parameters are incompatible
)
_COMPATIBLE_KINDS = {
    ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD"),
    ("KEYWORD_ONLY", "POSITIONAL_OR_KEYWORD"),
}
_VARIADIC = ("VAR_POSITIONAL", "VAR_KEYWORD")


@dataclass(frozen=True)
class Difference:
    """One incompatibility of the candidate with the reference."""

    kind: str
    target: str  # "module", "module:name" or "module:Class.member"
    detail: str

    @property
    def key(self) -> str:
        return f"{self.kind} {self.target}"


@dataclass
class AllowEntry:
    """One line of the allow-list."""

    kind: str
    pattern: str
    reason: str
    line: int
    section: str
    used: int = field(default=0)

    def matches(self, diff: Difference) -> bool:
        if self.kind not in ("*", diff.kind):
            return False
        if fnmatch.fnmatchcase(diff.target, self.pattern) or fnmatch.fnmatchcase(diff.target, self.pattern + ".*"):
            return True  # a name's pattern also covers the name's members
        return ":" not in self.pattern and fnmatch.fnmatchcase(diff.target.split(":", 1)[0], self.pattern)

    def __str__(self) -> str:
        return f"line {self.line}: {self.kind} {self.pattern} -- {self.reason}"


# ------------------------------------------------------------------------------------------------ signatures


def format_signature(params: Optional[Sequence[Sequence[str]]]) -> str:
    """``[["a", "POSITIONAL_OR_KEYWORD"], ["b", "KEYWORD_ONLY", "1"]]`` -> ``"(a, *, b=1)"``."""
    if params is None:
        return "(<no signature>)"
    parts: List[str] = []
    star_done = False
    for i, p in enumerate(params):
        name, kind = p[0], p[1]
        text = name + (f"={p[2]}" if len(p) > 2 else "")
        if kind == "VAR_POSITIONAL":
            text, star_done = "*" + name, True
        elif kind == "VAR_KEYWORD":
            text = "**" + name
        elif kind == "KEYWORD_ONLY" and not star_done:
            parts.append("*")
            star_done = True
        parts.append(text)
        if kind == "POSITIONAL_ONLY" and (i + 1 == len(params) or params[i + 1][1] != "POSITIONAL_ONLY"):
            parts.append("/")
    return "(" + ", ".join(parts) + ")"


def signature_problem(reference: Optional[List[List[str]]], candidate: Optional[List[List[str]]]) -> Optional[str]:
    """Why ``candidate`` cannot replace ``reference`` for every call that works upstream; ``None`` if it can."""
    if reference is None:
        return None
    if candidate is None:
        return "no inspectable signature here"
    for i, ref in enumerate(reference):
        if i >= len(candidate):
            return f"parameter {ref[0]!r} (position {i}) is missing"
        cand = candidate[i]
        if cand[0] != ref[0]:
            return f"position {i} is {cand[0]!r}, upstream {ref[0]!r}"
        if cand[1] != ref[1] and (ref[1], cand[1]) not in _COMPATIBLE_KINDS:
            return f"{ref[0]!r} is {cand[1]}, upstream {ref[1]}"
        ref_default = stable_text(ref[2]) if len(ref) > 2 else None
        cand_default = stable_text(cand[2]) if len(cand) > 2 else None
        if ref_default != cand_default:
            return f"{ref[0]!r} defaults to {cand_default or '<required>'}, upstream {ref_default or '<required>'}"
    for extra in candidate[len(reference) :]:
        if len(extra) < 3 and extra[1] not in _VARIADIC:
            return f"added parameter {extra[0]!r} has no default (calls written for upstream would fail)"
    return None


# ------------------------------------------------------------------------------------------------ comparison


def _entry_text(entry: Dict[str, Any]) -> str:
    kind = entry.get("kind", "?")
    if "signature" in entry:
        return f"{kind} {format_signature(entry['signature'])}"
    if "type" in entry:
        return f"{kind} of type {entry['type']}"
    return kind


def _inherited(candidate: Dict[str, Any], member: str) -> bool:
    """Whether a class of the candidate gets ``member`` from a non-fairscale base (nn.Module ...)."""
    for path in candidate.get("mro", []):
        if path.startswith("fairscale.") or path == "builtins.object":
            continue
        module_name, _, qualname = path.rpartition(".")
        try:
            base = getattr(importlib.import_module(module_name), qualname)
        except (ImportError, AttributeError):
            continue
        if hasattr(base, member):
            return True
    return False


def _compare_members(target: str, ref: Dict[str, Any], cand: Dict[str, Any]) -> Iterable[Difference]:
    if ref.get("kind") == "enum":
        missing = [m for m in ref.get("enum_members", []) if m not in cand.get("enum_members", [])]
        if missing:
            yield Difference("enum-member", target, f"members {missing} are missing")
        return
    cand_members = cand.get("members", {})
    for name, ref_member in sorted(ref.get("members", {}).items()):
        where = f"{target}.{name}"
        cand_member = cand_members.get(name)
        if cand_member is None:
            if not _inherited(cand, name):
                yield Difference("missing-member", where, f"upstream: {_entry_text(ref_member)}")
            continue
        ref_kind, cand_kind = ref_member["kind"], cand_member["kind"]
        if ref_kind != cand_kind and {ref_kind, cand_kind} - {"method", "callable"}:
            yield Difference("member-kind", where, f"upstream {ref_kind}, here {cand_kind}")
            continue
        problem = signature_problem(ref_member.get("signature"), cand_member.get("signature"))
        if problem:
            yield Difference("member-signature", where, _signature_detail(ref_member, cand_member, problem))


def _signature_detail(ref: Dict[str, Any], cand: Dict[str, Any], problem: str) -> str:
    return (
        f"{problem}\n      upstream {format_signature(ref.get('signature'))}"
        f"\n      here     {format_signature(cand.get('signature'))}"
    )


def _compare_name(target: str, ref: Dict[str, Any], cand: Dict[str, Any]) -> Iterable[Difference]:
    ref_kind, cand_kind = ref.get("kind"), cand.get("kind")
    if ref_kind != cand_kind or ref.get("type") != cand.get("type"):
        yield Difference("kind", target, f"upstream {_entry_text(ref)}, here {_entry_text(cand)}")
        return
    problem = signature_problem(ref.get("signature"), cand.get("signature"))
    if problem:
        yield Difference("signature", target, _signature_detail(ref, cand, problem))
    if ref_kind in ("class", "enum"):
        yield from _compare_members(target, ref, cand)


def compare(reference: Dict[str, Any], candidate: Dict[str, Any]) -> List[Difference]:
    """Every incompatibility of ``candidate`` with ``reference`` (both dumps), in module order."""
    diffs: List[Difference] = []
    cand_modules = candidate["modules"]
    for module, ref_mod in sorted(reference["modules"].items()):
        if "error" in ref_mod:
            continue  # upstream itself cannot import it here (e.g. a missing optional dependency)
        cand_mod = cand_modules.get(module)
        if cand_mod is None:
            diffs.append(Difference("missing-module", module, f"{len(ref_mod['names'])} public names upstream"))
            continue
        if "error" in cand_mod:
            diffs.append(Difference("module-error", module, cand_mod["error"]))
            continue
        for name, ref_entry in sorted(ref_mod["names"].items()):
            target = f"{module}:{name}"
            cand_entry = cand_mod["names"].get(name)
            if cand_entry is None:
                if name not in cand_mod.get("other", []):
                    diffs.append(Difference("missing-name", target, f"upstream: {_entry_text(ref_entry)}"))
                continue
            diffs.extend(_compare_name(target, ref_entry, cand_entry))
    return diffs


def additions(reference: Dict[str, Any], candidate: Dict[str, Any]) -> List[str]:
    """Modules and public names of ``candidate`` that ``reference`` lacks (what a new upstream release added)."""
    out: List[str] = []
    ref_modules = reference["modules"]
    for module, cand_mod in sorted(candidate["modules"].items()):
        ref_mod = ref_modules.get(module)
        if ref_mod is None:
            out.append(f"module {module}")
        elif "names" in cand_mod and "names" in ref_mod:
            out.extend(f"name {module}:{n}" for n in sorted(cand_mod["names"]) if n not in ref_mod["names"])
    return out


# ------------------------------------------------------------------------------------------------ allow-list


def read_allowlist(path: str = ALLOWLIST) -> List[AllowEntry]:
    """Parse the allow-list; a malformed line (no reason, unknown kind) raises ``ValueError``."""
    entries: List[AllowEntry] = []
    section = ""
    with open(path) as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if line.startswith("##"):
                section = line.lstrip("#").strip()
                continue
            if not line or line.startswith("#"):
                continue
            spec, sep, reason = line.partition(" -- ")
            words = spec.split()
            if not sep or not reason.strip() or len(words) != 2:
                raise ValueError(f"{path}:{number}: expected '<kind> <target> -- <reason>', got {line!r}")
            if words[0] != "*" and words[0] not in KINDS:
                raise ValueError(f"{path}:{number}: unknown kind {words[0]!r}; one of {KINDS} or *")
            entries.append(AllowEntry(words[0], words[1], reason.strip(), number, section))
    return entries


def split_allowed(diffs: List[Difference], allow: List[AllowEntry]) -> Tuple[List[Difference], List[Difference]]:
    """``(not allowed, allowed)``; counts the uses of each entry."""
    bad: List[Difference] = []
    ok: List[Difference] = []
    for diff in diffs:
        entry = next((e for e in allow if e.matches(diff)), None)
        if entry is None:
            bad.append(diff)
        else:
            entry.used += 1
            ok.append(diff)
    return bad, ok


#: Allow-list section whose unused entries are listed but do not fail the check (subsystems being ported).
PENDING_SECTION = "not yet ported"


def unused_entries(entries: List[AllowEntry]) -> Tuple[List[AllowEntry], List[AllowEntry]]:
    """``(stale, pending)``: unused entries that fail the check, and unused ones of the "not yet ported" section."""
    unused = [e for e in entries if not e.used]
    pending = [e for e in unused if e.section.startswith(PENDING_SECTION)]
    return [e for e in unused if e not in pending], pending


def report(bad: List[Difference], stale: List[AllowEntry], reference: Dict[str, Any], allowlist: str) -> str:
    """The text a failing check prints: each difference with upstream's and our signature, then stale entries."""
    lines: List[str] = []
    version = reference.get("fairscale_version", "?")
    if bad:
        lines.append(f"{len(bad)} difference(s) from upstream fairscale {version} not in {allowlist}:")
        for diff in bad:
            lines.append(f"  {diff.kind:<16} {diff.target}\n      {diff.detail}")
        lines.append(
            "Fix the API to match upstream, or, for a reviewed and documented difference, add a line "
            "'<kind> <target> -- <reason>' to the allow-list."
        )
    if stale:
        lines.append(f"{len(stale)} allow-list entr(y/ies) match no difference any more; remove them from {allowlist}:")
        lines.extend(f"  {e}" for e in stale)
    return "\n".join(lines)
