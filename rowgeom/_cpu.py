"""XLA:CPU formulations of projected RowNorm and of the row-diameter bracket's centred norms over
a leading feature axis.

Why they exist: XLA:CPU reduces a leading axis as a slow strided loop, and a reduction fused
with some elementwise producers (a row sum of ``x - p``, a column sum weighted per row) as a
slow generic one. The masked formulations that run everywhere else (`rowgeom._rownorm._masked`,
`rowgeom._geometry._masked_sq_dists`) are made of whole-axis reductions, some of that kind. The
ones here walk the array in cache-sized blocks or slabs so that every reduction is of a fast
kind and no full-size temporary is made (docs/benchmarks.md times the two on CPU). The bracket
needs one only for its centred norms over a leading feature axis (a Flax ``(d, V)`` kernel):
with token rows first both formulations are the same reduction, and its sweeps are
matrix-vector products in every formulation.

Contract: `rownorm` is the same function as `rowgeom._rownorm._masked` (same pivot, eps rule
and overflow guard, `rowgeom._numerics`) and `sq_dists` the same as the masked distance pass, up
to float32 rounding order. Both slice the vocabulary and feature axes, which would gather a
sharded head or fail on Explicit sharding types, so callers use them only when asked
to (``impl="cpu"``, or ``impl="auto"`` on one CPU device: `resolve_impl`).

    >>> import jax.numpy as jnp
    >>> from rowgeom import _cpu
    >>> g = jnp.array([[3.0, 4.0], [1.0, 0.0], [-4.0, -4.0]])   # (V, d) token rows
    >>> s = _cpu.rownorm(g, 0, eps=1e-8, center_input=True, center_output=True, num_valid=3)
    >>> float(jnp.abs(s.sum(axis=0)).max()) < 1e-6                # centred: 1ᵀS = 0
    True
    >>> kernel = g.T                                              # the Flax (d, V) layout
    >>> _cpu.sq_dists(kernel, kernel[:, 1:2]).tolist()            # ||g_v - g_1||² per token
    [20.0, 0.0, 41.0]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from rowgeom._numerics import _guarded, _pivot, _row_vector

# Token rows contiguous: rows per block are chosen so that one block of float32 rows, and the
# centred copy the two per-block reductions (row norms, weighted column sum) read, stay in a
# core's L2 cache (timed against larger blocks with benchmarks/bench_rownorm.py).
_BLOCK_BYTES = 2**20
# Tokens contiguous: feature rows per slab, read once for their mean and the token norms and once
# to be reduced and written. One row of a (768, 50304) kernel stays in cache while its uses read
# it (one row timed faster than 2, 4 or 16 a slab); at most 4 MiB a slab, and few enough rows
# that their squares accumulate in one unrolled elementwise fusion.
_SLAB_BYTES = 4 * 2**20
_SLAB_ROWS = 1
# The tokens-contiguous loops (the slab walk, the bracket's distance pass) take 8 feature rows
# an iteration when the head has at least this many tokens: their squares then accumulate into
# the V-vector of token norms in one fused pass instead of eight (timed faster for a
# (768, 50304) kernel). Below it that vector stays in L1 and unrolling gains nothing measurable,
# while its copies of the loop body made a small head's program 2-4x slower to compile.
_UNROLL_MIN_TOKENS = 4096


def _unroll(num_tokens: int, trips: int, rows_per_trip: int = 1) -> int:
    """Iterations per step of a loop of `trips` iterations, `rows_per_trip` feature rows each,
    over a head of `num_tokens` tokens."""
    if num_tokens < _UNROLL_MIN_TOKENS:
        return 1
    return max(1, min(8 // rows_per_trip, trips))


IMPLS = ("xla", "cpu", "auto")
"""The values of the head ops' ``impl`` option (`rownorm_direction`, `projected_rownorm`,
`row_diameter_bounds`, `track_row_diameter`, `clip_row_diameter`, `rowgeom.HeadOptions`)."""


def resolve_impl(impl: str, x) -> str:
    """The formulation ``impl`` names for the array ``x``: ``"xla"`` or ``"cpu"``.

    ``"xla"``: the masked formulation of `rowgeom._rownorm` / `rowgeom._geometry` (whole-axis
    reductions; any backend, any mesh). ``"cpu"``: this module's (slices; only correct where
    ``x`` is not sharded over several devices). ``"auto"`` is decided when ``x`` is traced, by
    where ``x`` lives: a concrete array on exactly one CPU device -> ``"cpu"``, on anything else
    -> ``"xla"``; a traced array whose abstract sharding names a mesh of more than one device
    -> ``"xla"``; otherwise (a tracer without a mesh, whose devices tracing cannot see) ``"cpu"``
    only when the default backend is CPU with one device, where no array can be sharded.
    Nothing else (no global flag) enters the choice, and only the chosen one is traced.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        devices = x.sharding.device_set
        platforms = {getattr(device, "platform", None) for device in devices}
        return "cpu" if len(devices) == 1 and platforms == {"cpu"} else "xla"
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is not None and getattr(mesh, "size", 1) > 1:
        return "xla"
    return "cpu" if jax.default_backend() == "cpu" and jax.device_count() == 1 else "xla"


