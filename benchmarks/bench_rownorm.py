"""The O(Vd) head operations against the donated memory floor, in the steady state; their passes.

Times, at a GPT-2 head shape in both layouts (a ``(V, d)`` table and a Flax ``(d, V)`` kernel),
the jitted ``projected_rownorm`` update, ``clip_row_diameter`` (bound mode), the bracket
``row_diameter_bounds`` and the ``track_row_diameter`` statistics, each in both of rowgeom's
formulations (their ``impl=``): ``[xla]``, the one that runs on every backend and under any
mesh, and ``[cpu]``, the XLA:CPU formulation (``rowgeom/_cpu.py``) that ``impl="auto"`` picks
for an array on a process's only CPU device. Each is next to the memory floor, a jitted
``x * 0.5`` with its input donated (one read and one write), and next to the number of times
its compiled program reads and writes an array of the head's size (``hlo_passes.py``). Then
``projected_rownorm`` across head sizes (with the fitted exponent of its time in ``V·d``), and
the tracker's cost per step in a chain as a one-CPU process runs it: ``projected_rownorm``
alone, chained with the tracker on every step, and with ``every_k_steps=100`` (its off-steps),
as stateful donated steps.

Each candidate names its formulation with ``impl=``, so both run side by side in one process.

Steady state, as in training: each donated function is applied to its own previous output
(``y = f(y)``), so its buffer is reused and never page-faults; functions that return only
statistics read the same input every call. All candidates are interleaved call by call and
each ratio is best-of-``--calls`` over best-of-``--calls`` (the floor itself is bimodal on a
shared machine, and timing fresh copies makes it swing with each buffer's page faults). The
machine's load average is recorded before and after. Also prints the accuracy of three centring
formulations on adversarial rows (a large common vector plus a tiny spread).

    python benchmarks/bench_rownorm.py             # (50304, 768) f32
    python benchmarks/bench_rownorm.py --quick     # small, for a smoke run
    python benchmarks/bench_rownorm.py --docs      # also rewrite its block of docs/benchmarks.md

A shared machine's timings move between runs: compare ratios, not milliseconds.
"""

from __future__ import annotations

import argparse
import time

import hlo_passes
import jax
import jax.numpy as jnp
import numpy as np
import optax
import provenance
from provenance import load_average

import rowgeom
from rowgeom._rownorm import rownorm_direction

FORMULATIONS = ("xla", "cpu")  # the head ops' impl= choices, "auto" aside
BLOCK = "rownorm"  # the generated block of docs/benchmarks.md
COMMAND = "python benchmarks/bench_rownorm.py --docs"

# The memory floor: one read and one write of the head, in place over the donated input.
floor = jax.jit(lambda x: x * 0.5, donate_argnums=0)


def steady_state(candidates: dict, x0, calls: int) -> dict:
    """Best-of-``calls`` seconds per candidate, interleaved with the donated floor.

    ``candidates`` maps a name to ``(jitted fn, donated)``, optionally followed by ``init`` and
    the formulation's name (a label here); a donated function is applied to its own previous output,
    any other one to the same input every call; ``init`` (or None) makes the first argument from
    the input (e.g. ``(updates, state)`` for a stateful step). The floor is added under the name
    ``"floor"``.
    """
    candidates = {"floor": (floor, True), **candidates}
    carry = {}
    for name, (fn, donated, *rest) in candidates.items():  # compile, reach the steady state
        init = (list(rest) + [None])[0]
        x = init(jnp.array(x0)) if init else jnp.array(x0)
        out = jax.block_until_ready(fn(x))
        carry[name] = out if donated else x
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(calls):
        for name, (fn, donated, *_) in candidates.items():
            start = time.perf_counter()
            out = jax.block_until_ready(fn(carry[name]))
            best[name] = min(best[name], time.perf_counter() - start)
            if donated:
                carry[name] = out
    return best


