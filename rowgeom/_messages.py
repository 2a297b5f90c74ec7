"""The messages of the errors a tree that cannot be labelled or planned raises.

Every problem of a tree is reported in one error, each leaf named with its shape, the labels that
fit it and a fix to paste. The labeller (`rowgeom._labels`), the model structure
(`rowgeom._structure`: the axes the shapes do not decide, with the likely reading) and the plan
(`rowgeom._recipe`) collect the problems; this module writes them, and runs only when a tree is
wrong (`rowgeom._structure`, which it imports, imports it only where it raises).

A label problem kind is a list of ``(path, shape)`` (``not_hidden`` entries carry the reason
too); `label_problems` writes the kinds in a fixed order.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from rowgeom._names import LABELS
from rowgeom._structure import (
    StructureError,
    in_blocks,
    is_position_embedding,
    out_in,
    stack_of,
    vector_layers,
    width_split,
    written_axes,
)
from rowgeom._tree import path_name, path_str

# --- `label_params`' problems -----------------------------------------------------------------


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


def label_problems(problems: dict[str, list], vocabs: set[int], layout, default) -> str | None:
    """One message for every problem kind found (None when there is none), in a fixed order:
    nameless trees, hidden matrices of vocabulary size, heads without one, unchecked defaults,
    unlabelled matrices (``ambiguous``: the (V, d)-shaped ones among them); `vocabs`: the token
    tables' sizes, `layout`: the `ModelStructure` the names alone give."""
    where_v = f"V={layout.vocab_size}" + (
        f", from {path_str(layout.source)}" if layout.source else "")
    sizes = Shapes(vocabs, layout.width, where_v)
    parts = [write(problems[kind], sizes, default) for kind, write in _MESSAGES.items()
             if problems.get(kind)]
    if problems.get("unmatched"):
        parts.append(_unmatched(problems["unmatched"], sizes, default,
                                problems.get("ambiguous", ())))
    return "label_params: " + " Also: ".join(parts) if parts else None


def untied_head(tied, heads) -> str:
    """``tied`` given, and a head matrix of no token table's shape."""
    return (f"label_params: tied={tied!r} but the params have a separate, untied head "
            f"{show(heads)} of no token table's shape; pass tied=None (the default) for an "
            "untied head")


def several_tied_tables(embeds) -> str:
    """``tied='head'`` and no one token table to train as the head."""
    return (f"label_params: tied='head' but several embedding tables {show(embeds)}; "
            "label the tied one with rules=[(regex, 'head')]")


def no_label_or_transform(found, transforms) -> str:
    """`partition_by_label`: parameters without a label (``found``: ``(path, (found, label))``),
    else the labels without a transform, each with the parameters that use it."""
    missing = [path_str(path) for path, (ok, _) in found if not ok]
    if missing:
        return "partition_by_label: no label for parameter(s) " + ", ".join(missing)
    no_tx: dict[str, list[str]] = {}
    for path, (_, label) in found:
        if label not in transforms:
            no_tx.setdefault(label, []).append(path_str(path))
    detail = "; ".join(f"{lab!r} (used by {', '.join(paths)})" for lab, paths in no_tx.items())
    return (f"partition_by_label: no transform for label(s) {detail}. "
            f"transforms has {sorted(map(str, transforms))}")


def tied_without_head(embeds) -> str:
    """An embedding table and no head, and no ``tied`` policy: the pattern of tied embeddings."""
    tokens = [lf for lf in embeds if not is_position_embedding(lf.path)] or embeds
    table = max(tokens, key=lambda lf: lf.shape[0] if lf.shape else 0)
    return (f"label_params: found embedding table(s) {show(embeds)} but no head matrix: "
            f"the pattern of tied embeddings (GPT-2, Gemma, OPT, nanodo), a token table "
            f"{path_str(table.path)} {tuple(table.shape)} and no (d, V) or (V, d) output "
            "matrix anywhere in the tree. If the logits reuse the token table (logits = "
            "h @ E.T), pass tied='embedding' (train the table with AdamW as an embedding) or "
            "tied='head' (train it with the head optimizer, uncentred RowNorm). If the model "
            "has its own output matrix, label it with rules=[(regex, 'head')] or "
            "extra_head_names=")


