"""What a language model's parameter tree says about the model: vocabulary, width, blocks,
layer stacks, expert stacks and routers, and from them each matrix's axes.

Names say what a parameter is for (`rowgeom._names`); shapes say how big the model is.
`label_params` and the optimizer plan use both, so that a name that contradicts the shapes is an
error instead of a silently wrong geometry:

- names are read from a path without its wrapper components (penzai's ``value/data_array``,
  `rowgeom._names.WRAPPER_SUFFIXES`); a path left with no names (``(3,)``) is **nameless**;
- the **vocabulary size** ``V`` and **width** ``d`` come from the token embedding table
  (``(V, d)``, the layout of every JAX ``Embed``), else from a named head matrix;
- the **repeated blocks** are the subtrees of a block container: a numbered component
  (``layers/0``, ``h/3``, ``layers_0``, ``encoderdecoderblock_2``, ``x_layers_1``) or a container
  name (``layers``, ``blocks``, ``h``, ``*_layers``, ...) followed by no number, which is a
  **stack** of scanned layers whose leaves carry a layer axis;
- a stack is also recognised **by structure**, whatever its name: a container of several
  modules (no expert module) whose every leaf has the same size ``L`` at the same leading axis
  (0 or 1), ``L != d``, with a stacked vector ``(L, d)`` or ``(d, L)`` among them (a norm
  scale) and a stacked matrix;
- a stack's **layer axis** is read off its norm scales (``(L, d)`` or, as in MaxText's default
  ``param_scan_axis=1``, ``(d, L)``), else from the one leading axis all its leaves share;
- a **mixture-of-experts module** holds a **router** (named in `DEFAULT_ROUTER_NAMES`, or an
  unnamed ``(d, E)`` matrix) and **expert stacks**: its leaves with three or more axes besides
  the layer axis (``(E, d, f)``, MaxText's scanned ``(E, L, d, f)``), or leaves under an
  ``experts``/``*moe*`` component. The expert count ``E`` is the router's axis other than ``d``
  that every expert stack has (or the number of numbered experts); each stack's **expert axis**
  is its one axis of size ``E``.

`muon_axes` turns this into Muon's matrix axes: layer and expert axes are batch axes (Muon runs
per layer and per expert), two axes left are the matrix; of three or more left, the one axis of
size ``d`` is one side of the matrix and the other axes together the other side (with no axis
of size ``d``: the one axis of a norm scale's size beside it, the rank of a low-rank projection
such as DeepSeek's ``wkv_b``). Orthogonalisation commutes with transposition, so which side is
fan-in matters only for the ``"spectral"``/``"keller"`` scales (the ``d`` axis is taken as
fan-in unless it is the last axis); `lm_optimizer`'s default ``"rms"`` scale is symmetric.
Where the shapes do not decide, `StructureError` carries the likely reading, for an error that
lists every such leaf at once. `head_vocab_axis` is the one axis of size ``V``, else the leaf
name's convention (`rowgeom._names.VOCAB_AXIS_BY_LEAF_NAME`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

from rowgeom._names import (
    BLOCK_CONTAINER_NAMES,
    CONTAINER_SUFFIXES,
    DEFAULT_ROUTER_NAMES,
    EXPERT_MODULE,
    GENERIC_LEAF_NAMES,
    POSITION_EMBEDDING_NAMES,
    TOKEN_EMBEDDING_NAMES,
    VOCAB_AXIS_BY_LEAF_NAME,
    WRAPPER_SUFFIXES,
)

Path = tuple[str, ...]
_NUMBERED = re.compile(r"^(?P<base>.*?)_?(?P<index>\d+)$")


def naming_path(path: Sequence[str]) -> Path:
    """`path` without the wrapper components at its end (`rowgeom._names.WRAPPER_SUFFIXES`)."""
    path = tuple(path)
    for suffix in WRAPPER_SUFFIXES:
        n = len(suffix)
        if len(path) > n - 1 and tuple(c.lower() for c in path[-n:]) == suffix:
            return path[:-n]
    return path


def is_nameless(path: Sequence[str]) -> bool:
    """Whether a path carries no name at all (``(3, 'value', 'data_array')``: penzai's tuple)."""
    return all(c.isdigit() for c in naming_path(path))


def is_container(component: str) -> bool:
    c = component.lower()
    return c in BLOCK_CONTAINER_NAMES or c.endswith(CONTAINER_SUFFIXES)


def block_position(path: Sequence[str]) -> tuple[int, bool] | None:
    """(index of the component that starts a repeated block, whether it is a stack), or None.

    ``layers/0/...``, ``h/0/...``, ``layers_0/...``, ``encoderdecoderblock_0/...``: an unrolled
    block. ``layers/attn/...`` (a container name followed by no number): a stack of layers.
    """
    path = naming_path(path)
    for i, component in enumerate(path[:-1]):
        c = component.lower()
        if c.isdigit():
            if i == 0:
                continue  # a list of modules at the root (sequential), not a block container
            return i, False
        match = _NUMBERED.match(c)
        if match and (is_container(match["base"]) or "block" in match["base"]
                      or match["base"].endswith(("layer", "layers"))):
            return i, False
        if is_container(c):
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
    ``source``: the path they were read from; ``stacks``: stack prefix -> (layer axis, L);
    ``experts``: expert-stack leaf path -> expert count ``E`` (None: not decided);
    ``routers``: router leaf path -> ``E`` (None: not decided).
    """

    vocab_size: int | None
    width: int | None
    source: tuple[str, ...] | None
    stacks: dict[tuple[str, ...], tuple[int, int] | None]
    experts: dict[tuple[str, ...], int | None] = {}
    routers: dict[tuple[str, ...], int | None] = {}


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


NOT_STACKED = (-1, -1)
"""`find_stacks` value for a block container whose leaves carry no layer axis."""


def _common_leading_axis(leaves, width):
    """``{(axis, size)}``: leading axes (0, 1) of one size on every leaf, the width excluded."""
    found = set()
    for axis in (0, 1):
        if all(len(s) > axis + 1 for _, s in leaves):
            sizes = {s[axis] for _, s in leaves}
            if len(sizes) == 1:
                found.add((axis, sizes.pop()))
    return {f for f in found if f[1] != width} if width is not None else found


def _stacked_norms(leaves, width, is_vector) -> set:
    """``{(axis, L)}`` read off stacked vectors ``(L, d)`` / ``(d, L)`` of a container."""
    found = set()
    for path, shape in leaves:
        if width is not None and len(shape) == 2 and is_vector(path, shape) \
                and list(shape).count(width) == 1:
            axis = 1 - shape.index(width)
            found.add((axis, shape[axis]))
    return found


def find_stacks(entries, width: int | None, is_vector) -> dict:
    """Layer axis and depth of every stack of scanned layers (named or by structure).

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
        found = _stacked_norms(leaves, width, is_vector)
        if len(found) != 1:
            found = _common_leading_axis(leaves, width)
        stacks[prefix] = found.pop() if len(found) == 1 else None
    stacks.update(_structural_stacks(entries, width, is_vector, stacks))
    return stacks


def _structural_stacks(entries, width, is_vector, named) -> dict:
    """Containers whose leaves all carry one layer axis, whatever their names (module doc)."""
    if width is None:
        return {}
    under: dict[tuple[str, ...], list] = {}
    for path, shape in entries:
        for n in range(1, len(path)):
            under.setdefault(tuple(path[:n]), []).append((path, shape))
    found: dict[tuple[str, ...], tuple[int, int]] = {}
    for prefix in sorted(under, key=len):
        if any(prefix[:n] in found or named.get(prefix[:n], NOT_STACKED) != NOT_STACKED
               for n in range(1, len(prefix) + 1)):
            continue  # inside a stack already
        leaves = under[prefix]
        modules = {p[len(prefix)] for p, _ in leaves if len(p) > len(prefix) + 1}
        if len(modules) < 2 or any(_is_expert_component(c) for c in prefix) \
                or any(len(s) < 2 for _, s in leaves) or all(len(s) < 3 for _, s in leaves):
            continue  # a stack holds several modules; experts' (E, f) biases are no layers
        common = _common_leading_axis(leaves, width)
        norms = _stacked_norms(leaves, width, is_vector)
        if len(norms) == 1 and norms <= common:
            found[prefix] = norms.pop()
    return found


def stack_of(path: Sequence[str], stacks: dict) -> tuple[tuple[str, ...], tuple | None] | None:
    """``(stack prefix, (layer axis, L) or None)`` for a leaf of a stack; None otherwise."""
    path = tuple(path)
    for n in range(1, len(path)):
        info = stacks.get(path[:n], NOT_STACKED)
        if info != NOT_STACKED:
            return path[:n], info
    return None


def in_blocks(path: Sequence[str], stacks: dict) -> bool:
    """Whether a leaf sits inside the repeated blocks (unrolled, named stack or structural)."""
    return block_position(path) is not None or stack_of(path, stacks) is not None


def _layer_axis(path, shape, stacks) -> int | None:
    stack = stack_of(path, stacks)
    if stack is None or stack[1] is None or len(shape) < 3:
        return None
    axis, depth = stack[1]
    return axis if shape[axis] == depth else None


def unstacked_axes(path, shape, stacks) -> list[int]:
    """The axes of a leaf other than its layer axis (when it has one)."""
    layer = _layer_axis(path, shape, stacks)
    return [a for a in range(len(shape)) if a != layer]


# --- Mixture of experts ------------------------------------------------------------------------


def _is_expert_component(component: str) -> bool:
    c = component.lower()
    return bool(EXPERT_MODULE.search(c)) and not c.startswith("shared") and not is_container(c)


def router_index(path: Sequence[str], router_names: Collection[str]) -> int | None:
    """Index of the component naming a router (``gate/kernel`` -> the ``gate``), or None."""
    nm = naming_path(path)
    if nm and nm[-1].lower() in router_names:
        return len(nm) - 1
    if len(nm) > 1 and nm[-2].lower() in router_names and nm[-1].lower() in GENERIC_LEAF_NAMES:
        return len(nm) - 2
    return None


def _numbered_experts(paths, module: Path) -> int | None:
    """The number of numbered experts (``experts/0``, ``experts/1``, ...) under a module."""
    indices = set()
    for path in paths:
        rest = path[len(module):]
        for i, c in enumerate(rest[:-1]):
            if c.lower() in ("experts", "expert") and rest[i + 1].isdigit():
                indices.add(int(rest[i + 1]))
    return len(indices) if indices and indices == set(range(len(indices))) else None


def find_experts(entries, width: int | None, stacks: dict, *,
                 router_names: Collection[str] = DEFAULT_ROUTER_NAMES,
                 movable: Callable[[Path], bool] = lambda p: True):
    """``(experts, routers)``: expert-stack leaf -> ``E``, router leaf -> ``E`` (module doc).

    `entries`: ``(path, shape, label)`` of every leaf (label None: not named). Routers are the
    leaves labelled ``"router"`` and, where `movable(path)`, the ``"hidden"`` or unlabelled
    leaves named in `router_names` (or unnamed ``(d, E)`` matrices beside expert stacks) that
    the shapes confirm; expert stacks are among the ``"hidden"`` or unlabelled leaves.
    """
    entries = [(tuple(p), tuple(s), lb) for p, s, lb in entries if len(s) >= 2]
    axes = {p: unstacked_axes(p, s, stacks) for p, s, _ in entries}
    shapes = {p: s for p, s, _ in entries}
    labels = {p: lb for p, _, lb in entries}
    routers: dict[Path, int | None] = {}
    experts: dict[Path, int | None] = {}
    may_expert = [p for p, _, lb in entries if lb in ("hidden", None) and len(axes[p]) >= 3]

    def stacks_under(module: Path, skip) -> list[Path]:
        return [p for p in may_expert if p[:len(module)] == module and p not in skip
                and not any(c.lower().startswith("shared") for c in p[len(module):])]

    def router_sizes(path) -> set[int]:
        sizes = [shapes[path][a] for a in axes[path]]
        if width is not None and sizes.count(width) == 1:
            return {s for s in sizes if s != width}
        return set(sizes)

    def count_for(router, members, module) -> int | None:
        sizes = router_sizes(router)
        if members:
            common = {e for e in sizes
                      if all(any(shapes[m][a] == e for a in axes[m]) for m in members)}
            if len(common) == 1:
                return common.pop()
        numbered = _numbered_experts(list(shapes), module)
        return numbered if numbered in sizes else None

    by_module: dict[Path, list[Path]] = {}
    for path, _, label in entries:
        if len(axes[path]) != 2:
            continue
        k = router_index(path, router_names)
        if label == "router" and k is None:
            nm = naming_path(path)
            k = len(nm) - (2 if len(nm) > 1 and nm[-1].lower() in GENERIC_LEAF_NAMES else 1)
        if k is not None and (label == "router" or (label in ("hidden", None)
                                                    and movable(path))):
            by_module.setdefault(path[:k], []).append(path)
    for module, candidates in by_module.items():
        members = stacks_under(module, set(candidates))
        for router in candidates:
            count = count_for(router, members, module)
            if count is not None or labels[router] == "router":
                routers[router] = count
            if count is not None:
                experts.update((m, count) for m in members)
    # Expert stacks under an experts/moe component and no named router beside them: a router
    # by its (d, E) shape alone, else an expert count nobody can tell.
    for path in may_expert:
        if path in experts:
            continue
        marks = [i for i, c in enumerate(path[:-1]) if _is_expert_component(c)]
        if not marks:
            continue
        module = path[:marks[-1] + 1]
        members = stacks_under(module, set(routers))
        if not members:
            continue
        # Sizes at one position in every stack (the expert axis; f changes places in wo).
        ranks = {len(axes[m]) for m in members}
        sizes = {shapes[members[0]][axes[members[0]][i]] for i in range(min(ranks))
                 if len(ranks) == 1 and len({shapes[m][axes[m][i]] for m in members}) == 1}
        if width is not None:
            sizes.discard(width)
        skip = set(members)

        def beside(p, module=module, skip=skip) -> bool:  # a child of the MoE module or parent
            for outer in (module, module[:-1]):
                rel = naming_path(p)[len(outer):]
                if p[:len(outer)] == outer and p not in skip and (
                        len(rel) == 1 or (len(rel) == 2 and rel[-1].lower() in GENERIC_LEAF_NAMES)):
                    return True
            return False

        shaped = [p for p, _, lb in entries if beside(p) and lb in ("hidden", None) and movable(p)
                  and len(axes[p]) == 2 and width is not None
                  and width in [shapes[p][a] for a in axes[p]] and router_sizes(p) & sizes]
        count = None
        if len(shaped) == 1 and len(router_sizes(shaped[0]) & sizes) == 1:
            count = (router_sizes(shaped[0]) & sizes).pop()
            routers[shaped[0]] = count
        experts.update((m, count) for m in members)
    return experts, routers


def model_structure(leaves, *, router_names: Collection[str] = DEFAULT_ROUTER_NAMES,
                    movable: Callable[[Path], bool] = lambda p: False) -> ModelStructure:
    """V, d, layer stacks, experts and routers of labelled leaves: ``(path, shape, label, ...)``.

    ``V`` and ``d`` come from the leaves labelled ``"embedding"``/``"head"``; a leaf labelled
    ``"vector"`` is a norm scale or bias; `movable(path)`: whether a ``"hidden"`` (or None)
    label may still turn out to be a router (`find_experts`).
    """
    rank2 = lambda lab: [(p, s) for p, s, lb, *_ in leaves if lb == lab and len(s) == 2]
    vocab, width, source = find_vocab(rank2("embedding"), rank2("head"))
    labels = {tuple(p): lb for p, _, lb, *_ in leaves}
    stacks = find_stacks([(p, s) for p, s, *_ in leaves], width,
                         lambda p, s: labels[tuple(p)] == "vector")
    experts, routers = find_experts([(p, s, lb) for p, s, lb, *_ in leaves], width, stacks,
                                    router_names=router_names, movable=movable)
    return ModelStructure(vocab, width, source, stacks, experts, routers)


# --- Matrix axes --------------------------------------------------------------------------------


class StructureError(ValueError):
    """A shape-based inference that cannot be made unambiguously (the message names the leaf).

    ``suggestion``: the likely ``(reduction_axes, output_axes)`` for an error to offer, or None;
    ``roles``: ``{axis: "experts" | "layers"}`` of the batch axes that reading assumes.
    """

    def __init__(self, message: str, suggestion: tuple | None = None,
                 roles: dict[int, str] | None = None):
        super().__init__(message)
        self.suggestion = suggestion
        self.roles = roles or {}


def batch_roles(path, shape, structure: ModelStructure) -> dict[int, str]:
    """``{axis: "layers" | "experts"}`` of the batch axes `muon_axes` takes out of a leaf."""
    roles = {}
    layer = _layer_axis(path, shape, structure.stacks)
    if layer is not None:
        roles[layer] = "layers"
    count = structure.experts.get(tuple(path))
    rest = [a for a in range(len(shape)) if a != layer]
    if count is not None and len(rest) >= 3:
        hits = [a for a in rest if shape[a] == count]
        if len(hits) == 1:
            roles[hits[0]] = "experts"
    return roles


def _split(shape, rest, width, features) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The rank >= 3 rule: the one axis of size d (else of a feature size) against the rest."""
    for sizes in ([width], features):
        wide = [a for a in rest if shape[a] in sizes]
        if len(wide) == 1:
            others = tuple(a for a in rest if a != wide[0])
            return (others, (wide[0],)) if wide[0] == rest[-1] else ((wide[0],), others)
        if wide:
            return None
    return None


def muon_axes(path: Sequence[str], shape: Sequence[int], structure: ModelStructure,
              features: Collection[int] = (), layer_sizes: Collection[int] = ()):
    """``(reduction_axes, output_axes)`` of a matrix-like leaf, or StructureError naming it.

    `features`: sizes of the norm scales beside the leaf (its module's low-rank widths);
    `layer_sizes`: lengths of stacked vectors ``(L, d)`` outside any stack (for the reading an
    error suggests).
    """
    shape, path = tuple(shape), tuple(path)
    width = structure.width
    where = f"{'/'.join(path)} {shape}"
    rest = list(range(len(shape)))
    stack = stack_of(path, structure.stacks)
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
    if path in structure.experts and len(rest) >= 3:
        count = structure.experts[path]
        hits = [a for a in rest if count is not None and shape[a] == count]
        if len(hits) != 1:
            guess = [a for a in rest if width is None or shape[a] != width][:1]
            left = [a for a in rest if a not in guess]
            suggestion: tuple[tuple[int, ...], tuple[int, ...]] | None = None
            if guess and len(left) == 2:
                suggestion = ((left[0],), (left[1],))
            elif guess:
                suggestion = _split(shape, left, width, features)
            why = ("no router (d, E) beside it tells the expert count" if count is None else
                   f"it has {len(hits)} axes of the expert count E={count}")
            raise StructureError(f"{where} is an expert stack and which axis indexes the "
                                 f"experts is not told by the shapes: {why}", suggestion,
                                 dict.fromkeys(guess, "experts"))
        rest.remove(hits[0])
    if len(rest) == 2:
        return (rest[0],), (rest[1],)
    if not in_blocks(path, structure.stacks):
        # The likely reading: a leading axis of a stacked vector's length is a layer axis.
        lead = [a for a in rest[:2] if shape[a] in layer_sizes and shape[a] != width][:1]
        left = [a for a in rest if a not in lead]
        suggestion = None
        if len(left) == 2:
            suggestion = ((left[0],), (left[1],))
        elif width is not None:
            suggestion = _split(shape, left, width, features)
        raise StructureError(
            f"{where} has rank {len(rest)} outside the repeated blocks, so a layer axis (a "
            "batch axis) cannot be told from a matrix axis", suggestion,
            dict.fromkeys(lead, "layers"))
    if width is None:
        raise StructureError(f"{where} has rank {len(rest)} and the model width is unknown (no "
                             "token embedding or head)")
    split = _split(shape, rest, width, features)
    if split is None:
        wide = [a for a in rest if shape[a] == width]
        raise StructureError(f"{where} has {len(wide)} axes of the model width d={width} "
                             "(need exactly one to tell the matrix's two sides apart)")
    return split


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


def router_axes(path, shape, structure: ModelStructure) -> tuple[int, int]:
    """``(feature axis, expert axis)`` of a router: its two axes besides a layer axis, the
    expert axis of size ``E`` (else the one not of size ``d``; else by the leaf name)."""
    path, shape = tuple(path), tuple(shape)
    rest = unstacked_axes(path, shape, structure.stacks)
    if len(rest) != 2:
        raise StructureError(f"router {'/'.join(path)} {shape} is not a (d, E) matrix (a layer "
                             "axis aside)")
    count, width = structure.routers.get(path), structure.width
    hits = [a for a in rest if count is not None and shape[a] == count]
    if len(hits) == 1:
        return next(a for a in rest if a != hits[0]), hits[0]
    wide = [a for a in rest if width is not None and shape[a] == width]
    if len(wide) == 1:
        return wide[0], next(a for a in rest if a != wide[0])
    name = naming_path(path)[-1].lower() if path else ""
    if name in ("weight", "weights"):
        return rest[1], rest[0]  # PyTorch-style (E, d)
    if name in ("kernel", "w") or name in DEFAULT_ROUTER_NAMES:
        return rest[0], rest[1]  # Flax-style (d, E)
    raise StructureError(f"cannot tell the expert axis of router {'/'.join(path)} {shape} (no "
                         "expert count, no model width, a leaf name that says no layout)")