def head_operations(axis: int) -> dict:
    """The jitted O(Vd) head operations for token rows along ``axis``, in both formulations:
    ``"name[formulation]" -> (fn, donated, None, formulation)`` for `steady_state`."""
    def update(tx):
        return jax.jit(lambda u: tx.update(u, optax.EmptyState())[0], donate_argnums=0)

    ops = {}
    for name in FORMULATIONS:
        tracker = rowgeom.track_row_diameter(vocab_axis=axis, impl=name)
        ops |= {
            f"projected_rownorm[{name}]": (
                update(rowgeom.projected_rownorm(vocab_axis=axis, impl=name)), True, None, name),
            f"clip_row_diameter[{name}]": (
                update(rowgeom.clip_row_diameter(1.0, vocab_axis=axis, impl=name)), True, None,
                name),
            f"row_diameter_bounds[{name}]": (
                jax.jit(lambda u, name=name: rowgeom.row_diameter_bounds(
                    u, vocab_axis=axis, impl=name)), False, None, name),
            f"track_row_diameter[{name}]": (
                jax.jit(lambda u, tracker=tracker: tracker.update(u, tracker.init(u))[1]), False,
                None, name),
        }
    return ops


def tracker_steps(axis: int, k: int) -> dict:
    """``projected_rownorm`` alone and chained with ``track_row_diameter`` (every step, and
    ``every_k_steps=k``), traced as in a process with one CPU device: donated
    ``(updates, state) -> (updates, state)`` steps, so the tracker's counter advances as in
    training. In a run of fewer than ``k`` timed calls every
    timed call of the ``k`` chain is an off-step (only the warm-up call measures)."""
    def chained(tracker):
        tx = optax.chain(rowgeom.projected_rownorm(vocab_axis=axis, impl="cpu"), tracker)
        return (jax.jit(lambda c: tx.update(*c), donate_argnums=0), True,
                lambda u: (u, tx.init(u)), "cpu")

    rownorm = rowgeom.projected_rownorm(vocab_axis=axis, impl="cpu")
    return {
        "projected_rownorm": (
            jax.jit(lambda u: rownorm.update(u, optax.EmptyState())[0], donate_argnums=0), True,
            None, "cpu"),
        "chain(projected_rownorm, track(k=1))": chained(
            rowgeom.track_row_diameter(vocab_axis=axis, impl="cpu")),
        f"chain(projected_rownorm, track(k={k}))": chained(
            rowgeom.track_row_diameter(vocab_axis=axis, every_k_steps=k, impl="cpu")),
    }


def measure_tracker(vocab: int, dim: int, *, calls: int, k: int = 100, seed: int = 0) -> list:
    """The tracker's cost per step with and without ``every_k_steps``, both layouts: one row
    per (candidate, layout) with its ratio to the floor; the ``k`` chain's row also carries
    ``off_over_rownorm`` (its off-step time over the bare ``projected_rownorm``) and
    ``amortized_ratio`` (one measured step in ``k``, from the ``k=1`` chain's time)."""
    if calls >= k:
        raise ValueError(f"calls ({calls}) must be < k ({k}) so that every timed call of the "
                         "every_k_steps chain is an off-step")
    rng = np.random.default_rng(seed)
    rows = []
    for axis, shape in ((0, (vocab, dim)), (1, (dim, vocab))):
        x0 = (rng.standard_normal(shape) + 0.1).astype(np.float32)
        ops = tracker_steps(axis, k)
        names = list(ops)
        # Two interleaved groups: the every-step chain's full-size temporaries, freed and
        # re-faulted between calls, slowed its neighbours by up to 1.5x when all three shared
        # one interleave, which made the off-step look expensive on the (V, d) layout.
        best = {}
        for group in ([names[0], names[2]], [names[1]]):
            got = steady_state({n: ops[n] for n in group}, x0, calls)
            best |= {n: (got[n], got["floor"]) for n in group}
        (bare, _), (every, _), (off, _) = (best[name] for name in names)
        for name in names:
            seconds, floor = best[name]
            row = dict(name=name, vocab_axis=axis, shape=list(shape), seconds=seconds,
                       floor_seconds=floor, ratio=seconds / floor)
            if name.endswith(f"k={k}))"):
                row.update(k=k, off_over_rownorm=off / bare,
                           amortized_ratio=(off + (every - off) / k) / best[name][1])
            rows.append(row)
    return rows


