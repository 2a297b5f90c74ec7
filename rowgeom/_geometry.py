"""Row diameter: the maths, no tree or device plumbing (Hilbert's distance: `rowgeom._hilbert`).

Math: a head ``W`` has one token row ``w_i`` per token; an update ``S`` has rows ``s_i`` and row
diameter ``D(S) = max_{i<j} ||s_i - s_j||``. Hilbert's projective distance between positive
vectors is ``d_H(p, q) = log max_i p_i/q_i - log min_i p_i/q_i``; for softmaxes it is the range of
the logit change (Lemma 1), so ``sup_{||h|| <= H} d_H(softmax(W h), softmax((W + S) h)) =
H * D(S)`` (Theorem 1).

Contract: `row_diameter` is exact (``O(V^2 d)``), `row_diameter_bounds` an ``O(V d)`` bracket
``lower <= D(S) <= upper``. Token rows are slices along ``vocab_axis``; every other
axis is flattened into features, so a Flax ``(d, V)`` Dense kernel uses ``vocab_axis=1`` and a
``(V, d)`` embedding ``vocab_axis=0``. Results are float32 whatever the input dtype, and finite
input never gives NaN (power-of-two rescaling, `rowgeom._numerics`). Each works under any
mesh and placement: the bracket reduces whole axes, multiplies by vectors and gathers single
rows (from their aligned 128-token block when the tokens are the minor axis of an unsharded
array: `_take_row`), so only vectors cross devices (in a process with one CPU device its centred
norms over a leading feature axis are `rowgeom._cpu.sq_dists`), and the exact diameter gathers
the rows once.

    >>> import jax.numpy as jnp, rowgeom
    >>> s = jnp.array([[0.0, 0.0], [3.0, 4.0]])
    >>> float(rowgeom.row_diameter(s, vocab_axis=0)), float(rowgeom.hilbert_perturbation(
    ...     s, jnp.array([0.6, 0.8]), vocab_axis=0))       # h* = (s_1 - s_0) / D attains H * D
    (5.0, 5.0)

References: arXiv 2608.22253 (Theorem 1); P. J. Bushell, "Hilbert's metric and positive
contraction mappings in a Banach space", Arch. Rational Mech. Anal. 52 (1973). Proofs and the
bracket's derivation: docs/geometry.md ("The row diameter is the worst case").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from rowgeom import _cpu
from rowgeom._numerics import (
    _out_of_range,
    _pow2_exponent,
    _replicated,
    _rescale_rows,
    _take_rows,
    _times_pow2,
    _token_axis_may_be_sharded,
)
from rowgeom._tree import (
    check_int,
    check_matrix_like,
)

_HIGHEST = lax.Precision.HIGHEST  # accelerators default to reduced-precision matmuls


def _rows_matrix(s: jax.Array, axis: int) -> jax.Array:
    """(V, F) float32 matrix: token rows along `axis`, all other axes flattened."""
    x = jnp.moveaxis(s, axis, 0)
    return x.reshape(x.shape[0], math.prod(x.shape[1:])).astype(jnp.float32)


def _block_rows(num_rows: int, block_size: int) -> tuple[int, int]:
    """(rows per block, number of blocks) for the triangular scan, at most `block_size` rows.

    The scan computes ``nb(nb+1)/2`` full ``B x B`` blocks for ``V(V+1)/2`` useful pairs; the
    excess is the diagonal blocks and the padding of the last block. Among multiples of 64 rows
    in ``[block_size/2, block_size]`` take the one computing the least, since matmul kernels tile
    multiples of 64 best. Tiny blocks are used as given.
    """
    if num_rows <= block_size:
        return num_rows, 1
    if block_size < 128:
        return block_size, -(-num_rows // block_size)

    def work(block):
        num_blocks = -(-num_rows // block)
        return num_blocks * (num_blocks + 1) // 2 * block * block

    block = min(range(block_size // 64 * 64, block_size // 2 - 1, -64), key=work)
    return block, -(-num_rows // block)


@functools.partial(jax.jit, static_argnames=("axis", "block_size"))
def _row_diameter(s, *, axis: int, block_size: int):
    x = _rows_matrix(_replicated(s), axis)
    num_rows, num_features = x.shape
    if num_rows <= 1:
        return jnp.zeros((), jnp.float32)
    # Centring keeps sq_i + sq_j - 2<x_i, x_j> from cancelling a large common offset; the
    # power-of-two scale (exact, O(Vd) next to the O(V^2 d) scan) keeps D^2 inside float32's
    # range for any finite input: D^2 of rows near 1e19 would overflow and inf - inf is NaN.
    x, exponent = _rescale_rows(x, 0)
    sq = jnp.sum(x * x, axis=1)
    block, num_blocks = _block_rows(num_rows, block_size)
    pad = block * num_blocks - num_rows
    # Padding rows get sq = -inf: every pair that touches one is -inf and loses the max, so the
    # loop needs no mask (their inner products are exactly 0, never inf - inf).
    x = jnp.pad(x, ((0, pad), (0, 0))).reshape(num_blocks, block, num_features)
    sq = jnp.pad(sq, (0, pad), constant_values=-jnp.inf).reshape(num_blocks, block)
    # Pre-transposed, pre-scaled right operand: each step is a plain (B, F) @ (F, B) matmul.
    xt = jnp.swapaxes(x, 1, 2) * -2.0
    rows, cols = np.triu_indices(num_blocks)  # only block pairs i <= j: half the work

    def step(best, ij):
        i, j = ij
        d2 = (sq[i][:, None] + sq[j][None, :]) + jnp.dot(x[i], xt[j], precision=_HIGHEST)
        return jnp.maximum(best, jnp.max(d2)), None

    pairs = (jnp.asarray(rows, jnp.int32), jnp.asarray(cols, jnp.int32))
    best, _ = lax.scan(step, jnp.zeros((), jnp.float32), pairs)
    # Rounding can make D^2 slightly negative; NaN (non-finite input) propagates through max.
    return _times_pow2(jnp.sqrt(jnp.maximum(best, 0.0)), exponent)


def row_diameter(s, *, vocab_axis: int, block_size: int = 1024) -> jax.Array:
    """Exact row diameter ``D(S) = max_{i<j} ||s_i - s_j||_2`` as a float32 scalar.

    Rows are centred, ``sq_i = ||x_i||^2``, and ``D^2 = max_{i<=j} sq_i + sq_j - 2<x_i, x_j>``
    is reduced over a triangular scan of row-block pairs ``i <= j``: ``O(V^2 d)`` time, memory
    ``O(V d + block^2)`` (two float32 copies of the rows and one block of pair distances, never
    a ``V x V`` matrix). ``D^2`` is clamped at 0 before the square root. Computed in float32
    (matmuls at ``Precision.HIGHEST``) whatever the input dtype; ``V = 1`` gives 0. Rows are
    rescaled by a power of two (exact), so every finite input gets its true ``D`` (``inf`` only
    when ``D`` exceeds float32's range); a NaN or inf entry gives NaN.

    Args:
      s: update or weight, rank >= 2, floating. Token rows are slices along ``vocab_axis``.
      vocab_axis: the token (vocabulary) axis, e.g. 1 for a Flax ``(d, V)`` kernel.
      block_size: most rows per block (``V`` need not be a multiple; padding is masked).

    Returns:
      Float32 scalar ``D(S)``. By Theorem 1, ``H * D(S)`` is the largest Hilbert-distance change
      of the softmax over hidden states with ``||h|| <= H``.

    Examples:
      >>> import jax.numpy as jnp, rowgeom
      >>> s = jnp.array([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0]])   # (V, d): 3 token rows
      >>> float(rowgeom.row_diameter(s, vocab_axis=0))
      5.0
      >>> float(rowgeom.row_diameter(s.T, vocab_axis=1))        # Flax (d, V) layout
      5.0
      >>> shifted = s + jnp.array([[10.0, -2.0]])              # the same vector on every row
      >>> float(rowgeom.row_diameter(shifted, vocab_axis=0))    # invisible to the softmax
      5.0
    """
    axis = check_matrix_like(s, argname="s", vocab_axis=vocab_axis)
    block_size = check_int(block_size, argname="block_size", minimum=1)
    return _row_diameter(s, axis=axis, block_size=block_size)


def _token_view(s, axis: int) -> tuple[jax.Array, int]:
    """A free float32 view of the token rows and its token axis ``t``: ``(V, F)`` (``t = 0``)
    when the tokens come first, ``(F, V)`` (``t = 1``) when they come last, else ``(A, V, B)``
    (``t = 1``). No unit axes: XLA copies a head just written in place over a donated buffer
    when it is then reduced through a view with one."""
    shape = jnp.shape(s)
    if axis == 0:
        view, t = s.reshape(shape[0], math.prod(shape[1:])), 0
    elif axis == len(shape) - 1:
        view, t = s.reshape(math.prod(shape[:-1]), shape[-1]), 1
    else:
        view, t = s.reshape(math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])), 1
    return view.astype(jnp.float32), t


def _features(x: jax.Array, t: int) -> tuple[int, ...]:
    return tuple(i for i in range(x.ndim) if i != t)


def _sq_dists(x: jax.Array, t: int, point: jax.Array, impl: str = "xla") -> jax.Array:
    """``||x_v - p||^2`` per token ``v`` of a `_token_view` ``x``; ``point`` is shaped like ``x``
    with a unit token axis.

    A plain reduction over whole axes: under a mesh only a reduced vector crosses devices (a
    ``V``-vector for a feature-sharded head). With ``impl="cpu"`` (a resolved `rowgeom._cpu`
    formulation) a leading feature axis is reduced by `rowgeom._cpu.sq_dists` instead (the same
    function), because XLA:CPU reduces a leading axis as a slow strided loop.
    """
    if impl == "cpu" and t == 1 and x.shape[0] > 1:
        return _cpu.sq_dists(x, point)
    return _masked_sq_dists(x, t, point)


def _masked_sq_dists(x: jax.Array, t: int, point: jax.Array) -> jax.Array:
    """`_sq_dists` as one reduction over whole axes (any device, any mesh)."""
    return jnp.sum(jnp.square(x - point), axis=_features(x, t))


def _sweep_sq_dists(x: jax.Array, t: int, centre, sq_centred, row, ka=0, kb=0) -> jax.Array:
    """``||x_v - r||^2`` per token of a `_token_view` ``x`` for one of its rows ``r``, from the
    centred squared norms ``sq_centred = ||x_v - c||^2`` (``c = centre``) already at hand:
    ``||x_v - c||^2 - 2 (x_v - c)·(r - c) + ||r - c||^2`` with ``(x_v - c)·u = x_v·u - c·u``.

    With power-of-two exponents ``ka``, ``kb`` (int scalars, 0 by default) the rows are taken at
    the scale of the rescaled bracket: ``sq_centred`` holds ``||(x_v 2^ka - centre) 2^kb||^2``
    and so does the result for ``(x_v - r) 2^(ka + kb)``; the matrix-vector product then reads
    ``x`` as it is (a scaled copy would be a pass of its own) and the scales go to vectors.

    One matrix-vector product over the feature axes: a single read of ``x`` in either layout,
    at memory speed on every backend (XLA:CPU runs the direct reduction over a leading feature
    axis as a slow strided loop), and under a mesh it moves a ``V``-vector at most. Its
    rounding, about ``eps (||c|| + ||x_v - c||) ||u||`` per token, only decides which row a sweep
    moves to: the bracket records the distance of the pair it picked, computed directly.
    """
    scaled = not (isinstance(ka, int) and isinstance(kb, int) and ka == kb == 0)
    if scaled:
        u = _times_pow2(_times_pow2(row, ka) - centre, kb)  # the row centred, at the scale
        half = jnp.asarray(ka, jnp.int32) // 2  # x_v·(u 2^half) neither overflows nor flushes
        v = _times_pow2(u, half)
    else:
        u = v = row - centre
    feat = _features(x, t)
    sharding = jax.typeof(x).sharding
    spec = tuple(getattr(sharding, "spec", ()) or ())
    out = None
    if any(part is not None for part in spec):  # Explicit axes: the tokens' sharding, summed
        out = NamedSharding(sharding.mesh, PartitionSpec(spec[t] if t < len(spec) else None))
    dot = lax.dot_general(x, jnp.squeeze(v, t), ((feat, tuple(range(v.ndim - 1))), ((), ())),
                          precision=_HIGHEST, out_sharding=out)
    if scaled:  # (x_v 2^ka - centre)·u 2^kb, the scales applied to V-vectors and scalars
        dot = _times_pow2(dot, ka - half + kb)
        offset = _times_pow2(jnp.sum(centre * u), kb)
    else:
        offset = jnp.sum(centre * u)
    return sq_centred - 2.0 * (dot - offset) + jnp.sum(u * u)


_LANES = 128  # a TPU tile's minor dimension


def _take_row(x: jax.Array, t: int, index: jax.Array) -> jax.Array:
    """``x``'s token row ``index`` (an int32 scalar, in range), shaped like ``x`` with a unit
    token axis: `rowgeom._numerics._take_rows` of one row, except for tokens along the minor
    axis of an unsharded ``x`` (a Flax ``(d, V)`` kernel). A gather of one column there makes
    the TPU compiler copy the whole head into a transposed layout first (one read and one write
    more per step); a gather of the aligned block of 128 columns holding it reads ``x`` in its
    own layout, and the row is then picked from that block (``128 d`` elements).
    """
    num_rows = x.shape[t]
    if t != x.ndim - 1 or num_rows < _LANES or _token_axis_may_be_sharded(x, t):
        return _take_rows(x, t, index[None])
    start = jnp.minimum(index // _LANES * _LANES, num_rows - _LANES)
    dnums = lax.GatherDimensionNumbers(offset_dims=tuple(range(x.ndim)),
                                       collapsed_slice_dims=(), start_index_map=(t,))
    block = lax.gather(x, start[None], dnums, x.shape[:t] + (_LANES,),
                       mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    pick = lax.broadcasted_iota(jnp.int32, block.shape, t) == index - start
    # A select, not a product with a one-hot: a NaN or inf elsewhere in the block stays there.
    return jnp.sum(jnp.where(pick, block, 0.0), axis=t, keepdims=True)


def _pair_distance(a: jax.Array, b: jax.Array) -> jax.Array:
    """``||a - b||_2`` of two rows, exact up to rounding for any finite rows: the difference
    (halved when it overflows) is rescaled by a power of two before it is squared."""
    diff = a - b
    finite = jnp.all(jnp.isfinite(diff))
    diff = jnp.where(finite, diff, a * 0.5 - b * 0.5)
    exponent = _pow2_exponent(diff)
    norm = jnp.sqrt(jnp.sum(jnp.square(_times_pow2(diff, -exponent))))
    return _times_pow2(norm, exponent + jnp.where(finite, 0, 1))


def _max_index_sum(n2: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(max(n2), argmax(n2), sum(n2))`` of a per-token vector, as one three-operand reduction.

    Plain ``jnp.max``/``jnp.sum`` of a vector that is itself a row reduction get fused by
    XLA:CPU into one nested reduction over the whole ``(V, d)`` array, much slower than the two
    apart; a multi-operand reduction is never fused that way. NaN propagates to
    the max (and the argmax is the first NaN), as with ``jnp.max`` / ``jnp.argmax``.
    """
    def combine(a, b):
        (a_max, a_idx, a_sum), (b_max, b_idx, b_sum) = a, b
        take_a = (a_max > b_max) | jnp.isnan(a_max) | ((a_max == b_max) & (a_idx < b_idx))
        return (jnp.where(take_a, a_max, b_max), jnp.where(take_a, a_idx, b_idx),
                a_sum + b_sum)

    index = lax.iota(jnp.int32, n2.shape[0])
    init = (jnp.array(-jnp.inf, n2.dtype), jnp.array(0, jnp.int32), jnp.array(0, n2.dtype))
    return lax.reduce((n2, index, n2), init, combine, (0,))


