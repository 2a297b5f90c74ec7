"""The O(Vd) head operations against the donated memory floor, in the steady state, and accuracy.

Times, at a GPT-2 head shape in both layouts (a ``(V, d)`` table and a Flax ``(d, V)`` kernel),
the jitted ``projected_rownorm`` update, ``clip_row_diameter`` (bound mode), the bracket
``row_diameter_bounds`` and the ``track_row_diameter`` statistics, each in both of rowgeom's
formulations: ``[masked]``, the one that runs on every backend and under any mesh, and
``[cpu]``, the XLA:CPU formulation (``rowgeom/_cpu.py``) that a process with one CPU device
uses instead (for the bracket of a ``(V, d)`` table the two are the same program: the CPU one
differs only over a leading feature axis). Each is next to the memory floor: a jitted
``x * 0.5`` with its input donated (one read and one write). Then the tracker's cost per step
in a chain, as a one-CPU process runs it: ``projected_rownorm`` alone, chained with the tracker
on every step, and with ``every_k_steps=100`` (its off-steps), as stateful donated steps.

A formulation is chosen when a function is traced (``rowgeom._cpu.one_cpu_device``); here each
candidate is traced with that choice fixed (`formulation`), so both run side by side in one
process whatever its device count.

Steady state, as in training: each donated function is applied to its own previous output
(``y = f(y)``), so its buffer is reused and never page-faults; functions that return only
statistics read the same input every call. All candidates are interleaved call by call and
each ratio is best-of-``--calls`` over best-of-``--calls`` (the floor itself is bimodal on a
shared machine, and timing fresh copies makes it jump between ~3 and ~17 ms). The machine's
load average is printed before and after. Also prints the accuracy of three centring
formulations on adversarial rows (a large common vector plus a tiny spread).

    python benchmarks/bench_rownorm.py             # (50304, 768) f32
    python benchmarks/bench_rownorm.py --quick     # small, for a smoke run

Machines with 2 shared cores vary 20-40 % between runs: compare ratios, not milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import rowgeom
from rowgeom import _cpu
from rowgeom._rownorm import rownorm_direction

# The memory floor: one read and one write of the head, in place over the donated input.
floor = jax.jit(lambda x: x * 0.5, donate_argnums=0)


def load_average() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def steady_state(candidates: dict, x0, calls: int) -> dict:
    """Best-of-``calls`` seconds per candidate, interleaved with the donated floor.

    ``candidates`` maps a name to ``(jitted fn, donated)``, optionally followed by ``init`` and
    the formulation to trace it with; a donated function is applied to its own previous output,
    any other one to the same input every call; ``init`` (or None) makes the first argument from
    the input (e.g. ``(updates, state)`` for a stateful step). The floor is added under the name
    ``"floor"``.
    """
    candidates = {"floor": (floor, True), **candidates}
    carry = {}
    for name, (fn, donated, *rest) in candidates.items():  # compile, reach the steady state
        init, traced_as = (list(rest) + [None, None])[:2]
        x = init(jnp.array(x0)) if init else jnp.array(x0)
        with formulation(traced_as) if traced_as else contextlib.nullcontext():
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


FORMULATIONS = _cpu.FORMULATIONS
formulation = _cpu.traced_as


def head_operations(axis: int) -> dict:
    """The jitted O(Vd) head operations for token rows along ``axis``, in both formulations:
    ``"name[formulation]" -> (fn, donated, None, formulation)`` for `steady_state`."""
    def update(tx):
        return jax.jit(lambda u: tx.update(u, optax.EmptyState())[0], donate_argnums=0)

    tracker = rowgeom.track_row_diameter(vocab_axis=axis)
    ops = {}
    for name in FORMULATIONS:
        ops |= {
            f"projected_rownorm[{name}]": (
                update(rowgeom.projected_rownorm(vocab_axis=axis)), True, None, name),
            f"clip_row_diameter[{name}]": (
                update(rowgeom.clip_row_diameter(1.0, vocab_axis=axis)), True, None, name),
            f"row_diameter_bounds[{name}]": (
                jax.jit(lambda u: rowgeom.row_diameter_bounds(u, vocab_axis=axis)), False, None,
                name),
            f"track_row_diameter[{name}]": (
                jax.jit(lambda u: tracker.update(u, tracker.init(u))[1]), False, None, name),
        }
    return ops


def tracker_steps(axis: int, k: int) -> dict:
    """``projected_rownorm`` alone and chained with ``track_row_diameter`` (every step, and
    ``every_k_steps=k``), traced as in a process with one CPU device: donated
    ``(updates, state) -> (updates, state)`` steps, so the tracker's counter advances as in
    training. In a run of fewer than ``k`` timed calls every
    timed call of the ``k`` chain is an off-step (only the warm-up call measures)."""
    def chained(tracker):
        tx = optax.chain(rowgeom.projected_rownorm(vocab_axis=axis), tracker)
        return (jax.jit(lambda c: tx.update(*c), donate_argnums=0), True,
                lambda u: (u, tx.init(u)), "cpu")

    rownorm = rowgeom.projected_rownorm(vocab_axis=axis)
    return {
        "projected_rownorm": (
            jax.jit(lambda u: rownorm.update(u, optax.EmptyState())[0], donate_argnums=0), True,
            None, "cpu"),
        "chain(projected_rownorm, track(k=1))": chained(
            rowgeom.track_row_diameter(vocab_axis=axis)),
        f"chain(projected_rownorm, track(k={k}))": chained(
            rowgeom.track_row_diameter(vocab_axis=axis, every_k_steps=k)),
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


def measure(vocab: int, dim: int, *, calls: int, names=None, seed: int = 0) -> list[dict]:
    """Both layouts of a (vocab, dim) head: one row per (operation, layout) with its ratio."""
    rng = np.random.default_rng(seed)
    rows = []
    for axis, shape in ((0, (vocab, dim)), (1, (dim, vocab))):
        x0 = (rng.standard_normal(shape) + 0.1).astype(np.float32)
        ops = head_operations(axis)
        ops = {name: ops[name] for name in (names or ops)}
        best = steady_state(ops, x0, calls)
        for name in ops:
            rows.append(dict(name=name, vocab_axis=axis, shape=list(shape), seconds=best[name],
                             floor_seconds=best["floor"], ratio=best[name] / best["floor"]))
    return rows


def print_rows(rows):
    for row in rows:
        print(f"  {row['name']:30s} {str(tuple(row['shape'])):14s} vocab_axis={row['vocab_axis']}"
              f"  {row['seconds'] * 1e3:8.2f} ms  floor {row['floor_seconds'] * 1e3:6.2f} ms"
              f"  ratio {row['ratio']:5.2f}"
              + (f"  off-step / rownorm {row['off_over_rownorm']:.3f}, amortized ratio "
                 f"{row['amortized_ratio']:.2f}" if "off_over_rownorm" in row else ""),
              flush=True)


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few calls")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--calls", type=int, default=15, help="interleaved timed calls")
    args = parser.parse_args()
    if args.quick:
        args.vocab, args.dim, args.calls = 8192, 256, 5
    print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.device_count()} device), "
          f"{os.cpu_count()} cpus, GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '<unset>')}")
    print(f"ratio = best-of-{args.calls} time / best-of-{args.calls} donated x*0.5 of the same "
          f"array, steady state, interleaved")
    print(f"load average before: {load_average()}")
    print_rows(measure(args.vocab, args.dim, calls=args.calls))
    print_rows(measure_tracker(args.vocab, args.dim, calls=args.calls))
    print(f"load average after: {load_average()}")
    accuracy(np.random.default_rng(0), 4096, 256)


if __name__ == "__main__":
    main()
