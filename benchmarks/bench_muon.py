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

Timed in the steady state, as in training: each jitted function has its inputs donated and is
applied to its own previous output (``y = f(y)``; for a step, ``(updates, state) -> (updates,
state)``), so no call page-faults a fresh buffer; the candidates are interleaved call by call
and each keeps its best of ``--reps`` (also reported: the median). Machines are noisy from run
to run: compare the ratios. Ratio = rowgeom / optax; < 1 means rowgeom is faster.

    python benchmarks/bench_muon.py            # d=256, 4 layers
    python benchmarks/bench_muon.py --quick    # a small smoke run
    python benchmarks/bench_muon.py --docs     # also rewrite its block of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import provenance
from optax.contrib import _muon as optax_muon

import rowgeom

BLOCK = "muon"  # the generated block of docs/benchmarks.md
COMMAND = "python benchmarks/bench_muon.py --docs"

EPS = 1e-7
KELLER = (3.4445, -4.7750, 2.0315)


def lm_hidden_params(d: int, layers: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d),
              "gate": (d, 4 * d), "up": (d, 4 * d), "down": (4 * d, d)}
    return {f"layer{i}": {name: jnp.asarray(rng.standard_normal(s), jnp.float32)
                          for name, s in shapes.items()}
            for i in range(layers)}


def compare(name: str, candidates: dict, reps: int) -> dict:
    """Steady-state seconds per call: ``candidates`` maps a name to ``(fn, carry)`` with ``fn``
    jitted, its argument donated and ``fn(carry)`` shaped like ``carry``; each is applied to its
    own previous output, interleaved with the others. Returns ``{name: (best, median)}``."""
    carries = {}
    for key, (fn, carry) in candidates.items():  # compile, then one more call: steady state
        carries[key] = jax.block_until_ready(fn(jax.block_until_ready(fn(carry))))
    samples: dict[str, list[float]] = {k: [] for k in candidates}
    for _ in range(reps):
        for key, (fn, _) in candidates.items():
            t0 = time.perf_counter()
            carries[key] = jax.block_until_ready(fn(carries[key]))
            samples[key].append(time.perf_counter() - t0)
    times = {k: (min(v), statistics.median(v)) for k, v in samples.items()}
    print(f"\n{name}")
    for k, (best, median) in times.items():
        print(f"  {k:<48s} best {best * 1e3:9.2f} ms  median {median * 1e3:9.2f} ms")
    return times


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def measure(d: int, layers: int, reps: int) -> dict:
    """Both comparisons on the hidden matrices of a (d, layers) LM (seconds: the best call).

    Returns ``{"ortho": {name: s}, "full": {name: s}, "ortho_median": ..., "full_median": ...,
    "ortho_err": float, "full_err": float, "ratio_ortho": float, "ratio_ortho_per_leaf": float,
    "ratio_full": float}`` (ratios are rowgeom / optax, of the best calls).
    """
    grads = lm_hidden_params(d, layers)

    # 1. Orthogonalization only.
    coeffs = jnp.asarray(KELLER)
    optax_ortho = jax.jit(lambda g: jax.tree.map(
            lambda x: optax_muon.orthogonalize_via_newton_schulz(x, coeffs, 5, eps=EPS), g),
            donate_argnums=0)
    ours_tx = rowgeom.muon_orthogonalize(ns_steps=5, ns_coeffs="keller", eps=EPS, scale=None)
    ours_ortho = jax.jit(lambda g: ours_tx.update(g, optax.EmptyState())[0], donate_argnums=0)
    per_leaf = jax.jit(lambda g: jax.tree.map(
            lambda x: rowgeom.newton_schulz(x, steps=5, coeffs="keller", eps=EPS), g),
            donate_argnums=0)

    a, b = optax_ortho(_copy(grads)), ours_ortho(_copy(grads))
    err = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                             jax.tree.leaves(b), strict=True))
    t1 = compare("1. orthogonalization only (y = f(y), donated)", {
            "optax orthogonalize_via_newton_schulz": (optax_ortho, _copy(grads)),
            "rowgeom muon_orthogonalize(scale=None)": (ours_ortho, _copy(grads)),
            "rowgeom newton_schulz per leaf (no grouping)": (per_leaf, _copy(grads)),
    }, reps)
    print(f"  max |optax - rowgeom| = {err:.2e}")

    # 2. Whole transform with EMA momentum (beta=0.95, no Nesterov, bias-corrected in both).
    dims = jax.tree.map(lambda _: optax_muon.MuonDimensionNumbers(), grads)
    optax_tx = optax.contrib.scale_by_muon(ns_coeffs=KELLER, ns_steps=5, beta=0.95, eps=EPS,
                                           nesterov=False, weight_dimension_numbers=dims)
    ours_full = optax.chain(optax.ema(0.95, debias=True), ours_tx)

    def stepper(tx):  # (updates, state) -> (updates, state): the update fed back as the gradient
        return jax.jit(lambda carry: tx.update(*carry), donate_argnums=0)

    optax_step, ours_step = stepper(optax_tx), stepper(ours_full)
    u_optax, _ = optax_step((_copy(grads), optax_tx.init(grads)))
    u_ours, _ = ours_step((_copy(grads), ours_full.init(grads)))
    err2 = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(
            jax.tree.leaves(u_optax), jax.tree.leaves(u_ours), strict=True))
    t2 = compare("2. momentum + orthogonalization (one update step, donated)", {
            "optax scale_by_muon(beta=0.95, nesterov=False)": (
                optax_step, (_copy(grads), optax_tx.init(grads))),
            "rowgeom chain(ema(0.95), muon_orthogonalize)": (
                ours_step, (_copy(grads), ours_full.init(grads))),
    }, reps)
    print(f"  max |optax - rowgeom| (first step) = {err2:.2e}")

    best = lambda t: {k: v[0] for k, v in t.items()}  # noqa: E731
    median = lambda t: {k: v[1] for k, v in t.items()}  # noqa: E731
    t1b, t2b = best(t1), best(t2)
    base = t1b["optax orthogonalize_via_newton_schulz"]
    return {
        "ortho": t1b, "full": t2b, "ortho_median": median(t1), "full_median": median(t2),
        "ortho_err": err, "full_err": err2,
        "ratio_ortho": t1b["rowgeom muon_orthogonalize(scale=None)"] / base,
        "ratio_ortho_per_leaf": t1b["rowgeom newton_schulz per leaf (no grouping)"] / base,
        "ratio_full": (t2b["rowgeom chain(ema(0.95), muon_orthogonalize)"]
                       / t2b["optax scale_by_muon(beta=0.95, nesterov=False)"]),
    }


