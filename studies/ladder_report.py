"""The scale ladder's report: tables, fits, predictions and figures from finished runs only.

`write_report` writes `scale_ladder.json`, `scale_ladder.md` and (when there is something to
draw) `scale_ladder_slopes.png` / `scale_ladder_robust.png`. Every number in the page is either
*measured* (over finished runs) or *predicted* (a fit's value at a shape no run had), and says
which. With no finished run the page says so and shows no number.

Seeds: every measured cell (protocol, point, head[, rate multiplier]) is summarised over its
seeds by `ladder_fit.seed_stats` (mean ± sample std, n). A reduction (baseline D or Hilbert
RMS ÷ RowNorm's) and a loss difference are formed per seed pair (same protocol, point and seed)
and then summarised, so their spread is the spread of the per-seed ratios, not one propagated
from the two heads' spreads. Fits and predictions use every per-seed point, never cell means.
Differences are judged against the seed spread by `ladder_fit.beyond_spread`.

A *baseline* (an earlier report's run records, `baseline_from_report`) adds its seeds per cell
to the coverage table and its reductions and predictions next to the current ones.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from studies import ladder_fit

LABEL = {"adamw": "AdamW", "muon": "Muon (RMS-matched)", "muon-spectral": "Muon (spectral)",
         "rownorm": "projected RowNorm"}
PROTOCOL_LABEL = {"equal": "(a) equal head rate", "tuned": "(b) tuned rate",
                  "matched": "(c) matched diameter", "robust": "(d) robustness grid"}
PER_LR = (("D_per_lr", "D ÷ lr"), ("hilbert_rms_per_lr", "Hilbert RMS ÷ lr"))
CELL_METRICS = ("D", "D_per_lr", "hilbert_rms", "hilbert_rms_per_lr", "final_val_loss")
BASELINES = ("adamw", "muon", "muon-spectral")
NEAR_BEST = 0.1  # nats: the robustness grid's "usable without further tuning" margin
# The fields of a run record that the report reads (a baseline keeps only these).
RECORD_FIELDS = ("point", "head", "lr", "seed", "protocol", "multiplier", "steps", "wall_s",
                 "final_val_loss", "D", "hilbert_rms", "D_per_lr", "hilbert_rms_per_lr",
                 "tightness", "loss_spikes", "diverged", "diameter_exact")


def _key(r):
    p = r["point"]
    return (p["d"], p["V"], p["layers"])


def _name(key):
    return f"d{key[0]}-V{key[1]}-L{key[2]}"


def _mult(m) -> str:
    return f"{m:.4g}"


def point_table(runs: list[dict]) -> dict:
    """{point: {head: {metric: seed_stats, "seeds", "lr", "diameter_exact"}}} (measured)."""
    groups = defaultdict(list)
    for r in runs:
        groups[(_key(r), r["head"])].append(r)
    out: dict = defaultdict(dict)
    for (key, head), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["seed"])
        out[_name(key)][head] = {
            "seeds": [r["seed"] for r in rs], "lr": sorted({r["lr"] for r in rs}),
            **{m: ladder_fit.seed_stats([r[m] for r in rs]) for m in CELL_METRICS},
            "tightness": ladder_fit.seed_stats([r["tightness"] for r in rs
                                                if r.get("tightness") is not None]),
            "diameter_exact": all(r["diameter_exact"] for r in rs)}
    return dict(out)


def ratio_stats(ratios) -> dict:
    """`seed_stats` of per-seed ratios, plus "vs_1": `beyond_spread` of their logs (does the
    ratio differ from 1 by more than the seed spread)."""
    xs = np.asarray(ratios, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.where(xs > 0, np.log(np.where(xs > 0, xs, 1.0)), np.nan)
    return ladder_fit.seed_stats(xs) | {"vs_1": ladder_fit.beyond_spread(logs)["verdict"]}


def reductions(runs: list[dict]) -> dict:
    """Per point and baseline head: per-seed-pair (same point, seed) ratios baseline ÷ RowNorm of
    D and Hilbert RMS (`ratio_stats`) and loss differences RowNorm − baseline
    (`ladder_fit.beyond_spread`)."""
    by = {(_key(r), r["seed"], r["head"]): r for r in runs}
    pairs: dict = defaultdict(lambda: defaultdict(list))
    for (key, seed, head), rn in sorted(by.items()):
        if head != "rownorm":
            continue
        for base in BASELINES:
            if (b := by.get((key, seed, base))) is not None:
                pairs[_name(key)][base].append((seed, b, rn))
    out: dict = defaultdict(dict)
    for point, bases in pairs.items():
        for base, rows in bases.items():
            out[point][base] = {
                "seeds": [s for s, _, _ in rows],
                "D": ratio_stats([b["D"] / rn["D"] for _, b, rn in rows]),
                "hilbert_rms": ratio_stats([b["hilbert_rms"] / rn["hilbert_rms"]
                                            for _, b, rn in rows]),
                "loss_delta": ladder_fit.beyond_spread(
                    [rn["final_val_loss"] - b["final_val_loss"] for _, b, rn in rows])}
    return dict(out)


def _fit_or_reason(features, y):
    """A log-log fit, or {"error": why not}. More distinct shapes than parameters are required
    (not only more runs): repeated seeds of too few shapes measure seed noise, not the power law."""
    cells = len({tuple(col) for col in zip(*features.values(), strict=True)})
    if cells <= len(features) + 1:
        return {"error": f"a fit with {len(features) + 1} parameters needs more than "
                         f"{len(features) + 1} distinct shapes, got {cells}"}
    try:
        fit = ladder_fit.fit_loglog(features, y)
    except ValueError as e:
        return {"error": str(e)}
    return fit | {"cells": cells}


def slope_fits(runs: list[dict], *, width_v: int, vocab_d: int) -> dict:
    """Per head and metric: slope vs d (at V = width_v), vs V (at d = vocab_d, 2 layers), each
    fitted to every per-seed run ("n" runs at "cells" distinct shapes)."""
    out = {}
    for head in sorted({r["head"] for r in runs}):
        mine = [r for r in runs if r["head"] == head and r["point"]["layers"] == 2]
        entry = {}
        for metric, _ in PER_LR:
            w = [r for r in mine if r["point"]["V"] == width_v]
            v = [r for r in mine if r["point"]["d"] == vocab_d]
            entry[metric] = {
                "vs_d": _fit_or_reason({"d": [r["point"]["d"] for r in w]}, [r[metric] for r in w]),
                "vs_V": _fit_or_reason({"V": [r["point"]["V"] for r in v]}, [r[metric] for r in v])}
        out[head] = entry
    return out


def predictions(runs: list[dict], shapes: dict) -> dict:
    """Per baseline: joint fit of the per-seed-pair reductions on (d, V), evaluated at `shapes`."""
    out = {}
    by = {(_key(r), r["seed"], r["head"]): r for r in runs}
    for base in BASELINES:
        rows = [(k, by[(k, s, base)], rn) for (k, s, h), rn in by.items()
                if h == "rownorm" and (k, s, base) in by]
        entry = {}
        for metric in ("D", "hilbert_rms"):
            fit = _fit_or_reason({"d": [k[0] for k, _, _ in rows], "V": [k[1] for k, _, _ in rows]},
                                 [b[metric] / rn[metric] for _, b, rn in rows])
            entry[metric] = {"fit": fit, "at": {} if "error" in fit else {
                name: ladder_fit.predict(fit, {"d": d, "V": V}) for name, (d, V) in shapes.items()}}
        out[base] = entry
    return out


def per_lr_predictions(runs: list[dict], shapes: dict) -> dict:
    """Per head: joint fit of its per-seed D ÷ lr and Hilbert RMS ÷ lr on (d, V) (every run of
    the protocol, the thin point included), evaluated at `shapes`."""
    out = {}
    for head in sorted({r["head"] for r in runs}):
        mine = [r for r in runs if r["head"] == head]
        entry = {}
        for metric, _ in PER_LR:
            fit = _fit_or_reason({"d": [r["point"]["d"] for r in mine],
                                  "V": [r["point"]["V"] for r in mine]},
                                 [r[metric] for r in mine])
            entry[metric] = {"fit": fit, "at": {} if "error" in fit else {
                name: ladder_fit.predict(fit, {"d": d, "V": V}) for name, (d, V) in shapes.items()}}
        out[head] = entry
    return out


# ----------------------------------------------------------------------------- the paper


def adam_ratio_bound(b1: float, b2: float, t: int | None = None) -> float:
    """The largest |m̂_t| ÷ √v̂_t that any gradient sequence gives one coordinate of Adam.

    With m_t = (1−β₁) Σ_k β₁^k g_{t−k} and v_t = (1−β₂) Σ_k β₂^k g²_{t−k}, Cauchy–Schwarz
    (β₁^k = (β₁/√β₂)^k · √β₂^k) gives |m_t| ≤ (1−β₁) √v_t / √((1−β₂)(1 − β₁²/β₂)) when
    β₁² < β₂; the bias corrections multiply the ratio by √(1−β₂^t) ÷ (1−β₁^t) at step t (1 when
    t is None, late in training), and a positive eps only lowers it. Equality: a gradient that
    grew like (β₁/β₂)^−k towards step t.

    >>> round(adam_ratio_bound(0.9, 0.95), 3), round(adam_ratio_bound(0.9, 0.999), 2)
    (1.165, 7.27)
    """
    if not b1 * b1 < b2:
        return float("inf")
    c = (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))
    return c if t is None else c * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)


def adamw_ceiling(d: int, b1: float, b2: float, t: int | None = None) -> float:
    """The largest D ÷ lr of an AdamW head step without its decoupled decay, at width d: every
    coordinate of the step is at most `adam_ratio_bound`·lr, a token row at most √d times that,
    and two rows at most twice one row's norm apart."""
    return 2 * math.sqrt(d) * adam_ratio_bound(b1, b2, t)