# --- The plan's problems ------------------------------------------------------------------------


def not_a_group(leaves) -> str:
    """Labels (a rule's, a given tree's) that are none of `LABELS`: no group trains them."""
    wrong: dict[str, list[str]] = {}
    for path, _, label, _ in leaves:
        if label not in LABELS:
            wrong.setdefault(label, []).append(path_str(path))
    detail = "; ".join(f"{lab!r} (used by {', '.join(paths)})" for lab, paths in wrong.items())
    return (f"lm_optimizer: no group for label(s) {detail}; its groups are {LABELS}: label "
            "these parameters with one of them (or build your own optax.partition with "
            "rowgeom.partition_by_label)")


def no_head_group(leaves, head: str, tied: str | None) -> str:
    """Labels given as a tree or callable name no head (``leaves``: `labelled_leaves`')."""
    matrices = [(p, s, lab) for p, s, lab, _ in leaves if len(s) == 2]
    largest = max((max(s) for _, s, _ in matrices), default=None)
    candidates = ", ".join(f"{path_str(p)} {tuple(s)} (labelled {lab!r})"
                           for p, s, lab in matrices if max(s) == largest)
    seen = f" (the matrices with the largest axis: {candidates})" if candidates else ""
    if tied == "head":
        return ("lm_optimizer(tied='head'): no parameter is labelled 'head'; label the tied "
                f"embedding table 'head'{seen}")
    return (f"lm_optimizer(head={head!r}): no parameter is labelled 'head' by the given "
            f"labels{seen}. Label the output matrix 'head', or pass tied='embedding' if the "
            "logits reuse the embedding table (tied='head' trains that table with the head "
            "optimizer: label it 'head')")


def no_dimension_numbers(missing: list[str]) -> str:
    """`MuonOptions.dimension_numbers`, given outright, leaves hidden parameters out."""
    return f"MuonOptions.dimension_numbers has no entry for the hidden parameter(s) {missing}"


def undecided_router_axes(optimizer: str, err: Exception) -> str:
    """A router whose expert axis the shapes do not tell (`err`: the StructureError)."""
    return (f"lm_optimizer(router={optimizer!r}): {err}. Train routers with router='muon', or "
            "label this one 'hidden'")


def muon_head_not_a_matrix(path, shape) -> str:
    """``head='muon'`` and a head leaf of rank other than 2."""
    return f"head='muon': the head {path_str(path)} {shape} must be a single matrix (rank 2)"


def not_an_axis_of_the_head(axis: int, path, shape) -> str:
    """``HeadOptions.vocab_axis`` out of range for a (rank-2) Muon head."""
    return f"HeadOptions.vocab_axis={axis} is not an axis of the head {path_str(path)} {shape}"


def undecided_muon_axes(errors) -> str:
    """One message for every leaf whose Muon axes the shapes do not decide (``(path, shape,
    StructureError, batch roles)``), with the mapping to pass (the likely reading where there
    is one)."""
    lines, entries = [], []
    for path, shape, err, roles in errors:
        lines.append(f"  {err}")
        roles = {**roles, **err.roles}
        dims, comment = "reduction_axis=..., output_axis=...", ""
        if err.suggestion is not None:
            red, out = err.suggestion
            dims = f"reduction_axis={written_axes(red)!r}, output_axis={written_axes(out)!r}"
            batch = [f"{a} ({roles.get(a, 'batch')})" for a in range(len(shape))
                     if a not in set(red) | set(out)]
            comment = f"  # batch axes {', '.join(batch)}" if batch else ""
        entries.append(f"    {path_str(path)!r}: rowgeom.MuonDimensionNumbers({dims}),{comment}")
    return (f"lm_optimizer: cannot infer Muon's matrix axes of {len(errors)} parameter(s) from "
            "the shapes:\n" + "\n".join(lines) + "\nCheck the likely reading below (axes not "
            "named in a side are batch axes: experts, layers), correct it where needed and pass "
            "it; leaves not named there are still inferred:\n"
            "muon=rowgeom.MuonOptions(dimension_numbers={\n" + "\n".join(entries) + "\n})")


