"""Muon's orthogonalization as a stateless optax transform, batched across leaves.

Contract: `muon_orthogonalize` replaces each matrix ``G`` of an update by
``scale(m, n) · polar(G)``, ``polar(G) = U Vᵀ`` for ``G = U Σ Vᵀ`` (Newton–Schulz,
`rowgeom.newton_schulz`), keeping the update's sign. `MuonDimensionNumbers` says which axes form
the matrix; the other axes are a batch of independent matrices. Momentum is a separate
transform: chain ``optax.trace`` before it and ``optax.scale_by_learning_rate`` after it.

It is the spectral-norm steepest-descent direction (Bernstein & Newhouse, arXiv 2409.20325;
Jordan et al., "Muon", 2024). How leaves of one matrix shape share one Newton–Schulz call, and
what that costs: docs/benchmarks.md; why it matters under sharding: docs/guides/sharding.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental.shard_alike import shard_alike
from jax.sharding import NamedSharding

from rowgeom._muon_sharding import (
    gather,
    known_replicated,
    matrix_mesh,
    on_mesh,
    sharded_like,
    split_long_side,
    splits_long_side,
    spread,
)
from rowgeom._newton_schulz import orthogonalize, resolve_coefficients
from rowgeom._tree import (
    Path,
    flatten_with_paths,
    is_masked,
    path_repr,
    path_str,
    resolve_per_leaf,
)
from rowgeom._validation import check_bool, check_momentum, not_array, prefixed

_SCALES = ("spectral", "keller", "rms", "none")


class MuonDimensionNumbers(NamedTuple):
    """Which axes of a leaf form the matrix: rows = `reduction_axis`, columns = `output_axis`.

    Each is an int or a tuple of ints (flattened in the given order); all remaining axes are batch
    axes, each index of which is a separate matrix. A Flax kernel ``(in, out)`` is ``(0, 1)`` (the
    default for rank-2 leaves); stacked layers ``(L, in, out)`` use ``(1, 2)``; a per-head
    attention kernel ``(d, H, Dh)`` uses reduction ``(0,)`` with output ``(2,)`` (one matrix per
    head, batch ``H``) or output ``(1, 2)`` (one ``(d, H·Dh)`` matrix).

    Examples:
      >>> import rowgeom
      >>> rowgeom.MuonDimensionNumbers()                   # a Flax kernel (in, out)
      MuonDimensionNumbers(reduction_axis=0, output_axis=1)
      >>> rowgeom.MuonDimensionNumbers(reduction_axis=1, output_axis=2)   # stacked (L, in, out)
      MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    """

    reduction_axis: int | tuple[int, ...] = 0
    output_axis: int | tuple[int, ...] = 1


def as_dimension_numbers(dims: Any) -> MuonDimensionNumbers | None:
    """`dims` as rowgeom's `MuonDimensionNumbers` (optax.contrib's converted); None otherwise."""
    if isinstance(dims, MuonDimensionNumbers):
        return dims
    if isinstance(dims, optax.contrib.MuonDimensionNumbers):
        return MuonDimensionNumbers(dims.reduction_axis, dims.output_axis)
    return None


def is_dimension_numbers(x) -> bool:
    """Whether `x` is a `MuonDimensionNumbers` (rowgeom's or optax.contrib's)."""
    return as_dimension_numbers(x) is not None


_DEFAULT_DIMS = MuonDimensionNumbers(0, 1)
_PASS = object()  # a None / MaskedNode entry of a dimension-numbers tree: leave the leaf as is


def _dims_per_leaf(dims, leaves: list[tuple[Path, Any]]) -> list:
    """One dimension-numbers entry per update leaf (`_PASS` where the tree says None).

    ``None`` at the root means the rank-2 default rule, checked per leaf. A tree is matched by
    path: its entry covers every leaf below it; a masked update leaf may lack one.
    """
    if dims is None or is_dimension_numbers(dims):
        return [dims] * len(leaves)
    per_leaf = resolve_per_leaf(dims, [path for path, _ in leaves],
                                is_value=lambda d: is_masked(d) or is_dimension_numbers(d),
                                argname="dimension_numbers")
    missing = [path_str(path) for (path, x), (found, _) in zip(leaves, per_leaf, strict=True)
               if not found and not is_masked(x)]
    if missing:
        raise ValueError(
                "dimension_numbers must be a MuonDimensionNumbers, a tree (prefix of the updates) "
                "with MuonDimensionNumbers or None leaves, or a callable returning one; it has no "
                f"entry for the updates {missing}")
    return [_PASS if is_masked(d) else d for _, d in per_leaf]  # explicit None: pass through


def _axes(value, ndim: int, field: str, where: str) -> tuple[int, ...]:
    axes = (value,) if isinstance(value, numbers.Integral) else tuple(value)
    if not axes:
        raise ValueError(f"dimension_numbers.{field} for {where} must name at least one axis")
    out = []
    for ax in axes:
        if isinstance(ax, bool) or not isinstance(ax, numbers.Integral):
            raise TypeError(f"dimension_numbers.{field} for {where} must be ints, got {value!r}")
        index = int(ax)
        if not -ndim <= index < ndim:
            raise ValueError(f"dimension_numbers.{field}={value!r} for {where} is out of range "
                             f"for rank {ndim}")
        out.append(index % ndim)
    return tuple(out)


class _Plan(NamedTuple):
    perm: tuple[int, ...]        # leaf axes -> (batch..., reduction..., output...)
    flat_shape: tuple[int, ...]  # (batch, m, n)
    wide: bool                   # True when m <= n (no transpose to orient wide)
    scale: Any                   # float or traced scalar


def _plan(path, x, dims, *, scale, rms_scale) -> _Plan:
    where = f"updates{path_repr(path)} (shape {tuple(x.shape)})"
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"muon_orthogonalize needs floating updates; {where} has dtype {x.dtype}")
    if dims is None:
        if x.ndim != 2:
            raise ValueError(
                    f"muon_orthogonalize: {where} has rank {x.ndim}; without dimension_numbers "
                    "only rank-2 leaves are supported. Pass dimension_numbers with a "
                    "MuonDimensionNumbers for it (e.g. (L, in, out) -> reduction_axis=1, "
                    "output_axis=2), or None there to pass it through unchanged")
        dims = _DEFAULT_DIMS
    if not is_dimension_numbers(dims):
        raise TypeError(f"dimension_numbers for {where} must be a MuonDimensionNumbers (rowgeom's "
                        f"or optax.contrib's) or None, got {dims!r}")
    dims = as_dimension_numbers(dims)
    red = _axes(dims.reduction_axis, x.ndim, "reduction_axis", where)
    out = _axes(dims.output_axis, x.ndim, "output_axis", where)
    if len(set(red + out)) != len(red) + len(out):
        raise ValueError(f"dimension_numbers for {where}: reduction_axis {red} and output_axis "
                         f"{out} must be distinct axes")
    batch = tuple(ax for ax in range(x.ndim) if ax not in red + out)
    size = lambda axes: math.prod(x.shape[ax] for ax in axes)
    m, n = size(red), size(out)
    if scale == "spectral":
        factor = math.sqrt(n / m) if m else 1.0
    elif scale == "keller":
        factor = math.sqrt(max(1.0, n / m)) if m else 1.0
    elif scale == "rms":
        factor = rms_scale * math.sqrt(max(m, n))
    else:
        factor = 1.0
    return _Plan(batch + red + out, (size(batch), m, n), m <= n, factor)


def _whole_matrices(stacked: jax.Array) -> jax.Array:
    """Gathers Explicit-mode shards of the two matrix axes, keeping the batch axis split.

    Under Explicit sharding a Gram matrix over a sharded axis has no defined output sharding.
    Each device then orthogonalizes whole matrices of its share of the batch; Auto axes are
    left to XLA's partitioner (a no-op here).
    """
    sharding = jax.typeof(stacked).sharding
    spec = tuple(sharding.spec) + (None,) * stacked.ndim
    if spec[1] is None and spec[2] is None:
        return stacked
    # A NamedSharding, not a bare PartitionSpec: outside `jax.set_mesh` there is no mesh to
    # resolve one against.
    return jax.sharding.reshard(stacked, NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(spec[0], None, None)))


def _as_matrices(x: jax.Array, plan: _Plan) -> jax.Array:
    """A leaf as its ``(batch, m, n)`` stack of matrices, oriented wide (``m <= n``)."""
    mats = jnp.transpose(x, plan.perm).reshape(plan.flat_shape)
    return mats if plan.wide else jnp.swapaxes(mats, -1, -2)


def _shape_groups(leaves, leaf_plans) -> list[list[int]]:
    """Indices of the planned leaves, grouped by oriented matrix shape and dtype: each group is
    orthogonalized by one call."""
    groups: dict[tuple, list[int]] = {}
    for i, (x, plan) in enumerate(zip(leaves, leaf_plans, strict=True)):
        if plan is None or x.size == 0:
            continue
        m, n = plan.flat_shape[1:]
        groups.setdefault((min(m, n), max(m, n), jnp.dtype(x.dtype)), []).append(i)
    return list(groups.values())


def _orthogonalize_group(mats: list[jax.Array], leaves: list[jax.Array],
                         leaf_plans: list[_Plan], polar_of) -> list[jax.Array]:
    """One group's stacks of matrices (from `_as_matrices`), concatenated, mapped by `polar_of`
    in one call and returned as the leaves' shapes, each times its scale."""
    polar = polar_of(jnp.concatenate(mats, axis=0))
    offsets = np.cumsum([m.shape[0] for m in mats])[:-1]
    return [_as_leaf(part, plan, x) for part, plan, x in
            zip(jnp.split(polar, offsets, axis=0), leaf_plans, leaves, strict=True)]


