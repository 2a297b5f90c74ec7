"""The example's CPU train step with and without the chunked loss, timed side by side.

One process, one CPU device, the `cpu-tiny` and `cpu-small` configs: the jitted, donated train
step (`examples/lm/train.py`) of each variant (`--model.loss_chunk` none, i.e. all the logits
at once, against the configs' chunk and others) applied to its own previous state on the same
batch, the variants interleaved round after round, the best of the rounds kept. Ratios are the
variant's best time over the unchunked one's.

Run: `python benchmarks/bench_lm_step.py` (`--docs`: rewrite its
block of docs/benchmarks.md; `--json PATH`; `--rounds N`).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import numpy as np
import provenance  # beside this script

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.lm import configs  # noqa: E402
from examples.lm import sharding as mesh_lib  # noqa: E402
from examples.lm.train import Trainer  # noqa: E402

BLOCK = "lm-step"
CHUNKS = (None, 64, 32, 16)


class _Step:
    """One variant's jitted step, state and batch, timed one call at a time."""

    def __init__(self, cfg: configs.Config, mesh):
        self.trainer, self.mesh = Trainer(cfg, mesh), mesh
        rng = np.random.default_rng(0)
        batch = rng.integers(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.seq_len + 1),
                             dtype=np.int32)
        lo, hi = mesh_lib.process_rows(len(batch), mesh)  # this process's rows of it
        with jax.set_mesh(mesh):
            self.inputs = mesh_lib.global_batch(batch[lo:hi, :-1], mesh, batch_size=len(batch))
            self.targets = mesh_lib.global_batch(batch[lo:hi, 1:], mesh, batch_size=len(batch))
            self.state = self.trainer.init()
        self.times: list[float] = []
        self.time()  # compile

    def time(self) -> None:
        with jax.set_mesh(self.mesh):
            start = time.perf_counter()
            self.state, loss = self.trainer.train_step(self.state, self.inputs, self.targets,
                                                          self.trainer.rates)
            loss.block_until_ready()
        self.times.append(time.perf_counter() - start)


def run(rounds: int) -> dict:
    env = provenance.environment(provenance.load_average())
    mesh = mesh_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    out = {}
    for name in ("cpu-tiny", "cpu-small"):
        base = configs.override(configs.get_config(name), {"mesh.data": 1})
        steps = {c: _Step(configs.override(base, {"model.loss_chunk": c}), mesh) for c in CHUNKS}
        for _ in range(rounds):
            for step in steps.values():
                step.time()
        best = {c: min(s.times[1:]) for c, s in steps.items()}
        out[name] = {"default": base.model.loss_chunk, "best_s": best,
                     "tokens": base.data.batch_size * base.seq_len,
                     "vocab": base.model.vocab_size}
    out["environment"] = provenance.finish(env) | {"rounds": rounds}
    return out


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [provenance.header(f"python benchmarks/bench_lm_step.py --rounds {env['rounds']} "
                               "--docs", env), "",
             f"The best of {env['rounds']} interleaved rounds each.", "",
             "| config (tokens per step, V) | " + " | ".join(
                 "all logits at once" if c is None else f"chunks of {c}" for c in CHUNKS) + " |",
             "|---|" + "---|" * len(CHUNKS)]
    for name, r in results.items():
        if name == "environment":
            continue
        plain = r["best_s"][None]
        cells = [f"{r['best_s'][c] * 1e3:.0f} ms ({r['best_s'][c] / plain:.2f}x)"
                 + (" (the config's)" if c == r["default"] else "") for c in CHUNKS]
        lines.append(f"| {name} ({r['tokens']}, {r['vocab']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    provenance.add_arguments(parser, BLOCK)
    args = parser.parse_args()
    results = run(args.rounds)
    provenance.publish(args, BLOCK, markdown(results), results)


if __name__ == "__main__":
    main()