def paper(table: dict, recipe: dict) -> dict:
    """The paper's final-update values per model, computed from its published table.

    table: {model: {"d", "V", "updates", "peak_lr": {head: rate}, "D" / "hilbert_rms" /
    "val_loss": {head: (mean, sd)}}} (Tables 1-3); recipe: {"final_lr_fraction",
    "adamw_head": {"b1", "b2"}, ...} (Table 2). At the final update every rate is
    final_lr_fraction × its peak, so D ÷ lr there is Table 3's D ÷ (fraction × peak head rate).
    Per model: "final_lr", "D_per_lr" and "hilbert_rms_per_lr" ({head: {"mean", "sd"}}),
    "reduction" (Table 3's AdamW ÷ RowNorm ratio of means, at the paper's own head rates),
    "reduction_per_lr" (the same per unit of each head's rate: what an equal-rate comparison
    measures), "loss_delta" (RowNorm − AdamW means) and "adamw_ceiling" (`adamw_ceiling` with
    the paper's betas at the final update). Plus "width_slope": the OLS slope of the AdamW head's
    log D ÷ lr on log d over the models (with its interval when there are more than 2).
    """
    f = recipe["final_lr_fraction"]
    adam = recipe["adamw_head"]
    models = {}
    for name, m in table.items():
        final_lr = {h: lr * f for h, lr in m["peak_lr"].items()}
        per_lr = {metric: {h: {"mean": m[metric][h][0] / final_lr[h],
                               "sd": m[metric][h][1] / final_lr[h]} for h in final_lr}
                  for metric in ("D", "hilbert_rms")}
        models[name] = {
            "d": m["d"], "V": m["V"], "updates": m["updates"], "final_lr": final_lr,
            "D_per_lr": per_lr["D"], "hilbert_rms_per_lr": per_lr["hilbert_rms"],
            "reduction": {k: m[k]["adamw"][0] / m[k]["rownorm"][0] for k in ("D", "hilbert_rms")},
            "reduction_per_lr": {k: per_lr[k]["adamw"]["mean"] / per_lr[k]["rownorm"]["mean"]
                                 for k in ("D", "hilbert_rms")},
            "loss_delta": m["val_loss"]["rownorm"][0] - m["val_loss"]["adamw"][0],
            "adamw_ceiling": adamw_ceiling(m["d"], adam["b1"], adam["b2"], m["updates"])}
    widths = [m["d"] for m in models.values()]
    ys = [m["D_per_lr"]["adamw"]["mean"] for m in models.values()]
    slope = None
    if len(set(widths)) > 2:
        slope = ladder_fit.fit_loglog({"d": widths}, ys)["slopes"]["d"]
    elif len(set(widths)) == 2:
        slope = {"value": math.log(ys[-1] / ys[0]) / math.log(widths[-1] / widths[0])}
    return {"models": models, "width_slope": slope, "table": table, "recipe": recipe}


