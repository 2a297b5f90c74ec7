"""Exact row diameter against a plain-XLA matmul, measured side by side; the bracket's tightness.

- Exact ``row_diameter`` (triangular scan over row-block pairs) against a plain jitted float32
  matmul doing the same number of *useful* FLOPs, ``V(V+1)/2 * d * 2`` (one multiply-add per
  unordered token pair and feature; the diagonal blocks and padding the scan also computes are
  counted as overhead, not work). The floor is one ``(m, K) @ (K, m)`` GEMM, ``m = 4096``
  (``m ~ K`` at small sizes), ``K`` matching that count: peak GEMM speed with a small output.
- ``row_diameter_bounds`` (centroid bracket + 2 farthest-point sweeps): how close its ends are
  to the exact ``D``. Its time against the memory floor is measured in the steady state with
  the other O(Vd) head operations by ``bench_rownorm.py``.

Machines are noisy: each timing is the minimum of ``--repeats`` runs, candidates interleaved.

    python benchmarks/bench_row_diameter.py            # (50304, 768) and (32768, 512)
    python benchmarks/bench_row_diameter.py --quick    # small sizes
    python benchmarks/bench_row_diameter.py --docs     # also rewrite its block of the docs
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import provenance

import rowgeom
from rowgeom._geometry import _block_rows

BLOCK = "row_diameter"  # the generated block of docs/benchmarks.md (a run_all.py section)
COMMAND = "python benchmarks/bench_row_diameter.py --docs"

GEMM_ROWS = 4096


def _time(fn, make_args, repeats):
    """Minimum (wall, process CPU) seconds of ``fn(*make_args())``, args made outside the timing.

    CPU time is the steadier efficiency measure on a shared machine: other processes stretch
    the wall clock but not the cycles this process spends.
    """
    jax.block_until_ready(fn(*make_args()))  # compile
    wall = cpu = float("inf")
    for _ in range(repeats):
        args = jax.block_until_ready(make_args())
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall, cpu


def bench(num_rows, dim, *, block_size, repeats):
    key_x, key_a, key_b = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key_x, (num_rows, dim), jnp.float32) * 0.01 + 0.3
    useful = num_rows * (num_rows + 1) / 2 * dim * 2
    # Square-ish small sizes, else m = 4096 and a long K: compute-bound, small output.
    rows = min(GEMM_ROWS, max(256, round((useful / 2) ** (1 / 3) / 256) * 256))
    depth = max(1, round(useful / (2 * rows * rows)))
    a = jax.random.normal(key_a, (rows, depth), jnp.float32)
    b = jax.random.normal(key_b, (depth, rows), jnp.float32)
    gemm = jax.jit(lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST))
    gemm_flops = 2 * rows * rows * depth

    exact = jax.jit(lambda x: rowgeom.row_diameter(x, vocab_axis=0, block_size=block_size))
    bounds = jax.jit(lambda x: rowgeom.row_diameter_bounds(x, vocab_axis=0))

    t_exact = t_gemm = (float("inf"), float("inf"))
    for _ in range(repeats):  # interleave the two compute-bound runs: load drifts
        t_exact = tuple(map(min, t_exact, _time(exact, lambda: (x,), 1)))
        t_gemm = tuple(map(min, t_gemm, _time(gemm, lambda: (a, b), 1)))

    d_exact = float(exact(x))
    lower, upper = (float(v) for v in bounds(x))
    block, num_blocks = _block_rows(num_rows, block_size)
    print(f"\n(V, d) = ({num_rows}, {dim}), block_size={block_size} -> {num_blocks} blocks of "
          f"{block} rows")
    for label, k in (("wall", 0), ("cpu ", 1)):
        print(f"  {label} exact row_diameter {t_exact[k]:8.3f} s "
              f"{useful / t_exact[k] / 1e9:6.1f} GFLOP/s useful | f32 GEMM {rows}x{depth}x{rows} "
              f"{t_gemm[k]:8.3f} s {gemm_flops / t_gemm[k] / 1e9:6.1f} GFLOP/s | ratio "
              f"{(useful / t_exact[k]) / (gemm_flops / t_gemm[k]):.2f}")
    print(f"  D = {d_exact:.6g}; lower/D = {lower / d_exact:.4f}, upper/D = {upper / d_exact:.4f}")
    # For benchmarks/run_all.py (wall times; "vs" values are rowgeom relative to the floor).
    return dict(vocab=num_rows, dim=dim, block=block, exact_seconds=t_exact[0],
                gemm_seconds=t_gemm[0], gemm_gflops=gemm_flops / t_gemm[0] / 1e9,
                exact_gflops=useful / t_exact[0] / 1e9,
                exact_vs_gemm=(useful / t_exact[0]) / (gemm_flops / t_gemm[0]),
                diameter=d_exact, lower_over_d=lower / d_exact, upper_over_d=upper / d_exact)


def run(sizes, *, repeats: int, block_size: int = 1024) -> dict:
    """`bench` at each ``(V, d)`` of ``sizes``, with the run's provenance."""
    env = provenance.environment(provenance.load_average())
    rows = [bench(v, d, block_size=block_size, repeats=repeats) for v, d in sizes]
    return dict(rows=rows, environment=provenance.finish(env))


def markdown(results: dict, command: str = COMMAND) -> str:
    lines = [provenance.header(command, results["environment"]), "",
             "### Row diameter: exact vs a matmul of the same FLOPs; the bracket's tightness", "",
             "Exact `row_diameter` (wall time, best of the repeats, interleaved with the GEMM) "
             "and the bracket's ends `row_diameter_bounds` (2 sweeps) over the exact diameter, "
             "on rows `0.3 + 0.01 * N(0, 1)`.", "",
             "| (V, d) | exact speed / GEMM speed (useful FLOP/s) | exact | GEMM GFLOP/s | "
             "bracket lower/D | bracket upper/D |",
             "|---|---|---|---|---|---|"]
    for row in results["rows"]:
        seconds = row["exact_seconds"]
        time_ = f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"
        lines.append(f"| {(row['vocab'], row['dim'])} | **{row['exact_vs_gemm']:.2f}x** | "
                     f"{time_} | {row['gemm_gflops']:.0f} | {row['lower_over_d']:.4f} | "
                     f"{row['upper_over_d']:.4f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=1024)
    provenance.add_arguments(parser, BLOCK)
    args = parser.parse_args()
    sizes = [(4096, 256), (2048, 512)] if args.quick else [(32768, 512), (50304, 768)]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {jax.device_count()} device(s)")
    results = run(sizes, repeats=args.repeats, block_size=args.block_size)
    provenance.publish(args, BLOCK, markdown(results), results)


if __name__ == "__main__":
    main()
