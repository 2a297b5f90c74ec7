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

from rowgeom._tree import ROOT, flatten_with_paths, path_name, resolve_per_leaf, unbox


def leaves_with_paths(tree, *, keep_none: bool = False) -> list[tuple[str, object]]:
    """``[(path, leaf)]`` in tree order, Flax boxes unwrapped into their values."""
    flat, _ = flatten_with_paths(tree, is_leaf=(lambda x: x is None) if keep_none else None)
    return [(path_name(p), unbox(x)) for p, x in flat]


def components(path: str) -> tuple[str, ...]:
    return () if path == ROOT else tuple(path.split("/"))


def per_path(option, paths: list[str], *, argname: str, is_value=lambda v: not isinstance(
        v, Mapping)) -> list[tuple[bool, object]]:
    """``(found, value)`` of a per-leaf option for each ``"/"``-joined path: rowgeom's one
    semantics (`rowgeom._tree.resolve_per_leaf`: nested or flat mappings, longest prefix wins,
    an entry covering no path is an error naming it)."""
    return resolve_per_leaf(option, [components(p) for p in paths], is_value=is_value,
                            argname=argname)


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
    if isinstance(vocab_axis, (bool, np.bool_)) or not isinstance(
            vocab_axis, (int, np.integer, Mapping)):
        raise TypeError(f"{argname} must be an int or a mapping from paths to ints, "
                        f"got {vocab_axis!r}")
    per_leaf = per_path(vocab_axis, [p for p, _ in leaves], argname=argname,
                        is_value=lambda v: v is None or not isinstance(v, Mapping))
    selected = []
    for (path, leaf), (found, axis) in zip(leaves, per_leaf, strict=True):
        if not found or axis is None:
            continue
        if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
            raise TypeError(f"{argname} for {path!r} must be an int or None, got {axis!r}")
        selected.append((path, leaf, int(axis)))
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
