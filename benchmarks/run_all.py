"""Every rowgeom benchmark, each in the process that matches what it measures; ratios, side by side.

Each comparison times a rowgeom operation next to a reference measured interleaved in the same
run, so both see the same machine load; the tables report ratios (absolute times only as
context) and the passes read from compiled programs. A shared machine's timings move between runs:
compare ratios, not milliseconds. Sections, each run in its own subprocess:

- ``rownorm`` (one CPU device): every O(Vd) head operation in both formulations and both
  layouts vs the donated memory floor, with its full-size passes; ``projected_rownorm`` across
  head sizes; the in-chain tracker's cost (``bench_rownorm.py``).
- ``muon`` (one CPU device): ``muon_orthogonalize`` vs optax ``scale_by_muon`` on the hidden
  matrices of a small LM (``bench_muon.py``).
- ``row_diameter`` (one CPU device): exact ``row_diameter`` vs a float32 matmul of the same
  useful FLOPs, and the bracket's tightness (``bench_row_diameter.py``).
- ``lm`` (one CPU device): one full optimizer step (update + apply, params and state donated)
  of ``lm_optimizer`` vs ``optax.contrib.muon`` with an AdamW head on the same small LM.
- ``state`` (abstract shapes): optimizer-state bytes of the head, RowNorm vs AdamW.
- ``sharding`` (8 simulated CPU devices): which collectives the compiled head update contains,
  for a vocabulary-sharded and a feature-sharded head.

A one-device section runs what a user with one CPU runs (the XLA:CPU formulation, ``[cpu]``,
unless a row says ``[masked]``); only the sharded section simulates devices, and it runs the
masked formulation, as every mesh does. Each section's table says which.

    python benchmarks/run_all.py                  # full CPU run
    python benchmarks/run_all.py --quick          # smoke run (CI; no thresholds)
    python benchmarks/run_all.py --gpu            # larger sizes on an accelerator
    python benchmarks/run_all.py --docs           # also rewrite the tables of docs/benchmarks.md

Writes ``results.md`` and ``results.json`` to ``--out`` (default ``runs/benchmarks``) and prints
the markdown; ``--docs`` also replaces the generated blocks of ``docs/benchmarks.md``: the
``benchmark-table`` block, made of one block per section (each with its own date, commit,
machine and load), which ``bench_rownorm.py --docs`` and the other benchmarks can also rewrite
one at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import provenance
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rowgeom

# Per mode: sizes and repetitions. "quick" is a smoke test (seconds), not a measurement.
MODES = {
    "quick": dict(rownorm=dict(vocab=8192, dim=256, calls=3, sizes=[(2048, 128), (4096, 256)],
                               repeats=1),
                  muon=(64, 1, 3), diameter_sizes=[(2048, 128)], diameter_repeats=1,
                  lm=dict(vocab=1024, d=64, layers=2), lm_reps=3, sharded=(64, 512)),
    "cpu": dict(rownorm=dict(vocab=50304, dim=768, calls=15,
                             sizes=[(4096, 256), (8192, 512), (16384, 768), (32768, 768),
                                    (50304, 768)], repeats=3),
                muon=(256, 4, 15), diameter_sizes=[(32768, 512), (50304, 768)],
                diameter_repeats=2, lm=dict(vocab=8192, d=256, layers=4), lm_reps=15,
                sharded=(256, 8192)),
    "gpu": dict(rownorm=dict(vocab=50304, dim=768, calls=50,
                             sizes=[(8192, 512), (32768, 768), (50304, 768), (131072, 1024),
                                    (262144, 2048)], repeats=3),
                muon=(1024, 12, 30), diameter_sizes=[(50304, 768), (131072, 1024)],
                diameter_repeats=3, lm=dict(vocab=50304, d=768, layers=12), lm_reps=30,
                sharded=None),
}
# The head of a GPT-2-small-sized model, for the state-size table (shapes only, never built).
GPT2_HEAD = (768, 50304)
COMMAND = "python benchmarks/run_all.py --docs"
OUTER_BLOCK = "benchmark-table"
# "%name = f32[64,512]{1,0} all-gather(...)": the result shape(s), then the op.
COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
    r"(?:-start)?\(")
SHAPE = re.compile(r"[a-z]+\d*\[[\d,]*\]")
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


# --- lm: one optimizer step on a small LM -------------------------------------------------------


def lm_params(vocab: int, d: int, layers: int, seed: int = 0) -> dict:
    """Parameters of a small pre-norm decoder (Flax layouts, untied (d, V) head)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.02, jnp.float32)
    block = lambda: {
        "attn": {name: {"kernel": normal(d, d)} for name in ("q_proj", "k_proj", "v_proj",
                                                             "o_proj")},
        "mlp": {"gate_proj": {"kernel": normal(d, 4 * d)}, "up_proj": {"kernel": normal(d, 4 * d)},
                "down_proj": {"kernel": normal(4 * d, d)}},
        "attn_norm": {"scale": jnp.ones((d,), jnp.float32)},
        "mlp_norm": {"scale": jnp.ones((d,), jnp.float32)},
    }
    return {"embed": {"embedding": normal(vocab, d)},
            "layers": {str(i): block() for i in range(layers)},
            "final_norm": {"scale": jnp.ones((d,), jnp.float32)},
            "lm_head": {"kernel": normal(d, vocab)}}


