"""What a language model's parameter tree says about the model, and every axis read from it.

Names say what a parameter is for, shapes how big the model is; the labels and the plan use
both, so a name that contradicts the shapes is an error, not a silently wrong geometry. Every
axis is inferred here: ``V`` and ``d`` (`find_vocab`), the layer axes of stacks (`find_stacks`),
routers, expert stacks and ``E`` (`find_experts`), Muon's matrix axes (`muon_axes`), the head's
vocabulary axis and a router's axes. Where the shapes do not decide, `StructureError` carries
the likely reading (`rowgeom._messages` writes it). The rules with examples: docs/guides/labels.md.
"""

from __future__ import annotations

import itertools
import re
import types
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

from rowgeom._muon import MuonDimensionNumbers, as_dimension_numbers, is_dimension_numbers
from rowgeom._names import (
    BIAS_LEAF,
    BLOCK_CONTAINER_NAMES,
    CONTAINER_SUFFIXES,
    DEFAULT_ROUTER_NAMES,
    EXPERT_MODULE,
    GENERIC_LEAF_NAMES,
    GPT2_CONV1D_NAMES,
    MATRIX_LEAF_NAMES,
    NORM_MODULE,
    OUT_IN_LEAF_NAMES,
    POSITION_EMBEDDING_NAMES,
    POSITION_WORD,
    TOKEN_EMBEDDING_NAMES,
    VOCAB_AXIS_BY_LEAF_NAME,
    WRAPPER_SUFFIXES,
)
from rowgeom._tree import Path, is_masked, path_str, resolve_per_leaf, tree_paths

# --- What the names in a parameter path say: wrappers, blocks, position tables, experts, routers,
# biases (the name sets of `rowgeom._names`). Whole components only, case-insensitive; shapes are
# never read here.

_NUMBERED = re.compile(r"^(?P<base>.*?)_?(?P<index>\d+)$")


def naming_path(path: Sequence[str]) -> Path:
    """`path` without the wrapper components at its end (`rowgeom._names.WRAPPER_SUFFIXES`)."""
    path = tuple(path)
    for suffix in WRAPPER_SUFFIXES:
        if tuple(c.lower() for c in path[-len(suffix):]) == suffix:
            return path[:-len(suffix)]
    return path


def is_nameless(path: Sequence[str]) -> bool:
    """Whether a path carries no name at all (``(3, 'value', 'data_array')``: penzai's tuple)."""
    return all(c.isdigit() for c in naming_path(path))


def is_container(component: str) -> bool:
    """Whether a component holds repeated blocks (``layers``, ``h``, ``*_layers``, ...)."""
    c = component.lower()
    return c in BLOCK_CONTAINER_NAMES or c.endswith(CONTAINER_SUFFIXES)


def _numbered_block(component: str) -> bool:
    """``layers_0``, ``encoderdecoderblock_2``, ``x_layers_1``: one unrolled block."""
    match = _NUMBERED.match(component)
    if match is None:
        return False
    base = match["base"]
    return is_container(base) or "block" in base or base.endswith(("layer", "layers"))


def block_position(path: Sequence[str]) -> tuple[int, bool] | None:
    """(index of the component that starts a repeated block, whether it is a stack), or None.

    ``layers/0/...``, ``h/0/...``, ``layers_0/...``, ``encoderdecoderblock_0/...``: an unrolled
    block. ``layers/attn/...`` (a container name followed by no number): a stack of layers.
    """
    path = naming_path(path)
    for i, component in enumerate(path[:-1]):
        c = component.lower()
        # (a number at the root is a list of modules, sequential, not a block container)
        if (c.isdigit() and i > 0) or _numbered_block(c):
            return i, False
        if is_container(c):
            return (i + 1, False) if path[i + 1].isdigit() else (i, True)
    return None