def _param_leaves(params, count: int) -> list | None:
    """The parameters' array leaves aligned with the updates' leaves (None where masked), or
    None when no parameters were given or their tree does not match the updates'."""
    if params is None:
        return None
    leaves = [x for _, x in flatten_with_paths(params, open_boxes=True, is_leaf=is_masked)[0]]
    if len(leaves) != count:
        return None
    return [None if is_masked(x) or not hasattr(x, "shape") else x for x in leaves]


def _as_leaf(part: jax.Array, plan: _Plan, x: jax.Array) -> jax.Array:
    """Undoes `_as_matrices` for one leaf's share of a group, times its scale."""
    if not plan.wide:
        part = jnp.swapaxes(part, -1, -2)
    part = (part * plan.scale).astype(x.dtype)
    permuted = tuple(x.shape[ax] for ax in plan.perm)
    inverse = tuple(int(a) for a in np.argsort(plan.perm))
    return jnp.transpose(part.reshape(permuted), inverse)


def check_muon_options(*, scale: str | None, eps: float, rms_scale: float,
                       compute_dtype: Any) -> str:
    """Checks `muon_orthogonalize`'s options (traced ``eps``/``rms_scale`` pass); the scale."""
    if scale is None:
        scale = "none"
    if scale not in _SCALES:
        raise ValueError(f"scale must be one of {_SCALES} or None, got {scale!r}")
    if isinstance(eps, numbers.Real) and not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if isinstance(rms_scale, numbers.Real) and not (math.isfinite(rms_scale) and rms_scale > 0):
        raise ValueError(f"rms_scale must be a finite number > 0, got {rms_scale!r}")
    if compute_dtype is not None and not jnp.issubdtype(jnp.dtype(compute_dtype), jnp.floating):
        raise TypeError(f"compute_dtype must be a floating dtype or None, got {compute_dtype!r}")
    return scale


