"""Float32 and sharding plumbing shared by the geometry and the transforms: exact power-of-two
rescaling, RowNorm's overflow guard, taking a few token rows under any mesh, and replicating rows
for the exact diameter.

Contract: every helper here is exact or a no-op on ordinary input. Rescaling by a power of two
changes no mantissa, so a diameter, bound or range computed on rescaled rows and scaled back is
the true value whenever it fits float32 (IEEE 754: multiplying by ``2**k`` only changes the
exponent). Why each guard exists is on the geometry page (docs/geometry.md, "Edge cases").

    >>> import jax.numpy as jnp
    >>> from rowgeom._numerics import _rescale_rows, _times_pow2
    >>> x = jnp.array([[3e30, 0.0], [1e30, 2e30]])
    >>> y, e = _rescale_rows(x, 0)          # x - x̄ = y * 2**e exactly, max |y| in [0.5, 1)
    >>> bool(jnp.all(_times_pow2(y, e) == x - x.mean(axis=0, keepdims=True)))
    True
    >>> 0.5 <= float(jnp.abs(y).max()) < 1
    True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

# A diameter (or bound) outside [2^-60, 2^60] may have lost D^2 to float32 overflow or underflow;
# it is then recomputed on rows rescaled by a power of two (exact) so that max|x| is ~1.
_SAFE_LOG2 = 60
# RowNorm's smallest eps. A row at least this long has a squared norm >= 2**-80, and squares that
# underflow (flushed to zero on XLA:CPU and TPU) lose less than d * 2**-126 of it: a relative
# 2**-46 * d, float32 rounding for any d up to 2**22. A smaller eps would let a row whose
# squared norm underflows be divided by eps instead of its norm, making it longer than 1.
MIN_EPS = 2.0**-40
# RowNorm's overflow guard: inputs with entries above 2**_HUGE_EXPONENT are scaled by a power
# of two (exact; the result is invariant to it, with eps scaled alike) so that the largest entry
# is about 2**20 and squared row norms (d < 2**26 terms) and the centring cannot overflow.
_HUGE_EXPONENT = 50


def _pow2(k):
    """``2.0**k`` as an exact float32 for an integer array ``k`` in ``[-126, 127]``."""
    return lax.bitcast_convert_type((k.astype(jnp.int32) + 127) << 23, jnp.float32)


def _times_pow2(x, k):
    """``x * 2**k`` exactly (unless the result over/underflows) for integer ``|k| <= 500``:
    normal power-of-two factors of one sign (``jnp.ldexp`` mishandles subnormals on XLA:CPU),
    four of ``2**(k/4)`` rounded toward zero and one of the remainder, at most 3 in size.
    Truncating division is one operation (floor division needs a sign fix-up), which keeps
    the many scalar rescalings of the bracket cheap to compile."""
    k = jnp.clip(jnp.asarray(k, jnp.int32), -500, 500)
    quarter = lax.div(k, jnp.int32(4))  # toward zero: every factor has k's sign
    piece = _pow2(quarter)
    return x * piece * piece * piece * piece * _pow2(k - 4 * quarter)


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


def _row_vector(w, ndim: int, axis: int):
    """Reshapes per-row values ``(V,)`` to broadcast along `axis` of a rank-`ndim` array."""
    return w.reshape(tuple(-1 if i == axis else 1 for i in range(ndim)))


def _rownorm_scale(amax, eps):
    """``(scale, eps)`` for RowNorm on input whose largest entry is ``amax``: ``(1, eps)``
    unless ``amax > 2**_HUGE_EXPONENT``, else a power of two bringing ``amax`` to about
    ``2**20`` and eps scaled alike, but never below `MIN_EPS` (rows shorter than
    ``2**-60 * amax`` then come out shorter than unit length, never longer)."""
    huge = amax > 2.0**_HUGE_EXPONENT
    # amax = f * 2**e with f in [0.5, 1): 2**(21 - e) brings it into [2**20, 2**21). An exact
    # power of two built from the exponent bits (exp2/log2 are approximations on XLA:CPU).
    exponent = jnp.clip(21 - jnp.frexp(amax)[1], -126, 127)
    scale = jnp.where(huge, _pow2(exponent), 1.0)
    return scale, jnp.where(huge, jnp.maximum(eps * scale, MIN_EPS), eps)


def _guarded(stats, amax, eps):
    """RowNorm's overflow guard, at no cost on ordinary input: ``stats(scale, eps)`` at scale 1,
    recomputed at `_rownorm_scale`'s scale only when its first result, the rows' squared norms,
    could have overflowed (above ``2**100``: an entry may exceed ``2**50``; also inf or NaN).

    ``amax`` is a thunk for the valid input's largest ``|entry|``, called only in the rescaled
    branch (a ``lax.cond``: on CPU, GPU and TPU only the taken branch runs), so the usual case
    costs no pass of its own. Returns ``stats(...) + (scale, eps)`` with ``stats`` a tuple.
    """
    one = jnp.ones((), jnp.float32)
    fast = stats(one, jnp.asarray(eps, jnp.float32))
    suspect = ~(jnp.max(fast[0]) <= 2.0 ** (2 * _HUGE_EXPONENT))  # also NaN / inf

    def rescaled():
        scale, eps_scaled = _rownorm_scale(amax(), eps)
        return stats(scale, eps_scaled) + (scale, eps_scaled)

    return lax.cond(suspect, rescaled, lambda: fast + (one, jnp.asarray(eps, jnp.float32)))


def _take_rows(x: jax.Array, axis: int, index: jax.Array) -> jax.Array:
    """``x``'s token rows at ``index`` (an int32 vector, in range) along ``axis``, as a gather.

    A few rows cost a few rows of memory traffic, not a pass over ``x``, under any mesh: the
    partitioner turns a gather along a sharded axis into a local gather and an all-reduce of
    the rows, where a slice would gather the whole array (Auto axes) or fail (Explicit axes,
    whose result sharding is then named here: the token axis replicated, the rest as ``x``).
    """
    where = tuple(index if i == axis else slice(None) for i in range(x.ndim))
    sharding = jax.typeof(x).sharding
    spec = tuple(getattr(sharding, "spec", ()) or ())
    out = None
    if axis < len(spec) and spec[axis] is not None:  # Explicit axes shard the token axis
        parts = list(spec) + [None] * (x.ndim - len(spec))
        parts[axis] = None
        out = NamedSharding(sharding.mesh, PartitionSpec(*parts))
    return x.at[where].get(mode="promise_in_bounds", out_sharding=out)


def _pivot(x: jax.Array, axis: int, num_valid: int, scale=1.0) -> jax.Array:
    """The mean of the first two valid token rows of ``x * scale`` (one row if there is one), a
    float32 point inside the row cloud that RowNorm centres around before taking the mean: for
    rows that are a large common vector plus a small spread, ``x_i - p`` is exact and the mean
    is then taken of small numbers (``x_i - fl(mean(x))`` would round at the scale of the
    common vector). Each row is halved before the sum (exact), so huge rows cannot overflow.
    Two rows rather than one also because XLA makes a one-row slice a view of ``x``, which then
    blocks writing a result in place over a donated ``x``."""
    k = min(2, num_valid)
    if not _token_axis_may_be_sharded(x, axis):
        # A static slice: the TPU compiler reads it in x's own layout. As a gather along the
        # minor axis of a (d, V) kernel it first copies the whole head into a transposed
        # layout (one read and one write more per step).
        rows = lax.slice_in_dim(x, 0, k, axis=axis)
    else:
        rows = _take_rows(x, axis, jnp.arange(k, dtype=jnp.int32))
    return jnp.sum(rows * (scale * (1.0 / k)), axis=axis, keepdims=True)


def _token_axis_may_be_sharded(x: jax.Array, axis: int) -> bool:
    """False only when tracing can tell the token axis is whole on every device: one device in
    the process, or an Explicit sharding that leaves the axis unsplit. (Auto axes under a mesh
    are invisible at trace time: keep the gather, which the partitioner handles locally.)"""
    if jax.device_count() == 1:
        return False
    sharding = jax.typeof(x).sharding
    mesh = getattr(sharding, "mesh", None)
    spec = tuple(getattr(sharding, "spec", ()) or ())
    if mesh is None or mesh.empty or not mesh.axis_types:
        return True
    explicit = all(t == AxisType.Explicit for t in mesh.axis_types)
    return not explicit or (axis < len(spec) and spec[axis] is not None)


def _out_of_range(d):
    """True where ``d`` may have over/underflowed in float32 (or is NaN/inf)."""
    return ~((d < 2.0**_SAFE_LOG2) & (d > 2.0**-_SAFE_LOG2))


def _replicated(x: jax.Array) -> jax.Array:
    """``x`` replicated over the devices of its sharding (a no-op on one device).

    The exact diameter's triangular scan reshapes the token axis into blocks and indexes them
    in a loop: Explicit sharding types forbid that reshape for a split axis, and with Auto axes
    the partitioner could gather blocks inside the loop. Gathering the ``O(V d)`` rows once is
    small next to the ``O(V^2 d)`` scan. The mesh is read from ``x``'s type, so this also works
    outside ``jax.set_mesh`` (arrays placed by ``jax.device_put`` or ``out_shardings``).
    """
    sharding = jax.typeof(x).sharding
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or mesh.size <= 1:
        return x
    replicated = NamedSharding(mesh, PartitionSpec())
    if any(part is not None for part in sharding.spec):  # Explicit axes: change the type
        x = jax.sharding.reshard(x, replicated)
    if any(kind == AxisType.Auto for kind in mesh.axis_types):
        # Auto axes: ask the partitioner for the gather. The barrier keeps the request from
        # propagating back to `x`'s producer, so an update computed from it stays sharded.
        x = lax.with_sharding_constraint(lax.optimization_barrier(x), replicated)
    return x
