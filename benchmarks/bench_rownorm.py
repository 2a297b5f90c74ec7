"""Projected RowNorm on an LM head: time against the donated memory floor, and accuracy.

Times the jitted ``projected_rownorm`` update with its input donated next to a plain donated
scale ``x * 0.5`` of the same array (one read and one write: the memory floor), measured
interleaved in one run so both see the same machine load. Reports the median of the per-call
ratios for each repeat and the median over repeats. Also times the straightforward XLA
formulation (the accelerator path) for context, and prints the accuracy of three centring
formulations on adversarial rows (a large common vector plus a tiny spread).

    python benchmarks/bench_rownorm.py             # (50304, 768) f32, 3 repeats
    python benchmarks/bench_rownorm.py --quick     # small, for a smoke run
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/bench_rownorm.py

Machines with 2 shared cores vary 20-40 % between runs: compare ratios, not milliseconds.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rowgeom import projected_rownorm
from rowgeom._rownorm import _project_f32


def _timed(fn, x):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(x))
    return time.perf_counter() - start, out


def side_by_side(candidate, floor, x0, calls):
    """Per-call times of `candidate` and `floor`, interleaved; both donate their input."""
    x = candidate(jnp.array(x0))
    y = floor(jnp.array(x0))
    jax.block_until_ready((x, y))
    times, floors = [], []
    for _ in range(calls):
        t, x = _timed(candidate, x)
        f, y = _timed(floor, y)
        times.append(t)
        floors.append(f)
    times, floors = np.array(times), np.array(floors)
    return np.median(times), np.median(floors), np.median(times / floors)


def report(name, candidate, floor, x0, *, repeats, calls):
    ratios, ms, floor_ms = [], [], []
    for _ in range(repeats):
        t, f, r = side_by_side(candidate, floor, x0, calls)
        ratios.append(r)
        ms.append(t * 1e3)
        floor_ms.append(f * 1e3)
    each = " ".join(f"{r:.2f}" for r in ratios)
    print(f"{name:44s} {np.median(ms):8.2f} ms  floor {np.median(floor_ms):6.2f} ms  "
          f"ratio {np.median(ratios):5.2f}  (repeats: {each})", flush=True)


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
            lambda x: _project_f32(x, vocab_axis=0, eps=1e-8, center_input=True,
                                   center_output=True, num_valid=None, argname="u"),
        "direct norms, plain f32 mean": _direct_no_pivot,
        "expanded norms ||x||^2 - 2x.m + ||m||^2": _expanded,
    }
    for name, fn in cands.items():
        got = np.asarray(jax.jit(fn)(jnp.asarray(u)), np.float64)
        print(f"  {name:44s} {np.abs(got - want).max():.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 1 repeat")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=15, help="timed calls per repeat")
    args = parser.parse_args()
    if args.quick:
        args.vocab, args.dim, args.repeats, args.calls = 8192, 256, 1, 5
    vocab, dim = args.vocab, args.dim
    print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.device_count()} device), "
          f"{os.cpu_count()} cpus, GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '<unset>')}")
    print(f"head ({vocab}, {dim}) f32; ratio = time / donated x*0.5 of the same array "
          f"(median of {args.calls} interleaved calls; median of {args.repeats} repeats)\n")
    rng = np.random.default_rng(0)
    floor = jax.jit(lambda x: x * 0.5, donate_argnums=0)
    for axis, shape in [(0, (vocab, dim)), (1, (dim, vocab))]:
        x0 = (rng.standard_normal(shape) + 0.1).astype(np.float32)
        tx = projected_rownorm(vocab_axis=axis)
        update = jax.jit(lambda u, tx=tx: tx.update(u, optax.EmptyState())[0],
                         donate_argnums=0)
        report(f"projected_rownorm {shape} vocab_axis={axis}", update, floor, x0,
               repeats=args.repeats, calls=args.calls)
        plain = jax.jit(lambda u, axis=axis: _project_f32(
            u, vocab_axis=axis, eps=1e-8, center_input=True, center_output=True,
            num_valid=None, argname="u", impl="reference"), donate_argnums=0)
        report("  straightforward XLA (accelerator path)", plain, floor, x0,
               repeats=args.repeats, calls=max(3, args.calls // 3))
    accuracy(rng, 4096, 256)


if __name__ == "__main__":
    main()
