"""Will the train step fit? Compile it ahead of time for a mesh and read the compiled program.

    python -m examples.lm.plan --config 190m --mesh.fsdp 8 --device-memory 16GiB
    python -m examples.lm.plan --config 640m --mesh.fsdp 4 --mesh.tensor 2 --json plan.json

Like MaxText's `train_compile.py`, this compiles the trainer's jitted step on abstract inputs
(`jax.ShapeDtypeStruct`s carrying the target shardings; nothing is allocated) for the mesh the
flags describe: on the real devices when there are enough accelerators, else on as many
simulated CPU devices (the program is then XLA:CPU's partitioning of the same step). It prints,
per device, the memory by kind (`memory_analysis`), the FLOPs against the model's own count
(`cost_analysis`) and the bytes of every cross-device collective by kind against the parameter
bytes (the HLO text), and whether the step fits `--device-memory`; it exits with status 1 when it
does not. Every config flag of the trainer applies (`--model.remat`, `--data.batch_size`, ...);
with `--optim.grad_accum_steps` the figures are those of one micro-batch step.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from examples.lm import compiled as compiled_lib
from examples.lm import configs, flags
from examples.lm import mesh as mesh_lib
from examples.lm import model as model_lib

GIB = 2**30
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20,
          "mb": 10**6, "g": GIB, "gib": GIB, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_size(text: str) -> int:
    """Bytes in `16GiB`, `80GB`, `512MiB`, `16G` (= GiB) or a plain number of bytes."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ValueError(f"--device-memory expects a size such as 16GiB or 80GB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def devices_for(cfg: configs.Config, count: int | None):
    """(devices, simulated) for the mesh of `cfg`: the accelerators when there are enough of
    them, else simulated CPU devices (which `prepare_backend` must have asked for). Without
    `count`, an axis of -1 takes all the accelerators, or is 1 on simulated devices."""
    sizes = (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    known = math.prod(s for s in sizes if s > 0)
    if jax.default_backend() != "cpu":
        total = count or (jax.device_count() if -1 in sizes else known)
        if total <= jax.device_count():
            return jax.devices()[:total], False
    total = count or known
    cpus = jax.devices("cpu")
    if len(cpus) < total:
        raise ValueError(f"the mesh needs {total} devices but {len(cpus)} CPU devices exist: "
                         "run `python -m examples.lm.plan` in a fresh process")
    return cpus[:total], True


def plan(cfg: configs.Config, devices, *, dump_dir: str | None = None,
         step: str = "train_step") -> dict:
    """Compile the train step of `cfg` for `devices` and read it (`compiled.read_compiled`), with
    the model's FLOP count and the parameter bytes to compare against. `step="grad_step"`: the
    same forward and backward pass without the optimizer update.

    `dump_dir`: where `prepare_backend` asked XLA to dump the step right after SPMD partitioning.
    Its collectives (`partitioned`) have the element types the partitioner chose; XLA:CPU later
    widens bf16 collectives to float32 (it has no bf16 collectives), which the final program's
    `collectives` then show.
    """
    from examples.lm.trainer import Trainer  # noqa: PLC0415  (pulls in rowgeom and flax)

    mesh = mesh_lib.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
    dp, batch = mesh_lib.data_parallel_size(mesh), cfg.data.batch_size
    if batch % dp:
        raise ValueError(f"--data.batch_size ({batch}) must be divisible by the data-parallel "
                         f"size --mesh.data x --mesh.fsdp ({dp})")
    if dump_dir:
        shutil.rmtree(dump_dir, ignore_errors=True)
    start = time.perf_counter()
    trainer = Trainer(cfg, mesh)
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len), jnp.int32,
                                  sharding=mesh_lib.batch_sharding(mesh))
    with jax.set_mesh(mesh):
        compiled = getattr(trainer, step).lower(trainer.abstract_state, tokens, tokens).compile()
    params = jax.tree.leaves(trainer.abstract_state["params"])
    out = compiled_lib.read_compiled(compiled)
    out.update(
        compile_s=time.perf_counter() - start, devices=len(devices),
        mesh={a: int(mesh.shape[a]) for a in mesh_lib.AXES},
        platform=devices[0].platform, batch=batch, seq_len=cfg.seq_len,
        remat=cfg.model.remat, scan_layers=cfg.model.scan_layers,
        param_count=sum(p.size for p in params),
        param_bytes=sum(p.size * p.dtype.itemsize for p in params),
        model_flops=model_lib.flops_per_token(cfg.model) * batch * cfg.seq_len / len(devices),
        partitioned=_partitioned(dump_dir))
    return out


