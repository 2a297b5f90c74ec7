"""The LM-head geometry study of arXiv 2608.22253, at a scale a 2-core CPU can run.

    python -m studies.compare_heads            # full study (head_study.md records its wall time)
    python -m studies.compare_heads --quick    # one seed, tiny model, a few steps (CI)
    python -m studies.compare_heads --report-only   # rebuild docs/results from finished runs

The same model, corpus and training loop as `examples/lm/train.py` (Muon backbone, AdamW
embeddings and vectors), with four heads: AdamW (baseline), Muon, projected RowNorm and projected
RowNorm rescaled to the whole diameter budget (`rowgeom.projected_rownorm(rescale="exact")`). The
backbone learning rate is fixed; each head's peak learning rate is chosen by a small sweep on a
separate seed (lowest final validation loss), then every head trains on the same three seeds.

Per run: the mean over the last K steps of the head step's exact row diameter `D(-lr·U)` and of
the empirical Hilbert RMS perturbation `RMS_n range(-lr·U·h_n)` on held-out final hidden states
(both probed on every one of the last K steps), the final validation loss, and their curves.
Each finished run leaves `WORKDIR/<role>-<head>-lr<lr>-s<seed>/result.json`; a rerun skips those,
so an interrupted study resumes where it stopped. The report (`head_study.json`, `head_study.md`,
`head_study_*.png` under `--out`) is rewritten after the sweep and after every final run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

import numpy as np

from examples.lm import configs, metrics, train

HEADS = ("adamw", "muon", "rownorm", "rownorm-rescaled")
# Peak head learning rates swept (factor-3 grid around each head's default: 1x the backbone rate
# for AdamW/Muon, 5x for RowNorm, whose rows each move by exactly lr).
SWEEP = {"adamw": (2e-3, 6e-3, 1.8e-2), "muon": (2e-3, 6e-3, 1.8e-2),
         "rownorm": (1e-2, 3e-2, 9e-2), "rownorm-rescaled": (1e-2, 3e-2, 9e-2)}
QUICK_SWEEP = {"adamw": (6e-3, 1.8e-2), "muon": (6e-3, 1.8e-2),
               "rownorm": (3e-2, 9e-2), "rownorm-rescaled": (3e-2, 9e-2)}
SWEEP_EXTEND = 2  # grid points added past an edge of the grid when the best rate is there
SWEEP_SEED = 100
SEEDS = (1, 2, 3)
RESULT_FILE = "result.json"
# Per-step quantities averaged over the last K steps (head step without decay, and full change).
LAST_K_KEYS = ("head_step_diameter", "head_step_hilbert_rms", "head_step_hilbert_max",
               "head_diameter", "hilbert_rms")
CURVE_KEYS = ("train_loss", "val_loss", *LAST_K_KEYS, "head_learning_rate")


def study_config(*, quick: bool, steps: int | None = None, last_k: int | None = None,
                 data_source=None, data_dir=None) -> configs.Config:
    """The shared config of every run (the head, its rate and the seed are set per run)."""
    if quick:
        base = configs.override(configs.get_config("test"), {
            "steps": 8, "optim.warmup_steps": 2, "eval.every": 4, "eval.probe_last_steps": 3,
            "log_every": 1, "eval.hilbert_sequences": 2})
    else:
        # cpu-tiny's model (V 4096, d 128, 2 layers) at half its sequence length, so that 24 runs
        # fit in about an hour on 2 shared cores: a short-horizon, small-scale study.
        base = configs.override(configs.get_config("cpu-tiny"), {
            "model.max_seq_len": 64, "data.batch_size": 16, "steps": 600,
            "optim.warmup_steps": 40, "eval.every": 100, "eval.batches": 8,
            "eval.hilbert_sequences": 8, "eval.probe_last_steps": 20, "log_every": 10})
    over = {"data.source": data_source, "data.dir": data_dir, "steps": steps,
            "eval.probe_last_steps": last_k}
    return configs.override(base, {"checkpoint.every": 10**9, "checkpoint.keep": 1,
                                   **{k: v for k, v in over.items() if v is not None}})


def run_name(role: str, head: str, lr: float, seed: int) -> str:
    return f"{role}-{head}-lr{lr:g}-s{seed}"


def summarize(records: list[dict], cfg: configs.Config) -> dict:
    """Final validation loss, last-K means and curves from a run's metrics.jsonl records."""
    k = cfg.eval.probe_last_steps
    last = [r for r in records if r["step"] > cfg.steps - k and "head_step_diameter" in r]
    if len(last) != k:
        raise RuntimeError(f"expected head probes on the last {k} steps, found {len(last)}")
    evals = [r for r in records if "val_loss" in r]
    curves = {key: [[r["step"], r[key]] for r in records if key in r] for key in CURVE_KEYS}
    return {"final_val_loss": evals[-1]["val_loss"], "final_step": evals[-1]["step"],
            "last_k": k, "last_k_mean": {key: sum(r[key] for r in last) / k
                                         for key in LAST_K_KEYS},
            "curves": curves}