def passes(fn, shape) -> dict:
    """Reads and writes of head-sized arrays in ``fn``'s compiled program (``hlo_passes``), and
    the same for the branches that run only when taken (the rescaling of huge input)."""
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    text = fn.lower(spec).compile().as_text()
    traffic = hlo_passes.head_traffic(text, int(np.prod(shape)))
    return dict(reads=traffic.reads, writes=traffic.writes,
                branch_reads=max((b.reads for b in traffic.branches), default=0.0))


def measure(vocab: int, dim: int, *, calls: int, names=None, seed: int = 0,
            count_passes: bool = True) -> list[dict]:
    """Both layouts of a (vocab, dim) head: one row per (operation, layout) with its ratio to
    the floor and (``count_passes``) its full-size reads and writes."""
    rng = np.random.default_rng(seed)
    rows = []
    for axis, shape in ((0, (vocab, dim)), (1, (dim, vocab))):
        x0 = (rng.standard_normal(shape) + 0.1).astype(np.float32)
        ops = head_operations(axis)
        ops = {name: ops[name] for name in (names or ops)}
        best = steady_state(ops, x0, calls)
        for name, (fn, _, _, formulation) in ops.items():
            row = dict(name=name, formulation=formulation, vocab_axis=axis, shape=list(shape),
                       seconds=best[name], floor_seconds=best["floor"],
                       ratio=best[name] / best["floor"])
            if count_passes:
                row.update(passes(fn, shape))
            rows.append(row)
    return rows


def fit_exponent(sizes, seconds) -> float:
    """Least-squares slope of log(time) in log(V·d): 1 means linear in the head size."""
    x = np.log([v * d for v, d in sizes])
    return float(np.polyfit(x, np.log(seconds), 1)[0])


def measure_sizes(sizes, *, repeats: int, calls: int) -> dict:
    """``projected_rownorm[cpu]`` against the floor at each size and layout, best of
    ``repeats`` interleaved measurements (all kept), and the fitted exponents."""
    rows = []
    for vocab, dim in sizes:
        got = [measure(vocab, dim, calls=calls, names=["projected_rownorm[cpu]"],
                       count_passes=False) for _ in range(repeats)]
        for per_layout in zip(*got, strict=True):
            best = min(per_layout, key=lambda r: r["ratio"])
            rows.append(dict(best, vocab=vocab, dim=dim,
                             ratio_repeats=[r["ratio"] for r in per_layout]))
        for row in rows[-2:]:
            print(f"  rownorm {tuple(row['shape'])} axis={row['vocab_axis']}: ratio "
                  f"{row['ratio']:.2f} ({row['seconds'] * 1e3:.2f} ms)", flush=True)
    exponents = {}
    for axis in (0, 1):
        sel = [row for row in rows if row["vocab_axis"] == axis]
        sizes_ = [(row["vocab"], row["dim"]) for row in sel]
        exponents[axis] = dict(rownorm=fit_exponent(sizes_, [r["seconds"] for r in sel]),
                               floor=fit_exponent(sizes_, [r["floor_seconds"] for r in sel]))
    return dict(rows=rows, exponents=exponents)


def print_rows(rows):
    for row in rows:
        counts = (f"  {row['reads']:.3g} reads, {row['writes']:.3g} writes" if "reads" in row
                  else "")
        print(f"  {row['name']:30s} {str(tuple(row['shape'])):14s} vocab_axis={row['vocab_axis']}"
              f"  {row['seconds'] * 1e3:8.2f} ms  floor {row['floor_seconds'] * 1e3:6.2f} ms"
              f"  ratio {row['ratio']:5.2f}{counts}"
              + (f"  off-step / rownorm {row['off_over_rownorm']:.3f}, amortized ratio "
                 f"{row['amortized_ratio']:.2f}" if "off_over_rownorm" in row else ""),
              flush=True)


def tracker_over_rownorm(rows) -> dict:
    """``{(formulation, vocab_axis): track_row_diameter time / projected_rownorm time}``."""
    time = {(r["name"].split("[")[0], r["formulation"], r["vocab_axis"]): r["seconds"]
            for r in rows}
    return {(f, a): time["track_row_diameter", f, a] / time["projected_rownorm", f, a]
            for (name, f, a) in time if name == "projected_rownorm"
            and ("track_row_diameter", f, a) in time}


