"""The messages of `label_params`' errors: every problem of a tree in one error, each leaf with
the labels that fit it and a fix to paste.

A problem kind is a list of ``(path, shape)`` (``not_hidden`` entries carry the reason too); the
labeller collects them (`rowgeom._labels`) and `problems_message` writes them in a fixed order.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from rowgeom._tree import path_str


class Shapes(NamedTuple):
    """What a message may say about the tree's sizes: the vocabulary sizes, ``d``, and where
    ``V`` was read (``"V=100, from embed/embedding"``)."""

    vocabs: set[int]
    width: int | None
    where_v: str


def regex(path: tuple[str, ...]) -> str:
    """A rule regex matching exactly this path (what error messages suggest)."""
    return "^" + re.escape(path_str(path)) + "$"


def show(entries) -> str:
    """``"a/b (2, 3), c (4,)"``: leaves as messages list them."""
    return ", ".join(f"{path_str(p)} {tuple(s)}" for p, s, *_ in entries)


def fitting(shape, sizes: Shapes, nameless: bool) -> list[str]:
    """The labels a leaf of this shape can have (what an error may offer for it)."""
    vocabs, width = sizes.vocabs, sizes.width
    if vocabs and not nameless:
        if vocabs & set(shape) and len(shape) == 2:
            return ["head", "embedding"]
        return ["hidden", "router"] if len(shape) == 2 and width in shape else ["hidden"]
    if len(shape) == 2:
        return ["embedding", "head", "hidden", "vector"] if nameless else \
            ["head", "embedding", "hidden"]
    return ["hidden", "vector"] if nameless else ["hidden"]


def _offer(entries, sizes: Shapes, nameless=False) -> str:
    return ", ".join(f"{path_str(p)} {tuple(s)}: "
                     + " or ".join(repr(x) for x in fitting(s, sizes, nameless))
                     for p, s, *_ in entries)


def _nameless(entries, sizes: Shapes, default) -> str:
    path, shape = entries[0][:2]
    return (f"{len(entries)} parameter(s) have no names in their paths (a tree of bare values, "
            "such as penzai's unbind_params tuple), and a matrix is never labelled by its shape "
            f"alone: {_offer(entries, sizes, nameless=True)}. Label them with "
            f"lm_optimizer(labels=...) or label_params(rules=...), e.g. "
            f"{{{path_str(path)!r}: {fitting(shape, sizes, True)[0]!r}, ...}} (a flat mapping "
            "from paths to labels), or pass the tree whose paths carry the module names")


def _not_hidden(entries, sizes: Shapes, default) -> str:
    path, _, why = entries[0]
    reason = "default='hidden'" if why == "default" else "its name"
    return (f"{show(entries)} would be 'hidden' (by {reason}) but has an axis of the vocabulary "
            f"size ({sizes.where_v}) and sits outside the repeated blocks: it is the output head "
            f"or an embedding table, not a hidden matrix. Label it explicitly: "
            f"rules=[({regex(path)!r}, 'head')] for the output matrix, or 'embedding' for a "
            "lookup table ('hidden' only if it truly is one)")


def _not_head(entries, sizes: Shapes, default) -> str:
    path = entries[0][0]
    return (f"{show(entries)} is named as the head but has no axis of the vocabulary size "
            f"({sizes.where_v}). If it is not the LM head, label it with "
            f"rules=[({regex(path)!r}, 'hidden')]; if it is, label the true token table with "
            "rules=[(regex, 'embedding')]")


def _unchecked(entries, sizes: Shapes, default) -> str:
    path = entries[0][0]
    return (f"default={default!r} cannot be checked for {show(entries)}: the vocabulary size "
            "cannot be read from the tree (no token embedding or head is named), so each of these "
            "matrices outside the repeated blocks may be the output head or an embedding table "
            f"({_offer(entries, sizes)}). Label them with rules, e.g. "
            f"rules=[({regex(path)!r}, 'head')], or name the token table with "
            "extra_embedding_names=")


def _unmatched(entries, sizes: Shapes, default, ambiguous=()) -> str:
    path, shape = entries[0][:2]
    note = ""
    if ambiguous:
        note = (f" ({show(ambiguous)} is (V, d)-shaped: the head stored (V, d) -> 'head', or a "
                "lookup table -> 'embedding')")
    return ("no label for these matrices: " + show(entries) + note
            + f". Name them with a (regex, label) rule, e.g. rules=[({regex(path)!r}, "
            f"{fitting(shape, sizes, False)[0]!r})] (labels that fit: {_offer(entries, sizes)}), "
            "add their names with extra_hidden_names=/extra_head_names=/extra_embedding_names=, "
            "or pass default='hidden' to send every unnamed matrix to Muon explicitly")


_MESSAGES = {"nameless": _nameless, "not_hidden": _not_hidden, "not_head": _not_head,
             "unchecked": _unchecked}


def problems_message(problems: dict[str, list], sizes: Shapes, default) -> str | None:
    """One message for every problem kind found (None when there is none), in a fixed order:
    nameless trees, hidden matrices of vocabulary size, heads without one, unchecked defaults,
    unlabelled matrices (``ambiguous``: the (V, d)-shaped ones among them)."""
    parts = [write(problems[kind], sizes, default) for kind, write in _MESSAGES.items()
             if problems.get(kind)]
    if problems.get("unmatched"):
        parts.append(_unmatched(problems["unmatched"], sizes, default,
                                problems.get("ambiguous", ())))
    return "label_params: " + " Also: ".join(parts) if parts else None
