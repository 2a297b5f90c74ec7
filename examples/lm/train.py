"""Train the example language model with rowgeom.lm_optimizer, measuring the head step's geometry.

Run from the repository root, as a module:

    python -m examples.lm.train                      # cpu-tiny, on CPU
    python -m examples.lm.train --config cpu-small --steps 3000 --head adamw --workdir runs/a
    python -m examples.lm.train --workdir runs/a     # rerun on a workdir: resume its latest one
    python -m examples.lm.train --config 190m --mesh.fsdp 8 --workdir gs://bucket/run
    python -m examples.lm.train --data.source 'fineweb10B/*.bin' --data.tokenizer gpt2/tok.json

Every config field is a flag named by its dotted path (`--model.d_model 64`; configs.py, flags.py).
`train(cfg, workdir)` is the loop: `run.start` (config, checkpoint, mesh, data) -> restore or init
-> `_Loop.step` (train, evaluate, probe the head, log, save) -> the plot and a summary line. A run
is preemption-safe: SIGTERM saves a checkpoint at the current step and exits 0, and the same
command resumes it, following the run's saved config. `main` is the command line.
"""

from __future__ import annotations

import sys

if __package__ in (None, ""):  # `python examples/lm/train.py`: the package is not importable
    print("train.py: error: run it as a module from the repository root: "
          "python -m examples.lm.train ...", file=sys.stderr)
    raise SystemExit(2)

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from examples.lm import batches, configs, evaluate, flags, metrics, resume, run, throughput
from examples.lm import mesh as mesh_lib
from examples.lm import model as model_lib
from examples.lm.benchmark import benchmark
from examples.lm.optimizer import lr_schedule
from examples.lm.run import UsageError
from examples.lm.trainer import Trainer

# The head probe's validation sequences use a fixed seed, independent of the training seed, so
# runs are comparable (the validation set itself is the start of the validation split).
PROBE_SEED = 0x5EED + 1


def train(cfg: configs.Config, workdir, *, overwrite: bool = False, change_horizon: bool = False,
          explicit=None, stop_after: int | None = None, progress: bool = True,
          print_fn=print) -> dict:
    """Train `cfg` in `workdir` (local or remote, e.g. gs://); return the last evaluation record.

    A workdir with checkpoints is resumed from the latest complete one, following the run's
    saved config (see `resume.resolve_config`; `explicit` names the fields the caller set, as
    dotted paths, None = all). overwrite: delete the checkpoints and metrics and start fresh.
    change_horizon: accept a new `steps` on resume. stop_after: stop after this many optimizer
    steps without a final save, as if interrupted (the schedule still follows `cfg.steps`); for
    tests of exact resumption. On SIGTERM the run saves a checkpoint at the current step and
    returns. Problems with the config, the data or the workdir raise `UsageError`.
    """
    workdir = os.fspath(workdir)
    lead = jax.process_index() == 0
    out = print_fn if lead else (lambda *a, **k: None)
    setup = run.start(cfg, workdir, explicit=explicit, overwrite=overwrite,
                      change_horizon=change_horizon, out=out)
    cfg = setup.cfg
    trainer = Trainer(cfg, setup.mesh)
    writer = metrics.MetricsWriter(workdir, enabled=lead)
    if overwrite:
        writer.clear()
    state = run.restore_or_init(setup, trainer, out)
    start = int(jax.device_get(state["micro_step"])) // cfg.optim.grad_accum_steps
    writer.truncate_after(start)
    run.describe(setup, trainer, state, out)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    loop = _Loop(setup, trainer, writer)
    bar = _progress(total=cfg.steps, initial=start, enabled=progress and lead)
    preemption = resume.PreemptionWatcher(setup.ckpt)
    try:
        with jax.set_mesh(setup.mesh):
            for step in range(start + 1, end + 1):
                state, record = loop.step(state, step)
                if record:
                    bar.set_postfix(loss=f"{record['train_loss']:.4f}",
                                    tok_s=f"{record['tokens_per_sec']:.0f}")
                saved = loop.maybe_save(state, step)
                bar.update(1)
                if step < end and preemption.reached(step):
                    loop.save_on_preemption(state, step, saved, out)
                    end = step
                    break
    finally:
        preemption.close()
        bar.close()
        setup.ckpt.close()
        writer.close()
    return _finish(loop.last_eval, finished=end == cfg.steps, writer=writer, workdir=workdir,
                   lead=lead, out=out)


