"""Projected RowNorm for the LM head: ``S = P · rownorm(P · u)``, ``P = I_V - 11ᵀ/V``.

Contract: `project_rownorm` (one array) and `projected_rownorm` (the stateless optax transform)
centre the token rows, scale each to at most unit length (``x / max(||x||, eps)``, zero rows stay
zero) and centre again, in float32, returning the input's dtype and sign: ``D(S) <= 2`` and
``1ᵀS = 0``. Put it after momentum and before ``optax.scale_by_learning_rate`` (radius
``r = lr``). ``vocab_axis`` has no default: normalising over the wrong axis is silently wrong.

Why this is the common-ball steepest-descent step and how close it is to the exact one: the
geometry page (docs/geometry.md); its conventions (eps, padding, huge inputs, bf16, tied heads):
that page's "Edge cases"; the CPU and mesh formulations and their cost: docs/benchmarks.md.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.typing import ArrayLike

from rowgeom import _native
from rowgeom._geometry import _row_diameter, _upper_bound
from rowgeom._numerics import single_device_trace
from rowgeom._tree import map_head_leaves, vocab_axes
from rowgeom._validation import canonical_axis, check_floating, check_min_rank

_RESCALE_MODES = (None, "exact", "bound")
# A diameter below this is treated as zero by `rescale` (2/D would overflow float32).
_MIN_DIAMETER = 1e-30
_DIAMETER_BLOCK = 1024  # rows per block of the exact diameter's triangular scan
# CPU path: rows per block are chosen so that one block of float32 rows stays in cache while
# the two per-block reductions (row norms, weighted column sum) read it.
_BLOCK_BYTES = 4 * 2**20
# (d, V) path: feature rows per slab, read once for their mean and the token norms and once
# to be reduced and written. At most 4 MiB and 16 rows (the squares are accumulated in one
# unrolled fusion; 16 rows of 50304 tokens measured best among 4-20 rows).
_SLAB_BYTES = 4 * 2**20
_SLAB_ROWS = 16
# Inputs with entries above 2**_HUGE_EXPONENT are scaled by a power of two first (exact: the
# result is invariant to it, with eps scaled alike), so squared row norms (d < 2**26 terms) and
# the centring never overflow float32; scaled, the largest entry is about 2**20.
_HUGE_EXPONENT = 50
_TINY = float(np.finfo(np.float32).tiny)


_STATIC_HINT = ("under optax.inject_hyperparams list it in static_args, e.g. "
                "static_args=('vocab_axis', 'eps', 'num_valid', 'rescale')")


def _check_eps(eps) -> float:
    if isinstance(eps, jax.core.Tracer):  # injected as a hyperparameter, under jit
        raise TypeError(f"eps must be a Python float, got a traced array; {_STATIC_HINT}")
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"eps must be a positive float, got {eps!r}") from None
    tiny = float(np.finfo(np.float32).tiny)
    if not (math.isfinite(value) and value >= tiny):
        # Below float32's smallest normal, 1/eps overflows and a zero row would become 0*inf.
        raise ValueError(f"eps must be a finite float >= {tiny:.3g} (float32 tiny), got {eps!r}")
    return value


def _check_num_valid(num_valid, vocab_size: int | None = None) -> int | None:
    if num_valid is None:
        return None
    if isinstance(num_valid, jax.core.Tracer):
        raise TypeError(f"num_valid must be a Python int or None, got a traced array; "
                        f"{_STATIC_HINT}")
    try:
        value = operator.index(num_valid)
    except TypeError:
        raise TypeError(f"num_valid must be an int or None, got {num_valid!r}") from None
    if value < 1 or (vocab_size is not None and value > vocab_size):
        upper = "V" if vocab_size is None else str(vocab_size)
        raise ValueError(f"num_valid must satisfy 1 <= num_valid <= {upper} (the vocabulary "
                         f"size along vocab_axis), got {value}")
    return value


def _row_vector(w, ndim: int, axis: int):
    """Reshapes per-row values (V,) to broadcast along `axis` of a rank-`ndim` array."""
    return w.reshape(tuple(-1 if i == axis else 1 for i in range(ndim)))


def _overflow_guard(amax, eps):
    """``(huge, scale, eps)``: scale 1 and eps unchanged for ordinary input; for ``amax`` above
    ``2**_HUGE_EXPONENT`` a power of two bringing it to ~2**20, and eps scaled alike."""
    huge = amax > 2.0**_HUGE_EXPONENT
    scale = jnp.where(huge, jnp.exp2(20.0 - jnp.floor(jnp.log2(jnp.where(huge, amax, 1.0)))),
                      1.0)
    return huge, scale, jnp.where(huge, jnp.maximum(eps * scale, _TINY), eps)


def _pivot(x, axis: int, num_valid: int, scale=1.0):
    """A float32 point inside the row cloud: the mean of the first two valid rows.

    Centring is computed as ``(x_i - p) - mean(x - p)``: for rows that are a large common vector
    plus a small spread, ``x_i - p`` is exact and the mean is taken of small numbers, so the
    centred rows keep their accuracy (``x_i - fl(mean(x))`` would not: the mean itself rounds at
    the scale of the common vector). Identical rows give exactly zero. Two rows rather than one
    because XLA turns a single-row slice into a view of ``x``, which then blocks writing the
    result in place over a donated input.
    """
    k = min(2, num_valid)
    rows = lax.slice_in_dim(x, 0, k, axis=axis) * scale
    return jnp.sum(rows, axis=axis, keepdims=True) * (1.0 / k)


def _reference_path(x, axis, *, eps, center_input, center_output, num_valid):
    """Straightforward formulation (accelerators, sharded arrays): a few fused reductions.

    Masks instead of slices along the vocabulary axis, so a vocabulary-sharded array only
    all-reduces d-vectors (the pivot, the two means); row norms stay local to each shard.
    """
    vocab = x.shape[axis]
    feat = tuple(i for i in range(x.ndim) if i != axis)
    token = _row_vector(jnp.arange(vocab), x.ndim, axis)
    zero = jnp.zeros((), jnp.float32)
    valid = token < num_valid if num_valid < vocab else None

    def mask(v):  # padding rows may hold anything (even inf): never let them into a sum
        return v if valid is None else jnp.where(valid, v, zero)

    xc = mask(x)
    _, scale, eps = _overflow_guard(jnp.max(jnp.abs(xc)), eps)
    xc, x = xc * scale, x * scale
    if center_input:
        k = min(2, num_valid)
        pivot = jnp.sum(jnp.where(token < k, x, zero), axis=axis, keepdims=True) * (1.0 / k)
        d = mask(xc - pivot)
        xc = mask(d - jnp.sum(d, axis=axis, keepdims=True) / num_valid)
    w = 1.0 / jnp.maximum(jnp.sqrt(jnp.sum(xc * xc, axis=feat, keepdims=True)), eps)
    y = xc * w
    if center_output:
        y = mask(y - jnp.sum(y, axis=axis, keepdims=True) / num_valid)
    return y


def _blocked_path(x, axis, *, eps, center_input, center_output, num_valid, block_rows=None):
    """The XLA formulation on one CPU device, where the native kernel is not used (no compiler,
    ``ROWGEOM_NATIVE=0``, a middle vocabulary axis) and for its derivative: no full-size
    temporary, result written in place.

    The exact algorithm needs the column mean ``m`` (one read), the squared row norms
    ``||x_i - m||²`` and the weighted column sum ``s = Σ_i (x_i - m) / n_i`` of the output
    centring, and the write ``(x_i - m) / n_i - s / N`` (a read and a write, in place over a
    donated input). XLA:CPU reduces quickly only along the contiguous axis of a materialised
    buffer (a reduction fused with an elementwise producer, or over a leading axis, runs as a
    slow generic loop), so each layout walks the array its own way:

    - token rows contiguous (a ``(V, d)`` table, ``_token_rows``): three reads and a write.
      Pass 1 sums cache-sized blocks of rows for ``m``; pass 2 takes the block norms and
      accumulates ``s`` (a vector-matrix product on the block); pass 3 is elementwise.
    - tokens contiguous (a Flax ``(d, V)`` kernel, ``vocab_axis`` last, ``_tokens_minor``): two
      reads and a write. A slab of feature rows holds every token's value of those features,
      so one walk over slabs gives their means and accumulates the token norms, and a second
      takes each slab's part of ``s`` just before writing it.

    Measured at (50304, 768) float32 on 2 shared cores (steady state, interleaved, best of 15):
    5.1x a donated ``x * 0.5`` for ``(V, d)`` and 5.7x for ``(d, V)``, against 3.1-3.3x and
    2.0-2.6x for the native kernel in the same run (benchmarks/bench_rownorm.py). What remains
    is XLA:CPU's reduction speed (about half of memory bandwidth), not traffic.

    The norms use ``||x_i - m||`` directly: the expanded ``||x_i||² - 2 x_i·m + ||m||²`` would
    fold pass 2 into pass 1 but cancels catastrophically for rows near their mean. The overflow
    guard costs no pass: squared norms above ``2**100`` (or inf/NaN) mean an entry may exceed
    ``2**50``, and only then is everything recomputed on power-of-two scaled input.
    """
    if axis == x.ndim - 1 and x.ndim >= 2:
        flat = x.reshape(-1, x.shape[-1])  # free: the tokens stay the contiguous axis
        return _tokens_minor(flat, eps=eps, center_input=center_input,
                             center_output=center_output, num_valid=num_valid,
                             slab_rows=block_rows).reshape(x.shape)
    return _token_rows(x, axis, eps=eps, center_input=center_input,
                       center_output=center_output, num_valid=num_valid, block_rows=block_rows)


def _guarded(stats, x_valid, eps):
    """``stats(scale, eps)`` at scale 1, redone at the overflow guard's scale when needed.

    ``stats`` returns a tuple whose first entry is the valid rows' squared norms.
    """
    fast = stats(jnp.ones((), jnp.float32), jnp.asarray(eps, jnp.float32))
    suspect = ~(jnp.max(fast[0]) <= 2.0 ** (2 * _HUGE_EXPONENT))  # also NaN / inf

    def rescaled():
        _, scale, eps_scaled = _overflow_guard(jnp.max(jnp.abs(x_valid())), eps)
        return stats(scale, eps_scaled) + (scale, eps_scaled)

    return lax.cond(suspect, rescaled,
                    lambda: fast + (jnp.ones((), jnp.float32), jnp.asarray(eps, jnp.float32)))


def _in_cache(block):
    """Materialises a cache-sized block before it is reduced: XLA:CPU runs a plain reduction
    of a buffer through its fast kernel, but one fused with an elementwise producer as a slow
    generic loop (measured: the (V, d) path takes ~0.7x the time with this barrier)."""
    return lax.optimization_barrier(block)


def _token_rows(x, axis, *, eps, center_input, center_output, num_valid, block_rows):
    """Token rows contiguous (vocab axis not last): blocks of rows, reduced along the rows."""
    ndim, vocab = x.ndim, x.shape[axis]
    feat = tuple(i for i in range(ndim) if i != axis)
    f32 = jnp.float32
    if block_rows is None:
        block_rows = max(8, _BLOCK_BYTES // (4 * max(1, x.size // vocab)))
    num_blocks, tail = divmod(num_valid, block_rows)
    col_shape = tuple(1 if i == axis else n for i, n in enumerate(x.shape))

    def fold_rows(fn, acc):
        """acc = fn(acc, rows, start) over the valid rows, one cache-sized block at a time."""
        def body(i, acc):
            start = i * block_rows
            return fn(acc, lax.dynamic_slice_in_dim(x, start, block_rows, axis=axis), start)

        if num_blocks == 1:
            acc = body(0, acc)
        elif num_blocks > 1:
            acc = lax.fori_loop(0, num_blocks, body, acc)
        if tail:
            start = num_blocks * block_rows
            acc = fn(acc, lax.slice_in_dim(x, start, num_valid, axis=axis), start)
        return acc

    def stats(scale, eps):
        if center_input:
            pivot = _pivot(x, axis, num_valid, scale)
            total = fold_rows(
                    lambda acc, rows, _: acc + jnp.sum(_in_cache(rows * scale - pivot), axis=axis,
                                                       keepdims=True),
                    jnp.zeros(col_shape, f32))
            shift = (pivot, total / num_valid)
        else:
            shift = (jnp.zeros(col_shape, f32), jnp.zeros(col_shape, f32))

        def norms_and_sum(carry, rows, start):
            acc, sq = carry
            xc = _in_cache((rows * scale - shift[0]) - shift[1])
            n2 = jnp.sum(xc * xc, axis=feat)
            if center_output:
                w = 1.0 / jnp.maximum(jnp.sqrt(n2), eps)
                s = lax.dot_general(w, xc, (((0,), (axis,)), ((), ())))
                acc = acc + s.reshape(col_shape)
            return acc, lax.dynamic_update_slice_in_dim(sq, n2, start, axis=0)

        acc, sq = fold_rows(norms_and_sum,
                            (jnp.zeros(col_shape, f32), jnp.zeros((num_valid,), f32)))
        return sq, shift, acc

    sq, shift, acc, scale, eps = _guarded(
            stats, lambda: lax.slice_in_dim(x, 0, num_valid, axis=axis), eps)
    weights = 1.0 / jnp.maximum(jnp.sqrt(sq), eps)
    if num_valid < vocab:
        weights = jnp.pad(weights, (0, vocab - num_valid))
    y = ((x * scale - shift[0]) - shift[1]) * _row_vector(weights, ndim, axis)
    if center_output:
        y = y - acc / num_valid
    if num_valid < vocab:
        valid = _row_vector(jnp.arange(vocab) < num_valid, ndim, axis)
        y = jnp.where(valid, y, jnp.zeros((), f32))
    return y


def _tokens_minor(x, *, eps, center_input, center_output, num_valid, slab_rows):
    """Tokens contiguous: ``x`` is ``(F, V)``, one feature per row (a Flax ``(d, V)`` kernel).

    A slab of feature rows holds every token's value of those features, so the column mean of
    those features is known as soon as the slab is read: passes 1 and 2 become one walk over
    slabs (row sums, then squares accumulated into the token norms while the slab is in
    cache), and pass 3 likewise takes each slab's weighted sum just before writing it. Row sums
    are matrix-vector products on the slab: XLA:CPU runs a row reduction fused with any
    elementwise producer as a serial chain, ~30x slower than memory bandwidth.
    """
    feats, vocab = x.shape
    f32 = jnp.float32
    if slab_rows is None:
        slab_rows = min(_SLAB_ROWS, _SLAB_BYTES // (4 * vocab))
    slab_rows = max(1, min(feats, slab_rows))
    num_slabs, tail = divmod(feats, slab_rows)
    ones = jnp.ones((num_valid,), f32)

    def over_slabs(fn, carry):
        """carry = fn(carry, start, size) over slabs of feature rows (a loop, then the tail)."""
        if num_slabs == 1:
            carry = fn(carry, 0, slab_rows)
        elif num_slabs > 1:
            carry = lax.fori_loop(0, num_slabs, lambda i, c: fn(c, i * slab_rows, slab_rows),
                                  carry)
        if tail:
            carry = fn(carry, num_slabs * slab_rows, tail)
        return carry

    def rows_of(y, start, size):
        return lax.dynamic_slice_in_dim(y, start, size, axis=0)

    def stats(scale, eps):
        k = min(2, num_valid)

        def slab_stats(carry, start, size):
            sq, shift_p, shift_m = carry
            rows = rows_of(x, start, size)[:, :num_valid] * scale
            if center_input:
                p = jnp.sum(rows[:, :k], axis=1, keepdims=True) * (1.0 / k)
                d = rows - p
                m = (jnp.dot(d, ones) / num_valid)[:, None]
                d = d - m
                shift_p = lax.dynamic_update_slice_in_dim(shift_p, p[:, 0], start, axis=0)
                shift_m = lax.dynamic_update_slice_in_dim(shift_m, m[:, 0], start, axis=0)
            else:
                d = rows
            for a in range(size):  # unrolled: one fused elementwise loop, no row reduction
                sq = sq + jnp.square(d[a])
            return sq, shift_p, shift_m

        zeros = jnp.zeros((feats,), f32)
        return over_slabs(slab_stats, (jnp.zeros((num_valid,), f32), zeros, zeros))

    sq, pivot, mean, scale, eps = _guarded(
            stats, lambda: lax.slice_in_dim(x, 0, num_valid, axis=1), eps)
    weights = 1.0 / jnp.maximum(jnp.sqrt(sq), eps)
    if num_valid < vocab:
        weights = jnp.pad(weights, (0, vocab - num_valid))
        valid = jnp.arange(vocab) < num_valid

    def write_slab(y, start, size):
        p = lax.dynamic_slice_in_dim(pivot, start, size)[:, None]
        m = lax.dynamic_slice_in_dim(mean, start, size)[:, None]
        out = ((rows_of(y, start, size) * scale - p) - m) * weights[None, :]
        if center_output:
            s = jnp.dot(out[:, :num_valid], ones) / num_valid
            out = out - s[:, None]
        if num_valid < vocab:
            out = jnp.where(valid[None, :], out, jnp.zeros((), f32))
        return lax.dynamic_update_slice_in_dim(y, out, start, axis=0)

    return over_slabs(write_slab, x)


def _native_applies(x, axis) -> bool:
    """The native kernel takes the token rows as the first or the last axis (a (V, d) table
    or a (d, V) kernel, features flattened); other layouts use the XLA formulation."""
    return (axis == 0 or axis == x.ndim - 1) and _native.usable()


def _native_path(x, axis, **opts):
    """The CPU kernel (rowgeom/csrc/rownorm.cc): the blocked path's algorithm with its passes
    at memory bandwidth, written in place over a donated input. Differentiable: its JVP is the
    blocked path's (the same function)."""
    rows = axis == 0

    @jax.custom_jvp
    def kernel(x):
        flat = x.reshape(x.shape[0], -1) if rows else x.reshape(-1, x.shape[-1])
        return _native.rownorm(flat, tokens_are_rows=rows, **opts).reshape(x.shape)

    kernel.defjvp(lambda primals, tangents: jax.jvp(
            lambda x: _blocked_path(x, axis, **opts), primals, tangents))
    return kernel(x)


