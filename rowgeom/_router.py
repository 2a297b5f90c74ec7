"""Router RowNorm: projected RowNorm of each matrix of a stack, rows along the expert axis.

A mixture-of-experts router ``(d, E)`` maps a token to the experts' logits, a softmax over
``E`` as the head's is over ``V``: with ``router="rownorm"`` `lm_optimizer` gives it the
head's geometry, one matrix per layer (a batch axis), each becoming `rownorm_direction` of it.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from rowgeom._rownorm import EPS, _check_eps, rownorm_direction
from rowgeom._tree import canonical_axis, flatten_with_paths, is_masked, path_str

AxesSpec = tuple[int, tuple[int, ...]]


def _check_spec(path: str, spec: Any) -> AxesSpec:
    """``(row axis, batch axes)`` as ints, or a TypeError naming the entry."""
    try:
        axis, batch = spec
        batch = tuple(batch)
    except (TypeError, ValueError):
        raise TypeError(f"axes[{path!r}] must be a (row axis, batch axes) pair, got "
                        f"{spec!r}") from None
    for value in (axis, *batch):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"axes[{path!r}] must hold ints, got {spec!r}")
    return int(axis), tuple(int(b) for b in batch)


def _leaf_axes(u, spec: AxesSpec, where: str) -> AxesSpec:
    """The spec's axes for this leaf, non-negative, or a ValueError naming the leaf."""
    axis, batch = spec
    if jnp.ndim(u) < 2 + len(batch):
        raise ValueError(f"updates at {where} (shape {jnp.shape(u)}) need rank >= "
                         f"{2 + len(batch)}: a row axis, a feature axis and {len(batch)} "
                         "batch axes")
    axis = canonical_axis(axis, u.ndim, argname=f"axes[{where!r}] row axis")
    batch = tuple(canonical_axis(b, u.ndim, argname=f"axes[{where!r}] batch axis")
                  for b in batch)
    if len(set(batch) | {axis}) != len(batch) + 1:
        raise ValueError(f"axes[{where!r}]: the row axis {axis} and batch axes {batch} must "
                         "be distinct")
    return axis, batch


def _per_matrix(u, spec: AxesSpec, options: dict, where: str):
    """`rownorm_direction` of each matrix of `u` (one per index of the batch axes)."""
    axis, batch = _leaf_axes(u, spec, where)
    if not batch:
        return rownorm_direction(u, vocab_axis=axis, **options)
    front = jnp.moveaxis(u, batch, tuple(range(len(batch))))
    rest = [a for a in range(u.ndim) if a not in batch]
    flat = front.reshape((-1,) + front.shape[len(batch):])
    row = rest.index(axis)
    out = jax.vmap(lambda m: rownorm_direction(m, vocab_axis=row, **options))(flat)
    return jnp.moveaxis(out.reshape(front.shape), tuple(range(len(batch))), batch)


def _updates(updates, axes: Mapping[str, AxesSpec], options: dict):
    leaves, treedef = flatten_with_paths(updates, open_boxes=True, is_leaf=is_masked)
    paths = {path_str(p) for p, _ in leaves}
    unknown = sorted(set(axes) - paths)
    if unknown:
        raise ValueError(f"axes names {unknown}, which are not in the tree")
    out = [u if is_masked(u) or path_str(p) not in axes
           else _per_matrix(u, axes[path_str(p)], options, path_str(p))
           for p, u in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


def rownorm_per_matrix(*, axes: Mapping[str, Any] | Callable[[Any], Mapping[str, Any]],
                       eps: float = EPS, center_input: bool = True, center_output: bool = True
                       ) -> optax.GradientTransformation:
    """Projected RowNorm of each leaf named in `axes`, one matrix per index of its batch axes.

    Args:
      axes: ``{"/"-joined path: (row axis, batch axes)}``, or a callable ``updates -> such a
        mapping`` (as `lm_optimizer`'s plan gives it). Each such leaf is a batch of
        matrices (one per index of the batch axes) whose rows lie along the row axis, its
        other axes being features; each matrix becomes `rownorm_direction` of it. Leaves not
        named, and masked leaves, pass through unchanged; a path naming no leaf is an error.
      eps: as in `rownorm_direction`.
      center_input: as in `rownorm_direction`.
      center_output: as in `rownorm_direction`.

    Returns:
      A stateless ``optax.GradientTransformation``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from rowgeom._router import rownorm_per_matrix
      >>> g = {"router": jax.random.normal(jax.random.key(0), (8, 3, 4))}   # (d, L, E)
      >>> tx = rownorm_per_matrix(axes={"router": (2, (1,))})
      >>> s, _ = tx.update(g, tx.init(g))
      >>> bool(jnp.allclose(s["router"].sum(axis=2), 0, atol=1e-6))   # each layer centred
      True
    """
    def checked(given: Any) -> dict[str, AxesSpec]:
        if not isinstance(given, Mapping):
            raise TypeError(f"axes must be a mapping path -> (row axis, batch axes), got "
                            f"{given!r}")
        return {str(path): _check_spec(str(path), spec) for path, spec in given.items()}

    given: Any = axes  # a mapping, or a callable of the updates
    fixed = None if callable(given) else checked(given)
    options = dict(eps=_check_eps(eps), center_input=bool(center_input),
                   center_output=bool(center_output))

    def update_fn(updates, state, params=None):
        del params
        specs = checked(given(updates)) if fixed is None else fixed
        return _updates(updates, specs, options), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)
