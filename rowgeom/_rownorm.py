"""Projected RowNorm for the LM head: ``S = P · rownorm(P · u)``, ``P = I_V - 11ᵀ/V``.

Math: with token rows ``u_i`` (slices along ``vocab_axis``), ``x_i = u_i - ū`` (the inner ``P``),
``y_i = x_i / max(||x_i||, eps)`` and ``S_i = y_i - ȳ`` (the outer ``P``). Over ``1ᵀS = 0`` this is
the exact steepest-descent step when every row must lie in a common ball of radius 1
(Theorem 2), within Jung's factor ``sqrt((k+1)/(2k)) >= 1/√2`` of steepest descent under the
row diameter itself (Theorem 3), which bounds the softmax's change in Hilbert's projective
distance (Theorem 1).

Contract: `rownorm_direction` (one array) and `projected_rownorm` (the stateless optax
transform) compute it in float32 and return the input's dtype and sign: ``D(S) <= 2`` and
``1ᵀS = 0``. Put it after momentum and before ``optax.scale_by_learning_rate`` (radius
``r = lr``). ``vocab_axis`` has no default: normalising over the wrong axis is silently wrong.
One formulation (`_masked`) runs on every backend and under any mesh: masks instead of slices
along the vocabulary axis, so a vocabulary-sharded array only all-reduces ``d``-vectors and a
feature-sharded one ``V``-vectors. In a process with one CPU device the XLA:CPU formulation
`rowgeom._cpu.rownorm` computes the same function.

    >>> import jax.numpy as jnp, rowgeom
    >>> s = rowgeom.rownorm_direction(jnp.array([[2.0, 0.0], [0.0, 0.0]]), vocab_axis=0)
    >>> s.tolist()                                  # x = ±(1, 0): unit rows, then centred
    [[1.0, 0.0], [-1.0, 0.0]]

References: arXiv 2608.22253 (the geometry); H. Jung, "Über die kleinste Kugel, die eine
räumliche Figur einschließt", J. reine angew. Math. 123 (1901) (Theorem 3's factor); the proofs,
conventions and edge cases (eps, padding, huge inputs, bf16, tied heads): docs/geometry.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.typing import ArrayLike

from rowgeom import _cpu
from rowgeom._geometry import _row_diameter, _upper_bound
from rowgeom._numerics import MIN_EPS, _guarded, _pivot, _row_vector, _rownorm_scale
from rowgeom._tree import (
    canonical_axis,
    check_floating,
    check_int,
    check_min_rank,
    flatten_with_paths,
    is_masked,
    path_name,
    path_repr,
    resolve_per_leaf,
    static_args_hint,
)

_RESCALE_MODES = (None, "exact", "bound")
EPS = 1e-8
"""RowNorm's default ``eps`` (every RowNorm function and option reads it here)."""
# A diameter below this is treated as zero by `rescale` (2/D would overflow float32).
_MIN_DIAMETER = 1e-30
_DIAMETER_BLOCK = 1024  # rows per block of the exact diameter's triangular scan

# `rescale` is a string or None, which inject_hyperparams never injects.
_ROWNORM_STATIC_ARGS = static_args_hint("vocab_axis", "eps", "num_valid")


def _check_eps(eps) -> float:
    if isinstance(eps, jax.core.Tracer):  # injected as a hyperparameter, under jit
        raise TypeError(f"eps must be a Python float, got a traced array; {_ROWNORM_STATIC_ARGS}")
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"eps must be a positive float, got {eps!r}") from None
    if not (math.isfinite(value) and value >= MIN_EPS):
        # Below it, float32 squared norms of rows at least eps long may underflow.
        raise ValueError(f"eps must be a finite float >= {MIN_EPS:.3g} (2**-40: smaller rows' "
                         f"squared norms underflow float32), got {eps!r}")
    return value


def _check_num_valid(num_valid, vocab_size: int | None = None) -> int | None:
    if num_valid is None:
        return None
    if isinstance(num_valid, jax.core.Tracer):
        raise TypeError(f"num_valid must be a Python int or None, got a traced array; "
                        f"{_ROWNORM_STATIC_ARGS}")
    value = check_int(num_valid, argname="num_valid", minimum=1)
    if vocab_size is not None and value > vocab_size:
        raise ValueError(f"num_valid must be <= {vocab_size} (the vocabulary size along "
                         f"vocab_axis), got {value}")
    return value