def _centroid_sq_dists(x: jax.Array, t: int, total: jax.Array | None = None,
                       impl: str = "xla"):
    """``(c, ||x_i - c||^2 per token)`` of a `_token_view`, ``c`` its centroid; ``total``: the
    rows' sum (``c * V``) when already at hand."""
    if total is None:
        total = jnp.sum(x, axis=t, keepdims=True)
    centre = total / x.shape[t]
    return centre, _sq_dists(x, t, centre, impl)


def _upper_bound(s, axis: int, impl: str = "xla") -> jax.Array:
    """``2 max_i ||s_i - sbar|| >= D(S)``, O(Vd); 0 for V = 1.

    Recomputed on power-of-two rescaled rows only when the result is outside
    ``[2^-60, 2^60]`` (squares may have over/underflowed), so the usual case costs one pass.
    """
    x, t = _token_view(s, axis)
    impl = _cpu.resolve_impl(impl, s)
    bound = lambda x: 2.0 * jnp.sqrt(_max_index_sum(
        _centroid_sq_dists(x, t, impl=impl)[1])[0])
    fast = bound(x)

    def rescaled(x):
        y, exponent = _rescale_rows(x, t)
        return _times_pow2(bound(y), exponent)

    return lax.cond(_out_of_range(fast), rescaled, lambda x: fast, x)