def run_one(cfg: configs.Config, workdir: Path, *, role: str, head: str, lr: float, seed: int,
            log) -> dict:
    """Train one run (or load its finished result) and return its record."""
    rundir = workdir / run_name(role, head, lr, seed)
    done = rundir / RESULT_FILE
    if done.exists():
        return json.loads(done.read_text())
    if rundir.exists():  # an interrupted run: start it again from scratch
        shutil.rmtree(rundir)
    run_cfg = configs.override(cfg, {"head": head, "optim.head_learning_rate": lr, "seed": seed})
    log(f"[{time.strftime('%H:%M:%S')}] {rundir.name}")
    t0 = time.perf_counter()
    try:
        train.train(run_cfg, rundir, progress=False, print_fn=lambda *a: None)
    except train.Preempted as stop:  # exit status 0; the relaunch trains this run again
        log(f"    preempted at step {stop.step}: the study stops here; rerun the same command")
        raise
    wall = time.perf_counter() - t0
    record = {"role": role, "head": head, "head_learning_rate": lr, "seed": seed,
              "wall_s": wall, **summarize(metrics.read_metrics(rundir), run_cfg)}
    done.write_text(json.dumps(record))
    m = record["last_k_mean"]
    log(f"    {wall:.0f} s  val_loss {record['final_val_loss']:.4f}  "
        f"D(step) {m['head_step_diameter']:.4g}  hilbert_rms {m['head_step_hilbert_rms']:.4g}")
    return record


def choose_rates(sweep_runs: list[dict]) -> dict[str, float]:
    """Each head's rate with the lowest final validation loss on the sweep seed."""
    best = {}
    for r in sweep_runs:
        h = r["head"]
        if h not in best or r["final_val_loss"] < best[h]["final_val_loss"]:
            best[h] = r
    return {h: r["head_learning_rate"] for h, r in best.items()}