# --- The axes the shapes do not decide (`rowgeom._structure`'s StructureErrors) -----------------


def no_layer_axis(where: str, prefix, info) -> StructureError:
    """A leaf of a layer stack without the stack's layer axis (``info``: its (axis, L) or None)."""
    if info is None:
        return StructureError(f"{where} is in the stacked layers {'/'.join(prefix)}, whose layer "
                              "axis cannot be told from the shapes")
    return StructureError(f"{where} has no layer axis of size {info[1]} at position {info[0]} "
                          f"like the rest of the stack {'/'.join(prefix)}")


def unknown_vocab_axis(path, shape, vocab_size) -> ValueError:
    """A head leaf with not exactly one axis of size V and no name that says its layout."""
    return ValueError(
        f"cannot infer the vocabulary axis of head parameter {path_name(tuple(path))!r} "
        f"(shape {tuple(shape)}): it has not exactly one axis of the vocabulary size "
        f"(V={vocab_size}), and only rank-2 leaves named 'kernel' ((d, V) -> 1), 'embedding' "
        "or 'weight' ((V, d) -> 0) are recognised by name. Say it with "
        "lm_optimizer(head=rowgeom.HeadOptions(vocab_axis=...))")


def _pair_or_split(shape, left, width, features, stored_out_in=False):
    """The reading to suggest for the axes left: the two of them (fan-in first, see `out_in`),
    else the rank >= 3 rule."""
    if len(left) == 2:
        fan_in, fan_out = left[::-1] if stored_out_in else left
        return (fan_in,), (fan_out,)
    return None if width is None else width_split(shape, left, width, features)


def undecided_expert_axis(path, shape, rest, structure, features, where) -> StructureError:
    """An expert stack with not exactly one axis of the expert count, with the likely reading
    (the first axis not of size d indexes the experts)."""
    count, width = structure.experts[path], structure.width
    hits = [a for a in rest if shape[a] == count]
    guess = [a for a in rest if width is None or shape[a] != width][:1]
    left = [a for a in rest if a not in guess]
    why = ("no router (d, E) beside it tells the expert count" if count is None else
           f"it has {len(hits)} axes of the expert count E={count}")
    return StructureError(f"{where} is an expert stack and which axis indexes the experts is not "
                          f"told by the shapes: {why}",
                          _pair_or_split(shape, left, width, features, out_in(path, structure))
                          if guess else None,
                          dict.fromkeys(guess, "experts"))


def undecided_matrix_axes(path, shape, rest, structure, features, where) -> StructureError:
    """A leaf of rank >= 3 (`rest`: its axes but a layer axis) whose matrix axes the shapes do
    not decide: outside the repeated blocks, with the model width unknown, or with not exactly
    one axis of size d."""
    width = structure.width
    if not in_blocks(path, structure.stacks):
        # The likely reading: a leading axis of the length of a stacked vector outside any stack
        # is a layer axis.
        loose = {layers[1] for p, s in structure.vectors if stack_of(p, structure.stacks) is None
                 and (layers := vector_layers(s, width)) is not None}
        lead = [a for a in rest[:2] if shape[a] in loose and shape[a] != width][:1]
        return StructureError(
            f"{where} has rank {len(rest)} outside the repeated blocks, so a layer axis (a "
            "batch axis) cannot be told from a matrix axis",
            _pair_or_split(shape, [a for a in rest if a not in lead], width, features,
                           out_in(path, structure)),
            dict.fromkeys(lead, "layers"))
    if width is None:
        return StructureError(f"{where} has rank {len(rest)} and the model width is unknown (no "
                              "token embedding or head)")
    wide = [a for a in rest if shape[a] == width]
    return StructureError(f"{where} has {len(wide)} axes of the model width d={width} "
                          "(need exactly one to tell the matrix's two sides apart)")