def optax_muon_adamw_head(learning_rate: float) -> optax.GradientTransformation:
    """optax.contrib.muon: Muon on the hidden matrices, AdamW on head, embedding and vectors."""
    def dims(params):
        labels = rowgeom.label_params(params)
        return jax.tree.map(
                lambda lab: optax.contrib.MuonDimensionNumbers() if lab == "hidden" else None,
                labels)

    return optax.contrib.muon(learning_rate, beta=0.95, weight_decay=0.1, adam_b2=0.95,
                              adam_weight_decay=0.1, muon_weight_dimension_numbers=dims)


def time_steps(candidates: dict, params, grads, reps: int) -> dict:
    """Median seconds of one donated ``(params, state) -> (params, state)`` step, interleaved."""
    steps, carries = {}, {}
    for name, tx in candidates.items():
        def step(p, s, g, tx=tx):
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s

        steps[name] = jax.jit(step, donate_argnums=(0, 1))
        p = jax.tree.map(jnp.copy, params)
        carries[name] = jax.block_until_ready(steps[name](p, tx.init(p), grads))  # compile
    samples = {name: [] for name in candidates}
    for _ in range(reps):
        for name in candidates:
            start = time.perf_counter()
            carries[name] = jax.block_until_ready(steps[name](*carries[name], grads))
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in samples.items()}