def _centre_and_scale(x, axis, num_valid, mask, eps):
    """``(pivot, mean, scale, eps)`` of the inner centring in one pass, branch-free.

    The pass that sums ``x - p`` over the token axis also takes the valid rows' largest
    ``|entry|`` along it (a sibling reduction the TPU compiler fuses into the same read of
    ``x``), and the overflow guard's power-of-two scale (`_rownorm_scale`: 1 unless an entry exceeds
    ``2**50``) is derived from it, with no ``lax.cond``: every compiler then sees the one path
    that runs. The sum is of ``(x - p) * h``, ``h = 2**-(2 + ceil(log2 V))``, which cannot
    overflow even for entries near the float32 maximum; ``h``, like ``scale``, is a power of
    two, so the scaled mean equals the unscaled one times ``scale`` exactly (barring
    subnormals, far below ``eps``). Padding rows (`mask`) are in neither reduction.
    """
    vocab = x.shape[axis]
    log2_h = -(2 + max(vocab - 1, 1).bit_length())
    h = 2.0**log2_h
    pivot = _pivot(x, axis, num_valid)
    # Two sibling reductions over the same axis: the TPU compiler fuses them into the mean's
    # pass (4 reads in all: bench_tpu.py); XLA:CPU runs the max as a pass of its own, at no
    # measurable cost (a variadic sum/max reduce would be one pass there, but 2-4x slower).
    total = jnp.sum(mask(x * h - pivot * h), axis=axis, keepdims=True)
    amax = jnp.max(mask(jnp.abs(x)), axis=axis)
    scale, eps = _rownorm_scale(jnp.max(amax), eps)
    # scale / h is an exact power of two (scale is one): the mean of x * scale - pivot * scale.
    mean = total * (scale * 2.0**-log2_h) / num_valid
    return pivot * scale, mean, scale, eps


def _masked(x, axis, *, eps, center_input, center_output, num_valid):
    """The formulation that runs everywhere: whole-axis reductions, masks instead of slices.

    A vocabulary-sharded array only all-reduces d-vectors (the pivot's two rows, the two
    means), a feature-sharded one V-vectors (the squared norms); row norms stay local.

    Centring is ``(x_i - p) - mean(x - p)`` with ``p`` the mean of the first two valid rows
    (`_pivot`: rows that are a large common vector plus a small spread keep their accuracy;
    identical rows give exactly zero). The algorithm reads the head four times and writes it
    once, and this is all it does: the column mean of ``x - p``, the squared norms of the
    centred rows (they need the mean), the weighted column sum ``s = Σ_i (x_i - m) / n_i`` of
    the outer centring (it needs the norms) and the write ``(x_i - m) / n_i - s / N`` (it needs
    ``s``). The overflow guard costs no pass and no branch (`_centre_and_scale`); the pivot
    reads two rows.
    """
    vocab = x.shape[axis]
    feat = tuple(i for i in range(x.ndim) if i != axis)
    token = _row_vector(jnp.arange(vocab), x.ndim, axis)
    zero = jnp.zeros((), jnp.float32)
    valid = token < num_valid if num_valid < vocab else None

    def mask(v):  # padding rows may hold anything (even inf): never let them into a sum
        return v if valid is None else jnp.where(valid, v, zero)

    def centred(scale, pivot, mean):
        return mask((x * scale - pivot) - mean)

    if center_input:
        pivot, mean, scale, eps = _centre_and_scale(x, axis, num_valid, mask, eps)
        xc = centred(*lax.optimization_barrier((scale, pivot, mean)))  # see below
        sq = jnp.sum(xc * xc, axis=feat, keepdims=True)
    else:
        def stats(scale, eps):
            del eps
            pivot = mean = jnp.zeros((), jnp.float32)
            xc = centred(*lax.optimization_barrier((scale, pivot, mean)))
            return jnp.sum(xc * xc, axis=feat, keepdims=True), pivot, mean

        sq, pivot, mean, scale, eps = _guarded(stats, lambda: jnp.max(jnp.abs(mask(x))), eps)
    weights = 1.0 / jnp.maximum(jnp.sqrt(sq), eps)
    if not center_output:
        return centred(scale, pivot, mean) * weights
    # One copy of the small operands per pass (optimization barriers): with a single copy, XLA
    # computes the full-size product both passes share once and stores it, a write and a read
    # more.
    shift, w = lax.optimization_barrier(((scale, pivot, mean), weights))
    total = jnp.sum(centred(*shift) * w, axis=axis, keepdims=True)
    shift, w = lax.optimization_barrier((shift, w))
    return mask(centred(*shift) * w - total / num_valid)


def _project_f32(u, *, vocab_axis, eps, center_input, center_output, num_valid, argname,
                 impl="xla"):
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
    if _cpu.resolve_impl(impl, u) == "cpu":
        return _cpu.rownorm(x, axis, **opts)
    return _masked(x, axis, **opts)


