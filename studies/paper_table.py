"""The paper's Table 3 from training runs: `python -m studies.paper_table RUN_DIR...`.

Each RUN_DIR is a workdir of `examples/lm/train.py` (for the paper's runs, one of the 18 that
`examples/lm/tools/paper_runs.py` launches). A run is identified by the config saved in its newest
checkpoint (model shape, head, seed), never by its directory name, and read from its
`metrics.jsonl` at the final update:

- the validation loss (`val_loss`);
- D(S_T), the exact row diameter of the head increment without decoupled weight decay
  (`head_step_diameter`);
- the Hilbert RMS of that increment over the fixed validation panel (`head_step_hilbert_rms`).

Printed in Table 3's layout (arXiv 2608.22253 v2): per model and head, the mean ± sample standard
deviation over seeds; the paired loss difference RowNorm − AdamW over the seeds both heads have;
the ratios of means AdamW ÷ RowNorm of D and of the Hilbert RMS. For a model that is one of the
paper's (same width, depth and vocabulary), the paper's value stands beside each cell
(`studies.scale_ladder.PAPER_TABLE`), and the runs the paper has that are not here (seeds 0-2 of
both heads) are listed as missing. A run that stopped before its last update is listed as
unfinished and left out of the table. `--json FILE` also writes the table as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from studies.scale_ladder import PAPER_TABLE

# The keys of metrics.jsonl read at the final update (examples/lm/evaluate.py writes them).
METRICS = {"val_loss": "val_loss", "D": "head_step_diameter",
           "hilbert_rms": "head_step_hilbert_rms"}
LABELS = {"val_loss": "validation loss", "D": "D(S_T)", "hilbert_rms": "Hilbert RMS"}
HEADS = ("adamw", "rownorm")  # Table 3's two heads, in its order
PAPER_SEEDS = (0, 1, 2)
PAPER_LAYERS = 32


class RunError(ValueError):
    """A run directory that cannot be read as a finished or unfinished training run."""


def _run_config(workdir: Path) -> dict:
    """The config dict (`dataclasses.asdict(Config)`) saved with the newest checkpoint."""
    from examples.lm import checkpointing

    directory = workdir / "checkpoints"
    if not directory.is_dir():
        raise RunError(f"{workdir}: no checkpoints/ folder, so its model, head and seed are "
                       "unknown (pass a workdir of examples/lm/train.py)")
    ckpt = checkpointing.Checkpointer(directory, async_save=False)
    try:
        step = ckpt.latest_step()
        if step is None:
            raise RunError(f"{workdir}: no complete checkpoint, so its model, head and seed are "
                           "unknown")
        return ckpt.restore_meta(step)["config"]
    finally:
        ckpt.close()


def model_name(model: dict) -> str:
    """The paper's name of a model config ("190M", ...), or a shape label for any other."""
    vocab = model.get("valid_vocab_size") or model["vocab_size"]
    for name, paper in PAPER_TABLE.items():
        if (model["d_model"], model["num_layers"], vocab) == (paper["d"], PAPER_LAYERS,
                                                               paper["V"]):
            return name
    return f"d{model['d_model']}-L{model['num_layers']}-V{vocab}"


def read_run(workdir: str | Path) -> dict:
    """One run: {"model", "head", "seed", "dir", "step", "steps", "finished", metric: value}."""
    workdir = Path(workdir)
    config = _run_config(workdir)
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        raise RunError(f"{workdir}: no metrics.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    run = {"model": model_name(config["model"]), "head": config["head"], "seed": config["seed"],
           "dir": str(workdir), "steps": config["steps"],
           "step": max((r["step"] for r in records), default=0)}
    final = [r for r in records if r["step"] == config["steps"]]
    run["finished"] = bool(final)
    for key, name in METRICS.items():
        values = [r[name] for r in final if name in r]
        run[key] = values[-1] if values else None
    if run["finished"] and any(run[k] is None for k in METRICS):
        missing = [METRICS[k] for k in METRICS if run[k] is None]
        raise RunError(f"{workdir}: the final update {config['steps']} has no {missing} in "
                       "metrics.jsonl (was the probe turned off?)")
    return run


def _mean_sd(values: Sequence[float]) -> tuple[float, float | None, int]:
    sd = statistics.stdev(values) if len(values) > 1 else None
    return statistics.fmean(values), sd, len(values)


