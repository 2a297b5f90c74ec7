"""Train the example language model with rowgeom.lm_optimizer, measuring the head step's geometry.

    python examples/lm/train.py                      # cpu-tiny, about 5 minutes on 2 CPU cores
    python examples/lm/train.py --config cpu-small --steps 3000 --head adamw --workdir runs/a
    python examples/lm/train.py --workdir runs/a     # rerun on a workdir: resume its latest one
    python examples/lm/train.py --config 190m --mesh_fsdp 8 --workdir gs://bucket/run  # see README
    python examples/lm/train.py --data_source 'fineweb10B/*.bin' --tokenizer gpt2/tokenizer.json

Data: token files (llm.c / modded-nanogpt shards, nanoGPT train.bin / val.bin, rowgeom shards
written by prepare.py) or text / jsonl, detected by content and name (see data.py, formats.py).
A run is preemption-safe: SIGTERM saves a checkpoint at the current step and exits 0, and the same
command resumes it; the schedule horizon and every run-defining option come from the checkpoint.

Every config field is a flag (`--d_model 64` or `--set d_model=64`); see configs.py and README.md.
The train state is one pytree of plain arrays, `{params, rest, opt_state, micro_step, rng}`, updated
by a single jitted step that donates it (parameters and optimizer state are updated in place). The
same code runs on 1 device, on simulated CPU devices, on GPUs and on TPU pod slices: parameters
carry PartitionSpecs over the (data, fsdp, tensor) mesh, and batches are split over (data, fsdp).
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make `examples.lm` importable
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

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

# The head probe's validation sequences use a fixed seed, independent of the training seed, so
# runs are comparable (the validation set itself is the start of the validation split).
PROBE_SEED = 0x5EED + 1
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(model_lib.ModelConfig))


# ----------------------------------------------------------------------------- configuration


def model_config(cfg: configs.Config) -> model_lib.ModelConfig:
    fields = {name: getattr(cfg, name) for name in MODEL_FIELDS if hasattr(cfg, name)}
    return model_lib.ModelConfig(max_seq_len=cfg.seq_len, **fields)


def lr_schedule(peak: float, cfg: configs.Config):
    """Learning rate as a function of the number of updates already applied (optax schedules).

    Linear warmup to `peak` over `cfg.effective_warmup()` updates (the first update already uses
    peak/warmup, never 0), then `optax.warmup_cosine_decay_schedule`'s cosine ("cosine"), or a
    constant phase and a linear decay over the last `decay_fraction` of the run ("wsd",
    `optax.join_schedules`), both ending exactly at `min_lr_ratio·peak` on the last update.
    """
    warm, total, end = cfg.effective_warmup(), cfg.steps, peak * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        base = optax.warmup_cosine_decay_schedule(0.0, peak, warm, total, end)
    else:
        stable_end = max(total - max(round(total * cfg.decay_fraction), 1), warm)
        base = optax.join_schedules(
            [optax.linear_schedule(0.0, peak, warm), optax.constant_schedule(peak),
             optax.linear_schedule(peak, end, total - stable_end)], [warm, stable_end])
    # optax counts from 0 = "at the start of the warmup"; update t (0-based) uses the value at
    # t + 1, so that the first update is not wasted with a zero learning rate.
    return lambda count: base(jnp.asarray(count) + 1)


def head_settings(cfg: configs.Config):
    """(learning-rate schedule, decoupled weight decay) of the optimizer group training the head.

    An untied head is the "head" group. A tied table is trained as the embedding (AdamW, tied=
    "embedding" in rowgeom.lm_optimizer), so its change is measured against the embedding rate.
    """
    if cfg.tied_embeddings:
        return lr_schedule(cfg.embedding_learning_rate or cfg.learning_rate, cfg), cfg.weight_decay
    return lr_schedule(cfg.resolved_head_learning_rate(), cfg), _head_weight_decay(cfg)


def _head_weight_decay(cfg: configs.Config) -> float:
    return cfg.weight_decay if cfg.head_weight_decay is None else cfg.head_weight_decay


def build_optimizer(cfg: configs.Config) -> optax.GradientTransformation:
    """Global-norm clipping -> rowgeom.lm_optimizer, wrapped in optax.MultiSteps to accumulate."""
    maybe = lambda peak: None if peak is None else lr_schedule(peak, cfg)
    rescaled = cfg.head == "rownorm-rescaled"
    tx = rowgeom.lm_optimizer(
        lr_schedule(cfg.learning_rate, cfg), head="rownorm" if rescaled else cfg.head,
        head_rescale="exact" if rescaled else None,
        tied="embedding" if cfg.tied_embeddings else None,
        head_learning_rate=lr_schedule(cfg.resolved_head_learning_rate(), cfg),
        embedding_learning_rate=maybe(cfg.embedding_learning_rate),
        vector_learning_rate=maybe(cfg.vector_learning_rate),
        weight_decay=cfg.weight_decay, head_weight_decay=_head_weight_decay(cfg),
        embedding_weight_decay=cfg.weight_decay,
        # A padded vocabulary: padding rows stay out of RowNorm's means and get a zero step.
        head_num_valid=cfg.valid_vocab_size)
    if cfg.grad_clip is not None:
        tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)
    if cfg.grad_accum_steps > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=cfg.grad_accum_steps)
    return tx


# ----------------------------------------------------------------------------- train state


class Trainer:
    """Model, optimizer, jitted functions and shardings for one config on one mesh."""

    def __init__(self, cfg: configs.Config, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.model_cfg = model_config(cfg)
        self.tx = build_optimizer(cfg)
        self.head_lr, self.head_wd = head_settings(cfg)
        mc, tx, seed = self.model_cfg, self.tx, cfg.seed

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
        exact = math.prod(head_shape) <= self.cfg.exact_diameter_max_elements
        self.exact_diameter = exact
        self.head_probe = evaluate.make_head_probe(
            gd, model_lib.head_matrix, exact=exact, out_sharding=repl)

    def init(self):
        with jax.set_mesh(self.mesh):
            return self._init()


# ----------------------------------------------------------------------------- training loop


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
                             vocab_size=_num_tokens(cfg))


def _num_tokens(cfg) -> int:
    return cfg.vocab_size if cfg.valid_vocab_size is None else cfg.valid_vocab_size


def _check_batch(cfg, mesh):
    dp = mesh_lib.data_parallel_size(mesh)
    if cfg.batch_size % dp or cfg.batch_size % jax.process_count():
        raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by the data-parallel "
                         f"size data*fsdp ({dp}) and the process count ({jax.process_count()})")


def _scalar(x) -> float:
    return float(np.asarray(jax.device_get(x)))


def _head_stats(opt_state) -> dict:
    """rowgeom's O(Vd) RowDiameterStats of the last full head step (max over head leaves).

    Empty when no parameter is in the head group (a tied table trained as the embedding).
    """
    stats = rowgeom.read_row_diameter(opt_state)
    out = {}
    for field in ("lower", "upper", "row_sum_residual"):
        leaves = [jnp.asarray(v) for v in jax.tree.leaves(getattr(stats, field))]
        if leaves:
            out[f"tracked_{field}"] = max(_scalar(v) for v in leaves)
    return out


# ----------------------------------------------------------------------------- resuming

class UsageError(ValueError):
    """A problem with the command line, the data or the work directory, explained in one line."""


def with_tokenizer_vocab(cfg: configs.Config) -> configs.Config:
    """With `cfg.tokenizer`: vocab_size = the tokenizer's size rounded up to a multiple of 128
    and valid_vocab_size = the tokenizer's size (the rest is padding)."""
    if cfg.tokenizer is None:
        return cfg
    n = data.tokenizer_vocab_size(data.load_tokenizer(cfg.tokenizer))
    padded = -(-n // configs.VOCAB_MULTIPLE) * configs.VOCAB_MULTIPLE
    return dataclasses.replace(cfg, vocab_size=padded, valid_vocab_size=n).validate()



def _report_changes(changed: dict, step: int, cfg: configs.Config, out) -> None:
    if "steps" in changed:
        old = dataclasses.replace(cfg, steps=changed["steps"][0])
        before = _scalar(lr_schedule(cfg.learning_rate, old)(step))
        after = _scalar(lr_schedule(cfg.learning_rate, cfg)(step))
        out(f"--change_horizon: steps {changed['steps'][0]} -> {changed['steps'][1]}; the "
            f"learning rate of update {step + 1} changes from {before:.6g} to {after:.6g}")
    if changed:
        out(f"resuming with changed settings (saved, now): {changed}")


def _default_data_dir(workdir: str) -> str:
    if checkpointing.is_remote(workdir):  # the token cache is memory-mapped: keep it local
        return str(Path("~/.cache/rowgeom/lm-data").expanduser())
    return str(Path(workdir) / "data")


def _setup(cfg, workdir, *, explicit, overwrite, change_horizon, out):
    """Everything before the first step; each problem is a ValueError in one line."""
    cfg = with_tokenizer_vocab(cfg.validate())
    mesh = mesh_lib.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor)
    ckpt = checkpointing.Checkpointer(
        cfg.checkpoint_dir or checkpointing.as_path(workdir) / "checkpoints",
        keep=cfg.keep_checkpoints)
    latest = ckpt.latest_step()
    if latest is not None and overwrite:
        out(f"--overwrite: deleting checkpoints {ckpt.all_steps()} in {ckpt.directory}")
        ckpt.delete_all()
        latest = None
    meta = None
    if latest is not None:
        meta = ckpt.restore_meta(latest)
        cfg, changed = resume_lib.resolve_config(cfg, meta, explicit=explicit,
                                                 change_horizon=change_horizon)
        _report_changes(changed, meta["step"], cfg, out)
        mesh = mesh_lib.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor)
    _check_batch(cfg, mesh)
    if cfg.effective_warmup() != cfg.warmup_steps:
        out(f"warmup_steps={cfg.warmup_steps} does not fit steps={cfg.steps}: warming up over "
            f"{cfg.effective_warmup()} steps instead")
    tokens = data.prepare_tokens(source=cfg.data_source,
                                 workdir=cfg.data_dir or _default_data_dir(workdir),
                                 vocab_size=cfg.vocab_size, tokenizer=cfg.tokenizer)
    if tokens.vocab_size > _num_tokens(cfg):
        raise ValueError(f"the tokenizer has {tokens.vocab_size} tokens but the model has "
                         f"{_num_tokens(cfg)} (vocab_size / valid_vocab_size)")
    need = cfg.batch_size * cfg.seq_len + 1
    if len(tokens.train) < need:
        raise ValueError(f"the training split has {len(tokens.train)} tokens, fewer than one "
                         f"batch of batch_size x seq_len + 1 = {need}; use more data or a "
                         "smaller batch_size / seq_len")
    val_set = data.ValidationSet(
        tokens.val, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
        eval_tokens=cfg.resolved_eval_tokens(), process_index=jax.process_index(),
        process_count=jax.process_count(), vocab_size=_num_tokens(cfg))
    return cfg, mesh, ckpt, latest, tokens, val_set


