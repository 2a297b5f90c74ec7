"""Parameter paths and arguments: the one tree walker, per-leaf options and argument checks.

- A **path** is a tuple of ``str``, one per key (`key_name`), shown ``"/"``-joined (`path_str`).
- **Flax boxes** (``nnx.Variable``, Linen ``nn.Partitioned``) are transparent: the Variables
  ``nnx.Optimizer`` hands ``tx.init`` and the arrays it hands ``tx.update`` have the same paths.
  Flax is never imported here. **Masked** leaves (`is_masked`) are leaves wherever a transform
  walks.
- A **per-leaf option** (labels, ``vocab_axis``, Muon dimension numbers) is one value, a
  callable ``tree -> option``, or a tree matched by path (nested, flat with ``"/"``-joined keys,
  or a mix), an entry covering every leaf below it (the longest prefix wins; an entry covering no
  leaf is an error naming it): `resolve_per_leaf`.
- **Argument** errors name the argument (an options object's as ``Owner.field``) and what was
  expected.
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

Path = tuple[str, ...]

ROOT = "(root)"
"""How the empty path (a bare array's) is shown in messages: `path_name`."""


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


def path_name(path: Path) -> str:
    """`path_str`, or `ROOT` for the empty path: a path as a message names a leaf."""
    return path_str(path) or ROOT


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
    return isinstance(x, box_types())


def unbox(x: Any) -> Any:
    """The array (or ShapeDtypeStruct, or label) inside a Flax box; `x` itself otherwise."""
    if not is_box(x):
        return x
    for method in ("get_value", "unbox"):  # a Variable, a Linen box (an older Variable: value)
        if hasattr(x, method):
            return getattr(x, method)()
    return x.value


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
        tree, is_leaf=lambda x: extra(x) or isinstance(x, boxes))
    named = [(_components(keys), leaf) for keys, leaf in outer]
    if not open_boxes or not any(isinstance(x, boxes) for _, x in named):
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


def map_with_paths(fn: Callable[..., Any], tree):
    """``fn(path, leaf)`` on every leaf of `tree` (Flax boxes as leaves), same structure out."""
    leaves, treedef = flatten_with_paths(tree)
    return jax.tree_util.tree_unflatten(treedef, [fn(path, leaf) for path, leaf in leaves])


# --- Per-leaf options matched by path ----------------------------------------------------------


def prefix_entries(prefix, *, is_entry: Callable[[Any], bool] | None = None) -> dict[Path, Any]:
    """``{path: entry}`` of a prefix tree, its Flax boxes unboxed; `is_entry` stops the walk."""
    return {path: unbox(x) for path, x in flatten_with_paths(prefix, is_leaf=is_entry)[0]}


def lookup_prefix(table: Mapping[Path, Any], path: Path) -> tuple[bool, Any]:
    """``(found, value)`` for the longest prefix of `path` in `table` (whole components)."""
    for n in range(len(path), -1, -1):
        if path[:n] in table:
            return True, table[path[:n]]
    return False, None


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
    # An entry that is no prefix of any path: a typo, not a no-op.
    unknown = [path_str(k) for k in entries if not any(p[:len(k)] == k for p in paths)]
    if unknown:
        leaves = sorted(path_str(p) for p in paths)
        more = f" and {len(leaves) - 8} more" if len(leaves) > 8 else ""
        raise ValueError(f"{argname} names {unknown}, which are not in the tree (its leaves: "
                         f"{leaves[:8]}{more})")
    return [lookup_prefix(entries, path) for path in paths]


# --- Argument checks: every public function reports bad input the same way ------------------


def check_int(value: Any, *, argname: str, minimum: int) -> int:
    """Returns `value` as an int ``>= minimum`` (a bool is no int here), or raises naming it."""
    if isinstance(value, bool):
        raise TypeError(f"{argname} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{argname} must be an int, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{argname} must be >= {minimum}, got {value}")
    return value


def canonical_axis(axis: Any, ndim: int, *, argname: str = "vocab_axis") -> int:
    """Returns `axis` as a non-negative int, or raises naming `argname`."""
    try:
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"{argname} must be an int, got {axis!r}") from None
    if not -ndim <= axis < ndim:
        raise ValueError(f"{argname}={axis} is out of range for an array of rank {ndim} "
                         f"(expected {-ndim} <= {argname} < {ndim})")
    return axis % ndim


def check_floating(x: ArrayLike, *, argname: str) -> None:
    """Raises TypeError unless `x` has a real floating dtype."""
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{argname} must have a real floating dtype (float32, bfloat16, ...), "
                        f"got {dtype}")


def check_min_rank(x: ArrayLike, min_rank: int, *, argname: str, what: str = "") -> None:
    """Raises ValueError if `x` has fewer than `min_rank` dimensions."""
    if jnp.ndim(x) < min_rank:
        extra = f" ({what})" if what else ""
        raise ValueError(f"{argname} must have rank >= {min_rank}{extra}, got shape {jnp.shape(x)}")


def check_matrix_like(x: ArrayLike, *, argname: str, vocab_axis: Any) -> int:
    """Validates a head-like array (rank >= 2, float) and returns its vocab axis."""
    check_min_rank(x, 2, argname=argname, what="token rows along vocab_axis, features elsewhere")
    check_floating(x, argname=argname)
    return canonical_axis(vocab_axis, jnp.ndim(x))


def static_args_hint(*names: str) -> str:
    """The advice for an option that arrived as a traced array (injected under jit): list the
    transform's non-float options under `optax.inject_hyperparams`."""
    return f"under optax.inject_hyperparams list it in static_args, e.g. static_args={names!r}"


# --- options objects: each field checked on creation, its error naming ``Owner.field`` ---------


def one_of(value, allowed, argname: str):
    """`value` if it is in `allowed`; a ValueError naming `argname` otherwise."""
    if value not in allowed:
        raise ValueError(f"{argname} must be one of {allowed}, got {value!r}")
    return value


def not_array(value, argname: str):
    """`value` unless it is a jax array (options objects are static Python values)."""
    if isinstance(value, jax.Array):
        raise TypeError(f"{argname} must be a Python value, not a jax array: options objects are "
                        "static (only lm_optimizer's float rates are injectable)")
    return value


def check_real(value, argname: str, *, low: float, high: float = math.inf,
               low_open: bool = False, high_open: bool = False) -> None:
    """Raises unless `value` is a real number in the interval (bounds open where said)."""
    not_array(value, argname)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{argname} must be a finite real number, got {value!r}")
    value = float(value)
    if value < low or (low_open and value == low) or value > high or (high_open and value == high):
        bounds = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{argname} must be in {bounds}, got {value!r}")


def check_momentum(value, argname: str) -> None:
    """None or a decay in [0, 1)."""
    if value is not None:
        check_real(value, argname, low=0.0, high=1.0, high_open=True)


def check_bool(value, argname: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{argname} must be a bool, got {value!r}")


def prefixed(owner: str, check, *args, **kwargs):
    """Runs a transform's own argument check, its error naming the options field."""
    try:
        return check(*args, **kwargs)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{owner}.{err}") from None