def _partitioned(dump_dir: str | None) -> dict | None:
    """`compiled.analyse_hlo` of the train step as XLA dumped it after SPMD partitioning."""
    dumps = sorted(glob.glob(os.path.join(dump_dir, "*after_spmd-partitioning*.txt"))
                   if dump_dir else [])
    if not dumps:
        return None
    with open(dumps[-1]) as f:
        result = compiled_lib.analyse_hlo(f.read())
    shutil.rmtree(dump_dir, ignore_errors=True)
    return result


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 100 else f"{n / 2**20:.2f} MiB"


def _collective_lines(title: str, figures: dict, param_bytes: int) -> list[str]:
    total = sum(figures["collectives"].values())
    by_kind = ", ".join(f"{k} {v / param_bytes:.2f}x"
                        for k, v in figures["collectives"].items() if v) or "none"
    lines = [f"  {title}: {_gib(total)} = {total / param_bytes:.2f}x the parameter bytes "
             f"({_gib(param_bytes)}): {by_kind}; the largest:"]
    return lines + [f"    {c['kind']} {c['shape']} x{c['times']}: {_gib(c['bytes'])}"
                    for c in figures["largest_collectives"][:4]]


def report(result: dict, *, name: str, device_memory: int | None) -> str:
    """The plan as a few lines of text."""
    sizes = ", ".join(f"{a} {n}" for a, n in result["mesh"].items())
    kinds = ", ".join(f"{k} {_gib(v)}" for k, v in result["memory"].items())
    per_device = result["batch"] / (result["mesh"]["data"] * result["mesh"]["fsdp"])
    lines = [
        f"{name}: mesh {sizes} on {result['devices']} {result['platform']} devices; micro-batch "
        f"{result['batch']} x {result['seq_len']} ({per_device:g} sequences per data-parallel "
        f"rank); remat {result['remat']}, {'scanned' if result['scan_layers'] else 'unrolled'} "
        f"layers; {result['param_count'] / 1e6:.1f}M parameters; compiled in "
        f"{result['compile_s']:.0f} s",
        f"  memory per device: {kinds}; peak {_gib(result['peak_bytes'])}",
        f"  matmul FLOPs per device: {result['matmul_flops']:.3g} = "
        f"{result['matmul_flops'] / result['model_flops']:.2f}x the model's count (6N + "
        f"attention, {result['model_flops']:.3g})",
    ]
    if result["partitioned"]:
        lines += _collective_lines("collectives per device as partitioned (what an "
                                   "accelerator moves)", result["partitioned"],
                                   result["param_bytes"])
    title = f"collectives per device as compiled for {result['platform']}"
    if result["platform"] == "cpu":
        title += " (bf16 collectives widened to float32)"
    lines += _collective_lines(title, result, result["param_bytes"])
    if device_memory is not None:
        fits = result["peak_bytes"] <= device_memory
        lines.append(f"  {'fits' if fits else 'does NOT fit'} {_gib(device_memory)} per device "
                     f"(peak {_gib(result['peak_bytes'])})")
    return "\n".join(lines)


def prepare_backend(cpu_devices: int, dump_dir: str) -> None:
    """Before JAX starts its backends: ask for `cpu_devices` CPU devices (simulated when no
    accelerator is present) and for the train step's HLO after SPMD partitioning in `dump_dir`."""
    jax.config.update("jax_num_cpu_devices", max(cpu_devices, 1))
    dump = (f"--xla_dump_to={dump_dir} --xla_dump_hlo_pass_re=spmd-partitioning "
            "--xla_dump_hlo_module_re=.*_step.*")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {dump}".strip()


def main(argv=None) -> int:
    parser = flags.Parser(prog="plan.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-memory", type=parse_size, default=None, metavar="SIZE",
                        help="per-device memory to check against, e.g. 16GiB (TPU v5e) or 80GB "
                             "(H100); exit status 1 if the step does not fit")
    parser.add_argument("--devices", type=int, default=None, metavar="N",
                        help="devices to plan for (default: the accelerators, or as many "
                             "simulated CPU devices as the mesh sizes multiply to, an axis of -1 "
                             "counting 1)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures")
    flags.add_config_arguments(parser)
    args = parser.parse_args(argv)
    dump_dir = tempfile.mkdtemp(prefix="rowgeom-plan-")
    try:
        cfg = flags.config_from_args(args)
        sizes = (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
        prepare_backend(args.devices or math.prod(s for s in sizes if s > 0), dump_dir)
        devices, _ = devices_for(cfg, args.devices)
        result = plan(cfg, devices, dump_dir=dump_dir)
    except ValueError as e:
        parser.error(str(e))
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)
    print(report(result, name=args.config or configs.DEFAULT_CONFIG,
                 device_memory=args.device_memory))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    fits = args.device_memory is None or result["peak_bytes"] <= args.device_memory
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