def train(cfg: configs.Config, workdir, *, resume: bool = True, overwrite: bool = False,
          change_horizon: bool = False, explicit=None, stop_after: int | None = None,
          progress: bool = True, print_fn=print) -> dict:
    """Train `cfg` in `workdir` (local or remote, e.g. gs://); return the last evaluation record.

    A workdir with checkpoints is resumed from the latest complete one, following the run's
    saved config (see `resume.resolve_config`; `explicit` names the fields the caller set,
    None = all). resume: accepted for compatibility; resuming is the default. overwrite: delete
    the checkpoints and metrics and start fresh. change_horizon: accept a new `steps` on resume.
    stop_after: stop after this many optimizer steps without a final save, as if interrupted
    (the schedule still follows `cfg.steps`); for tests of exact resumption.
    On SIGTERM the run saves a checkpoint at the current step and returns.
    """
    del resume  # the default behaviour; the argument stays for callers that pass it
    workdir = os.fspath(workdir)
    lead = jax.process_index() == 0
    out = print_fn if lead else (lambda *a, **k: None)
    try:
        cfg, mesh, ckpt, latest, tokens, val_set = _setup(
            cfg, workdir, explicit=explicit, overwrite=overwrite,
            change_horizon=change_horizon, out=out)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e
    trainer = Trainer(cfg, mesh)
    writer = metrics.MetricsWriter(workdir, enabled=lead)
    if overwrite:
        writer.clear()
    with jax.set_mesh(mesh):
        if latest is not None:
            state, _ = ckpt.restore(latest, trainer.abstract_state)
            out(f"resumed from step {latest} ({ckpt.directory})")
        else:
            state = trainer.init()
            out(f"no checkpoint in {ckpt.directory}: starting fresh")
    accum = cfg.grad_accum_steps
    start = int(jax.device_get(state["micro_step"])) // accum
    writer.truncate_after(start)
    head = "tied head (trained as the embedding)" if cfg.tied_embeddings else f"{cfg.head} head"
    out(f"{mesh_lib.describe(mesh)}; {head}; "
        f"{sum(x.size for x in jax.tree.leaves(state['params'])):,} parameters; "
        f"{'exact' if trainer.exact_diameter else 'bracketed'} head diameter; data: "
        f"{tokens.format}, {len(tokens.train):,} train / {len(tokens.val):,} validation tokens, "
        f"{val_set.num_tokens:,} evaluated")
    out(str(rowgeom.describe(  # each parameter's label, geometry, peak learning rate and decay
        state["params"], cfg.learning_rate, tied="embedding" if cfg.tied_embeddings else None,
        head="rownorm" if cfg.head in configs.ROWNORM_HEADS else cfg.head,
        head_learning_rate=cfg.resolved_head_learning_rate(), weight_decay=cfg.weight_decay,
        embedding_learning_rate=cfg.embedding_learning_rate,
        vector_learning_rate=cfg.vector_learning_rate)))

    train_batches = _Batches(
        _sampler(tokens.train, cfg, batch_size=cfg.batch_size, seed=cfg.seed), mesh)
    val_batches = _Batches(val_set, mesh)
    probe_inputs = _Batches(_sampler(tokens.val, cfg, batch_size=cfg.hilbert_sequences,
                                     seed=PROBE_SEED, replicated=True),
                            mesh, replicated=True).get(0)[0]
    tokens_per_step = cfg.batch_size * cfg.seq_len * accum
    flops_per_token = model_lib.flops_per_token(trainer.model_cfg)
    peak = throughput.peak_flops()

    last_eval: dict = {}
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    bar = _progress(total=cfg.steps, initial=start, enabled=progress and lead)
    preemption = resume_lib.PreemptionWatcher(ckpt)
    window_start, window_steps = time.perf_counter(), 0
    try:
        with jax.set_mesh(mesh):
            for step in range(start + 1, end + 1):
                is_eval = step % cfg.eval_every == 0 or step == cfg.steps
                is_probe = not is_eval and step > cfg.steps - cfg.probe_last_steps
                is_log = is_eval or is_probe or step % cfg.log_every == 0
                need_old = is_eval or is_probe
                head_old = trainer.head_of(state["params"], state["rest"]) if need_old else None
                losses = []
                for micro in range(accum):
                    inputs, targets = train_batches.get((step - 1) * accum + micro)
                    state, loss = trainer.train_step(state, inputs, targets)
                    losses.append(loss)
                window_steps += 1
                record = {}
                if is_log:
                    record = {"step": step, "train_loss": _scalar(sum(losses) / accum),
                              "learning_rate": _scalar(
                                  lr_schedule(cfg.learning_rate, cfg)(step - 1)),
                              "head_learning_rate": _scalar(trainer.head_lr(step - 1))}
                if is_eval:
                    record |= _evaluate(trainer, state, head_old, val_batches, probe_inputs,
                                        step)
                    last_eval = record
                elif is_probe:
                    record |= _probe(trainer, state, head_old, probe_inputs, step)
                if is_log:
                    elapsed = time.perf_counter() - window_start
                    speed = window_steps * tokens_per_step / elapsed
                    record |= {"tokens_per_sec": speed, "sec_per_step": elapsed / window_steps}
                    utilisation = throughput.mfu(speed, flops_per_token, peak=peak)
                    if utilisation is not None:
                        record["mfu"] = utilisation
                    writer.write(record)
                    bar.set_postfix(loss=f"{record['train_loss']:.4f}", tok_s=f"{speed:.0f}")
                    window_start, window_steps = time.perf_counter(), 0
                saved = step % cfg.save_every == 0 or step == cfg.steps
                if saved:
                    ckpt.save(step, state, _meta(cfg, step, accum, mesh))
                bar.update(1)
                if step < end and preemption.reached(step):
                    if not saved:
                        ckpt.save(step, state, _meta(cfg, step, accum, mesh))
                    ckpt.wait()
                    out(f"preempted (SIGTERM): saved a checkpoint at step {step} in "
                        f"{ckpt.directory}; rerun the same command to resume")
                    end = step
                    break
    finally:
        preemption.close()
        bar.close()
        ckpt.close()
        writer.close()
    if end == cfg.steps:
        writer.plot()
        if not last_eval and lead:  # resumed a finished run: report its last evaluation
            evals = [r for r in metrics.read_metrics(workdir) if "val_loss" in r]
            last_eval = evals[-1] if evals else {}
        if last_eval:
            out(summary_line(last_eval))
    return last_eval