def robustness(runs: list[dict]) -> dict:
    """Per head and rate multiplier: final loss, spike onsets, divergences over seeds; the loss
    difference to the head's own 1× run and RowNorm − head at the same multiplier, per seed."""
    out: dict = defaultdict(dict)
    by = {(r["head"], _mult(r["multiplier"]), r["seed"]): r for r in runs}
    for r in sorted(runs, key=lambda r: (r["head"], r["multiplier"], r["seed"])):
        m = out[r["head"]].setdefault(_mult(r["multiplier"]), {
            "multiplier": r["multiplier"], "lr": r["lr"], "seeds": [], "spikes": [],
            "diverged": []})
        m["seeds"].append(r["seed"])
        m["spikes"].append(r["loss_spikes"])
        m["diverged"].append(r["diverged"])
    vs_rownorm: dict = defaultdict(dict)
    for head, rows in out.items():
        for mk, v in rows.items():
            loss = {s: by[(head, mk, s)]["final_val_loss"] for s in v["seeds"]}
            v["final_val_loss"] = ladder_fit.seed_stats(list(loss.values()))
            one = {s: by[(head, _mult(1.0), s)]["final_val_loss"] for s in v["seeds"]
                   if (head, _mult(1.0), s) in by}
            v["vs_tuned"] = (None if v["multiplier"] == 1.0 else
                             ladder_fit.beyond_spread([loss[s] - one[s] for s in one]))
            if head != "rownorm":
                rn = {s: by[("rownorm", mk, s)]["final_val_loss"] for s in v["seeds"]
                      if ("rownorm", mk, s) in by}
                if rn:
                    vs_rownorm[mk][head] = {"multiplier": v["multiplier"], "seeds": sorted(rn),
                                            **ladder_fit.beyond_spread(
                                                [rn[s] - loss[s] for s in sorted(rn)])}
    heads = {}
    for head, rows in out.items():
        stable = [v["multiplier"] for v in rows.values()
                  if not any(v["diverged"]) and not any(v["spikes"])]
        # Within NEAR_BEST nats of the head's best mean final loss: the rates a practitioner
        # could pick without tuning further (stable alone admits rates that barely learn).
        mean = {v["multiplier"]: v["final_val_loss"]["mean"] for v in rows.values()
                if v["final_val_loss"]["mean"] is not None}
        best = min(mean.values(), default=np.inf)
        near = [k for k, m in mean.items() if k in stable and m <= best + NEAR_BEST]
        heads[head] = {"rows": rows, "stable_multipliers": sorted(stable),
                       "near_best_multipliers": sorted(near), "near_best_nats": NEAR_BEST}
    return {"heads": heads, "rownorm_minus_head": dict(vs_rownorm)}


# ----------------------------------------------------------------------------- coverage


def _cell(protocol: str, r: dict) -> tuple:
    return (protocol, _name(_key(r)), _mult(r["multiplier"]) if protocol == "robust" else "",
            r["head"])


def cell_seeds(runs: dict) -> dict:
    """{(protocol, point, multiplier or "", head): sorted seeds} of finished runs (no sweep)."""
    out: dict = defaultdict(set)
    for protocol, rs in runs.items():
        if protocol in PROTOCOL_LABEL:
            for r in rs:
                out[_cell(protocol, r)].add(r["seed"])
    return {k: sorted(v) for k, v in out.items()}


def planned_seeds(ladder) -> dict:
    """{(protocol, point, multiplier or "", head): planned number of seeds} of `ladder`."""
    out = {}
    for p in ladder.points:
        for protocol in ("equal", "tuned", "matched"):
            if ladder.runs_protocol(protocol, p):
                for h in ladder.heads_at(p):
                    out[(protocol, p.name, "", h)] = len(ladder.seeds(p))
    if "robust" in ladder.protocols:
        for h in ladder.heads:
            for m in ladder.robust_multipliers:
                out[("robust", ladder.robust_point.name, _mult(m), h)] = len(ladder.robust_seeds)
    return out


def coverage(runs: dict, ladder, baseline_runs: dict | None = None) -> list[dict]:
    """Seeds per cell: planned, finished now and (given a baseline) finished before."""
    now, planned = cell_seeds(runs), planned_seeds(ladder)
    before = cell_seeds(baseline_runs) if baseline_runs is not None else {}
    order = {p.name: i for i, p in enumerate(ladder.points)}
    proto = {p: i for i, p in enumerate(PROTOCOL_LABEL)}

    def sort(k):
        return (proto[k[0]], order.get(k[1], len(order)), k[1], float(k[2] or 0),
                list(LABEL).index(k[3]) if k[3] in LABEL else len(LABEL))

    return [{"protocol": k[0], "point": k[1], "multiplier": k[2], "head": k[3],
             "planned": planned.get(k, 0), "now": now.get(k, []),
             "before": before.get(k, []) if baseline_runs is not None else None}
            for k in sorted(set(now) | set(planned) | set(before), key=sort)]


def baseline_from_report(report: dict, *, source: str) -> dict:
    """An earlier report's run records, cut to the fields the report reads, as a baseline."""
    return {"source": source,
            "runs": {p: [{k: r[k] for k in RECORD_FIELDS if k in r} for r in rs]
                     for p, rs in report["runs"].items()}}


# ----------------------------------------------------------------------------- markdown


def _f(x, fmt=".3g"):
    return "–" if x is None else f"{x:{fmt}}"


def _pm(st, fmt=".3g"):
    """mean ± std of a `seed_stats` dict; the bare mean with one seed (no spread measured)."""
    if st["mean"] is None:
        return "not finite" if st["n"] else "–"
    return f"{st['mean']:{fmt}}" if st["std"] is None else f"{st['mean']:{fmt}} ± {st['std']:.2g}"


