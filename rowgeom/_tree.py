"""Parameter paths: the one tree walker behind labels, transforms, the recipe and the tracker.

Contract (the layout page, docs/architecture.md, shows who uses what):

- A **path** is a tuple of ``str``, one per key (`key_name`): ``("lm_head", "kernel")``. It is
  shown ``"/"``-joined (`path_str`), the form every rowgeom message and mapping key uses.
- **Flax boxes** (``nnx.Variable``, Linen ``nn.Partitioned``) are transparent: a boxed leaf has
  the path of the parameter, never an extra ``value`` component, so the ``nnx.State`` of
  Variables that ``nnx.Optimizer`` hands ``tx.init`` and the plain arrays it hands ``tx.update``
  have the same paths. Flax is never imported here; its box types are recognised only when the
  caller already loaded it.
- **Masked** leaves (`is_masked`: ``None`` and ``optax.MaskedNode``, what ``optax.partition`` and
  ``optax.masked`` put where a transform must not act) are leaves wherever a transform walks.
- A **per-leaf option** (labels, ``vocab_axis``, Muon dimension numbers, the routing a test
  expects) has one semantics everywhere (`resolve_per_leaf`): one value for every leaf, a
  callable ``tree -> option``, or a tree matched by path — nested like the parameters, flat with
  ``"/"``-joined keys, or a mix, since a key's ``"/"`` separates components — whose entry at a
  path covers every leaf below it (the longest prefix wins). An entry that covers no leaf is an
  error naming it (a typo must not silently do nothing).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
import optax

from rowgeom._validation import check_int

Path = tuple[str, ...]


def key_name(key) -> str:
    """One path component: ``DictKey``'s key, ``GetAttrKey``'s name, ``SequenceKey``'s index."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _components(keys) -> Path:
    """The path of a key path: one component per key, a key's ``"/"`` splitting it further."""
    return tuple(part for key in keys for part in key_name(key).split("/"))


def path_str(path: Path) -> str:
    """``"lm_head/kernel"``: a path as every message and mapping key shows it."""
    return "/".join(path)


def path_repr(path: Path) -> str:
    """``"['lm_head']['kernel']"``: a path in the indexing form of the transforms' errors."""
    return "".join(f"[{name!r}]" for name in path)


def is_masked(x) -> bool:
    """Whether a transform leaves this leaf untouched: ``None`` or ``optax.MaskedNode()``."""
    return x is None or isinstance(x, optax.MaskedNode)


# --- Flax boxes ---------------------------------------------------------------------------------


def box_types() -> tuple[type, ...]:
    """Flax's parameter boxes, if Flax is loaded (a tree cannot hold them otherwise)."""
    types = []
    variablelib = sys.modules.get("flax.nnx.variablelib")
    if variablelib is not None:
        types.append(variablelib.Variable)
    meta = sys.modules.get("flax.core.meta")
    if meta is not None:
        types.append(meta.AxisMetadata)
    return tuple(types)


def is_box(x) -> bool:
    """Whether `x` is a Flax box (``nnx.Variable``, Linen ``AxisMetadata``)."""
    boxes = box_types()
    return bool(boxes) and isinstance(x, boxes)


def unbox(x: Any, boxes: tuple[type, ...] | None = None) -> Any:
    """The array (or ShapeDtypeStruct, or label) inside a Flax box; `x` itself otherwise."""
    boxes = box_types() if boxes is None else boxes
    if not (boxes and isinstance(x, boxes)):
        return x
    box: Any = x  # a Variable (get_value), a Linen box (unbox) or an older Variable (value)
    if hasattr(box, "get_value"):
        return box.get_value()
    if hasattr(box, "unbox"):
        return box.unbox()
    return box.value


def leaf_shape(x) -> tuple[int, ...]:
    """Shape of a leaf, a Flax box's content or a ShapeDtypeStruct (values are never read)."""
    x = unbox(x)
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else np.shape(x)


# --- The walker ---------------------------------------------------------------------------------


def flatten_with_paths(tree, *, open_boxes: bool = False,
                       is_leaf: Callable[[Any], bool] | None = None):
    """``([(path, leaf)], treedef)`` in tree order; the one walk every module uses.

    With ``open_boxes=False`` a Flax box is one leaf (labels name a parameter as a whole); with
    ``open_boxes=True`` the walk goes on into it, as ``jax.tree`` does, and ``treedef`` is
    ``jax.tree.structure(tree, is_leaf=is_leaf)`` (a transform rebuilds the tree it was given),
    each leaf inside a box carrying the box's path. `is_leaf` adds leaves (e.g. `is_masked`).
    """
    boxes = box_types()
    extra = is_leaf if is_leaf is not None else (lambda x: False)
    outer, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: extra(x) or (bool(boxes) and isinstance(x, boxes)))
    named = [(_components(keys), leaf) for keys, leaf in outer]
    if not open_boxes or not any(boxes and isinstance(x, boxes) for _, x in named):
        return named, treedef
    opened: list[tuple[Path, Any]] = []
    for path, leaf in named:
        inner = (jax.tree.leaves(leaf, is_leaf=is_leaf) if isinstance(leaf, boxes)
                 and not extra(leaf) else [leaf])
        opened.extend((path, x) for x in inner)
    return opened, jax.tree.structure(tree, is_leaf=is_leaf)


def tree_paths(tree) -> list[tuple[Path, Any]]:
    """``[(path, leaf)]`` with Flax boxes as leaves (not unboxed)."""
    return flatten_with_paths(tree)[0]


