"""One grammar for mptrain's list arguments (``fp32_fallback``, ``keep_bf16``): the default list, edits of it, or a
whole list.

- ``"default"`` (or None): the argument's default list;
- a list of edits, ``"+x"`` / ``"-x"``: the default list with ``x`` added / removed, in order;
- a list of plain entries: that list, replacing the default; ``[]``: the empty list.

Refused, each message naming the argument, the value and the fix: any other string, a value that is not a list,
an entry that is not a non-empty string, edits mixed with plain entries (which of the two was meant?), removing an
entry the default list does not hold (the edit would do nothing), and an entry the argument's vocabulary does not
know.  The result is a tuple without repeats, in first-seen order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

EDIT_PREFIXES = ("+", "-")


@dataclass(frozen=True)
class ListGrammar:
    """The list grammar of one argument; :meth:`resolve` turns a value into the checked tuple of entries."""

    arg: str  # the argument's name, as the user writes it: "fp32_fallback"
    default: tuple[str, ...]
    what: str  # what the entries are, plural: "op names"
    example: str  # a valid value, as Python: "['softmax', 'layer_norm']"
    known: Optional[Callable[[str], bool]] = None  # None: any entry is valid
    noun: str = "entry"  # what an unknown entry is called: "unknown op 'x'"
    vocabulary: str = ""  # the valid entries, for an unknown one: "names are torch functional names such as ..."

    def resolve(self, value: Any) -> tuple[str, ...]:
        if value is None or value == "default":
            return self.default
        if isinstance(value, str) or not _is_list(value):
            raise ValueError(f"{self.arg}={value!r} is not valid: expected 'default', a list of {self.what} ('+x' / "
                             f"'-x' edit the default list) or []; e.g. {self.arg}={self.example}")
        entries = list(value)
        for e in entries:
            if not isinstance(e, str) or not e.strip(EDIT_PREFIXES[0] + EDIT_PREFIXES[1]):
                raise ValueError(f"{self.arg}={entries!r}: entry {e!r} is not a name; every entry is a non-empty "
                                 f"string (one of the {self.what}, or '+x' / '-x'), e.g. {self.arg}={self.example}")
        if is_edit_list(entries):
            entries = self._apply_edits(entries)
        elif any(e.startswith(EDIT_PREFIXES) for e in entries):
            raise ValueError(f"{self.arg}={entries!r} mixes edits ('+x', '-x') and plain entries: write either edits "
                             f"of the default list {list(self.default)} or the whole list, "
                             f"e.g. {self.arg}={self.example}")
        for e in entries:
            if self.known is not None and not self.known(e):
                raise ValueError(f"{self.arg}: unknown {self.noun} {e!r} in {self.arg}={list(value)!r}; "
                                 f"{self.vocabulary}")
        return tuple(dict.fromkeys(entries))

    def _apply_edits(self, edits: list[str]) -> list[str]:
        entries = list(self.default)
        for e in edits:
            name = e[1:]
            if e[0] == "+":
                entries.append(name)  # a repeat is dropped by resolve
            elif name in entries:
                entries.remove(name)
            else:
                raise ValueError(f"{self.arg}={edits!r}: {e!r} removes {name!r}, which is not in the default list "
                                 f"{list(self.default)}; remove an entry of that list, or write the whole list")
        return entries


def is_edit_list(value: Any) -> bool:
    """Is ``value`` a non-empty list of edits (``"+x"`` / ``"-x"`` only), to be applied to the default list?"""
    return _is_list(value) and bool(value) and \
        all(isinstance(e, str) and e.startswith(EDIT_PREFIXES) for e in value)


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple))