@dataclasses.dataclass(frozen=True)
class MuonOptions:
    """Every option of a Muon chain (``optax.trace`` then `muon_orthogonalize`): the one home of
    their defaults, which `muon_orthogonalize`'s own keywords read.

    `rowgeom.lm_optimizer` trains its hidden group (and a Muon head or router) with it.

    Attributes:
      momentum: ``optax.trace`` decay before the orthogonalization (the hidden and a Muon
        router group's momentum; a group's `GroupOptions.momentum` overrides it).
      nesterov: Nesterov momentum (buffer ``b = m·b + g``, direction ``g + m·b``).
      mu_dtype: dtype of the momentum buffer (``optax.trace``'s ``accumulator_dtype``); None:
        the parameters'.
      ns_steps: Newton–Schulz steps.
      ns_coeffs: preset name, triple or table (`rowgeom.ns_coefficients`).
      eps: added to each matrix's Frobenius norm before normalising.
      compute_dtype: dtype of the Newton–Schulz iteration (e.g. ``jnp.bfloat16``; products
        accumulate in float32); None: each update's own.
      scale: `muon_orthogonalize`'s ``scale`` (``"rms"``: step RMS `rms_scale`; ``"keller"``:
        ``sqrt(max(1, fan_out / fan_in))``).
      rms_scale: the step RMS of ``scale="rms"``.
      shard_matrices: when the updates live on a multi-device mesh, orthogonalize whole
        matrices, each on one device (`muon_orthogonalize`'s option of that name); False leaves
        Newton–Schulz to the partitioner.
      dimension_numbers: None (in `lm_optimizer`, each hidden leaf's matrix axes inferred from
        the model structure; an undecidable leaf raises, naming it); a mapping ``{"/"-joined
        path: MuonDimensionNumbers}`` overriding the inference for those leaves or subtrees;
        or, as in `muon_orthogonalize`, one ``MuonDimensionNumbers`` for every hidden leaf, a
        tree or a callable of the parameter tree (nothing inferred).

    Examples:
      >>> import rowgeom
      >>> rowgeom.MuonOptions(ns_steps=6).ns_steps
      6
      >>> rowgeom.MuonOptions(rms_scale=0)
      Traceback (most recent call last):
      ...
      ValueError: MuonOptions.rms_scale must be a finite number > 0, got 0
    """

    momentum: float = 0.95
    nesterov: bool = True
    mu_dtype: Any = None
    ns_steps: int = 5
    ns_coeffs: Any = "keller"
    eps: float = 1e-7
    compute_dtype: Any = None
    scale: str | None = "rms"
    rms_scale: float = 0.2
    shard_matrices: bool = True
    dimension_numbers: Any = None

    def __post_init__(self):
        check_bool(self.nesterov, "MuonOptions.nesterov")
        check_bool(self.shard_matrices, "MuonOptions.shard_matrices")
        check_momentum(self.momentum, "MuonOptions.momentum")
        for name in ("ns_coeffs", "dimension_numbers", "eps", "rms_scale"):
            not_array(getattr(self, name), f"MuonOptions.{name}")
        prefixed("MuonOptions", resolve_coefficients, self.ns_coeffs, self.ns_steps)
        prefixed("MuonOptions", check_muon_options, scale=self.scale, eps=self.eps,
                 rms_scale=self.rms_scale, compute_dtype=self.compute_dtype)

    def orthogonalize(self, dimension_numbers: Any) -> optax.GradientTransformation:
        """`muon_orthogonalize` with these options and the given dimension numbers."""
        return muon_orthogonalize(
            ns_steps=self.ns_steps, ns_coeffs=self.ns_coeffs, eps=self.eps,
            compute_dtype=self.compute_dtype, scale=self.scale, rms_scale=self.rms_scale,
            shard_matrices=self.shard_matrices, dimension_numbers=dimension_numbers)


