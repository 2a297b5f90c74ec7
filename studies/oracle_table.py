"""Certified first-order decrease of head steps against the exact diameter optimum (small V).

    python -m studies.oracle_table          # writes docs/results/oracle_table.{md,json}

For each instance ``G`` (zero-sum over the vocabulary, as a cross-entropy gradient of an untied
head is) the exact steepest-descent value under the row diameter,
``OPT(rho) = max <-G, S> s.t. D(S) <= rho``, is solved in float64 by
`rowgeom.testing.diameter_oracle` (a second-order cone program, clarabel). Every candidate step
is evaluated in float64 numpy as
``<-G, S> / OPT(rho)`` at the same diameter budget ``rho`` (arXiv 2608.22253; maths in
docs/geometry.md):

- projected RowNorm ``S = -(rho/2) P rownorm(P G)``: ``D(S) <= rho`` (radius rho/2); Theorem 3
  guarantees ``sqrt((k+1)/(2k)) <= ratio <= 1`` with ``k = rank(PG)``;
- rescaled projected RowNorm ``S · rho / D(S)``: the whole budget (``D = rho`` exactly);
- Muon ``-polar(G)`` (exact, by SVD) and sign ``-sign(G)`` (AdamW without momentum is close to
  it), each scaled to ``D = rho`` ("decrease per unit of diameter").

The row "regular simplex" is the worst case of Theorem 3 (rows of ``G`` at the vertices of a
regular k-simplex), where RowNorm's ratio equals the bound.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import rowgeom
import rowgeom.testing

RHO = 2.0
METHODS = ("rownorm", "rownorm_rescaled", "muon", "sign")
LABEL = {"rownorm": "projected RowNorm", "rownorm_rescaled": "RowNorm rescaled",
         "muon": "Muon (polar)", "sign": "sign"}


def diameter(s) -> float:
    """Exact row diameter in float64 (brute force over all pairs)."""
    s = np.asarray(s, np.float64)
    sq = np.sum(s * s, axis=1)
    d2 = sq[:, None] + sq[None, :] - 2.0 * s @ s.T
    return float(np.sqrt(max(d2.max(), 0.0)))


def jung(k: int) -> float:
    return float(np.sqrt((k + 1) / (2 * k)))


def steps(g: np.ndarray, rho: float) -> dict[str, np.ndarray]:
    """The candidate steps for a zero-sum float64 gradient `g`, each with D(step) <= rho."""
    pg = g - g.mean(axis=0)
    norms = np.linalg.norm(pg, axis=1, keepdims=True)
    u = np.where(norms > 0, pg / np.where(norms > 0, norms, 1.0), 0.0)
    rn = -(rho / 2) * (u - u.mean(axis=0))
    u_svd, _, vt = np.linalg.svd(g, full_matrices=False)
    out = {"rownorm": rn}
    for name, s in (("rownorm_rescaled", rn), ("muon", -(u_svd @ vt)), ("sign", -np.sign(g))):
        out[name] = s * (rho / diameter(s))
    return out


SHAPES = ((6, 3), (10, 4), (16, 8), (24, 12), (32, 16))
SIMPLEX_KS = (1, 2, 3, 5, 8, 12, 20)


def instances(rng: np.random.Generator, per_structure: int, shapes=SHAPES, simplex_ks=SIMPLEX_KS):
    """(structure name, zero-sum G) pairs: random families and the regular simplex."""
    def zero_sum(g):
        return g - g.mean(axis=0)

    def lm_like(v, d):  # sum over positions of (softmax - onehot) h^T, Zipf-distributed targets
        n = 4 * v
        h = rng.normal(size=(n, d))
        logits = rng.normal(size=(n, v)) * 2.0
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        zipf = 1.0 / np.arange(1, v + 1)
        y = rng.choice(v, size=n, p=zipf / zipf.sum())
        p[np.arange(n), y] -= 1.0
        return p.T @ h / n

    families = {
        "gaussian": lambda v, d: rng.normal(size=(v, d)),
        "rank 1": lambda v, d: rng.normal(size=(v, 1)) @ rng.normal(size=(1, d)),
        "rank 2": lambda v, d: rng.normal(size=(v, 2)) @ rng.normal(size=(2, d)),
        "heavy rows (Zipf row scales)": lambda v, d: rng.normal(size=(v, d))
        / np.arange(1, v + 1)[:, None],
        "LM-like (softmax − onehot)·hᵀ": lm_like,
    }
    for name, make in families.items():
        for v, d in shapes:
            for _ in range(per_structure):
                yield name, zero_sum(make(v, d))
    for k in simplex_ks:
        yield "regular simplex", zero_sum(np.eye(k + 1))


def row_space(g: np.ndarray, k: int) -> np.ndarray:
    """`g` in coordinates of its k-dimensional row space: the same OPT(rho), better conditioned.

    For any feasible S, its projection S·Q·Qᵀ onto the row space (Q: orthonormal basis) keeps
    ⟨-G, S⟩ and, projection being non-expansive, stays feasible; so the optimum lies in the row
    space. The solver otherwise stalls ("AlmostSolved") on the flat optimal faces of low-rank G.
    """
    q = np.linalg.svd(g, full_matrices=False)[2][:k].T
    return g @ q


def build_table(per_structure: int = 5, seed: int = 0, shapes=SHAPES,
                simplex_ks=SIMPLEX_KS) -> dict:
    rng = np.random.default_rng(seed)
    rows, failed = [], []
    for name, g in instances(rng, per_structure, shapes, simplex_ks):
        g = g / np.linalg.norm(g)  # every ratio is scale invariant; helps the solver
        k = int(np.linalg.matrix_rank(g))
        try:
            _, opt = rowgeom.testing.diameter_oracle(row_space(g, k), RHO)
        except RuntimeError as err:  # not certified optimal: reported, never used as a value
            failed.append({"structure": name, "V": g.shape[0], "d": g.shape[1], "k": k,
                           "error": str(err)})
            continue
        cand = steps(g, RHO)
        ratios = {m: float(-np.sum(g * s) / opt) for m, s in cand.items()}
        diam = {m: diameter(s) for m, s in cand.items()}
        rows.append({"structure": name, "V": g.shape[0], "d": g.shape[1], "k": k, "opt": opt,
                     "bound": jung(k), "ratio": ratios, "diameter": diam})
    return {"rho": RHO, "per_structure": per_structure, "seed": seed,
            "shapes": [list(x) for x in shapes], "instances": rows,
            "uncertified": failed}


def markdown(table: dict) -> str:
    rows = table["instances"]
    lines = ["# Certified oracle table: first-order decrease ÷ exact optimum", "",
             "Generated by `python -m studies.oracle_table`. Each ratio is ⟨−G, S⟩ / OPT(ρ) with "
             f"ρ = {table['rho']:g}, OPT solved exactly by `rowgeom.testing.diameter_oracle` "
             "(float64, clarabel SOCP) on zero-sum G (an untied head's cross-entropy gradient is "
             "zero-sum). "
             "RowNorm uses radius ρ/2; the rescaled variant, Muon and sign are scaled to D = ρ. "
             "Bound: Theorem 3, sqrt((k+1)/(2k)) with k = rank(PG). "
             f"{table['per_structure']} random instances per structure and shape (V, d) in "
             f"{', '.join(f'({v}, {d})' for v, d in table['shapes'])}.", "",
             "## Random instances: ratio min / mean / max", "",
             "| structure | n | k range | bound (worst k) | " + " | ".join(
                 LABEL[m] for m in METHODS) + " |",
             "|---|---|---|---|" + "---|" * len(METHODS)]
    names = list(dict.fromkeys(r["structure"] for r in rows if r["structure"] != "regular simplex"))
    for name in names:
        group = [r for r in rows if r["structure"] == name]
        ks = [r["k"] for r in group]
        cells = []
        for m in METHODS:
            x = np.array([r["ratio"][m] for r in group])
            cells.append(f"{x.min():.4f} / {x.mean():.4f} / {x.max():.4f}")
        lines.append(f"| {name} | {len(group)} | {min(ks)}–{max(ks)} | "
                     f"{min(r['bound'] for r in group):.4f} | " + " | ".join(cells) + " |")
    lines += ["", "## Regular simplex (Theorem 3's worst case)", "",
              "| V | d | k | bound sqrt((k+1)/(2k)) | " + " | ".join(
                  LABEL[m] for m in METHODS) + " |",
              "|---|---|---|---|" + "---|" * len(METHODS)]
    for r in (r for r in rows if r["structure"] == "regular simplex"):
        lines.append(f"| {r['V']} | {r['d']} | {r['k']} | {r['bound']:.4f} | " + " | ".join(
            f"{r['ratio'][m]:.4f}" for m in METHODS) + " |")
    rn = rows
    below = sum(r["ratio"]["rownorm"] < r["bound"] * (1 - 1e-6) for r in rn)
    above = sum(max(r["ratio"].values()) > 1 + 1e-6 for r in rn)
    worst = min(r["ratio"]["rownorm"] / r["bound"] for r in rn)
    max_d = max(r["diameter"]["rownorm"] for r in rn)
    rescaled_ok = all(r["ratio"]["rownorm_rescaled"] >= r["ratio"]["rownorm"] - 1e-12 for r in rn)
    lines += ["", "## Checks", "",
              f"- {len(table['uncertified'])} further instances where clarabel did not report "
              "an optimal solution are left out (listed in oracle_table.json).",
              f"- {len(rn)} instances; projected RowNorm below the Theorem 3 bound: {below}; "
              f"any method above the exact optimum (ratio > 1 + 1e-6): {above}.",
              f"- Smallest RowNorm ratio ÷ its bound: {worst:.6f} (1 = the bound is attained).",
              f"- Largest D(RowNorm step) / ρ: {max_d / table['rho']:.6f} (≤ 1 by Theorem 2).",
              f"- Rescaled ≥ plain RowNorm on every instance: {rescaled_ok}.",
              f"- Wall time: {table.get('wall_s', float('nan')):.0f} s.", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--per_structure", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    table = build_table(args.per_structure, args.seed)
    table["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "oracle_table.json").write_text(json.dumps(table, indent=1))
    (out / "oracle_table.md").write_text(markdown(table))
    print(f"{len(table['instances'])} instances in {table['wall_s']:.0f} s -> {out}")
    return table


if __name__ == "__main__":
    main()
