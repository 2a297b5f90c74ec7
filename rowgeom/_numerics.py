"""Float32 plumbing shared by the geometry and the transforms: exact power-of-two rescaling,
and where a computation is being traced (one device or a mesh, sharded or not).

Contract: every helper here is exact or a no-op on ordinary input. Rescaling by a power of two
changes no mantissa, so a diameter, bound or range computed on rescaled rows and scaled back is
the true value whenever it fits float32; the device checks only pick between two formulations
that compute the same numbers. Why each guard exists is on the geometry page
(docs/geometry.md, "Edge cases").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# A diameter (or bound) outside [2^-60, 2^60] may have lost D^2 to float32 overflow or underflow;
# it is then recomputed on rows rescaled by a power of two (exact) so that max|x| is ~1.
_SAFE_LOG2 = 60


def _pow2(k):
    """``2.0**k`` as an exact float32 for an integer array ``k`` in ``[-126, 127]``."""
    return lax.bitcast_convert_type((k.astype(jnp.int32) + 127) << 23, jnp.float32)


def _times_pow2(x, k):
    """``x * 2**k`` exactly (unless the result over/underflows) for integer ``|k| <= 500``:
    four normal power-of-two factors (``jnp.ldexp`` mishandles subnormals on XLA:CPU)."""
    k = jnp.clip(jnp.asarray(k, jnp.int32), -500, 500)
    for parts in (4, 3, 2, 1):
        piece = k // parts  # floor: the remaining pieces stay within [-126, 127]
        x = x * _pow2(piece)
        k = k - piece
    return x


def _pow2_exponent(x):
    """``e`` with ``max|x| = f * 2**e``, ``f`` in ``[0.5, 1)`` (0 for all-zero or NaN ``x``)."""
    return jnp.frexp(jnp.max(jnp.abs(x)))[1]


def _rescale_rows(x, axis: int):
    """``(y, e)``: ``x`` centred over `axis` with ``x - xbar = y * 2**e`` and ``max|y|`` in
    ``[0.5, 1)``. Scaling before centring too keeps ``x_i - xbar`` from overflowing."""
    e1 = _pow2_exponent(x)
    y = _times_pow2(x, -e1)
    y = y - jnp.mean(y, axis=axis, keepdims=True)
    e2 = _pow2_exponent(y)
    return _times_pow2(y, -e2), e1 + e2


def _out_of_range(d):
    """True where ``d`` may have over/underflowed in float32 (or is NaN/inf)."""
    return ~((d < 2.0**_SAFE_LOG2) & (d > 2.0**-_SAFE_LOG2))


def single_device_trace() -> bool:
    """False while tracing under a multi-device mesh context (``jax.set_mesh``).

    The CPU-tuned loops over slabs or row blocks slice an axis that may be sharded; under a
    mesh, plain reductions let XLA's partitioner move only reduced vectors between devices.
    """
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size <= 1


def _replicated(x: jax.Array) -> jax.Array:
    """`x` with any Explicit-mode sharding removed (no-op for Auto axes or one device).

    The triangular scan reshapes the token axis into blocks, which Explicit sharding types
    forbid when the axis is split across devices. The exact diameter is an O(V^2 d)
    diagnostic, so gathering the O(V d) rows once costs little next to it.
    """
    if any(part is not None for part in jax.typeof(x).sharding.spec):
        return jax.sharding.reshard(x, jax.sharding.PartitionSpec())
    return x
