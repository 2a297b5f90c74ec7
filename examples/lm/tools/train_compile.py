"""Will the train step fit? Compile it ahead of time for a mesh and read the compiled program.

    python -m examples.lm.tools.train_compile --config 190m --mesh.fsdp 8 --device-memory 16GiB
    python -m examples.lm.tools.train_compile --config 640m --mesh.fsdp 4 --mesh.tensor 2

Like MaxText's `train_compile.py`, this compiles the trainer's jitted step on abstract inputs
(`jax.ShapeDtypeStruct`s carrying the target shardings; nothing is allocated) for the mesh the
flags describe: on the real devices when there are enough accelerators, else on as many
simulated CPU devices (the program is then XLA:CPU's partitioning of the same step). It prints,
per device, the memory by kind (`memory_analysis`), the FLOPs against the model's own count
(`cost_analysis`) and the bytes of every cross-device collective by kind against the parameter
bytes (the HLO text), and whether the step fits in `--device-memory` (on a GPU, the 75 % JAX
preallocates); it exits with status 1 when it does not, listing the changes that keep the
sequences per update, cheapest first (`fitting_changes`; `--fit auto` compiles them and names the
first that fits). Every config flag of the trainer applies (`--model.remat`, `--data.batch_size`,
...); the figures are those of one micro-batch step, `--optim.grad_accum_steps` of them per
update.

    python -m examples.lm.tools.train_compile --paper  # every paper config (configs.PAPER_MODELS)
    python -m examples.lm.tools.train_compile --paper --config 190m --head adamw

`--paper` compiles each paper config where the paper ran it: 256 x 2,048 per update on 8 devices,
data parallel, at the paper's micro-batch and accumulation (`configs.paper_config`). It prints
the parameter count without padding beside the paper's, whether the step fits in 80 GiB (H100) and
141 GiB (H200) per device, the micro-batch, accumulation and recomputation that fit a 16 GiB
TPU v5e chip (FSDP over the 8 chips) with their recomputation cost (compiled matmul FLOPs over
the model's count), and the exact head diameter's share of the training FLOPs: the diameter
program's compiled matmul FLOPs over `eval.diameter_every` updates of `grad_accum_steps`
micro-batch steps each.

Its v5e split is XLA:CPU's estimate (the step compiled for simulated CPU devices), which is not
the TPU compiler's: `--topology v5e-8` (libtpu) asks the TPU compiler itself, which can fit a
larger micro-batch (`190m`: 8 sequences per chip, where the estimate takes 4).
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
from flax import nnx

from examples.lm import configs
from examples.lm import model as model_lib
from examples.lm import sharding as mesh_lib
from examples.lm.tools import compiled as compiled_lib

GIB = 2**30
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20,
          "mb": 10**6, "g": GIB, "gib": GIB, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_size(text: str) -> int:
    """Bytes in `16GiB`, `80GB`, `512MiB`, `16G` (= GiB) or a plain number of bytes."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ValueError(f"--device-memory expects a size such as 16GiB or 80GB (a bare "
                         f"number is bytes), got {text!r}")
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
                         "run `python -m examples.lm.tools.train_compile` in a fresh process")
    return cpus[:total], True