def is_position_embedding(path: Sequence[str]) -> bool:
    """Whether a path names a position table: a component in `POSITION_EMBEDDING_NAMES`, or one
    whose ``_``-separated words include a position word (``pos``, ``position``,
    ``positional``, ``posembed``, ``pos``/``position`` + ``embed...``), so ``W_pos`` and
    ``abs_pos_emb`` are, ``composer``, ``purpose`` and ``transposed_proj`` are not."""
    return any(c.lower() in POSITION_EMBEDDING_NAMES
               or any(POSITION_WORD.fullmatch(w) for w in c.lower().split("_")) for c in path)


def is_expert_component(component: str) -> bool:
    """A component naming an MoE module or its experts (``experts``, ``MoeBlock_0``); not a
    shared expert (a dense MLP every token uses) nor a block container (``moe_layers``)."""
    c = component.lower()
    return bool(EXPERT_MODULE.search(c)) and not c.startswith("shared") and not is_container(c)


def module_index(path: Sequence[str]) -> int:
    """Length of a leaf's module path: ``gate/kernel`` -> 1 (the storage name is no module)."""
    nm = naming_path(path)
    return len(nm) - (2 if len(nm) > 1 and nm[-1].lower() in GENERIC_LEAF_NAMES else 1)


def router_index(path: Sequence[str], router_names: Collection[str]) -> int | None:
    """Index of the component naming a router (``gate/kernel`` -> the ``gate``), or None."""
    nm = naming_path(path)
    if nm and nm[-1].lower() in router_names:
        return len(nm) - 1
    k = module_index(path)
    return k if k < len(nm) - 1 and nm[k].lower() in router_names else None


def is_vector_name(path: Sequence[str], vector_names: Collection[str]) -> bool:
    """Whether a leaf's names make it a vector whatever its rank: its own name is in
    `vector_names`, ends in ``_bias`` or is a bias (``b``, TransformerLens's per-head ``b_Q``
    ``(n_heads, d_head)``, ``b_in``), or its module is a norm and it is no kernel."""
    names = naming_path(path)
    if not names:
        return False
    leaf = names[-1].lower()
    if leaf in vector_names or leaf.endswith("_bias") or BIAS_LEAF.fullmatch(leaf):
        return True
    return len(names) > 1 and bool(NORM_MODULE.search(names[-2].lower())) \
        and leaf not in MATRIX_LEAF_NAMES


# --- Mixture-of-experts modules: which leaves are routers and expert stacks, and the expert count.
#
# A **mixture-of-experts module** holds a **router** (named in the labeler's router names, or an
# unnamed ``(d, E)`` matrix) and **expert stacks**: its leaves with three or more axes besides the
# layer axis (``(E, d, f)``, MaxText's scanned ``(E, L, d, f)``), or leaves under an
# ``experts``/``*moe*`` component. The expert count ``E`` is the router's axis other than ``d``
# that every expert stack has (or the number of numbered experts ``experts/0``, ``experts/1``...).
# A dense MLP's ``gate`` ``(d, f)``, with no expert stack beside it, is no router. Which axis of a
# stack indexes the experts (its one axis of size ``E``) is read with the matrix axes (`muon_axes`).

def _numbered_experts(paths, module: Path) -> int | None:
    """The number of numbered experts (``experts/0``, ``experts/1``, ...) under a module."""
    indices = {int(i) for path in paths for name, i in itertools.pairwise(path[len(module):])
               if name.lower() in ("experts", "expert") and i.isdigit()}
    return len(indices) if indices and indices == set(range(len(indices))) else None


