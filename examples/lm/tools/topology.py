"""Compile the train step for a Cloud TPU slice or a GPU node on a host that has neither.

    python -m examples.lm.tools.topology --config 190m --topology v5e-8
    python -m examples.lm.tools.topology --config 190m --topology h200-8 --json report.json

The target's own compiler does the work: libtpu for TPUs (the `tpu` extra), jax's CUDA plugin
and ptxas for NVIDIA GPUs (the `gpu-aot` extra; docs/guides/targets.md says how to install it).
`jax.experimental.topologies.get_topology_desc` describes the target's devices without any being
present; a mesh over them and `jit(...).lower(abstract inputs).compile()` give the executable
that target would run, and `train_compile.compile_step` reads it (memory by kind, matmul FLOPs,
collectives, compile time). Nothing is allocated and nothing runs.

Targets are named as Cloud TPU names its slices and as one names a GPU node:

- `v5e-N`, `v6e-N` (N chips, one TensorCore each), `v5p-N`, `v4-N` (N TensorCores, two per
  chip: `v5p-8` is four chips); `2xv5e-256` is two slices (multi-slice, over DCN);
- `h100-N`, `h200-N`: N GPUs, eight per host (`h200-16` is two hosts), from the target
  descriptions in `examples/lm/tools/targets/`.

A TPU chip's whole HBM is the budget; on a GPU, JAX preallocates 75% of the device memory
(`XLA_PYTHON_CLIENT_MEM_FRACTION`), and that is the budget the step must fit in. The exit status
is 1 when it does not fit, 2 for a bad command line or a compiler that is not installed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import sys
import time

GIB = 2**30
TARGETS_DIR = pathlib.Path(__file__).resolve().parent / "targets"
GPU_PREALLOCATE = 0.75  # jax's default XLA_PYTHON_CLIENT_MEM_FRACTION

# generation -> (topology prefix, HBM per chip, TensorCores per chip named in the slice size,
# chip config, dimensions of the torus)
_TPUS = {
    "v5e": ("v5e", 16 * GIB, 1, "default", 2),
    "v6e": ("v6e", 32 * GIB, 1, "default", 2),
    "v5p": ("v5", 95 * GIB, 2, "megacore", 3),
    "v4": ("v4", 32 * GIB, 2, "megacore", 3),
}
# name -> (target description file, device memory in bytes: the description's own figure)
_GPUS = {"h100": ("h100_sxm.txtpb", 84942979072), "h200": ("h200.txtpb", 151397597184)}

INSTALL = {
    "tpu": 'pip install -e ".[tpu]"   (libtpu, the TPU compiler)',
    "cuda": ("pip install --no-deps jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2 "
             "nvidia-cuda-nvcc-cu12   (the GPU compiler; see docs/guides/targets.md)"),
}


@dataclasses.dataclass(frozen=True)
class Target:
    """A set of accelerators to compile for: `devices()` builds their compile-only description.

    `memory_bytes` is one device's memory; `budget_bytes` what a program may use of it (all of
    a TPU's HBM; JAX's default preallocation of a GPU's).
    """

    name: str
    platform: str  # "tpu" or "cuda"
    num_devices: int
    device_kind: str
    memory_bytes: int
    budget_bytes: int
    topology: dict

    def devices(self) -> list:
        """The target's devices (compile-only); raises `CompilerMissing` without its compiler."""
        from jax.experimental import topologies  # noqa: PLC0415

        check_compiler(self.platform)
        kwargs = dict(self.topology)
        if self.platform == "cuda":
            kwargs["target_config"] = (TARGETS_DIR / kwargs.pop("file")).read_text()
        devices = list(topologies.get_topology_desc(platform=self.platform, **kwargs).devices)
        if len(devices) != self.num_devices:
            raise RuntimeError(f"{self.name}: expected {self.num_devices} devices, the "
                               f"topology has {len(devices)}")
        return devices


class CompilerMissing(RuntimeError):
    """The target's compiler is not installed (the message says what to install)."""


def check_compiler(platform: str) -> None:
    """Raise `CompilerMissing` when `platform`'s compiler (libtpu, or the CUDA plugin and
    ptxas) is not importable here."""
    import importlib.util  # noqa: PLC0415

    if platform == "tpu":
        missing = importlib.util.find_spec("libtpu") is None
    else:
        missing = (importlib.util.find_spec("jax_plugins.xla_cuda12") is None
                   or _ptxas() is None)
    if missing:
        raise CompilerMissing(f"no {platform.upper()} compiler here: {INSTALL[platform]}")


def _ptxas() -> str | None:
    import importlib.util  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = pathlib.Path(root) / "bin" / "ptxas"
        if path.exists():
            return str(path)
    return shutil.which("ptxas")


