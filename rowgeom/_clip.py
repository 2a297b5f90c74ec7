"""Clip an update's row diameter: a hard cap on the softmax's Hilbert-distance change.

By Theorem 1 of arXiv 2608.22253, ``sup_{||h|| <= H} d_H(softmax(W h), softmax((W + S) h))
= H * D(S)`` with ``D(S) = max_{i<j} ||s_i - s_j||`` over token rows. Scaling an update by
``min(1, max_diameter / D)`` therefore caps the worst-case change of every next-token
distribution at ``H * max_diameter`` while keeping the step's direction.

``D`` is either the ``O(V d)`` safe upper bound ``2 max_i ||s_i - sbar|| >= D(S)`` (default;
the clipped step then satisfies ``D <= max_diameter`` through the bound, possibly shrinking it
up to 2x more than needed) or the exact ``O(V^2 d)`` row diameter. Both work under any mesh and
placement (`rowgeom._geometry`): the bound moves only reduced vectors between devices, the exact
diameter gathers the rows once.

    >>> import jax.numpy as jnp, rowgeom
    >>> tx = rowgeom.clip_row_diameter(2.0, vocab_axis=0)
    >>> u = jnp.array([[0.0, 0.0], [3.0, 4.0]])                 # bound 2 max ||u_i - ū|| = 5
    >>> tx.update(u, tx.init(u))[0].tolist()                    # scaled by 2 / 5
    [[0.0, 0.0], [1.2000000476837158, 1.600000023841858]]

References: arXiv 2608.22253 (Theorem 1).
"""

from __future__ import annotations

import numbers
from typing import Any

import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from rowgeom._cpu import check_impl
from rowgeom._geometry import _row_diameter, _upper_bound
from rowgeom._rownorm import map_head_leaves, vocab_axes
from rowgeom._tree import check_int, check_matrix_like


def _check_max_diameter(max_diameter):
    if isinstance(max_diameter, numbers.Real) and not isinstance(max_diameter, bool):
        if not float(max_diameter) >= 0 or float(max_diameter) == float("inf"):
            raise ValueError(
                    f"max_diameter must be a finite number >= 0, got {max_diameter!r}")
        return
    dtype = jnp.result_type(max_diameter)
    real = jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    if jnp.ndim(max_diameter) != 0 or not real:
        raise TypeError(f"max_diameter must be a real scalar, got {max_diameter!r}")


def clip_row_diameter(
        max_diameter: float | ArrayLike,
        *,
        vocab_axis: Any,
        exact: bool = False,
        block_size: int = 1024,
        impl: str = "xla",
) -> optax.GradientTransformation:
    """Rescales each update so that its row diameter is at most ``max_diameter``.

    Per leaf, ``u <- u * min(1, max_diameter / D(u))`` (``D = 0`` leaves ``u`` unchanged). The
    sign and direction of the update are kept, like optax's ``clip_by_*`` transforms.

    Args:
      max_diameter: the diameter cap, a non-negative scalar (may be a traced array, e.g. under
        ``optax.inject_hyperparams(clip_row_diameter, static_args=("vocab_axis",
        "block_size"))``).
      vocab_axis: token axis per leaf: an int (every leaf), a tree prefix of ints / ``None``
        (``None`` leaves pass through), or a callable ``tree -> such a
        prefix``, called on the updates (like ``optax.masked``).
      exact: use the exact ``O(V^2 d)`` diameter (``D <= max_diameter`` up to float rounding)
        instead of the ``O(V d)`` upper bound ``2 max_i ||u_i - ubar||``.
      block_size: rows per block of the exact diameter's scan.
      impl: the formulation of the upper bound's pass, as in `rowgeom.row_diameter_bounds`.

    Returns:
      A stateless ``optax.GradientTransformation``. ``None`` and ``optax.MaskedNode`` leaves pass
      through untouched.

    Examples:
      >>> import jax.numpy as jnp, rowgeom
      >>> u = jnp.array([[0.0, 0.0], [3.0, 4.0]])                   # D(u) = 5
      >>> tx = rowgeom.clip_row_diameter(1.0, vocab_axis=0, exact=True)
      >>> clipped, _ = tx.update(u, tx.init(u))
      >>> round(float(rowgeom.row_diameter(clipped, vocab_axis=0)), 4)
      1.0
    """
    _check_max_diameter(max_diameter)
    if not isinstance(exact, bool):
        raise TypeError(f"exact must be a bool, got {exact!r}")
    block_size = check_int(block_size, argname="block_size", minimum=1)
    impl = check_impl(impl)

    def clip_leaf(u, vocab):
        axis = check_matrix_like(u, argname="updates", vocab_axis=vocab)
        if exact:
            diameter = _row_diameter(u, axis=axis, block_size=block_size)
        else:
            diameter = _upper_bound(u, axis, impl)
        cap = jnp.asarray(max_diameter, jnp.float32)
        scale = jnp.where(diameter > cap, cap / jnp.where(diameter > 0, diameter, 1.0), 1.0)
        return (u.astype(jnp.float32) * scale).astype(u.dtype)

    def update_fn(updates, state, params=None):
        del params
        axes = vocab_axes(vocab_axis, updates)
        return map_head_leaves(clip_leaf, lambda u: u, updates, axes), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)

