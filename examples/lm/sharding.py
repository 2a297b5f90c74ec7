"""The device mesh and where every array lives on it: parameters, optimizer state, batches.

Axes: `data` (parameters replicated), `fsdp` (parameters and optimizer state sharded, ZeRO-3)
and `tensor` (vocabulary, MLP width, heads). The model names every parameter's and activation's
axes by meaning (`"embed"`, `"activation_batch"`), and `RULES` maps the names onto mesh axes, as
MaxText's `logical_axis_rules` (without the activation constraints the partitioner would carry
the FSDP split into the activations and gather whole global-batch activations). A mesh axis that
does not divide a dimension is dropped for it (`fit_spec`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def maybe_initialize_distributed(mode: str = "auto") -> None:
    """`jax.distributed.initialize()` (which reads its arguments from the environment) with `mode`
    "on", or "auto" when a launcher describes several processes (Cloud TPU pod, SLURM, MPI, an
    explicit coordinator). Must run before any other JAX call touches the backend."""
    if mode == "auto":
        hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
        several = (os.environ.get("JAX_COORDINATOR_ADDRESS") or len(hosts) > 1
                   or any(int(os.environ.get(var, "1") or 1) > 1
                          for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JAX_NUM_PROCESSES")))
        mode = "on" if several else "off"
    if mode == "on":
        # jax reads JAX_COORDINATOR_ADDRESS but not these two: a launcher that sets them (and
        # no cluster jax detects) describes the processes through them.
        given = {name: os.environ.get(var) for name, var in (
            ("num_processes", "JAX_NUM_PROCESSES"), ("process_id", "JAX_PROCESS_ID"))}
        if any(given.values()) and not all(given.values()):
            raise ValueError("JAX_NUM_PROCESSES and JAX_PROCESS_ID describe the processes "
                             "together: set both (and JAX_COORDINATOR_ADDRESS), or neither")
        jax.distributed.initialize(**{k: int(v) for k, v in given.items() if v})


_FLAGS = "--mesh.data/--mesh.fsdp/--mesh.tensor"


def check_sizes(data: int, fsdp: int, tensor: int) -> None:
    """Raise ValueError unless every size is positive or -1, and at most one is -1."""
    sizes = (data, fsdp, tensor)
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"{_FLAGS} must be positive or -1, got {sizes}")
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one of {_FLAGS} may be -1 (the axis that takes the remaining "
                         f"devices), got {sizes}")


def mesh_shape(data: int, fsdp: int, tensor: int, num_devices: int) -> tuple[int, int, int]:
    """Resolve at most one -1 entry to the remaining devices and check the product."""
    check_sizes(data, fsdp, tensor)
    sizes = [data, fsdp, tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(f"{_FLAGS} = {tuple(sizes)}: {num_devices} devices are not "
                             f"divisible by {known}")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ValueError(f"{_FLAGS} = {tuple(sizes)} need {math.prod(sizes)} devices, but "
                         f"{num_devices} are available")
    return tuple(sizes)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, *, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axes (jax.make_mesh would default to Explicit).
    Several TPU slices get a hybrid mesh: `data` spans the slices first (only the gradients'
    data-parallel reductions cross the data-center network), the rest within each slice."""
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(data, fsdp, tensor, len(devices))
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices > 1:
        if shape[0] % slices:
            raise ValueError(f"{_FLAGS} = {shape}: with {slices} slices --mesh.data must be a "
                             "multiple of the number of slices (only data parallelism crosses "
                             "slices)")
        from jax.experimental import mesh_utils  # noqa: PLC0415

        grid = mesh_utils.create_hybrid_device_mesh(
            (shape[0] // slices, shape[1], shape[2]), (slices, 1, 1), devices)
        return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def fit_spec(shape: tuple[int, ...], spec: P, mesh: Mesh) -> P:
    """`spec` with every mesh axis removed from the dimensions it does not divide."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    fitted = []
    for dim, entry in zip(shape, entries, strict=True):
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        kept, size = [], 1
        for name in names:
            if dim % (size * mesh.shape[name]) == 0:
                kept.append(name)
                size *= mesh.shape[name]
        fitted.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return P(*fitted)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches (B, T): rows split over the data-parallel axes."""
    return NamedSharding(mesh, P(BATCH_AXES, None))


def check_batch(batch_size: int, mesh: Mesh) -> tuple[int, int]:
    """This process's rows (`process_rows`); a ValueError unless the batch splits evenly over the
    data-parallel devices and each process's devices hold one block of consecutive rows."""
    dp = math.prod(mesh.shape[a] for a in BATCH_AXES)
    if batch_size % dp:
        raise ValueError(f"--data.batch_size ({batch_size}) must be divisible by the data-"
                         f"parallel size --mesh.data x --mesh.fsdp ({dp})")
    return process_rows(batch_size, mesh)


def process_rows(batch_size: int, mesh: Mesh, devices=None) -> tuple[int, int]:
    """The rows [lo, hi) of a (batch_size, T) batch that `devices` (default: this process's)
    hold under `batch_sharding`: what a process reads of every batch (all of them where the
    data-parallel axes stay within a process). A ValueError unless they are one block."""
    devices = set(mesh.local_devices if devices is None else devices)
    held = sorted({index[0].indices(batch_size)[:2] for device, index in
                   batch_sharding(mesh).devices_indices_map((batch_size, 1)).items()
                   if device in devices})
    lo, hi = held[0][0], max(stop for _, stop in held)
    if sum(stop - start for start, stop in held) != hi - lo:
        raise ValueError(
            f"the mesh gives process {jax.process_index()} batch rows {held}, not one block of "
            f"consecutive rows: lay {_FLAGS} out so that each process's devices are "
            "neighbours on the data-parallel axes (e.g. --mesh.data a multiple of the process "
            "count)")
    return lo, hi


def global_batch(local: np.ndarray, mesh: Mesh, *, batch_size: int,
                 replicated_rows: bool = False) -> jax.Array:
    """The global (batch_size, T) array from this process's rows (`process_rows`; every
    process passes its own), split over the data-parallel axes; with `replicated_rows`, the
    whole array on every device (every process then passes all of it)."""
    target = replicated(mesh) if replicated_rows else batch_sharding(mesh)
    return jax.make_array_from_process_local_data(target, local,
                                                  (batch_size, *local.shape[1:]))


def state_shardings(abstract: dict, param_shardings, mesh: Mesh) -> dict:
    """Shardings of the train state `{params, opt_state, ...}`: `param_shardings` for the
    parameters and, leaf for leaf where the shapes match, for every optimizer-state subtree laid
    out like them (moments, `MultiSteps`' accumulator, a partition group's copy with
    `MaskedNode`s); the rest replicated. (`optax.tree_utils.tree_map_params` would initialise
    the optimizer on placeholders, but `rowgeom.lm_optimizer` labels parameters by their paths.)"""
    repl, params = replicated(mesh), abstract["params"]
    _masked = lambda x: isinstance(x, optax.MaskedNode)
    layout = jax.tree.structure(params)

    def like_params(tree) -> bool:
        return (not isinstance(tree, jax.ShapeDtypeStruct | jax.Array)
                and jax.tree.structure(tree, is_leaf=_masked) == layout)

    def place(tree):
        if not like_params(tree):
            return repl
        return jax.tree.map(
            lambda leaf, p, s: leaf if _masked(leaf) else (s if leaf.shape == p.shape else repl),
            tree, params, param_shardings, is_leaf=_masked)

    out = {k: jax.tree.map(lambda _: repl, v) for k, v in abstract.items()}
    out["params"] = param_shardings
    out["opt_state"] = jax.tree.map(place, abstract["opt_state"], is_leaf=like_params)
    return out


# logical name -> mesh axes (None: not split). Every name the model uses must be here.
RULES: dict[str, str | tuple[str, ...] | None] = {
    # parameters
    "embed": "fsdp",        # a matrix's model-width axis: FSDP shards weights along it
    "heads": "tensor",      # attention projections' head axis (heads x head width, flattened)
    "mlp": "tensor",        # MLP width
    "vocab": "tensor",      # the head's and the embedding's vocabulary axis
    "norm": None,           # norm scales (tiny: replicated)
    "layers": None,         # the layer axis of a scanned stack
    # activations
    "activation_batch": ("data", "fsdp"),
    "activation_length": None,
    "activation_embed": None,  # the residual stream: whole on every device
    "activation_heads": "tensor",
    "activation_head_dim": None,
    "activation_mlp": "tensor",
    "activation_vocab": "tensor",
}


def mesh_axes(names: Sequence[str | None]) -> P:
    """The PartitionSpec of logical `names` by `RULES` (None stays None)."""
    unknown = [n for n in names if n is not None and n not in RULES]
    if unknown:
        raise KeyError(f"logical axis names {unknown} are not in examples.lm.sharding.RULES "
                       f"(known: {sorted(RULES)})")
    return P(*(None if n is None else RULES[n] for n in names))


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """`x` constrained to the sharding its logical axis `names` map to on the current mesh;
    unchanged without a mesh (one device, unit tests)."""
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} axis names {names} for an array of shape "
                         f"{x.shape}")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, fit_spec(x.shape, mesh_axes(names), mesh))


def num_shards(dim: int, name: str) -> int:
    """Into how many pieces the current mesh splits an axis of size `dim` named `name`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    entry = fit_spec((dim,), mesh_axes((name,)), mesh)[0]
    axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    return math.prod(mesh.shape[a] for a in axes)
