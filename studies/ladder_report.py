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
from collections import defaultdict
from pathlib import Path

import numpy as np

from studies import ladder_fit

LABEL = {"adamw": "AdamW", "muon": "Muon (RMS-matched)", "muon-spectral": "Muon (spectral)",
         "rownorm": "projected RowNorm"}
PROTOCOL_LABEL = {"equal": "(a) equal head rate", "tuned": "(b) tuned rate",
                  "matched": "(c) matched diameter", "robust": "(d) robustness grid"}
PAPER = {"diameter_reduction": [45.0, 60.0], "hilbert_reduction": [12.0, 15.0],
         "loss_delta": [0.0057, 0.0153]}
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


def _prediction_lines(preds, protocol):
    lines = []
    for base, entry in preds.items():
        for metric, label, paper_key in _METRICS:
            e, paper = entry[metric], PAPER[paper_key]
            if "error" in e["fit"]:
                continue
            for shape, p in e["at"].items():
                reach = p["ci"][1] >= paper[0] and p["ci"][0] <= paper[1]
                lines.append(f"| {PROTOCOL_LABEL[protocol]} | {LABEL[base]} | {label} | {shape} | "
                             f"{_ci(p)} | {e['fit']['n']} | {paper[0]:g}–{paper[1]:g}× | "
                             f"{'yes' if reach else 'no'} |")
    if lines:
        lines = ["| protocol | baseline | reduction of | shape | predicted [95% CI] | "
                 "per-seed points | paper | interval meets paper range |",
                 "|---|---|---|---|---|---|---|---|", *lines]
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


def build(runs: dict, *, rules: dict, ladder, paper_shapes: dict) -> dict:
    """The report's content (JSON-able) from the runs of each protocol."""
    protocols = {}
    for protocol in ("equal", "tuned", "matched"):
        rs = runs.get(protocol, [])
        if not rs:
            continue
        protocols[protocol] = {
            "measured": {"points": point_table(rs), "reductions": reductions(rs)},
            "fits": slope_fits(rs, width_v=ladder.width_v, vocab_d=ladder.vocab_d),
            "predicted": predictions(rs, paper_shapes)}
    done = sum(len(v) for v in runs.values())
    return {"runs_done": done, "protocols": protocols, "tuned_rate_rules": rules,
            "sweep": point_table(runs.get("sweep", [])),
            "robustness": robustness(runs["robust"]) if runs.get("robust") else {},
            "paper": PAPER, "paper_shapes": paper_shapes}


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
                 session_wall_s: float, baseline: dict | None = None) -> dict:
    """Write scale_ladder.json / .md (and figures when there are runs) under `out`.

    baseline: `baseline_from_report` of an earlier run, or None: its seeds per cell, reductions
    and predictions are shown next to the current ones.
    """
    from studies.scale_ladder import PAPER_SHAPES

    out.mkdir(parents=True, exist_ok=True)
    content = build(runs, rules=rules, ladder=ladder, paper_shapes=PAPER_SHAPES)
    before, summary = None, None
    if baseline is not None:
        before = build(baseline["runs"], rules={}, ladder=ladder, paper_shapes=PAPER_SHAPES)
        summary = {"source": baseline["source"],
                   "protocols": {p: {"reductions": e["measured"]["reductions"],
                                     "predicted": e["predicted"]}
                                 for p, e in before["protocols"].items()}}
    cov = coverage(runs, ladder, None if baseline is None else baseline["runs"])
    result = {"quick": ladder.quick, "config_first_point": config, **content,
              "coverage": cov, "baseline": summary,
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
        pred = _prediction_lines(e["predicted"], protocol)
        md += ["### Predicted reductions at the paper's head shapes", "",
               "Joint fit `log(baseline D ÷ RowNorm D) = a + b·log d + c·log V` over every "
               "per-seed pair of this protocol (the thin one-layer point included), evaluated "
               "at the paper's (d, V); the interval is the fitted trend's 95% t-interval.", "",
               *(pred or ["Not enough points for a joint fit on (d, V)."]), ""]
        if protocol == "equal":
            plot_slopes(runs["equal"], e["fits"], out / "scale_ladder_slopes.png",
                        width_v=ladder.width_v, vocab_d=ladder.vocab_d)
            md += ["![slopes](scale_ladder_slopes.png)", ""]
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