class _MatrixLeaves:
    """The rank >= 2 leaves `find_experts` reads: shapes, labels and axes besides a layer axis."""

    def __init__(self, entries, width: int | None, stacks: Mapping):
        self.entries = [(tuple(p), tuple(s), lb) for p, s, lb in entries if len(s) >= 2]
        self.axes = {p: unstacked_axes(p, s, stacks) for p, s, _ in self.entries}
        self.shapes = {p: s for p, s, _ in self.entries}
        self.labels = {p: lb for p, _, lb in self.entries}
        self.width = width
        self.may_expert = [p for p, _, lb in self.entries
                           if lb in ("hidden", None) and len(self.axes[p]) >= 3]

    def stacks_under(self, module: Path, skip) -> list[Path]:
        """The possible expert stacks of a module (its shared experts excluded)."""
        return [p for p in self.may_expert if p[:len(module)] == module and p not in skip
                and not any(c.lower().startswith("shared") for c in p[len(module):])]

    def router_sizes(self, path) -> set[int]:
        """A router's possible expert counts: its sizes other than one of ``d``."""
        sizes = [self.shapes[path][a] for a in self.axes[path]]
        if self.width is not None and sizes.count(self.width) == 1:
            return {s for s in sizes if s != self.width}
        return set(sizes)

    def count_for(self, router, members, module) -> int | None:
        """The expert count a router and the stacks beside it agree on (or numbered experts)."""
        sizes = self.router_sizes(router)
        if members:
            common = {e for e in sizes if all(any(self.shapes[m][a] == e for a in self.axes[m])
                                              for m in members)}
            if len(common) == 1:
                return common.pop()
        numbered = _numbered_experts(list(self.shapes), module)
        return numbered if numbered in sizes else None

    def common_sizes(self, members) -> set[int]:
        """Sizes at one position in every stack (the expert axis; f changes places in wo)."""
        ranks = {len(self.axes[m]) for m in members}
        if len(ranks) != 1:
            return set()
        first = members[0]
        sizes = {self.shapes[first][self.axes[first][i]] for i in range(ranks.pop())
                 if len({self.shapes[m][self.axes[m][i]] for m in members}) == 1}
        return sizes - {self.width}

    def beside(self, p: Path, module: Path, skip) -> bool:
        """A direct child leaf of the MoE module or of its parent."""
        for outer in (module, module[:-1]):
            rel = naming_path(p)[len(outer):]
            if p[:len(outer)] == outer and p not in skip and (
                    len(rel) == 1 or (len(rel) == 2 and rel[-1].lower() in GENERIC_LEAF_NAMES)):
                return True
        return False


def _named_routers(leaves: _MatrixLeaves, router_names, movable) -> dict[Path, list[Path]]:
    """``{module: [router candidates]}``: matrices labelled ``"router"`` or named as one."""
    by_module: dict[Path, list[Path]] = {}
    for path, _, label in leaves.entries:
        if len(leaves.axes[path]) != 2:
            continue
        k = router_index(path, router_names)
        if label == "router" and k is None:
            k = module_index(path)
        if k is not None and (label == "router" or (label in ("hidden", None) and movable(path))):
            by_module.setdefault(path[:k], []).append(path)
    return by_module


def _shaped_router(leaves: _MatrixLeaves, module, members, movable):
    """``(router or None, E or None)`` of expert stacks with no named router: the one unnamed
    ``(d, E)`` matrix beside them whose ``E`` they share."""
    sizes, skip, width = leaves.common_sizes(members), set(members), leaves.width
    shaped = [p for p, _, lb in leaves.entries if leaves.beside(p, module, skip)
              and lb in ("hidden", None) and movable(p) and len(leaves.axes[p]) == 2
              and width is not None and width in [leaves.shapes[p][a] for a in leaves.axes[p]]
              and leaves.router_sizes(p) & sizes]
    if len(shaped) == 1 and len(common := leaves.router_sizes(shaped[0]) & sizes) == 1:
        return shaped[0], common.pop()
    return None, None


def find_experts(entries, width: int | None, stacks: Mapping, router_names: Collection[str],
                 movable: Callable[[Path], bool]):
    """``(experts, routers)``: expert-stack leaf -> ``E``, router leaf -> ``E`` (section comment)
    of ``(path, shape, label)`` entries; only leaves labelled ``"router"``, or ``"hidden"``/None
    and `movable`, may become routers."""
    leaves = _MatrixLeaves(entries, width, stacks)
    routers: dict[Path, int | None] = {}
    experts: dict[Path, int | None] = {}
    for module, candidates in _named_routers(leaves, router_names, movable).items():
        members = leaves.stacks_under(module, set(candidates))
        for router in candidates:
            count = leaves.count_for(router, members, module)
            if count is not None or leaves.labels[router] == "router":
                routers[router] = count
            if count is not None:
                experts.update((m, count) for m in members)
    # Expert stacks under an experts/moe component and no named router beside them: a router
    # by its (d, E) shape alone, else an expert count nobody can tell.
    for path in leaves.may_expert:
        marks = [i for i, c in enumerate(path[:-1]) if is_expert_component(c)]
        if path in experts or not marks:
            continue
        module = path[:marks[-1] + 1]
        members = leaves.stacks_under(module, set(routers))
        if members:
            router, count = _shaped_router(leaves, module, members, movable)
            if router is not None:
                routers[router] = count
            experts.update((m, count) for m in members)
    return experts, routers