def study(cfg: configs.Config, *, workdir: Path, out: Path, heads=HEADS, sweep=None,
          seeds=SEEDS, sweep_seed=SWEEP_SEED, extend=2, report_only=False, log=print) -> dict:
    """Run (or resume) the sweep and the final runs, writing the report as results arrive.

    extend: how many times a head's grid may be extended past its edge (see the loop below).
    """
    sweep = sweep or SWEEP
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs: list[dict] = []

    def get(role, head, lr, seed):
        path = workdir / run_name(role, head, lr, seed) / RESULT_FILE
        if report_only:
            return json.loads(path.read_text()) if path.exists() else None
        return run_one(cfg, workdir, role=role, head=head, lr=lr, seed=seed, log=log)

    def report():
        return write_report(
            runs, cfg=cfg, out=out, heads=heads, sweep=sweep, seeds=seeds,
            sweep_seed=sweep_seed, session_wall_s=time.perf_counter() - t0)

    for head in heads:
        grid = sorted(sweep[head])
        for lr in grid:
            r = get("sweep", head, lr, sweep_seed)
            if r is not None:
                runs.append(r)
        # A best rate at the edge of the grid may not be the head's best: extend the grid by
        # the same factor in that direction, at most `extend` times.
        step = grid[-1] / grid[-2] if len(grid) > 1 else 3.0
        for _ in range(extend):
            mine = [r for r in runs if r["role"] == "sweep" and r["head"] == head]
            best = choose_rates(mine).get(head)
            tried = sorted(r["head_learning_rate"] for r in mine)
            if best is None or tried[0] < best < tried[-1]:
                break
            lr = float(f"{best * step if best == tried[-1] else best / step:.6g}")
            r = get("sweep", head, lr, sweep_seed)
            if r is None:
                break
            runs.append(r)
    rates = choose_rates([r for r in runs if r["role"] == "sweep"])
    result = report()
    for seed in seeds:  # seed-major, so a partial study has every head on the same seeds
        for head in heads:
            if head not in rates:
                continue
            r = get("final", head, rates[head], seed)
            if r is not None:
                runs.append(r)
                if not report_only:
                    result = report()
    return report() if report_only else result


# ----------------------------------------------------------------------------- report

# The paper's abstract rounds Table 3's ratios (below, computed per size) to these ranges.
PAPER_ABSTRACT = {"diameter_reduction": "45–60×", "hilbert_reduction": "12–15×"}


def paper() -> dict:
    """The paper's numbers set beside the study's: arXiv 2608.22253 v2, whose baseline is the AdamW
    head (Table 2): the abstract's ranges with Table 3's ratios of means per size (AdamW ÷
    RowNorm, each head at its own Table 2 rate) and loss differences, computed from
    `studies.scale_ladder.PAPER_TABLE`."""
    from studies import ladder_report, scale_ladder

    pp = ladder_report.paper(scale_ladder.PAPER_TABLE, scale_ladder.PAPER_RECIPE)
    models, adam = pp["models"].values(), pp["recipe"]["adamw_head"]

    def table3(key, metric):
        return (f"{PAPER_ABSTRACT[key]} (Table 3: "
                + " / ".join(f"{m['reduction'][metric]:.3g}" for m in models) + ")")

    ratio = "/".join(sorted({f"{m['final_lr']['adamw'] / m['final_lr']['rownorm']:.3g}"
                             for m in models}))
    vocab = ", ".join(sorted({f"{m['V']:,}" for m in models}))
    widths = "/".join(str(m["d"]) for m in models)
    loss = [m["loss_delta"] for m in models]
    return {"baseline": LABEL["adamw"],
            "diameter_reduction": table3("diameter_reduction", "D"),
            "hilbert_reduction": table3("hilbert_reduction", "hilbert_rms"),
            "loss_delta": f"{min(loss):+.4f} … {max(loss):+.4f}",
            "setting": f"{'/'.join(pp['table'])} parameters (heads d {widths} × V {vocab}), Muon "
                       f"backbone, 3 seeds; baseline: the AdamW head (β₂ {adam['b2']:g}, eps "
                       f"{adam['eps']:g}) at {ratio}× the RowNorm head's rate (Table 2)"}


LABEL = {"adamw": "AdamW", "muon": "Muon", "rownorm": "projected RowNorm",
         "rownorm-rescaled": "projected RowNorm, rescaled"}
METRICS = (("final_val_loss", "final val loss"),
           ("head_step_diameter", "D(head step)"),
           ("head_step_hilbert_rms", "Hilbert RMS"),
           ("diameter_per_lr", "D(head step) ÷ head lr"))


def _value(run, key):
    if key == "diameter_per_lr":  # D(step) / head lr, mean over the last K steps (RowNorm: <= 2)
        lr = dict((s, v) for s, v in run["curves"]["head_learning_rate"])
        steps = sorted(s for s, _ in run["curves"]["head_step_diameter"])[-run["last_k"]:]
        diam = dict((s, v) for s, v in run["curves"]["head_step_diameter"])
        return float(np.mean([diam[s] / lr[s] for s in steps]))
    return run[key] if key == "final_val_loss" else run["last_k_mean"][key]


