"""Muon's orthogonalization as a stateless optax transform, batched across leaves.

Contract: `muon_orthogonalize` replaces each matrix ``G`` of an update by
``scale(m, n) · polar(G)``, ``polar(G) = U Vᵀ`` for ``G = U Σ Vᵀ`` (Newton–Schulz,
`rowgeom.newton_schulz`), keeping the update's sign. `MuonDimensionNumbers` says which axes form
the matrix; the other axes are a batch of independent matrices. Momentum is a separate
transform: chain ``optax.trace`` before it and ``optax.scale_by_learning_rate`` after it.

It is the spectral-norm steepest-descent direction (Bernstein & Newhouse, arXiv 2409.20325;
Jordan et al., "Muon", 2024). How leaves of one matrix shape share one Newton–Schulz call, and
what that costs: docs/benchmarks.md; why it matters under sharding: docs/guides/sharding.md.

Three sections: the transform (each leaf's matrix layout, `_Layout`, and the batching of
matrices of one shape), the Newton–Schulz iteration that computes the polar factor
(`newton_schulz`, `ns_coefficients`), and where it runs when the updates are sharded (whole
matrices on one device each: `matrix_mesh`, `on_mesh`, `spread`, `gather`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental.shard_alike import shard_alike
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike, DTypeLike

from rowgeom._tree import (
    Path,
    check_bool,
    check_floating,
    check_min_rank,
    check_momentum,
    flatten_with_paths,
    is_masked,
    not_array,
    path_repr,
    path_str,
    prefixed,
    resolve_per_leaf,
)

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


class _Layout(NamedTuple):
    perm: tuple[int, ...]        # leaf axes -> (batch..., reduction..., output...)
    flat_shape: tuple[int, ...]  # (batch, m, n)
    wide: bool                   # True when m <= n (no transpose to orient wide)
    scale: Any                   # float or traced scalar


def _layout(path, x, dims, *, scale, rms_scale) -> _Layout:
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
    return _Layout(batch + red + out, (size(batch), m, n), m <= n, factor)


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


def _as_matrices(x: jax.Array, layout: _Layout) -> jax.Array:
    """A leaf as its ``(batch, m, n)`` stack of matrices, oriented wide (``m <= n``)."""
    mats = jnp.transpose(x, layout.perm).reshape(layout.flat_shape)
    return mats if layout.wide else jnp.swapaxes(mats, -1, -2)


def _shape_groups(leaves, layouts) -> list[list[int]]:
    """Indices of the laid-out leaves, grouped by oriented matrix shape and dtype: each group is
    orthogonalized by one call."""
    groups: dict[tuple, list[int]] = {}
    for i, (x, layout) in enumerate(zip(leaves, layouts, strict=True)):
        if layout is None or x.size == 0:
            continue
        m, n = layout.flat_shape[1:]
        groups.setdefault((min(m, n), max(m, n), jnp.dtype(x.dtype)), []).append(i)
    return list(groups.values())


def _orthogonalize_group(mats: list[jax.Array], leaves: list[jax.Array],
                         layouts: list[_Layout], polar_of) -> list[jax.Array]:
    """One group's stacks of matrices (from `_as_matrices`), concatenated, mapped by `polar_of`
    in one call and returned as the leaves' shapes, each times its scale."""
    polar = polar_of(jnp.concatenate(mats, axis=0))
    offsets = np.cumsum([m.shape[0] for m in mats])[:-1]
    return [_as_leaf(part, layout, x) for part, layout, x in
            zip(jnp.split(polar, offsets, axis=0), layouts, leaves, strict=True)]


def _param_leaves(params, count: int) -> list | None:
    """The parameters' array leaves aligned with the updates' leaves (None where masked), or
    None when no parameters were given or their tree does not match the updates'."""
    if params is None:
        return None
    leaves = [x for _, x in flatten_with_paths(params, open_boxes=True, is_leaf=is_masked)[0]]
    if len(leaves) != count:
        return None
    return [None if is_masked(x) or not hasattr(x, "shape") else x for x in leaves]


def _as_leaf(part: jax.Array, layout: _Layout, x: jax.Array) -> jax.Array:
    """Undoes `_as_matrices` for one leaf's share of a group, times its scale."""
    if not layout.wide:
        part = jnp.swapaxes(part, -1, -2)
    part = (part * layout.scale).astype(x.dtype)
    permuted = tuple(x.shape[ax] for ax in layout.perm)
    inverse = tuple(int(a) for a in np.argsort(layout.perm))
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
        _leaf_layouts(params, options)  # report bad shapes/dtypes/dimension numbers at init time
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