def _project_f32(u, *, vocab_axis, eps, center_input, center_output, num_valid, argname,
                 impl="auto"):
    check_min_rank(u, 2, argname=argname, what="token rows along vocab_axis, features elsewhere")
    check_floating(u, argname=argname)
    axis = canonical_axis(vocab_axis, jnp.ndim(u))
    eps = _check_eps(eps)
    vocab = jnp.shape(u)[axis]
    num_valid = _check_num_valid(num_valid, vocab)
    u = jnp.asarray(u)
    if u.size == 0:
        return jnp.zeros(u.shape, jnp.float32)
    x = u.astype(jnp.float32)
    opts = dict(eps=eps, center_input=bool(center_input), center_output=bool(center_output),
                num_valid=vocab if num_valid is None else num_valid)
    if impl == "auto" and not single_device_trace():
        y = _reference_path(x, axis, **opts)
    elif impl == "auto":
        cpu = _native_path if _native_applies(x, axis) else _blocked_path
        y = lax.platform_dependent(x, cpu=lambda x: cpu(x, axis, **opts),
                                   default=lambda x: _reference_path(x, axis, **opts))
    elif impl == "native":  # auto's CPU branch, the kernel required
        if not _native.available():
            raise RuntimeError("impl='native': the native kernel is not available (see the "
                               "warning, or ROWGEOM_NATIVE)")
        y = (_native_path if _native_applies(x, axis) else _blocked_path)(x, axis, **opts)
    elif impl == "blocked":
        y = _blocked_path(x, axis, **opts)
    elif impl == "reference":
        y = _reference_path(x, axis, **opts)
    else:
        raise ValueError(f"impl must be 'auto', 'native', 'blocked' or 'reference', got "
                         f"{impl!r}")
    return y