def _grid(chips: int, dims: int) -> tuple[int, ...]:
    """The slice shape Cloud TPU uses for `chips` chips: 2-D (v5e, v6e) as 1x1, 2x2, 2x4, 4x4,
    4x8, 8x8, ...; 3-D (v4, v5p) as 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ..."""
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"a TPU slice has a power-of-two number of chips, got {chips}")
    if dims == 2:
        if chips == 2:
            return (1, 2)
        side = 1 << (chips.bit_length() - 1) // 2
        return (side, chips // side)
    if chips < 4:
        raise ValueError("v4 and v5p slices have at least 4 chips (v4-8, v5p-8)")
    shape = [2, 2, 1]
    while math.prod(shape) < chips:  # double the smallest axis, the last of equals first
        shape[max(range(3), key=lambda i: (-shape[i], i))] *= 2
    return tuple(shape)


def get_target(name: str) -> Target:
    """The `Target` named `name`: `v5e-8`, `v6e-256`, `v5p-8`, `v4-32`, `2xv5e-256` (two
    slices), `h100-8`, `h200-16`. Raises ValueError for a name it does not know."""
    match = re.fullmatch(r"(?:(\d+)x)?([a-z0-9]+)-(\d+)", name.strip().lower())
    if not match:
        raise ValueError(f"unknown target {name!r}: try v5e-8, v6e-8, v5p-8, v4-8, 2xv5e-256, "
                         "h100-8 or h200-8")
    slices, kind, count = int(match.group(1) or 1), match.group(2), int(match.group(3))
    if kind in _TPUS:
        prefix, hbm, cores, chip_config, dims = _TPUS[kind]
        if count % cores:
            raise ValueError(f"{kind}-N counts TensorCores ({cores} per chip): N must be a "
                             f"multiple of {cores}")
        chips = count // cores
        grid = _grid(chips, dims)
        shape3 = tuple(grid) + (1,) * (3 - len(grid))
        per_host = (min(2, shape3[0]), min(2, shape3[1]), 1)
        topology = dict(topology_name=f"{prefix}:{'x'.join(map(str, grid))}",
                        chip_config_name=chip_config, chips_per_host_bounds=per_host,
                        num_slices=slices, wrap=(False, False, False))
        kinds = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v5p": "TPU v5", "v4": "TPU v4"}
        return Target(name, "tpu", chips * slices, kinds[kind], hbm, hbm, topology)
    if kind in _GPUS and slices == 1:
        file, memory = _GPUS[kind]
        hosts, per_host = (count // 8, 8) if count % 8 == 0 else (1, count)
        if count < 1 or (count > 8 and count % 8):
            raise ValueError(f"{kind}-N: N GPUs, up to 8 per host, a multiple of 8 beyond")
        return Target(name, "cuda", count, f"NVIDIA {kind.upper()}", memory,
                      int(memory * GPU_PREALLOCATE),
                      dict(topology=f"1x{hosts}x{per_host}", file=file))
    raise ValueError(f"unknown target {name!r}: TPUs v5e-N, v6e-N, v5p-N, v4-N (and KxNAME for "
                     "K slices), GPUs h100-N, h200-N")


def prepare(platform: str) -> None:
    """Before JAX starts a backend: keep it on the CPU (the GPU plugin would look for GPUs and
    libtpu for TPUs) and quiet libtpu's metadata lookups. Compiling for the target still uses
    the target's compiler."""
    import jax  # noqa: PLC0415

    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    jax.config.update("jax_platforms", "cpu")


def for_target(cfg):
    """`cfg` with the head ops traced as an accelerator runs them (`optim.head_impl="xla"`).

    rowgeom's `impl="auto"` sees a CPU host's one device when tracing for a target from it,
    and would pick its XLA:CPU formulation; every accelerator and every mesh runs "xla"."""
    from examples.lm import configs  # noqa: PLC0415

    return configs.override(cfg, {"optim.head_impl": "xla"})


def compile_for(fn, args, target: Target, *, in_shardings=None, out_shardings=None,
                donate_argnums=()):
    """(compiled, seconds): `jax.jit(fn)` compiled for `target` on abstract `args`
    (`jax.ShapeDtypeStruct`s; their shardings, or `in_shardings`, must be on the target's
    devices, e.g. a `Mesh` over `target.devices()`). rowgeom's head ops in `fn` should say
    `impl="xla"` (see `for_target`)."""
    import jax  # noqa: PLC0415

    del target  # the devices come with the shardings
    jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                     donate_argnums=donate_argnums)
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    return compiled, time.perf_counter() - start


def _mesh_for(cfg, target: Target):
    """`cfg` with its default mesh (every device on `data`) replaced by FSDP over every device
    of a slice, and data parallelism across slices; an explicit mesh stays."""
    from examples.lm import configs  # noqa: PLC0415

    if dataclasses.astuple(cfg.mesh) == dataclasses.astuple(configs.MeshConfig()):
        slices = target.topology.get("num_slices", 1)
        return configs.override(cfg, {"mesh.data": slices, "mesh.fsdp": -1})
    return cfg


def compile_train_step(cfg, target: Target, *, step: str = "train_step") -> dict:
    """`train_compile.compile_step` of `cfg`'s train step compiled for `target` (its default
    mesh: FSDP over all the devices), with the target's name, memory and budget, and whether the
    step fits.

    When the TPU compiler itself refuses the program for want of HBM, the result says so
    (`refused`: the compiler's message; `peak_bytes`: the memory it said it needs, at least)."""
    import jax  # noqa: PLC0415

    from examples.lm.tools import train_compile  # noqa: PLC0415

    cfg = for_target(_mesh_for(cfg, target))
    start = time.perf_counter()
    try:
        result = train_compile.compile_step(cfg, target.devices(), step=step)
    except jax.errors.JaxRuntimeError as e:
        needed = re.search(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)([KMGT])\)", str(e))
        if not needed:
            raise
        scale = {"K": 2**10, "M": 2**20, "G": GIB, "T": 2**40}[needed.group(2)]
        result = dict(refused=str(e).splitlines()[0], peak_bytes=float(needed.group(1)) * scale,
                      compile_s=time.perf_counter() - start, batch=cfg.data.batch_size,
                      grad_accum_steps=cfg.optim.grad_accum_steps, remat=cfg.model.remat,
                      platform=target.platform, devices=target.num_devices)
    return _with_target(result, target)