_D = MuonOptions  # muon_orthogonalize's defaults are MuonOptions'


def muon_orthogonalize(*, ns_steps: int = _D.ns_steps, ns_coeffs: Any = _D.ns_coeffs,
                       eps: float = _D.eps, compute_dtype: Any = _D.compute_dtype,
                       scale: str | None = _D.scale, rms_scale: float = _D.rms_scale,
                       dimension_numbers: Any = None, shard_matrices: bool = _D.shard_matrices
                       ) -> optax.GradientTransformation:
    """Replaces every matrix of the updates by `scale(m, n) * newton_schulz(matrix)`.

    Args:
      ns_steps: Newton–Schulz steps (static Python int).
      ns_coeffs: `"keller"`, `"polar_express"`, a `(3,)` triple or an `(ns_steps, 3)` table
        (see `rowgeom.ns_coefficients`); resolved once here into a static numpy table.
      eps: added to the Frobenius norm before normalising; zero matrices map to zero.
      compute_dtype: dtype of the iteration (e.g. `jnp.bfloat16`); products accumulate in f32,
        results keep each leaf's dtype.
      scale: per matrix, with ``m`` = fan-in (product of the reduction dims) and ``n`` = fan-out:
        ``"rms"`` (default) ``rms_scale * sqrt(max(m, n))`` (a full-rank polar factor has RMS
        ``1/sqrt(max(m, n))``, so the step's RMS is about ``rms_scale``, AdamW's typical update
        RMS at 0.2: Liu et al., arXiv 2502.16982); ``"spectral"`` ``sqrt(n / m)`` (Yang, Simon &
        Bernstein, arXiv 2310.17813); ``"keller"`` ``sqrt(max(1, n / m))`` (Keller Jordan's
        Muon); ``"none"`` or `None`: the bare polar factor. The factor depends on the matrix
        shape, not the leaf's, so a stacked ``(L, in, out)`` leaf is scaled like ``L`` separate
        matrices (optax 0.2.8's ``adaptive=True`` instead multiplies by ``<G, polar(G)>`` summed
        over the whole leaf, mixing the matrices of a stack).
      rms_scale: target update RMS for `scale="rms"`.
      dimension_numbers: `None` (every leaf must be rank 2: reduction axis 0, output axis 1), one
        `MuonDimensionNumbers` for every leaf, a tree (prefix of the updates) of
        `MuonDimensionNumbers` or `None` (`None` passes that subtree through unchanged), or a
        callable receiving the updates (same structure and shapes as the params) and returning
        such a tree. ``optax.contrib.MuonDimensionNumbers`` is accepted wherever rowgeom's is.
      shard_matrices: when the updates live on a device mesh (set with `jax.set_mesh`, or named
        by the updates' own `NamedSharding`), orthogonalize whole matrices, each on one device:
        each group of same-shape matrices is padded with zero matrices to a multiple of the
        device count and split along its batch axis over every device of the mesh (one
        all-to-all), Newton–Schulz runs with no communication, and each result returns to its
        update's sharding (one all-to-all back). A group of fewer matrices than devices is
        instead split along the matrices' long side over every device when that moves less data
        (each step then all-reduces the small Gram matrices: a Muon head). Under Explicit axes a
        group of replicated updates stays where it is. `False`: leave the placement to XLA's
        partitioner, which communicates inside every iteration for a matrix split across
        devices. Results are the same either way (to float32 rounding). A static Python bool;
        see the sharding guide.

    Returns:
      A stateless `optax.GradientTransformation` (`optax.EmptyState`). `None` and
      `optax.MaskedNode` update leaves pass through, so it works inside `optax.partition`.

    With `optax.inject_hyperparams`, `eps` and `rms_scale` may be injected; `ns_steps`,
    `ns_coeffs` (if an array) and a callable `dimension_numbers` must be listed in `static_args`.

    Examples:
      Momentum first, then the polar factor, then the learning rate; a stacked `(L, in, out)`
      leaf is `L` separate matrices:

      >>> import jax, jax.numpy as jnp, optax, rowgeom
      >>> grads = {"w": jax.random.normal(jax.random.key(0), (64, 256)),
      ...          "stack": jax.random.normal(jax.random.key(1), (3, 64, 64))}
      >>> tx = optax.chain(
      ...     optax.trace(decay=0.95, nesterov=True),
      ...     rowgeom.muon_orthogonalize(dimension_numbers={
      ...         "w": rowgeom.MuonDimensionNumbers(reduction_axis=0, output_axis=1),
      ...         "stack": rowgeom.MuonDimensionNumbers(reduction_axis=1, output_axis=2)}),
      ...     optax.scale_by_learning_rate(1e-3))
      >>> updates, _ = tx.update(grads, tx.init(grads))
      >>> rms = float(jnp.sqrt(jnp.mean(jnp.square(updates["w"]))))
      >>> 0.15 < rms / 1e-3 < 0.21   # scale="rms": step RMS about rms_scale * lr
      True
    """
    table, norm_scale = resolve_coefficients(ns_coeffs, ns_steps)
    scale = check_muon_options(scale=scale, eps=eps, rms_scale=rms_scale,
                               compute_dtype=compute_dtype)
    if not isinstance(shard_matrices, (bool, np.bool_)):
        raise TypeError(f"shard_matrices must be a Python bool, got {shard_matrices!r}")
    options = _Options(_Polar(table, norm_scale, eps, compute_dtype), dimension_numbers, scale,
                       rms_scale, bool(shard_matrices))

    def init_fn(params):
        _leaf_plans(params, options)  # report bad shapes/dtypes/dimension numbers at init time
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        return _orthogonalized(updates, params, options), state

    return optax.GradientTransformation(init_fn, update_fn)