def project_rownorm(u: ArrayLike, *, vocab_axis: int, eps: float = 1e-8,
                    center_input: bool = True, center_output: bool = True,
                    num_valid: int | None = None) -> jax.Array:
    """Returns ``P · rownorm(P · u)`` over token rows, computed in float32, in ``u``'s dtype.

    Args:
        u: a real floating array of rank >= 2 (a head gradient, momentum or update).
        vocab_axis: the axis indexing token rows (``1`` for a Flax Dense kernel ``(d, V)``,
            ``0`` for a ``(V, d)`` table); negative values count from the end. Every other axis
            is a feature axis of the row norm.
        eps: rows with ``||x_i|| < eps`` are divided by ``eps`` instead (``x / max(n, eps)``);
            zero rows stay zero. Must be a float32 normal number (>= 1.2e-38).
        center_input: subtract the mean token row before normalising (inner ``P``).
        center_output: subtract the mean normalised row afterwards (outer ``P``; ``1ᵀS = 0``).
        num_valid: rows ``>= num_valid`` along ``vocab_axis`` are padding: excluded from both
            means, zero in the result. ``None``: every row is valid.

    Returns:
        An array of ``u``'s shape and dtype. Every normalised row has ``||·|| <= 1`` (up to
        float32 rounding), so the row diameter of the result is at most 2. ``V = 1`` or rows
        that are all equal give exactly zero.

    Examples:
        >>> import jax.numpy as jnp, rowgeom
        >>> g = jnp.array([[3.0, 4.0], [1.0, 0.0], [-4.0, -4.0]])   # (V, d) token rows
        >>> s = rowgeom.project_rownorm(g, vocab_axis=0)
        >>> float(rowgeom.row_diameter(s, vocab_axis=0)) <= 2.0     # radius 1: D <= 2
        True
        >>> float(jnp.abs(s.sum(axis=0)).max()) < 1e-6              # gauge 1ᵀS = 0
        True
        >>> bool(jnp.allclose(rowgeom.project_rownorm(g.T, vocab_axis=1), s.T))  # (d, V)
        True
    """
    y = _project_f32(u, vocab_axis=vocab_axis, eps=eps, center_input=center_input,
                     center_output=center_output, num_valid=num_valid, argname="u")
    return y.astype(jnp.result_type(u))