def _probe(trainer, state, head_old, probe_inputs, step) -> dict:
    """Head diagnostics of the update just applied (no validation loss)."""
    head_lr = trainer.head_lr(step - 1)  # the rate of the update just applied
    probe = trainer.head_probe(state["params"], state["rest"], head_old, probe_inputs,
                               head_lr, jnp.float32(trainer.head_wd))
    return {k: _scalar(v) for k, v in sorted(probe.items())} | _head_stats(state["opt_state"])


def _evaluate(trainer, state, head_old, val_batches, probe_inputs, step) -> dict:
    """Mean loss over the fixed validation set (every batch has the same number of tokens)."""
    val_set = val_batches.source
    total = 0.0
    for i in range(val_set.num_batches):
        total += _scalar(trainer.val_loss(state["params"], state["rest"], *val_batches.get(i)))
    record = {"val_loss": total / val_set.num_batches, "val_tokens": val_set.num_tokens}
    return record | _probe(trainer, state, head_old, probe_inputs, step)


def _meta(cfg, step, accum, mesh) -> dict:
    # `config` is the whole run definition (schedule horizon included): a resumed run follows it.
    return {"step": step, "data_position": step * accum, "config": dataclasses.asdict(cfg),
            "mesh": {a: int(mesh.shape[a]) for a in mesh_lib.AXES},
            "process_count": jax.process_count()}


