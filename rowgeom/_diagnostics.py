"""Cheap row-diameter diagnostics recorded in the optimizer state.

A head step ``S`` changes every next-token distribution by at most ``||h|| * D(S)`` in Hilbert's
projective distance (Theorem 1 of arXiv 2608.22253), ``D(S) = max_{i<j} ||s_i - s_j||``. The
exact ``D`` costs ``O(V^2 d)``; this transform records the ``O(V d)`` bracket instead: with
centred rows ``x_i = s_i - sbar``, ``r_c = max ||x_i||`` and ``rms_c^2 = mean ||x_i||^2``,

    lower = max(r_c, sqrt(2V/(V-1)) rms_c, two farthest-point sweeps) <= D(S) <= 2 r_c = upper,

and ``row_sum_residual = ||sum_i s_i||_2``, which is 0 for a step in the canonical gauge
``1^T S = 0`` (projected RowNorm) and measures the common-mode logit drift otherwise.

Place it last in the chain so it sees the step the softmax sees: after the learning rate and
decoupled weight decay (``Delta W = -lr U - lr wd W``). With ``every_k_steps=k`` it measures
the first update and every k-th (updates ``1, k, 2k, ...``, counted from ``init``) and skips the
``O(Vd)`` work on the others; ``measured_at`` and ``count`` say how fresh the stats are.
The bracket is `rowgeom.row_diameter_bounds`'s, so it works under any mesh and placement and
moves only reduced vectors between devices.

    >>> import jax.numpy as jnp, rowgeom
    >>> tx = rowgeom.track_row_diameter(vocab_axis=0)
    >>> step = jnp.array([[0.0, 0.0], [3.0, 4.0]])                     # D = 5
    >>> stats = tx.update(step, tx.init(step))[1]
    >>> float(stats.lower), float(stats.upper), float(stats.row_sum_residual)
    (5.0, 5.0, 5.0)

References: arXiv 2608.22253 (Theorem 1); the bracket's proof: docs/geometry.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rowgeom._cpu import check_impl
from rowgeom._geometry import _bounds_and_sum
from rowgeom._numerics import _pow2_exponent, _times_pow2
from rowgeom._rownorm import map_head_leaves, vocab_axes
from rowgeom._tree import (
    check_int,
    check_matrix_like,
    is_box,
    is_masked,
    key_name,
    path_str,
    static_args_hint,
    tree_paths,
    unbox,
)

PyTree = Any  # a nested structure of arrays (dicts, lists, NamedTuples, nnx.State, ...)


class RowDiameterStats(NamedTuple):
    """Per-leaf scalars, each field a tree shaped like the tracked parameters.

    ``lower``, ``upper`` and ``row_sum_residual`` (float32) describe the update measured last;
    ``measured_at`` (int32) is the number of that update (1 for the first update after
    ``init``; 0 while nothing has been measured, when the three are zeros) and ``count``
    (int32) the number of updates the tracker has seen. The stats describe the latest update
    exactly when ``measured_at == count``; with ``track_row_diameter(every_k_steps=k)`` they
    are ``count - measured_at < k`` updates old. Both counts are the tracker's own: a step
    skipped by ``optax.apply_if_finite`` or a micro-step of ``optax.MultiSteps`` does not count.

    Leaves that are not tracked (``vocab_axis`` ``None``, ``None`` or ``optax.MaskedNode``
    parameters) hold ``None`` / ``MaskedNode`` instead. For a single array the fields are
    scalars.

    Examples:
      >>> import jax.numpy as jnp, optax, rowgeom
      >>> tx = rowgeom.track_row_diameter(vocab_axis=0)
      >>> u = jnp.array([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0]])
      >>> _, state = tx.update(u, tx.init(u))
      >>> isinstance(state, rowgeom.RowDiameterStats), state._fields
      (True, ('lower', 'upper', 'row_sum_residual', 'measured_at', 'count'))
      >>> int(state.measured_at), int(state.count)
      (1, 1)
    """

    lower: PyTree
    upper: PyTree
    row_sum_residual: PyTree
    measured_at: PyTree
    count: PyTree


_MEASURED = 3  # the first three fields are measured; the last two are counters


def _leaf_stats(u, vocab, impl="xla"):
    axis = check_matrix_like(u, argname="updates", vocab_axis=vocab)
    lower, upper, row_sum = _bounds_and_sum(u, axis=axis, sweeps=2, impl=impl)
    # ||row_sum|| on a power-of-two rescaled copy (exact): squares of entries near 1e19 overflow.
    exponent = _pow2_exponent(row_sum)
    residual = jnp.sqrt(jnp.sum(jnp.square(_times_pow2(row_sum, -exponent))))
    return lower, upper, _times_pow2(residual, exponent)


def _zero_stats(p, vocab):
    check_matrix_like(p, argname="params", vocab_axis=vocab)
    # Five distinct buffers (not one zero five times), so that a jitted step can donate them.
    return tuple(jnp.zeros((), jnp.float32 if i < _MEASURED else jnp.int32) for i in range(5))


def _skip(leaf, n=_MEASURED):
    skipped = leaf if isinstance(leaf, optax.MaskedNode) else None
    return (skipped,) * n


def _unzip(tree, like, n: int) -> tuple:
    """Tree of n-tuples (one per leaf of `like`) -> n trees."""
    return tuple(jax.tree.map(lambda _, t, k=k: t[k], like, tree, is_leaf=is_masked)
                 for k in range(n))


_TRACKER_STATIC_ARGS = static_args_hint("vocab_axis", "every_k_steps")


def _check_every_k_steps(k) -> int:
    if k is None:
        return 1
    if isinstance(k, jax.core.Tracer):  # injected as a hyperparameter, under jit
        raise TypeError("every_k_steps must be a Python int, got a traced array; "
                        f"{_TRACKER_STATIC_ARGS}")
    return check_int(k, argname="every_k_steps", minimum=1)


def track_row_diameter(
        *, vocab_axis: int | PyTree | Callable[[PyTree], PyTree],
        every_k_steps: int | None = None,
        impl: str = "xla",
) -> optax.GradientTransformation:
    """Records the ``O(Vd)`` row-diameter bracket of each update; updates pass unchanged.

    Args:
      vocab_axis: token axis per leaf: an int (every leaf), a tree prefix of ints / ``None``
        (``None`` leaves are not tracked), or a callable ``tree -> such a
        prefix``, called on the params in ``init`` and on the updates in ``update`` (like
        ``optax.masked``).
      every_k_steps: measure the first update and then every k-th, i.e. updates number
        ``1, k, 2k, 3k, ...`` counted from ``init`` (``count`` after the update is 1 or a
        multiple of k), which are the steps a loop logging at ``step % k == 0`` (steps
        counted from 1) reads. On the other updates the stats are kept bit for bit and the
        ``O(Vd)`` passes do not run (``jax.lax.cond``: only the taken branch executes on
        CPU and GPU; under ``jax.vmap`` both would). A static Python int >= 1; default
        every update; None means 1 (so that ``optax.inject_hyperparams`` never injects the
        default).
      impl: the formulation of the bracket's passes, as in `rowgeom.row_diameter_bounds`.

    Returns:
      A ``GradientTransformation`` whose state is a ``RowDiameterStats`` of the latest measured
      update (zeros and ``measured_at == 0`` after ``init``); its structure never changes, so a
      jitted step compiles once. Read it back from any nested optimizer state with
      ``read_row_diameter``.

    Raises:
      TypeError, ValueError: if ``every_k_steps`` is not a positive int (a traced value, e.g.
        injected by ``optax.inject_hyperparams``, must be listed in its ``static_args``).

    Examples:
      >>> import jax.numpy as jnp, optax, rowgeom
      >>> tx = optax.chain(rowgeom.projected_rownorm(vocab_axis=0),
      ...                  rowgeom.track_row_diameter(vocab_axis=0))
      >>> g = jnp.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.5]])
      >>> _, state = tx.update(g, tx.init(g))
      >>> stats = rowgeom.read_row_diameter(state)
      >>> float(stats.lower) <= float(rowgeom.row_diameter(
      ...     rowgeom.rownorm_direction(g, vocab_axis=0), vocab_axis=0)) <= float(stats.upper)
      True
      >>> round(float(stats.row_sum_residual), 6)                   # projected: 1ᵀS = 0
      0.0

      Every 10th update (and the first); the others only count:

      >>> import jax
      >>> tx = rowgeom.track_row_diameter(vocab_axis=0, every_k_steps=10)
      >>> step, state = jax.jit(tx.update), tx.init(g)
      >>> for _ in range(12):
      ...     _, state = step(g, state)
      >>> int(state.measured_at), int(state.count)
      (10, 12)
    """
    k = _check_every_k_steps(every_k_steps)
    impl = check_impl(impl)
    leaf_stats = functools.partial(_leaf_stats, impl=impl)

    def init_fn(params):
        axes = vocab_axes(vocab_axis, params)
        tree = map_head_leaves(_zero_stats, lambda x: _skip(x, 5), params, axes)
        lower, upper, residual, measured_at, count = _unzip(tree, params, 5)
        return RowDiameterStats(lower, upper, residual, measured_at, count)

    def update_fn(updates, state, params=None):
        del params
        axes = vocab_axes(vocab_axis, updates)

        def measure() -> tuple[PyTree, PyTree, PyTree]:
            lower, upper, residual = _unzip(
                map_head_leaves(leaf_stats, _skip, updates, axes), updates, _MEASURED)
            return lower, upper, residual

        plus_one = lambda tree: jax.tree.map(lambda c: c + 1, tree)
        counts = jax.tree.leaves(state.count)
        if not counts:  # nothing tracked, nothing to count (measure() still checks the axes)
            lower, upper, residual = measure()
            return updates, RowDiameterStats(lower, upper, residual, state.measured_at,
                                             state.count)
        if k == 1:
            lower, upper, residual = measure()
            return updates, RowDiameterStats(lower, upper, residual, plus_one(state.count),
                                             plus_one(state.count))
        new = counts[0] + 1  # every tracked leaf has seen the same number of updates
        now = (new == 1) | (new % k == 0)
        # Off-steps take the identity branch: the O(Vd) reductions do not run at all.
        lower, upper, residual = jax.lax.cond(
            now, measure, lambda: (state.lower, state.upper, state.row_sum_residual))
        measured_at = jax.tree.map(lambda m: jnp.where(now, new, m), state.measured_at)
        return updates, RowDiameterStats(lower, upper, residual, measured_at,
                                         plus_one(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def _plain(stats: RowDiameterStats) -> RowDiameterStats:
    """Each field as ``{"/"-joined head path: array}`` (Flax boxes unboxed, untracked leaves
    dropped); a tracker of one bare array keeps scalar fields."""
    def field(tree):
        if hasattr(tree, "shape") or is_box(tree):
            return jnp.asarray(unbox(tree))
        return {path_str(path): jnp.asarray(unbox(leaf))
                for path, leaf in tree_paths(tree) if not is_masked(leaf)}

    return RowDiameterStats(*(field(f) for f in stats))


def read_row_diameter(opt_state: Any, which: int | str | None = None) -> RowDiameterStats:
    """The ``RowDiameterStats`` recorded by ``track_row_diameter``, as plain arrays by path.

    Searches any nesting of optax states (``chain`` tuples, ``partition``'s ``PartitionState``,
    ``masked``, ``inject_hyperparams``, ``MultiSteps``, ``apply_if_finite``) and the state of an
    ``nnx.Optimizer`` (``optimizer.opt_state``, whose arrays are boxed in Variables).

    Args:
      opt_state: the optimizer state.
      which: needed only when several trackers are present: an int picks the n-th found (in
        tree order), a str picks the one whose path contains that key or attribute name
        (e.g. the label of an ``optax.partition``).

    Returns:
      ``RowDiameterStats`` whose fields are dicts ``{"/"-joined parameter path: scalar array}``
      (float32 stats, int32 ``measured_at`` and ``count``) over the tracked (head) leaves only,
      the same path for every wrapper above (``"lm_head/kernel"``); scalars when the tracker
      saw one bare array. The stats describe the latest update when ``measured_at == count``
      (always with ``every_k_steps=1``); ``measured_at == 0``: nothing measured yet.

    Raises:
      ValueError: if none is found, or several and ``which`` does not pick exactly one.

    Examples:
      >>> import jax.numpy as jnp, optax, rowgeom
      >>> params = {"mlp": {"kernel": jnp.zeros((4, 4))}, "lm_head": {"kernel": jnp.zeros((4, 8))}}
      >>> head = optax.chain(rowgeom.projected_rownorm(vocab_axis=1),
      ...                    rowgeom.track_row_diameter(vocab_axis=1))
      >>> tx = rowgeom.partition_by_label({"hidden": optax.sgd(0.1), "head": head},
      ...                                 rowgeom.label_params)
      >>> state = optax.MultiSteps(tx, every_k_schedule=2).init(params)
      >>> stats = rowgeom.read_row_diameter(state)   # found inside the wrappers' states
      >>> {path: float(v) for path, v in stats.upper.items()}   # zeros until the first update
      {'lm_head/kernel': 0.0}
    """
    found = [
        (path, leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(
                opt_state, is_leaf=lambda x: isinstance(x, RowDiameterStats))[0]
        if isinstance(leaf, RowDiameterStats)
    ]
    paths = [jax.tree_util.keystr(path) for path, _ in found]
    if not found:
        raise ValueError("opt_state holds no RowDiameterStats: add rowgeom.track_row_diameter "
                         "to the optimizer")
    if which is None:
        if len(found) > 1:
            raise ValueError(f"opt_state holds {len(found)} RowDiameterStats (at {paths}); "
                             "pass which=<index or key name> to pick one")
        return _plain(found[0][1])
    if isinstance(which, str):
        matches = [stats for path, stats in found if which in map(key_name, path)]
        if len(matches) != 1:
            raise ValueError(f"which={which!r} matches {len(matches)} of the RowDiameterStats "
                             f"found (at {paths}); expected exactly one")
        return _plain(matches[0])
    if isinstance(which, bool) or not isinstance(which, int):
        raise TypeError(f"which must be None, an int or a str, got {which!r}")
    if not -len(found) <= which < len(found):
        raise ValueError(f"which={which} is out of range: {len(found)} RowDiameterStats found "
                         f"(at {paths})")
    return _plain(found[which][1])