def _bounds(s, *, axis: int, sweeps: int, impl: str = "xla"):
    return _bounds_and_sum(s, axis=axis, sweeps=sweeps, impl=impl)[:2]


def _bounds_and_sum(s, *, axis: int, sweeps: int, impl: str = "xla"):
    """``(lower, upper, row_sum)``: the bracket and ``sum_i s_i`` (float32, shape of one token
    row), which the bracket's centroid needs anyway: one pass fewer for the tracker. ``impl``:
    `rowgeom._cpu.IMPLS`, resolved here for ``s``."""
    return _jitted_bounds_and_sum(s, axis=axis, sweeps=sweeps,
                                  impl=_cpu.resolve_impl(impl, s))


@functools.partial(jax.jit, static_argnames=("axis", "sweeps", "impl"))
def _jitted_bounds_and_sum(s, *, axis: int, sweeps: int, impl: str):
    x, t = _token_view(s, axis)
    total = jnp.sum(x, axis=t, keepdims=True)
    row_sum = total.reshape(s.shape[:axis] + s.shape[axis + 1:])
    if x.shape[t] <= 1:
        zero = jnp.zeros((), jnp.float32)
        return zero, zero, row_sum
    return _bounds_of_view(s, axis, sweeps=sweeps, total=total, impl=impl) + (row_sum,)