def _leaf_layouts(tree, options: _Options):
    """``(leaves, treedef, [_Layout or None])`` of a tree (None: the leaf passes unchanged)."""
    dims = options.dimension_numbers
    dims = dims(tree) if callable(dims) else dims
    leaves, treedef = flatten_with_paths(tree, open_boxes=True, is_leaf=is_masked)
    layouts = [None if is_masked(x) or d is _PASS else
             _layout(path, x, d, scale=options.scale, rms_scale=options.rms_scale)
             for (path, x), d in zip(leaves, _dims_per_leaf(dims, leaves), strict=True)]
    return [x for _, x in leaves], treedef, layouts


def _local(group: list[int], leaves, layouts, polar: _Polar) -> list[jax.Array]:
    """One group's results, orthogonalized wherever the partitioner places them."""
    mats = [_as_matrices(leaves[i], layouts[i]) for i in group]
    # Explicit-mode sharding is part of the type: only equally sharded stacks concatenate.
    by_sharding: dict[Any, list[int]] = {}
    for k, m in enumerate(mats):
        by_sharding.setdefault(jax.typeof(m).sharding.spec, []).append(k)
    out: dict[int, jax.Array] = {}
    for ks in by_sharding.values():
        parts = _orthogonalize_group([mats[k] for k in ks], [leaves[group[k]] for k in ks],
                                     [layouts[group[k]] for k in ks], polar.whole)
        out.update((group[k], part) for k, part in zip(ks, parts, strict=True))
    return [sharded_like(out[i], leaves[i]) for i in group]


def _spread(inputs, *, groups, layouts, where, polar: _Polar) -> list[list[jax.Array]]:
    """The groups' results (one list of leaves per group), each matrix orthogonalized whole
    on one device of `where` (`_Polar.on_devices`); run inside `on_mesh`."""
    out = []
    for group, leaves in zip(groups, inputs, strict=True):
        group_layouts = [layouts[i] for i in group]
        mats = [_as_matrices(x, layout) for x, layout in zip(leaves, group_layouts, strict=True)]
        out.append(_orthogonalize_group(mats, leaves, group_layouts,
                                        functools.partial(polar.on_devices, where=where)))
    return out


def _tied(result: jax.Array, anchor) -> jax.Array:
    """Under Auto axes a parameter's sharding is fixed where the update's is not: the result
    tied to it, so the update comes back in its sharding."""
    if anchor is not None and anchor.shape == result.shape:
        return shard_alike(result, anchor)[0]
    return result


def _orthogonalized(updates, params, options: _Options):
    """`muon_orthogonalize`'s update: every laid-out matrix replaced by its scaled polar factor,
    groups of one shape in one call, spread over the mesh the updates live on."""
    leaves, treedef, layouts = _leaf_layouts(updates, options)  # shapes from the updates
    groups = _shape_groups(leaves, layouts)
    where = (matrix_mesh([leaves[i] for group in groups for i in group])
             if options.shard_matrices else None)
    spread_groups = [group for group in groups if where is not None
                     and not all(known_replicated(leaves[i], where) for i in group)]
    out = list(leaves)
    for group in groups:
        if group not in spread_groups:
            for i, result in zip(group, _local(group, leaves, layouts, options.polar),
                                 strict=True):
                out[i] = result
    if where is not None and spread_groups:
        results = on_mesh(functools.partial(_spread, groups=spread_groups, layouts=layouts,
                                            where=where, polar=options.polar),
                          [[leaves[i] for i in group] for group in spread_groups], where)
        anchors = _param_leaves(params, len(leaves)) if not where.explicit_axes else None
        for group, group_results in zip(spread_groups, results, strict=True):
            for i, result in zip(group, group_results, strict=True):
                out[i] = _tied(result, None if anchors is None else anchors[i])
    return jax.tree_util.tree_unflatten(treedef, out)


# --- Newton–Schulz orthogonalization: an approximate polar factor from matrix products only.
#
# Contract: for ``X = U Σ Vᵀ``, `newton_schulz` returns about ``polar(X) = U Vᵀ`` (the spectral-norm
# steepest-descent direction, Bernstein & Newhouse, arXiv 2409.20325) by applying an odd quintic
# ``σ <- a σ + b σ³ + c σ⁵`` to every singular value at once, ``X <- a X + (b A + c A²) X`` with
# ``A = X Xᵀ``, after normalising by the Frobenius norm (an upper bound of the spectral norm).
# It works per matrix over the last two axes (leading axes are a batch), keeps the singular
# vectors and zero singular values (a zero-sum matrix keeps a zero-sum polar factor), and returns
# the input's dtype. `ns_coefficients` gives the ``(a, b, c)`` table of each step.
#
# The presets' sources and measured singular-value bands: docs/api/muon.md ("Newton–Schulz
# coefficients").

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