def _values(st, fmt="+.3f"):
    return ", ".join(f"{v:{fmt}}" for v in st["values"])


def _seeds(seeds):
    return f"{len(seeds)} ({', '.join(str(s) for s in seeds)})"


def _measured_table(table):
    lines = ["| point | head | lr | n (seeds) | D | D ÷ lr | Hilbert RMS | Hilbert RMS ÷ lr | "
             "tightness | final val loss |", "|---|---|---|---|---|---|---|---|---|---|"]
    for point, heads in table.items():
        for head, e in heads.items():
            exact = "" if e["diameter_exact"] else " (upper bracket)"
            lines.append(
                f"| {point} | {LABEL[head]} | {', '.join(f'{x:g}' for x in e['lr'])} | "
                f"{_seeds(e['seeds'])} | {_pm(e['D'], '.4g')}{exact} | {_pm(e['D_per_lr'])} | "
                f"{_pm(e['hilbert_rms'], '.4g')} | {_pm(e['hilbert_rms_per_lr'])} | "
                f"{_pm(e['tightness'])} | {_pm(e['final_val_loss'], '.4f')} |")
    return lines


def _reduction_table(red, matched=False):
    if matched:
        lines = ["| point | baseline | n (seeds) | D ratio (vs 1×) | Hilbert RMS ratio (vs 1×) | "
                 "Δ val loss (RowNorm − baseline) | per-seed Δ | Δ vs seed spread |",
                 "|---|---|---|---|---|---|---|---|"]
    else:
        lines = ["| point | baseline | n (seeds) | D reduction | Hilbert RMS reduction | "
                 "Δ val loss (RowNorm − baseline) | Δ vs seed spread |",
                 "|---|---|---|---|---|---|---|"]
    for point, bases in red.items():
        for base, v in bases.items():
            d, h, dl = v["D"], v["hilbert_rms"], v["loss_delta"]
            if matched:
                lines.append(f"| {point} | {LABEL[base]} | {_seeds(v['seeds'])} | "
                             f"{_pm(d)}× ({d['vs_1']}) | {_pm(h)}× ({h['vs_1']}) | "
                             f"{_pm(dl, '+.4f')} | {_values(dl)} | {dl['verdict']} |")
            else:
                lines.append(f"| {point} | {LABEL[base]} | {_seeds(v['seeds'])} | {_pm(d)}× | "
                             f"{_pm(h)}× | {_pm(dl, '+.4f')} | {dl['verdict']} |")
    return lines


def _fit_cell(f, name):
    if "error" in f:
        return f"not fitted ({f['error']})"
    s = f["slopes"][name]
    return (f"{s['value']:.3f} [{s['ci'][0]:.3f}, {s['ci'][1]:.3f}] "
            f"(n {f['n']} runs, {f['cells']} shapes)")


def _slope_lines(fits):
    lines = ["| head | metric | slope vs d [95% CI] | slope vs V [95% CI] |", "|---|---|---|---|"]
    for head, entry in fits.items():
        for metric, label in PER_LR:
            lines.append(f"| {LABEL[head]} | {label} | {_fit_cell(entry[metric]['vs_d'], 'd')} | "
                         f"{_fit_cell(entry[metric]['vs_V'], 'V')} |")
    return lines


def _ci(p):
    return f"{p['value']:.3g}× [{p['ci'][0]:.3g}, {p['ci'][1]:.3g}]"


_METRICS = (("D", "D", "diameter_reduction"), ("hilbert_rms", "Hilbert RMS", "hilbert_reduction"))
PAPER_BASELINE = "adamw"  # the paper compares projected RowNorm with an AdamW head (Table 2)


def _shape(name, paper_models):
    m = paper_models.get(name)
    return name if m is None else f"{name} ({m['d']} × {m['V']})"


def _prediction_lines(preds, protocol, paper_models):
    lines = []
    for base, entry in preds.items():
        for metric, label, _ in _METRICS:
            e = entry[metric]
            if "error" in e["fit"]:
                continue
            for shape, p in e["at"].items():
                m = paper_models.get(shape) if base == PAPER_BASELINE else None
                if m is None:
                    paper_cells = "– (no such head in the paper) | – | –"
                else:
                    same = m["reduction_per_lr"][metric]
                    holds = p["ci"][0] <= same <= p["ci"][1]
                    paper_cells = (f"{same:.3g}× | {m['reduction'][metric]:.3g}× | "
                                   f"{'yes' if holds else 'no'}")
                lines.append(f"| {PROTOCOL_LABEL[protocol]} | {LABEL[base]} | {label} | "
                             f"{_shape(shape, paper_models)} | {_ci(p)} | {e['fit']['n']} | "
                             f"{paper_cells} |")
    if lines:
        lines = ["| protocol | baseline | reduction of | shape (d × V) | predicted [95% CI] | "
                 "per-seed points | paper, per unit head rate | paper, at its rates (Table 3) | "
                 "interval holds the paper's per-unit-rate value |",
                 "|---|---|---|---|---|---|---|---|---|", *lines]
    return lines


def _rate_ratios(table: dict) -> str:
    """The paper's AdamW ÷ RowNorm peak head rates, e.g. '1.25×' (or their range)."""
    r = sorted({float(f"{m['peak_lr']['adamw'] / m['peak_lr']['rownorm']:.3g}")
                for m in table.values()})
    return f"{r[0]:g}×" if len(r) == 1 else f"{r[0]:g}–{r[-1]:g}×"


def _paper_rate_rule(table: dict) -> str:
    """Table 2's head rates as a rule: AdamW c/d and RowNorm k × AdamW (when they fit one)."""
    c = sorted({float(f"{m['peak_lr']['adamw'] * m['d']:.3g}") for m in table.values()})
    k = sorted({float(f"{m['peak_lr']['rownorm'] / m['peak_lr']['adamw']:.2g}")
                for m in table.values()})
    adamw = f"AdamW {c[0]:g}/d" if len(c) == 1 else "AdamW " + ", ".join(
        f"{m['peak_lr']['adamw']:g}" for m in table.values())
    return adamw + (f", RowNorm {k[0]:g} × AdamW" if len(k) == 1 else "")