def rownorm_direction(u: ArrayLike, *, vocab_axis: int, eps: float = EPS,
                      center_input: bool = True, center_output: bool = True,
                      num_valid: int | None = None, impl: str = "xla") -> jax.Array:
    """Returns ``P · rownorm(P · u)`` over token rows, computed in float32, in ``u``'s dtype.

    With ``x_i`` the token rows of ``u`` after the inner centring (``center_input``), each row
    becomes ``x_i / max(||x_i||, eps)``: rows with ``||x_i|| >= eps`` come out unit length, shorter
    ones ``x_i / eps`` (zero rows stay zero, never ``0/0``); then the mean row is subtracted
    (``center_output``). This is the direction of the head step of `projected_rownorm`.

    Args:
        u: a real floating array of rank >= 2 (a head gradient, momentum or update).
        vocab_axis: the axis indexing token rows (``1`` for a Flax Dense kernel ``(d, V)``,
            ``0`` for a ``(V, d)`` table); negative values count from the end. Every other axis
            is a feature axis of the row norm.
        eps: the row length below which rows are divided by ``eps`` instead of their norm. A
            float ``>= 2**-40`` (about 9.1e-13): below that, float32 squared norms of rows at
            least ``eps`` long can underflow.
        center_input: subtract the mean token row before normalising (inner ``P``).
        center_output: subtract the mean normalised row afterwards (outer ``P``; ``1ᵀS = 0``).
        num_valid: rows ``>= num_valid`` along ``vocab_axis`` are padding: excluded from both
            means, zero in the result. ``None``: every row is valid.
        impl: the formulation: ``"xla"`` (masks along the vocabulary axis: any backend, any
            mesh), ``"cpu"`` (`rowgeom._cpu.rownorm`, the same function in cache-sized blocks,
            faster on XLA:CPU; an array on one device only) or ``"auto"`` (decided for ``u``
            when traced: `rowgeom._cpu.resolve_impl`).

    Returns:
        An array of ``u``'s shape and dtype. Every normalised row has ``||·|| <= 1`` (up to
        float32 rounding), so the row diameter of the result is at most 2. ``V = 1`` or rows
        that are all equal give exactly zero. Inputs with entries above ``2**50`` are scaled
        by a power of two first (exact); rows shorter than ``2**-60`` times the largest entry
        then come out shorter than unit length, never longer.

    Examples:
        >>> import jax.numpy as jnp, rowgeom
        >>> g = jnp.array([[3.0, 4.0], [1.0, 0.0], [-4.0, -4.0]])   # (V, d) token rows
        >>> s = rowgeom.rownorm_direction(g, vocab_axis=0)
        >>> float(rowgeom.row_diameter(s, vocab_axis=0)) <= 2.0     # radius 1: D <= 2
        True
        >>> float(jnp.abs(s.sum(axis=0)).max()) < 1e-6              # gauge 1ᵀS = 0
        True
        >>> bool(jnp.allclose(rowgeom.rownorm_direction(g.T, vocab_axis=1), s.T))  # (d, V)
        True
        >>> rows = jnp.array([[0.375, 0.5], [0.0, 0.0], [6.0, 8.0]])   # norms 0.625, 0, 10
        >>> rowgeom.rownorm_direction(rows, vocab_axis=0, eps=1.0, center_input=False,
        ...                           center_output=False).tolist()  # eps = 1: short rows / 1
        [[0.375, 0.5], [0.0, 0.0], [0.6000000238418579, 0.800000011920929]]
    """
    y = _project_f32(u, vocab_axis=vocab_axis, eps=eps, center_input=center_input,
                     center_output=center_output, num_valid=num_valid, argname="u",
                     impl=_cpu.check_impl(impl))
    return y.astype(jnp.result_type(u))


def _rescale(s, *, axis, mode, num_valid, impl):
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
        diameter = _upper_bound(measured, axis, impl)
    ok = diameter > _MIN_DIAMETER
    return s * jnp.where(ok, 2.0 / jnp.where(ok, diameter, 1.0), 1.0)


