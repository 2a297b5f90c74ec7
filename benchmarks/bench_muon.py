"""Muon orthogonalization: rowgeom.muon_orthogonalize vs optax 0.2.8, side by side in one run.

Workload: the hidden matrices of a small LM (d=256, 4 layers: q, k, v, o (d, d); MLP gate, up
(d, 4d); down (4d, d); 28 fp32 leaves), jitted, 5 Newton–Schulz steps, Keller coefficients, the
same eps. Compared like with like:

1. orthogonalization only: optax `orthogonalize_via_newton_schulz` mapped over the leaves vs
   `muon_orthogonalize(scale=None)` (the bare polar factors; results agree to ~1e-6), plus
   `rowgeom.newton_schulz` per leaf (no grouping) to separate the two effects;
2. the whole transform with a momentum buffer: `optax.contrib.scale_by_muon(beta=0.95,
   nesterov=False)` vs `optax.chain(optax.ema(0.95, debias=True), muon_orthogonalize(scale=None))`
   (both: EMA + bias correction + orthogonalization).

Timings are medians over interleaved repetitions (machines are noisy: 20–40 % run to run).
Ratio = rowgeom / optax; < 1 means rowgeom is faster. Run: `python benchmarks/bench_muon.py`
(`--quick` for a small smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import _muon as optax_muon

import rowgeom

EPS = 1e-7
KELLER = (3.4445, -4.7750, 2.0315)


def lm_hidden_params(d: int, layers: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d),
              "gate": (d, 4 * d), "up": (d, 4 * d), "down": (4 * d, d)}
    return {f"layer{i}": {name: jnp.asarray(rng.standard_normal(s), jnp.float32)
                          for name, s in shapes.items()}
            for i in range(layers)}


def timeit(fn, args, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times


def compare(name: str, candidates: dict, reps: int) -> dict:
    """Compiles each candidate, then times them interleaved; returns median seconds."""
    for fn, args in candidates.values():
        jax.block_until_ready(fn(*args))  # compile + warm up
        jax.block_until_ready(fn(*args))
    samples = {k: [] for k in candidates}
    for _ in range(reps):
        for k, (fn, args) in candidates.items():
            samples[k] += timeit(fn, args, 1)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    print(f"\n{name}")
    for k, t in medians.items():
        print(f"  {k:<44s} {t * 1e3:9.2f} ms")
    return medians


def measure(d: int, layers: int, reps: int) -> dict:
    """Both comparisons on the hidden matrices of a (d, layers) LM; medians in seconds.

    Returns ``{"ortho": {name: s}, "full": {name: s}, "ortho_err": float, "full_err": float,
    "ratio_ortho": float, "ratio_ortho_per_leaf": float, "ratio_full": float}`` (ratios are
    rowgeom / optax).
    """
    grads = lm_hidden_params(d, layers)

    # 1. Orthogonalization only.
    coeffs = jnp.asarray(KELLER)
    optax_ortho = jax.jit(lambda g: jax.tree.map(
            lambda x: optax_muon.orthogonalize_via_newton_schulz(x, coeffs, 5, eps=EPS), g))
    ours_tx = rowgeom.muon_orthogonalize(ns_steps=5, ns_coeffs="keller", eps=EPS, scale=None)
    ours_ortho = jax.jit(lambda g: ours_tx.update(g, optax.EmptyState())[0])
    per_leaf = jax.jit(lambda g: jax.tree.map(
            lambda x: rowgeom.newton_schulz(x, steps=5, coeffs="keller", eps=EPS), g))

    a, b = optax_ortho(grads), ours_ortho(grads)
    err = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                             jax.tree.leaves(b), strict=True))
    t1 = compare("1. orthogonalization only", {
            "optax orthogonalize_via_newton_schulz": (optax_ortho, (grads,)),
            "rowgeom muon_orthogonalize(scale=None)": (ours_ortho, (grads,)),
            "rowgeom newton_schulz per leaf (no grouping)": (per_leaf, (grads,)),
    }, reps)
    print(f"  max |optax - rowgeom| = {err:.2e}")

    # 2. Whole transform with EMA momentum (beta=0.95, no Nesterov, bias-corrected in both).
    dims = jax.tree.map(lambda _: optax_muon.MuonDimensionNumbers(), grads)
    optax_tx = optax.contrib.scale_by_muon(ns_coeffs=KELLER, ns_steps=5, beta=0.95, eps=EPS,
                                           nesterov=False, weight_dimension_numbers=dims)
    ours_full = optax.chain(optax.ema(0.95, debias=True), ours_tx)
    optax_state, ours_state = optax_tx.init(grads), ours_full.init(grads)
    optax_step = jax.jit(optax_tx.update)
    ours_step = jax.jit(ours_full.update)
    u_optax, _ = optax_step(grads, optax_state)
    u_ours, _ = ours_step(grads, ours_state)
    err2 = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(
            jax.tree.leaves(u_optax), jax.tree.leaves(u_ours), strict=True))
    t2 = compare("2. momentum + orthogonalization (one update step)", {
            "optax scale_by_muon(beta=0.95, nesterov=False)": (optax_step, (grads, optax_state)),
            "rowgeom chain(ema(0.95), muon_orthogonalize)": (ours_step, (grads, ours_state)),
    }, reps)
    print(f"  max |optax - rowgeom| = {err2:.2e}")

    base = t1["optax orthogonalize_via_newton_schulz"]
    return {
        "ortho": t1, "full": t2, "ortho_err": err, "full_err": err2,
        "ratio_ortho": t1["rowgeom muon_orthogonalize(scale=None)"] / base,
        "ratio_ortho_per_leaf": t1["rowgeom newton_schulz per leaf (no grouping)"] / base,
        "ratio_full": (t2["rowgeom chain(ema(0.95), muon_orthogonalize)"]
                       / t2["optax scale_by_muon(beta=0.95, nesterov=False)"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="d=128, 2 layers, few reps")
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    d, layers, reps = (128, 2, 5) if args.quick else (args.d, args.layers, args.reps)

    print(f"jax {jax.__version__}, optax {optax.__version__}, backend {jax.default_backend()}, "
          f"d={d}, layers={layers}, {7 * layers} matrices, 5 NS steps (keller), reps={reps}")
    result = measure(d, layers, reps)
    print("\nratios rowgeom / optax (target <= 0.8):")
    print(f"  orthogonalization only, grouped     {result['ratio_ortho']:.2f}x")
    print(f"  orthogonalization only, per leaf    {result['ratio_ortho_per_leaf']:.2f}x")
    print(f"  momentum + orthogonalization        {result['ratio_full']:.2f}x")


if __name__ == "__main__":
    main()
