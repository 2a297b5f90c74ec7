"""The sharded optimizer update, read from compiled HLO on 8 simulated devices.

Everything is compiled from abstract inputs (`jax.ShapeDtypeStruct` with a `NamedSharding`:
nothing is allocated), so the numbers are the compiled program's, not timings:

- **collectives**: the bytes of every cross-device collective in `compiled.as_text()`
  (all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute; the larger of result
  and operands, loop bodies by their trip counts: `examples/lm/tools/compiled.py`), per device,
  divided by the *full hidden group*: the bytes of every hidden (Muon) matrix, unsharded;
- **FLOPs**: `compiled.cost_analysis()["flops"]` per device, divided by the same update compiled
  for one device (ideal with 8 devices: 0.125);
- **temporary memory**: `compiled.memory_analysis().temp_size_in_bytes` per device.

Workloads:

1. `rowgeom.lm_optimizer(1e-3).update(grads, state, params)`, default options (and
   `MuonOptions(shard_matrices=False)`), on the parameter trees of the example
   LM (`examples/lm`: the `190m` and `640m` configs, and a GPT-2-small-shaped one: 12 blocks,
   d 768, MLP 3072, V 50304, untied head). Layouts: *per-block* (the example's NNX model, a list
   of blocks, from `nnx.eval_shape`, with its sharding annotations fitted by
   `examples/lm/sharding.py`), *scanned* (MaxText-style: every block leaf stacked on a leading layer
   axis and sharded like the block's leaf, so `(L, d, f)` is split on `d`) and, on the 1-D mesh,
   *per-block, first axis* (plain FSDP: every matrix split along its first axis). Meshes: FSDP
   over 8 devices, `data` x `fsdp` (2 x 4) and `fsdp` x `tensor` (4 x 2). Optimizer state is
   sharded like its parameter (`examples/lm/sharding.py`'s `state_shardings`).
2. Fewer matrices than devices: `muon_orthogonalize` on 1, 2, 4, 8 split `(768, 3072)` matrices
   and on one `(768, 50304)` Muon head, with and without `shard_matrices`.
The example's whole training step is `benchmarks/bench_train_compile.py`'s
(`examples.lm.tools.train_compile`).

Run: `python benchmarks/bench_sharded_optimizer.py` (`--quick`: small trees; `--docs`: rewrite
its generated block of docs/benchmarks.md, with the run's provenance; `--json PATH`: the raw
numbers).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import inspect  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import provenance  # noqa: E402  (beside this script)
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rowgeom  # noqa: E402
from examples.lm import configs, sharding  # noqa: E402
from examples.lm import model as model_lib  # noqa: E402
from examples.lm import sharding as mesh_lib  # noqa: E402
from examples.lm.tools.compiled import analyse_hlo  # noqa: E402

BLOCK = "sharded-optimizer"  # the generated block of docs/benchmarks.md
COMMAND = "python benchmarks/bench_sharded_optimizer.py"
MESHES = {"fsdp 8": (1, 8, 1), "data 2 x fsdp 4": (2, 4, 1), "fsdp 4 x tensor 2": (1, 4, 2)}
GPT2_SMALL = model_lib.ModelConfig(vocab_size=50304, d_model=768, num_layers=12, num_heads=12,
                                   mlp_dim=3072, max_seq_len=1024)
TINY = model_lib.ModelConfig(vocab_size=1024, d_model=64, num_layers=3, num_heads=2, mlp_dim=192,
                             max_seq_len=64)
GIB = 2**30


# --- Reading a compiled program ------------------------------------------------------------------


def read(compiled) -> dict:
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return dict(collectives=analyse_hlo(compiled.as_text())["collectives"],
                flops=float(cost["flops"]),
                temp_bytes=int(memory.temp_size_in_bytes),
                argument_bytes=int(memory.argument_size_in_bytes),
                output_bytes=int(memory.output_size_in_bytes),
                alias_bytes=int(memory.alias_size_in_bytes))


# --- Parameter trees ---------------------------------------------------------------------------


def per_block_tree(cfg: model_lib.ModelConfig):
    """The example model's abstract parameters and mesh PartitionSpecs (a list of blocks, or,
    with `cfg.scan_layers`, one stacked block)."""
    model = nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    _, params, _ = nnx.split(model, nnx.Param, ...)
    specs = jax.tree.map(sharding.mesh_axes, nnx.to_pure_dict(nnx.get_partition_spec(params)),
                         is_leaf=lambda x: isinstance(x, P))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          nnx.to_pure_dict(params))
    return shapes, specs


def scanned_tree(cfg: model_lib.ModelConfig):
    """The example's scanned layout: every block leaf stacked on a leading layer axis (as
    MaxText stores them), sharded like the block's leaf, so `(L, d, f)` is split on `d`."""
    return per_block_tree(dataclasses.replace(cfg, scan_layers=True))


