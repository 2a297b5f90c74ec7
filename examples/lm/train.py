"""Train the example language model with rowgeom.lm_optimizer, measuring the head step's geometry.

Run from the repository root, as a module:

    python -m examples.lm.train                      # cpu-tiny, about 5 minutes on 2 CPU cores
    python -m examples.lm.train --config cpu-small --steps 3000 --head adamw --workdir runs/a
    python -m examples.lm.train --workdir runs/a     # rerun on a workdir: resume its latest one
    python -m examples.lm.train --config 190m --mesh.fsdp 8 --workdir gs://bucket/run  # README
    python -m examples.lm.train --data.source 'fineweb10B/*.bin' --data.tokenizer gpt2/tok.json

Data: token files (llm.c / modded-nanogpt shards, nanoGPT train.bin / val.bin, rowgeom shards
written by prepare.py) or text / jsonl, detected by content and name (see data.py, formats.py).
A run is preemption-safe: SIGTERM saves a checkpoint at the current step and exits 0, and the same
command resumes it; the schedule horizon and every run-defining option come from the checkpoint.

Every config field is a flag named by its dotted path (`--model.d_model 64`); see configs.py.
The train state is one pytree of plain arrays, `{params, rest, opt_state, micro_step, rng}`, updated
by a single jitted step that donates it (parameters and optimizer state are updated in place). The
same code runs on 1 device, on simulated CPU devices, on GPUs and on TPU pod slices: parameters
carry PartitionSpecs over the (data, fsdp, tensor) mesh, and batches are split over (data, fsdp).
"""

from __future__ import annotations

import sys

if __package__ in (None, ""):  # `python examples/lm/train.py`: the package is not importable
    print("train.py: error: run it as a module from the repository root: "
          "python -m examples.lm.train ...", file=sys.stderr)
    raise SystemExit(2)

import argparse
import dataclasses
import math
import os
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import rowgeom
from examples.lm import checkpointing, configs, data, evaluate, metrics, throughput
from examples.lm import mesh as mesh_lib
from examples.lm import model as model_lib
from examples.lm import resume as resume_lib
from examples.lm.optimizer import build_optimizer, head_group, lr_schedule, optimizer_options

# The head probe's validation sequences use a fixed seed, independent of the training seed, so
# runs are comparable (the validation set itself is the start of the validation split).
PROBE_SEED = 0x5EED + 1


# ----------------------------------------------------------------------------- train state