def _paper_lines(content: dict, config: dict, ladder) -> list[str]:
    """The paper's measured D ÷ lr and Hilbert RMS ÷ lr beside the equal-rate predictions, the
    AdamW ceiling of each recipe's betas, and how the runs' setting differs from the paper's."""
    pp = content["paper"]
    models, recipe = pp["models"], pp["recipe"]
    eq = content["protocols"].get("equal", {})
    preds = eq.get("predicted_per_lr", {})
    points = eq.get("measured", {}).get("points", {})
    frac = recipe["final_lr_fraction"]
    lines = ["## The paper's measured values beside the predictions", "",
             "The paper (arXiv 2608.22253 v2, Tables 1-3) compares projected RowNorm with an "
             "**AdamW head**. Its heads are d × V = "
             + ", ".join(f"{m['d']} × {m['V']:,} ({n})" for n, m in models.items())
             + f". Table 3 gives D(S_T) at the final update T, where every rate is {frac:g} × "
             "its peak (Table 2's schedule), so the paper's D ÷ lr is D ÷ "
             f"({frac:g} × the Table 2 peak head rate), computed here from the published "
             "table (`scale_ladder.PAPER_TABLE`); its spread is Table 3's sample sd over 3 seeds "
             "÷ that rate. **Predicted**: a joint fit `log(D ÷ lr) = a + b·log d + c·log V` "
             "over every per-seed equal-rate run of the head (the thin one-layer point "
             "included), evaluated at the paper's (d, V), with the fitted trend's 95% "
             "t-interval. **Measured at the same width**: the ladder's own runs at the paper "
             "model's d (mean over seeds, n).", ""]
    for metric, label in PER_LR:
        key = metric
        rows = []
        for name, m in models.items():
            for head in ("adamw", "rownorm"):
                pe = preds.get(head, {}).get(metric, {})
                p = pe.get("at", {}).get(name)
                same = [f"{pt}: {_pm(h[head][metric])} ({h[head][metric]['n']})"
                        for pt, h in points.items() if int(pt.split("-")[0][1:]) == m["d"]
                        and head in h]
                pv = m[key][head]
                rows.append(f"| {name} | {m['d']} × {m['V']:,} | {LABEL[head]} | "
                            + ("not fitted" if p is None else
                               f"{p['value']:.3g} [{p['ci'][0]:.3g}, {p['ci'][1]:.3g}] "
                               f"({pe['fit']['n']})")
                            + f" | {'; '.join(same) or '–'} | {pv['mean']:.3g} ± {pv['sd']:.2g} | "
                            + ("–" if p is None else f"{pv['mean'] / p['value']:.2f}") + " |")
        lines += [f"### {label}", "",
                  f"| model | head shape d × V | head | predicted {label} [95% CI] (n runs) | "
                  f"ladder, measured at the same width: point: {label} (n) | paper: {label} at "
                  "T (mean ± sd) | paper ÷ predicted |", "|---|---|---|---|---|---|---|", *rows,
                  ""]
        if metric == "hilbert_rms_per_lr":
            lines += ["The Hilbert RMS also scales with the final hidden states' norms (the "
                      "paper's final RMSNorm has no gain; the ladder's model learns one), so "
                      "this row compares less directly than D ÷ lr.", ""]
    slope = pp["width_slope"]
    fit = preds.get("adamw", {}).get("D_per_lr", {}).get("fit", {})
    if slope is not None and "slopes" in fit:
        ours = fit["slopes"]["d"]
        lines += [f"**Trend with width.** Across its three sizes the paper's AdamW D ÷ lr grows "
                  f"like d^{slope['value']:.2f} (log-log least squares on the 3 published means"
                  + (f", 95% interval [{slope['ci'][0]:.2f}, {slope['ci'][1]:.2f}] on 1 degree "
                     "of freedom" if "ci" in slope else "")
                  + f"); the ladder's joint fit gives d^{ours['value']:.2f} "
                    f"[{ours['ci'][0]:.2f}, {ours['ci'][1]:.2f}] (V held fixed).", ""]
    runs_adam, steps = content["runs_adamw_head"], config.get("steps")
    pa = recipe["adamw_head"]
    rows, above = [], 0
    for name, m in models.items():
        ours = adamw_ceiling(m["d"], runs_adam["b1"], runs_adam["b2"], steps)
        val = m["D_per_lr"]["adamw"]["mean"]
        above += val > ours
        rows.append(f"| {name} | {m['d']} | {val:.3g} | {ours:.3g} | {m['adamw_ceiling']:.3g} |")
    lines += ["### The AdamW head's ceiling: what its betas allow", "",
              "No AdamW step can exceed D ÷ lr = 2·√d·(1−β₁)/√((1−β₂)(1−β₁²/β₂)) × "
              "√(1−β₂^t)/(1−β₁^t) at step t (`ladder_report.adam_ratio_bound`: every "
              "coordinate of m̂/(√v̂+eps) is bounded by Cauchy–Schwarz, a row has d of them, "
              "two rows are at most twice a row's norm apart). The ladder's runs trained the "
              f"AdamW head with β = ({runs_adam['b1']:g}, {runs_adam['b2']:g}), eps "
              f"{runs_adam['eps']:g}, t = {steps}; the paper with β = ({pa['b1']:g}, "
              f"{pa['b2']:g}), eps {pa['eps']:g}, t = T.", "",
              "| model | d | paper: AdamW D ÷ lr at T | ceiling, the runs' β | ceiling, the "
              "paper's β |", "|---|---|---|---|---|", *rows, "",
              f"The paper's measured value is above the ceiling of the runs' AdamW head at "
              f"{above} of {len(models)} widths: "
              + ("no AdamW head with the runs' betas can reach it at the paper's widths, "
                 "whatever its horizon, data or rate. " if above == len(models) else "")
              + "The extrapolation is of the ladder's recipe, not of the paper's.", ""]
    model = config.get("model", {})
    batch, seq = config.get("data", {}).get("batch_size"), model.get("max_seq_len")
    sched, last_k = config.get("optim", {}), config.get("eval", {}).get("probe_last_steps")
    lines += ["### Where the ladder's setting differs from the paper's", "",
              "| | ladder runs (this page) | paper |", "|---|---|---|",
              f"| tokens per update | {batch} × {seq} = {batch * seq:,} | "
              f"{recipe['tokens_per_update']:,} |" if batch and seq else
              "| tokens per update | – | – |",
              f"| updates | {steps} | "
              + " / ".join(f"{m['updates']:,}" for m in models.values()) + " |",
              f"| head rate at the last update ÷ peak | {sched.get('min_lr_ratio')} | "
              f"{frac:g} |",
              f"| D ÷ lr read at | mean of the last {last_k} "
              "steps; 1-2 seeds per shape (coverage above) | the final update; 3 seeds |",
              f"| AdamW head β, eps | ({runs_adam['b1']:g}, {runs_adam['b2']:g}), "
              f"{runs_adam['eps']:g} | ({pa['b1']:g}, {pa['b2']:g}), {pa['eps']:g} |",
              f"| head rates | every head at {ladder.equal_lr:g} (equal-rate protocol) | "
              f"Table 2: {_paper_rate_rule(pp['table'])} |",
              "| backbone depth | 2 blocks (1 at the thin point) | 32 blocks |",
              "| data, vocabulary | a BPE of each size trained on the Python standard library | "
              "FineWeb, the GPT-2 tokenizer |", ""]
    return lines