_EMPTY: Mapping = types.MappingProxyType({})


class ModelStructure(NamedTuple):
    """What the shapes say about a parameter tree (see the module docstring). Read-only.

    ``vocab_size``/``width``: ``V`` and ``d`` (None when no embedding or head was found);
    ``source``: the path they were read from; ``stacks``: stack prefix -> (layer axis, L);
    ``experts``: expert-stack leaf path -> expert count ``E`` (None: not decided);
    ``routers``: router leaf path -> ``E`` (None: not decided); ``router_names``: the names
    that mean a router (the labeler's); ``vectors``: ``(path, shape)`` of the norm scales and
    biases; ``out_in_modules``: module names whose ``kernel`` this tree stores ``(out, in)``
    (`out_in`).
    """

    vocab_size: int | None
    width: int | None
    source: tuple[str, ...] | None
    stacks: Mapping[tuple[str, ...], tuple[int, int] | None] = _EMPTY
    experts: Mapping[tuple[str, ...], int | None] = _EMPTY
    routers: Mapping[tuple[str, ...], int | None] = _EMPTY
    router_names: frozenset[str] = DEFAULT_ROUTER_NAMES
    vectors: tuple[tuple[Path, tuple[int, ...]], ...] = ()
    out_in_modules: frozenset[str] = frozenset()


def find_vocab(embeddings, heads) -> tuple[int | None, int | None, tuple | None]:
    """``(V, d, path)`` from the token embedding ``(V, d)``, else a head matrix (larger axis V),
    of the ``(path, shape)`` of rank-2 leaves."""
    tokens = ([(p, s) for p, s in embeddings if any(c.lower() in TOKEN_EMBEDDING_NAMES for c in p)]
              or [(p, s) for p, s in embeddings if not is_position_embedding(p)])
    if tokens:
        path, shape = max(tokens, key=lambda e: e[1][0])
        if sum(s[0] == shape[0] for _, s in tokens) > 1:
            path = None  # several equally large tables: V and d are known, which one is not
        return shape[0], shape[1], path
    if heads:
        path, shape = heads[0]
        return max(shape), min(shape), path
    return None, None, None


# --- Layer stacks -------------------------------------------------------------------------------

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
    return {f for f in found if f[1] != width}


def vector_layers(shape, width) -> tuple[int, int] | None:
    """``(axis, L)`` of a stacked vector ``(L, d)`` / ``(d, L)``; None for any other shape."""
    if width is None or len(shape) != 2 or list(shape).count(width) != 1:
        return None
    axis = 1 - shape.index(width)
    return axis, shape[axis]


def _stacked_norms(leaves, width, vectors) -> set:
    """``{(axis, L)}`` read off the stacked vectors of a container."""
    return {vector_layers(s, width) for p, s in leaves if p in vectors} - {None}


def _no_layer_axis(leaves) -> bool:
    """A vector without a layer axis, or no stacked matrix: these leaves are no stack."""
    return any(len(s) < 2 for _, s in leaves) or all(len(s) < 3 for _, s in leaves)


