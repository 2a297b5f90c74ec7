"""Draws the figures of docs/geometry.md (committed PNGs; rerun after changing this file).

    python -m studies.make_figures          # writes docs/figures/*.png

- ``common_ball.png``: the common-ball relaxation in 2-D. Left: a set of diameter rho that no
  ball of radius rho/2 contains (the equilateral triangle, the tight case of Jung's theorem).
  Right: a projected-RowNorm step; its rows lie on one circle of radius r, so D <= 2r.
- ``diameter_vs_vocab.png``: row diameter per unit RMS of Muon (polar factor), sign/Adam-like and
  RowNorm head steps on synthetic LM-head gradients, against the vocabulary size.
- ``approximation.png``: the guarantee sqrt((k+1)/(2k)) against k = rank(PG), with the exactly
  solved instances of ``docs/results/oracle_table.json`` (written by the head study) on top when
  that file exists.
"""

from __future__ import annotations

import json
import pathlib

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import rowgeom  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "figures"  # where the PNGs go
DPI = 110


def _circle(ax, centre, radius, **kwargs):
    ax.add_patch(plt.Circle(centre, radius, fill=False, **kwargs))


def common_ball() -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.5, 4.6))

    # Left: equilateral triangle of side rho = 2.
    rho = 2.0
    angles = np.pi / 2 + 2 * np.pi * np.arange(3) / 3
    tri = (rho / np.sqrt(3)) * np.stack([np.cos(angles), np.sin(angles)], axis=1)
    left.fill(tri[:, 0], tri[:, 1], color="tab:blue", alpha=0.12)
    left.scatter(tri[:, 0], tri[:, 1], color="tab:blue", zorder=3, label="rows $s_i$")
    _circle(left, (0, 0), rho / np.sqrt(3), color="tab:blue", lw=1.5,
            label=r"smallest ball: radius $\rho/\sqrt{3}$")
    _circle(left, (0, 0), rho / 2, color="tab:red", ls="--", lw=1.5,
            label=r"common ball of radius $\rho/2$")
    left.plot(*tri[[0, 1]].T, color="k", lw=1)
    left.annotate(r"$\|s_i - s_j\| = \rho$", tri[[0, 1]].mean(0), xytext=(-128, 8),
                  textcoords="offset points", fontsize=10)
    left.set_title("diameter $\\rho$, yet no ball of radius $\\rho/2$ holds it\n"
                   "(k = 2: the relaxation keeps $\\sqrt{3/4}$ of the optimum)", fontsize=10)

    # Right: a projected-RowNorm step of 7 token rows in 2-D, r = 1.
    rng = np.random.default_rng(3)
    g = rng.standard_normal((7, 2)) * np.array([1.5, 0.6])
    g[0] *= 0.15  # a rare token: tiny gradient, still a full-length row
    s = -np.asarray(rowgeom.rownorm_direction(g.astype(np.float32), vocab_axis=0), np.float64)
    pg = g - g.mean(0)
    centre = (pg / np.linalg.norm(pg, axis=1, keepdims=True)).mean(0)  # s_i = ū - u_i
    right.quiver(np.zeros(7), np.zeros(7), -pg[:, 0] * 0.5, -pg[:, 1] * 0.5, angles="xy",
                 scale_units="xy", scale=1, color="0.6", width=0.006,
                 label=r"$-(PG)_i$ (scaled)")
    right.scatter(s[:, 0], s[:, 1], color="tab:green", zorder=3, label="step rows $s_i$")
    _circle(right, centre, 1.0, color="tab:green", lw=1.5, label="common ball, radius $r$")
    pair = max(((i, j) for i in range(7) for j in range(i + 1, 7)),
               key=lambda ij: np.linalg.norm(s[ij[0]] - s[ij[1]]))
    diameter = np.linalg.norm(s[pair[0]] - s[pair[1]])
    right.plot(*s[list(pair)].T, color="k", lw=1, label=f"diameter D = {diameter:.2f} <= 2r")
    right.set_title("projected RowNorm, $r = 1$: $s_i = -r(u_i - \\bar u)$,\n"
                    "$\\|u_i\\| = 1$, so every row is on one circle", fontsize=10)

    for ax in (left, right):
        ax.set_aspect("equal")
        ax.set_xlim(-2.2, 2.2)
        ax.set_ylim(-2.2, 2.2)
        ax.axhline(0, color="0.9", lw=0.8, zorder=0)
        ax.axvline(0, color="0.9", lw=0.8, zorder=0)
        ax.legend(loc="lower left", fontsize=8, framealpha=0.9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(HERE / "common_ball.png", dpi=DPI)
    plt.close(fig)


def synthetic_head_gradient(rng, vocab: int, dim: int, tokens: int = 4096) -> np.ndarray:
    """``G = mean_n (p_n - e_{y_n}) h_nᵀ``, ``(V, d)``: Zipf targets, near-uniform predictions.

    Cross-entropy makes every column of G sum to zero (``1ᵀG = 0``), as for a real untied head.
    """
    ranks = np.arange(1, vocab + 1)
    zipf = 1.0 / ranks**1.1
    y = rng.choice(vocab, size=tokens, p=zipf / zipf.sum())
    h = rng.standard_normal((tokens, dim))
    logits = 0.5 * rng.standard_normal((tokens, vocab)) + np.log(zipf)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(tokens), y] -= 1.0
    return p.T @ h / tokens


