"""Every rowgeom benchmark in one process, side by side: a markdown table of ratios plus raw JSON.

Each comparison times a rowgeom operation next to a reference measured interleaved in the same
run, so both see the same machine load; the tables report ratios (absolute times only as
context). Shared machines vary 20-40 % between runs: compare ratios, not milliseconds.

1. ``projected_rownorm`` as a process with one CPU device runs it (the XLA:CPU formulation,
   ``rowgeom/_cpu.py``) vs a donated plain scale ``x * 0.5`` of the same array (the memory
   floor), across head sizes up to (50304, 768), both layouts, with the fitted exponent of its
   time in ``V·d``; then every O(Vd) head operation (``projected_rownorm``,
   ``clip_row_diameter``, ``row_diameter_bounds``, ``track_row_diameter``) at the largest size
   in both layouts and both formulations (``[cpu]`` and ``[masked]``, the one every other
   backend and any mesh runs). Steady state: each donated function applied to its own previous
   output, interleaved with the floor, best of ``rownorm_calls`` each (``bench_rownorm.py``,
   which traces each candidate with its formulation fixed, so this 8-device process measures
   both). Then the in-chain tracker's cost per step on one CPU device: ``projected_rownorm``
   alone vs chained with ``track_row_diameter`` on every step vs with ``every_k_steps=100``
   (its off-steps).
2. ``muon_orthogonalize`` vs optax ``scale_by_muon`` on the hidden matrices of a small LM
   (``bench_muon.py``).
3. Exact ``row_diameter`` vs a float32 matmul of the same useful FLOPs, and the ``O(Vd)``
   bracket ``row_diameter_bounds`` vs the donated floor (``bench_row_diameter.py``).
4. One full optimizer step (update + apply, params and state donated) of ``lm_optimizer`` vs
   ``optax.contrib.muon`` with an AdamW head on the same small LM.
5. Optimizer-state bytes of the head: RowNorm (one float32 momentum) vs AdamW (two moments).
6. On 8 simulated CPU devices: which collectives the compiled head update contains, for a
   vocabulary-sharded and a feature-sharded head.

    python benchmarks/run_all.py                  # full CPU run (several minutes)
    python benchmarks/run_all.py --quick          # smoke run (CI; no thresholds)
    python benchmarks/run_all.py --gpu            # larger sizes on an accelerator

Writes ``results.md`` and ``results.json`` to ``--out`` (default ``runs/benchmarks``) and prints
the markdown; ``--docs`` also replaces the table in ``docs/benchmarks.md`` (between its
``benchmark-table`` markers), which is how the committed CPU table is produced.
"""

from __future__ import annotations

import argparse
import os
import sys

_GPU = "--gpu" in sys.argv
if not _GPU:
    # 8 simulated CPU devices for section 6. Set before jax starts; single-device timings run
    # on device 0 and are unaffected (one shared thread pool).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")

import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import bench_muon  # noqa: E402
import bench_row_diameter  # noqa: E402
import bench_rownorm  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import rowgeom  # noqa: E402

# Per mode: sizes and repetitions. "quick" is a smoke test (seconds), not a measurement.
MODES = {
    "quick": dict(rownorm_sizes=[(2048, 128), (4096, 256)], rownorm_repeats=1, rownorm_calls=3,
                  muon=(64, 1, 3), diameter_sizes=[(2048, 128)], diameter_repeats=1,
                  lm=dict(vocab=1024, d=64, layers=2), lm_reps=3, sharded=(64, 512)),
    "cpu": dict(rownorm_sizes=[(4096, 256), (8192, 512), (16384, 768), (32768, 768),
                               (50304, 768)],
                rownorm_repeats=3, rownorm_calls=15, muon=(256, 4, 15),
                diameter_sizes=[(32768, 512), (50304, 768)], diameter_repeats=2,
                lm=dict(vocab=8192, d=256, layers=4), lm_reps=15, sharded=(256, 8192)),
    "gpu": dict(rownorm_sizes=[(8192, 512), (32768, 768), (50304, 768), (131072, 1024),
                               (262144, 2048)],
                rownorm_repeats=3, rownorm_calls=50, muon=(1024, 12, 30),
                diameter_sizes=[(50304, 768), (131072, 1024)], diameter_repeats=3,
                lm=dict(vocab=50304, d=768, layers=12), lm_reps=30, sharded=None),
}
# The head of a GPT-2-small-sized model, for the state-size table (shapes only, never built).
GPT2_HEAD = (768, 50304)
DOCS_PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
MARKERS = ("<!-- benchmark-table:start -->", "<!-- benchmark-table:end -->")
# "%name = f32[64,512]{1,0} all-gather(...)": the result shape(s), then the op.
COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
    r"(?:-start)?\(")