def _mean_std(xs):
    xs = np.asarray(xs, np.float64)
    return [float(xs.mean()), float(xs.std(ddof=1)) if xs.size > 1 else 0.0]


def _pm(mean, std, fmt):
    return f"{mean:{fmt}} ± {std:{fmt.lstrip('+')}}"


def summarize_heads(finals: list[dict], heads) -> dict:
    """Per head: mean/std over seeds of each metric, and paired comparisons with AdamW and Muon.

    Reductions are baseline/head (ratio of the means, and mean ± std of the per-seed ratios, seeds
    paired: same initialisation and data order); loss deltas are head - baseline.
    """
    by = {h: {r["seed"]: r for r in finals if r["head"] == h} for h in heads}
    out = {}
    for h in heads:
        if not by[h]:
            continue
        stats = {key: _mean_std([_value(r, key) for r in by[h].values()]) for key, _ in METRICS}
        entry = {"seeds": sorted(by[h]), "head_learning_rate": next(iter(by[h].values()))[
            "head_learning_rate"], "stats": stats, "vs": {}}
        for base in ("adamw", "muon"):
            common = sorted(set(by[h]) & set(by.get(base, {})))
            if not common:
                continue
            def pair(key, fn, b=by[base], x=by[h], common=common):
                return [fn(_value(b[s], key), _value(x[s], key)) for s in common]

            cmp = {"seeds": common,
                   "loss_delta": _mean_std(pair("final_val_loss", lambda b, x: x - b))}
            for key in ("head_step_diameter", "head_step_hilbert_rms"):
                base_mean = np.mean([_value(by[base][s], key) for s in common])
                head_mean = np.mean([_value(by[h][s], key) for s in common])
                cmp[key] = {"ratio_of_means": float(base_mean / head_mean),
                            "paired": _mean_std(pair(key, lambda b, x: b / x))}
            entry["vs"][base] = cmp
        out[h] = entry
    return out


def _sweep_table(sweeps, rates, heads):
    lines = ["| head | peak head lr | final val loss | D(head step), last K "
             "| Hilbert RMS, last K |",
             "|---|---|---|---|---|"]
    for h in heads:
        for r in sorted((r for r in sweeps if r["head"] == h),
                        key=lambda r: r["head_learning_rate"]):
            pick = " **(chosen)**" if rates.get(h) == r["head_learning_rate"] else ""
            m = r["last_k_mean"]
            lines.append(f"| {LABEL[h]} | {r['head_learning_rate']:g}{pick} | "
                         f"{r['final_val_loss']:.4f} | {m['head_step_diameter']:.4g} | "
                         f"{m['head_step_hilbert_rms']:.4g} |")
    return lines


def _main_table(summary, heads):
    lines = ["| head | lr | seeds | final val loss | D(head step) | Hilbert RMS | D ÷ lr |",
             "|---|---|---|---|---|---|---|"]
    for h in heads:
        if h in summary:
            e, st = summary[h], summary[h]["stats"]
            lines.append(f"| {LABEL[h]} | {e['head_learning_rate']:g} | {len(e['seeds'])} | "
                         f"{_pm(*st['final_val_loss'], '.4f')} | "
                         f"{_pm(*st['head_step_diameter'], '.4g')} | "
                         f"{_pm(*st['head_step_hilbert_rms'], '.4g')} | "
                         f"{_pm(*st['diameter_per_lr'], '.3g')} |")
    lines += ["", "Reductions (baseline ÷ head; ratio of the seed means, then mean ± std of the "
              "per-seed paired ratios) and loss cost (head − baseline, paired by seed):", "",
              "| head | vs | D reduction | Hilbert RMS reduction | Δ final val loss |",
              "|---|---|---|---|---|"]
    for h in heads:
        for base, cmp in summary.get(h, {}).get("vs", {}).items():
            if base == h:
                continue
            d, hb = cmp["head_step_diameter"], cmp["head_step_hilbert_rms"]
            lines.append(f"| {LABEL[h]} | {LABEL[base]} | {d['ratio_of_means']:.3g}× "
                         f"({_pm(*d['paired'], '.3g')}) | {hb['ratio_of_means']:.3g}× "
                         f"({_pm(*hb['paired'], '.3g')}) | "
                         f"{_pm(*cmp['loss_delta'], '+.4f')} |")
    pp = paper()
    lines.append(f"| **paper**: projected RowNorm | {pp['baseline']} | "
                 f"{pp['diameter_reduction']} | {pp['hilbert_reduction']} | "
                 f"{pp['loss_delta']} |")
    return lines


