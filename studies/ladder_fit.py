"""Seed statistics and log-log least-squares fits with t-intervals, for the scale ladder
(`studies.scale_ladder`).

`seed_stats` summarises one cell's per-seed values (mean, sample standard deviation, n, standard
error); `beyond_spread` applies the ladder's rule for "a difference larger than the seed
spread" to per-seed paired differences.

A power law `y = c · x1^b1 · x2^b2 ...` is a linear model in logs: `log y = a + Σ b_k log x_k`.
`fit_loglog` solves it by ordinary least squares (numpy), with the classical covariance
`s² (XᵀX)⁻¹`, `s² = SSR / (n - p)`, and two-sided Student-t intervals on `n - p` degrees of
freedom; `predict` gives the fitted mean of `log y` at new shapes with its t-interval (the
interval of the trend, not of a single new run), returned in linear units. Every seed is one
observation (per-cell means are never fitted: a cell with more seeds weighs more, and seed noise
enters the residual variance).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

LEVEL = 0.95
SPREAD_SE = 2.0  # `beyond_spread`: |mean| must exceed this many standard errors


def seed_stats(values) -> dict:
    """Mean, sample standard deviation (ddof 1), n and standard error std/√n of per-seed values.

    Returns {"values", "n", "mean", "std", "se"}; with one value std and se are None (no
    spread is measured), with none every statistic is None. A non-finite value (a diverged
    run) makes mean, std and se None: no finite summary of such a cell exists.

    >>> seed_stats([1.0, 3.0])["std"] == 2 ** 0.5
    True
    """
    xs = np.asarray(values, np.float64).reshape(-1)
    out = {"values": xs.tolist(), "n": int(xs.size), "mean": None, "std": None, "se": None}
    if xs.size == 0 or not np.all(np.isfinite(xs)):
        return out
    out["mean"] = float(xs.mean())
    if xs.size > 1:
        out["std"] = float(xs.std(ddof=1))
        out["se"] = out["std"] / math.sqrt(xs.size)
    return out


def beyond_spread(diffs, *, k: float = SPREAD_SE) -> dict:
    """Whether per-seed paired differences are larger than their seed spread.

    The rule: with n >= 2 seeds, a difference is *larger than the seed spread* when every
    per-seed difference is non-zero and has the sign of their mean, and |mean| > k·se
    (se = std/√n, k = 2 by default); otherwise it is *within* the spread. With one seed no spread
    is measured (verdict "one seed"); a non-finite difference gives "not finite". This is a
    screen for 2-3 seeds, not a significance test (a two-sided 95 % t-test would need
    |mean| > 12.7·se with 2 seeds, 4.3·se with 3).

    Returns `seed_stats(diffs)` plus {"verdict": "larger" | "within" | "one seed" |
    "not finite" | "no data", "same_sign": bool | None, "k": k}.

    >>> beyond_spread([0.10, 0.12, 0.11])["verdict"], beyond_spread([0.1, -0.1])["verdict"]
    ('larger', 'within')
    """
    out = seed_stats(diffs) | {"k": k, "same_sign": None}
    xs = np.asarray(out["values"], np.float64)
    if xs.size == 0:
        return out | {"verdict": "no data"}
    if out["mean"] is None:
        return out | {"verdict": "not finite"}
    if xs.size == 1:
        return out | {"verdict": "one seed"}
    same = bool(out["mean"] != 0 and np.all(np.sign(xs) == np.sign(out["mean"])))
    larger = same and abs(out["mean"]) > k * out["se"]
    return out | {"same_sign": same, "verdict": "larger" if larger else "within"}


def fit_loglog(features: dict[str, np.ndarray], y, *, level: float = LEVEL) -> dict:
    """OLS of `log y` on `log` of each feature (plus an intercept).

    features: name -> positive values, one per observation; y: positive values.
    Returns {"names", "coef" (intercept first), "cov", "dof", "s", "n", "level",
    "slopes": {name: {"value", "ci": [lo, hi], "se"}}}. Raises ValueError on non-positive or
    non-finite data, or when there are not more observations than parameters (no interval).
    """
    y = np.asarray(y, np.float64)
    names = list(features)
    cols = [np.asarray(features[k], np.float64) for k in names]
    for name, col in zip(["y", *names], [y, *cols], strict=True):
        if col.shape != y.shape or col.ndim != 1:
            raise ValueError(f"{name} must be a 1-D array of length {y.size}, got {col.shape}")
        if not np.all(np.isfinite(col)) or np.any(col <= 0):
            raise ValueError(f"{name} must be finite and positive for a log-log fit")
    n, p = y.size, len(names) + 1
    if n <= p:
        raise ValueError(f"a fit with {p} parameters needs more than {p} observations, got {n}")
    X = np.column_stack([np.ones(n), *(np.log(c) for c in cols)])
    if np.linalg.matrix_rank(X) < p:
        raise ValueError(f"the features {names} do not vary independently: no unique fit")
    coef, *_ = np.linalg.lstsq(X, np.log(y), rcond=None)
    resid = np.log(y) - X @ coef
    dof = n - p
    s2 = float(resid @ resid) / dof
    cov = s2 * np.linalg.inv(X.T @ X)
    t = float(stats.t.ppf(0.5 + level / 2, dof))
    slopes = {}
    for i, name in enumerate(names, start=1):
        se = float(np.sqrt(cov[i, i]))
        slopes[name] = {"value": float(coef[i]), "se": se,
                        "ci": [float(coef[i] - t * se), float(coef[i] + t * se)]}
    return {"names": names, "coef": coef.tolist(), "cov": cov.tolist(), "dof": dof,
            "s": float(np.sqrt(s2)), "n": n, "level": level, "slopes": slopes}


def predict(fit: dict, at: dict[str, float]) -> dict:
    """Fitted value of y at the feature values `at`, with the t-interval of the fitted mean."""
    x = np.array([1.0, *(np.log(float(at[k])) for k in fit["names"])])
    coef, cov = np.asarray(fit["coef"]), np.asarray(fit["cov"])
    mean = float(x @ coef)
    se = float(np.sqrt(x @ cov @ x))
    t = float(stats.t.ppf(0.5 + fit["level"] / 2, fit["dof"]))
    return {"value": float(np.exp(mean)), "ci": [float(np.exp(mean - t * se)),
                                                 float(np.exp(mean + t * se))]}


def count_spikes(losses, *, window: int = 5, jump: float = 0.25, rel: float = 0.05,
                 z: float = 4.0) -> int:
    """Onsets of loss spikes in a logged training-loss series.

    A point spikes when it exceeds the median of the `window` points before it by more than
    `max(jump, rel · median, z · noise)` nats, where `noise` is the series' own mini-batch
    noise (1.4826 × the median absolute excess over that running median, a robust standard
    deviation); consecutive spiking points count once. A non-finite loss counts as a spike (and
    the run as diverged, see `diverged`). Without the noise term, small batches' ordinary
    ±0.3-nat scatter counted 3-9 "spikes" in every healthy 100-step ladder run.
    """
    xs = np.asarray(losses, np.float64)
    refs = np.full(xs.size, np.inf)
    for i in range(window, xs.size):
        prev = xs[i - window:i][np.isfinite(xs[i - window:i])]
        refs[i] = float(np.median(prev)) if prev.size else np.inf
    excess = xs - refs
    finite = excess[np.isfinite(excess)]
    noise = 1.4826 * float(np.median(np.abs(finite))) if finite.size else 0.0
    count, inside = 0, False
    for i in range(window, xs.size):
        spike = bool(not np.isfinite(xs[i])
                     or excess[i] > max(jump, rel * abs(refs[i]), z * noise))
        count += int(spike and not inside)
        inside = spike
    return count


def diverged(val_losses, vocab: int | None = None) -> bool:
    """A run diverged when its final validation loss is not finite, above its first one, or
    (given the vocabulary size) at or above ``ln(vocab)``, the loss of predicting every token
    uniformly: a model there has learned nothing, even if it got there from a worse start."""
    xs = np.asarray(val_losses, np.float64)
    if xs.size == 0 or not np.isfinite(xs[-1]) or xs[-1] > xs[0]:
        return True
    return bool(vocab is not None and xs[-1] >= math.log(vocab))