def _ranks(cfg, target: Target) -> int:
    """Data-parallel ranks of `cfg`'s mesh on `target` (data x fsdp)."""
    mesh = _mesh_for(cfg, target).mesh
    sizes = [mesh.data, mesh.fsdp, mesh.tensor]
    if -1 in sizes:
        known = math.prod(s for s in sizes if s > 0)
        sizes[sizes.index(-1)] = target.num_devices // known
    return sizes[0] * sizes[1]


def fit_train_step(cfg, target: Target, *, fit: bool = True, step: str = "train_step",
                   print_fn=None) -> dict:
    """`compile_train_step` of `cfg`; when that does not fit and `fit`, the first of
    `train_compile.SPLIT_CANDIDATES` (micro-batch, accumulation, recomputation: the same
    sequences per update) that does (`train_compile.fit_split`). The result's `split` says which
    was compiled (`chosen`: found by the search; `tried`: how many compiles), `as_configured`
    holds the config's own result when the search replaced it."""
    from examples.lm.tools import train_compile  # noqa: PLC0415

    result = compile_train_step(cfg, target, step=step)
    ranks = _ranks(cfg, target)
    tried = [1]

    def compile_fn(candidate):
        tried[0] += 1
        return compile_train_step(candidate, target, step=step)

    chosen = None
    if fit and not result["fits"]:
        if print_fn:
            print_fn(f"  as configured ({train_compile.split_text(cfg, ranks)}): peak "
                     f"{_gib(result['peak_bytes'])} does NOT fit in {_gib(target.budget_bytes)}; "
                     "searching")
        chosen, found = train_compile.fit_split(cfg, ranks, compile_fn, target.budget_bytes,
                                       print_fn=print_fn, skip_own=True)
        if chosen is not None:
            found["as_configured"] = {k: result[k] for k in ("peak_bytes", "fits", "batch",
                                                             "grad_accum_steps", "remat")}
            result, cfg = found, chosen
    result["split"] = dict(chosen=chosen is not None, tried=tried[0], ranks=ranks,
                           sequences_per_rank=cfg.data.batch_size // ranks,
                           grad_accum_steps=cfg.optim.grad_accum_steps, remat=cfg.model.remat,
                           sequences_per_update=cfg.data.batch_size
                           * cfg.optim.grad_accum_steps)
    return result


def _with_target(result: dict, target: Target) -> dict:
    return dict(result, target=target.name, device_kind=target.device_kind,
                device_memory=target.memory_bytes, budget=target.budget_bytes,
                fits=result["peak_bytes"] <= target.budget_bytes)