def _robust_lines(rob):
    heads = rob["heads"]
    lines = ["| head | × tuned rate | lr | n (seeds) | final val loss | Δ vs 1× (paired) | "
             "Δ vs seed spread | spike onsets (per seed) | diverged |",
             "|---|---|---|---|---|---|---|---|---|"]
    for head, e in heads.items():
        for v in sorted(e["rows"].values(), key=lambda v: v["multiplier"]):
            vt = v["vs_tuned"]
            lines.append(f"| {LABEL[head]} | {v['multiplier']:.3g} | {v['lr']:g} | "
                         f"{_seeds(v['seeds'])} | {_pm(v['final_val_loss'], '.4f')} | "
                         f"{'–' if vt is None else _pm(vt, '+.4f')} | "
                         f"{'–' if vt is None else vt['verdict']} | {v['spikes']} | "
                         f"{sum(v['diverged'])}/{len(v['diverged'])} |")
    lines += ["", "Stable multipliers (no divergence and no spike on any seed; diverged: final "
              "val loss not finite, above its first evaluation, or at or above ln V): " + "; ".join(
        f"{LABEL[h]}: {', '.join(f'{m:.3g}' for m in e['stable_multipliers']) or 'none'}"
        for h, e in heads.items()),
        "", f"Stable and within {NEAR_BEST} nats of the head's best mean final loss: " + "; ".join(
        f"{LABEL[h]}: {', '.join(f'{m:.3g}' for m in e['near_best_multipliers']) or 'none'}"
        for h, e in heads.items())]
    if rob["rownorm_minus_head"]:
        lines += ["", "RowNorm against each head at the same multiple of its own tuned rate "
                  "(Δ = RowNorm − head final val loss, per seed; negative: RowNorm lower):", "",
                  "| × tuned rate | head | n (seeds) | Δ | per-seed Δ | Δ vs seed spread |",
                  "|---|---|---|---|---|---|"]
        for _, row in sorted(rob["rownorm_minus_head"].items(), key=lambda kv: float(kv[0])):
            for head, v in row.items():
                lines.append(f"| {v['multiplier']:.3g} | {LABEL[head]} | {_seeds(v['seeds'])} | "
                             f"{_pm(v, '+.4f')} | {_values(v)} | {v['verdict']} |")
    return lines


def _coverage_lines(rows: list[dict], ladder, runs: dict, baseline: dict | None) -> list[str]:
    """Seeds per cell (before → now / planned) in one row per protocol, point and multiplier."""
    heads = [h for h in LABEL if h in ladder.heads]
    grouped: dict = {}
    for r in rows:
        grouped.setdefault((r["protocol"], r["point"], r["multiplier"]), {})[r["head"]] = r
    what = "before → now / planned" if baseline is not None else "now / planned"
    lines = ["### Coverage (seeds per cell)", "",
             f"Each cell: finished seeds {what}"
             + (f"; *before* is the baseline run ({baseline['source']})" if baseline else "")
             + ". A cell with no finished seed says nothing on this page: nothing is "
               "extrapolated from runs that did not happen. RowNorm's matched-diameter runs are "
               "its tuned runs.", "",
             "| protocol | point | × tuned rate | " + " | ".join(LABEL[h] for h in heads) + " |",
             "|---|---|---|" + "---|" * len(heads)]
    for (protocol, point, mult), cells in grouped.items():
        out = []
        for h in heads:
            c = cells.get(h)
            if c is None:
                out.append("–")
                continue
            now = f"{len(c['now'])} / {c['planned']}"
            out.append(now if c["before"] is None else f"{len(c['before'])} → {now}")
        lines.append(f"| {protocol} | {point} | {f'{float(mult):.3g}' if mult else ''} | "
                     + " | ".join(out) + " |")
    sweep: dict = defaultdict(int)
    for r in runs.get("sweep", []):
        sweep[_name(_key(r))] += 1
    if sweep:
        lines += ["", "Sweep (one seed per rate by design): " + "; ".join(
            f"{p}: {n} runs" for p, n in sorted(sweep.items())) + "."]
    return lines