class _Polar(NamedTuple):
    """The Newton–Schulz iteration of one transform, resolved."""

    table: np.ndarray
    norm_scale: float
    eps: Any
    compute_dtype: Any

    def __call__(self, stack: jax.Array) -> jax.Array:
        return orthogonalize(stack, self.table, norm_scale=self.norm_scale, eps=self.eps,
                             compute_dtype=self.compute_dtype)

    def whole(self, stack: jax.Array) -> jax.Array:
        """Of a stack whose Explicit-mode shards of the matrix axes are gathered first."""
        return self(_whole_matrices(stack))

    def on_devices(self, stack: jax.Array, where) -> jax.Array:
        """Of a stack with each matrix whole on one device of `where` (a stack of fewer, wide
        matrices: each split along its long side over every device, when that moves less)."""
        batch, m, n = stack.shape
        if splits_long_side(batch, m, n, where, self.table.shape[0]):
            return gather(self(split_long_side(stack, where)), batch, where, long_side=True)
        return gather(self(spread(stack, where)), batch, where)


class _Options(NamedTuple):
    polar: _Polar
    dimension_numbers: Any
    scale: str
    rms_scale: Any
    shard_matrices: bool


def _leaf_plans(tree, options: _Options):
    """``(leaves, treedef, [_Plan or None])`` of a tree (None: the leaf passes unchanged)."""
    dims = options.dimension_numbers
    dims = dims(tree) if callable(dims) else dims
    leaves, treedef = flatten_with_paths(tree, open_boxes=True, is_leaf=is_masked)
    plans = [None if is_masked(x) or d is _PASS else
             _plan(path, x, d, scale=options.scale, rms_scale=options.rms_scale)
             for (path, x), d in zip(leaves, _dims_per_leaf(dims, leaves), strict=True)]
    return [x for _, x in leaves], treedef, plans