def compile_step(cfg: configs.Config, devices, *, dump_dir: str | None = None,
         step: str = "train_step") -> dict:
    """Compile the train step of `cfg` for `devices` and read it (`compiled.read_compiled`), with
    the model's FLOP count and the parameter bytes to compare against. `step="grad_step"`: the
    same forward and backward pass without the optimizer update.

    The step is also dumped right after SPMD partitioning (into `dump_dir`, default a temporary
    directory; the compile's own debug options, so no process-wide XLA_FLAGS are needed). Its
    collectives (`partitioned`) have the element types the partitioner chose; XLA:CPU later
    widens bf16 collectives to float32 (it has no bf16 collectives), which the final program's
    `collectives` then show.
    """
    from examples.lm.train import Trainer  # noqa: PLC0415  (pulls in rowgeom and flax)

    mesh = mesh_lib.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
    batch = cfg.data.batch_size
    mesh_lib.check_batch(batch, mesh)
    own_dump = dump_dir is None
    dump_dir = dump_dir or tempfile.mkdtemp(prefix="rowgeom-train-compile-")
    shutil.rmtree(dump_dir, ignore_errors=True)
    dump = {"xla_dump_to": dump_dir, "xla_dump_hlo_pass_re": "spmd-partitioning"}
    start = time.perf_counter()
    trainer = Trainer(cfg, mesh)
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len), jnp.int32,
                                  sharding=mesh_lib.batch_sharding(mesh))
    try:
        with jax.set_mesh(mesh):
            rates = (trainer.abstract_rates,) if step == "train_step" else ()
            compiled = getattr(trainer, step).lower(trainer.abstract_state, tokens, tokens,
                                                    *rates).compile(compiler_options=dump)
        partitioned = _partitioned(dump_dir)
    finally:
        # The dump also holds the compiler's object files and LLVM IR (about 10 MB a step):
        # a directory this function made goes whatever happened; a caller's stays.
        if own_dump:
            shutil.rmtree(dump_dir, ignore_errors=True)
    params = jax.tree.leaves(trainer.abstract_state["params"])
    out = compiled_lib.read_compiled(compiled)
    out.update(
        compile_s=time.perf_counter() - start, devices=len(devices),
        mesh={a: int(mesh.shape[a]) for a in mesh_lib.AXES},
        platform=devices[0].platform, batch=batch, seq_len=cfg.seq_len,
        grad_accum_steps=cfg.optim.grad_accum_steps, remat=cfg.model.remat,
        scan_layers=cfg.model.scan_layers,
        param_count=sum(p.size for p in params),
        param_bytes=sum(p.size * p.dtype.itemsize for p in params),
        model_flops=model_lib.flops_per_token(cfg.model) * batch * cfg.seq_len / len(devices),
        partitioned=partitioned)
    return out


# Per-device memory of the GPUs the paper's configs were run on, and of a TPU v5e chip.
GPU_MEMORY = {"H100": 80 * GIB, "H200": 141 * GIB}
V5E_MEMORY = 16 * GIB
# (recomputation, sequences per data-parallel rank) tried when a step does not fit, cheapest
# recomputation and largest micro-batch first: the first that fits is taken (`fit_split`).
SPLIT_CANDIDATES = (("dots", 8), ("dots", 4), ("block", 8), ("block", 4), ("block", 2),
                    ("block", 1))