SHAPE = re.compile(r"[a-z]+\d*\[[\d,]*\]")


# --- 1. projected RowNorm vs the donated memory floor -----------------------------------------


def fit_exponent(sizes, seconds) -> float:
    """Least-squares slope of log(time) in log(V·d): 1 means linear in the head size."""
    x = np.log([v * d for v, d in sizes])
    return float(np.polyfit(x, np.log(seconds), 1)[0])


TRACKER_EVERY_K = 100  # the tracker's every_k_steps in the head section (a log interval)


def rownorm_section(cfg) -> dict:
    """projected_rownorm at each size and layout, then every O(Vd) head operation at the
    largest size, all in the steady state against the donated floor (``bench_rownorm``)."""
    rows = []
    for vocab, dim in cfg["rownorm_sizes"]:
        for _ in range(cfg["rownorm_repeats"]):  # repeats of one interleaved measurement
            got = bench_rownorm.measure(vocab, dim, calls=cfg["rownorm_calls"],
                                        names=["projected_rownorm[cpu]"])
            for row in got:
                match = [r for r in rows if r["shape"] == row["shape"]]
                if match:
                    match[0]["ratio_repeats"].append(row["ratio"])
                    if row["ratio"] < match[0]["ratio"]:
                        match[0].update(row, ratio_repeats=match[0]["ratio_repeats"])
                else:
                    rows.append(dict(row, vocab=vocab, dim=dim, ratio_repeats=[row["ratio"]]))
        for row in rows[-2:]:
            print(f"  rownorm {tuple(row['shape'])} axis={row['vocab_axis']}: ratio "
                  f"{row['ratio']:.2f} ({row['seconds'] * 1e3:.2f} ms)", flush=True)
    exponents = {}
    for axis in (0, 1):
        sel = [row for row in rows if row["vocab_axis"] == axis]
        sizes = [(row["vocab"], row["dim"]) for row in sel]
        exponents[axis] = dict(rownorm=fit_exponent(sizes, [row["seconds"] for row in sel]),
                               floor=fit_exponent(sizes, [row["floor_seconds"] for row in sel]))
    vocab, dim = cfg["rownorm_sizes"][-1]
    load_before = bench_rownorm.load_average()
    head_ops = bench_rownorm.measure(vocab, dim, calls=cfg["rownorm_calls"])
    bench_rownorm.print_rows(head_ops)
    load_between = bench_rownorm.load_average()
    tracker = bench_rownorm.measure_tracker(vocab, dim, calls=cfg["rownorm_calls"],
                                            k=TRACKER_EVERY_K)
    bench_rownorm.print_rows(tracker)
    return dict(rows=rows, exponents=exponents, head_ops=head_ops,
                head_ops_load=[load_before, load_between], tracker=tracker,
                tracker_load=[load_between, bench_rownorm.load_average()])


# --- 4. One optimizer step on a small LM -------------------------------------------------------


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


# --- 5. Head optimizer-state bytes -------------------------------------------------------------


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


# --- 6. Collectives of the sharded head update -------------------------------------------------


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