# --- the generated block ---------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _passes(row: dict) -> str:
    """``"4 reads, 1 write"`` of a row with pass counts."""
    def count(value: float, what: str) -> str:
        text = f"{value:.2f}".rstrip("0").rstrip(".")
        return f"{text} {what}" + ("" if text == "1" else "s")

    return f"{count(row['reads'], 'read')}, {count(row['writes'], 'write')}"


def markdown(results: dict, command: str = COMMAND) -> str:
    """The ``rownorm`` block: head operations with passes, the size sweep, the in-chain tracker."""
    lines = [provenance.header(command, results["environment"]), ""]
    head = results["head_ops"]
    shape = tuple(head[0]["shape"])
    lines += [f"### Every O(Vd) head operation vs the donated floor, {shape} and its transpose",
              "", "One interleaved run (steady state, best of "
              f"{results['calls']} calls each). `[cpu]`: the XLA:CPU formulation, which a "
              "process with one CPU device runs by default (`impl='auto'`); `[xla]`: the "
              "formulation of every other backend and of any mesh, here on one CPU device. "
              "Each cell: time over the "
              "donated floor's; then the full-size reads and writes of the compiled program "
              "(`benchmarks/hlo_passes.py`).", "",
              "| operation | (V, d), vocab_axis=0 | (d, V), vocab_axis=1 |", "|---|---|---|"]
    for name in dict.fromkeys(row["name"] for row in head):
        cells = []
        for axis in (0, 1):
            (r,) = [r for r in head if r["name"] == name and r["vocab_axis"] == axis]
            counts = f"; {_passes(r)}" if "reads" in r else ""
            cells.append(f"**{r['ratio']:.2f}x** ({_ms(r['seconds'])}, floor "
                         f"{_ms(r['floor_seconds'])}{counts})")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    ratios = tracker_over_rownorm(head)
    for formulation in FORMULATIONS:
        if (formulation, 0) in ratios:
            lines.append(f"| `track_row_diameter` / `projected_rownorm` [{formulation}] | "
                         + " | ".join(f"{ratios[formulation, a]:.2f}" for a in (0, 1)) + " |")
    lines.append("")
    if results.get("sizes"):
        sizes = results["sizes"]
        lines += ["### projected_rownorm vs a donated `x * 0.5` across head sizes (`[cpu]`)", "",
                  "| head shape | vocab_axis | ratio (best repeat) | repeats | rownorm | floor |",
                  "|---|---|---|---|---|---|"]
        for row in sizes["rows"]:
            reps = " ".join(f"{r:.2f}" for r in row["ratio_repeats"])
            lines.append(f"| {tuple(row['shape'])} | {row['vocab_axis']} | "
                         f"**{row['ratio']:.2f}x** | {reps} | {_ms(row['seconds'])} | "
                         f"{_ms(row['floor_seconds'])} |")
        lines += ["", "Fitted exponent of time in `V·d` (1 = linear): " + "; ".join(
                f"vocab_axis={ax}: rownorm {e['rownorm']:.2f}, floor {e['floor']:.2f}"
                for ax, e in sizes["exponents"].items()) + ".", ""]
    if results.get("tracker"):
        lines += _tracker_table(results["tracker"])
    return "\n".join(lines)


def _tracker_table(rows: list) -> list:
    """The tracker's cost per step, with and without every_k_steps (stateful donated steps)."""
    shape = tuple(rows[0]["shape"])
    k = next(r["k"] for r in rows if "k" in r)
    lines = [f"### The in-chain tracker's cost per step, {shape} and its transpose", "",
             "Stateful donated steps `(updates, state) -> (updates, state)` as a process with "
             f"one CPU device runs them (`[cpu]` formulation). Every timed call of the `k={k}` "
             f"chain is an off-step; *amortized* adds one measured step in {k}.", "",
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


def np_reference(u):
    x = np.asarray(u, np.float64)
    x = x - x.mean(axis=0)
    y = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-8)
    return y - y.mean(axis=0)


