"""Head-geometry scale ladder: how the head-step diameter and Hilbert perturbation of AdamW,
Muon and projected RowNorm heads grow with the width d and the vocabulary V.

    python -m studies.scale_ladder --plan      # every run with its estimated cost, and the total
    python -m studies.scale_ladder             # run (or resume) the ladder, then write the report
    python -m studies.scale_ladder --report-only   # rebuild the report from finished runs
    python -m studies.scale_ladder --refit docs/results/scale_ladder.json   # from stored records
    python -m studies.scale_ladder --quick --workdir /tmp/q --out /tmp/q/out   # seconds (CI)
    python -m studies.scale_ladder --time-shapes   # re-measure the per-step costs behind --plan

Same recipe as the head study (`studies/compare_heads.py`, whose run driver and summaries
this reuses): Muon backbone, cosine schedule, a BPE trained on the standard library, the exact
last-K head-step diameter and Hilbert RMS on held-out hidden states. The ladder:

- widths d ∈ {128, 256, 512, 768} at V 4096; vocabularies V ∈ {4096, 16384, 50304} at d 256
  (a BPE of each size, cached per size); and a thin point d 768, V 50304 on a one-layer
  backbone (`POINTS`): the paper's 380M head width at a vocabulary of the GPT-2 size padded to
  50,304 (its own BPE, every row a token). The paper's head shapes are d 512 / 768 / 1024 at
  V 50,257 (`PAPER_SHAPES`): the report predicts there, beside the paper's measured values
  (`PAPER_TABLE`, Tables 1-3 of the paper). Layers 2, head dim 32, MLP 3d, sequence 64, batch 16,
  100 steps (warm-up 10, cosine), last-5-step means.
- heads (`HEADS`): AdamW; Muon RMS-matched (the library's `scale="rms"`, step RMS 0.2); Muon
  spectral-scaled (`scale="spectral"`: polar factor × sqrt(fan_out/fan_in) = sqrt(V/d)); projected
  RowNorm. The spectral head is trained as the RMS-matched Muon head at rate `lr·SPECTRAL(d)`,
  `SPECTRAL(d) = sqrt(V/d) / (0.2·sqrt(max(d, V))) = 5/sqrt(d)` for V >= d, with head weight decay
  `wd / SPECTRAL(d)`: the update `-(lr·s)(U_rms + (wd/s)·W) = -lr·(U_spectral + wd·W)` is exactly
  the spectral-scaled one (the backbone keeps `scale="rms"`); its records carry the nominal rate.
- protocols (`PROTOCOLS`):
  (a) `equal`: every head at `EQUAL_LR`.
  (b) `tuned`: a sweep (`SWEEP`, one seed, grid extended once past an edge) at the two
      `SWEEP_POINTS` (d 128 and d 256 at V 4096); each head's best rate is carried along the
      ladder by `lr(d) = lr(128)·(d/128)^α`, α = log(lr(256)/lr(128)) / log 2 (α = 0 when the
      two agree), and unchanged along V (the sweep measures no V dependence: an assumption).
  (c) `matched`: AdamW and Muon heads at the rate whose last-K head-step diameter equals
      RowNorm's: one calibration (the tuned run on the point's first seed) then a linear rescale
      `lr_c = lr_tuned · D_rownorm / D_head` (D scales about linearly with the rate; the report
      gives the achieved ratio D_head / D_rownorm of the matched runs).
  (d) `robust`: at `ROBUST_POINT`, each head at `ROBUST_MULTIPLIERS` × its tuned rate on 3
      seeds: final loss, loss-spike onsets (`ladder_fit.count_spikes`) and divergence.
- seeds per point: `SEEDS_BY_POINT` (2 at the two sweep points, 1 elsewhere); which protocols
  run where: `PROTOCOLS_BY_POINT` (tuned, matched and robust at the sweep points only). The
  comment above those constants says why; `--plan` prices the whole grid.

Every run leaves `WORKDIR/<point>/<role>-<head>-lr<lr>-s<seed>/result.json` (plus `ladder.json`
with the ladder's extra per-run numbers); a rerun skips finished runs and restarts an interrupted
one from scratch, so a killed ladder resumes where it stopped. The report is
`scale_ladder.{json,md}` and `scale_ladder_*.png` under `--out` (docs/results), rewritten after
every run; it contains only what finished runs measured and fits to them: every cell as mean ±
std over its seeds, reductions and loss differences per seed pair, fits on per-seed points, and
whether each difference is larger than the seed spread (`studies.ladder_report`), and, beside the
predictions at the paper's head shapes, the paper's own published values (`PAPER_TABLE`: its
final-update D ÷ lr, ratios and the AdamW head's ceiling, computed there). `--refit JSON`
rebuilds the report from the run records stored in a `scale_ladder.json`, training nothing.
`--baseline` (default `docs/results/scale_ladder_baseline.json`, the one-seed run committed with
the first results) adds that run's seeds per cell, reductions and predictions next to the
current ones:

    python -m studies.scale_ladder --report-only --workdir WORKDIR --out docs/results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np

from examples.lm import configs, metrics, train
from studies import compare_heads, ladder_fit, ladder_report


@dataclasses.dataclass(frozen=True, order=True)
class Point:
    """One ladder shape: width, vocabulary, backbone layers."""

    d: int
    V: int
    layers: int = 2

    @property
    def name(self) -> str:
        return f"d{self.d}-V{self.V}-L{self.layers}"


WIDTH_V, VOCAB_D = 4096, 256
WIDTHS = (128, 256, 512, 768)
VOCABS = (4096, 16384, 50304)
THIN = Point(768, 50304, 1)
POINTS = tuple(sorted({*(Point(d, WIDTH_V) for d in WIDTHS), *(Point(VOCAB_D, v) for v in VOCABS),
                       THIN}))
# The grid is cut to fit one ~2 h session of a 2-core machine (`--plan` prices every run):
# 100 steps per run; 2 seeds at the two cheap sweep points, 1 elsewhere; the tuned-rate, matched
# and robustness protocols only at the sweep points; the thin d 768 × V 50304 point without the
# spectral-scaled Muon head (its direction is the RMS-matched head's: only the rate differs).
SEEDS_BY_POINT = {Point(128, 4096): (1, 2), Point(256, 4096): (1, 2),
                  Point(512, 4096): (1,), Point(768, 4096): (1,),
                  Point(256, 16384): (1,), Point(256, 50304): (1,), THIN: (1,)}
HEADS = ("adamw", "muon", "muon-spectral", "rownorm")
HEADS_BY_POINT = {THIN: ("adamw", "muon", "rownorm")}
PROTOCOLS = ("equal", "tuned", "matched", "robust")
PROTOCOLS_BY_POINT = {p: ("equal",) for p in POINTS
                      if p not in (Point(128, 4096), Point(256, 4096))}
EQUAL_LR = 0.018  # the head study's tuned AdamW / Muon rate; RowNorm's was 0.03
SWEEP_POINTS = (Point(128, 4096), Point(256, 4096))
SWEEP = {"adamw": (6e-3, 1.8e-2, 5.4e-2), "muon": (6e-3, 1.8e-2, 5.4e-2),
         "muon-spectral": (1.8e-2, 5.4e-2, 0.162), "rownorm": (1e-2, 3e-2, 9e-2)}
SWEEP_SEED = 100
ROBUST_POINT = Point(128, 4096)
ROBUST_MULTIPLIERS = (1 / 9, 1 / 3, 1.0, 3.0, 9.0, 27.0)
ROBUST_SEEDS = (1, 2, 3)  # seed-major: seed 1 on every head and rate first
ROOT = Path(__file__).resolve().parents[1]
# The one-seed run committed with issue 12's results, the report's "before" (`--baseline`).
BASELINE = ROOT / "docs" / "results" / "scale_ladder_baseline.json"
# The paper's published values (arXiv 2608.22253 v2, section "Pretraining experiments"):
# Table 1's head shapes (width d, GPT-2 vocabulary V = 50,257), Table 2's peak head rates and
# recipe, Table 3's final-update results as (mean, sample sd) over seeds 0, 1, 2. Every
# comparison with the paper on the report is computed from these numbers (`ladder_report.paper`).
PAPER_TABLE = {
    "190M": {"d": 512, "V": 50257, "updates": 7083,
             "peak_lr": {"adamw": 4.0e-3, "rownorm": 3.2e-3},
             "val_loss": {"adamw": (3.1588, 0.0027), "rownorm": (3.1741, 0.0031)},
             "D": {"adamw": (2.870e-2, 0.140e-2), "rownorm": (6.369e-4, 0.009e-4)},
             "hilbert_rms": {"adamw": (9.076e-2, 0.605e-2), "rownorm": (7.506e-3, 0.017e-3)}},
    "380M": {"d": 768, "V": 50257, "updates": 14464,
             "peak_lr": {"adamw": 2.667e-3, "rownorm": 2.133e-3},
             "val_loss": {"adamw": (2.9403, 0.0019), "rownorm": (2.9494, 0.0024)},
             "D": {"adamw": (2.303e-2, 0.324e-2), "rownorm": (4.241e-4, 0.015e-4)},
             "hilbert_rms": {"adamw": (7.732e-2, 0.874e-2), "rownorm": (5.667e-3, 0.024e-3)}},
    "640M": {"d": 1024, "V": 50257, "updates": 24406,
             "peak_lr": {"adamw": 2.0e-3, "rownorm": 1.6e-3},
             "val_loss": {"adamw": (2.8156, 0.0024), "rownorm": (2.8213, 0.0033)},
             "D": {"adamw": (1.895e-2, 0.368e-2), "rownorm": (3.1856e-4, 0.0029e-4)},
             "hilbert_rms": {"adamw": (7.555e-2, 0.382e-2), "rownorm": (4.955e-3, 0.025e-3)}},
}
# Table 2's recipe, as far as the comparison needs it: every rate warms up, then follows a cosine
# to 10 % of its peak at the final update T (so Table 3's D is a step at 0.1 × the peak rate);
# 256 sequences × 2,048 tokens per update; the AdamW head's betas and eps.
PAPER_RECIPE = {"final_lr_fraction": 0.1, "tokens_per_update": 256 * 2048,
                "adamw_head": {"b1": 0.9, "b2": 0.999, "eps": 1e-10}}
# The paper's head shapes (190M / 380M / 640M): predictions are made here.
PAPER_SHAPES = {name: (m["d"], m["V"]) for name, m in PAPER_TABLE.items()}
# The AdamW head of the committed ladder runs (2026-11-30 / 12-01): rowgeom.AdamOptions' defaults
# then, a record of what those runs trained with (not read from the library, whose defaults may
# change after them).
RUNS_ADAMW_HEAD = {"b1": 0.9, "b2": 0.95, "eps": 1e-8}

# Per-step wall time (s) of the jitted train step, measured by `--time-shapes`
# (examples/lm/tools/benchmark.py: median of 4 steps after 2, seq 64, batch 16) on 2 otherwise
# idle CPU cores, 2026-11-30 13:31 UTC (under a running test suite the same steps took 1.2-3x
# longer). Keyed by (d, V, layers, head kind).
STEP_COST_S = {
    "128,4096,2,adamw": 0.151, "128,4096,2,muon": 0.135, "128,4096,2,rownorm": 0.152,
    "256,4096,2,adamw": 0.258, "256,4096,2,muon": 0.277, "256,4096,2,rownorm": 0.252,
    "256,16384,2,adamw": 0.513, "256,16384,2,muon": 0.676, "256,16384,2,rownorm": 0.676,
    "256,50304,2,adamw": 1.257, "256,50304,2,muon": 1.593, "256,50304,2,rownorm": 1.23,
    "512,4096,2,adamw": 1.047, "512,4096,2,muon": 1.126, "512,4096,2,rownorm": 0.974,
    "768,4096,2,adamw": 2.717, "768,4096,2,muon": 3.073, "768,4096,2,rownorm": 2.749,
    "768,50304,1,adamw": 3.651, "768,50304,1,muon": 6.742, "768,50304,1,rownorm": 3.396}
# Seconds of one exact head-step diameter (O(V²d), rowgeom.row_diameter) per (d, V), same run.
PROBE_COST_S = {
    "128,4096": 0.021, "256,4096": 0.038, "256,16384": 0.475, "256,50304": 4.561,
    "512,4096": 0.072, "768,4096": 0.134, "768,50304": 11.825}
RUN_OVERHEAD_S = 25.0  # compile, tokenizer cache load, evaluations (head study: ~25 s per run)

QUICK = dict(points=(Point(32, 512), Point(64, 512), Point(32, 1024), Point(64, 1024, 1)),
             width_v=512, vocab_d=32, thin=Point(64, 1024, 1),
             sweep_points=(Point(32, 512), Point(64, 512)),
             sweep={"adamw": (6e-3, 1.8e-2), "muon": (6e-3, 1.8e-2),
                    "muon-spectral": (1.8e-2, 5.4e-2), "rownorm": (3e-2, 9e-2)},
             robust_point=Point(32, 512), robust_multipliers=(1 / 3, 3.0), robust_seeds=(1,),
             seeds=(1,))


@dataclasses.dataclass(frozen=True)
class Ladder:
    """Everything that defines a ladder (the full one, `--quick`, or a test's)."""

    points: tuple
    width_v: int
    vocab_d: int
    thin: Point
    sweep_points: tuple
    sweep: dict
    robust_point: Point
    robust_multipliers: tuple
    robust_seeds: tuple
    seeds_by_point: dict
    protocols_by_point: dict = dataclasses.field(default_factory=dict)
    heads_by_point: dict = dataclasses.field(default_factory=dict)
    heads: tuple = HEADS
    protocols: tuple = PROTOCOLS
    equal_lr: float = EQUAL_LR
    sweep_seed: int = SWEEP_SEED
    sweep_extend: int = 1
    quick: bool = False

    def seeds(self, point: Point) -> tuple:
        return self.seeds_by_point[point]

    def heads_at(self, point: Point) -> tuple:
        return tuple(h for h in self.heads if h in self.heads_by_point.get(point, HEADS))

    def runs_protocol(self, protocol: str, point: Point) -> bool:
        return (protocol in self.protocols
                and protocol in self.protocols_by_point.get(point, PROTOCOLS))


def full_ladder(**over) -> Ladder:
    return Ladder(points=POINTS, width_v=WIDTH_V, vocab_d=VOCAB_D, thin=THIN,
                  sweep_points=SWEEP_POINTS, sweep=SWEEP, robust_point=ROBUST_POINT,
                  robust_multipliers=ROBUST_MULTIPLIERS, robust_seeds=ROBUST_SEEDS,
                  seeds_by_point=SEEDS_BY_POINT, protocols_by_point=PROTOCOLS_BY_POINT,
                  heads_by_point=HEADS_BY_POINT, **over)


def quick_ladder(**over) -> Ladder:
    q = dict(QUICK)
    seeds = q.pop("seeds")
    return Ladder(**q, seeds_by_point={p: seeds for p in q["points"]}, sweep_extend=0,
                  quick=True, **over)


def restrict(ladder: Ladder, *, points=None, max_seeds=None) -> Ladder:
    """The ladder on a subset of its points and/or its first `max_seeds` seeds (same workdir)."""
    if points is not None:
        names = {p.name: p for p in ladder.points}
        unknown = sorted(set(points) - set(names))
        if unknown:
            raise SystemExit(f"--points: unknown {unknown}; the ladder's points are "
                             f"{sorted(names)}")
        ladder = dataclasses.replace(ladder, points=tuple(p for p in ladder.points
                                                          if p.name in points))
    if max_seeds is not None:
        if max_seeds < 1:
            raise SystemExit(f"--max-seeds: expected a positive integer, got {max_seeds}")
        ladder = dataclasses.replace(
            ladder, seeds_by_point={p: s[:max_seeds] for p, s in ladder.seeds_by_point.items()},
            robust_seeds=ladder.robust_seeds[:max_seeds])
    return ladder


def point_config(point: Point, *, quick: bool, data_dir: str | None = None,
                 data_source=None, steps: int | None = None) -> configs.Config:
    """The run config of a ladder point (head, rate and seed are set per run)."""
    if quick:
        base = configs.override(configs.get_config("test"), {
            "steps": 8, "optim.warmup_steps": 2, "eval.every": 4, "eval.probe_last_steps": 3,
            "log_every": 1, "eval.hilbert_sequences": 2})
        heads = max(1, point.d // 16)
    else:
        base = configs.override(configs.get_config("cpu-tiny"), {
            "model.max_seq_len": 64, "data.batch_size": 16, "steps": 100,
            "optim.warmup_steps": 10, "eval.every": 50, "eval.batches": 8,
            "eval.hilbert_sequences": 8, "eval.probe_last_steps": 5, "log_every": 2})
        heads = point.d // 32
    over = {k: v for k, v in {"data.source": data_source, "data.dir": data_dir,
                              "steps": steps}.items() if v is not None}
    exact = base.eval.exact_diameter_max_elements
    return configs.override(base, {
        "model.vocab_size": point.V, "model.d_model": point.d, "model.num_layers": point.layers,
        "model.num_heads": heads, "model.mlp_dim": 3 * point.d, "checkpoint.every": 10**9,
        "checkpoint.keep": 1,
        # exact O(V²d) diameter up to the thin point's head (larger: the O(Vd) upper bracket)
        "eval.exact_diameter_max_elements": max(exact, point.V * point.d), **over})


def spectral_factor(point: Point) -> float:
    """Muon's spectral scale ÷ its RMS scale for a (d, V) head kernel (fan_in d, fan_out V)."""
    return math.sqrt(point.V / point.d) / (0.2 * math.sqrt(max(point.d, point.V)))


def _lr(x: float) -> float:
    return float(f"{x:.4g}")


# ----------------------------------------------------------------------------- one run


def run_dir(workdir: Path, point: Point, head: str, lr: float, seed: int) -> Path:
    """`WORKDIR/<point>/<role>-<example head>-lr<trained rate>-s<seed>` (compare_heads' names)."""
    kind, eff_lr = _trained_as(point, head, lr)
    eff_lr = float(f"{eff_lr:.6g}")
    return workdir / point.name / compare_heads.run_name(_role(head), kind, eff_lr, seed)


def _role(head: str) -> str:
    return "spectral" if head == "muon-spectral" else "run"


def _trained_as(point: Point, head: str, lr: float):
    """(example head, rate the example trains with) of a ladder head at nominal rate lr."""
    if head == "muon-spectral":
        return "muon", lr * spectral_factor(point)
    return head, lr


def _extras(rundir: Path, cfg: configs.Config, k: int) -> dict:
    """Ladder numbers compare_heads' summary leaves out: tightness, spikes, divergence."""
    records = metrics.read_metrics(rundir)
    last = [r for r in records if r["step"] > cfg.steps - k and "head_step_diameter" in r]
    tight = [r["head_step_hilbert_tightness"] for r in last
             if "head_step_hilbert_tightness" in r]
    warm = cfg.effective_warmup()
    train_loss = [r["train_loss"] for r in records if "train_loss" in r and r["step"] > warm]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {"tightness": float(np.mean(tight)) if tight else None,
            "loss_spikes": ladder_fit.count_spikes(train_loss),
            "diverged": ladder_fit.diverged(val, vocab=cfg.model.vocab_size),
            "diameter_exact": (cfg.model.d_model * cfg.model.vocab_size
                               <= cfg.eval.exact_diameter_max_elements)}


def run_point(ladder: Ladder, workdir: Path, point: Point, head: str, lr: float, seed: int, *,
              data_source=None, steps=None, report_only=False,
              log=print) -> dict | None:
    """Train (or load) one run; return its ladder record, or None (report_only, not run)."""
    lr = _lr(lr)
    rundir = run_dir(workdir, point, head, lr, seed)
    extra = rundir / "ladder.json"
    cfg = point_config(point, quick=ladder.quick, data_source=data_source, steps=steps,
                       data_dir=str(workdir / "data" / f"V{point.V}"))
    if extra.exists():
        done = json.loads(extra.read_text())
        if done["steps"] != cfg.steps:  # run names do not carry the horizon: never mix two
            raise ValueError(f"{extra} is a {done['steps']}-step run but this ladder trains "
                             f"{cfg.steps} steps; use another --workdir (or the same --steps)")
        if (rundir / "metrics.jsonl").exists():  # the current spike and divergence rules
            done.update(_extras(rundir, cfg, done["last_k"]))
        return done
    if report_only:
        return None
    kind, eff_lr = _trained_as(point, head, lr)
    eff_lr = float(f"{eff_lr:.6g}")
    if head == "muon-spectral":
        cfg = configs.override(cfg, {"optim.head_weight_decay": cfg.optim.weight_decay
                                     / spectral_factor(point)})
    record = compare_heads.run_one(cfg, rundir.parent, role=_role(head), head=kind, lr=eff_lr,
                                   seed=seed, log=log)
    scale = eff_lr / lr  # per-lr numbers are per unit of the nominal rate
    # the same per-step ratios as the head study's D ÷ lr, for the diameter and the Hilbert RMS
    lrs = dict((s, v) for s, v in record["curves"]["head_learning_rate"])
    k = record["last_k"]

    def per_lr(key):
        pts = sorted(record["curves"][key])[-k:]
        return float(np.mean([v / lrs[s] for s, v in pts])) * scale

    out = {"point": dataclasses.asdict(point), "head": head, "lr": lr, "seed": seed,
           "trained_as": {"head": kind, "lr": eff_lr},
           "steps": cfg.steps, "last_k": k, "wall_s": record["wall_s"],
           "final_val_loss": record["final_val_loss"],
           "D": record["last_k_mean"]["head_step_diameter"],
           "hilbert_rms": record["last_k_mean"]["head_step_hilbert_rms"],
           "D_per_lr": per_lr("head_step_diameter"),
           "hilbert_rms_per_lr": per_lr("head_step_hilbert_rms"),
           "val_loss_curve": record["curves"]["val_loss"],
           **_extras(rundir, cfg, k)}
    tmp = extra.with_suffix(".tmp")  # atomic: a kill never leaves half a record behind
    tmp.write_text(json.dumps(out))
    tmp.replace(extra)
    shutil.rmtree(rundir / "checkpoints", ignore_errors=True)  # up to ~0.6 GB each at V 50304
    return out


# ----------------------------------------------------------------------------- protocols


def _best(runs: list[dict]) -> float | None:
    ok = [r for r in runs if np.isfinite(r["final_val_loss"])]
    return min(ok, key=lambda r: r["final_val_loss"])["lr"] if ok else None


def carry_rule(best: dict) -> dict:
    """Tuned-rate rule per head from the sweep's best rates {point: rate}: (lr0, d0, α)."""
    (p0, r0), *rest = sorted(best.items())
    if not rest:
        return {"lr0": r0, "d0": p0.d, "alpha": 0.0}
    p1, r1 = rest[-1]
    alpha = math.log(r1 / r0) / math.log(p1.d / p0.d) if r1 != r0 else 0.0
    return {"lr0": r0, "d0": p0.d, "alpha": alpha}


def tuned_rate(rule: dict, point: Point) -> float:
    return _lr(rule["lr0"] * (point.d / rule["d0"]) ** rule["alpha"])


class Driver:
    """Runs the protocols in order, each as far as finished results allow (`report_only`)."""

    def __init__(self, ladder: Ladder, workdir: Path, *, data_source=None, steps=None,
                 report_only=False, log=print):
        self.ladder, self.workdir, self.log = ladder, Path(workdir), log
        self.kw = dict(data_source=data_source, steps=steps, report_only=report_only, log=log)
        self.runs: dict[str, list[dict]] = {p: [] for p in (*PROTOCOLS, "sweep")}
        self.rules: dict[str, dict] = {}
        self.trained = 0  # runs this session trained (not loaded from their records)

    def get(self, protocol, point, head, lr, seed):
        rundir = run_dir(self.workdir, point, head, _lr(lr), seed)
        done = (rundir / "ladder.json").exists()
        r = run_point(self.ladder, self.workdir, point, head, lr, seed, **self.kw)
        self.trained += r is not None and not done
        if r is not None:
            self.runs[protocol].append({**r, "protocol": protocol})
        return r

    def equal(self):
        L = self.ladder
        for point in L.points:
            for seed in L.seeds(point) if L.runs_protocol("equal", point) else ():
                for head in L.heads_at(point):
                    self.get("equal", point, head, L.equal_lr, seed)

    def sweep(self):
        L = self.ladder
        for head in L.heads:
            best = {}
            for point in L.sweep_points:
                grid = sorted(L.sweep[head])
                mine = [r for lr in grid
                        if (r := self.get("sweep", point, head, lr, L.sweep_seed)) is not None]
                complete = len(mine) == len(grid)  # every grid rate finished
                step = grid[-1] / grid[-2] if len(grid) > 1 else 3.0
                for _ in range(L.sweep_extend if complete else 0):
                    b, tried = _best(mine), sorted(r["lr"] for r in mine)
                    if b is None or tried[0] < b < tried[-1]:
                        break  # best inside the rates tried
                    r = self.get("sweep", point, head,  # best at an edge: one rate past it
                                 b * step if b == tried[-1] else b / step, L.sweep_seed)
                    if r is None:
                        complete = False  # report-only, the edge run not finished yet
                        break
                    mine.append(r)
                if complete and (b := _best(mine)) is not None:
                    best[point] = b
            if len(best) == len(L.sweep_points):
                self.rules[head] = carry_rule(best) | {
                    "best": {p.name: v for p, v in best.items()}}

    def tuned(self):
        L = self.ladder
        for point in L.points:
            for seed in L.seeds(point) if L.runs_protocol("tuned", point) else ():
                for head in L.heads_at(point):
                    if head in self.rules:
                        self.get("tuned", point, head, tuned_rate(self.rules[head], point), seed)

    def matched(self):
        L = self.ladder
        if "rownorm" not in self.rules:
            return
        for point in (p for p in L.points if L.runs_protocol("matched", p)):
            seeds = L.seeds(point)
            ref = {r["head"]: r for r in self.runs["tuned"]
                   if Point(**r["point"]) == point and r["seed"] == seeds[0]}
            if "rownorm" not in ref:
                continue
            for seed in seeds:
                self.get("matched", point, "rownorm", ref["rownorm"]["lr"], seed)
                for head in L.heads:
                    if head != "rownorm" and head in ref:
                        lr = ref[head]["lr"] * ref["rownorm"]["D"] / ref[head]["D"]
                        if not (np.isfinite(lr) and lr > 0):  # a diverged calibration run
                            self.log(f"{point.name} {head}: no matched rate (calibration "
                                     f"D {ref[head]['D']})")
                            continue
                        self.get("matched", point, head, lr, seed)

    def robust(self):
        L = self.ladder
        for seed in L.robust_seeds:
            for head in L.heads:
                if head not in self.rules:
                    continue
                base = tuned_rate(self.rules[head], L.robust_point)
                for m in L.robust_multipliers:
                    r = self.get("robust", L.robust_point, head, base * m, seed)
                    if r is not None:
                        self.runs["robust"][-1]["multiplier"] = m

    def run(self, report):
        """Run every protocol in order, calling `report()` after each stage that trained a run
        (the page follows a long study as it goes; a stage that only read finished records
        changes nothing a rerun's final report would not show)."""
        stages = [("equal", self.equal), ("sweep", self.sweep), ("tuned", self.tuned),
                  ("matched", self.matched), ("robust", self.robust)]
        for name, stage in stages:
            if name == "sweep" and not {"tuned", "matched", "robust"} & set(self.ladder.protocols):
                continue
            if name in PROTOCOLS and name not in self.ladder.protocols:
                continue
            trained = self.trained
            stage()
            if self.trained > trained:
                report()


# ----------------------------------------------------------------------------- plan and costs


def _cost_key(point: Point, head: str) -> str:
    kind = {"muon-spectral": "muon"}.get(head, head)
    return f"{point.d},{point.V},{point.layers},{kind}"


def estimate_s(ladder: Ladder, point: Point, head: str, costs=None, probes=None,
               steps=None) -> float | None:
    """Estimated wall seconds of one run, from the measured per-step and per-probe costs."""
    costs = STEP_COST_S if costs is None else costs
    probes = PROBE_COST_S if probes is None else probes
    step = costs.get(_cost_key(point, head))
    if step is None:
        return None
    cfg = point_config(point, quick=ladder.quick, steps=steps)
    n_probe = cfg.eval.probe_last_steps + cfg.steps // cfg.eval.every
    probe = probes.get(f"{point.d},{point.V}", 0.0) * 2  # step and full change
    return cfg.steps * step + n_probe * probe + RUN_OVERHEAD_S


def plan(ladder: Ladder, steps=None) -> list[dict]:
    """Every run of the ladder; tuned/matched/robust rates are symbolic until the sweep ends."""
    L, rows = ladder, []

    def add(protocol, point, head, rate, seed):
        rows.append({"protocol": protocol, "point": point.name, "head": head, "rate": rate,
                     "seed": seed, "est_s": estimate_s(L, point, head, steps=steps)})

    for p in L.points:
        for s in L.seeds(p) if L.runs_protocol("equal", p) else ():
            for h in L.heads_at(p):
                add("equal", p, h, f"{L.equal_lr:g}", s)
    for p in L.sweep_points:
        for h in L.heads:
            for lr in L.sweep[h]:
                add("sweep", p, h, f"{lr:g}", L.sweep_seed)
            if L.sweep_extend:
                add("sweep (edge, if needed)", p, h, "edge ×3", L.sweep_seed)
    for p in L.points:
        for s in L.seeds(p):
            for h in L.heads_at(p):
                if L.runs_protocol("tuned", p):
                    add("tuned", p, h, "tuned (rule)", s)
                if h != "rownorm" and L.runs_protocol("matched", p):
                    add("matched", p, h, "tuned·D_rn/D_head", s)
    for s in L.robust_seeds if "robust" in L.protocols else ():
        for h in L.heads:
            for m in L.robust_multipliers:
                if m != 1.0:  # multiplier 1 is the tuned run on the same seed
                    add("robust", L.robust_point, h, f"tuned×{m:.3g}", s)
    return rows


def print_plan(ladder: Ladder, out=print, steps=None) -> float:
    rows = plan(ladder, steps)
    out(f"{'protocol':<24}{'point':<18}{'head':<15}{'rate':<20}{'seed':>5}{'est':>9}")
    total = 0.0
    for r in rows:
        est = r["est_s"]
        total += est or 0.0
        out(f"{r['protocol']:<24}{r['point']:<18}{r['head']:<15}{r['rate']:<20}{r['seed']:>5}"
            f"{'?' if est is None else f'{est / 60:.1f} min':>9}")
    by = {}
    for r in rows:
        key = (r["point"], r["protocol"].split()[0])
        by[key] = by.get(key, 0.0) + (r["est_s"] or 0.0)
    out("hours by point and protocol: " + "; ".join(
        f"{p} {proto} {v / 3600:.2f}" for (p, proto), v in sorted(by.items())))
    missing = sum(r["est_s"] is None for r in rows)
    out(f"{len(rows)} runs (the sweep's edge runs only if a best rate is at an edge; matched "
        f"RowNorm runs are the tuned ones); estimated total {total / 3600:.2f} h on 2 CPU cores"
        + (f", {missing} runs without a measured cost" if missing else ""))
    seeds = ", ".join(f"{p.name}: {len(ladder.seeds(p))}" for p in ladder.points)
    out(f"seeds per point: {seeds}; robustness: {len(ladder.robust_seeds)} seeds at "
        f"{ladder.robust_point.name}")
    return total


def time_shapes(ladder: Ladder, *, steps: int = 4, log=print) -> dict:
    """Measure the per-step cost of every distinct (shape, head kind) and the exact probe."""
    import jax

    import rowgeom
    from examples.lm.tools.benchmark import benchmark

    costs, probes = {}, {}
    for point in ladder.points:
        for head in ("adamw", "muon", "rownorm"):
            cfg = configs.override(point_config(point, quick=ladder.quick), {"head": head})
            costs[_cost_key(point, head)] = benchmark(
                cfg, steps=steps, print_fn=lambda *a: None)["step_s"]
            log(f"{point.name} {head}: {costs[_cost_key(point, head)]:.3f} s/step")
        x = jax.random.normal(jax.random.key(0), (point.d, point.V))
        f = jax.jit(lambda x: rowgeom.row_diameter(x, vocab_axis=1))
        f(x).block_until_ready()
        t0 = time.perf_counter()
        f(x).block_until_ready()
        probes[f"{point.d},{point.V}"] = time.perf_counter() - t0
        log(f"{point.name} exact diameter: {probes[f'{point.d},{point.V}']:.3f} s")
    return {"step_cost_s": costs, "probe_cost_s": probes}


# ----------------------------------------------------------------------------- entry point


def load_baseline(path: Path | None) -> dict | None:
    """A baseline for the report (`ladder_report.baseline_from_report`), or None without one.

    The file is either such a baseline or a whole earlier `scale_ladder.json` (then cut)."""
    if path is None:
        return None
    data = json.loads(Path(path).read_text())
    if "source" not in data:
        data = ladder_report.baseline_from_report(data, source=str(path))
    return data


def ladder_study(ladder: Ladder, *, workdir: Path, out: Path, data_source=None, steps=None,
                 report_only=False, baseline: dict | None = None, log=print) -> dict:
    """Run (or resume) the ladder and write the report; return the report's JSON content."""
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    driver = Driver(ladder, workdir, data_source=data_source, steps=steps,
                    report_only=report_only, log=log)
    result = {}

    def report():
        nonlocal result
        result = ladder_report.write_report(
            driver.runs, rules=driver.rules, ladder=ladder, out=out,
            config=dataclasses.asdict(point_config(ladder.points[0], quick=ladder.quick,
                                                   steps=steps)),
            session_wall_s=time.perf_counter() - t0, baseline=baseline)

    driver.run(report)
    report()
    return result


def refit(stored: Path, *, out: Path, baseline: dict | None = None, ladder: Ladder | None = None,
          log=print) -> dict:
    """Rebuild the report from the run records stored in an earlier report (`scale_ladder.json`),
    training nothing and reading no run directory: the measured tables are the stored runs',
    the fits and predictions are recomputed (at the current `PAPER_SHAPES`)."""
    t0 = time.perf_counter()
    data = json.loads(Path(stored).read_text())
    if ladder is None:
        ladder = quick_ladder() if data["quick"] else full_ladder()
    runs = {p: list(rs) for p, rs in data["runs"].items()}
    n = sum(len(v) for v in runs.values())
    log(f"refit: {n} run records from {stored}, nothing trained")

    def shapes(s):
        return ", ".join(f"{name} d {d} × V {v:,}" for name, (d, v) in s.items())

    # the shapes the stored runs were last predicted at before any refit (kept across refits)
    old = (data.get("refit") or {}).get("paper_shapes_before", data.get("paper_shapes", {}))
    old = {k: tuple(v) for k, v in old.items()}
    where = ("unchanged" if old == PAPER_SHAPES else
             f"before: {shapes(old)}" if old else "new on this page")
    thin = ladder.thin
    note = (f"**How this page was made.** Rebuilt by `python -m studies.scale_ladder --refit "
            f"{_shown(stored)}` from the {n} run records stored in that file: no run was "
            "trained or retrained. Recomputed from those records: every table, fit and figure, "
            f"and the predictions at the paper's head shapes, {shapes(PAPER_SHAPES)} ({where}). "
            "Not rerun: the runs themselves, so every measured number is the stored one, "
            f"including the thin point {thin.name} (d {thin.d} × V {thin.V:,}; not one of the "
            "paper's head shapes).")
    return ladder_report.write_report(
        runs, rules=data["tuned_rate_rules"], ladder=ladder, out=Path(out),
        config=data["config_first_point"], session_wall_s=time.perf_counter() - t0,
        baseline=baseline, provenance=(note,),
        refit={"from": _shown(stored), "paper_shapes_before": old})


def _shown(path: Path) -> str:
    """A path as the page shows it: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def main(argv=None):
    train.use_compilation_cache()  # the runs' steps, compiled once (by shape, not rate)
    parser = argparse.ArgumentParser(prog="python -m studies.scale_ladder",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny grid (4 points of the `test` model, 8 steps, 1 seed): seconds")
    parser.add_argument("--plan", action="store_true",
                        help="print every run with its estimated cost and the total; train nothing")
    parser.add_argument("--time-shapes", action="store_true",
                        help="measure the per-step cost of each shape (for STEP_COST_S)")
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild the report from finished runs, train nothing")
    parser.add_argument("--refit", default=None, metavar="JSON",
                        help="rebuild the report from the run records stored in an earlier "
                             "scale_ladder.json (no run directory needed, nothing trained): "
                             "the fits and predictions at the current paper shapes")
    parser.add_argument("--workdir", default=None,
                        help="run directories (default runs/scale_ladder[_quick])")
    parser.add_argument("--out", default=None,
                        help="report directory (default docs/results; --quick: WORKDIR/report)")
    parser.add_argument("--data_source", default=None, help="corpus (default: the stdlib)")
    parser.add_argument("--steps", type=int, default=None, help="override steps per run")
    parser.add_argument("--heads", nargs="+", choices=HEADS, default=list(HEADS))
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    parser.add_argument("--points", nargs="+", default=None, metavar="NAME",
                        help="only these points (names as in --plan, e.g. d128-V4096-L2): run "
                             "the cheap points first, the costly ones later, into one workdir")
    parser.add_argument("--max-seeds", type=int, default=None,
                        help="at most this many seeds per point and for the robustness grid")
    parser.add_argument("--baseline", default=None, metavar="JSON",
                        help="an earlier run's records to compare against (seeds per cell, "
                             "reductions, predictions); default for the full ladder: "
                             f"{BASELINE.relative_to(ROOT)} when it exists; 'none' for no "
                             "baseline")
    args = parser.parse_args(argv)
    make = quick_ladder if args.quick else full_ladder
    ladder = restrict(make(heads=tuple(args.heads), protocols=tuple(args.protocols)),
                      points=args.points, max_seeds=args.max_seeds)
    if args.plan:
        return print_plan(ladder, steps=args.steps)
    if args.time_shapes:
        measured = time_shapes(ladder)
        print(json.dumps(measured, indent=1))
        return measured
    if args.baseline is None:
        baseline = BASELINE if not args.quick and BASELINE.exists() else None
    else:
        baseline = None if args.baseline == "none" else Path(args.baseline)
    if args.refit is not None:
        return refit(Path(args.refit), out=Path(args.out or "docs/results"),
                     baseline=load_baseline(baseline), ladder=ladder)
    workdir = Path(args.workdir or ("runs/scale_ladder_quick" if args.quick
                                    else "runs/scale_ladder"))
    out = Path(args.out or (workdir / "report" if args.quick else "docs/results"))
    return ladder_study(ladder, workdir=workdir, out=out, data_source=args.data_source,
                        steps=args.steps, report_only=args.report_only,
                        baseline=load_baseline(baseline))


if __name__ == "__main__":
    main()
