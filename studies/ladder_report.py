"""The scale ladder's report: tables, fits, predictions and figures from finished runs only.

`write_report` writes `scale_ladder.json`, `scale_ladder.md` and (when there is something to
draw) `scale_ladder_slopes.png` / `scale_ladder_robust.png`. Every number in the page is either
*measured* (a mean over finished runs) or *predicted* (a fit's value at a shape no run had), and
says which. With no finished run the page says so and shows no number.
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
NEAR_BEST = 0.1  # nats: the robustness grid's "usable without further tuning" margin


def _key(r):
    p = r["point"]
    return (p["d"], p["V"], p["layers"])


def _name(key):
    return f"d{key[0]}-V{key[1]}-L{key[2]}"


def _ms(xs):
    xs = np.asarray(xs, np.float64)
    return [float(xs.mean()), float(xs.std(ddof=1)) if xs.size > 1 else 0.0]


def point_table(runs: list[dict]) -> dict:
    """{point: {head: {metric: [mean, std], "seeds": [...], "lr": ...}}} (measured)."""
    groups = defaultdict(list)
    for r in runs:
        groups[(_key(r), r["head"])].append(r)
    out = defaultdict(dict)
    for (key, head), rs in sorted(groups.items()):
        out[_name(key)][head] = {
            "seeds": sorted(r["seed"] for r in rs), "lr": sorted({r["lr"] for r in rs}),
            **{m: _ms([r[m] for r in rs]) for m in
               ("D", "D_per_lr", "hilbert_rms", "hilbert_rms_per_lr", "final_val_loss")},
            "tightness": _ms([r["tightness"] for r in rs if r["tightness"] is not None] or [0.0]),
            "diameter_exact": all(r["diameter_exact"] for r in rs)}
    return dict(out)


def reductions(runs: list[dict]) -> dict:
    """Paired (same point, seed) baseline ÷ RowNorm ratios of D and Hilbert RMS, loss deltas."""
    by = {(_key(r), r["seed"], r["head"]): r for r in runs}
    out = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for (key, seed, head), rn in by.items():
        if head != "rownorm":
            continue
        for base in ("adamw", "muon", "muon-spectral"):
            b = by.get((key, seed, base))
            if b is None:
                continue
            row = out[_name(key)][base]
            row["D"].append(b["D"] / rn["D"])
            row["hilbert_rms"].append(b["hilbert_rms"] / rn["hilbert_rms"])
            row["loss_delta"].append(rn["final_val_loss"] - b["final_val_loss"])
            row["seeds"].append(seed)
    return {p: {b: dict(v) for b, v in d.items()} for p, d in out.items()}


def _fit_or_reason(features, y):
    try:
        return ladder_fit.fit_loglog(features, y)
    except ValueError as e:
        return {"error": str(e)}


def slope_fits(runs: list[dict], *, width_v: int, vocab_d: int) -> dict:
    """Per head and metric: slope vs d (at V = width_v), vs V (at d = vocab_d, 2 layers)."""
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
    """Per baseline: joint fit of the paired reductions on (d, V), evaluated at `shapes`."""
    out = {}
    by = {(_key(r), r["seed"], r["head"]): r for r in runs}
    for base in ("adamw", "muon", "muon-spectral"):
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
    """Per head and rate multiplier: final loss, spike onsets, divergences over seeds."""
    out = defaultdict(dict)
    for r in runs:
        m = out[r["head"]].setdefault(f"{r['multiplier']:.4g}", {
            "multiplier": r["multiplier"], "lr": r["lr"], "final_val_loss": [], "spikes": [],
            "diverged": [], "seeds": []})
        m["final_val_loss"].append(r["final_val_loss"])
        m["spikes"].append(r["loss_spikes"])
        m["diverged"].append(r["diverged"])
        m["seeds"].append(r["seed"])
    for head, rows in out.items():
        stable = [v["multiplier"] for v in rows.values()
                  if not any(v["diverged"]) and not any(v["spikes"])]
        # Within NEAR_BEST nats of the head's best mean final loss: the rates a practitioner
        # could pick without tuning further (stable alone admits rates that barely learn).
        mean = {v["multiplier"]: float(np.mean(v["final_val_loss"])) for v in rows.values()}
        finite = [m for m in mean.values() if np.isfinite(m)]
        best = min(finite) if finite else np.inf
        near = [k for k, m in mean.items() if k in stable and m <= best + NEAR_BEST]
        out[head] = {"rows": rows, "stable_multipliers": sorted(stable),
                     "near_best_multipliers": sorted(near), "near_best_nats": NEAR_BEST}
    return dict(out)


# ----------------------------------------------------------------------------- markdown


def _f(x, fmt=".3g"):
    return "–" if x is None else f"{x:{fmt}}"


def _pm(ms, fmt=".3g", n=None):
    """mean ± std, or the bare value (one seed: no spread measured)."""
    return f"{ms[0]:{fmt}}" if n == 1 else f"{ms[0]:{fmt}} ± {ms[1]:.2g}"


def _measured_table(table):
    lines = ["| point | head | lr | seeds | D | D ÷ lr | Hilbert RMS | Hilbert RMS ÷ lr | "
             "tightness | final val loss |", "|---|---|---|---|---|---|---|---|---|---|"]
    for point, heads in table.items():
        for head, e in heads.items():
            n = len(e["seeds"])
            exact = "" if e["diameter_exact"] else " (upper bracket)"
            lines.append(
                f"| {point} | {LABEL[head]} | {', '.join(f'{x:g}' for x in e['lr'])} | "
                f"{n} | {_f(e['D'][0], '.4g')}{exact} | {_pm(e['D_per_lr'], n=n)} | "
                f"{_f(e['hilbert_rms'][0], '.4g')} | {_pm(e['hilbert_rms_per_lr'], n=n)} | "
                f"{_f(e['tightness'][0])} | {_pm(e['final_val_loss'], '.4f', n)} |")
    return lines


def _reduction_table(red):
    lines = ["| point | baseline | D reduction | Hilbert RMS reduction | Δ val loss (RowNorm − "
             "baseline) | seeds |", "|---|---|---|---|---|---|"]
    for point, bases in red.items():
        for base, v in bases.items():
            n = len(v["seeds"])
            lines.append(f"| {point} | {LABEL[base]} | {_pm(_ms(v['D']), n=n)}× | "
                         f"{_pm(_ms(v['hilbert_rms']), n=n)}× | "
                         f"{_pm(_ms(v['loss_delta']), '+.4f', n)} | {n} |")
    return lines


def _slope_lines(fits):
    lines = ["| head | metric | slope vs d [95% CI] | slope vs V [95% CI] |", "|---|---|---|---|"]
    for head, entry in fits.items():
        for metric, label in PER_LR:
            cells = []
            for axis, name in (("vs_d", "d"), ("vs_V", "V")):
                f = entry[metric][axis]
                cells.append(f"not fitted ({f['error']})" if "error" in f else
                             f"{f['slopes'][name]['value']:.3f} [{f['slopes'][name]['ci'][0]:.3f}, "
                             f"{f['slopes'][name]['ci'][1]:.3f}] (n {f['n']})")
            lines.append(f"| {LABEL[head]} | {label} | {cells[0]} | {cells[1]} |")
    return lines


def _prediction_lines(preds, protocol):
    lines = []
    for base, entry in preds.items():
        for metric, paper in (("D", PAPER["diameter_reduction"]),
                              ("hilbert_rms", PAPER["hilbert_reduction"])):
            e = entry[metric]
            if "error" in e["fit"]:
                continue
            for shape, p in e["at"].items():
                reach = p["ci"][1] >= paper[0] and p["ci"][0] <= paper[1]
                lines.append(f"| {PROTOCOL_LABEL[protocol]} | {LABEL[base]} | "
                             f"{'D' if metric == 'D' else 'Hilbert RMS'} | {shape} | "
                             f"{p['value']:.3g}× [{p['ci'][0]:.3g}, {p['ci'][1]:.3g}] | "
                             f"{paper[0]:g}–{paper[1]:g}× | {'yes' if reach else 'no'} |")
    if lines:
        lines = ["| protocol | baseline | reduction of | shape | predicted [95% CI] | paper | "
                 "interval meets paper range |", "|---|---|---|---|---|---|---|", *lines]
    return lines


def _robust_lines(rob):
    lines = ["| head | × tuned rate | lr | final val loss | spike onsets (per seed) | diverged |",
             "|---|---|---|---|---|---|"]
    for head, e in rob.items():
        for v in sorted(e["rows"].values(), key=lambda v: v["multiplier"]):
            loss = _pm(_ms(v["final_val_loss"]), ".4f", len(v["seeds"]))
            lines.append(f"| {LABEL[head]} | {v['multiplier']:.3g} | {v['lr']:g} | "
                         f"{loss} | {v['spikes']} | "
                         f"{sum(v['diverged'])}/{len(v['diverged'])} |")
    lines += ["", "Stable multipliers (no divergence and no spike on any seed; diverged: final "
              "val loss not finite, above its first evaluation, or at or above ln V): " + "; ".join(
        f"{LABEL[h]}: {', '.join(f'{m:.3g}' for m in e['stable_multipliers']) or 'none'}"
        for h, e in rob.items()),
        "", f"Stable and within {NEAR_BEST} nats of the head's best final loss: " + "; ".join(
        f"{LABEL[h]}: {', '.join(f'{m:.3g}' for m in e['near_best_multipliers']) or 'none'}"
        for h, e in rob.items())]
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
                line = ax.plot(xs, ys, "o", label=LABEL[head])[0]
                f = fits[head][metric][f"vs_{axis}"]
                if "error" not in f:
                    grid = np.geomspace(min(xs), max(xs), 20)
                    ax.plot(grid, np.exp(f["coef"][0]) * grid ** f["coef"][1],
                            color=line.get_color(),
                            label=f"slope {f['slopes'][axis]['value']:.2f}")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(axis)
            ax.set_title(f"{label} vs {axis} ({fixed} {other}; measured, last-K mean)")
            if ax.get_lines():
                ax.legend(fontsize=7)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_robust(rob, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5), constrained_layout=True)
    for head, e in rob.items():
        rows = sorted(e["rows"].values(), key=lambda v: v["multiplier"])
        ax.errorbar([v["multiplier"] for v in rows],
                    [_ms(v["final_val_loss"])[0] for v in rows],
                    yerr=[_ms(v["final_val_loss"])[1] for v in rows], marker="o",
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


def _coverage_lines(runs: dict, ladder) -> list[str]:
    """Finished against planned runs per protocol and point: what this page can and cannot say."""
    from studies.scale_ladder import Point, plan

    planned: dict = {}
    for row in plan(ladder):
        if row["protocol"].startswith("sweep (edge"):
            continue  # only when a best rate is at an edge
        key = (row["protocol"], row["point"])
        planned[key] = planned.get(key, 0) + 1
    done: dict = {}
    for protocol, rs in runs.items():
        for r in rs:
            if protocol == "matched" and r["head"] == "rownorm":
                continue  # RowNorm's matched runs are its tuned runs (not planned twice)
            key = (protocol, Point(**r["point"]).name)
            done[key] = done.get(key, 0) + 1
    lines = ["### Coverage (finished / planned runs)", "",
             "A protocol or point with no finished run says nothing on this page: nothing is "
             "extrapolated from runs that did not happen.", "",
             "| protocol | point | finished | planned |", "|---|---|---|---|"]
    for key in sorted(set(planned) | set(done)):
        lines.append(f"| {key[0]} | {key[1]} | {done.get(key, 0)} | {planned.get(key, 0)} |")
    return lines


def write_report(runs: dict, *, rules, ladder, out: Path, config: dict,
                 session_wall_s: float) -> dict:
    """Write scale_ladder.json / .md (and figures when there are runs) under `out`."""
    from studies.scale_ladder import PAPER_SHAPES

    out.mkdir(parents=True, exist_ok=True)
    content = build(runs, rules=rules, ladder=ladder, paper_shapes=PAPER_SHAPES)
    result = {"quick": ladder.quick, "config_first_point": config, **content,
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
           *_coverage_lines(runs, ladder), "",
           "Labels: **measured** = mean (± std over seeds) of finished runs, last-K means of "
           "the head step; **predicted** = a log-log least-squares fit evaluated at a shape no "
           "run had, with its 95% t-interval (of the fitted trend).", ""]
    for protocol, e in content["protocols"].items():
        md += [f"## {PROTOCOL_LABEL[protocol]}", "", "### Measured, per point", "",
               *_measured_table(e["measured"]["points"]), "",
               "### Measured reductions (baseline ÷ RowNorm, paired by seed)", "",
               *(["Under matched diameter the D column is the achieved match (1× = the "
                  "rescaled rate hit RowNorm's diameter exactly); the Hilbert and loss columns "
                  "compare the geometries per unit of head-step diameter.", ""]
                 if protocol == "matched" else []),
               *_reduction_table(e["measured"]["reductions"]), "",
               "### Fitted log-log slopes (measured runs; √ is 0.5)", "",
               *_slope_lines(e["fits"]), ""]
        pred = _prediction_lines(e["predicted"], protocol)
        md += ["### Predicted reductions at the paper's head shapes", "",
               "Joint fit `log(baseline D ÷ RowNorm D) = a + b·log d + c·log V` over every "
               "paired run of this protocol (the thin one-layer point included), evaluated at "
               "the paper's (d, V); the interval is the fitted trend's 95% t-interval.", "",
               *(pred or ["Not enough points for a joint fit on (d, V)."]), ""]
        if protocol == "equal" and "equal" in content["protocols"]:
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
    (out / "scale_ladder.md").write_text("\n".join(md))
    return result