# --- Whole matrices on one device each: where Muon's Newton–Schulz runs when updates are sharded.
#
# Contract: `matrix_mesh` finds the device mesh the updates live on at trace time (or None), and
# `on_mesh` runs a function of the updates in an Auto view of that mesh, returning each result in
# its input's sharding. Inside it, `spread` splits a ``(b, m, n)`` stack of matrices along its
# batch axis over every device of the mesh (zero matrices pad ``b`` up to a multiple of the device
# count; Newton–Schulz maps them to zero) and `gather` undoes it. A group of fewer matrices than
# devices is split along the matrices' long side instead (`split_long_side`) when that moves less
# data (`splits_long_side`): the iteration then all-reduces the small Gram matrices.
#
# Why: Newton–Schulz on a matrix split across devices communicates in every iteration (a Gram
# matrix over a split axis is a sum over devices; a split along the Gram's own axes makes the
# partitioner all-gather the matrix). Split along the batch axis instead, each device
# orthogonalizes whole matrices with no communication; getting there and back is one all-to-all
# each way, which the partitioner emits from the two sharding constraints.
#
# Which mesh: the one set by `jax.set_mesh`, else the one the updates' types carry (inside `jit`,
# JAX records the mesh of an array placed with a `NamedSharding` in its type, for Auto and
# Explicit axes alike, whether it was placed by `device_put`, by a `jit`'s `out_shardings` or by
# Flax's sharding annotations). Manual axes (inside `shard_map`) and axes of size 1 are not used.
# When no mesh is visible (one device, or host arrays given to a `jit` with `in_shardings` outside
# `jax.set_mesh`) nothing is constrained, and the partitioner places the iteration as it would
# any other computation; a constraint naming devices the computation does not run on would fail
# or move it. Under Explicit axes the sharding is known: a group of replicated updates is left
# where it is, and every result is resharded to its update's sharding.

class MatrixMesh(NamedTuple):
    """The mesh the updates live on and the axes a batch of matrices is split over."""

    mesh: Any                # a jax.sharding.AbstractMesh (or a concrete Mesh outside jit)
    axes: tuple[str, ...]    # its non-manual axes of size > 1, in mesh order
    size: int                # the number of devices they span

    @property
    def explicit_axes(self) -> tuple[str, ...]:
        types = dict(zip(self.mesh.axis_names, self.mesh.axis_types, strict=True))
        return tuple(a for a in self.axes if types[a] == AxisType.Explicit)


def _sharding(x) -> NamedSharding | None:
    sharding = jax.typeof(x).sharding if isinstance(x, jax.core.Tracer) else getattr(
            x, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


def matrix_mesh(leaves: Sequence[jax.Array]) -> MatrixMesh | None:
    """The mesh of `jax.set_mesh`, else the one mesh the leaves' shardings name; None if there
    is none, if the leaves name different meshes, or if it has no usable axis of size > 1."""
    mesh: Any = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        meshes = {s.mesh for s in map(_sharding, leaves) if s is not None and not s.mesh.empty}
        if len(meshes) != 1:
            return None
        (mesh,) = meshes
    axes = tuple(name for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes,
                                                   mesh.axis_types, strict=True)
                 if size > 1 and kind != AxisType.Manual)
    if not axes:
        return None
    return MatrixMesh(mesh, axes, math.prod(mesh.shape[a] for a in axes))


def known_replicated(x: jax.Array, where: MatrixMesh) -> bool:
    """True when `x` is known to be whole on every device of `where` (Explicit axes only: an
    Auto axis's sharding is decided after tracing, so it counts as possibly split)."""
    if set(where.explicit_axes) != set(where.axes):
        return False
    sharding = _sharding(x)
    if sharding is None:
        return False
    used = {a for entry in sharding.spec if entry is not None
            for a in (entry if isinstance(entry, tuple) else (entry,))}
    return not used & set(where.axes)