def _rescaled_centred_norms(s, axis: int, centre):
    """``(p, ||d_v||^2 per token, ka, kb)`` with ``d_v = (x_v 2^ka - p) 2^kb`` the centred rows
    of ``s``'s `_token_view` ``x`` at a power-of-two scale (exact) where ``max |d|`` is about 1,
    so that their squares neither overflow nor underflow: two reads of ``x``.

    The first read takes, as sibling reductions over the token axis (one pass on TPU), the
    largest ``|x - centre|`` (``centre``: the rows' mean from their sum, as rounded), the largest
    ``|x|`` and the sum of ``x 2^-ceil(log2 V)``, which cannot overflow. Usually ``x - centre``
    is finite: ``p = centre``, ``ka = 0`` and ``2^kb`` brings its largest entry to ``[0.5, 1)``,
    however small the rows' spread. Otherwise (the sum or the centring overflowed) ``2^ka``
    brings ``max |x|`` to ``[0.5, 1)`` and ``p`` is the mean of those scaled rows, from the
    scaled sum. The second read is the squared norms.
    """
    x, t = _token_view(s, axis)
    num_rows = x.shape[t]
    log2_h = -max(num_rows - 1, 1).bit_length()  # V 2^log2_h <= 1: the scaled sum is finite
    spread = jnp.max(jnp.abs(x - centre), axis=t)
    amax = jnp.max(jnp.abs(x), axis=t)
    scaled_sum = jnp.sum(x * 2.0**log2_h, axis=t, keepdims=True)
    spread, amax = jnp.max(spread), jnp.max(amax)
    centred = jnp.isfinite(spread)  # also False for NaN, which then reaches the norms
    e_spread, e_amax = _pow2_exponent(spread), _pow2_exponent(amax)
    ka = jnp.where(centred, 0, -e_amax)
    kb = jnp.where(centred, -e_spread, 0)
    mean = _times_pow2(scaled_sum / num_rows, -log2_h - e_amax)  # max |mean| <= 1
    p = jnp.where(centred, centre, mean)
    d = _times_pow2(_times_pow2(x, ka) - p, kb)
    # A barrier on the (small) results: XLA's conditional simplifier inlines a branch made only
    # of reductions and elementwise ops into selects, so XLA:GPU would run these two reads on
    # every call; a barrier is not such an op, and costs nothing.
    return lax.optimization_barrier((p, jnp.sum(jnp.square(d), axis=_features(x, t)), ka, kb))