def diameter_vs_vocab() -> None:
    rng = np.random.default_rng(0)
    dim = 128
    vocabs = [256, 512, 1024, 2048, 4096, 8192]
    ratios = {"Muon (polar factor)": [], "sign / Adam-like": [], "projected RowNorm": []}
    for vocab in vocabs:
        g = synthetic_head_gradient(rng, vocab, dim)
        u, _, vt = np.linalg.svd(g, full_matrices=False)
        steps = {"Muon (polar factor)": u @ vt, "sign / Adam-like": np.sign(g),
                 "projected RowNorm": np.asarray(
                         rowgeom.rownorm_direction(g.astype(np.float32), vocab_axis=0))}
        for name, step in steps.items():
            step = np.asarray(step, np.float32)
            rms = float(np.sqrt(np.mean(np.square(step, dtype=np.float64))))
            ratios[name].append(float(rowgeom.row_diameter(step, vocab_axis=0)) / rms)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (name, values), marker in zip(ratios.items(), "osD", strict=True):
        ax.plot(vocabs, values, marker=marker, label=name)
    v = np.array(vocabs, float)
    ax.plot(v, np.sqrt(2 * v), "k--", lw=1, label=r"$\sqrt{2V}$")
    ax.plot(v, np.full_like(v, 2 * np.sqrt(dim)), "k:", lw=1, label=r"$2\sqrt{d}$")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("vocabulary size V")
    ax.set_ylabel("row diameter / RMS of the step")
    ax.set_title(f"Head steps at equal RMS: how far can the softmax move? (d = {dim})",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", color="0.92")
    fig.tight_layout()
    fig.savefig(HERE / "diameter_vs_vocab.png", dpi=DPI)
    plt.close(fig)


def approximation() -> None:
    k = np.arange(1, 65)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(k, np.sqrt((k + 1) / (2 * k)), "-", label=r"$\sqrt{(k+1)/(2k)}$ (tight)")
    table = HERE.parent / "results" / "oracle_table.json"
    if table.exists():
        instances = json.loads(table.read_text())["instances"]
        ks = np.array([inst["k"] for inst in instances], float)
        ratios = np.array([inst["ratio"]["rownorm"] for inst in instances])
        jitter = np.exp(np.random.default_rng(0).uniform(-0.06, 0.06, len(ks)))
        ax.scatter(ks * jitter, ratios, s=10, color="tab:green", alpha=0.6, zorder=3,
                   label=f"projected RowNorm / exact OPT ({len(ks)} solved instances)")
    ax.axhline(1 / np.sqrt(2), color="k", ls="--", lw=1, label=r"$1/\sqrt{2}$")
    for kk in (1, 2, 20):
        val = np.sqrt((kk + 1) / (2 * kk))
        ax.annotate(f"k={kk}: {val:.4f}", (kk, val), xytext=(4, -14), textcoords="offset points",
                    fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0.65, 1.04)
    ax.set_xlabel(r"k = rank(PG)")
    ax.set_ylabel("worst-case decrease / OPT")
    ax.set_title("Projected RowNorm's guarantee against the exact diameter step", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", color="0.92")
    fig.tight_layout()
    fig.savefig(HERE / "approximation.png", dpi=DPI)
    plt.close(fig)


if __name__ == "__main__":
    common_ball()
    diameter_vs_vocab()
    approximation()
    print("wrote", ", ".join(sorted(p.name for p in HERE.glob("*.png"))))