def _curves(runs, key):
    """Mean over runs at the steps all of them report."""
    series = [dict((int(s), v) for s, v in r["curves"][key]) for r in runs]
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    return steps, [float(np.mean([s[t] for s in series])) for t in steps]


def plot_curves(finals, heads, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("val_loss", "validation loss", False),
              ("head_step_diameter", "D(head step), exact", True),
              ("head_step_hilbert_rms", "Hilbert RMS of the head step (held-out h)", True))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), constrained_layout=True)
    for ax, (key, title, log) in zip(axes, panels, strict=True):
        for h in heads:
            xs, ys = _curves([r for r in finals if r["head"] == h], key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=LABEL[h])
        if log and ax.get_lines():
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.get_lines():
            ax.legend()
    fig.suptitle("final runs, mean over seeds")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(sweeps, heads, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5), constrained_layout=True)
    for h in heads:
        pts = sorted((r["head_learning_rate"], r["final_val_loss"]) for r in sweeps
                     if r["head"] == h)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=LABEL[h])
    ax.set_xscale("log")
    ax.set_xlabel("peak head learning rate")
    ax.set_ylabel("final validation loss")
    ax.set_title("learning-rate sweep (sweep seed)")
    ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(runs, *, cfg, out: Path, heads, sweep, seeds, sweep_seed, session_wall_s):
    """Write head_study.json, head_study.md and head_study_curves.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    sweeps = [r for r in runs if r["role"] == "sweep"]
    finals = [r for r in runs if r["role"] == "final"]
    rates = choose_rates(sweeps)
    summary = summarize_heads(finals, heads)
    run_wall = sum(r["wall_s"] for r in runs)
    expected = max(len(sweeps), sum(len(sweep[h]) for h in heads)) + len(heads) * len(seeds)
    result = {"config": dataclasses.asdict(cfg), "heads": list(heads),
              "sweep_grid": {h: list(sweep[h]) for h in heads}, "sweep_seed": sweep_seed,
              "sweep_tried": {h: sorted(r["head_learning_rate"] for r in sweeps
                                        if r["head"] == h) for h in heads},
              "seeds": list(seeds), "chosen_head_learning_rates": rates, "paper": paper(),
              "summary": summary, "runs_done": len(runs), "runs_planned": expected,
              "wall_s_runs_total": run_wall, "wall_s_this_session": session_wall_s,
              "runs": runs}
    (out / "head_study.json").write_text(json.dumps(result, indent=1))
    if finals:
        plot_curves(finals, heads, out / "head_study_curves.png")
    if sweeps:
        plot_sweep(sweeps, heads, out / "head_study_sweep.png")
    c, m, o = cfg, cfg.model, cfg.optim
    md = ["# LM-head geometry study (small scale, short horizon)", "",
          "Generated by `python -m studies.compare_heads`; raw records in `head_study.json`, "
          "discussion in `head_study_discussion.md`.", "",
          f"Status: {len(runs)} of {expected} runs finished. Wall time of the runs: "
          f"{run_wall / 60:.1f} min (sum over runs, on 2 CPU cores shared with other jobs).", "",
          "## Setup", "",
          f"- Model: V {m.vocab_size}, d {m.d_model}, {m.num_layers} layers, seq {c.seq_len}, "
          f"batch {c.data.batch_size}; {c.steps} steps "
          f"({c.steps * c.data.batch_size * c.seq_len:,} tokens), {o.schedule} schedule (warmup "
          f"{o.warmup_steps}, final lr {o.min_lr_ratio}× peak), weight decay {o.weight_decay}, "
          f"grad clip {o.grad_clip}.",
          f"- Corpus: {c.data.source or 'the interpreter standard library (.py files)'}; BPE "
          "vocabulary trained on the train split; validation on held-out files.",
          f"- Backbone: Muon, peak lr {o.learning_rate:g} (embeddings and vectors: AdamW, same "
          "rate). Heads: AdamW (baseline), Muon, projected RowNorm, projected RowNorm rescaled "
          "to D(step) = 2·lr exactly.",
          f"- Metrics: mean over the last K = {c.eval.probe_last_steps} steps of the exact row "
          "diameter of the head step −lr·U (without the decoupled-decay term) and of the RMS "
          "over held-out final hidden states h_n of range(−lr·U·h_n) (exact Hilbert distance, "
          f"{c.eval.hilbert_sequences}×{c.seq_len} validation positions); final validation "
          f"loss ({c.eval.batches}×{c.data.batch_size} sequences).",
          "- D ÷ lr: the head step's diameter per unit of head learning rate (last K steps), "
          "the geometry without the tuned rate: at most 2 for RowNorm by construction (every "
          "row lies at distance lr from one common centre); for the other heads it grows with "
          "the width d (sign-like AdamW steps) or the vocabulary V (Muon's polar factor), see "
          "[the geometry](../geometry.md#why-muon-and-adam-head-steps-have-large-diameters).",
          f"- Seeds {list(seeds)}; head learning rate per head by a sweep on seed {sweep_seed}.",
          "", "## Results (mean ± std over seeds)", "", *_main_table(summary, heads), "",
          f"Paper setting: {paper()['setting']}.", "",
          "![curves](head_study_curves.png)", "",
          f"## Learning-rate sweep (seed {sweep_seed}; lowest final val loss chosen)", "",
          "A factor-3 grid of peak head rates per head; when the best rate is at an edge of "
          "the rates tried, the grid is extended by one more factor in that direction (at most "
          "twice).", "",
          *_sweep_table(sweeps, rates, heads), "", "![sweep](head_study_sweep.png)", ""]
    (out / "head_study.md").write_text("\n".join(md))
    return result


def main(argv=None) -> dict:
    train.use_compilation_cache()  # the runs' steps, compiled once (by shape, not rate)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="one seed, the `test` model, 8 steps, a 2-point sweep (for CI)")
    parser.add_argument("--workdir", default=None,
                        help="run directories (default runs/head_study or runs/head_study_quick)")
    parser.add_argument("--out", default="docs/results", help="where the report is written")
    parser.add_argument("--data_source", default=None, help="corpus (default: the stdlib)")
    parser.add_argument("--data_dir", default=None, help="tokenizer cache (default WORKDIR/data)")
    parser.add_argument("--steps", type=int, default=None, help="override the number of steps")
    parser.add_argument("--last_k", type=int, default=None, help="override K (last-K averages)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--heads", nargs="+", choices=HEADS, default=list(HEADS))
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild the report from finished runs, train nothing")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or ("runs/head_study_quick" if args.quick else "runs/head_study"))
    cfg = study_config(quick=args.quick, steps=args.steps, last_k=args.last_k,
                       data_source=args.data_source,
                       data_dir=args.data_dir or str(workdir / "data"))
    seeds = tuple(args.seeds) if args.seeds else (SEEDS[:1] if args.quick else SEEDS)
    return study(cfg, workdir=workdir, out=Path(args.out), heads=tuple(args.heads),
                 sweep=QUICK_SWEEP if args.quick else SWEEP, seeds=seeds,
                 extend=0 if args.quick else SWEEP_EXTEND,
                 report_only=args.report_only)


if __name__ == "__main__":
    main()