def find_stacks(entries, width: int | None, vectors: Collection[Path]) -> dict:
    """``{stack prefix: (axis, L) or None}`` (None: not determinable) of every stack of scanned
    layers, named or structural, among ``(path, shape)`` entries: read off its norm scales
    (`vectors`: ``(L, d)``, or MaxText's ``(d, L)``), else the one leading axis its leaves share."""
    members: dict[tuple[str, ...], list] = {}
    for path, shape in entries:
        pos = block_position(path)
        if pos is not None and pos[1]:
            members.setdefault(tuple(path[:pos[0] + 1]), []).append((path, shape))
    stacks: dict[tuple[str, ...], tuple[int, int] | None] = {}
    for prefix, leaves in members.items():
        if _no_layer_axis(leaves):
            stacks[prefix] = NOT_STACKED
            continue
        found = _stacked_norms(leaves, width, vectors)
        if len(found) != 1:
            found = _common_leading_axis(leaves, width)
        stacks[prefix] = found.pop() if len(found) == 1 else None
    stacks.update(_structural_stacks(entries, width, vectors, stacks))
    return stacks


def _structural_stacks(entries, width, vectors, named) -> dict:
    """Containers whose leaves all carry one layer axis, whatever their names: several modules
    (no expert module), one leading axis ``L != d`` (0 or 1) on every leaf, a stacked norm scale
    ``(L, d)`` or ``(d, L)`` and a stacked matrix among them."""
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
        if len(modules) < 2 or any(is_expert_component(c) for c in prefix) \
                or _no_layer_axis(leaves):
            continue  # a stack holds several modules; experts' (E, f) biases are no layers
        norms = _stacked_norms(leaves, width, vectors)
        if len(norms) == 1 and norms <= _common_leading_axis(leaves, width):
            found[prefix] = norms.pop()
    return found


def stack_of(path: Sequence[str], stacks: Mapping) -> tuple[tuple[str, ...], Any] | None:
    """``(stack prefix, (layer axis, L) or None)`` for a leaf of a stack; None otherwise."""
    path = tuple(path)
    for n in range(1, len(path)):
        info = stacks.get(path[:n], NOT_STACKED)
        if info != NOT_STACKED:
            return path[:n], info
    return None


def in_blocks(path: Sequence[str], stacks: Mapping) -> bool:
    """Whether a leaf sits inside the repeated blocks (unrolled, named stack or structural)."""
    return block_position(path) is not None or stack_of(path, stacks) is not None


def layer_axis(path, shape, stacks: Mapping, *, min_rank: int = 3,
               where: str | None = None) -> int | None:
    """The layer axis of a leaf of rank >= `min_rank` in a stack, if it has one; given `where`
    (the leaf as a message names it), a leaf of a stack without one is a StructureError."""
    stack = stack_of(path, stacks)
    if stack is None or len(shape) < min_rank:
        return None
    prefix, info = stack
    if info is not None and shape[info[0]] == info[1]:
        return info[0]
    if where is None:
        return None
    from rowgeom._messages import no_layer_axis  # error text: not on the optimizer's path

    raise no_layer_axis(where, prefix, info)


def unstacked_axes(path, shape, stacks: Mapping, *, min_rank: int = 3,
                   where: str | None = None) -> list[int]:
    """The axes of a leaf other than its layer axis (when it has one; `layer_axis`)."""
    layer = layer_axis(path, shape, stacks, min_rank=min_rank, where=where)
    return [a for a in range(len(shape)) if a != layer]


def model_structure(leaves, *, router_names: Collection[str] = DEFAULT_ROUTER_NAMES,
                    movable: Callable[[Path], bool] = lambda p: False) -> ModelStructure:
    """V, d, layer stacks, experts and routers of labelled leaves ``(path, shape, label, ...)``
    (V and d from the ``"embedding"``/``"head"`` leaves, norm scales and biases ``"vector"``);
    `movable(path)`: whether a ``"hidden"`` (or None) label may still become a router."""
    leaves = [(tuple(p), tuple(s), lb) for p, s, lb, *_ in leaves]
    rank2 = lambda lab: [(p, s) for p, s, lb in leaves if lb == lab and len(s) == 2]
    vocab, width, source = find_vocab(rank2("embedding"), rank2("head"))
    vectors = tuple((p, s) for p, s, lb in leaves if lb == "vector")
    stacks = find_stacks([(p, s) for p, s, _ in leaves], width, {p for p, _ in vectors})
    names = frozenset(router_names)
    experts, routers = find_experts(leaves, width, stacks, names, movable)
    return ModelStructure(vocab, width, source, types.MappingProxyType(stacks),
                          types.MappingProxyType(experts), types.MappingProxyType(routers),
                          names, vectors, _conv1d_out_in(leaves, width))


