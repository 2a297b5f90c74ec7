"""Leaf paths for the assertions: ``"lm_head/kernel"`` for any tree a user holds.

A nested dict, an ``nnx.State`` of ``nnx.Variable`` (as ``nnx.state(model)`` returns it), the same
state as plain arrays and a Flax Linen ``{"params": ...}`` tree with boxed leaves all name a leaf
by the same ``"/"``-joined path, the form `rowgeom.label_params` uses in its messages: the paths
of ``rowgeom._tree``, shown as strings (`ROOT` for a bare array).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from rowgeom._tree import flatten_with_paths, lookup_prefix, path_str, unbox

ROOT = "(root)"
"""How the path of a bare array (a tree with one leaf and no keys) is shown."""


def leaves_with_paths(tree, *, keep_none: bool = False) -> list[tuple[str, object]]:
    """``[(path, leaf)]`` in tree order, Flax boxes unwrapped into their values."""
    flat, _ = flatten_with_paths(tree, is_leaf=(lambda x: x is None) if keep_none else None)
    return [(path_str(p) or ROOT, unbox(x)) for p, x in flat]


def components(path: str) -> tuple[str, ...]:
    return () if path == ROOT else tuple(path.split("/"))


def prefix_lookup(table: dict[str, object], path: str):
    """``(key, value)`` of the longest entry of `table` that is a whole-component prefix of
    `path` (``"layers"`` covers ``"layers/0/kernel"``, not ``"layers_norm/scale"``)."""
    found, key = lookup_prefix({components(k): k for k in table}, components(path))
    return (key, table[key]) if found else (None, None)


def per_leaf_axes(vocab_axis, tree, *, argname: str = "vocab_axis", rank=(2, None)):
    """``[(path, array, axis)]`` for the leaves of `tree` that `vocab_axis` selects.

    `vocab_axis` is an int (every leaf), or a mapping -- nested like the tree, or flat with
    ``"/"``-joined keys -- from paths to an int or None (None, or a leaf no entry covers: not
    checked). Every entry must cover some leaf and at least one leaf must be selected, so a
    misspelt path fails loudly instead of checking nothing. Every selected leaf must have a rank
    in ``rank = (min, max or None)`` and ``vocab_axis`` in range, checked before any is measured.
    """
    leaves = leaves_with_paths(tree)
    if not leaves:
        raise ValueError(f"the tree has no array leaves to check (got {type(tree).__name__})")
    if isinstance(vocab_axis, (bool, np.bool_)):
        raise TypeError(f"{argname} must be an int or a mapping from paths to ints, "
                        f"got {vocab_axis!r}")
    if isinstance(vocab_axis, (int, np.integer)):
        return _checked([(path, leaf, int(vocab_axis)) for path, leaf in leaves], rank, argname)
    if not isinstance(vocab_axis, Mapping):
        raise TypeError(f"{argname} must be an int or a mapping from paths to ints, "
                        f"got {type(vocab_axis).__name__}")
    table = dict(leaves_with_paths(vocab_axis, keep_none=True))
    for key, value in table.items():
        if value is not None and (isinstance(value, (bool, np.bool_))
                                  or not isinstance(value, (int, np.integer))):
            raise TypeError(f"{argname}[{key!r}] must be an int or None, got {value!r}")
    selected, used = [], set()
    for path, leaf in leaves:
        key, axis = prefix_lookup(table, path)
        if key is not None:
            used.add(key)
            if axis is not None:
                selected.append((path, leaf, int(axis)))
    unused = sorted(set(table) - used)
    if unused:
        raise ValueError(f"{argname} names paths with no leaf under them: {unused}; the tree's "
                         f"leaves are {[p for p, _ in leaves]}")
    if not selected:
        raise ValueError(f"{argname} selects no leaf of the tree (every entry is None)")
    return _checked(selected, rank, argname)


def _checked(selected, rank, argname):
    low, high = rank
    for path, leaf, axis in selected:
        shape = np.shape(leaf)
        if len(shape) < low or (high is not None and len(shape) > high):
            want = f"rank {low}" if high == low else f"rank >= {low}"
            raise ValueError(f"leaf {path!r}: expected an array of {want} with token rows along "
                             f"{argname}={axis}, got shape {shape}")
        if not -len(shape) <= axis < len(shape):
            raise ValueError(f"leaf {path!r}: {argname}={axis} is out of range for shape {shape}")
    return selected


def check_concrete(x, *, what: str):
    """Host value of `x` as a numpy array; a clear error for tracers (inside jit)."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"{what} is a JAX tracer: rowgeom.testing assertions read concrete values, so call "
            "them outside jax.jit / nnx.jit, on the step's outputs")
    return np.asarray(jax.device_get(x))