def map_with_paths(fn: Callable[..., Any], tree, *, open_boxes: bool = False,
                   is_leaf: Callable[[Any], bool] | None = None):
    """``fn(path, leaf)`` on every leaf of `tree` (`flatten_with_paths`), same structure out."""
    leaves, treedef = flatten_with_paths(tree, open_boxes=open_boxes, is_leaf=is_leaf)
    return jax.tree_util.tree_unflatten(treedef, [fn(path, leaf) for path, leaf in leaves])


# --- Per-leaf options matched by path ----------------------------------------------------------


def prefix_entries(prefix, *, is_entry: Callable[[Any], bool] | None = None) -> dict[Path, Any]:
    """``{path: entry}`` of a prefix tree, its Flax boxes unboxed; `is_entry` stops the walk."""
    boxes = box_types()
    return {path: unbox(x, boxes) for path, x in flatten_with_paths(prefix, is_leaf=is_entry)[0]}


def lookup_prefix(table: Mapping[Path, Any], path: Path) -> tuple[bool, Any]:
    """``(found, value)`` for the longest prefix of `path` in `table` (whole components)."""
    for n in range(len(path), -1, -1):
        if path[:n] in table:
            return True, table[path[:n]]
    return False, None


def unmatched(entries: Iterable[Path], paths: Iterable[Path]) -> list[str]:
    """The entries (``"/"``-joined) that are no prefix of any of `paths`: a typo, not a no-op."""
    paths = list(paths)
    return [path_str(k) for k in entries if not any(p[:len(k)] == k for p in paths)]


def resolve_per_leaf(option, paths: list[Path], *, is_value: Callable[[Any], bool],
                     argname: str) -> list[tuple[bool, Any]]:
    """``(found, value)`` of a per-leaf option for each of `paths` (the module docstring).

    `option` is one value (``is_value(option)``), or a tree of values matched by path; call a
    callable option on the tree first. Paths no entry covers get ``(False, None)``: the caller
    decides whether that is an error. Entries that cover none of `paths` raise, naming them.
    """
    if is_value(option):
        return [(True, option)] * len(paths)
    entries = prefix_entries(option, is_entry=is_value)
    unknown = unmatched(entries, paths)
    if unknown:
        leaves = sorted(path_str(p) for p in paths)
        more = f" and {len(leaves) - 8} more" if len(leaves) > 8 else ""
        raise ValueError(f"{argname} names {unknown}, which are not in the tree (its leaves: "
                         f"{leaves[:8]}{more})")
    return [lookup_prefix(entries, path) for path in paths]


# --- Per-leaf vocabulary axes (the head transforms and the tracker) ---------------------------


def _check_axis_value(ax):
    if ax is None:
        return None
    if isinstance(ax, jax.core.Tracer):
        raise TypeError("vocab_axis must be a static int, got a traced value; under "
                        "optax.inject_hyperparams pass static_args=('vocab_axis', ...)")
    return check_int(ax, argname="vocab_axis", minimum=-(2**31))


def vocab_axes(vocab_axis, tree):
    """Broadcasts ``vocab_axis`` to one ``int | None`` per leaf of ``tree``.

    ``vocab_axis`` is a per-leaf option (`resolve_per_leaf`): an int (every leaf), ``None`` (no
    leaf), a tree or flat ``"/"``-keyed mapping with ints / ``None`` at its leaves, or a callable
    ``tree -> such a tree`` (like optax masks). A leaf under no entry gets ``None`` (left
    unchanged, never a guessed axis), e.g. ``{"lm_head/kernel": 1}`` on a whole model.
    """
    if callable(vocab_axis):
        vocab_axis = vocab_axis(tree)
    leaves, treedef = flatten_with_paths(tree, open_boxes=True, is_leaf=is_masked)
    is_value = lambda ax: ax is None or not isinstance(ax, Mapping | list | tuple) \
        or isinstance(ax, optax.MaskedNode)
    per_leaf = resolve_per_leaf(vocab_axis, [p for p, _ in leaves], is_value=is_value,
                                argname="vocab_axis")
    axes = []
    for (path, _), (_, ax) in zip(leaves, per_leaf, strict=True):
        try:
            # A masked entry (a partition's callable sees MaskedNode leaves): not a head leaf.
            axes.append(None if is_masked(ax) else _check_axis_value(ax))
        except (TypeError, ValueError) as err:
            raise type(err)(f"vocab_axis at {path_str(path) or '<root>'}: {err}") from None
    return jax.tree_util.tree_unflatten(treedef, axes)


def map_head_leaves(fn, skip, tree, axes):
    """``fn(leaf, axis)`` on every leaf with an axis (`vocab_axes`); ``skip(leaf)`` elsewhere.

    Errors from ``fn`` are re-raised with the leaf's path, so a user sees which parameter failed.
    """
    leaves, treedef = flatten_with_paths(tree, open_boxes=True, is_leaf=is_masked)

    def apply(path, leaf, ax):
        if is_masked(leaf) or ax is None:
            return skip(leaf)
        try:
            return fn(leaf, ax)
        except (TypeError, ValueError) as err:
            raise type(err)(f"leaf {path_repr(path)}: {err}") from None

    out = [apply(path, leaf, ax)
           for (path, leaf), ax in zip(leaves, treedef.flatten_up_to(axes), strict=True)]
    return jax.tree_util.tree_unflatten(treedef, out)