def _conv1d_out_in(leaves, width: int | None) -> frozenset[str]:
    """`GPT2_CONV1D_NAMES` when a fused ``c_attn`` kernel of the tree is ``(3d, d)`` (Hugging
    Face's Flax GPT-2), else none: only the fused projection's shape tells the two apart."""
    for path, shape, _ in leaves:
        names = [c.lower() for c in naming_path(path)[-2:]]
        if width and names == ["c_attn", "kernel"] and shape[-2:] == (3 * width, width):
            return GPT2_CONV1D_NAMES
    return frozenset()


# --- Matrix axes --------------------------------------------------------------------------------


class StructureError(ValueError):
    """A shape-based inference the shapes do not decide (the message names the leaf), with the
    likely ``(reduction_axes, output_axes)`` for an error to offer (``suggestion``, or None) and
    the batch axes that reading assumes (``roles``: ``{axis: "experts" | "layers"}``)."""

    def __init__(self, message: str, suggestion: tuple | None = None,
                 roles: dict[int, str] | None = None):
        super().__init__(message)
        self.suggestion = suggestion
        self.roles = roles or {}


def batch_roles(path, shape, structure: ModelStructure) -> dict[int, str]:
    """``{axis: "layers" | "experts"}`` of the batch axes `muon_axes` takes out of a leaf."""
    rest = unstacked_axes(path, shape, structure.stacks)
    roles = {a: "layers" for a in range(len(shape)) if a not in rest}
    hits = [a for a in rest if shape[a] == structure.experts.get(tuple(path))]
    if len(rest) >= 3 and len(hits) == 1:
        roles[hits[0]] = "experts"
    return roles


def batch_axes(dims: Any, ndim: int) -> tuple[int, ...]:
    """The axes of a rank-`ndim` leaf that `dims` (reduction, output) leaves as a batch."""
    used = {a for side in (dims.reduction_axis, dims.output_axis)
            for a in ((side,) if isinstance(side, int) else side)}
    return tuple(a for a in range(ndim) if a not in used)


def norm_widths(path: Sequence[str], structure: ModelStructure) -> set[int]:
    """Sizes of the norm scales in a leaf's module other than ``d`` (a low-rank projection's
    width, e.g. DeepSeek's ``kv_norm`` beside ``wkv_b``)."""
    names = naming_path(path)
    module = names[:-2] if len(names) > 2 and names[-1].lower() in GENERIC_LEAF_NAMES \
        else names[:-1]
    sizes = ([vshape[a] for a in unstacked_axes(vpath, vshape, structure.stacks, min_rank=2)]
             for vpath, vshape in structure.vectors if vpath[:len(module)] == module)
    return {rest[0] for rest in sizes if len(rest) == 1 and rest[0] != structure.width}


def width_split(shape, rest, width, features) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The rank >= 3 rule: the one axis of size d (else of a feature size) against the rest,
    as fan-in unless it is the last axis (only the "spectral"/"keller" scales tell)."""
    for sizes in ([width], features):
        wide = [a for a in rest if shape[a] in sizes]
        if len(wide) == 1:
            others = tuple(a for a in rest if a != wide[0])
            return (others, (wide[0],)) if wide[0] == rest[-1] else ((wide[0],), others)
        if wide:
            return None
    return None


def _without_expert_axis(path, shape, rest, structure, features, where) -> list[int]:
    """`rest` without an expert stack's expert axis (its one axis of size ``E``)."""
    if path not in structure.experts or len(rest) < 3:
        return rest
    hits = [a for a in rest if shape[a] == structure.experts[path]]
    if len(hits) == 1:
        return [a for a in rest if a != hits[0]]
    from rowgeom._messages import undecided_expert_axis  # error text: not on the optimizer's path

    raise undecided_expert_axis(path, shape, rest, structure, features, where)


