"""What the names in a parameter path say: wrappers, blocks, position tables, experts, routers,
biases. Whole components only, case-insensitive; shapes are never read here.

The name sets are data in `rowgeom._names`; these predicates are the rules that read them, used
by the labels (`rowgeom._labels`) and the model structure (`rowgeom._structure`).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

from rowgeom._names import (
    BIAS_LEAF,
    BLOCK_CONTAINER_NAMES,
    CONTAINER_SUFFIXES,
    EXPERT_MODULE,
    GENERIC_LEAF_NAMES,
    MATRIX_LEAF_NAMES,
    NORM_MODULE,
    POSITION_EMBEDDING_NAMES,
    POSITION_WORD,
    WRAPPER_SUFFIXES,
)
from rowgeom._tree import Path

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
        if c.isdigit():
            if i == 0:
                continue  # a list of modules at the root (sequential), not a block container
            return i, False
        if _numbered_block(c):
            return i, False
        if is_container(c):
            return (i + 1, False) if path[i + 1].isdigit() else (i, True)
    return None


def is_position_embedding(path: Sequence[str]) -> bool:
    """Whether a path names a position table: a component in `POSITION_EMBEDDING_NAMES`, or one
    whose ``_``-separated words include a position word (``pos``, ``position``,
    ``positional``, ``posembed``, ``pos``/``position`` + ``embed...``), so ``W_pos`` and
    ``abs_pos_emb`` are, ``composer``, ``purpose`` and ``transposed_proj`` are not."""
    for component in path:
        c = component.lower()
        if c in POSITION_EMBEDDING_NAMES or any(POSITION_WORD.fullmatch(w) for w in c.split("_")):
            return True
    return False


def is_expert_component(component: str) -> bool:
    """A component naming an MoE module or its experts (``experts``, ``MoeBlock_0``); not a
    shared expert (a dense MLP every token uses) nor a block container (``moe_layers``)."""
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


def module_index(path: Sequence[str]) -> int:
    """Length of a leaf's module path: ``gate/kernel`` -> 1 (the storage name is no module)."""
    nm = naming_path(path)
    return len(nm) - (2 if len(nm) > 1 and nm[-1].lower() in GENERIC_LEAF_NAMES else 1)


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