def _local(group: list[int], leaves, leaf_plans, polar: _Polar) -> list[jax.Array]:
    """One group's results, orthogonalized wherever the partitioner places them."""
    mats = [_as_matrices(leaves[i], leaf_plans[i]) for i in group]
    # Explicit-mode sharding is part of the type: only equally sharded stacks concatenate.
    by_sharding: dict[Any, list[int]] = {}
    for k, m in enumerate(mats):
        by_sharding.setdefault(jax.typeof(m).sharding.spec, []).append(k)
    out: dict[int, jax.Array] = {}
    for ks in by_sharding.values():
        parts = _orthogonalize_group([mats[k] for k in ks], [leaves[group[k]] for k in ks],
                                     [leaf_plans[group[k]] for k in ks], polar.whole)
        out.update((group[k], part) for k, part in zip(ks, parts, strict=True))
    return [sharded_like(out[i], leaves[i]) for i in group]


def _spread(inputs, *, groups, leaf_plans, where, polar: _Polar) -> list[list[jax.Array]]:
    """The groups' results (one list of leaves per group), each matrix orthogonalized whole
    on one device of `where` (`_Polar.on_devices`); run inside `on_mesh`."""
    out = []
    for group, leaves in zip(groups, inputs, strict=True):
        group_plans = [leaf_plans[i] for i in group]
        mats = [_as_matrices(x, plan) for x, plan in zip(leaves, group_plans, strict=True)]
        out.append(_orthogonalize_group(mats, leaves, group_plans,
                                        functools.partial(polar.on_devices, where=where)))
    return out


def _tied(result: jax.Array, anchor) -> jax.Array:
    """Under Auto axes a parameter's sharding is fixed where the update's is not: the result
    tied to it, so the update comes back in its sharding."""
    if anchor is not None and anchor.shape == result.shape:
        return shard_alike(result, anchor)[0]
    return result


def _orthogonalized(updates, params, options: _Options):
    """`muon_orthogonalize`'s update: every planned matrix replaced by its scaled polar factor,
    groups of one shape in one call, spread over the mesh the updates live on."""
    leaves, treedef, leaf_plans = _leaf_plans(updates, options)  # shapes from the updates
    groups = _shape_groups(leaves, leaf_plans)
    where = (matrix_mesh([leaves[i] for group in groups for i in group])
             if options.shard_matrices else None)
    spread_groups = [group for group in groups if where is not None
                     and not all(known_replicated(leaves[i], where) for i in group)]
    out = list(leaves)
    for group in groups:
        if group not in spread_groups:
            for i, result in zip(group, _local(group, leaves, leaf_plans, options.polar),
                                 strict=True):
                out[i] = result
    if where is not None and spread_groups:
        results = on_mesh(functools.partial(_spread, groups=spread_groups, leaf_plans=leaf_plans,
                                            where=where, polar=options.polar),
                          [[leaves[i] for i in group] for group in spread_groups], where)
        anchors = _param_leaves(params, len(leaves)) if not where.explicit_axes else None
        for group, group_results in zip(spread_groups, results, strict=True):
            for i, result in zip(group, group_results, strict=True):
                out[i] = _tied(result, None if anchors is None else anchors[i])
    return jax.tree_util.tree_unflatten(treedef, out)
