"""Whole matrices on one device each: where Muon's Newton–Schulz runs when updates are sharded.

Contract: `matrix_mesh` finds the device mesh the updates live on at trace time (or None), and
`on_mesh` runs a function of the updates in an Auto view of that mesh, returning each result in
its input's sharding. Inside it, `spread` splits a ``(b, m, n)`` stack of matrices along its
batch axis over every device of the mesh (zero matrices pad ``b`` up to a multiple of the device
count; Newton–Schulz maps them to zero) and `gather` undoes it. A group of fewer matrices than
devices is split along the matrices' long side instead (`split_long_side`) when that moves less
data (`splits_long_side`): the iteration then all-reduces the small Gram matrices.

Why: Newton–Schulz on a matrix split across devices communicates in every iteration (a Gram
matrix over a split axis is a sum over devices; a split along the Gram's own axes makes the
partitioner all-gather the matrix). Split along the batch axis instead, each device
orthogonalizes whole matrices with no communication; getting there and back is one all-to-all
each way, which the partitioner emits from the two sharding constraints.

Which mesh: the one set by `jax.set_mesh`, else the one the updates' types carry (inside `jit`,
JAX records the mesh of an array placed with a `NamedSharding` in its type, for Auto and
Explicit axes alike, whether it was placed by `device_put`, by a `jit`'s `out_shardings` or by
Flax's sharding annotations). Manual axes (inside `shard_map`) and axes of size 1 are not used.
When no mesh is visible (one device, or host arrays given to a `jit` with `in_shardings` outside
`jax.set_mesh`) nothing is constrained, and the partitioner places the iteration as it would
any other computation; a constraint naming devices the computation does not run on would fail
or move it. Under Explicit axes the sharding is known: a group of replicated updates is left
where it is, and every result is resharded to its update's sharding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.shard_alike import shard_alike
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


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