def _bounds_of_view(s, axis: int, *, sweeps: int, total=None, impl: str = "xla"):
    """``(lower, upper)`` of ``s`` (see `row_diameter_bounds`), from its `_token_view`.

    The passes over ``x`` the algorithm needs and no more: its sum (the centroid; skipped when
    ``total`` is given), the centred squared norms, and one matrix-vector product per sweep
    (`_sweep_sq_dists`); a sweep's own rows are gathered (`_take_row`). Only the centred
    norms can over/underflow float32 (their squares; the pair lengths are rescaled): when the
    upper end is outside ``[2^-60, 2^60]`` a branch recomputes them at a power-of-two scale
    (`_rescaled_centred_norms`, two reads) and the sweeps work at that scale. The sweeps run
    after the branch, once, whichever it took.
    """
    x, t = _token_view(s, axis)
    num_rows = x.shape[t]
    if num_rows <= 1:
        zero = jnp.zeros((), jnp.float32)
        return zero, zero
    if total is None:
        total = jnp.sum(x, axis=t, keepdims=True)
    centre = total / num_rows
    sq_centred = _sq_dists(x, t, centre, impl)
    zero = jnp.zeros((), jnp.int32)
    fast = (centre, sq_centred, zero, zero)
    # The operand is `s` itself, not its view: inside one program with the step that produced
    # `s`, XLA materialised the view as a second full-size buffer for the conditional.
    suspect = _out_of_range(2.0 * jnp.sqrt(_max_index_sum(sq_centred)[0]))
    centre, sq_centred, ka, kb = lax.cond(
        suspect, lambda s: _rescaled_centred_norms(s, axis, centre), lambda s: fast, s)
    top, anchor, sum_n2 = _max_index_sum(sq_centred)
    r_c = jnp.sqrt(top)  # at the scale 2^(ka + kb): the bounds are scaled back at the end
    unscale = -(ka + kb)
    upper = _times_pow2(2.0 * r_c, unscale)  # 2 max_i ||x_i - c|| >= D for *any* point c
    if sweeps == 0:
        # Lower bounds that hold for the exact centroid only (see row_diameter_bounds).
        lower = jnp.maximum(r_c, math.sqrt(2 / (num_rows - 1)) * jnp.sqrt(sum_n2))
        return jnp.minimum(_times_pow2(lower, unscale), upper), upper
    # Farthest-point sweeps from the row farthest from the centroid: each one is the length of
    # an actual pair, hence a lower bound whatever the centroid's rounding, and usually lands on
    # (or near) a diametral pair. The first sweep is >= ||x_a - xbar|| (the mean lies in the
    # rows' hull), so it already dominates the centroid's own lower bounds.
    def sweep(_, carry):
        lower, anchor = carry
        row = _take_row(x, t, anchor)
        far = _max_index_sum(_sweep_sq_dists(x, t, centre, sq_centred, row, ka, kb))[1]
        pair = _pair_distance(_take_row(x, t, far), row)
        return jnp.maximum(lower, pair), far

    # A loop, not unrolled: its body reads x's buffer as it is. Unrolled, XLA would recompute
    # the gathered rows from x's producer, and for a head step written in place over its
    # donated input, read that input after it was overwritten (so copy it first).
    lower, _ = lax.fori_loop(0, sweeps, sweep, (jnp.zeros((), jnp.float32), anchor))
    # Equal in exact arithmetic when D = 2 r_c (e.g. V = 2); keep the order under rounding.
    return jnp.minimum(lower, upper), upper