def projected_rownorm(*, vocab_axis: Any, eps: float = EPS, center_input: bool = True,
                      center_output: bool = True, num_valid: int | None = None,
                      rescale: str | None = None, impl: str = "xla"
                      ) -> optax.GradientTransformation:
    """Projected RowNorm as a stateless optax transform (the math: `rownorm_direction`).

    Put it after momentum (``optax.chain(optax.trace(0.95), projected_rownorm(...),
    optax.scale_by_learning_rate(lr))``); it keeps the sign of incoming updates.

    Args:
        vocab_axis: where the token rows are. One int for every leaf; a tree prefix of the
            updates whose leaves are ints or ``None`` (``None``: pass that subtree through
            unchanged); or a callable taking the params (the updates when ``update`` gets no
            params) and returning such a tree.
        eps: as in ``rownorm_direction``.
        center_input: as in ``rownorm_direction``.
        center_output: as in ``rownorm_direction``.
        num_valid: as in ``rownorm_direction``; applies to every transformed leaf.
        rescale: ``None``: radius 1 (``D <= 2``). ``"exact"``: multiply by ``2 / D(S)`` so the
            step uses the whole diameter budget 2 (never worse, still feasible; ``D`` costs
            ``O(V² d)`` per leaf). ``"bound"``: divide by the ``O(V d)`` upper bound
            ``2 max_i ||s_i - s̄||`` of ``D`` instead, which stays feasible but may use less than
            the budget (up to ~2x less). A zero diameter leaves the update unchanged.
        impl: as in ``rownorm_direction``.

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
    impl = _cpu.check_impl(impl)

    def transform_leaf(u, axis):
        s = _project_f32(u, vocab_axis=axis, eps=eps, center_input=center_input,
                         center_output=center_output, num_valid=num_valid, argname="updates",
                         impl=impl)
        if rescale is not None:
            s = _rescale(s, axis=canonical_axis(axis, s.ndim), mode=rescale,
                         num_valid=num_valid, impl=impl)
        return s.astype(jnp.result_type(u))

    def update_fn(updates, state, params=None):
        axes = vocab_axes(vocab_axis, updates if params is None else params)
        return map_head_leaves(transform_leaf, lambda u: u, updates, axes), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


# --- one matrix at a time: the routers' RowNorm ----------------------------------------------
# A mixture-of-experts router (d, E) takes projected RowNorm over its expert rows
# (`rowgeom.RouterOptions`); scanned, (d, L, E) is L independent routers, so the row norms and
# means must never mix layers.


# --- Per-leaf vocabulary axes: the tree helpers of every head transform (RowNorm, the clip, the
# tracker) -------------------------------------------------------------------------------------


def _check_axis_value(ax):
    if ax is None:
        return None
    if isinstance(ax, jax.core.Tracer):
        raise TypeError("vocab_axis must be a static int, got a traced value; under "
                        "optax.inject_hyperparams pass static_args=('vocab_axis', ...)")
    return check_int(ax, argname="vocab_axis", minimum=-(2**31))


def vocab_axes(vocab_axis, tree):
    """Broadcasts ``vocab_axis`` to one ``int | None`` per leaf of ``tree``.

    ``vocab_axis`` is a per-leaf option (`resolve_per_leaf`): an int (every leaf), ``None`` (no
    leaf), a tree or flat ``"/"``-keyed mapping with ints / ``None`` at its leaves, or a callable
    ``tree -> such a tree`` (like optax masks). A leaf under no entry gets ``None`` (left
    unchanged, never a guessed axis), e.g. ``{"lm_head/kernel": 1}`` on a whole model.
    """
    if callable(vocab_axis):
        vocab_axis = vocab_axis(tree)
    leaves, treedef = flatten_with_paths(tree, open_boxes=True, is_leaf=is_masked)
    is_value = lambda ax: ax is None or not isinstance(ax, Mapping | list | tuple) \
        or isinstance(ax, optax.MaskedNode)
    per_leaf = resolve_per_leaf(vocab_axis, [p for p, _ in leaves], is_value=is_value,
                                argname="vocab_axis")
    axes = []
    for (path, _), (_, ax) in zip(leaves, per_leaf, strict=True):
        try:
            # A masked entry (a partition's callable sees MaskedNode leaves): not a head leaf.
            axes.append(None if is_masked(ax) else _check_axis_value(ax))
        except (TypeError, ValueError) as err:
            raise type(err)(f"vocab_axis at {path_name(path)}: {err}") from None
    return jax.tree_util.tree_unflatten(treedef, axes)


def map_head_leaves(fn, skip, tree, axes):
    """``fn(leaf, axis)`` on every leaf with an axis (`vocab_axes`); ``skip(leaf)`` elsewhere.

    Errors from ``fn`` are re-raised with the leaf's path, so a user sees which parameter failed.
    """
    leaves, treedef = flatten_with_paths(tree, open_boxes=True, is_leaf=is_masked)

    def apply(path, leaf, ax):
        if is_masked(leaf) or ax is None:
            return skip(leaf)
        try:
            return fn(leaf, ax)
        except (TypeError, ValueError) as err:
            raise type(err)(f"leaf {path_repr(path)}: {err}") from None

    out = [apply(path, leaf, ax)
           for (path, leaf), ax in zip(leaves, treedef.flatten_up_to(axes), strict=True)]
    return jax.tree_util.tree_unflatten(treedef, out)