def summary_line(record: dict) -> str:
    return (f"final step {record['step']}: val_loss {record['val_loss']:.4f}  "
            f"head_diameter {record['head_diameter']:.4g} "
            f"(step without decay {record['head_step_diameter']:.4g})  "
            f"hilbert_rms {record['hilbert_rms']:.4g} "
            f"(step without decay {record['head_step_hilbert_rms']:.4g})")


class _NoBar:
    def set_postfix(self, **kwargs):
        pass

    def update(self, n):
        pass

    def close(self):
        pass


def _progress(*, total, initial, enabled):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


# ----------------------------------------------------------------------------- timing


def benchmark(cfg: configs.Config, *, steps: int = 20, print_fn=print) -> dict:
    """Time the jitted step with and without the optimizer update, interleaved, on one batch.

    Both variants run the forward and backward pass on the same batch; the difference is the
    optimizer (rowgeom.lm_optimizer + clipping) and the parameter update. Timings alternate
    between the two so machine noise hits both alike; medians are reported.
    """
    mesh = mesh_lib.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor)
    trainer = Trainer(cfg, mesh)
    rng = np.random.default_rng(0)
    local = rng.integers(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), dtype=np.int32)
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
              "tokens_per_sec": cfg.batch_size * cfg.seq_len / full_s}
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
    parser = _Parser(prog="train.py", description=__doc__.split("\n\n")[0],
                     epilog="Resuming: rerunning a command on a workdir with checkpoints resumes "
                            "the run from the latest complete one, following its saved config.")
    parser.add_argument("--workdir", default=None, metavar="PATH",
                        help="metrics, TensorBoard, plot, data cache, checkpoints; local or "
                             "remote, e.g. gs://bucket/run (default: runs/<config>)")
    parser.add_argument("--resume", action="store_true",
                        help="accepted for compatibility: resuming is the default")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete the workdir's checkpoints and metrics and start fresh")
    parser.add_argument("--change_horizon", "--change-horizon", action="store_true",
                        help="on resume, accept a --steps different from the checkpoint's and "
                             "rebuild the learning-rate schedule for it (the rate jumps)")
    parser.add_argument("--distributed", choices=("auto", "on", "off"), default="auto",
                        help="jax.distributed.initialize(): auto-detect multi-process launches "
                             "(default: auto)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--benchmark", type=int, default=0, metavar="N",
                        help="instead of training, time N steps with and without the optimizer")
    configs.add_config_arguments(parser)
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