def _baseline_lines(content: dict, before: dict, baseline: dict, thin: str) -> list[str]:
    """The baseline run's reductions and predictions next to the current ones."""
    lines = [f"## Against the baseline run ({baseline['source']})", "",
             "The same statistics computed from the baseline's run records; n is the number of "
             "seed pairs (reductions) or per-seed points (fits).", ""]
    now_p, old_p = content["protocols"], before["protocols"]
    red = [(pr, base) for pr in now_p if pr in old_p
           for base in now_p[pr]["measured"]["reductions"].get(thin, {})
           if base in old_p[pr]["measured"]["reductions"].get(thin, {})]
    if red:
        lines += [f"### Measured reductions at {thin}", "",
                  "| protocol | baseline | D before (n) | D now (n) | Hilbert RMS before (n) | "
                  "Hilbert RMS now (n) |", "|---|---|---|---|---|---|"]
        for pr, base in red:
            n, o = (p[pr]["measured"]["reductions"][thin][base] for p in (now_p, old_p))
            lines.append(f"| {PROTOCOL_LABEL[pr]} | {LABEL[base]} | {_pm(o['D'])}× "
                         f"({o['D']['n']}) | {_pm(n['D'])}× ({n['D']['n']}) | "
                         f"{_pm(o['hilbert_rms'])}× ({o['hilbert_rms']['n']}) | "
                         f"{_pm(n['hilbert_rms'])}× ({n['hilbert_rms']['n']}) |")
        lines.append("")
    pred = []
    for pr in now_p:
        for base, entry in now_p[pr]["predicted"].items():
            for metric, label, _ in _METRICS:
                new = entry[metric]
                old = old_p.get(pr, {}).get("predicted", {}).get(base, {}).get(metric)
                for shape, p in new["at"].items():
                    o = None if old is None else old["at"].get(shape)
                    pred.append(f"| {PROTOCOL_LABEL[pr]} | {LABEL[base]} | {label} | {shape} | "
                                + ("not fitted" if o is None else
                                   f"{_ci(o)} ({old['fit']['n']})")
                                + f" | {_ci(p)} ({new['fit']['n']}) |")
    if pred:
        lines += ["### Predicted reductions at the paper's head shapes", "",
                  "| protocol | baseline | reduction of | shape | before [95% CI] (n) | "
                  "now [95% CI] (n) |", "|---|---|---|---|---|---|", *pred, ""]
    if "matched" in now_p:
        old_red = old_p.get("matched", {}).get("measured", {}).get("reductions", {})
        lines += ["### Matched-diameter loss differences (RowNorm − baseline)", "",
                  "| point | baseline | before (n) | now: mean ± std (n) | per-seed Δ | "
                  "now vs seed spread |", "|---|---|---|---|---|---|"]
        for point, bases in now_p["matched"]["measured"]["reductions"].items():
            for base, v in bases.items():
                o = old_red.get(point, {}).get(base)
                dl = v["loss_delta"]
                lines.append(f"| {point} | {LABEL[base]} | "
                             + ("–" if o is None else
                                f"{_pm(o['loss_delta'], '+.4f')} ({o['loss_delta']['n']})")
                             + f" | {_pm(dl, '+.4f')} ({dl['n']}) | {_values(dl)} | "
                               f"{dl['verdict']} |")
        lines.append("")
    return lines


# ----------------------------------------------------------------------------- figures


def plot_slopes(runs, fits, path: Path, *, width_v, vocab_d) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    for row, (metric, label) in enumerate(PER_LR):
        for col, (axis, fixed, other) in enumerate((("d", "V", width_v), ("V", "d", vocab_d))):
            ax = axes[row][col]
            for head in fits:
                pts = [(r["point"][axis], r[metric]) for r in runs if r["head"] == head
                       and r["point"][fixed] == other and r["point"]["layers"] == 2]
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=True)
                line = ax.plot(xs, ys, "o", alpha=0.7, label=LABEL[head])[0]
                f = fits[head][metric][f"vs_{axis}"]
                if "error" not in f:
                    grid = np.geomspace(min(xs), max(xs), 20)
                    ax.plot(grid, np.exp(f["coef"][0]) * grid ** f["coef"][1],
                            color=line.get_color(),
                            label=f"slope {f['slopes'][axis]['value']:.2f}")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(axis)
            ax.set_title(f"{label} vs {axis} ({fixed} {other}; one point per seed)")
            if ax.get_lines():
                ax.legend(fontsize=7)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_robust(rob, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5), constrained_layout=True)
    for head, e in rob["heads"].items():
        rows = sorted(e["rows"].values(), key=lambda v: v["multiplier"])
        stats = [v["final_val_loss"] for v in rows]
        ax.errorbar([v["multiplier"] for v in rows],
                    [np.nan if s["mean"] is None else s["mean"] for s in stats],
                    yerr=[s["std"] or 0.0 for s in stats], marker="o", capsize=3,
                    label=LABEL[head])
    ax.set_xscale("log")
    ax.set_xlabel("head rate ÷ tuned head rate")
    ax.set_ylabel("final validation loss (mean ± std over seeds)")
    ax.legend()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------- the report


def build(runs: dict, *, rules: dict, ladder, paper_shapes: dict,
          paper_values: dict | None = None) -> dict:
    """The report's content (JSON-able) from the runs of each protocol; paper_values: `paper`'s
    summary of the paper's published values (or None)."""
    protocols = {}
    for protocol in ("equal", "tuned", "matched"):
        rs = runs.get(protocol, [])
        if not rs:
            continue
        protocols[protocol] = {
            "measured": {"points": point_table(rs), "reductions": reductions(rs)},
            "fits": slope_fits(rs, width_v=ladder.width_v, vocab_d=ladder.vocab_d),
            "predicted": predictions(rs, paper_shapes),
            "predicted_per_lr": per_lr_predictions(rs, paper_shapes)}
    done = sum(len(v) for v in runs.values())
    return {"runs_done": done, "protocols": protocols, "tuned_rate_rules": rules,
            "sweep": point_table(runs.get("sweep", [])),
            "robustness": robustness(runs["robust"]) if runs.get("robust") else {},
            "paper": paper_values, "paper_shapes": paper_shapes}


SPREAD_RULE = (
    "**Seed spread.** Each cell is a mean ± sample standard deviation (ddof 1) over its seeds, "
    "n seeds (one seed: the bare value, no spread measured). Reductions (baseline ÷ RowNorm) and "
    "loss differences (RowNorm − baseline) are formed **per seed pair** (same protocol, point "
    "and seed) and then summarised; their spread is that of the per-seed values, not a "
    "propagated one. *Larger than the seed spread* means: at least 2 seeds, every per-seed "
    "difference of the mean's sign, and |mean| > {k:g} standard errors (std/√n); otherwise "
    "*within* (ratios: the same rule on their logarithms, against 1×). With 2-3 seeds this is a "
    "screen, not a significance test (a two-sided 95 % t-test needs |mean| > 12.7 se with 2 "
    "seeds, 4.3 se with 3).")