def compile_optimizer_update(cfg, target: Target) -> dict:
    """`cfg`'s optimizer update alone (`tx.update` + `apply_updates` on the trainer's sharded
    state, parameters and state donated) compiled for `target`, read like the step."""
    import jax  # noqa: PLC0415
    import optax  # noqa: PLC0415

    from examples.lm import sharding as mesh_lib  # noqa: PLC0415
    from examples.lm.tools import compiled as compiled_lib  # noqa: PLC0415
    from examples.lm.train import Trainer  # noqa: PLC0415

    cfg = for_target(_mesh_for(cfg, target))
    mesh = mesh_lib.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor,
                              devices=target.devices())
    trainer = Trainer(cfg, mesh)
    tx, shardings = trainer.tx, trainer.shardings
    abstract = trainer.abstract_state

    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    args = (abstract["params"], abstract["opt_state"], abstract["params"])
    with jax.set_mesh(mesh):
        compiled, seconds = compile_for(
            update, args, target,
            in_shardings=(shardings["params"], shardings["opt_state"], shardings["params"]),
            out_shardings=(shardings["params"], shardings["opt_state"]), donate_argnums=(0, 1))
    params = jax.tree.leaves(abstract["params"])
    out = compiled_lib.read_compiled(compiled)
    out.update(compile_s=seconds, devices=len(mesh.devices.flat),
               param_bytes=sum(p.size * p.dtype.itemsize for p in params),
               hlo=compiled.as_text())
    return _with_target(out, target)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def format_report(result: dict, *, name: str) -> str:
    """The compiled step's figures for its target as a few lines of text."""
    from examples.lm.tools import train_compile  # noqa: PLC0415

    split = result.get("split")
    if "refused" in result:
        head = (f"{name} on {result['target']} ({result['devices']} x {result['device_kind']}): "
                f"micro-batch {result['batch']} x {result['grad_accum_steps']} accumulation, "
                f"remat {result['remat']}: the {result['platform']} compiler refused it "
                f"({result['refused']})")
        return head + f"\n  does NOT fit in {_gib(result['budget'])} per device"
    lines = train_compile.report(result, name=name, device_memory=None).splitlines()
    lines[0] = lines[0].replace(f"{result['devices']} {result['platform']} devices",
                                f"{result['target']} ({result['devices']} x "
                                f"{result['device_kind']}, {result['platform']} compiler)")
    budget = result["budget"]
    of = (f"{_gib(budget)} (the chip's HBM)" if result["platform"] == "tpu" else
          f"{_gib(budget)} (JAX preallocates {GPU_PREALLOCATE:.0%} of the device's "
          f"{_gib(result['device_memory'])})")
    if not result.get("loops_known", True):
        lines.append("  (some loops' trip counts are unknown: those loops' FLOPs and "
                     "collectives are counted once)")
    if split:
        recompute = result["matmul_flops"] / result["model_flops"]
        per_update = result["matmul_flops"] * split["grad_accum_steps"]
        compiles = f"{split['tried']} compile{'s' if split['tried'] > 1 else ''}"
        lines.append(
            f"  split{' (chosen to fit)' if split['chosen'] else ''}: "
            f"{split['sequences_per_rank']} sequences per data-parallel rank x "
            f"{split['grad_accum_steps']} accumulation = {split['sequences_per_update']} "
            f"sequences per update, remat {split['remat']}; recomputation cost: matmul FLOPs "
            f"{recompute:.2f}x the model's count, {per_update:.3g} per device per update "
            f"({compiles})")
    lines.append(f"  {'fits in' if result['fits'] else 'does NOT fit in'} {of}: peak "
                 f"{_gib(result['peak_bytes'])} per device, "
                 f"{result['peak_bytes'] / budget:.0%} of the budget")
    return "\n".join(lines)


def main(argv=None) -> int:
    from examples.lm import configs  # noqa: PLC0415

    parser = configs.Parser(prog="topology.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", required=True, metavar="NAME",
                        help="v5e-8, v6e-8, v5p-8, v4-8, 2xv5e-256, h100-8, h200-8, ...")
    parser.add_argument("--step", choices=("train_step", "grad_step"), default="train_step",
                        help="grad_step: the forward and backward pass without the optimizer")
    parser.add_argument("--fit", choices=("auto", "off"), default="auto",
                        help="auto: when the step does not fit, take the first micro-batch / "
                             "accumulation / remat (same sequences per update) that does "
                             "(train_compile.SPLIT_CANDIDATES); off: compile the config's "
                             "own, e.g. as --data.batch_size/--optim.grad_accum_steps/"
                             "--model.remat set it")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures")
    configs.add_config_arguments(parser)
    args = parser.parse_args(argv)
    try:
        target = get_target(args.topology)
        cfg = configs.config_from_args(args)
        prepare(target.platform)
        result = fit_train_step(cfg, target, fit=args.fit == "auto", step=args.step,
                                print_fn=lambda line: print(line, flush=True))
    except CompilerMissing as e:
        print(f"topology.py: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        parser.error(str(e))
    print(format_report(result, name=args.config or configs.DEFAULT_CONFIG))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