def state_bytes(state, head_name: str = "lm_head") -> int:
    """Bytes of the optimizer-state leaves that belong to the head parameter (by path)."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for path, x in leaves
               if head_name in jax.tree_util.keystr(path))


def lm_section(cfg) -> dict:
    shape = cfg["lm"]
    params = lm_params(shape["vocab"], shape["d"], shape["layers"])
    rng = np.random.default_rng(1)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
    candidates = {
        "optax.contrib.muon (AdamW head)": optax_muon_adamw_head(1e-3),
        "rowgeom.lm_optimizer(head='adamw')": rowgeom.lm_optimizer(1e-3, head="adamw"),
        "rowgeom.lm_optimizer() (RowNorm head)": rowgeom.lm_optimizer(1e-3),
    }
    seconds = time_steps(candidates, params, grads, cfg["lm_reps"])
    for name, t in seconds.items():
        print(f"  {name:44s} {t * 1e3:8.2f} ms", flush=True)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return dict(shape=shape, num_params=int(n_params), seconds=seconds,
                baseline="optax.contrib.muon (AdamW head)")


# --- state: head optimizer-state bytes ---------------------------------------------------------


def state_section(cfg) -> dict:
    """Head state bytes from abstract shapes (``jax.eval_shape``: nothing is allocated)."""
    out = {}
    shape = cfg["lm"]
    models = {f"small LM head ({shape['d']}, {shape['vocab']})":
              lm_params(shape["vocab"], shape["d"], 1),
              f"GPT-2-small head {GPT2_HEAD}":
              {"lm_head": {"kernel": jax.ShapeDtypeStruct(GPT2_HEAD, jnp.float32)}}}
    txs = {"RowNorm (lm_optimizer)": rowgeom.lm_optimizer(1e-3),
           "AdamW (lm_optimizer head='adamw')": rowgeom.lm_optimizer(1e-3, head="adamw"),
           "AdamW (optax.contrib.muon)": optax_muon_adamw_head(1e-3)}
    for model, params in models.items():
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        head = abstract["lm_head"]["kernel"]
        out[model] = dict(param_bytes=math.prod(head.shape) * np.dtype(head.dtype).itemsize,
                          state_bytes={name: state_bytes(jax.eval_shape(tx.init, abstract))
                                       for name, tx in txs.items()})
    return out


# --- sharding: collectives of the sharded head update ------------------------------------------


def collectives(hlo_text: str) -> dict:
    """``"op result-shape" -> count`` for every cross-device collective in optimized HLO text.

    The shape says what travels: a few ``d``- or ``V``-vectors are cheap, a full ``(d, V)``
    all-gather means the head was replicated on every device.
    """
    counts: dict[str, int] = {}
    for result, op in COLLECTIVE.findall(hlo_text):
        key = f"{op} {' '.join(SHAPE.findall(result))}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def sharding_section(cfg) -> dict | None:
    if cfg["sharded"] is None or jax.device_count() < 8:
        return None
    d, vocab = cfg["sharded"]
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(2)
    kernel = jnp.asarray(rng.standard_normal((d, vocab)), jnp.float32)
    params = {"lm_head": {"kernel": kernel}}
    grads = {"lm_head": {"kernel": kernel * 0.1}}
    out = {}
    for layout, spec in (("vocabulary-sharded (d, V/8)", P(None, "x")),
                         ("feature-sharded (d/8, V)", P("x", None))):
        sharding = NamedSharding(mesh, spec)
        p, g = jax.device_put(params, sharding), jax.device_put(grads, sharding)
        for name, tx in (("projected_rownorm", rowgeom.projected_rownorm(vocab_axis=1)),
                         ("lm_optimizer head (RowNorm + tracker)", rowgeom.lm_optimizer(1e-3)),
                         ("lm_optimizer head='adamw' (+ tracker)",
                          rowgeom.lm_optimizer(1e-3, head="adamw"))):
            with jax.set_mesh(mesh):
                state = jax.jit(tx.init)(p)
                hlo = jax.jit(tx.update).lower(g, state, p).compile().as_text()
            out.setdefault(layout, {})[name] = collectives(hlo)
    return dict(shape=[d, vocab], devices=8, collectives=out)


# --- Report ------------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


def _process(env: dict) -> str:
    """Which devices a section ran on, and so which formulation of RowNorm and the bracket."""
    if env["backend"] == "cpu" and env["devices"] == 1:
        return "Process: one CPU device, so RowNorm and the bracket run the XLA:CPU formulation."
    devices = (f"{env['devices']} simulated CPU devices" if env["backend"] == "cpu"
               else f"{env['devices']} {env['backend']} device(s)")
    return f"Process: {devices}, so RowNorm and the bracket run the masked formulation."


def lm_markdown(lm: dict, env: dict) -> str:
    base = lm["seconds"][lm["baseline"]]
    s = lm["shape"]
    lines = [provenance.header(COMMAND, env), "", _process(env), "",
             f"### One optimizer step on a small LM (vocab {s['vocab']}, d {s['d']}, "
             f"{s['layers']} layers, {lm['num_params'] / 1e6:.2f}M params; donated)", "",
             "Median of interleaved steps.", "",
             "| optimizer | time / optax.contrib.muon | time |", "|---|---|---|"]
    for name, t in lm["seconds"].items():
        lines.append(f"| {name} | **{t / base:.2f}x** | {_ms(t)} |")
    return "\n".join(lines)


def state_markdown(state: dict, env: dict) -> str:
    first = next(iter(state.values()))["state_bytes"]
    lines = [provenance.header(COMMAND, env), "", "### Head optimizer-state bytes", "",
             "From abstract shapes (`jax.eval_shape`); exact, not timed.", "",
             "| head | parameter | " + " | ".join(first) + " |",
             "|---|---|" + "---|" * len(first)]
    for model, row in state.items():
        cells = [f"{_mib(b)} ({b / row['param_bytes']:.2f}x)"
                 for b in row["state_bytes"].values()]
        lines.append(f"| {model} | {_mib(row['param_bytes'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sharding_markdown(sh: dict | None, env: dict) -> str:
    lines = [provenance.header(COMMAND, env), ""]
    if sh is None:
        return "\n".join(lines + ["### Collectives in the compiled head update", "",
                                   "Not run: fewer than 8 devices in this mode."])
    lines += [_process(env), "",
              f"### Collectives in the compiled head update ((d, V) = {tuple(sh['shape'])}, "
              f"{sh['devices']} simulated devices)", "",
              "Read from the compiled program: each collective's result shape and count.", "",
              "| layout | transform | collectives |", "|---|---|---|"]
    for layout, per_tx in sh["collectives"].items():
        for name, counts in per_tx.items():
            text = ", ".join(f"`{op}`" + (f" x{n}" if n > 1 else "")
                             for op, n in sorted(counts.items())) or "none"
            lines.append(f"| {layout} | {name} | {text} |")
    return "\n".join(lines)


# --- Sections, each in its own process -----------------------------------------------------------


def run_section(name: str, cfg: dict) -> dict:
    """Runs one section in this process: ``{"results": ..., "markdown": ...}``."""
    import bench_muon
    import bench_row_diameter
    import bench_rownorm

    env = provenance.environment(provenance.load_average())
    if name == "rownorm":
        results = bench_rownorm.run(cfg["rownorm"])
        return dict(results=results, markdown=bench_rownorm.markdown(results, COMMAND))
    if name == "muon":
        results = bench_muon.run(*cfg["muon"])
        return dict(results=results, markdown=bench_muon.markdown(results, COMMAND))
    if name == "row_diameter":
        results = bench_row_diameter.run(cfg["diameter_sizes"], repeats=cfg["diameter_repeats"])
        return dict(results=results, markdown=bench_row_diameter.markdown(results, COMMAND))
    if name == "lm":
        results = lm_section(cfg)
        return dict(results=results, markdown=lm_markdown(results, provenance.finish(env)))
    if name == "state":
        results = state_section(cfg)
        return dict(results=results, markdown=state_markdown(results, provenance.finish(env)))
    if name == "sharding":
        results = sharding_section(cfg)
        return dict(results=results, markdown=sharding_markdown(results, provenance.finish(env)))
    raise ValueError(f"unknown section {name!r}")


# Section name -> (simulated CPU devices, or None: leave the devices alone).
SECTIONS = {"rownorm": 1, "muon": 1, "row_diameter": 1, "lm": 1, "state": 1, "sharding": 8}


def _env(devices: int | None, gpu: bool) -> dict:
    """The child's environment: one CPU device, or ``devices`` simulated CPU devices."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_FLAG)]
    if not gpu and devices and devices > 1:
        flags.append(f"{_DEVICE_FLAG}={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def _spawn(name: str, mode: str, gpu: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / f"{name}.json"
        cmd = [sys.executable, __file__, "--section", name, "--mode", mode, "--json", str(out)]
        proc = subprocess.run(cmd, env=_env(SECTIONS[name], gpu), check=False)
        if proc.returncode != 0:
            raise SystemExit(f"section {name} failed (exit status {proc.returncode})")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--gpu", action="store_true", help="accelerator sizes, no simulated mesh")
    parser.add_argument("--out", default="runs/benchmarks", help="folder for results.md/.json")
    parser.add_argument("--docs", action="store_true",
                        help="also write the generated blocks of docs/benchmarks.md")
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS),
                        help="run these sections only (with --docs: rewrite only their blocks)")
    parser.add_argument("--section", choices=list(SECTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:  # a child: one section in this process
        cfg = MODES[args.mode]
        print(f"[{args.section}] jax {jax.__version__} on {jax.default_backend()}, "
              f"{jax.device_count()} device(s); load {provenance.load_average()}", flush=True)
        got = run_section(args.section, cfg)
        pathlib.Path(args.json).write_text(json.dumps(got, indent=1, default=str) + "\n")
        return
    mode = "quick" if args.quick else ("gpu" if args.gpu else "cpu")
    start = time.perf_counter()
    names = args.only or list(SECTIONS)
    results: dict = {"config": MODES[mode], "mode": mode}
    blocks = {}
    for name in names:
        print(f"== {name} ({SECTIONS[name]} device(s))", flush=True)
        got = _spawn(name, mode, args.gpu)
        results[name] = got["results"]
        blocks[name] = got["markdown"]
    results["total_seconds"] = time.perf_counter() - start
    text = "\n\n".join(blocks.values())
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print("\n" + text)
    print(f"wrote {out / 'results.md'} and {out / 'results.json'} "
          f"({results['total_seconds']:.0f} s)")
    if args.docs:
        if args.only:
            for name, markdown in blocks.items():
                provenance.write_block(name, markdown)
        else:
            provenance.write_block(OUTER_BLOCK, "\n\n".join(
                    provenance.block(name, markdown) for name, markdown in blocks.items()))


if __name__ == "__main__":
    main()
