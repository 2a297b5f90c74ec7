"""Assertions on a head step's geometry: row diameter, the softmax gauge, Hilbert perturbation.

Each one reads concrete values (call it on a step's outputs, outside ``jax.jit``), checks every
selected leaf of a tree and raises ``AssertionError`` naming the leaf's path and the measured
value, like chex's ``assert_*`` functions. Measurements come from rowgeom's public diagnostics
(`rowgeom.row_diameter`, `rowgeom.row_diameter_bounds`, `rowgeom.hilbert_perturbation`); the
gauge residual is computed on the host in float64.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import rowgeom
from rowgeom.testing._tree import check_concrete, per_leaf_axes

_METHODS = ("auto", "exact", "bounds")


def _check_bound(value, argname: str) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{argname} must be a real number, got {value!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{argname} must be finite and >= 0, got {value!r}")
    return value


def _leaf_error(path: str, err: Exception) -> Exception:
    return type(err)(f"leaf {path!r}: {err}")


def _pivoted(leaf, axis: int):
    """Float32 rows minus the first row: the same ``D`` (a common shift), without a large
    common offset, whose float32 rounding of the centroid would widen the bracket's upper end
    (by about the offset's rounding error) and leave a tight bound uncertified."""
    x = jnp.asarray(leaf)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"expected a floating array, got dtype {x.dtype}")
    x = x.astype(jnp.float32)
    # The first row by a one-hot contraction, not a gather: a vocabulary-sharded array under
    # Explicit mesh axes allows a contraction (an all-reduce of one row) but no gather.
    onehot = (jnp.arange(x.shape[axis]) == 0).astype(jnp.float32)
    first = jnp.tensordot(x, onehot, axes=(axis, 0), precision=jax.lax.Precision.HIGHEST)
    return x - jnp.expand_dims(first, axis)