class _Batches:
    """Global batches from a BatchSampler or ValidationSet, sharded over the mesh's data axes."""

    def __init__(self, source, mesh, *, replicated=False):
        self.source, self.mesh = source, mesh
        self.sharding = (mesh_lib.replicated(mesh) if replicated
                         else mesh_lib.batch_sharding(mesh))

    def get(self, index):
        put = lambda x: jax.make_array_from_process_local_data(self.sharding, x)
        return tuple(put(x) for x in self.source.get(index))


def _sampler(tokens, cfg, *, batch_size, seed, replicated=False):
    share = (0, 1) if replicated else (jax.process_index(), jax.process_count())
    return batches.BatchSampler(tokens, batch_size=batch_size, seq_len=cfg.seq_len, seed=seed,
                                process_index=share[0], process_count=share[1],
                                vocab_size=cfg.model.num_tokens)


def _scalar(x) -> float:
    return float(np.asarray(jax.device_get(x)))


class _Loop:
    """One optimizer step after another: train, probe the head, evaluate, log, save."""

    def __init__(self, setup: run.Run, trainer: Trainer, writer: metrics.MetricsWriter):
        cfg, mesh = setup.cfg, setup.mesh
        self.setup, self.cfg, self.trainer, self.writer = setup, cfg, trainer, writer
        self.accum = cfg.optim.grad_accum_steps
        self.train_batches = _Batches(
            _sampler(setup.tokens.train, cfg, batch_size=cfg.data.batch_size, seed=cfg.seed),
            mesh)
        self.val_batches = _Batches(setup.val_set, mesh)
        self.probe_inputs = _Batches(
            _sampler(setup.tokens.val, cfg, batch_size=cfg.eval.hilbert_sequences,
                     seed=PROBE_SEED, replicated=True), mesh, replicated=True).get(0)[0]
        self.tokens_per_step = cfg.data.batch_size * cfg.seq_len * self.accum
        self.flops_per_token = model_lib.flops_per_token(cfg.model)
        self.peak_flops = throughput.peak_flops()
        self.lr = lr_schedule(cfg.optim.learning_rate, cfg)
        self.last_eval: dict = {}
        self.window_start, self.window_steps = time.perf_counter(), 0

    def step(self, state, step: int):
        """Apply optimizer step `step` (1-based); return (state, the record logged or {})."""
        cfg, trainer = self.cfg, self.trainer
        is_eval = step % cfg.eval.every == 0 or step == cfg.steps
        is_probe = not is_eval and step > cfg.steps - cfg.eval.probe_last_steps
        every = cfg.eval.diameter_every
        # The head step's diameter alone, where no probe measures it anyway.
        is_diameter = (not (is_eval or is_probe) and every > 0
                       and (step % every == 0 or step == cfg.steps))
        head_old = (trainer.head_of(state["params"], state["rest"])
                    if is_eval or is_probe or is_diameter else None)
        losses = []
        for micro in range(self.accum):
            inputs, targets = self.train_batches.get((step - 1) * self.accum + micro)
            state, loss = trainer.train_step(state, inputs, targets)
            losses.append(loss)
        self.window_steps += 1
        if not (is_eval or is_probe or is_diameter or step % cfg.log_every == 0):
            return state, {}
        record = {"step": step, "train_loss": _scalar(sum(losses) / self.accum),
                  "learning_rate": _scalar(self.lr(step - 1)),
                  "head_learning_rate": _scalar(trainer.head_lr(step - 1))}
        if is_eval:
            record |= self._evaluate(state)
        if is_eval or is_probe:
            record |= self._probe(state, head_old, step)
        if is_diameter:
            record |= self._step_diameter(state, head_old, step)
        if is_eval and trainer.centring_probe is not None:
            record |= self._centring(state, head_old, step)
        if is_eval:
            self.last_eval = record
        record |= self._throughput()
        self.writer.write(record)
        return state, record

    def _evaluate(self, state) -> dict:
        """Mean loss over the fixed validation set (every batch has the same number of tokens)."""
        val_set, total = self.val_batches.source, 0.0
        for i in range(val_set.num_batches):
            total += _scalar(self.trainer.val_loss(state["params"], state["rest"],
                                                   *self.val_batches.get(i)))
        return {"val_loss": total / val_set.num_batches, "val_tokens": val_set.num_tokens}

    def _probe(self, state, head_old, step) -> dict:
        """Head diagnostics of the update just applied (no validation loss)."""
        head_lr = self.trainer.head_lr(step - 1)  # the rate of the update just applied
        probe = self.trainer.head_probe(state["params"], state["rest"], head_old,
                                        self.probe_inputs, head_lr,
                                        jnp.float32(self.trainer.head_wd))
        return ({k: _scalar(v) for k, v in sorted(probe.items())}
                | evaluate.tracked_head_stats(state["opt_state"]))

    def _step_diameter(self, state, head_old, step) -> dict:
        """The diameter of the head step just applied, without its decoupled decay."""
        out = self.trainer.step_diameter(state["params"], state["rest"], head_old,
                                         self.trainer.head_lr(step - 1),
                                         jnp.float32(self.trainer.head_wd))
        return {k: _scalar(v) for k, v in out.items()}

    def _centring(self, state, head_old, step) -> dict:
        """A RowNorm head's step against the uncentred one (evaluate.centring_diagnostics)."""
        out = self.trainer.centring_probe(state["params"], state["rest"], state["opt_state"],
                                          head_old, self.trainer.head_lr(step - 1),
                                          jnp.float32(self.trainer.head_wd))
        return {k: _scalar(v) for k, v in out.items()}

    def _throughput(self) -> dict:
        """Tokens/s, s/step (and model-FLOPs utilisation) since the last record."""
        elapsed = time.perf_counter() - self.window_start
        speed = self.window_steps * self.tokens_per_step / elapsed
        out = {"tokens_per_sec": speed, "sec_per_step": elapsed / self.window_steps}
        utilisation = throughput.mfu(speed, self.flops_per_token, peak=self.peak_flops)
        if utilisation is not None:
            out["mfu"] = utilisation
        self.window_start, self.window_steps = time.perf_counter(), 0
        return out

    def maybe_save(self, state, step: int) -> bool:
        if step % self.cfg.checkpoint.every and step != self.cfg.steps:
            return False
        self.setup.ckpt.save(step, state, run.checkpoint_meta(self.cfg, step, self.setup.mesh))
        return True

    def save_on_preemption(self, state, step: int, saved: bool, out) -> None:
        ckpt = self.setup.ckpt
        if not saved:
            ckpt.save(step, state, run.checkpoint_meta(self.cfg, step, self.setup.mesh))
        ckpt.wait()
        out(f"preempted (SIGTERM): saved a checkpoint at step {step} in {ckpt.directory}; "
            "rerun the same command to resume")