def write_report(runs: dict, *, rules, ladder, out: Path, config: dict,
                 session_wall_s: float, baseline: dict | None = None,
                 provenance: tuple = (), refit: dict | None = None) -> dict:
    """Write scale_ladder.json / .md (and figures when there are runs) under `out`.

    provenance: paragraphs saying how this page was made when that is not the plain run (e.g.
    `scale_ladder.refit`: rebuilt from stored run records); printed under the status line.
    refit: what `scale_ladder.refit` records in the JSON (its source, the shapes before it).

    baseline: `baseline_from_report` of an earlier run, or None: its seeds per cell, reductions
    and predictions are shown next to the current ones.
    """
    from studies.scale_ladder import PAPER_RECIPE, PAPER_SHAPES, PAPER_TABLE, RUNS_ADAMW_HEAD

    out.mkdir(parents=True, exist_ok=True)
    content = build(runs, rules=rules, ladder=ladder, paper_shapes=PAPER_SHAPES,
                    paper_values=paper(PAPER_TABLE, PAPER_RECIPE))
    content["runs_adamw_head"] = RUNS_ADAMW_HEAD
    before, summary = None, None
    if baseline is not None:
        before = build(baseline["runs"], rules={}, ladder=ladder, paper_shapes=PAPER_SHAPES)
        summary = {"source": baseline["source"],
                   "protocols": {p: {"reductions": e["measured"]["reductions"],
                                     "predicted": e["predicted"]}
                                 for p, e in before["protocols"].items()}}
    cov = coverage(runs, ladder, None if baseline is None else baseline["runs"])
    result = {"quick": ladder.quick, "config_first_point": config, **content,
              "coverage": cov, "baseline": summary, "provenance": list(provenance),
              "refit": refit,
              "wall_s_runs_total": sum(r["wall_s"] for v in runs.values() for r in v),
              "wall_s_this_session": session_wall_s,
              "runs": {k: v for k, v in runs.items() if v}}
    (out / "scale_ladder.json").write_text(json.dumps(result, indent=1))
    md = ["# Head-geometry scale ladder", "",
          "Generated by `python -m studies.scale_ladder` (see its docstring for the grid, the "
          "protocols and the seeds); raw per-run records in `scale_ladder.json`.", ""]
    if content["runs_done"] == 0:
        md += ["**No ladder run has finished yet.** Nothing on this page is measured and no "
               "prediction is made; run `python -m studies.scale_ladder --plan` for the cost, "
               "then `python -m studies.scale_ladder`.", ""]
        (out / "scale_ladder.md").write_text("\n".join(md))
        return result
    md += [f"Status: {content['runs_done']} run records (a run shared by two protocols counts "
           f"in each), {result['wall_s_runs_total'] / 60:.1f} min of training.", "",
           *(x for para in provenance for x in (para, "")),
           *_coverage_lines(cov, ladder, runs, baseline), "",
           "Labels: **measured** = over finished runs, last-K means of the head step; "
           "**predicted** = a log-log least-squares fit evaluated at a shape no run had, with "
           "its 95% t-interval (of the fitted trend). Every fit uses one point per seed (never "
           "a cell's mean), so seed noise is in its residual variance; n counts those points. "
           "A fit needs more distinct shapes than parameters: seeds of too few shapes do not "
           "test a power law.",
           "", SPREAD_RULE.format(k=ladder_fit.SPREAD_SE), ""]
    for protocol, e in content["protocols"].items():
        md += [f"## {PROTOCOL_LABEL[protocol]}", "", "### Measured, per point", "",
               *_measured_table(e["measured"]["points"]), "",
               "### Measured reductions (baseline ÷ RowNorm, per seed pair)", "",
               *(["Under matched diameter the D column is the achieved match (1× = the "
                  "rescaled rate hit RowNorm's diameter exactly; the rate was calibrated on the "
                  "first seed); the Hilbert and loss columns compare the geometries per unit of "
                  "head-step diameter. In brackets: whether the ratio differs from 1× by more "
                  "than the seed spread.", ""]
                 if protocol == "matched" else []),
               *_reduction_table(e["measured"]["reductions"], matched=protocol == "matched"), "",
               "### Fitted log-log slopes (per-seed runs; √ is 0.5)", "",
               *_slope_lines(e["fits"]), ""]
        pred = _prediction_lines(e["predicted"], protocol, content["paper"]["models"])
        md += ["### Predicted reductions at the paper's head shapes", "",
               "Joint fit `log(baseline D ÷ RowNorm D) = a + b·log d + c·log V` over every "
               "per-seed pair of this protocol (the thin one-layer point included), evaluated "
               "at the paper's (d, V); the interval is the fitted trend's 95% t-interval. The "
               "paper's baseline is the AdamW head; its Table 3 ratio of means compares the two "
               "heads at their own Table 2 rates (AdamW's "
               + _rate_ratios(content["paper"]["table"])
               + " RowNorm's), so the column to set beside an equal-rate prediction is the ratio "
               "per unit head rate (the ratio of the two D ÷ lr, see the next section).", "",
               *(pred or ["Not enough points for a joint fit on (d, V)."]), ""]
        if protocol == "equal":
            plot_slopes(runs["equal"], e["fits"], out / "scale_ladder_slopes.png",
                        width_v=ladder.width_v, vocab_d=ladder.vocab_d)
            md += ["![slopes](scale_ladder_slopes.png)", ""]
    if content["paper"] is not None and "equal" in content["protocols"]:
        md += _paper_lines(content, config, ladder)
    if rules:
        md += ["## Tuned-rate rule (from the sweep)", "", "| head | best rates | α (lr ∝ d^α) |",
               "|---|---|---|", *(f"| {LABEL[h]} | {r['best']} | {r['alpha']:.3f} |"
                                 for h, r in rules.items()), ""]
    if content["robustness"]:
        plot_robust(content["robustness"], out / "scale_ladder_robust.png")
        md += [f"## {PROTOCOL_LABEL['robust']} at {ladder.robust_point.name} (measured)", "",
               *_robust_lines(content["robustness"]), "", "![robust](scale_ladder_robust.png)",
               ""]
    if baseline is not None and before is not None and before["runs_done"]:
        md += _baseline_lines(content, before, baseline, ladder.thin.name)
    (out / "scale_ladder.md").write_text("\n".join(md))
    return result