def first_axis_tree(cfg: model_lib.ModelConfig):
    """The per-block tree with plain FSDP: every matrix split along its first axis."""
    shapes, specs = per_block_tree(cfg)
    specs = jax.tree.map(lambda a: P("fsdp") if a.ndim >= 2 else P(), shapes)
    return shapes, specs


LAYOUTS = {"per-block": per_block_tree, "scanned": scanned_tree,
           "per-block, first axis": first_axis_tree}


def hidden_bytes(shapes) -> int:
    labels = rowgeom.label_params(shapes)
    return sum(math.prod(a.shape) * a.dtype.itemsize for a, label in
               zip(jax.tree.leaves(shapes), jax.tree.leaves(labels), strict=True)
               if label == "hidden")


def placed(shapes, specs, mesh):
    """Abstract arrays with the specs fitted to `mesh` (axes that do not divide are dropped)."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, mesh_lib.fit_spec(a.shape, s, mesh))),
        shapes, specs, is_leaf=lambda x: isinstance(x, P))


def make_mesh(sizes):
    return jax.make_mesh(sizes, mesh_lib.AXES, axis_types=(AxisType.Auto,) * 3)


def supports_shard_matrices(fn) -> bool:
    return "shard_matrices" in inspect.signature(fn).parameters


# --- 1. The lm_optimizer update ----------------------------------------------------------------


def compile_update(tx, params, mesh=None):
    """`tx.update(grads, state, params)` compiled for `params` (abstract, maybe sharded), the
    optimizer state sharded like the example trainer shards it (moments like their parameter,
    `examples/lm/sharding.py`'s `state_shardings`)."""
    state = jax.eval_shape(tx.init, params)
    if mesh is None:
        return read(jax.jit(tx.update).lower(params, state, params).compile())
    param_shardings = jax.tree.map(lambda a: a.sharding, params)
    shardings = mesh_lib.state_shardings({"params": params, "opt_state": state},
                                         param_shardings, mesh)["opt_state"]
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         state, shardings)
    with jax.set_mesh(mesh):
        return read(jax.jit(tx.update).lower(params, state, params).compile())


def update_rows(trees, meshes, variants):
    rows = []
    for tree_name, cfg in trees.items():
        for layout, build in LAYOUTS.items():
            shapes, specs = build(cfg)
            hidden = hidden_bytes(shapes)
            single = {name: compile_update(make(), shapes) for name, make in variants.items()}
            for mesh_name in meshes[tree_name] if layout != "per-block, first axis" else [
                    "fsdp 8"]:
                mesh = make_mesh(MESHES[mesh_name])
                for name, make in variants.items():
                    t0 = time.perf_counter()
                    got = compile_update(make(), placed(shapes, specs, mesh), mesh)
                    rows.append(dict(tree=tree_name, layout=layout, mesh=mesh_name, variant=name,
                                     hidden_bytes=hidden, single=single[name], sharded=got,
                                     compile_s=time.perf_counter() - t0))
                    print(_update_line(rows[-1]), flush=True)
    return rows


def _update_line(row) -> str:
    c = row["sharded"]["collectives"]
    total = sum(c.values()) / row["hidden_bytes"]
    flops = row["sharded"]["flops"] / row["single"]["flops"]
    return (f"{row['tree']:>11s} {row['layout']:>9s} {row['mesh']:>17s} {row['variant']:>22s}: "
            f"collectives {total:6.3f}x hidden, FLOPs {flops:.3f}x one device, temp "
            f"{row['sharded']['temp_bytes'] / 2**20:8.1f} MiB ({row['compile_s']:.0f} s)")


# --- 2. Fewer matrices than devices ------------------------------------------------------------


def few_rows(d: int, f: int, vocab: int, counts=(1, 2, 4, 8)):
    """`muon_orthogonalize` on k FSDP-sharded (d, f) matrices and on one (d, V) Muon head
    (split along d, as FSDP splits it, or along V, as tensor parallelism does)."""
    mesh = make_mesh(MESHES["fsdp 8"])
    cases = {f"{k} x ({d}, {f}), split on {d}": ([(d, f)] * k, P("fsdp", None))
             for k in counts}
    cases[f"1 x ({d}, {vocab}) head, split on {d}"] = ([(d, vocab)], P("fsdp", None))
    cases[f"1 x ({d}, {vocab}) head, split on {vocab}"] = ([(d, vocab)], P(None, "fsdp"))
    variants = {"default": {}}
    if supports_shard_matrices(rowgeom.muon_orthogonalize):
        variants["shard_matrices=False"] = {"shard_matrices": False}
    rows = []
    for case, (shapes, spec) in cases.items():
        tree = {f"w{i}": jax.ShapeDtypeStruct(s, jnp.float32) for i, s in enumerate(shapes)}
        full = sum(math.prod(s) * 4 for s in shapes)
        for name, kwargs in variants.items():
            tx = rowgeom.muon_orthogonalize(**kwargs)
            step = lambda g, tx=tx: tx.update(g, tx.init(g))[0]
            single = read(jax.jit(step).lower(tree).compile())
            sharding = NamedSharding(mesh, spec)
            sharded_tree = jax.tree.map(lambda a, sharding=sharding: jax.ShapeDtypeStruct(
                    a.shape, a.dtype, sharding=sharding), tree)
            with jax.set_mesh(mesh):
                got = read(jax.jit(step).lower(sharded_tree).compile())
            rows.append(dict(case=case, variant=name, matrix_bytes=full, single=single,
                             sharded=got))
            c = got["collectives"]
            print(f"{case:>36s} {name:>22s}: collectives {sum(c.values()) / full:6.3f}x the "
                  f"matrices, FLOPs {got['flops'] / single['flops']:.3f}x one device", flush=True)
    return rows


