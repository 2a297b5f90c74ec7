"""rowgeom's operations as the TPU compiler builds them, on a host with no TPU: its estimates.

Compiles with libtpu (the `tpu` extra) for compile-only Cloud TPU devices
(`examples/lm/tools/topology.py`) and reads each program's `cost_analysis()`: the bytes it accesses,
its FLOPs and XLA's `optimal_seconds` estimate. These are the TPU compiler's estimates, not
timings; nothing runs. Three tables:

1. The O(Vd) head operations on one chip (v5e, v6e), f32 head (50304, 768) in both layouts
   (`vocab_axis=0`: a (V, d) table; `vocab_axis=1`: a Flax (d, V) kernel): the
   `projected_rownorm` update (input donated) and the `track_row_diameter` statistics, each
   against the memory floor, a donated `x * 0.5` (one read, one write), with the passes over the
   head that the compiled program makes (`hlo_passes.py`). The minimum for RowNorm is 4 reads
   and 1 write: 2.5x the floor; for the tracker 4 reads (the row sum, the centred norms, one
   per sweep): 2x the floor.
2. Muon's orthogonalization on one chip: `rowgeom.muon_orthogonalize` (5 Newton-Schulz steps,
   Keller's coefficients) against optax's `orthogonalize_via_newton_schulz` mapped over the same
   hidden matrices (one `190m` block: q, k, v, o (768, 768), gate and up (768, 2560), down
   (2560, 768)). Matmul FLOPs counted from the HLO (loop bodies by their trip counts).
3. One optimizer update (updates applied, parameters and state donated) on the `190m` tree,
   FSDP over v5e-8: `rowgeom.lm_optimizer` (the example's groups and rates) against
   `optax.adamw`: per-chip bytes, collective bytes and memory.

    python benchmarks/bench_tpu.py            # everything (about a minute or two here)
    python benchmarks/bench_tpu.py --docs     # also rewrite its block of docs/benchmarks.md

`optimal_seconds` counts a loop body once and comes out negative for some programs; it is
shown only for loop-free programs where it is positive.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import hlo_passes  # noqa: E402  (beside this script)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import provenance  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from optax.contrib import _muon as optax_muon  # noqa: E402

import rowgeom  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.lm import configs  # noqa: E402
from examples.lm import optimizer as optimizer_lib  # noqa: E402
from examples.lm import sharding as mesh_lib  # noqa: E402
from examples.lm.tools import compiled as compiled_lib  # noqa: E402
from examples.lm.tools import topology  # noqa: E402

BLOCK = "tpu"  # the generated block of docs/benchmarks.md
COMMAND = "python benchmarks/bench_tpu.py"
HEAD = (50304, 768)
CHIPS = ("v5e-1", "v6e-1")
KELLER = (3.4445, -4.7750, 2.0315)
EPS = 1e-7


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    hlo = compiled.as_text()
    figures = compiled_lib.analyse_hlo(hlo)
    loops = " while(" in hlo
    seconds = float(cost.get("optimal_seconds", -1.0))
    return {"bytes": float(cost.get("bytes accessed", 0.0)), "flops": float(cost.get("flops", 0)),
            "seconds": None if loops or seconds <= 0 else seconds,
            "matmul_flops": figures["matmul_flops"], "collectives": figures["collectives"],
            "loops": loops, "hlo": hlo}


def _one_chip(name: str):
    target = topology.get_target(name)
    mesh = jax.sharding.Mesh(target.devices()[:1], ("x",))
    return target, NamedSharding(mesh, P())


def head_ops(chip: str) -> list[dict]:
    """Each head operation's cost on one `chip` in both layouts, over the floor's."""
    target, rep = _one_chip(chip)
    rows = []
    for axis in (0, 1):
        shape = HEAD if axis == 0 else HEAD[::-1]
        x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rep)
        rownorm = rowgeom.projected_rownorm(vocab_axis=axis, impl="xla")
        tracker = rowgeom.track_row_diameter(vocab_axis=axis, impl="xla")
        ops = {
            "floor (donated x * 0.5)": (lambda u: u * 0.5, (0,)),
            "projected_rownorm": (lambda u, t=rownorm: t.update(u, optax.EmptyState())[0], (0,)),
            "track_row_diameter": (lambda u, t=tracker: t.update(u, t.init(u))[1], ()),
        }
        costs = {}
        for op, (fn, donate) in ops.items():
            compiled, _ = topology.compile_for(fn, (x,), target, in_shardings=rep,
                                               donate_argnums=donate)
            costs[op] = _cost(compiled)
            traffic = hlo_passes.head_traffic(costs[op]["hlo"], HEAD[0] * HEAD[1])
            costs[op]["passes"] = hlo_passes.summary(traffic)
            costs[op]["run"] = traffic.reads + traffic.writes  # the path that always runs
        floor = costs["floor (donated x * 0.5)"]
        for op, c in costs.items():
            rows.append(dict(chip=chip, op=op, vocab_axis=axis, shape=list(shape),
                             bytes=c["bytes"], seconds=c["seconds"], passes=c["passes"],
                             bytes_ratio=c["bytes"] / floor["bytes"],
                             run_ratio=c["run"] / floor["run"],
                             seconds_ratio=(c["seconds"] / floor["seconds"]
                                            if c["seconds"] and floor["seconds"] else None)))
    return rows


def hidden_matrices(d: int = 768, mlp: int = 2560) -> dict:
    """One `190m` block's hidden matrices (float32 updates)."""
    return {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "gate": (d, mlp),
            "up": (d, mlp), "down": (mlp, d)}


