"""Metric sinks: DIR/metrics.jsonl, TensorBoard event files (a local DIR only), a PNG plot.

Floats round-trip exactly; every value but the wall-clock ones (`tokens_per_sec`, `sec_per_step`,
`mfu`) is a deterministic function of the run, so a resumed run writes the same records as an
uninterrupted one. Only process 0 writes.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np
from etils import epath

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "metrics.png"
log = logging.getLogger(__name__)


# Dense bf16 FLOP/s per chip or GPU by `device_kind` prefix (lower case), from the vendors' data
# sheets: the trainer's MFU is model FLOPs/s over this times the device count; an unknown device
# (a CPU, a new chip) has none rather than a guess. ("tpu v5 lite" is a v5e, "tpu v6 lite" a v6e;
# the H100 figure is the SXM part's.)
PEAK_FLOPS = {
    "tpu v4": 275e12, "tpu v5 lite": 197e12, "tpu v5e": 197e12, "tpu v5p": 459e12,
    "tpu v5": 459e12, "tpu v6 lite": 918e12, "tpu v6e": 918e12, "tpu7x": 2307e12,
    "nvidia h200": 989e12, "nvidia h100": 989e12, "nvidia gh200": 989e12,
    "nvidia b200": 2250e12, "nvidia a100": 312e12, "nvidia l4": 121e12, "nvidia a10g": 125e12,
}


def peak_flops(device=None) -> float | None:
    """Peak bf16 FLOP/s of `device` (default: the first device), or None when unknown."""
    kind = (device or jax.devices()[0]).device_kind.lower()
    # Longest prefix first, so "tpu v5 lite" wins over "tpu v5".
    for prefix in sorted(PEAK_FLOPS, key=len, reverse=True):
        if kind.startswith(prefix):
            return PEAK_FLOPS[prefix]
    return None


def _plain(value):
    """JSON-ready Python scalars (numpy/JAX scalars -> float/int, exactly)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)) or getattr(value, "shape", None) == ():
        return float(value)
    return value


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
    """The records of DIR/metrics.jsonl, in order ([] when there is none); see `_records`."""
    path = epath.Path(workdir) / METRICS_FILE
    if not path.exists():
        return []
    return [record for _, record in _records(path, path.read_text())]


def _records(path: epath.Path, text: str) -> list[tuple[str, dict]]:
    """(line, record) for each line of `text`, the metrics.jsonl at `path`. A last line cut
    short (a full disk, a machine stopped mid-write) is left out with a warning: the run that
    resumes redoes its step. An unreadable line before the last is damage: an error naming the
    file and the line."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    out = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a record with a step")
        except ValueError as e:
            if number < len(lines):
                raise ValueError(f"{path}, line {number}, is not a metrics record ({e}): "
                                 "move the file away to start a new one") from None
            log.warning("%s: its last line is cut short (%s); leaving it out", path, e)
            break
        out.append((line, record))
    return out


class MetricsWriter:
    """Appends metric records to jsonl and TensorBoard; `enabled=False` makes every call a no-op."""

    def __init__(self, workdir: str | os.PathLike, *, enabled: bool = True):
        self.workdir = epath.Path(workdir)
        self.tensorboard = "://" not in os.fspath(workdir)
        self.enabled = enabled
        self._tb = None
        self._purge_step = None  # set by truncate_after: TensorBoard drops the old run's points
        if enabled:
            self.workdir.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        """Drop records with step > `step`, which a resumed run is about to redo: from
        metrics.jsonl, and from TensorBoard by a `purge_step` in the next event file."""
        if not self.enabled:
            return
        if self.tensorboard and (self.workdir / TENSORBOARD_DIR).exists():
            self._purge_step = step + 1
        path = self.workdir / METRICS_FILE
        if not path.exists():
            return
        text = path.read_text()
        kept = "".join(line + "\n" for line, record in _records(path, text)
                       if record["step"] <= step)
        if kept != text:  # records to redo, or a last line cut short (appends would join it)
            tmp = self.workdir / (METRICS_FILE + ".tmp")
            tmp.write_text(kept)
            tmp.replace(path)

    def clear(self) -> list[str]:
        """Delete metrics.jsonl, metrics.png and the TensorBoard events (--overwrite); return the
        names deleted."""
        if not self.enabled:
            return []
        self.close()
        deleted = []
        for name in (METRICS_FILE, PLOT_FILE):
            if (self.workdir / name).exists():
                (self.workdir / name).unlink()
                deleted.append(name)
        if (self.workdir / TENSORBOARD_DIR).exists():
            (self.workdir / TENSORBOARD_DIR).rmtree()
            deleted.append(TENSORBOARD_DIR + "/")
        self._purge_step = None
        return deleted

    def write(self, record: dict) -> None:
        """Append `record` (with a `step`) to jsonl and log it to TensorBoard."""
        if not self.enabled:
            return
        record = {k: _plain(v) for k, v in record.items()}
        step = record["step"]
        path, line = self.workdir / METRICS_FILE, json.dumps(record) + "\n"
        if not self.tensorboard:  # remote: object stores cannot append; rewrite the small file
            path.write_text((path.read_text() if path.exists() else "") + line)
            return
        with path.open("a") as f:
            f.write(line)
        if self._tb is None:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=str(self.workdir / TENSORBOARD_DIR),
                                     purge_step=self._purge_step)
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def plot(self) -> epath.Path | None:
        """Write DIR/metrics.png: losses, head diameters and Hilbert perturbations against step."""
        if not self.enabled:
            return None
        from examples.lm.tools.plot import plot_metrics

        return plot_metrics(read_metrics(self.workdir), self.workdir / PLOT_FILE)