def _direct_no_pivot(x):
    xc = x - jnp.mean(x, axis=0, keepdims=True)
    y = xc / jnp.maximum(jnp.linalg.norm(xc, axis=1, keepdims=True), 1e-8)
    return y - jnp.mean(y, axis=0, keepdims=True)


def _expanded(x):
    """||x_i - m||² = ||x_i||² - 2 x_i·m + ||m||² (matvecs only; cancels near the mean)."""
    m = jnp.mean(x, axis=0)
    n2 = jnp.sum(x * x, axis=1) - 2 * (x @ m) + m @ m
    w = 1 / jnp.maximum(jnp.sqrt(jnp.maximum(n2, 0.0)), 1e-8)
    y = (x - m) * w[:, None]
    return y - jnp.mean(y, axis=0, keepdims=True)


def accuracy(rng, vocab, dim):
    print(f"\naccuracy on rows = 1e3 * c + 1e-2 * noise, ({vocab}, {dim}) f32, "
          "max |error| vs float64 (unit-norm rows):")
    common = 1e3 * rng.standard_normal((1, dim))
    u = (common + 1e-2 * rng.standard_normal((vocab, dim))).astype(np.float32)
    want = np_reference(u)
    cands = {
        "rowgeom (pivot-shifted mean, direct norms)":
            lambda x: rownorm_direction(x, vocab_axis=0),
        "direct norms, plain f32 mean": _direct_no_pivot,
        "expanded norms ||x||^2 - 2x.m + ||m||^2": _expanded,
    }
    for name, fn in cands.items():
        got = np.asarray(jax.jit(fn)(jnp.asarray(u)), np.float64)
        print(f"  {name:44s} {np.abs(got - want).max():.2e}")


QUICK = dict(vocab=8192, dim=256, calls=5, sizes=[(2048, 128), (4096, 256)], repeats=1)
FULL = dict(vocab=50304, dim=768, calls=15,
            sizes=[(4096, 256), (8192, 512), (16384, 768), (32768, 768), (50304, 768)],
            repeats=3)


def run(cfg: dict, *, sizes: bool = True, tracker: bool = True) -> dict:
    """Every measurement of this benchmark (``cfg``: `QUICK` or `FULL`), as a JSON-able dict."""
    env = provenance.environment(load_average())
    print(f"head operations at ({cfg['vocab']}, {cfg['dim']}), both formulations", flush=True)
    results = dict(calls=cfg["calls"],
                   head_ops=measure(cfg["vocab"], cfg["dim"], calls=cfg["calls"]))
    print_rows(results["head_ops"])
    for (formulation, axis), ratio in tracker_over_rownorm(results["head_ops"]).items():
        print(f"  track_row_diameter / projected_rownorm [{formulation}] vocab_axis={axis}: "
              f"{ratio:.2f}")
    if sizes:
        print("projected_rownorm[cpu] across sizes", flush=True)
        results["sizes"] = measure_sizes(cfg["sizes"], repeats=cfg["repeats"],
                                         calls=cfg["calls"])
    if tracker:
        print("the tracker in a chain, one CPU device", flush=True)
        results["tracker"] = measure_tracker(cfg["vocab"], cfg["dim"], calls=cfg["calls"])
        print_rows(results["tracker"])
    results["environment"] = provenance.finish(env)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few calls")
    parser.add_argument("--calls", type=int, help="interleaved timed calls (default 15)")
    parser.add_argument("--no-sizes", action="store_true", help="skip the size sweep")
    provenance.add_arguments(parser, BLOCK)
    args = parser.parse_args()
    cfg = dict(QUICK if args.quick else FULL)
    if args.calls:
        cfg["calls"] = args.calls
    print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.device_count()} device), "
          f"ratio = best-of-{cfg['calls']} time / best-of-{cfg['calls']} donated x*0.5 of the "
          f"same array, steady state, interleaved; load average {load_average()}", flush=True)
    results = run(cfg, sizes=not args.no_sizes)
    provenance.publish(args, BLOCK, markdown(results), results)
    accuracy(np.random.default_rng(0), 4096, 256)


if __name__ == "__main__":
    main()