def _bracket_rounding(shape, axis: int) -> float:
    """Relative float32 error allowed on the centroid bounds (the mean of ``V`` rows is off by
    about ``log2(V) eps`` of the rows' size in each of the ``F`` features)."""
    vocab = shape[axis]
    features = max(1, math.prod(shape) // max(vocab, 1))
    return 2 * float(np.finfo(np.float32).eps) * (math.log2(max(vocab, 2)) + 2) * math.sqrt(
        features)


def assert_row_diameter_at_most(updates, bound, *, vocab_axis, method: str = "auto",
                                exact_max_vocab: int = 8192, rtol: float = 1e-5) -> None:
    """Asserts ``D(S) = max_{i<j} ||s_i - s_j|| <= bound`` for every selected leaf ``S``.

    ``D`` is the head step's size as the softmax sees it: the largest change of the output
    distribution in Hilbert's projective distance per unit hidden-state norm. A projected
    RowNorm step of radius ``lr`` has ``D <= 2 lr`` (plus ``lr * wd * D(W)`` with decoupled
    weight decay, by the triangle inequality).

    How ``D`` is measured (the failure message says which was used):

    - ``"exact"``: `rowgeom.row_diameter`, ``O(V^2 d)``.
    - ``"bounds"``: the certified ``O(Vd)`` bracket ``lower <= D <= upper`` of
      `rowgeom.row_diameter_bounds`, widened by its float32 rounding. Passes when
      ``upper <= bound``, fails when ``lower > bound``; a bracket containing the bound fails
      as *not certified*.

    Both measure the rows minus the first row (``D`` is shift invariant), so a large common
    offset costs no accuracy.
    - ``"auto"``: exact for ``V <= exact_max_vocab``; otherwise the bracket, falling back to
      the exact value only when the bracket contains the bound.

    Args:
      updates: an array or a tree of arrays (dicts, ``nnx.State`` of Variables, Linen trees).
      bound: the largest allowed ``D`` (finite, >= 0).
      vocab_axis: the token axis: an int for every leaf, or a mapping (nested like `updates`,
        or flat with ``"/"``-joined keys such as ``{"lm_head/kernel": 1}``) from paths to an
        int or None; a path covers every leaf under it and uncovered leaves are not checked.
        An entry that covers no leaf is an error.
      method: ``"auto"``, ``"exact"`` or ``"bounds"``.
      exact_max_vocab: largest vocabulary measured exactly by ``"auto"``.
      rtol: relative slack for float32 rounding: fails when ``D > bound * (1 + rtol)``.

    Raises:
      AssertionError: naming the leaf path, the measured ``D`` (or bracket) and the method.

    Examples:
      >>> import jax.numpy as jnp, rowgeom.testing
      >>> step = {"lm_head": {"kernel": jnp.array([[0.0, 3.0, 1.0], [0.0, 4.0, 1.0]])}}
      >>> rowgeom.testing.assert_row_diameter_at_most(step, 5.0, vocab_axis=1)  # D = 5
      >>> rowgeom.testing.assert_row_diameter_at_most(step, 4.0, vocab_axis=1)
      Traceback (most recent call last):
      ...
      AssertionError: leaf 'lm_head/kernel': row diameter D = 5 > bound 4 (exact ...
    """
    bound = _check_bound(bound, "bound")
    rtol = _check_bound(rtol, "rtol")
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    limit = bound * (1.0 + rtol)
    for path, leaf, axis in per_leaf_axes(vocab_axis, updates):
        check_concrete(leaf, what=f"leaf {path!r}")
        try:
            vocab = int(np.shape(leaf)[axis])
            use_exact = method == "exact" or (method == "auto" and vocab <= exact_max_vocab)
            rows = _pivoted(leaf, axis)
            bracket = None
            if not use_exact:
                lower, upper = (float(b) for b in rowgeom.row_diameter_bounds(
                    rows, vocab_axis=axis))
                bracket = f"[{lower:.8g}, {upper:.8g}]"
                slack = _bracket_rounding(np.shape(leaf), axis)
                if upper * (1 + slack) <= limit:
                    continue
                if lower * (1 - slack) > limit:
                    raise AssertionError(
                        f"leaf {path!r}: row diameter D >= {lower:.8g} > bound {bound:.8g} "
                        f"(certified bracket rowgeom.row_diameter_bounds: {lower:.8g} <= D <= "
                        f"{upper:.8g}, V = {vocab})")
                if method == "bounds":  # (auto: a NaN bracket goes on to report D = nan)
                    raise AssertionError(
                        f"leaf {path!r}: row diameter D <= bound {bound:.8g} not certified: "
                        f"rowgeom.row_diameter_bounds gives {bracket} (V = {vocab}); use "
                        "method='exact' (O(V^2 d)) to decide")
            value = float(rowgeom.row_diameter(rows, vocab_axis=axis))
        except (TypeError, ValueError) as err:
            raise _leaf_error(path, err) from None
        if not value <= limit:  # NaN fails too
            how = "exact rowgeom.row_diameter"
            if bracket is not None:
                how += f" after the inconclusive bracket {bracket}"
            raise AssertionError(f"leaf {path!r}: row diameter D = {value:.8g} > bound "
                                 f"{bound:.8g} ({how}, V = {vocab})")


def _default_rtol(dtype) -> float:
    eps32 = float(np.finfo(np.float32).eps)
    try:
        eps = float(jnp.finfo(dtype).eps)
    except ValueError:
        eps = eps32
    return max(64 * eps32, eps)


def assert_rows_zero_sum(updates, *, vocab_axis, num_valid: int | None = None,
                         rtol: float | None = None, atol: float = 0.0) -> None:
    """Asserts that the token rows of every selected leaf sum to zero: ``1^T S = 0``.

    Adding one vector to every token row shifts all logits by the same amount, which the
    softmax cannot see; projected RowNorm removes that component, so its step lies in the
    gauge ``1^T S = 0``. Measured on the host in float64 as the scale-free residual

        residual = ||sum_i s_i|| / (V * max_i ||s_i||)      (0 for an all-zero leaf)

    which is at most 1, and must be ``<= rtol`` (or ``||sum_i s_i|| <= atol``). With
    `num_valid`, only rows ``< num_valid`` are summed and the padded rows must be exactly zero.

    Args:
      updates: an array or a tree of arrays.
      vocab_axis: as in `assert_row_diameter_at_most`.
      num_valid: number of real tokens of a padded vocabulary (rows ``>= num_valid`` padding).
      rtol: largest allowed residual; default ``max(64 eps(float32), eps(dtype))`` -- float32
        arithmetic, and one rounding of the result to a lower-precision dtype.
      atol: an absolute tolerance on ``||sum_i s_i||``.

    Raises:
      AssertionError: naming the leaf, the residual, ``||sum_i s_i||`` and the worst feature
        (or the first non-zero padded row).

    Examples:
      >>> import jax.numpy as jnp, rowgeom, rowgeom.testing
      >>> grad = jnp.array([[1.0, 2.0], [3.0, 5.0], [0.0, 1.0]])          # (V, d)
      >>> step = rowgeom.rownorm_direction(grad, vocab_axis=0)
      >>> rowgeom.testing.assert_rows_zero_sum(step, vocab_axis=0)
      >>> rowgeom.testing.assert_rows_zero_sum(grad, vocab_axis=0)
      Traceback (most recent call last):
      ...
      AssertionError: leaf '(root)': token rows do not sum to zero: residual ||sum_i s_i|| /
      (V max_i ||s_i||) = 0.5113 > rtol 7.629e-06 (||sum_i s_i|| = 8.944, ...)
    """
    if atol is not None:
        atol = _check_bound(atol, "atol")
    for path, leaf, axis in per_leaf_axes(vocab_axis, updates):
        x = check_concrete(leaf, what=f"leaf {path!r}")
        try:
            if not jnp.issubdtype(x.dtype, jnp.floating):
                raise TypeError(f"expected a floating array, got dtype {x.dtype}")
            axis_ = axis % x.ndim
        except (TypeError, ValueError) as err:
            raise _leaf_error(path, err) from None
        tol = _default_rtol(x.dtype) if rtol is None else _check_bound(rtol, "rtol")
        moved = np.moveaxis(x, axis_, 0)
        feature_shape = moved.shape[1:]
        rows = moved.reshape(moved.shape[0], -1).astype(np.float64)
        vocab = rows.shape[0]
        if num_valid is not None:
            if not (isinstance(num_valid, (int, np.integer)) and 1 <= num_valid <= vocab):
                raise ValueError(f"leaf {path!r}: num_valid must be an int in [1, {vocab}], "
                                 f"got {num_valid!r}")
            padded = np.abs(rows[num_valid:]).max(axis=1) if num_valid < vocab else np.zeros(0)
            bad = np.flatnonzero(~(padded == 0))
            if bad.size:
                token = num_valid + int(bad[0])
                raise AssertionError(
                    f"leaf {path!r}: padded token rows (index >= num_valid = {num_valid}) must "
                    f"be zero: row {token} has max |entry| = {padded[bad[0]]:.4g} "
                    f"({bad.size} non-zero padded rows, V = {vocab})")
            rows = rows[:num_valid]
        total = rows.sum(axis=0)
        total_norm = float(np.linalg.norm(total))
        scale = rows.shape[0] * float(np.linalg.norm(rows, axis=1).max(initial=0.0))
        residual = total_norm / scale if scale > 0 else (0.0 if total_norm == 0 else math.inf)
        if residual <= tol or total_norm <= atol:
            continue
        worst = int(np.nanargmax(np.abs(total))) if np.isfinite(total).any() else 0
        index = np.unravel_index(worst, feature_shape)
        raise AssertionError(
            f"leaf {path!r}: token rows do not sum to zero: residual ||sum_i s_i|| / "
            f"(V max_i ||s_i||) = {residual:.4g} > rtol {tol:.4g} (||sum_i s_i|| = "
            f"{total_norm:.4g}, worst feature {tuple(int(i) for i in index)} sums to "
            f"{total[worst]:.4g}, V = {rows.shape[0]})")


def assert_hilbert_perturbation_at_most(updates, hidden, bound, *, vocab_axis,
                                        rtol: float = 1e-5, atol: float = 0.0) -> None:
    """Asserts ``d_H(softmax(W h), softmax((W + S) h)) <= ||h|| * bound`` for every hidden state.

    The left side is the step's exact effect on the prediction at ``h``,
    ``range_i (S h)_i`` (`rowgeom.hilbert_perturbation`); Theorem 1 says it never exceeds
    ``||h|| * D(S)``, so ``bound = D(S)`` (or the step's diameter budget) must always pass.

    Args:
      updates: a rank-2 head step, or a tree whose selected leaves are rank-2 head steps.
      hidden: ``(..., d)`` final hidden states (concrete; ``||h||`` is taken over the last axis
        in float64).
      bound: allowed perturbation per unit ``||h||`` (finite, >= 0).
      vocab_axis: as in `assert_row_diameter_at_most` (``1`` for a Flax ``(d, V)`` kernel).
      rtol: relative slack for float32 rounding.
      atol: absolute slack.

    Raises:
      AssertionError: naming the leaf, the worst hidden state's index, the measured
        perturbation, ``||h||`` and the allowed value.

    Examples:
      >>> import jax.numpy as jnp, rowgeom.testing
      >>> step = jnp.array([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])   # (V, d), D = sqrt(5)
      >>> hidden = jnp.array([[1.0, 0.0], [0.0, 2.0]])
      >>> rowgeom.testing.assert_hilbert_perturbation_at_most(step, hidden, 2.237, vocab_axis=0)
      >>> rowgeom.testing.assert_hilbert_perturbation_at_most(step, hidden, 1.5, vocab_axis=0)
      Traceback (most recent call last):
      ...
      AssertionError: leaf '(root)': Hilbert perturbation at hidden[1] is 4 > ||h|| * bound =
      2 * 1.5 = 3 (2 per unit ||h||)
    """
    bound = _check_bound(bound, "bound")
    rtol, atol = _check_bound(rtol, "rtol"), _check_bound(atol, "atol")
    h = check_concrete(hidden, what="hidden")
    if h.ndim < 1:
        raise ValueError(f"hidden must have shape (..., d), got shape {h.shape}")
    norms = np.linalg.norm(h.astype(np.float64), axis=-1)
    allowed = norms * bound * (1.0 + rtol) + atol
    for path, leaf, axis in per_leaf_axes(vocab_axis, updates, rank=(2, 2)):
        check_concrete(leaf, what=f"leaf {path!r}")
        try:
            measured = np.asarray(rowgeom.hilbert_perturbation(leaf, hidden, vocab_axis=axis),
                                  np.float64)
        except (TypeError, ValueError) as err:
            raise _leaf_error(path, err) from None
        bad = ~(measured <= allowed)
        if not bad.any():
            continue
        excess = np.where(bad, np.nan_to_num(measured - allowed, nan=np.inf), -np.inf)
        where = np.unravel_index(int(np.argmax(excess)), measured.shape)
        value, norm = float(measured[where]), float(norms[where])
        per_unit = value / norm if norm > 0 else math.inf
        index = "hidden" + (f"[{', '.join(str(int(i)) for i in where)}]" if where else "")
        raise AssertionError(
            f"leaf {path!r}: Hilbert perturbation at {index} is {value:.8g} > ||h|| * "
            f"bound = {norm:.8g} * {bound:.8g} = {norm * bound:.8g} ({per_unit:.8g} per unit "
            f"||h||)")
