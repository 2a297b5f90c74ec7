"""Device mesh and sharding helpers: one code path for 1 device, simulated devices, GPU, TPU pods.

The mesh has three axes:

- `data`: pure data parallelism (parameters replicated),
- `fsdp`: data parallelism with parameters and optimizer state sharded (ZeRO-3 style),
- `tensor`: tensor parallelism (the vocabulary axis of the head and embedding, MLP width, heads).

The batch is split over ("data", "fsdp"). Parameters carry their own PartitionSpecs in mesh-axis
names (see model.py); `fit_spec` drops an axis from a spec where it does not divide the dimension,
so a small model still runs on a large mesh (that dimension is then replicated).
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def _multi_process_environment() -> bool:
    """True when a launcher describes several processes (Cloud TPU pod, SLURM, MPI, explicit)."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if len([h for h in hosts.split(",") if h.strip()]) > 1:
        return True
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JAX_NUM_PROCESSES"):
        if int(os.environ.get(var, "1") or 1) > 1:
            return True
    return False


def maybe_initialize_distributed(mode: str = "auto") -> bool:
    """Call `jax.distributed.initialize()` when running multi-process.

    mode "on" always initializes (arguments come from the environment: on Cloud TPU and SLURM JAX
    detects them itself), "off" never, "auto" when the environment describes several processes.
    Must run before any other JAX call touches the backend. Returns whether it initialized.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--distributed must be 'auto', 'on' or 'off', got {mode!r}")
    if mode == "off" or (mode == "auto" and not _multi_process_environment()):
        return False
    jax.distributed.initialize()
    return True


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

    Devices of several TPU slices (multi-slice, `slice_index`) get a hybrid mesh: `data` is
    split across the slices first (the data-center network carries only the gradients' data-
    parallel reductions), the rest within each slice."""
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


def fit_sharding(shape: tuple[int, ...], spec: P, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, fit_spec(shape, spec, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches (B, T): rows split over the data-parallel axes."""
    return NamedSharding(mesh, P(BATCH_AXES, None))


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def global_batch(local: np.ndarray, mesh: Mesh) -> jax.Array:
    """The global (B, T) array from this process's rows (every process passes its share)."""
    return jax.make_array_from_process_local_data(batch_sharding(mesh), local)


def _path(path) -> tuple[str, ...]:
    """("opt_state", "0", "mu", "lm_head", "kernel"): the key names along a JAX key path."""
    return tuple(jax.tree_util.keystr((k,), simple=True) for k in path)


def state_shardings(abstract: dict, param_shardings, mesh: Mesh) -> dict:
    """Shardings of the whole train state for `mesh`.

    Parameters use their (fitted) PartitionSpecs. An optimizer-state leaf whose path ends with a
    parameter's path and has that parameter's shape (momenta, Adam moments) is sharded like the
    parameter; everything else (counts, scalars, statistics) is replicated.
    """
    flat = jax.tree_util.tree_flatten_with_path(param_shardings)[0]
    shapes = {_path(p): s for p, s in jax.tree_util.tree_flatten_with_path(abstract["params"])[0]}
    by_path = {_path(p): (shapes[_path(p)].shape, s) for p, s in flat}
    repl = replicated(mesh)

    def like_param(path, leaf):
        keys = _path(path)
        for start in range(len(keys)):
            hit = by_path.get(keys[start:])
            if hit is not None and hit[0] == leaf.shape:
                return hit[1]
        return repl

    out = {k: jax.tree.map(lambda _: repl, v) for k, v in abstract.items()}
    out["params"] = param_shardings
    out["opt_state"] = jax.tree_util.tree_map_with_path(like_param, abstract["opt_state"])
    return out


def describe(mesh: Mesh) -> str:
    shape = ", ".join(f"{a}={mesh.shape[a]}" for a in AXES)
    return (f"mesh({shape}) on {mesh.devices.size} {jax.devices()[0].platform} devices, "
            f"{jax.process_count()} process(es)")