def row_diameter_bounds(s, *, vocab_axis: int, sweeps: int = 2,
                        impl: str = "xla") -> tuple[jax.Array, jax.Array]:
    """An ``O(V d)`` bracket ``lower <= D(S) <= upper`` (float32 scalars).

    With centred rows ``x_i = s_i - xbar``, ``r_c = max_i ||x_i||``, ``rms_c^2 = mean ||x_i||^2``:
    ``upper = 2 r_c`` and ``lower = max(r_c, sqrt(2V/(V-1)) rms_c, farthest-point sweeps)``.
    Each sweep is one ``O(Vd)`` pass, a matrix-vector product: from the current anchor (first,
    the row farthest from the centroid) find the farthest row, record that pair's distance
    (computed from the two rows) and move the anchor there. The upper
    end is at most 2x the diameter (``r_c <= D``); how tight both ends are on head steps is
    measured on the benchmarks page (docs/benchmarks.md). ``V = 1`` gives ``(0, 0)``.

    With ``sweeps >= 1`` the lower end is the length of an actual pair of rows, so it stays a
    lower bound when the float32 centroid is rounded (rows sharing a common offset much larger
    than their spread); it is never below ``r_c`` (up to float32 rounding of the distances that
    pick a sweep's row). With ``sweeps=0`` it is the centroid bound
    ``max(r_c, sqrt(2V/(V-1)) rms_c)``, which such rounding can push above ``D``. The upper end
    holds for any centre, rounded or not.

    Args:
      s: rank >= 2 floating array with token rows along ``vocab_axis``.
      vocab_axis: the token axis.
      sweeps: number of farthest-point sweeps (0 keeps only the centroid bounds, see above).
      impl: ``"xla"`` (whole-axis reductions: any backend, any mesh), ``"cpu"`` (the XLA:CPU
        formulation of the centred norms over a leading feature axis; an array on one device
        only) or ``"auto"`` (decided for ``s`` when traced: `rowgeom._cpu.resolve_impl`).

    Examples:
      >>> import jax.numpy as jnp, rowgeom
      >>> s = jnp.array([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0]])
      >>> lower, upper = rowgeom.row_diameter_bounds(s, vocab_axis=0)
      >>> round(float(lower), 4), round(float(upper), 4)       # exact D is 5
      (5.0, 5.7349)
    """
    axis = check_matrix_like(s, argname="s", vocab_axis=vocab_axis)
    sweeps = check_int(sweeps, argname="sweeps", minimum=0)
    return _bounds(s, axis=axis, sweeps=sweeps, impl=_cpu.check_impl(impl))