class Trainer:
    """Model, optimizer, jitted functions and shardings for one config on one mesh."""

    def __init__(self, cfg: configs.Config, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.tx = build_optimizer(cfg)
        group = head_group(cfg)  # the head step's rate and decay, for the head probe
        self.head_lr, self.head_wd = lr_schedule(group.learning_rate, cfg), group.weight_decay
        mc, tx, seed = cfg.model, self.tx, cfg.seed

        def init_state():
            model = model_lib.Transformer(mc, rngs=nnx.Rngs(seed))
            _, params, rest = nnx.split(model, nnx.Param, ...)
            params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
            return {"params": params, "rest": rest, "opt_state": tx.init(params),
                    "micro_step": jnp.zeros((), jnp.int32),
                    "rng": jax.random.key_data(jax.random.key(seed))}

        with jax.set_mesh(mesh):
            abstract_model = nnx.eval_shape(lambda: model_lib.Transformer(mc, rngs=nnx.Rngs(seed)))
            self.graphdef, abs_params, _ = nnx.split(abstract_model, nnx.Param, ...)
            specs = nnx.to_pure_dict(nnx.get_partition_spec(abs_params))
            abs_params = nnx.to_pure_dict(abs_params)
            param_shardings = jax.tree.map(
                lambda a, s: mesh_lib.fit_sharding(a.shape, s, mesh), abs_params, specs,
                is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
            abstract = jax.eval_shape(init_state)
        self.shardings = mesh_lib.state_shardings(abstract, param_shardings, mesh)
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
            self.shardings)
        self._init = jax.jit(init_state, out_shardings=self.shardings)
        self._build_functions()

    def _build_functions(self):
        gd, tx = self.graphdef, self.tx
        batch = mesh_lib.batch_sharding(self.mesh)
        repl = mesh_lib.replicated(self.mesh)

        def loss_fn(params, rest, inputs, targets):
            return evaluate.cross_entropy(nnx.merge(gd, params, rest)(inputs), targets)

        def train_step(state, inputs, targets):
            loss, grads = jax.value_and_grad(loss_fn)(state["params"], state["rest"], inputs,
                                                      targets)
            updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            return {**state, "params": params, "opt_state": opt_state,
                    "micro_step": state["micro_step"] + 1}, loss

        def grad_step(state, inputs, targets):  # for timing: the step without the optimizer
            return jax.value_and_grad(loss_fn)(state["params"], state["rest"], inputs, targets)

        self.train_step = jax.jit(
            train_step, in_shardings=(self.shardings, batch, batch),
            out_shardings=(self.shardings, repl), donate_argnums=0)
        self.grad_step = jax.jit(
            grad_step, in_shardings=(self.shardings, batch, batch),
            out_shardings=(repl, self.shardings["params"]))
        self.val_loss = evaluate.make_val_loss(gd, out_sharding=repl)
        # A fresh copy of the head (jit outputs never alias donated inputs).
        head_of = lambda p, r: model_lib.head_matrix(nnx.merge(gd, p, r))[0] + 0
        self.head_of = jax.jit(head_of)
        head_shape = jax.eval_shape(head_of, self.abstract_state["params"],
                                    self.abstract_state["rest"]).shape
        exact = math.prod(head_shape) <= self.cfg.eval.exact_diameter_max_elements
        self.exact_diameter = exact
        self.head_probe = evaluate.make_head_probe(
            gd, model_lib.head_matrix, exact=exact, out_sharding=repl)

    def init(self):
        with jax.set_mesh(self.mesh):
            return self._init()


# ----------------------------------------------------------------------------- data


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
    return data.BatchSampler(tokens, batch_size=batch_size, seq_len=cfg.seq_len, seed=seed,
                             process_index=share[0], process_count=share[1],
                             vocab_size=cfg.model.num_tokens)


def _check_batch(cfg, mesh):
    dp, batch = mesh_lib.data_parallel_size(mesh), cfg.data.batch_size
    if batch % dp or batch % jax.process_count():
        raise ValueError(f"data.batch_size ({batch}) must be divisible by the data-parallel "
                         f"size data*fsdp ({dp}) and the process count ({jax.process_count()})")


def _scalar(x) -> float:
    return float(np.asarray(jax.device_get(x)))


# ----------------------------------------------------------------------------- setup and resume

class UsageError(ValueError):
    """A problem with the command line, the data or the work directory, explained in one line."""


def with_tokenizer_vocab(cfg: configs.Config) -> configs.Config:
    """With `data.tokenizer`: model.vocab_size = the tokenizer's size rounded up to a multiple of
    128 and model.valid_vocab_size = the tokenizer's size (the rest is padding)."""
    if cfg.data.tokenizer is None:
        return cfg
    n = data.tokenizer_vocab_size(data.load_tokenizer(cfg.data.tokenizer))
    padded = -(-n // configs.VOCAB_MULTIPLE) * configs.VOCAB_MULTIPLE
    return configs.override(cfg, {"model.vocab_size": padded, "model.valid_vocab_size": n})


def _report_changes(changed: dict, step: int, cfg: configs.Config, out) -> None:
    if "steps" in changed:
        old = dataclasses.replace(cfg, steps=changed["steps"][0])
        before = _scalar(lr_schedule(cfg.optim.learning_rate, old)(step))
        after = _scalar(lr_schedule(cfg.optim.learning_rate, cfg)(step))
        out(f"--change_horizon: steps {changed['steps'][0]} -> {changed['steps'][1]}; the "
            f"learning rate of update {step + 1} changes from {before:.6g} to {after:.6g}")
    if changed:
        out(f"resuming with changed settings (saved, now): {changed}")


def _default_data_dir(workdir: str) -> str:
    if checkpointing.is_remote(workdir):  # the token cache is memory-mapped: keep it local
        return str(Path("~/.cache/rowgeom/lm-data").expanduser())
    return str(Path(workdir) / "data")


def _make_mesh(cfg):
    return mesh_lib.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)


class _Run(NamedTuple):
    """What `_setup` resolves before the first step."""

    cfg: configs.Config
    mesh: jax.sharding.Mesh
    ckpt: checkpointing.Checkpointer
    latest: int | None  # the checkpoint to resume from
    tokens: data.TokenSplits
    val_set: data.ValidationSet


def _setup(cfg, workdir, *, explicit, overwrite, change_horizon, out) -> _Run:
    """Everything before the first step; each problem is a ValueError in one line."""
    cfg = with_tokenizer_vocab(cfg.validate())
    ckpt = checkpointing.Checkpointer(
        cfg.checkpoint.dir or checkpointing.as_path(workdir) / "checkpoints",
        keep=cfg.checkpoint.keep)
    latest = ckpt.latest_step()
    if latest is not None and overwrite:
        out(f"--overwrite: deleting checkpoints {ckpt.all_steps()} in {ckpt.directory}")
        ckpt.delete_all()
        latest = None
    if latest is not None:
        meta = ckpt.restore_meta(latest)
        cfg, changed = resume_lib.resolve_config(cfg, meta, explicit=explicit,
                                                 change_horizon=change_horizon)
        _report_changes(changed, meta["step"], cfg, out)
    mesh = _make_mesh(cfg)
    _check_batch(cfg, mesh)
    if cfg.effective_warmup() != cfg.optim.warmup_steps:
        out(f"optim.warmup_steps={cfg.optim.warmup_steps} does not fit steps={cfg.steps}: "
            f"warming up over {cfg.effective_warmup()} steps instead")
    tokens = data.prepare_tokens(source=cfg.data.source,
                                 workdir=cfg.data.dir or _default_data_dir(workdir),
                                 vocab_size=cfg.model.vocab_size, tokenizer=cfg.data.tokenizer)
    if tokens.vocab_size > cfg.model.num_tokens:
        raise ValueError(f"the tokenizer has {tokens.vocab_size} tokens but the model has "
                         f"{cfg.model.num_tokens} (model.vocab_size / model.valid_vocab_size)")
    need = cfg.data.batch_size * cfg.seq_len + 1
    if len(tokens.train) < need:
        raise ValueError(f"the training split has {len(tokens.train)} tokens, fewer than one "
                         f"batch of batch_size x seq_len + 1 = {need}; use more data or a "
                         "smaller data.batch_size / model.max_seq_len")
    val_set = data.ValidationSet(
        tokens.val, batch_size=cfg.data.batch_size, seq_len=cfg.seq_len,
        eval_tokens=cfg.resolved_eval_tokens(), process_index=jax.process_index(),
        process_count=jax.process_count(), vocab_size=cfg.model.num_tokens)
    return _Run(cfg, mesh, ckpt, latest, tokens, val_set)


def _restore_or_init(run: _Run, trainer: Trainer, out):
    with jax.set_mesh(run.mesh):
        if run.latest is not None:
            state, _ = run.ckpt.restore(run.latest, trainer.abstract_state)
            out(f"resumed from step {run.latest} ({run.ckpt.directory})")
        else:
            state = trainer.init()
            out(f"no checkpoint in {run.ckpt.directory}: starting fresh")
    return state


def _describe(run: _Run, trainer: Trainer, state, out) -> None:
    cfg, tokens = run.cfg, run.tokens
    head = ("tied head (trained as the embedding)" if cfg.model.tied_embeddings
            else f"{cfg.head} head")
    out(f"{mesh_lib.describe(run.mesh)}; {head}; "
        f"{sum(x.size for x in jax.tree.leaves(state['params'])):,} parameters; "
        f"{'exact' if trainer.exact_diameter else 'bracketed'} head diameter; data: "
        f"{tokens.format}, {len(tokens.train):,} train / {len(tokens.val):,} validation tokens, "
        f"{run.val_set.num_tokens:,} evaluated")
    # each parameter's label, geometry, peak learning rate and decay
    out(str(rowgeom.describe(state["params"], cfg.optim.learning_rate,
                             **optimizer_options(cfg))))


def _meta(cfg, step, mesh) -> dict:
    # `config` is the whole run definition (schedule horizon included): a resumed run follows it.
    return {"step": step, "data_position": step * cfg.optim.grad_accum_steps,
            "config": dataclasses.asdict(cfg),
            "mesh": {a: int(mesh.shape[a]) for a in mesh_lib.AXES},
            "process_count": jax.process_count()}


# ----------------------------------------------------------------------------- training loop


def train(cfg: configs.Config, workdir, *, resume: bool = True, overwrite: bool = False,
          change_horizon: bool = False, explicit=None, stop_after: int | None = None,
          progress: bool = True, print_fn=print) -> dict:
    """Train `cfg` in `workdir` (local or remote, e.g. gs://); return the last evaluation record.

    A workdir with checkpoints is resumed from the latest complete one, following the run's
    saved config (see `resume.resolve_config`; `explicit` names the fields the caller set, as
    dotted paths, None = all). resume: accepted for compatibility; resuming is the default.
    overwrite: delete the checkpoints and metrics and start fresh. change_horizon: accept a new
    `steps` on resume. stop_after: stop after this many optimizer steps without a final save, as
    if interrupted (the schedule still follows `cfg.steps`); for tests of exact resumption.
    On SIGTERM the run saves a checkpoint at the current step and returns.
    """
    del resume  # the default behaviour; the argument stays for callers that pass it
    workdir = os.fspath(workdir)
    lead = jax.process_index() == 0
    out = print_fn if lead else (lambda *a, **k: None)
    try:
        run = _setup(cfg, workdir, explicit=explicit, overwrite=overwrite,
                     change_horizon=change_horizon, out=out)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e
    cfg = run.cfg
    trainer = Trainer(cfg, run.mesh)
    writer = metrics.MetricsWriter(workdir, enabled=lead)
    if overwrite:
        writer.clear()
    state = _restore_or_init(run, trainer, out)
    start = int(jax.device_get(state["micro_step"])) // cfg.optim.grad_accum_steps
    writer.truncate_after(start)
    _describe(run, trainer, state, out)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    loop = _Loop(run, trainer, writer)
    bar = _progress(total=cfg.steps, initial=start, enabled=progress and lead)
    preemption = resume_lib.PreemptionWatcher(run.ckpt)
    try:
        with jax.set_mesh(run.mesh):
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
        run.ckpt.close()
        writer.close()
    return _finish(loop.last_eval, finished=end == cfg.steps, writer=writer, workdir=workdir,
                   lead=lead, out=out)


class _Loop:
    """One optimizer step after another: train, probe the head, evaluate, log, save."""

    def __init__(self, run: _Run, trainer: Trainer, writer: metrics.MetricsWriter):
        cfg, mesh = run.cfg, run.mesh
        self.run, self.cfg, self.trainer, self.writer = run, cfg, trainer, writer
        self.accum = cfg.optim.grad_accum_steps
        self.train_batches = _Batches(
            _sampler(run.tokens.train, cfg, batch_size=cfg.data.batch_size, seed=cfg.seed), mesh)
        self.val_batches = _Batches(run.val_set, mesh)
        self.probe_inputs = _Batches(
            _sampler(run.tokens.val, cfg, batch_size=cfg.eval.hilbert_sequences,
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
        head_old = (trainer.head_of(state["params"], state["rest"]) if is_eval or is_probe
                    else None)
        losses = []
        for micro in range(self.accum):
            inputs, targets = self.train_batches.get((step - 1) * self.accum + micro)
            state, loss = trainer.train_step(state, inputs, targets)
            losses.append(loss)
        self.window_steps += 1
        if not (is_eval or is_probe or step % cfg.log_every == 0):
            return state, {}
        record = {"step": step, "train_loss": _scalar(sum(losses) / self.accum),
                  "learning_rate": _scalar(self.lr(step - 1)),
                  "head_learning_rate": _scalar(trainer.head_lr(step - 1))}
        if is_eval:
            record |= self._evaluate(state)
        if is_eval or is_probe:
            record |= self._probe(state, head_old, step)
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
        return {k: _scalar(v) for k, v in sorted(probe.items())} | _head_stats(state["opt_state"])

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
        self.run.ckpt.save(step, state, _meta(self.cfg, step, self.run.mesh))
        return True

    def save_on_preemption(self, state, step: int, saved: bool, out) -> None:
        ckpt = self.run.ckpt
        if not saved:
            ckpt.save(step, state, _meta(self.cfg, step, self.run.mesh))
        ckpt.wait()
        out(f"preempted (SIGTERM): saved a checkpoint at step {step} in {ckpt.directory}; "
            "rerun the same command to resume")


def _head_stats(opt_state) -> dict:
    """rowgeom's O(Vd) RowDiameterStats of the last full head step (max over head leaves).

    Empty when no parameter is in the head group (a tied table trained as the embedding), or
    when the tracker did not measure the last step (see `optimizer.track_every_k_steps`).
    """
    stats = rowgeom.read_row_diameter(opt_state)
    fresh = [_scalar(m) == _scalar(c) for m, c in zip(jax.tree.leaves(stats.measured_at),
                                                     jax.tree.leaves(stats.count), strict=True)]
    if not all(fresh):  # measured on an earlier step (track_every_k_steps): not this step's
        return {}
    out = {}
    for field in ("lower", "upper", "row_sum_residual"):
        leaves = [jnp.asarray(v) for v in jax.tree.leaves(getattr(stats, field))]
        if leaves:
            out[f"tracked_{field}"] = max(_scalar(v) for v in leaves)
    return out


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
    return (f"final step {record['step']}: val_loss {record['val_loss']:.4f}  "
            f"head_diameter {record['head_diameter']:.4g} "
            f"(step without decay {record['head_step_diameter']:.4g})  "
            f"hilbert_rms {record['hilbert_rms']:.4g} "
            f"(step without decay {record['head_step_hilbert_rms']:.4g})")


def _progress(*, total, initial, enabled):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                disable=not enabled)


# ----------------------------------------------------------------------------- timing


def benchmark(cfg: configs.Config, *, steps: int = 20, print_fn=print) -> dict:
    """Time the jitted step with and without the optimizer update, interleaved, on one batch.

    Both variants run the forward and backward pass on the same batch; the difference is the
    optimizer (rowgeom.lm_optimizer + clipping) and the parameter update. Timings alternate
    between the two so machine noise hits both alike; medians are reported.
    """
    mesh = _make_mesh(cfg)
    trainer = Trainer(cfg, mesh)
    rng = np.random.default_rng(0)
    local = rng.integers(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.seq_len + 1),
                         dtype=np.int32)
    with jax.set_mesh(mesh):
        inputs = mesh_lib.global_batch(local[:, :-1], mesh)
        targets = mesh_lib.global_batch(local[:, 1:], mesh)
        state = trainer.init()
        full, grad_only = [], []
        for i in range(steps + 2):
            t0 = time.perf_counter()
            state, loss = trainer.train_step(state, inputs, targets)
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


# ----------------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `train.py: error: ...` and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="train.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                     epilog="Resuming: rerunning a command on a workdir with checkpoints resumes "
                            "the run from the latest complete one, following its saved config.")
    parser.add_argument("--workdir", default=None, metavar="PATH",
                        help="metrics, TensorBoard, plot, data cache, checkpoints; local or "
                             "remote, e.g. gs://bucket/run (default: runs/<config>)")
    parser.add_argument("--resume", action="store_true",
                        help="accepted for compatibility: resuming is the default")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete the workdir's checkpoints and metrics and start fresh")
    parser.add_argument("--change_horizon", action="store_true",
                        help="on resume, accept a --steps different from the checkpoint's and "
                             "rebuild the learning-rate schedule for it (the rate jumps)")
    parser.add_argument("--distributed", choices=("auto", "on", "off"), default="auto",
                        help="jax.distributed.initialize(): auto-detect multi-process launches "
                             "(default: auto)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--benchmark", type=int, default=0, metavar="N",
                        help="instead of training, time N steps with and without the optimizer")
    configs.add_config_arguments(parser)
    configs.add_renamed_flags(parser, {"change-horizon": "change_horizon"})
    return parser


def main(argv=None) -> dict:
    """The command line: user errors print one line and exit with status 2."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        cfg = configs.config_from_args(args)
        explicit = configs.explicit_fields(args)
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
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