def _rescale(s, *, axis, mode, num_valid):
    """Multiplies ``s`` by ``2 / D(s)`` (radius-1 budget), treating tiny ``D`` as zero.

    ``D`` is measured over the valid rows only: padding rows are moved to the valid rows' mean,
    a point of their convex hull, which changes neither ``D`` nor its centroid bound (and needs
    no slice of a possibly sharded vocabulary axis).
    """
    measured = s
    if num_valid is not None and num_valid < s.shape[axis]:
        valid = _row_vector(jnp.arange(s.shape[axis]) < num_valid, s.ndim, axis)
        masked = jnp.where(valid, s, jnp.zeros((), s.dtype))
        mean = jnp.sum(masked, axis=axis, keepdims=True) / num_valid
        measured = jnp.where(valid, s, mean)
    if mode == "exact":
        diameter = _row_diameter(measured, axis=axis, block_size=_DIAMETER_BLOCK)
    else:
        diameter = _upper_bound(measured, axis)
    ok = diameter > _MIN_DIAMETER
    return s * jnp.where(ok, 2.0 / jnp.where(ok, diameter, 1.0), 1.0)


def projected_rownorm(*, vocab_axis: Any, eps: float = 1e-8, center_input: bool = True,
                      center_output: bool = True, num_valid: int | None = None,
                      rescale: str | None = None) -> optax.GradientTransformation:
    """Projected RowNorm as a stateless optax transform (the math: `project_rownorm`).

    Put it after momentum (``optax.chain(optax.trace(0.95), projected_rownorm(...),
    optax.scale_by_learning_rate(lr))``); it keeps the sign of incoming updates.

    Args:
        vocab_axis: where the token rows are. One int for every leaf; a tree prefix of the
            updates whose leaves are ints or ``None`` (``None``: pass that subtree through
            unchanged); or a callable taking the params (the updates when ``update`` gets no
            params) and returning such a tree.
        eps: as in ``project_rownorm``.
        center_input: as in ``project_rownorm``.
        center_output: as in ``project_rownorm``.
        num_valid: as in ``project_rownorm``; applies to every transformed leaf.
        rescale: ``None``: radius 1 (``D <= 2``). ``"exact"``: multiply by ``2 / D(S)`` so the
            step uses the whole diameter budget 2 (never worse, still feasible; ``D`` costs
            ``O(V² d)`` per leaf). ``"bound"``: divide by the ``O(V d)`` upper bound
            ``2 max_i ||s_i - s̄||`` of ``D`` instead, which stays feasible but may use less than
            the budget (up to ~2x less). A zero diameter leaves the update unchanged.

    ``None`` and ``optax.MaskedNode`` leaves pass through, so it works inside
    ``optax.partition`` / ``optax.masked``.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, rowgeom
        >>> params = {"kernel": jnp.zeros((16, 100))}                 # Flax (d, V) head
        >>> tx = optax.chain(optax.ema(0.95), rowgeom.projected_rownorm(vocab_axis=1),
        ...                  optax.scale_by_learning_rate(5e-3))     # radius r = 5e-3
        >>> grads = {"kernel": jax.random.normal(jax.random.key(0), (16, 100))}
        >>> updates, _ = tx.update(grads, tx.init(params), params)
        >>> diameter = rowgeom.row_diameter(updates["kernel"], vocab_axis=1)
        >>> bool(diameter <= 2 * 5e-3 * (1 + 1e-5))                   # D(step) <= 2r
        True
    """
    eps = _check_eps(eps)
    num_valid = _check_num_valid(num_valid)
    if rescale not in _RESCALE_MODES:
        raise ValueError(f"rescale must be one of {_RESCALE_MODES}, got {rescale!r}")

    def transform_leaf(u, axis):
        s = _project_f32(u, vocab_axis=axis, eps=eps, center_input=center_input,
                         center_output=center_output, num_valid=num_valid, argname="updates")
        if rescale is not None:
            s = _rescale(s, axis=canonical_axis(axis, s.ndim), mode=rescale,
                         num_valid=num_valid)
        return s.astype(jnp.result_type(u))

    def update_fn(updates, state, params=None):
        axes = vocab_axes(vocab_axis, updates if params is None else params)
        return map_head_leaves(transform_leaf, lambda u: u, updates, axes), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)