def split_configs(cfg: configs.Config, ranks: int, *, skip_own: bool = False):
    """`cfg` at each of `SPLIT_CANDIDATES` on `ranks` data-parallel ranks, in order, keeping its
    sequences per update (micro-batch x accumulation); candidates that do not divide them (and
    with `skip_own`, `cfg`'s own split, already tried) are left out."""
    sequences = cfg.data.batch_size * cfg.optim.grad_accum_steps
    own = (cfg.model.remat, cfg.data.batch_size)
    for remat, per_rank in SPLIT_CANDIDATES:
        micro = per_rank * ranks
        if sequences % micro or (skip_own and (remat, micro) == own):
            continue
        yield configs.override(cfg, {"model.remat": remat, "data.batch_size": micro,
                                     "optim.grad_accum_steps": sequences // micro})


def fit_split(cfg: configs.Config, ranks: int, compile_fn, budget: int, *, print_fn=None,
              skip_own: bool = False):
    """(config, result) of the first of `split_configs(cfg, ranks)` whose `compile_fn(config)`
    (a dict with `peak_bytes`) fits `budget` bytes, or (None, None) when none does. Every
    candidate tried is printed with `print_fn`. The one owner of the search: `--paper` (v5e on
    simulated CPU devices) and `examples.lm.tools.topology` (the target's compiler) both use it."""
    for candidate in split_configs(cfg, ranks, skip_own=skip_own):
        result = compile_fn(candidate)
        fits = result["peak_bytes"] <= budget
        if print_fn:
            print_fn(f"  tried {split_text(candidate, ranks)}: peak {_gib(result['peak_bytes'])}"
                     f" {'fits in' if fits else 'does NOT fit in'} {_gib(budget)}")
        if fits:
            return candidate, result
    return None, None


def split_text(cfg: configs.Config, ranks: int) -> str:
    """`cfg`'s micro-batch, accumulation and recomputation in words."""
    return (f"{cfg.data.batch_size // ranks} sequences per rank x {cfg.optim.grad_accum_steps} "
            f"accumulation (micro-batch {cfg.data.batch_size}), remat {cfg.model.remat}")


def diameter_flops(cfg: configs.Config, devices) -> float:
    """Matmul FLOPs per device of the exact head-step diameter program (the trainer's
    `step_diameter`, compiled for `cfg` on `devices`)."""
    from examples.lm.train import Trainer  # noqa: PLC0415

    mesh = mesh_lib.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
    trainer = Trainer(cfg, mesh)
    if not trainer.exact_diameter:
        raise ValueError("the config measures the O(Vd) bracket, not the exact diameter")
    state = trainer.abstract_state
    head = jax.eval_shape(trainer.head_of, state["params"], state["rest"])
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    with jax.set_mesh(mesh):
        program = trainer.step_diameter.lower(state["params"], state["rest"], head, scalar,
                                              scalar).compile()
    return compiled_lib.read_compiled(program)["matmul_flops"]


def param_count(cfg: model_lib.ModelConfig) -> int:
    """Trainable scalars of `cfg`'s model, not counting a padded vocabulary's (zero, untrained)
    padding rows, as the paper counts (its 190M: 185,680,896); nothing is allocated."""
    abstract = nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    padding_rows = cfg.vocab_size - cfg.num_tokens
    tables = 1 if cfg.tied_embeddings else 2  # the embedding and the head
    return total - tables * padding_rows * cfg.d_model


def paper_figures(size: str, head: str, devices, *, print_fn=print) -> dict:
    """The `--paper` figures of one paper config on 8 `devices` (see the module docstring)."""
    cfg = configs.override(configs.paper_config(size, head),
                           {"mesh.data": len(devices), "mesh.fsdp": 1, "mesh.tensor": 1})
    paper = configs.PAPER_MODELS[size]
    count = param_count(cfg.model)
    gpu = compile_step(cfg, devices)
    peak = gpu["peak_bytes"]
    diameter = diameter_flops(cfg, devices)
    update = cfg.eval.diameter_every * cfg.optim.grad_accum_steps * gpu["matmul_flops"]
    out = {"size": size, "head": head, "param_count": count, "paper_param_count": paper.params,
           "batch": cfg.data.batch_size, "grad_accum_steps": cfg.optim.grad_accum_steps,
           "remat": cfg.model.remat, "peak_bytes": peak,
           "fits": {name: peak <= limit for name, limit in GPU_MEMORY.items()},
           "step_matmul_flops": gpu["matmul_flops"], "diameter_matmul_flops": diameter,
           "diameter_share": diameter / update}
    per_gpu = cfg.data.batch_size // len(devices)
    print_fn(f"{size} ({head} head): {count:,} parameters without padding (paper "
             f"{paper.params:,}); 8 devices, data parallel, micro-batch {per_gpu} x "
             f"{cfg.seq_len} per device x {cfg.optim.grad_accum_steps} accumulation = "
             f"{cfg.data.batch_size * cfg.optim.grad_accum_steps} sequences per update, remat "
             f"{cfg.model.remat}: peak {_gib(peak)} per device; "
             + ", ".join(f"{'fits in' if fits else 'does NOT fit in'} {_gib(GPU_MEMORY[name])} "
                         f"({name})" for name, fits in out["fits"].items()))
    print_fn(f"  exact D every {cfg.eval.diameter_every} updates: {diameter:.3g} matmul FLOPs "
             f"per device against {update:.3g} for {cfg.eval.diameter_every} updates: "
             f"{100 * out['diameter_share']:.3f}% of the training FLOPs (in float32 at "
             "Precision.HIGHEST, slower per FLOP than the bf16 step)")
    out["v5e"] = None
    v5e_cfg = configs.override(cfg, {"mesh.data": 1, "mesh.fsdp": len(devices)})
    chosen, result = fit_split(v5e_cfg, len(devices), lambda c: compile_step(c, devices),
                               V5E_MEMORY)
    if chosen is not None:
        out["v5e"] = {"remat": chosen.model.remat,
                      "sequences_per_device": chosen.data.batch_size // len(devices),
                      "grad_accum_steps": chosen.optim.grad_accum_steps,
                      "peak_bytes": result["peak_bytes"],
                      "recompute": result["matmul_flops"] / result["model_flops"]}
    if out["v5e"] is None:
        print_fn(f"  no micro-batch of {SPLIT_CANDIDATES} fits in {_gib(V5E_MEMORY)} (TPU v5e)")
    else:
        v = out["v5e"]
        print_fn(f"  TPU v5e ({_gib(V5E_MEMORY)}), fsdp 8, as XLA:CPU estimates it: "
                 f"{v['sequences_per_device']} sequences per chip x {v['grad_accum_steps']} "
                 f"accumulation, remat {v['remat']}: peak {_gib(v['peak_bytes'])}; matmul FLOPs "
                 f"{v['recompute']:.2f}x the model's count (the paper's GPUs: "
                 f"{gpu['matmul_flops'] / gpu['model_flops']:.2f}x); the TPU compiler's own "
                 f"split, which can be larger: --config {size} --topology v5e-8")
    return out


def _partitioned(dump_dir: str | None) -> dict | None:
    """`compiled.analyse_hlo` of the train step as XLA dumped it after SPMD partitioning."""
    dumps = sorted(glob.glob(os.path.join(dump_dir, "*after_spmd-partitioning*.txt"))
                   if dump_dir else [])
    if not dumps:
        return None
    with open(dumps[-1]) as f:
        return compiled_lib.analyse_hlo(f.read())


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
    """The compile report (`compile_step`'s result) as a few lines of text."""
    sizes = ", ".join(f"{a} {n}" for a, n in result["mesh"].items())
    kinds = ", ".join(f"{k} {_gib(v)}" for k, v in result["memory"].items())
    per_device = result["batch"] / (result["mesh"]["data"] * result["mesh"]["fsdp"])
    accum = result["grad_accum_steps"]
    lines = [
        f"{name}: mesh {sizes} on {result['devices']} {result['platform']} devices; micro-batch "
        f"{result['batch']} x {result['seq_len']} ({per_device:g} sequences per data-parallel "
        f"rank); remat {result['remat']}, {'scanned' if result['scan_layers'] else 'unrolled'} "
        f"layers; {result['param_count'] / 1e6:.1f}M parameters; compiled in "
        f"{result['compile_s']:.0f} s",
        f"  the figures below are per micro-batch step, {accum} micro-batch"
        f"{'es' if accum != 1 else ''} per update (--optim.grad_accum_steps)",
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
        lines.append(f"  {'fits' if fits else 'does NOT fit'} in {_gib(device_memory)} per "
                     f"device (peak {_gib(result['peak_bytes'])})")
        lines.append(f"  note: on a GPU, JAX preallocates {GPU_PREALLOCATE:.0%} of its memory "
                     "(XLA_PYTHON_CLIENT_MEM_FRACTION): give --device-memory as that share, e.g. "
                     "60GB for an 80 GB H100")
    return "\n".join(lines)


# JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION: the share of a GPU's memory a process can use.
GPU_PREALLOCATE = 0.75


def fitting_changes(cfg: configs.Config, devices) -> list[tuple[str, configs.Config]]:
    """The changes that keep the sequences per update, cheapest first: FSDP over the
    data-parallel axis (no extra compute), then `split_configs`' micro-batches and
    recomputation. Each as (flags, config)."""
    out = []
    if cfg.mesh.data > 1:
        fsdp = cfg.mesh.data * cfg.mesh.fsdp
        out.append((f"--mesh.data 1 --mesh.fsdp {fsdp}",
                    configs.override(cfg, {"mesh.data": 1, "mesh.fsdp": fsdp})))
    ranks = len(devices) // cfg.mesh.tensor
    for candidate in split_configs(cfg, ranks, skip_own=True):
        out.append((f"--model.remat {candidate.model.remat} --data.batch_size "
                    f"{candidate.data.batch_size} --optim.grad_accum_steps "
                    f"{candidate.optim.grad_accum_steps}", candidate))
    return out


def cheapest_fit(cfg: configs.Config, devices, budget: int, *, search: bool,
                 print_fn=print) -> str | None:
    """After a step that does not fit `budget`: with `search` (`--fit auto`), recompile
    `fitting_changes` in order and print the first that fits, returning its flags; else list
    them, cheapest first, without compiling."""
    changes = fitting_changes(cfg, devices)
    if not changes:
        print_fn("  no change of micro-batch, recomputation or FSDP keeps the sequences per "
                 "update on this mesh: use more devices or a shorter --model.max_seq_len")
        return None
    if not search:
        print_fn("  changes to try, cheapest first (add --fit auto to compile them and take the "
                 "first that fits): " + "; ".join(f for f, _ in changes))
        return None
    for flags, candidate in changes:
        peak = compile_step(candidate, devices)["peak_bytes"]
        if peak <= budget:
            print_fn(f"  the cheapest change that fits: {flags} (peak {_gib(peak)})")
            return flags
    print_fn("  none of " + "; ".join(f for f, _ in changes) + f" fits in {_gib(budget)}: use "
             "more devices (--mesh.fsdp) or a shorter --model.max_seq_len")
    return None


def prepare_backend(cpu_devices: int) -> None:
    """Before JAX starts its backends: ask for `cpu_devices` CPU devices (simulated when no
    accelerator is present). Where the backends have already started (a test process, a notebook)
    the devices are those there are, and `devices_for` says when they are too few."""
    try:
        jax.config.update("jax_num_cpu_devices", max(cpu_devices, 1))
    except RuntimeError:
        pass


def main(argv=None) -> int:
    parser = configs.Parser(prog="train_compile.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-memory", default=None, metavar="SIZE",
                        help="per-device memory to check against, e.g. 16GiB (TPU v5e) or 60GB "
                             "(the 75%% of an 80 GB H100 JAX preallocates); a bare number is "
                             "bytes; exit status 1 if the step does not fit")
    parser.add_argument("--devices", type=int, default=None, metavar="N",
                        help="devices to compile for (default: the accelerators, or as many "
                             "simulated CPU devices as the mesh sizes multiply to, an axis of -1 "
                             "counting 1)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures")
    parser.add_argument("--paper", action="store_true",
                        help="compile the paper configs on 8 devices (--config: only that one; "
                             "--head: its head, default rownorm); see the module docstring")
    parser.add_argument("--topology", default=None, metavar="NAME",
                        help="compile with the target's own compiler instead of simulated CPU "
                             "devices: v5e-8, v6e-8, h100-8, h200-8, ... (python -m "
                             "examples.lm.tools.topology; needs the `tpu` or `gpu-aot` extra)")
    parser.add_argument("--fit", choices=("auto", "off"), default=None,
                        help="when the config's step does not fit: auto compiles the "
                             "micro-batch / accumulation / remat (and FSDP) changes, cheapest "
                             "first, and takes the first that fits; off lists them (the default "
                             "without --topology; with it, auto is)")
    configs.add_config_arguments(parser)
    args = parser.parse_args(argv)
    if args.device_memory is not None:
        try:
            args.device_memory = parse_size(args.device_memory)
        except ValueError as e:
            parser.error(str(e))
    if args.topology is not None:
        if args.paper or args.devices is not None or args.device_memory is not None:
            parser.error("--topology sets the devices and their memory: drop --paper, "
                         "--devices and --device-memory")
        from examples.lm.tools import topology

        argv = list(sys.argv[1:] if argv is None else argv)
        return topology.main(argv)
    if args.paper:
        return _main_paper(parser, args)
    try:
        cfg = configs.config_from_args(args)
        sizes = (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
        prepare_backend(args.devices or math.prod(s for s in sizes if s > 0))
        devices, _ = devices_for(cfg, args.devices)
        result = compile_step(cfg, devices)
    except ValueError as e:
        parser.error(str(e))
    print(report(result, name=args.config or configs.DEFAULT_CONFIG,
                 device_memory=args.device_memory))
    fits = args.device_memory is None or result["peak_bytes"] <= args.device_memory
    if not fits:
        result["cheapest_fit"] = cheapest_fit(cfg, devices, args.device_memory,
                                              search=args.fit == "auto")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if fits else 1


def _main_paper(parser, args) -> int:
    if args.config is not None and args.config not in configs.PAPER_MODELS:
        parser.error(f"--paper compiles the paper configs {sorted(configs.PAPER_MODELS)}, got "
                     f"--config {args.config}")
    sizes = [args.config] if args.config else list(configs.PAPER_MODELS)
    head = configs.config_from_args(args).head if args.field__head else "rownorm"
    prepare_backend(8)
    devices = (jax.devices()[:8] if jax.default_backend() != "cpu" and jax.device_count() >= 8
               else jax.devices("cpu")[:8])
    results = [paper_figures(size, head, devices) for size in sizes]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["fits"]["H100"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
