"""The paper's pretraining protocol in miniature, on a CPU: `python -m studies.paper_protocol`.

arXiv 2608.22253's Table 3 compares the AdamW head with the projected-RowNorm head on three
models trained by one recipe (Table 2), three seeds each. This study applies the same rules at a
scale two CPU cores finish in well under an hour:

- the paper's block (`configs.paper_config`'s model switches: query/key RMS norm, no norm gains,
  N(0, 0.02²) everywhere, untied, RoPE 10,000, RMSNorm eps 1e-6), at width `D_MODEL`, depth
  `LAYERS`, heads of 64, SwiGLU 4d, on the interpreter's standard library tokenised by a BPE of
  `VOCAB` tokens (the largest vocabulary whose rows all get trained in this many tokens);
- the paper's recipe (`configs.paper_config("190m", head).optim`): Nesterov Muon 8e-3 scaled by
  √max(1, fan_out/fan_in), AdamW embedding 4e-3 (0.9, 0.999) eps 1e-10, clip 1.0, warmup
  floor(0.1 T) then cosine to 10 % of every peak; the AdamW head with decay 0.1, the RowNorm head
  with a bias-corrected EMA 0.95 and no decay;
- the head rates scaled from Table 2 as the paper scales them across its sizes: the AdamW head's
  ∝ 1/d from 4e-3 at d = 512, RowNorm's 0.8 × AdamW's;
- the paper's diagnostics: the exact D of the head step without decay every 10 updates and at
  the last, the Hilbert RMS over a fixed validation panel and the validation loss on a fixed
  validation prefix at evaluations and at the last update;
- 2 heads × `SEEDS`, then `studies.paper_table` over the six runs.

Every run leaves `WORKDIR/<head>-s<seed>/` (a workdir of examples/lm/train.py, with its own
wall time and the machine's load average in `study.json`; a finished one is reused, an
interrupted one restarted). The report, `paper_protocol.{md,json}` under `--out`
(docs/results), is generated from the runs and carries their wall time. A RowNorm run also
records how far rowgeom's projected step is from the uncentred one the authors' code takes
(`eval.centring`, on in the paper's RowNorm configs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from examples.lm import configs, metrics, train
from studies import paper_table
from studies.scale_ladder import PAPER_TABLE

HEADS = ("adamw", "rownorm")
SEEDS = (0, 1, 2)
D_MODEL, LAYERS, VOCAB, SEQ_LEN, BATCH = 128, 4, 8192, 128, 16
STEPS = 600
PAPER_D = 512  # Table 2's head rates are given at 190M, d = 512; the AdamW head's scales as 1/d
ROWNORM_TO_ADAMW = 0.8  # Table 2: 3.2e-3 / 4.0e-3 at every size


def head_rate(head: str, d_model: int) -> float:
    """The head's peak rate at width `d_model`, scaled from Table 2 (190M: d 512)."""
    adamw = configs.PAPER_MODELS["190m"].adamw_head_lr * PAPER_D / d_model
    return adamw if head == "adamw" else ROWNORM_TO_ADAMW * adamw