def run(d: int, layers: int, reps: int) -> dict:
    """`measure` with the run's provenance and its shape."""
    env = provenance.environment(provenance.load_average())
    results = measure(d, layers, reps)
    return dict(results, d=d, layers=layers, reps=reps, environment=provenance.finish(env))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def markdown(mu: dict, command: str = COMMAND) -> str:
    ortho, full = mu["ortho"], mu["full"]
    optax_ortho = ortho["optax orthogonalize_via_newton_schulz"]
    return "\n".join([
        provenance.header(command, mu["environment"]), "",
        f"### muon_orthogonalize vs optax (hidden matrices, d={mu['d']}, {mu['layers']} layers)",
        "", f"Steady state (donated, `y = f(y)`), interleaved, best of {mu['reps']} calls each; "
        "5 Newton–Schulz steps, Keller coefficients.", "",
        "| comparison | ratio rowgeom / optax | rowgeom | optax | max abs diff |",
        "|---|---|---|---|---|",
        f"| orthogonalization only (grouped) | **{mu['ratio_ortho']:.2f}x** | "
        f"{_ms(ortho['rowgeom muon_orthogonalize(scale=None)'])} | {_ms(optax_ortho)} | "
        f"{mu['ortho_err']:.1e} |",
        f"| orthogonalization only (per leaf) | {mu['ratio_ortho_per_leaf']:.2f}x | "
        f"{_ms(ortho['rowgeom newton_schulz per leaf (no grouping)'])} | {_ms(optax_ortho)} "
        "| |",
        f"| EMA momentum + orthogonalization vs `scale_by_muon` | **{mu['ratio_full']:.2f}x** | "
        f"{_ms(full['rowgeom chain(ema(0.95), muon_orthogonalize)'])} | "
        f"{_ms(full['optax scale_by_muon(beta=0.95, nesterov=False)'])} | "
        f"{mu['full_err']:.1e} |"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="d=128, 2 layers, few reps")
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=15)
    provenance.add_arguments(parser, BLOCK)
    args = parser.parse_args()
    d, layers, reps = (128, 2, 5) if args.quick else (args.d, args.layers, args.reps)

    print(f"jax {jax.__version__}, optax {optax.__version__}, backend {jax.default_backend()}, "
          f"d={d}, layers={layers}, {7 * layers} matrices, 5 NS steps (keller), reps={reps}")
    result = run(d, layers, reps)
    print("\nratios rowgeom / optax, best calls (target <= 0.8):")
    print(f"  orthogonalization only, grouped     {result['ratio_ortho']:.2f}x")
    print(f"  orthogonalization only, per leaf    {result['ratio_ortho_per_leaf']:.2f}x")
    print(f"  momentum + orthogonalization        {result['ratio_full']:.2f}x")
    provenance.publish(args, BLOCK, markdown(result), result)


if __name__ == "__main__":
    main()