# --- 3. The example's training step ------------------------------------------------------------


# --- Report ------------------------------------------------------------------------------------


def _kinds(c: dict, scale: float) -> str:
    parts = [f"{k} {v / scale:.3f}" for k, v in c.items() if v]
    return ", ".join(parts) if parts else "none"


def markdown(results: dict, command: str = COMMAND) -> str:
    env = results["environment"]
    lines = [provenance.header(command, env), "",
             "Every number is read from the compiled program (abstract inputs, nothing "
             "allocated).", "",
             "### `lm_optimizer(1e-3).update`, default options", "",
             "Collectives: result bytes per device per step ÷ the full (unsharded) hidden group; "
             "FLOPs per device ÷ the same update compiled for one device (ideal 0.125); "
             "temporary memory per device.", "",
             "| tree | layout | mesh | variant | collectives ÷ hidden group | by kind | "
             "FLOPs ÷ one device | temp / device |", "|---|---|---|---|---|---|---|---|"]
    for r in results["update"]:
        c, h = r["sharded"]["collectives"], r["hidden_bytes"]
        lines.append(
                f"| {r['tree']} ({h / 2**20:.0f} MiB hidden) | {r['layout']} | {r['mesh']} | "
                f"{r['variant']} | **{sum(c.values()) / h:.3f}** | {_kinds(c, h)} | "
                f"{r['sharded']['flops'] / r['single']['flops']:.3f} | "
                f"{r['sharded']['temp_bytes'] / 2**20:.0f} MiB |")
    lines += ["", "### Fewer matrices than devices (`muon_orthogonalize`, FSDP over 8)", "",
              "| matrices | variant | collectives ÷ the matrices' bytes | by kind | "
              "FLOPs ÷ one device |", "|---|---|---|---|---|"]
    for r in results["few"]:
        c, full = r["sharded"]["collectives"], r["matrix_bytes"]
        lines.append(f"| {r['case']} | {r['variant']} | **{sum(c.values()) / full:.3f}** | "
                     f"{_kinds(c, full)} | {r['sharded']['flops'] / r['single']['flops']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small trees")
    provenance.add_arguments(parser, BLOCK)
    parser.add_argument("--trees", nargs="*", help="only these trees (e.g. '190m')")
    parser.add_argument("--no-few", action="store_true", help="skip fewer-matrices cases")
    args = parser.parse_args()
    assert jax.device_count() == 8, jax.devices()
    env = provenance.environment(provenance.load_average())

    variants = {"default": lambda: rowgeom.lm_optimizer(1e-3)}
    if "shard_matrices" in rowgeom.MuonOptions.__dataclass_fields__:
        variants["shard_matrices=False"] = lambda: rowgeom.lm_optimizer(
                1e-3, muon=rowgeom.MuonOptions(shard_matrices=False))
    if args.quick:
        trees = {"tiny": TINY}
        meshes = {"tiny": list(MESHES)}
        few = dict(d=64, f=192, vocab=1024)
    else:
        trees = {"GPT-2 small": GPT2_SMALL, "190m": configs.get_config("190m").model,
                 "640m": configs.get_config("640m").model}
        meshes = {"GPT-2 small": list(MESHES), "190m": list(MESHES), "640m": ["fsdp 8"]}
        few = dict(d=768, f=3072, vocab=50304)
    if args.trees:
        trees = {k: v for k, v in trees.items() if k in args.trees}
    results = {"update": update_rows(trees, meshes, variants),
               "few": [] if args.no_few else few_rows(**few)}
    results["environment"] = provenance.finish(env)
    shown = [a for i, a in enumerate(sys.argv[1:]) if not a.startswith("--json")
             and (i == 0 or sys.argv[i] != "--json")]  # a local path: not part of the command
    command = " ".join([COMMAND, *shown])
    provenance.publish(args, BLOCK, markdown(results, command), results)


if __name__ == "__main__":
    main()