def study_config(head: str, seed: int, *, quick: bool = False, steps: int | None = None,
                 data_source=None, data_dir=None) -> configs.Config:
    """One run of the miniature: the paper's block and recipe, shrunk (see the module doc)."""
    paper = configs.paper_config("190m", head)
    if quick:
        d, layers, vocab, seq, batch, total = 64, 2, 512, 32, 8, 12
    else:
        d, layers, vocab, seq, batch, total = D_MODEL, LAYERS, VOCAB, SEQ_LEN, BATCH, STEPS
    total = steps or total
    model = dataclasses.replace(
        paper.model, vocab_size=vocab, valid_vocab_size=None, d_model=d, num_layers=layers,
        num_heads=d // 64, mlp_dim=4 * d, max_seq_len=seq, compute_dtype="float32",
        scan_layers=False, remat="none", loss_chunk=32 if seq >= 64 else None)
    cfg = configs.override(paper, {
        "steps": total, "seed": seed, "data.batch_size": batch,
        "data.source": data_source, "data.dir": data_dir,
        "optim.warmup_steps": total // 10, "optim.grad_accum_steps": 1,
        "optim.head_learning_rate": head_rate(head, d),
        "eval.every": max(total // 4, 1), "eval.tokens": None,
        "eval.batches": 4 if quick else 32, "eval.hilbert_sequences": 2 if quick else 16,
        "eval.diameter_every": 10, "checkpoint.every": 10**9, "checkpoint.keep": 1,
        "log_every": 10})
    return dataclasses.replace(cfg, model=model).validate()


STUDY_FILE = "study.json"  # per run: its wall seconds and the load average around it


def run_one(cfg: configs.Config, rundir: Path, log) -> dict:
    """Train one run unless finished already; its `STUDY_FILE` record."""
    done = rundir / STUDY_FILE
    if done.exists():
        return json.loads(done.read_text())
    if rundir.exists():  # interrupted: start again from scratch
        shutil.rmtree(rundir)
    log(f"[{time.strftime('%H:%M:%S')}] {rundir.name}")
    load, t0 = os.getloadavg()[0], time.perf_counter()
    try:
        train.train(cfg, rundir, progress=False, print_fn=lambda *a: None)
    except train.Preempted as stop:  # exit status 0; the relaunch trains this run again
        log(f"    preempted at step {stop.step}: the study stops here; rerun the same command")
        raise
    record = {"wall_s": time.perf_counter() - t0, "load_average": [load, os.getloadavg()[0]]}
    done.write_text(json.dumps(record))
    last = metrics.read_metrics(rundir)[-1]
    log(f"    {record['wall_s']:.0f} s  val_loss {last['val_loss']:.4f}  "
        f"D {last['head_step_diameter']:.4g}  hilbert_rms {last['head_step_hilbert_rms']:.4g}")
    return record


def _per_run(rundir: Path, cfg: configs.Config) -> dict:
    """The extra per-run numbers: final D ÷ final head rate, and the centring's size."""
    records = metrics.read_metrics(rundir)
    last = [r for r in records if r["step"] == cfg.steps and "head_step_diameter" in r][-1]
    final_lr = cfg.optim.head_learning_rate * cfg.optim.min_lr_ratio
    out = {"D_over_lr": last["head_step_diameter"] / final_lr}
    centring = [r for r in records if "centring_ratio" in r]
    if centring:  # ||projected step - uncentred step||_F / ||projected step||_F, and D of both
        out["centring_ratio"] = (min(r["centring_ratio"] for r in centring),
                                 max(r["centring_ratio"] for r in centring))
        out["uncentred_over_projected_D"] = max(
            abs(r["uncentred_step_diameter"] / r["head_step_diameter"] - 1) for r in centring)
    return out


def write_report(table: dict, extras: dict, *, cfg: configs.Config, wall_s: float,
                 load: tuple[float, float], out: Path, quick: bool) -> None:
    m = cfg.model
    params = _params(cfg)
    tokens = cfg.steps * cfg.data.batch_size * cfg.seq_len
    paper_rows = ["| model | head | validation loss | D(S_T) | Hilbert RMS |",
                  "|---|---|---|---|---|"]
    for name, p in PAPER_TABLE.items():
        for head in HEADS:
            paper_rows.append(
                f"| {name} | {head} | {p['val_loss'][head][0]:.4f} ± {p['val_loss'][head][1]:.4f} "
                f"| {p['D'][head][0]:.4g} ± {p['D'][head][1]:.2g} "
                f"| {p['hilbert_rms'][head][0]:.4g} ± {p['hilbert_rms'][head][1]:.2g} |")
    ratio_lines = []
    for head in HEADS:
        vals = [extras[k]["D_over_lr"] for k in extras if k.startswith(head)]
        if vals:
            ratio_lines.append(f"- {head}: D ÷ final head rate {statistics.fmean(vals):.3g} "
                               f"(seeds {', '.join(f'{v:.3g}' for v in vals)})")
    centring = [v for v in extras.values() if "centring_ratio" in v]
    text = f"""# The paper's protocol in miniature

Generated by `python -m studies.paper_protocol{' --quick' if quick else ''}` (do not edit by
hand); {len(extras)} runs in {wall_s / 60:.1f} min of wall time on 2 CPU cores that other jobs
shared (1-minute load average {load[0]:.1f} to {load[1]:.1f} around the runs).

The paper's block and recipe (arXiv 2608.22253 v2, Tables 1-2) at d {m.d_model}, {m.num_layers}
blocks of {m.num_heads} head(s) of 64, SwiGLU {m.mlp_dim}, vocabulary {m.vocab_size:,} (a BPE of
the interpreter's standard library), context {cfg.seq_len}: {params:,} parameters, {cfg.steps:,}
updates of {cfg.data.batch_size} × {cfg.seq_len} tokens ({tokens:,} tokens, {tokens / params:.2f}
per parameter; the paper trains 20). Head rates scaled from Table 2 as the paper scales them:
AdamW {head_rate('adamw', m.d_model):.3g} (4e-3 × 512 / d), RowNorm
{head_rate('rownorm', m.d_model):.3g} (0.8 × AdamW). Seeds {', '.join(map(str, SEEDS))}.

## This study (`python -m studies.paper_table` over its runs)

{paper_table.format_table(table)}

D ÷ the final head rate (10 % of the peak): the paper's RowNorm head has 2 by construction and
its AdamW head about 72 (190M).

{chr(10).join(ratio_lines)}
""" + (f"""
The RowNorm head here is rowgeom's projected RowNorm (centre, normalise, centre); the authors'
code normalises the EMA rows without the centrings. At the evaluations of
{len(centring)} RowNorm run(s), the difference between the two steps is
{min(c["centring_ratio"][0] for c in centring):.3g} to
{max(c["centring_ratio"][1] for c in centring):.3g} of the step (Frobenius norm): one common
row, which an untied softmax head's outputs do not see; their row diameters D differ by at
most {max(c["uncentred_over_projected_D"] for c in centring):.2g} (relative).
""" if centring else "") + f"""
## The paper (Table 3: mean ± sample sd over seeds 0-2, final update)

{chr(10).join(paper_rows)}

## What differs, and what moves with scale

This is the paper's recipe on a model {PAPER_TABLE['190M']['d'] // m.d_model}× narrower and
8× shallower than its smallest, with a vocabulary {PAPER_TABLE['190M']['V'] / m.vocab_size:.1f}×
smaller, trained on {tokens / params:.2f} rather than 20 tokens per parameter, on Python source
rather than FineWeb, with its own data order and a Hilbert panel of
{cfg.eval.hilbert_sequences} × {cfg.seq_len} validation positions (the paper: 8,192). The
RowNorm head's D ÷ rate is 2 at every scale (each row moves by the rate, and projection keeps
the diameter within the budget), so its D and Hilbert RMS follow the rate schedule. The AdamW
head's D ÷ rate grows with the vocabulary and with training length (rare tokens' rows get
large, uneven AdamW steps; the paper's 72 at V 50,257 after 7,083 updates), so the AdamW ÷
RowNorm ratios of D and Hilbert RMS, and the loss difference, are expected to move towards the
paper's values with V, d and tokens per parameter (the paper's own loss difference shrinks
with size, 0.0153 to 0.0057). The miniature shows the direction and the RowNorm head's exact
budget; it is not a reproduction of the paper's magnitudes.
"""
    out.mkdir(parents=True, exist_ok=True)
    (out / "paper_protocol.md").write_text(text)
    (out / "paper_protocol.json").write_text(json.dumps(
        {"table": paper_table._jsonable(table), "runs": extras, "wall_s": wall_s,
         "params": params, "tokens": tokens, "config": dataclasses.asdict(cfg)}, indent=1) + "\n")


def _params(cfg: configs.Config) -> int:
    from examples.lm.tools import train_compile

    return train_compile.param_count(cfg.model)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m studies.paper_protocol",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/rowgeom-paper-protocol")
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--quick", action="store_true", help="a tiny model, a few steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--data-source", default=None)
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    data_dir = str(workdir / "tokens")
    runs, extras, studied = [], {}, []
    for head in HEADS:
        for seed in args.seeds:
            cfg = study_config(head, seed, quick=args.quick, steps=args.steps,
                               data_source=args.data_source, data_dir=data_dir)
            rundir = workdir / f"{head}-s{seed}"
            studied.append(run_one(cfg, rundir, print))
            runs.append(paper_table.read_run(rundir))
            extras[rundir.name] = _per_run(rundir, cfg)
    table = paper_table.build_table(runs)
    print(paper_table.format_table(table))
    loads = [x for r in studied for x in r["load_average"]]
    write_report(table, extras, cfg=cfg, wall_s=sum(r["wall_s"] for r in studied),
                 load=(min(loads), max(loads)), out=Path(args.out), quick=args.quick)
    return table


if __name__ == "__main__":
    main()