def out_in(path: Sequence[str], structure: ModelStructure) -> bool:
    """Whether a matrix leaf is stored ``(out, in)``: a ``weight`` (`OUT_IN_LEAF_NAMES`), or a
    ``kernel`` of a module the tree stores that way (``structure.out_in_modules``)."""
    names = [c.lower() for c in naming_path(path)] or [""]
    return names[-1] in OUT_IN_LEAF_NAMES or (
        names[-1] == "kernel" and len(names) > 1 and names[-2] in structure.out_in_modules)


def muon_axes(path: Sequence[str], shape: Sequence[int], structure: ModelStructure):
    """``(reduction_axes, output_axes)`` of a matrix-like leaf, or StructureError naming it."""
    shape, path = tuple(shape), tuple(path)
    width, features = structure.width, norm_widths(path, structure)
    where = f"{'/'.join(path)} {shape}"
    rest = unstacked_axes(path, shape, structure.stacks, where=where)
    rest = _without_expert_axis(path, shape, rest, structure, features, where)
    if len(rest) == 2:  # fan-in first, unless the leaf is stored (out, in)
        fan_in, fan_out = rest[::-1] if out_in(path, structure) else rest
        return (fan_in,), (fan_out,)
    # Rank >= 3 (a layer axis aside): inside the repeated blocks, the one axis of size d.
    split = None
    if in_blocks(path, structure.stacks) and width is not None:
        split = width_split(shape, rest, width, features)
    if split is None:
        from rowgeom._messages import undecided_matrix_axes  # error text: not on the path

        raise undecided_matrix_axes(path, shape, rest, structure, features, where)
    return split


def head_vocab_axis(path: Sequence[str], shape: Sequence[int], vocab_size: int | None) -> int:
    """The vocabulary axis of a head leaf: its one axis of size ``V``, else by its name.

    A rank-2 leaf named ``kernel`` is a Flax ``(d, V)`` kernel (axis 1), ``embedding`` or
    ``weight`` a ``(V, d)`` table (axis 0). Anything else raises a ValueError naming it.
    """
    shape = tuple(shape)
    if vocab_size is not None and len(shape) == 2:
        axes = [a for a in (0, 1) if shape[a] == vocab_size]
        if len(axes) == 1:
            return axes[0]
    name = path[-1].lower() if path else ""
    if name in VOCAB_AXIS_BY_LEAF_NAME and len(shape) == 2:
        return VOCAB_AXIS_BY_LEAF_NAME[name]
    from rowgeom._messages import unknown_vocab_axis  # error text: not on the optimizer's path

    raise unknown_vocab_axis(path, shape, vocab_size)


def router_axes(path, shape, structure: ModelStructure, *, any_order: bool = False
                ) -> tuple[int, int]:
    """``(feature axis, expert axis)`` of a router: its two axes besides a layer axis, the
    expert axis of size ``E`` (else the one not of size ``d``; else by the leaf name: a
    PyTorch-style ``weight`` is ``(E, d)``, a ``kernel``, ``w`` or a router name of the
    structure's `router_names` Flax-style ``(d, E)``; else, with `any_order` (a Muon router:
    the polar factor does not depend on which side is which), its two axes in order)."""
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
    if name in ("kernel", "w") or name in structure.router_names or any_order:
        return rest[0], rest[1]  # Flax-style (d, E)
    raise StructureError(f"cannot tell the expert axis of router {'/'.join(path)} {shape} (no "
                         "expert count, no model width, a leaf name that says no layout)")


# --- Each planned leaf's axes: a hidden leaf's Muon matrix axes, a router's and a head's --------


def written_axes(axes: tuple[int, ...]):
    """Axes as `MuonDimensionNumbers` is written: one axis an int."""
    return axes[0] if len(axes) == 1 else tuple(axes)


