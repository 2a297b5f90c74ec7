"""The softmax's Hilbert geometry: how far a head update moves the output distribution.

Hilbert's projective distance between positive vectors is
``d_H(p, q) = log max_i p_i/q_i - log min_i p_i/q_i``; for softmaxes it is the range of the logit
change (Lemma 1), so a head update ``S`` moves ``softmax(W h)`` by exactly
``range_i (S h)_i <= ||h|| * D(S)`` (Theorem 1; `rowgeom.row_diameter` is ``D``).
`hilbert_distance` measures the distance between two distributions (or logits) and
`hilbert_perturbation` the change an update causes per hidden state. Results are float32 (or
wider), and finite input never overflows (power-of-two rescaling, `rowgeom._numerics`).

References: arXiv 2608.22253 (Lemma 1, Theorem 1); P. J. Bushell, "Hilbert's metric and
positive contraction mappings in a Banach space", Arch. Rational Mech. Anal. 52 (1973).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from rowgeom._numerics import _pow2_exponent, _times_pow2
from rowgeom._tree import canonical_axis, check_floating, check_min_rank

_HIGHEST = lax.Precision.HIGHEST  # accelerators default to reduced-precision matmuls


def hilbert_distance(p, q, *, axis: int = -1, logits: bool = False) -> jax.Array:
    """Hilbert's projective distance ``log max_i p_i/q_i - log min_i p_i/q_i`` along ``axis``.

    Computed in the log domain as the range of ``log p - log q``. With ``logits=True``, ``p`` and
    ``q`` are logits and the result is ``range(p - q)``, which by Lemma 1 equals the distance
    between their softmaxes *exactly*, even where probabilities underflow: prefer it whenever
    logits are available. It is invariant to adding a constant to either input.

    Probabilities must be non-negative (they need not be normalised: the metric is projective).
    Entries where both are zero are ignored (the metric of the face they share); the distance
    is ``inf`` when one is zero where the other is not, and 0 when both vanish everywhere.

    Returns:
      Float32 (or wider) array with ``axis`` reduced.

    Examples:
      >>> import jax.numpy as jnp, rowgeom
      >>> p = jnp.array([0.5, 0.25, 0.25])
      >>> q = jnp.array([0.25, 0.25, 0.5])
      >>> round(float(rowgeom.hilbert_distance(p, q)), 4)      # log 2 - log(1/2)
      1.3863
      >>> z = jnp.array([2.0, 0.0, -1.0])                     # logits: d_H = range(z' - z)
      >>> round(float(rowgeom.hilbert_distance(z + jnp.array([0.5, 0.0, 0.0]), z,
      ...                                      logits=True)), 4)
      0.5
    """
    check_floating(p, argname="p")
    check_floating(q, argname="q")
    if jnp.ndim(p) != jnp.ndim(q):
        raise ValueError(f"p and q must have the same rank, got shapes {jnp.shape(p)} and "
                         f"{jnp.shape(q)}")
    check_min_rank(p, 1, argname="p")
    axis = canonical_axis(axis, jnp.ndim(p), argname="axis")
    return _hilbert_distance(p, q, axis=axis, logits=bool(logits))


@functools.partial(jax.jit, static_argnames=("axis", "logits"))
def _hilbert_distance(p, q, *, axis: int, logits: bool):
    dtype = jnp.promote_types(jnp.result_type(p, q), jnp.float32)
    p, q = jnp.asarray(p, dtype), jnp.asarray(q, dtype)
    if logits:
        # A power-of-two scale (exact) keeps p - q from overflowing for any finite logits.
        exponent = jnp.maximum(_pow2_exponent(p), _pow2_exponent(q))
        r = _times_pow2(p, -exponent) - _times_pow2(q, -exponent)
        return _times_pow2(jnp.max(r, axis=axis) - jnp.min(r, axis=axis), exponent)
    both_zero = (p == 0) & (q == 0)
    r = jnp.log(jnp.where(both_zero, 1.0, p)) - jnp.log(jnp.where(both_zero, 1.0, q))
    top = jnp.max(jnp.where(both_zero, -jnp.inf, r), axis=axis)
    bottom = jnp.min(jnp.where(both_zero, jnp.inf, r), axis=axis)
    return jnp.where(jnp.all(both_zero, axis=axis), 0.0, top - bottom)


def hilbert_perturbation(update, hidden, *, vocab_axis: int) -> jax.Array:
    """Hilbert-distance change of the softmax per hidden state: ``range_i (update . h)_i``.

    By Lemma 1 this is exactly ``d_H(softmax(W h), softmax((W + update) h))`` for every ``W``, and
    by Theorem 1 it never exceeds ``||h|| * D(update)``; the ratio is the step's tightness.

    Args:
      update: rank-2 head update. ``vocab_axis=0`` for ``(V, d)`` storage (embedding / tied
        head), ``vocab_axis=1`` for a Flax ``(d, V)`` kernel.
      hidden: ``(..., d)`` final hidden states.
      vocab_axis: which axis of ``update`` holds the tokens.

    Returns:
      Float32 array of shape ``hidden.shape[:-1]``.

    Examples:
      >>> import jax.numpy as jnp, rowgeom
      >>> update = jnp.array([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])   # (V, d) = (3, 2)
      >>> hidden = jnp.array([[1.0, 0.0], [0.0, 2.0]])                 # two hidden states
      >>> rowgeom.hilbert_perturbation(update, hidden, vocab_axis=0).tolist()
      [2.0, 4.0]
    """
    check_floating(update, argname="update")
    if jnp.ndim(update) != 2:
        raise ValueError(f"update must have rank 2 (tokens x features), got shape "
                         f"{jnp.shape(update)}")
    check_floating(hidden, argname="hidden")
    check_min_rank(hidden, 1, argname="hidden", what="(..., d) hidden states")
    axis = canonical_axis(vocab_axis, 2)
    feature_axis = 1 - axis
    d = jnp.shape(update)[feature_axis]
    if jnp.shape(hidden)[-1] != d:
        raise ValueError(
                f"hidden must have last dimension d={d} (update's feature axis {feature_axis} "
                f"for vocab_axis={vocab_axis}), got shape {jnp.shape(hidden)}")
    return _hilbert_perturbation(update, hidden, feature_axis=feature_axis)


@functools.partial(jax.jit, static_argnames=("feature_axis",))
def _hilbert_perturbation(update, hidden, *, feature_axis: int):
    # Both factors scaled by powers of two (exact), so the products cannot overflow to inf - inf
    # for finite inputs; the range is scaled back (inf only if it exceeds float32).
    hidden, update = hidden.astype(jnp.float32), update.astype(jnp.float32)
    e_h, e_u = _pow2_exponent(hidden), _pow2_exponent(update)
    delta = jnp.tensordot(_times_pow2(hidden, -e_h), _times_pow2(update, -e_u),
                          axes=(hidden.ndim - 1, feature_axis), precision=_HIGHEST)
    return _times_pow2(jnp.max(delta, axis=-1) - jnp.min(delta, axis=-1), e_h + e_u)