def muon(chip: str = "v5e-1") -> list[dict]:
    target, rep = _one_chip(chip)
    grads = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=rep)
             for k, s in hidden_matrices().items()}
    coeffs = jnp.asarray(KELLER)
    ours = rowgeom.muon_orthogonalize(ns_steps=5, ns_coeffs="keller", eps=EPS, scale=None)
    candidates = {
        "optax orthogonalize_via_newton_schulz (per matrix)": lambda g: jax.tree.map(
            lambda x: optax_muon.orthogonalize_via_newton_schulz(x, coeffs, 5, eps=EPS), g),
        "rowgeom muon_orthogonalize(scale=None)": lambda g: ours.update(
            g, optax.EmptyState())[0],
    }
    rows = []
    for name, fn in candidates.items():
        compiled, seconds = topology.compile_for(fn, (grads,), target, in_shardings=rep,
                                                 donate_argnums=(0,))
        c = _cost(compiled)
        rows.append(dict(chip=chip, name=name, bytes=c["bytes"], matmul_flops=c["matmul_flops"],
                         xla_flops=c["flops"], seconds=c["seconds"], loops=c["loops"],
                         compile_s=seconds))
    return rows


def optimizers(config: str = "190m", target_name: str = "v5e-8") -> list[dict]:
    """`lm_optimizer` vs `optax.adamw`: one update of the `config` tree, FSDP over the target."""
    from examples.lm.train import Trainer  # noqa: PLC0415

    target = topology.get_target(target_name)
    cfg = topology.for_target(configs.override(configs.get_config(config),
                                                {"mesh.data": 1, "mesh.fsdp": -1}))
    mesh = mesh_lib.make_mesh(1, -1, 1, devices=target.devices())
    trainer = Trainer(cfg, mesh)
    params = trainer.abstract_state["params"]
    param_shardings = trainer.shardings["params"]
    txs = {"rowgeom.lm_optimizer": rowgeom.lm_optimizer(
               cfg.optim.learning_rate, **optimizer_lib.optimizer_options(cfg)),
           "optax.adamw": optax.adamw(cfg.optim.learning_rate,
                                      weight_decay=cfg.optim.weight_decay)}
    param_bytes = sum(p.size * p.dtype.itemsize for p in jax.tree.leaves(params))
    rows = []
    for name, tx in txs.items():
        with jax.set_mesh(mesh):
            state = jax.eval_shape(tx.init, params)
        shardings = mesh_lib.state_shardings({"params": params, "opt_state": state},
                                             param_shardings, mesh)

        def update(p, s, g, tx=tx):
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s

        with jax.set_mesh(mesh):
            compiled, seconds = topology.compile_for(
                update, (params, state, params), target,
                in_shardings=(param_shardings, shardings["opt_state"], param_shardings),
                out_shardings=(param_shardings, shardings["opt_state"]), donate_argnums=(0, 1))
        c = _cost(compiled)
        memory = compiled_lib.read_compiled(compiled)
        rows.append(dict(name=name, target=target_name, config=config, bytes=c["bytes"],
                         collectives=sum(c["collectives"].values()),
                         by_kind={k: v for k, v in c["collectives"].items() if v},
                         param_bytes=param_bytes, peak=memory["peak_bytes"],
                         seconds=c["seconds"], loops=c["loops"], compile_s=seconds))
    return rows