def build_table(runs: Iterable[dict]) -> dict:
    """Table 3 from `read_run` results: cells, paired differences, ratios, missing runs."""
    runs = list(runs)
    done = [r for r in runs if r["finished"]]
    seen: dict[tuple, str] = {}
    for r in done:
        key = (r["model"], r["head"], r["seed"])
        if key in seen:
            raise RunError(f"{r['dir']} and {seen[key]} are the same run ({key[0]}, head "
                           f"{key[1]}, seed {key[2]}): pass one of them")
        seen[key] = r["dir"]
    models = sorted({r["model"] for r in done}, key=_model_order)
    table: dict = {"models": {}, "unfinished": [
        f"{r['dir']} ({r['model']} {r['head']} seed {r['seed']}: step {r['step']} of "
        f"{r['steps']})" for r in runs if not r["finished"]], "missing": []}
    for model in models:
        entry: dict = {"heads": {}, "paper": model in PAPER_TABLE}
        by_head = {h: {r["seed"]: r for r in done if r["model"] == model and r["head"] == h}
                   for h in sorted({r["head"] for r in done if r["model"] == model},
                                   key=_head_order)}
        for head, seeds in by_head.items():
            entry["heads"][head] = {"seeds": sorted(seeds), **{
                k: _mean_sd([seeds[s][k] for s in sorted(seeds)]) for k in METRICS}}
        if {"adamw", "rownorm"} <= by_head.keys():
            common = sorted(by_head["adamw"].keys() & by_head["rownorm"].keys())
            if common:
                entry["loss_diff"] = _mean_sd([by_head["rownorm"][s]["val_loss"]
                                               - by_head["adamw"][s]["val_loss"] for s in common])
                entry["loss_diff_seeds"] = common
            entry["ratio"] = {k: entry["heads"]["adamw"][k][0] / entry["heads"]["rownorm"][k][0]
                              for k in ("D", "hilbert_rms")}
        table["models"][model] = entry
    for model in PAPER_TABLE:
        if model not in models:
            continue
        for head in HEADS:
            have = table["models"][model]["heads"].get(head, {}).get("seeds", [])
            table["missing"] += [f"{model} {head} seed {s}" for s in PAPER_SEEDS if s not in have]
    return table


def _model_order(name: str) -> tuple:
    return (0, list(PAPER_TABLE).index(name)) if name in PAPER_TABLE else (1, name)


def _head_order(head: str) -> tuple:
    return (HEADS.index(head), head) if head in HEADS else (len(HEADS), head)


def paper_values(model: str) -> dict:
    """The paper's Table 3 entries for `model`: cells, paired differences and ratios."""
    p = PAPER_TABLE[model]
    return {"heads": {h: {k: p[k][h] for k in METRICS} for h in HEADS},
            "ratio": {k: p[k]["adamw"][0] / p[k]["rownorm"][0] for k in ("D", "hilbert_rms")}}


# Table 3's paired differences (RowNorm - AdamW), which its per-head cells do not determine.
PAPER_LOSS_DIFF = {"190M": (0.0153, 0.0027), "380M": (0.0091, 0.0007), "640M": (0.0057, 0.0012)}


def _cell(value: tuple, digits: int = 4) -> str:
    mean, sd = value[0], value[1]
    if sd is None:
        return f"{mean:.{digits}g} (1 seed)"
    return f"{mean:.{digits}g} ± {sd:.2g}"


def format_table(table: dict) -> str:
    """Markdown: Table 3's layout with the paper's values beside the runs' own."""
    lines = ["| model | head | seeds | " + " | ".join(
        f"{LABELS[k]} | paper" for k in METRICS) + " |",
        "|---|---|---|" + "---|---|" * len(METRICS)]
    for model, entry in table["models"].items():
        paper = paper_values(model) if entry["paper"] else None
        for head, cell in entry["heads"].items():
            row = [model, head, ",".join(map(str, cell["seeds"]))]
            for k in METRICS:
                row.append(_cell(cell[k]))
                row.append(_cell(paper["heads"][head][k]) if paper and head in HEADS else "")
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| model | loss RowNorm − AdamW (paired) | paper | D ratio AdamW ÷ RowNorm | "
              "paper | Hilbert RMS ratio | paper |", "|---|---|---|---|---|---|---|"]
    for model, entry in table["models"].items():
        if "ratio" not in entry:
            continue
        paper = paper_values(model) if entry["paper"] else None
        diff = entry.get("loss_diff")
        row = [model, (f"{diff[0]:+.4f} ± {diff[1]:.2g}" if diff and diff[1] is not None
                       else f"{diff[0]:+.4f} (1 seed)" if diff else "no common seed"),
               f"{PAPER_LOSS_DIFF[model][0]:+.4f} ± {PAPER_LOSS_DIFF[model][1]:.2g}"
               if paper else ""]
        for k in ("D", "hilbert_rms"):
            row += [f"{entry['ratio'][k]:.3g}", f"{paper['ratio'][k]:.3g}" if paper else ""]
        lines.append("| " + " | ".join(row) + " |")
    if table["missing"]:
        lines += ["", "Missing (the paper has them): " + "; ".join(table["missing"]) + "."]
    if table["unfinished"]:
        lines += ["", "Unfinished, left out: " + "; ".join(table["unfinished"]) + "."]
    return "\n".join(lines)


def _jsonable(table: dict) -> dict:
    def fix(x):
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [fix(v) for v in x]
        if isinstance(x, float) and not math.isfinite(x):
            return repr(x)
        return x
    return fix(table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m studies.paper_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="training workdirs")
    parser.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    args = parser.parse_args(argv)
    try:
        runs = [read_run(d) for d in args.runs]
        table = build_table(runs)
    except RunError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if not table["models"]:
        parser.exit(2, f"{parser.prog}: error: no run reached its final update "
                       f"({'; '.join(table['unfinished'])})\n")
    print(format_table(table))
    if args.json:
        Path(args.json).write_text(json.dumps(_jsonable(table), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
