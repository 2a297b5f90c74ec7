"""What a language model's parameter tree says about the model: vocabulary, width, blocks,
layer stacks, and from them each hidden leaf's matrix axes and each head leaf's vocabulary axis.

Names say what a parameter is for (`rowgeom._names`); shapes say how big the model is.
`label_params` and the optimizer plan use both, so that a name that contradicts the shapes is an
error instead of a silently wrong geometry:

- the **vocabulary size** ``V`` and **width** ``d`` come from the token embedding table
  (``(V, d)``, the layout of every JAX ``Embed``), else from a named head matrix;
- the **repeated blocks** are the subtrees of a block container: a numbered component
  (``layers/0``, ``h/3``, ``layers_0``, ``encoderdecoderblock_2``, ``blocks_1``) or a container
  name (``layers``, ``blocks``, ``h``, ...) followed by no number, which is a **stack** of
  scanned layers whose leaves carry a layer axis;
- a stack's **layer axis** is read off its norm scales (``(L, d)`` or, as in MaxText's default
  ``param_scan_axis=1``, ``(d, L)``), else from the one leading axis all its leaves share.

`muon_axes` turns this into Muon's matrix axes for rank 3–4 kernels: the layer axis is a batch
axis, the one axis of size ``d`` is one side of the matrix, the other axes together are the
other side. Orthogonalisation commutes with transposition, so which side is fan-in matters only
for the ``"spectral"``/``"keller"`` scales (the ``d`` axis is taken as fan-in unless it is the
last axis); `lm_optimizer`'s default ``"rms"`` scale is symmetric. `head_vocab_axis` is the one
axis of size ``V``, else the leaf name's convention (`rowgeom._names.VOCAB_AXIS_BY_LEAF_NAME`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

from rowgeom._names import (
    BLOCK_CONTAINER_NAMES,
    POSITION_EMBEDDING_NAMES,
    TOKEN_EMBEDDING_NAMES,
    VOCAB_AXIS_BY_LEAF_NAME,
)

_NUMBERED = re.compile(r"^(?P<base>.*?)_?(?P<index>\d+)$")


def block_position(path: Sequence[str]) -> tuple[int, bool] | None:
    """(index of the component that starts a repeated block, whether it is a stack), or None.

    ``layers/0/...``, ``h/0/...``, ``layers_0/...``, ``encoderdecoderblock_0/...``: an unrolled
    block. ``layers/attn/...`` (a container name followed by no number): a stack of layers.
    """
    for i, component in enumerate(path[:-1]):
        c = component.lower()
        if c.isdigit():
            if i == 0:
                continue  # a list of modules at the root (sequential), not a block container
            return i, False
        match = _NUMBERED.match(c)
        if match and (match["base"] in BLOCK_CONTAINER_NAMES
                      or "block" in match["base"] or match["base"].endswith("layer")):
            return i, False
        if c in BLOCK_CONTAINER_NAMES:
            nxt = path[i + 1].lower()
            if nxt.isdigit():
                return i + 1, False
            return i, True
    return None


def is_position_embedding(path: Sequence[str]) -> bool:
    return any(c.lower() in POSITION_EMBEDDING_NAMES or "pos" in c.lower() for c in path)


class ModelStructure(NamedTuple):
    """What the shapes say about a parameter tree (see the module docstring).

    ``vocab_size``/``width``: ``V`` and ``d`` (None when no embedding or head was found);
    ``source``: the path they were read from; ``stacks``: stack prefix -> (layer axis, L).
    """

    vocab_size: int | None
    width: int | None
    source: tuple[str, ...] | None
    stacks: dict[tuple[str, ...], tuple[int, int] | None]


def find_vocab(embeddings, heads) -> tuple[int | None, int | None, tuple | None]:
    """``(V, d, path)`` from the token embedding ``(V, d)``, else a head matrix (larger axis V).

    `embeddings` and `heads` are lists of ``(path, shape)`` of rank-2 leaves.
    """
    tokens = [(p, s) for p, s in embeddings if any(c.lower() in TOKEN_EMBEDDING_NAMES for c in p)]
    if not tokens:
        tokens = [(p, s) for p, s in embeddings if not is_position_embedding(p)]
    if tokens:
        path, shape = max(tokens, key=lambda e: e[1][0])
        if sum(s[0] == shape[0] for _, s in tokens) > 1:
            path = None  # several equally large tables: V and d are known, which one is not
        return shape[0], shape[1], path
    if heads:
        path, shape = heads[0]
        return max(shape), min(shape), path
    return None, None, None


def find_stacks(entries, width: int | None, is_vector) -> dict:
    """Layer axis and depth of every stack of scanned layers.

    `entries`: ``(path, shape)`` of every leaf; `is_vector(path, shape)` says which are norm
    scales / biases. Returns ``{stack prefix: (axis, L) or None}`` (None: not determinable).
    """
    members: dict[tuple[str, ...], list] = {}
    for path, shape in entries:
        pos = block_position(path)
        if pos is not None and pos[1]:
            members.setdefault(tuple(path[:pos[0] + 1]), []).append((path, shape))
    stacks: dict[tuple[str, ...], tuple[int, int] | None] = {}
    for prefix, leaves in members.items():
        if any(len(s) < 2 for _, s in leaves) or all(len(s) < 3 for _, s in leaves):
            stacks[prefix] = NOT_STACKED  # a vector without a layer axis, or no stacked matrix
            continue
        found = set()
        for path, shape in leaves:  # stacked norm scales: (L, d) or (d, L)
            if width is not None and len(shape) == 2 and is_vector(path, shape) \
                    and list(shape).count(width) == 1:
                axis = 1 - shape.index(width)
                found.add((axis, shape[axis]))
        if len(found) != 1:
            found = set()
            for axis in (0, 1):
                sizes = {s[axis] for _, s in leaves if len(s) > axis + 1}
                if len(sizes) == 1 and all(len(s) > axis + 1 for _, s in leaves):
                    found.add((axis, sizes.pop()))
            if width is not None:  # the width is a matrix axis, not the layer axis
                found = {f for f in found if f[1] != width}
        stacks[prefix] = found.pop() if len(found) == 1 else None
    return stacks


NOT_STACKED = (-1, -1)
"""`find_stacks` value for a block container whose leaves carry no layer axis."""


def stack_of(path: Sequence[str], stacks: dict) -> tuple[tuple[str, ...], tuple | None] | None:
    """``(stack prefix, (layer axis, L) or None)`` for a leaf of a stack; None otherwise."""
    pos = block_position(path)
    if pos is None or not pos[1]:
        return None
    prefix = tuple(path[:pos[0] + 1])
    info = stacks.get(prefix)
    return None if info == NOT_STACKED else (prefix, info)


class StructureError(ValueError):
    """A shape-based inference that cannot be made unambiguously (the message names the leaf)."""


def muon_axes(path: Sequence[str], shape: Sequence[int], width: int | None, stacks: dict):
    """``(reduction_axes, output_axes)`` of a hidden parameter, or StructureError naming it."""
    shape = tuple(shape)
    where = f"{'/'.join(path)} {shape}"
    rest = list(range(len(shape)))
    stack = stack_of(path, stacks)
    if stack is not None and len(shape) >= 3:
        prefix, info = stack
        if info is None:
            raise StructureError(f"{where} is in the stacked layers {'/'.join(prefix)}, whose "
                                 "layer axis cannot be told from the shapes")
        axis, depth = info
        if shape[axis] != depth:
            raise StructureError(f"{where} has no layer axis of size {depth} at position {axis} "
                                 f"like the rest of the stack {'/'.join(prefix)}")
        rest.remove(axis)
    if len(rest) == 2:
        return (rest[0],), (rest[1],)
    if any("expert" in c.lower() or c.lower() == "moe" for c in path):
        raise StructureError(f"{where} is an expert stack: which axis indexes the experts is not "
                          "told by the shapes")
    if width is None:
        raise StructureError(f"{where} has rank {len(rest)} and the model width is unknown (no "
                          "token embedding or head)")
    wide = [a for a in rest if shape[a] == width]
    if len(wide) != 1:
        raise StructureError(f"{where} has {len(wide)} axes of the model width d={width} "
                          "(need exactly one to tell the matrix's two sides apart)")
    others = tuple(a for a in rest if a != wide[0])
    if wide[0] == rest[-1]:
        return others, (wide[0],)
    return (wide[0],), others


def model_structure(leaves) -> ModelStructure:
    """V, d and the layer stacks of labelled leaves: ``(path, shape, label, ...)`` tuples."""
    rank2 = lambda lab: [(p, s) for p, s, lb, *_ in leaves if lb == lab and len(s) == 2]
    vocab, width, source = find_vocab(rank2("embedding"), rank2("head"))
    labels = {p: lb for p, _, lb, *_ in leaves}
    stacks = find_stacks([(p, s) for p, s, *_ in leaves], width,
                         lambda p, s: labels[p] == "vector")
    return ModelStructure(vocab, width, source, stacks)


def head_vocab_axis(path: Sequence[str], shape: Sequence[int], vocab_size: int | None) -> int:
    """The vocabulary axis of a head leaf: its one axis of size ``V``, else by its name.

    A rank-2 leaf named ``kernel`` is a Flax ``(d, V)`` kernel (axis 1), ``embedding`` or
    ``weight`` a ``(V, d)`` table (axis 0). Anything else raises `StructureError` naming it.
    """
    shape = tuple(shape)
    if vocab_size is not None and len(shape) == 2:
        axes = [a for a in (0, 1) if shape[a] == vocab_size]
        if len(axes) == 1:
            return axes[0]
    name = path[-1].lower() if path else ""
    if name in VOCAB_AXIS_BY_LEAF_NAME and len(shape) == 2:
        return VOCAB_AXIS_BY_LEAF_NAME[name]
    raise StructureError(
        f"cannot infer the vocabulary axis of head parameter {'/'.join(path) or '<root>'!r} "
        f"(shape {shape}): it has not exactly one axis of the vocabulary size "
        f"(V={vocab_size}), and only rank-2 leaves named 'kernel' ((d, V) -> 1), 'embedding' "
        "or 'weight' ((V, d) -> 0) are recognised by name. Say it with "
        "lm_optimizer(head=rowgeom.HeadOptions(vocab_axis=...))")