def run() -> dict:
    env = provenance.environment(provenance.load_average())
    start = time.perf_counter()
    out = {"heads": [row for chip in CHIPS for row in head_ops(chip)], "muon": muon(),
           "optimizers": optimizers()}
    out["environment"] = provenance.finish(env) | {"total_s": time.perf_counter() - start,
                                                    "libtpu": _libtpu_version()}
    return out


def _libtpu_version() -> str:
    from importlib.metadata import version  # noqa: PLC0415

    return version("libtpu")


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None or seconds <= 0 else f"{seconds * 1e3:.3f} ms"


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [provenance.header(COMMAND + " --docs", env), "",
             f"The TPU compiler's estimates, not timings: libtpu {env['libtpu']} compiled each "
             f"program for compile-only Cloud TPU devices ({env['total_s']:.0f} s in all) and "
             "its `cost_analysis()` gives the bytes accessed and `optimal_seconds` (n/a: a "
             "program with a loop, or a negative estimate). Passes: reads and writes of a "
             "head-sized array in the compiled program (`hlo_passes.py`); the minimum for "
             "`projected_rownorm` is 4 reads and 1 write, 2.5x the floor's bytes. "
             "`cost_analysis()` adds up both branches of a conditional, so its bytes include "
             "the branches that run only when taken (such as the overflow guard's rescaling, "
             "for entries above 2**50, or the tracker's rescaled centred norms, for a bracket "
             "outside [2**-60, 2**60]), and it counts a loop's body once (the tracker's two "
             "sweeps: one); the passes count each iteration. The last column counts "
             "the passes of the path that runs on every call, over the floor's.", "",
             "| chip | op | layout | bytes accessed | ÷ floor | est. time | ÷ floor | passes | "
             "passes run ÷ floor's |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["heads"]:
        layout = "(V, d), vocab_axis=0" if r["vocab_axis"] == 0 else "(d, V), vocab_axis=1"
        ratio = "—" if r["seconds_ratio"] is None else f"{r['seconds_ratio']:.2f}x"
        lines.append(f"| {r['chip']} | `{r['op']}` | {layout} | {_mb(r['bytes'])} | "
                     f"{r['bytes_ratio']:.2f}x | {_ms(r['seconds'])} | {ratio} | {r['passes']} | "
                     f"{r['run_ratio']:.2f}x |")
    m = results["muon"]
    lines += ["", "Muon's orthogonalization of one `190m` block's hidden matrices on one "
              f"{m[0]['chip']} chip (float32, 5 Newton-Schulz steps):", "",
              "| implementation | matmul FLOPs (HLO) | bytes accessed | est. time |",
              "|---|---|---|---|"]
    for r in m:
        lines.append(f"| {r['name']} | {r['matmul_flops']:.3g} | {_mb(r['bytes'])} | "
                     f"{_ms(r['seconds'])} |")
    lines.append(f"\nrowgeom / optax: {m[1]['matmul_flops'] / m[0]['matmul_flops']:.2f}x the "
                 f"matmul FLOPs, {m[1]['bytes'] / m[0]['bytes']:.2f}x the bytes accessed.")
    o = results["optimizers"]
    lines += ["", f"One optimizer update of the `{o[0]['config']}` tree (updates applied, "
              f"parameters and state donated), FSDP over {o[0]['target']}, per chip:", "",
              "| optimizer | bytes accessed | collectives (x parameter bytes) | peak memory | "
              "est. time |", "|---|---|---|---|---|"]
    for r in o:
        kinds = ", ".join(f"{k} {v / r['param_bytes']:.2f}x" for k, v in r["by_kind"].items())
        lines.append(f"| `{r['name']}` | {_mb(r['bytes'])} | "
                     f"{r['collectives'] / r['param_bytes']:.2f}x ({kinds or 'none'}) | "
                     f"{r['peak'] / 2**30:.2f} GiB | {_ms(r['seconds'])} |")
    ratio = o[0]["bytes"] / o[1]["bytes"]
    lines.append(f"\n`lm_optimizer` / `optax.adamw`: {ratio:.2f}x the bytes accessed.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    provenance.add_arguments(parser, BLOCK)
    args = parser.parse_args()
    try:
        topology.check_compiler("tpu")
    except topology.CompilerMissing as e:
        raise SystemExit(f"bench_tpu.py: {e}") from None
    topology.prepare("tpu")
    results = run()
    for section in ("muon", "optimizers"):
        for row in results[section]:
            row.pop("hlo", None)
    provenance.publish(args, BLOCK, markdown(results), results)


if __name__ == "__main__":
    main()