def sharded_like(y: jax.Array, x: jax.Array) -> jax.Array:
    """`y` resharded to `x`'s sharding where that is part of the type (Explicit axes)."""
    want = jax.typeof(x).sharding
    if not want.mesh.explicit_axes or jax.typeof(y).sharding.spec == want.spec:
        return y
    return jax.sharding.reshard(y, want)


def on_mesh(fn: Callable[[Any], Any], leaves: Any, where: MatrixMesh) -> Any:
    """`fn(leaves)` with every axis of `where` Auto inside; `fn` returns a tree like `leaves`
    (same shapes), each output in its leaf's sharding when that is known (Explicit axes), else
    where the partitioner puts it."""
    def alike(xs):
        # Under Auto axes the updates' shardings are decided after tracing: tying each result
        # to its update lets the partitioner return it there (one all-to-all) rather than
        # choose a layout of its own for a result nothing downstream constrains.
        return jax.tree.map(lambda y, x: shard_alike(y, x)[0], fn(xs), xs)

    explicit = where.explicit_axes
    if not explicit:
        return alike(leaves)
    out_sharding = jax.tree.map(lambda x: jax.typeof(x).sharding, leaves)
    return jax.sharding.auto_axes(fn, axes=explicit, out_sharding=out_sharding)(leaves)


def _constrain(x: jax.Array, spec: P, where: MatrixMesh) -> jax.Array:
    # Inside `on_mesh` the current mesh is the Auto view of `where.mesh`; outside `jax.set_mesh`
    # there is none, and the constraint names the updates' own mesh.
    mesh = jax.sharding.get_abstract_mesh()
    return jax.lax.with_sharding_constraint(
            x, NamedSharding(where.mesh if mesh.empty else mesh, spec))


_FREE = P.UNCONSTRAINED


def splits_long_side(batch: int, m: int, n: int, where: MatrixMesh, steps: int) -> bool:
    """Whether `batch` matrices ``(m, n)``, ``m <= n``, communicate less split along ``n`` over
    every device (each step all-reduces the ``(m, m)`` Gram matrices) than moved whole to one
    device each (one matrix per device per direction): only with fewer matrices than devices,
    and then for wide matrices (a Muon head ``(d, V)``)."""
    devices = where.size
    if batch >= devices:
        return False
    whole = 2 * -(-batch // devices) * m * n
    long_side = 2 * batch * m * -(-n // devices) + steps * batch * m * m
    return long_side < whole


def spread(stack: jax.Array, where: MatrixMesh) -> jax.Array:
    """A ``(b, m, n)`` stack padded with zero matrices to ``b' = ceil(b / D) D`` and split along
    the batch axis over the `D` devices of `where`, whole matrices on each."""
    pad = -stack.shape[0] % where.size
    if pad:
        stack = jnp.pad(stack, ((0, pad), (0, 0), (0, 0)))
    # One mesh axis at a time: each step is an all-to-all over that axis (or a local slice
    # where the stack is replicated over it), which the partitioner emits directly; a move
    # over several axes at once it may implement by gathering the whole stack. The first
    # constraint keeps the batch axis whole where the leaves are concatenated (a concatenation
    # along a split axis is not local).
    for k in range(len(where.axes)):
        stack = _constrain(stack, P(where.axes[:k] or None, _FREE, _FREE), where)
    return _constrain(stack, P(where.axes, None, None), where)


def split_long_side(stack: jax.Array, where: MatrixMesh) -> jax.Array:
    """A ``(b, m, n)`` stack with every matrix split along ``n`` over the devices of `where`
    (one mesh axis at a time, as in `spread`)."""
    for k in range(len(where.axes)):
        stack = _constrain(stack, P(None, _FREE, where.axes[:k] or _FREE), where)
    return _constrain(stack, P(None, None, where.axes), where)


def gather(polar: jax.Array, batch: int, where: MatrixMesh, *, long_side: bool = False
           ) -> jax.Array:
    """The first `batch` matrices of a `spread` (or `split_long_side`) stack, the batch axis
    whole again; the matrix axes' sharding is left to the partitioner, which takes it from the
    results' users."""
    # First the layout the iteration ran in, so that the results' users cannot pull another
    # layout (and its communication) back into the last Newton–Schulz step.
    polar = _constrain(polar, P(None, None, where.axes) if long_side
                       else P(where.axes, None, None), where)
    for k in reversed(range(len(where.axes))):
        axes = where.axes[:k]
        spec = (P(None, _FREE, axes or _FREE) if long_side
                else P(axes or None, _FREE, _FREE))
        polar = _constrain(polar, spec, where)
    return polar[:batch]
