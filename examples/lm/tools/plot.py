"""The curves of a run: losses, head diameters and Hilbert perturbations against step, as the
trainer writes them to WORKDIR/metrics.png at the end of a run. To plot a run in progress:

    python -m examples.lm.tools.plot WORKDIR
"""

from __future__ import annotations

import argparse
import math
import os

from etils import epath

from examples.lm import metrics


def _series(records, key):
    pts = [(r["step"], r[key]) for r in records
           if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_metrics(records: list[dict], path: str | os.PathLike) -> epath.Path:
    """Write the three panels of `records` to the PNG `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("loss", [("train_loss", "train"), ("val_loss", "validation")], False),
        ("head row diameter", [("head_diameter", "D(ΔW), full change"),
                               ("head_step_diameter", "D(step), no decay"),
                               ("head_diameter_upper", "O(Vd) upper bound")], True),
        ("Hilbert perturbation (RMS over held-out h)",
         [("hilbert_rms", "full change"), ("head_step_hilbert_rms", "step, no decay")], True),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), constrained_layout=True)
    for ax, (title, keys, log) in zip(axes, panels, strict=True):
        for key, label in keys:
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, label=label, marker="." if len(xs) < 30 else None)
        if log and any(ln.get_ydata().size and min(ln.get_ydata()) > 0 for ln in ax.get_lines()):
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.get_lines():
            ax.legend()
    path = epath.Path(path)
    with path.open("wb") as f:
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
    return path


def main(argv=None) -> epath.Path:
    parser = argparse.ArgumentParser(prog="python -m examples.lm.tools.plot",
                                     description="plot WORKDIR/metrics.jsonl to metrics.png")
    parser.add_argument("workdir", help="a trainer's --workdir")
    args = parser.parse_args(argv)
    records = metrics.read_metrics(args.workdir)
    if not records:
        parser.error(f"no records in {args.workdir}/{metrics.METRICS_FILE}: pass the --workdir "
                     "of a run that has logged")
    path = plot_metrics(records, epath.Path(args.workdir) / metrics.PLOT_FILE)
    print(path)
    return path


if __name__ == "__main__":
    main()