def check_impl(impl: str) -> str:
    """``impl`` if it names a formulation; a ValueError naming the option otherwise."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


# --- projected RowNorm ----------------------------------------------------------------------------


def rownorm(x, axis: int, *, eps: float, center_input: bool, center_output: bool,
            num_valid: int, block_rows: int | None = None):
    """``P · rownorm(P x)`` of a float32 ``x`` with token rows along ``axis`` (the math and the
    contract: `rowgeom._rownorm.rownorm_direction`), written in place over a donated input.

    The algorithm needs the column mean ``m`` (one read), the squared row norms
    ``||x_i - m||²`` and the weighted column sum ``s = Σ_i (x_i - m) / n_i`` of the output
    centring, and the write ``(x_i - m) / n_i - s / N``. Each layout walks the array its own
    way: token rows contiguous (`_row_blocks`: three reads and a write) or tokens contiguous, a
    Flax ``(d, V)`` kernel with the vocabulary axis last (`_feature_slabs`: two reads and a
    write). ``block_rows`` overrides the rows per block or slab.

    The norms use ``||x_i - m||`` directly: the expanded ``||x_i||² - 2 x_i·m + ||m||²`` would save
    a pass but cancels catastrophically for rows near their mean. The overflow guard costs no
    pass: squared norms above ``2**100`` (or inf/NaN) mean an entry may exceed ``2**50``, and only
    then is everything recomputed on power-of-two scaled input.
    """
    opts = dict(eps=eps, center_input=center_input, center_output=center_output,
                num_valid=num_valid)
    if axis == x.ndim - 1 and x.ndim >= 2:
        flat = x.reshape(-1, x.shape[-1])  # free: the tokens stay the contiguous axis
        return _feature_slabs(flat, slab_rows=block_rows, **opts).reshape(x.shape)
    return _row_blocks(x, axis, block_rows=block_rows, **opts)


def _in_cache(block):
    """Materialises a cache-sized block before it is reduced: XLA:CPU runs a plain reduction of a
    buffer through its fast kernel, but one fused with an elementwise producer as a generic loop."""
    return lax.optimization_barrier(block)


def _fold_rows(fn, acc, x, axis: int, num_valid: int, block_rows: int):
    """``acc = fn(acc, rows, start)`` over the valid token rows of ``x`` (along ``axis``), one
    block of ``block_rows`` at a time: a loop over the whole blocks, then the tail."""
    num_blocks, tail = divmod(num_valid, block_rows)

    def block(i, acc):
        start = i * block_rows
        return fn(acc, lax.dynamic_slice_in_dim(x, start, block_rows, axis=axis), start)

    if num_blocks == 1:
        acc = block(0, acc)
    elif num_blocks > 1:
        acc = lax.fori_loop(0, num_blocks, block, acc)
    if tail:
        start = num_blocks * block_rows
        acc = fn(acc, lax.slice_in_dim(x, start, num_valid, axis=axis), start)
    return acc


def _add_centred_sum(acc, rows, start, *, scale, pivot, axis):
    del start
    return acc + jnp.sum(_in_cache(rows * scale - pivot), axis=axis, keepdims=True)


def _add_norms_and_sum(carry, rows, start, *, scale, shift, axis, eps, center_output):
    """Pass 2 on one block: its squared centred norms into ``sq`` and, for the output
    centring, ``Σ_i (x_i - m) / n_i`` into ``acc`` (a vector-matrix product on the block)."""
    acc, sq = carry
    xc = _in_cache((rows * scale - shift[0]) - shift[1])
    n2 = jnp.sum(xc * xc, axis=tuple(i for i in range(rows.ndim) if i != axis))
    if center_output:
        w = 1.0 / jnp.maximum(jnp.sqrt(n2), eps)
        s = lax.dot_general(w, xc, (((0,), (axis,)), ((), ())))
        acc = acc + s.reshape(acc.shape)
    return acc, lax.dynamic_update_slice_in_dim(sq, n2, start, axis=0)


def _row_stats(x, axis, num_valid, block_rows, center_input, center_output, scale, eps):
    """Passes 1 and 2 of `_row_blocks` on ``x * scale``: the valid rows' squared centred norms,
    the shift (pivot, mean) and the weighted column sum of the output centring."""
    zeros = jnp.zeros(tuple(1 if i == axis else n for i, n in enumerate(x.shape)), jnp.float32)
    shift = (zeros, zeros)
    if center_input:
        pivot = _pivot(x, axis, num_valid, scale)
        add = functools.partial(_add_centred_sum, scale=scale, pivot=pivot, axis=axis)
        shift = (pivot, _fold_rows(add, zeros, x, axis, num_valid, block_rows) / num_valid)
    add = functools.partial(_add_norms_and_sum, scale=scale, shift=shift, axis=axis, eps=eps,
                            center_output=center_output)
    acc, sq = _fold_rows(add, (zeros, jnp.zeros((num_valid,), jnp.float32)), x, axis,
                         num_valid, block_rows)
    return sq, shift, acc


def _row_blocks(x, axis, *, eps, center_input, center_output, num_valid, block_rows):
    """Token rows contiguous (vocabulary axis not last): cache-sized blocks of rows.

    Pass 1 sums blocks of rows for ``m``; pass 2 takes the block norms and accumulates ``s``
    (`_row_stats`); pass 3 is elementwise.
    """
    ndim, vocab = x.ndim, x.shape[axis]
    if block_rows is None:
        block_rows = max(8, _BLOCK_BYTES // (4 * max(1, x.size // vocab)))
    stats = functools.partial(_row_stats, x, axis, num_valid, block_rows, center_input,
                              center_output)
    sq, shift, acc, scale, eps = _guarded(
            stats, lambda: jnp.max(jnp.abs(lax.slice_in_dim(x, 0, num_valid, axis=axis))), eps)
    weights = 1.0 / jnp.maximum(jnp.sqrt(sq), eps)
    if num_valid < vocab:
        weights = jnp.pad(weights, (0, vocab - num_valid))
    y = ((x * scale - shift[0]) - shift[1]) * _row_vector(weights, ndim, axis)
    if center_output:
        y = y - acc / num_valid
    if num_valid < vocab:
        valid = _row_vector(jnp.arange(vocab) < num_valid, ndim, axis)
        y = jnp.where(valid, y, jnp.zeros((), jnp.float32))
    return y


def _over_slabs(fn, carry, feats: int, slab_rows: int, vocab: int):
    """``carry = fn(carry, start, size)`` over slabs of ``slab_rows`` feature rows (a loop, then
    the tail). For a large head the loop takes about 8 feature rows an iteration (`_unroll`)."""
    num_slabs, tail = divmod(feats, slab_rows)
    if num_slabs == 1:
        carry = fn(carry, 0, slab_rows)
    elif num_slabs > 1:
        carry = lax.fori_loop(0, num_slabs, lambda i, c: fn(c, i * slab_rows, slab_rows),
                              carry, unroll=_unroll(vocab, num_slabs, slab_rows))
    if tail:
        carry = fn(carry, num_slabs * slab_rows, tail)
    return carry


def _add_slab_stats(carry, start, size, *, x, scale, num_valid, center_input):
    """One slab of feature rows: its pivot and mean (row sums of the slab, once in cache), and
    its squares added into the token norms."""
    sq, shift_p, shift_m = carry
    rows = lax.dynamic_slice_in_dim(x, start, size, axis=0)[:, :num_valid] * scale
    d = rows
    if center_input:
        k = min(2, num_valid)
        p = jnp.sum(rows[:, :k], axis=1, keepdims=True) * (1.0 / k)
        m = (jnp.sum(rows - p, axis=1) / num_valid)[:, None]
        d = (rows - p) - m
        shift_p = lax.dynamic_update_slice_in_dim(shift_p, p[:, 0], start, axis=0)
        shift_m = lax.dynamic_update_slice_in_dim(shift_m, m[:, 0], start, axis=0)
    for a in range(size):  # unrolled: one fused elementwise loop, no row reduction
        sq = sq + jnp.square(d[a])
    return sq, shift_p, shift_m


def _slab_stats(x, num_valid, slab_rows, center_input, scale, eps):
    """The token norms and the per-feature pivot and mean of ``x * scale`` (one walk)."""
    del eps  # the norms need none; `_guarded`'s signature
    add = functools.partial(_add_slab_stats, x=x, scale=scale, num_valid=num_valid,
                            center_input=center_input)
    zeros = jnp.zeros((x.shape[0],), jnp.float32)
    return _over_slabs(add, (jnp.zeros((num_valid,), jnp.float32), zeros, zeros), x.shape[0],
                       slab_rows, x.shape[1])


def _write_slab(y, start, size, *, scale, pivot, mean, weights, num_valid, center_output):
    """One slab of the output: centred, scaled by the token weights, centred again over the
    valid tokens (its weighted sum just before the write), padding tokens zero."""
    p = lax.dynamic_slice_in_dim(pivot, start, size)[:, None]
    m = lax.dynamic_slice_in_dim(mean, start, size)[:, None]
    out = ((lax.dynamic_slice_in_dim(y, start, size, axis=0) * scale - p) - m) * weights[None, :]
    if center_output:
        out = out - (jnp.sum(out[:, :num_valid], axis=1) / num_valid)[:, None]
    if num_valid < out.shape[1]:
        valid = jnp.arange(out.shape[1]) < num_valid
        out = jnp.where(valid[None, :], out, jnp.zeros((), jnp.float32))
    return lax.dynamic_update_slice_in_dim(y, out, start, axis=0)


def _feature_slabs(x, *, eps, center_input, center_output, num_valid, slab_rows):
    """Tokens contiguous: ``x`` is ``(F, V)``, one feature per row (a Flax ``(d, V)`` kernel).

    A slab of feature rows holds every token's value of those features, so the column mean of
    those features is known as soon as the slab is read: the mean and the token norms take one
    walk over slabs (`_slab_stats`: row sums, then squares accumulated into the token norms
    while the slab is in cache), and the write takes each slab's weighted sum just before
    writing it (`_write_slab`). The row sums are plain reductions of the slab (timed faster than
    matrix-vector products with a vector of ones in this XLA); they are what this layout's time
    goes to.
    """
    feats, vocab = x.shape
    if slab_rows is None:
        slab_rows = min(_SLAB_ROWS, _SLAB_BYTES // (4 * vocab))
    slab_rows = max(1, min(feats, slab_rows))
    stats = functools.partial(_slab_stats, x, num_valid, slab_rows, center_input)
    sq, pivot, mean, scale, eps = _guarded(
            stats, lambda: jnp.max(jnp.abs(lax.slice_in_dim(x, 0, num_valid, axis=1))), eps)
    weights = 1.0 / jnp.maximum(jnp.sqrt(sq), eps)
    if num_valid < vocab:
        weights = jnp.pad(weights, (0, vocab - num_valid))
    write = functools.partial(_write_slab, scale=scale, pivot=pivot, mean=mean, weights=weights,
                              num_valid=num_valid, center_output=center_output)
    return _over_slabs(write, x, feats, slab_rows, vocab)


# --- the bracket's distance pass ------------------------------------------------------------------


def sq_dists(x, point):
    """``||x_v - p||²`` per token ``v`` of an ``(F, V)`` or ``(A, V, B)`` float32 view with a
    leading feature axis (a Flax ``(d, V)`` kernel); ``point`` is shaped like ``x`` with a unit
    token axis (the bracket's centroid). The same function as
    `rowgeom._geometry._masked_sq_dists`.

    The leading axis is accumulated in a loop, each slice ``x[a]`` contiguous, so the only
    reduction left (over ``B``, if any) is along the trailing axis, which reduces fast.
    """
    def accumulate(a, total):
        d2 = jnp.square(x[a] - point[a])
        return total + (d2 if d2.ndim == 1 else jnp.sum(d2, axis=1))

    zeros = jnp.zeros((x.shape[1],), jnp.float32)
    return lax.fori_loop(0, x.shape[0], accumulate, zeros, unroll=_unroll(x.shape[1], x.shape[0]))