def _tracker_table(rows: list, load: list) -> list:
    """The tracker's cost per step, with and without every_k_steps (stateful donated chains)."""
    shape = tuple(rows[0]["shape"])
    k = next(r["k"] for r in rows if "k" in r)
    lines = [f"### The in-chain tracker's cost per step, {shape} and its transpose", "",
             f"Stateful donated steps `(updates, state) -> (updates, state)`, one interleaved "
             f"run; load average {load[0]} before / {load[1]} after. Every timed call of the "
             f"`k={k}` chain is an off-step; *amortized* adds one measured step in {k}.", "",
             "| step | (V, d), vocab_axis=0 | (d, V), vocab_axis=1 |", "|---|---|---|"]
    for name in dict.fromkeys(row["name"] for row in rows):
        cells = [next(f"**{r['ratio']:.2f}x** ({_ms(r['seconds'])}, floor "
                      f"{_ms(r['floor_seconds'])})" for r in rows
                      if r["name"] == name and r["vocab_axis"] == axis) for axis in (0, 1)]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    off = {r["vocab_axis"]: r for r in rows if "off_over_rownorm" in r}
    lines.append(f"| off-step / bare `projected_rownorm` | {off[0]['off_over_rownorm']:.3f} | "
                 f"{off[1]['off_over_rownorm']:.3f} |")
    lines.append(f"| amortized `k={k}` chain vs the floor | {off[0]['amortized_ratio']:.2f}x | "
                 f"{off[1]['amortized_ratio']:.2f}x |")
    return lines + [""]


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [f"Run {env['date']} on {env['machine']}: jax {env['jax']}, optax {env['optax']}, "
             f"backend {env['backend']} ({env['devices']} device(s)), {env['cpus']} CPUs, "
             f"load average {env['load_before']} before / {env['load_after']} after, "
             f"mode `{env['mode']}`, total {env['total_seconds']:.0f} s.", ""]

    rn = results["rownorm"]
    lines += ["### projected_rownorm vs a donated `x * 0.5` of the same array", "",
              "The XLA:CPU formulation, which a process with one CPU device runs. Steady state "
              "(each function applied to its own previous, donated output), interleaved call by "
              "call; ratio = best time / best floor time.", "",
              "| head shape | vocab_axis | ratio (best repeat) | repeats | rownorm | floor |",
              "|---|---|---|---|---|---|"]
    for row in rn["rows"]:
        reps = " ".join(f"{r:.2f}" for r in row["ratio_repeats"])
        lines.append(f"| {tuple(row['shape'])} | {row['vocab_axis']} | **{row['ratio']:.2f}x** | "
                     f"{reps} | {_ms(row['seconds'])} | {_ms(row['floor_seconds'])} |")
    lines += ["", "Fitted exponent of time in `V·d` (1 = linear): "
              + "; ".join(f"vocab_axis={ax}: rownorm {e['rownorm']:.2f}, floor {e['floor']:.2f}"
                          for ax, e in rn["exponents"].items()) + ".", ""]
    shape = tuple(rn["head_ops"][0]["shape"])
    lines += [f"### Every O(Vd) head operation vs the donated floor, {shape} and its transpose",
              "", f"One interleaved run; load average {rn['head_ops_load'][0]} before / "
              f"{rn['head_ops_load'][1]} after. `[cpu]`: the XLA:CPU formulation (one CPU "
              "device in the process); `[masked]`: the formulation of every other backend and "
              "of any mesh, here on one CPU device.", "",
              "| operation | (V, d), vocab_axis=0 | (d, V), vocab_axis=1 |", "|---|---|---|"]
    for name in dict.fromkeys(row["name"] for row in rn["head_ops"]):
        cells = [next(f"**{r['ratio']:.2f}x** ({_ms(r['seconds'])}, floor "
                      f"{_ms(r['floor_seconds'])})" for r in rn["head_ops"]
                      if r["name"] == name and r["vocab_axis"] == axis) for axis in (0, 1)]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines.append("")
    if "tracker" in rn:
        lines += _tracker_table(rn["tracker"], rn["tracker_load"])

    mu = results["muon"]
    d, layers, _ = results["config"]["muon"]
    lines += [f"### muon_orthogonalize vs optax (hidden matrices, d={d}, {layers} layers)", "",
              "| comparison | ratio rowgeom / optax | rowgeom | optax | max abs diff |",
              "|---|---|---|---|---|",
              f"| orthogonalization only (grouped) | **{mu['ratio_ortho']:.2f}x** | "
              f"{_ms(mu['ortho']['rowgeom muon_orthogonalize(scale=None)'])} | "
              f"{_ms(mu['ortho']['optax orthogonalize_via_newton_schulz'])} | "
              f"{mu['ortho_err']:.1e} |",
              f"| orthogonalization only (per leaf) | {mu['ratio_ortho_per_leaf']:.2f}x | "
              f"{_ms(mu['ortho']['rowgeom newton_schulz per leaf (no grouping)'])} | "
              f"{_ms(mu['ortho']['optax orthogonalize_via_newton_schulz'])} | |",
              f"| EMA momentum + orthogonalization vs `scale_by_muon` | "
              f"**{mu['ratio_full']:.2f}x** | "
              f"{_ms(mu['full']['rowgeom chain(ema(0.95), muon_orthogonalize)'])} | "
              f"{_ms(mu['full']['optax scale_by_muon(beta=0.95, nesterov=False)'])} | "
              f"{mu['full_err']:.1e} |", ""]

    lines += ["### Row diameter: exact vs a matmul of the same FLOPs; the bracket's tightness", "",
              "| (V, d) | exact speed / GEMM speed (useful FLOP/s) | exact | GEMM GFLOP/s | "
              "bracket lower/D | bracket upper/D |",
              "|---|---|---|---|---|---|"]
    for row in results["row_diameter"]:
        lines.append(
                f"| {(row['vocab'], row['dim'])} | **{row['exact_vs_gemm']:.2f}x** | "
                f"{_ms(row['exact_seconds'])} | {row['gemm_gflops']:.0f} | "
                f"{row['lower_over_d']:.4f} | {row['upper_over_d']:.4f} |")
    lines.append("")

    lm = results["lm"]
    base = lm["seconds"][lm["baseline"]]
    s = lm["shape"]
    lines += [f"### One optimizer step on a small LM (vocab {s['vocab']}, d {s['d']}, "
              f"{s['layers']} layers, {lm['num_params'] / 1e6:.2f}M params; donated)", "",
              "| optimizer | time / optax.contrib.muon | time |", "|---|---|---|"]
    for name, t in lm["seconds"].items():
        lines.append(f"| {name} | **{t / base:.2f}x** | {_ms(t)} |")
    lines.append("")

    lines += ["### Head optimizer-state bytes", "",
              "| head | parameter | " + " | ".join(next(iter(results["state"].values()))
                                                   ["state_bytes"]) + " |",
              "|---|---|" + "---|" * len(next(iter(results["state"].values()))["state_bytes"])]
    for model, row in results["state"].items():
        cells = [f"{_mib(b)} ({b / row['param_bytes']:.2f}x)"
                 for b in row["state_bytes"].values()]
        lines.append(f"| {model} | {_mib(row['param_bytes'])} | " + " | ".join(cells) + " |")
    lines.append("")

    sh = results["sharding"]
    if sh is not None:
        lines += [f"### Collectives in the compiled head update ((d, V) = {tuple(sh['shape'])}, "
                  f"{sh['devices']} simulated devices)", "",
                  "| layout | transform | collectives |", "|---|---|---|"]
        for layout, per_tx in sh["collectives"].items():
            for name, counts in per_tx.items():
                text = ", ".join(f"`{op}`" + (f" x{n}" if n > 1 else "")
                                 for op, n in sorted(counts.items())) or "none"
                lines.append(f"| {layout} | {name} | {text} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--gpu", action="store_true", help="accelerator sizes, no simulated mesh")
    parser.add_argument("--out", default="runs/benchmarks", help="folder for results.md/.json")
    parser.add_argument("--docs", action="store_true",
                        help="also write the table into docs/benchmarks.md")
    args = parser.parse_args()
    mode = "quick" if args.quick else ("gpu" if args.gpu else "cpu")
    cfg = MODES[mode]
    if args.quick and args.gpu:
        cfg = dict(cfg, sharded=None)
    start = time.perf_counter()
    load_before = " ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"mode {mode}: jax {jax.__version__} on {jax.default_backend()}, "
          f"{jax.device_count()} device(s); load {load_before}", flush=True)

    results = {"config": cfg}
    print("1. projected_rownorm vs donated floor", flush=True)
    results["rownorm"] = rownorm_section(cfg)
    print("2. muon_orthogonalize vs optax", flush=True)
    results["muon"] = bench_muon.measure(*cfg["muon"])
    print("3. row diameter", flush=True)
    results["row_diameter"] = [
        bench_row_diameter.bench(v, d, block_size=1024, repeats=cfg["diameter_repeats"])
        for v, d in cfg["diameter_sizes"]]
    print("4. optimizer step on a small LM", flush=True)
    results["lm"] = lm_section(cfg)
    print("5. head state bytes", flush=True)
    results["state"] = state_section(cfg)
    print("6. collectives of the sharded head update", flush=True)
    results["sharding"] = sharding_section(cfg)

    results["environment"] = dict(
            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            machine=f"{platform.machine()} {platform.system()}", cpus=os.cpu_count(),
            jax=jax.__version__, optax=optax.__version__, backend=jax.default_backend(),
            devices=jax.device_count(), mode=mode, load_before=load_before,
            load_after=" ".join(f"{v:.1f}" for v in os.getloadavg()),
            glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""),
            total_seconds=time.perf_counter() - start)
    text = markdown(results)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print("\n" + text)
    print(f"wrote {out / 'results.md'} and {out / 'results.json'}")
    if args.docs:
        page = DOCS_PAGE.read_text()
        start, end = page.index(MARKERS[0]) + len(MARKERS[0]), page.index(MARKERS[1])
        DOCS_PAGE.write_text(page[:start] + "\n" + text + "\n" + page[end:])
        print(f"updated {DOCS_PAGE}")


if __name__ == "__main__":
    main()