def hidden_muon_dims(labelled, structure: ModelStructure, option: Any, tree: Any) -> dict:
    """``{path: MuonDimensionNumbers or None}`` of the ``"hidden"`` leaves of ``(path, shape,
    label, reason)``: inferred (`muon_axes`) unless `MuonOptions.dimension_numbers` (`option`)
    overrides them (``{"/"-joined path: dims}``) or gives them outright (anything else: every
    hidden leaf covered, None passes one through); every undecided leaf in one ValueError."""
    hidden = [(p, s) for p, s, label, _ in labelled if label == "hidden"]
    overrides = [(False, None)] * len(hidden)
    flat = isinstance(option, Mapping) and bool(option) and all(isinstance(k, str) for k in option)
    if flat and all(is_dimension_numbers(v) for v in option.values()):  # the rest inferred
        overrides = resolve_per_leaf(
            option, [p for p, _ in hidden], is_value=is_dimension_numbers,
            argname="MuonOptions.dimension_numbers (matched to the hidden parameters)")
    elif option is not None:  # given outright: nothing is inferred
        option = option(tree) if callable(option) else option
        paths = [p for p, _ in tree_paths(tree)]
        given = dict(zip(paths, resolve_per_leaf(
            option, paths, is_value=lambda d: is_masked(d) or is_dimension_numbers(d),
            argname="MuonOptions.dimension_numbers"), strict=True))
        overrides = [given[p] for p, _ in hidden]
        missing = [path_str(p) for p, _ in hidden if not given[p][0]]
        if missing:
            from rowgeom._messages import no_dimension_numbers  # error text: not on the path

            raise ValueError(no_dimension_numbers(missing))
    dims, undecided = {}, []
    for (path, shape), (found, value) in zip(hidden, overrides, strict=True):
        if found:
            dims[path] = as_dimension_numbers(value)
            continue
        try:
            red, out = muon_axes(path, shape, structure)
        except StructureError as err:
            undecided.append((path, shape, err, batch_roles(path, shape, structure)))
            continue
        dims[path] = MuonDimensionNumbers(written_axes(red), written_axes(out))
    if undecided:
        from rowgeom._messages import undecided_muon_axes  # error text: not on the path

        raise ValueError(undecided_muon_axes(undecided))
    return dims


def router_leaf_axes(path, shape, structure: ModelStructure, optimizer: str):
    """``(muon dims or None, expert axis or None, batch axes)`` of a router leaf trained by
    `optimizer` (`router_axes`; the expert axis is RowNorm's vocabulary axis)."""
    try:
        feature, expert = router_axes(path, shape, structure, any_order=optimizer != "rownorm")
    except StructureError as err:
        from rowgeom._messages import undecided_router_axes  # error text: not on the path

        raise ValueError(undecided_router_axes(optimizer, err)) from None
    batch = tuple(a for a in range(len(shape)) if a not in (feature, expert))
    if optimizer == "muon":
        return MuonDimensionNumbers(feature, expert), None, batch
    return None, (expert if optimizer == "rownorm" else None), batch


def head_leaf_axes(path, shape, structure: ModelStructure, optimizer: str,
                   vocab_axis: int | None):
    """``(muon dims or None, vocabulary axis)`` of a head leaf trained by `optimizer`: the given
    `vocab_axis`, else `head_vocab_axis`; a Muon head is one ``(d, V)`` or ``(V, d)`` matrix."""
    from rowgeom import _messages  # error text only (imported here: it imports this module)

    if optimizer == "muon" and len(shape) != 2:
        raise ValueError(_messages.muon_head_not_a_matrix(path, shape))
    axis = head_vocab_axis(path, shape, structure.vocab_size) if vocab_axis is None else vocab_axis
    if optimizer != "muon":
        return None, axis
    if not -2 <= axis < 2:
        raise ValueError(_messages.not_an_axis_of_the_head(axis, path, shape))
    vocab = axis % 2  # fan-out; the other axis, d, is fan-in
    return MuonDimensionNumbers(1 - vocab, vocab), axis