def _finish(last_eval: dict, *, finished: bool, writer, workdir, lead, out) -> dict:
    """At the end of the run: the plot and the summary line; return the last evaluation."""
    if not finished:
        return last_eval
    writer.plot()
    if not last_eval and lead:  # resumed a finished run: report its last evaluation
        evals = [r for r in metrics.read_metrics(workdir) if "val_loss" in r]
        last_eval = evals[-1] if evals else {}
    if last_eval:
        out(summary_line(last_eval))
    return last_eval


def summary_line(record: dict) -> str:
    """The run's last printed line: validation loss, head diameter and Hilbert RMS."""
    return (f"final step {record['step']}: val_loss {record['val_loss']:.4f}  "
            f"head_diameter {record['head_diameter']:.4g} "
            f"(step without decay {record['head_step_diameter']:.4g})  "
            f"hilbert_rms {record['hilbert_rms']:.4g} "
            f"(step without decay {record['head_step_hilbert_rms']:.4g})")


def _progress(*, total, initial, enabled):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                disable=not enabled)


def main(argv=None) -> dict:
    """The command line (flags.py): train, or time the step with `--benchmark N`. A user error
    prints one line, `train.py: error: ...`, and exits with status 2."""
    parser = flags.parser(description=__doc__.split("\n\n")[0])
    args = parser.parse_args(argv)
    try:
        cfg, explicit = flags.config_from_args(args), flags.explicit_fields(args)
    except ValueError as e:
        parser.error(str(e))
    mesh_lib.maybe_initialize_distributed(args.distributed)
    if args.benchmark:
        return benchmark(cfg, steps=args.benchmark)
    workdir = args.workdir or f"runs/{args.config or configs.DEFAULT_CONFIG}"
    try:
        return train(cfg, workdir, overwrite=args.overwrite, change_horizon=args.change_horizon,
                     explicit=explicit, progress=not args.no_progress)
    except UsageError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
