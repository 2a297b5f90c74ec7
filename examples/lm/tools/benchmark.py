"""Time the trainer's step with and without the optimizer: `python -m examples.lm.train
--benchmark N` (and `studies/scale_ladder.py`, which times steps with `benchmark`)."""

from __future__ import annotations

import time

import jax
import numpy as np

from examples.lm import configs, sharding
from examples.lm.train import Trainer


def benchmark(cfg: configs.Config, *, steps: int = 20, print_fn=print) -> dict:
    """Time the jitted step with and without the optimizer update, interleaved, on one batch.

    Both variants run the forward and backward pass on the same batch; the difference is the
    optimizer (rowgeom.lm_optimizer + clipping) and the parameter update. Timings alternate
    between the two so machine noise hits both alike; medians are reported.
    """
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    trainer = Trainer(cfg, mesh)
    rng = np.random.default_rng(0)
    batch = rng.integers(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.seq_len + 1),
                         dtype=np.int32)
    lo, hi = sharding.process_rows(len(batch), mesh)  # this process's rows of it
    with jax.set_mesh(mesh):
        inputs = sharding.global_batch(batch[lo:hi, :-1], mesh, batch_size=len(batch))
        targets = sharding.global_batch(batch[lo:hi, 1:], mesh, batch_size=len(batch))
        state = trainer.init()
        full, grad_only = [], []
        for i in range(steps + 2):
            t0 = time.perf_counter()
            state, loss = trainer.train_step(state, inputs, targets, trainer.rates)
            loss.block_until_ready()
            t1 = time.perf_counter()
            jax.block_until_ready(trainer.grad_step(state, inputs, targets))
            t2 = time.perf_counter()
            if i >= 2:  # the first two include compilation
                full.append(t1 - t0)
                grad_only.append(t2 - t1)
    full_s, grad_s = float(np.median(full)), float(np.median(grad_only))
    result = {"step_s": full_s, "grad_only_s": grad_s,
              "optimizer_share": (full_s - grad_s) / full_s,
              "tokens_per_sec": cfg.data.batch_size * cfg.seq_len / full_s}
    print_fn(f"step {full_s * 1e3:.1f} ms, forward+backward only {grad_s * 1e3:.1f} ms "
             f"(median of {steps}, interleaved): optimizer share {result['optimizer_share']:.1%}, "
             f"{result['tokens_per_sec']:.0f} tokens/s")
    return result
