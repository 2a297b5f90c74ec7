"""Newton–Schulz orthogonalization: an approximate polar factor from matrix products only.

Contract: for ``X = U Σ Vᵀ``, `newton_schulz` returns about ``polar(X) = U Vᵀ`` (the spectral-norm
steepest-descent direction, Bernstein & Newhouse, arXiv 2409.20325) by applying an odd quintic
``σ <- a σ + b σ³ + c σ⁵`` to every singular value at once, ``X <- a X + (b A + c A²) X`` with
``A = X Xᵀ``, after normalising by the Frobenius norm (an upper bound of the spectral norm).
It works per matrix over the last two axes (leading axes are a batch), keeps the singular
vectors and zero singular values (a zero-sum matrix keeps a zero-sum polar factor), and returns
the input's dtype. `ns_coefficients` gives the ``(a, b, c)`` table of each step.

The presets' sources and measured singular-value bands: docs/api/muon.md ("Newton–Schulz
coefficients").
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from rowgeom._validation import check_floating, check_min_rank

_KELLER = (3.4445, -4.7750, 2.0315)

# KellerJordan/modded-nanogpt train_gpt.py (also microsoft/dion benchmark/polar_express.py).
_POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
_POLAR_EXPRESS_SAFETY = 1.02
# Degree-5 Newton–Schulz (Padé) polynomial: converges to 1 from (0, 1], used past step 5.
_NS_QUINTIC = (15 / 8, -10 / 8, 3 / 8)

PRESETS = ("keller", "polar_express")


def _check_steps(steps: int) -> int:
    if isinstance(steps, bool):
        raise TypeError(f"ns_steps must be a Python int >= 1, got {steps!r}")
    try:
        steps = operator.index(steps)
    except TypeError:
        raise TypeError(
                f"ns_steps must be a static Python int >= 1, got {steps!r} (it sets the "
                "number of unrolled steps; with optax.inject_hyperparams list it in "
                "static_args)") from None
    if steps < 1:
        raise ValueError(f"ns_steps must be >= 1, got {steps}")
    return steps


def resolve_coefficients(coeffs: str | ArrayLike, steps: int) -> tuple[np.ndarray, float]:
    """Returns `(table (steps, 3) float64, norm_scale)`; `norm_scale` multiplies ||X||_F."""
    steps = _check_steps(steps)
    if isinstance(coeffs, str):
        if coeffs == "keller":
            return np.tile(np.asarray(_KELLER, np.float64), (steps, 1)), 1.0
        if coeffs == "polar_express":
            rows = list(_POLAR_EXPRESS[:steps]) + [_NS_QUINTIC] * max(0, steps - 5)
            return np.asarray(rows, np.float64), _POLAR_EXPRESS_SAFETY
        raise ValueError(f"ns_coeffs must be one of {PRESETS}, a (3,) triple or a "
                         f"(ns_steps, 3) array, got unknown preset {coeffs!r}")
    if isinstance(coeffs, jax.core.Tracer):
        raise TypeError("ns_coeffs must be static (a preset name, tuple or numpy array), got a "
                        "traced array; with optax.inject_hyperparams list it in static_args")
    try:
        table = np.asarray(coeffs, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"ns_coeffs must be a preset name, a (3,) triple or a (ns_steps, 3) "
                        f"array of floats, got {coeffs!r}") from None
    if table.shape == (3,):
        table = np.tile(table, (steps, 1))
    elif table.shape != (steps, 3):
        raise ValueError(f"ns_coeffs must have shape (3,) or (ns_steps, 3) = ({steps}, 3), "
                         f"got shape {table.shape}")
    if not np.all(np.isfinite(table)):
        raise ValueError(f"ns_coeffs must be finite, got {table.tolist()}")
    return table, 1.0


def ns_coefficients(coeffs: str | ArrayLike, steps: int) -> np.ndarray:
    """The `(steps, 3)` float64 table of `(a, b, c)` that `newton_schulz` applies, row k at step k.

    Args:
      coeffs: `"keller"`, `"polar_express"` (sources, bands and the behaviour when
        `steps != 5`: the Muon API page), a `(3,)` triple (repeated), or a `(steps, 3)` array.
      steps: number of Newton–Schulz steps, a Python int >= 1.

    Raises:
      ValueError: unknown preset (naming `ns_coeffs`), wrong shape, non-finite entries,
        `steps < 1`.

    Examples:
      >>> import rowgeom
      >>> rowgeom.ns_coefficients("keller", 2)
      array([[ 3.4445, -4.775 ,  2.0315],
             [ 3.4445, -4.775 ,  2.0315]])
      >>> rowgeom.ns_coefficients("polar_express", 5).shape
      (5, 3)

    Note:
      optax 0.2.8 (`optax.contrib.scale_by_muon`) also applies an `(n, 3)` table row by row in
      order, but its length check is inverted: `if not n <= ns_steps: raise ValueError("Not
      enough coeffs ...")` rejects a table *longer* than `ns_steps` with a message saying the
      opposite (so `optax.contrib.muon(ns_coeffs="dion", ns_steps=3)` fails), the slice
      `ns_coeffs[-ns_steps:]` after it is dead code (and would keep the *last* rows, the gentle
      ones, were the check fixed), and a table shorter than `ns_steps` silently runs only `n`
      steps. Here an array must have exactly `steps` rows; presets define every `steps`.
    """
    return resolve_coefficients(coeffs, steps)[0]


# Why `orthogonalize` is written this way:
#
# - The Gram matrix is formed on the smaller side (tall inputs are transposed), so a step costs
#   `2 m² n + m³` multiply-adds with `m` the smaller side.
# - No `vmap` over a batch of one: optax 0.2.8 does that, and on CPU XLA then copies a transpose in
#   every iteration; contracting with `lax.dot_general` directly is 1.6–2.4x faster (measured).
# - `compute_dtype` (e.g. bfloat16) sets the dtype of X between steps; every product accumulates in
#   float32 (`preferred_element_type`), which is also the fastest path for bf16 on CPU. The norm is
#   always taken in float32. The output has the input's dtype.


def _dot(lhs: jax.Array, rhs: jax.Array, lhs_contract: int, rhs_contract: int) -> jax.Array:
    """Batched matmul over all leading axes, accumulating in float32, without transposes."""
    batch = tuple(range(lhs.ndim - 2))
    return jax.lax.dot_general(
            lhs, rhs, (((lhs_contract,), (rhs_contract,)), (batch, batch)),
            preferred_element_type=jnp.float32)


def orthogonalize(x: jax.Array, table: np.ndarray, *, norm_scale: float = 1.0,
                  eps: ArrayLike = 1e-7, compute_dtype: DTypeLike | None = None) -> jax.Array:
    """Core iteration with a resolved static `table` (see `newton_schulz`)."""
    check_min_rank(x, 2, argname="x", what="matrices over the last two axes")
    check_floating(x, argname="x")
    out_dtype = x.dtype
    cdtype = out_dtype if compute_dtype is None else jnp.dtype(compute_dtype)
    if not jnp.issubdtype(cdtype, jnp.floating):
        raise TypeError(f"compute_dtype must be a floating dtype, got {cdtype}")
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:  # Gram on the smaller side: A is (min, min).
        x = jnp.swapaxes(x, -1, -2)
    r, c = x.ndim - 1, x.ndim - 2  # row/column contraction axes of a batched matrix

    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    norm = jnp.sqrt(jnp.sum(jnp.square(x32), axis=(-2, -1), keepdims=True))
    denom = norm * norm_scale + eps
    # A zero matrix (or eps = 0) must map to zero, never 0/0.
    x = (x32 / jnp.where(denom > 0, denom, 1)).astype(cdtype)
    for a, b, cc in np.asarray(table, np.float64).tolist():
        gram = _dot(x, x, r, r)                                      # A = X Xᵀ
        poly = (b * gram + cc * _dot(gram.astype(cdtype), gram.astype(cdtype), r, c))
        x = (a * x.astype(jnp.float32)
             + _dot(poly.astype(cdtype), x, r, c)).astype(cdtype)    # aX + (bA + cA²)X
    if transposed:
        x = jnp.swapaxes(x, -1, -2)
    return x.astype(out_dtype)


def newton_schulz(x: ArrayLike, *, steps: int = 5, coeffs: str | ArrayLike = "keller",
                  eps: ArrayLike = 1e-7, compute_dtype: DTypeLike | None = None) -> jax.Array:
    """Approximate polar factor `U Vᵀ` of every matrix over the last two axes of `x`.

    `X0 = x / (s ||x||_F + eps)` (`s = 1`, or 1.02 for `"polar_express"`), then for each row
    `(a, b, c)` of `ns_coefficients(coeffs, steps)`: `X <- a X + (b A + c A²) X`, `A = X Xᵀ`.

    Args:
      x: floating array of rank >= 2; leading axes are a batch of independent matrices.
      steps: number of steps (Python int >= 1).
      coeffs: `"keller"`, `"polar_express"`, a `(3,)` triple or a `(steps, 3)` array.
      eps: added to the scaled norm; a zero matrix gives a zero result whatever `eps`.
      compute_dtype: dtype of X between steps (default: `x.dtype`); products accumulate in f32.

    Returns:
      Array of `x`'s shape and dtype whose matrices have singular values in the preset's band
      (the Muon API page) and the singular vectors of `x`. Sign convention: same sign as `x`.

    Examples:
      >>> import jax, jax.numpy as jnp, rowgeom
      >>> x = jax.random.normal(jax.random.key(0), (4, 16, 64))   # a batch of 4 matrices
      >>> polar = rowgeom.newton_schulz(x, steps=5)
      >>> polar.shape
      (4, 16, 64)
      >>> sigma = jnp.linalg.svd(polar, compute_uv=False)   # near 1: the "keller" band
      >>> bool(jnp.all((sigma > 0.68) & (sigma < 1.14)))
      True
    """
    table, norm_scale = resolve_coefficients(coeffs, steps)
    return orthogonalize(jnp.asarray(x), table, norm_scale=norm_scale, eps=eps,
                         compute_dtype=compute_dtype)


__all__ = ["newton_schulz", "ns_coefficients"]
