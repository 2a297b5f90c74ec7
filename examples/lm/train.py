"""Train the example language model with rowgeom.lm_optimizer, measuring the head step's geometry.

    python examples/lm/train.py                      # cpu-tiny, about 5 minutes on 2 CPU cores
    python examples/lm/train.py --config cpu-small --steps 3000 --head adamw --workdir runs/a
    python examples/lm/train.py --workdir runs/a --resume          # continue the latest checkpoint
    python examples/lm/train.py --config 190m --mesh_fsdp 8 --workdir gs://bucket/run  # see README

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
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import rowgeom
from examples.lm import checkpointing, configs, data, evaluate, metrics
from examples.lm import mesh as mesh_lib
from examples.lm import model as model_lib

# Validation batches use fixed seeds, independent of the training seed, so runs are comparable.
VAL_SEED = 0x5EED
PROBE_SEED = 0x5EED + 1
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(model_lib.ModelConfig))


# ----------------------------------------------------------------------------- configuration


def model_config(cfg: configs.Config) -> model_lib.ModelConfig:
    fields = {name: getattr(cfg, name) for name in MODEL_FIELDS if hasattr(cfg, name)}
    return model_lib.ModelConfig(max_seq_len=cfg.seq_len, **fields)


def lr_schedule(peak: float, cfg: configs.Config):
    """Learning rate as a function of the number of updates already applied.

    Linear warmup to `peak` over `warmup_steps` updates (the first update already uses
    peak/warmup, never 0), then either a cosine decay ("cosine") or a constant phase followed by a
    linear decay over the last `decay_fraction` of the run ("wsd"), both ending exactly at
    `min_lr_ratio·peak` on the last update.
    """
    warm, total, end = cfg.warmup_steps, cfg.steps, peak * cfg.min_lr_ratio
    decay = max(round(total * cfg.decay_fraction), 1)

    def schedule(count):
        t = jnp.asarray(count, jnp.float32)
        warm_lr = peak * (t + 1) / max(warm, 1)
        if cfg.schedule == "cosine":
            frac = jnp.clip((t - warm + 1) / max(total - warm, 1), 0.0, 1.0)
            main = end + (peak - end) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
        else:
            frac = jnp.clip((t - (total - decay) + 1) / decay, 0.0, 1.0)
            main = peak + (end - peak) * frac
        return jnp.where(t < warm, warm_lr, main)

    return schedule


def head_settings(cfg: configs.Config):
    """(learning-rate schedule, decoupled weight decay) of the optimizer group training the head.

    An untied head is the "head" group. A tied table is trained as the embedding (AdamW, tied=
    "embedding" in rowgeom.lm_optimizer), so its change is measured against the embedding rate.
    """
    if cfg.tied_embeddings:
        return lr_schedule(cfg.embedding_learning_rate or cfg.learning_rate, cfg), cfg.weight_decay
    return lr_schedule(cfg.resolved_head_learning_rate(), cfg), cfg.weight_decay


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
        weight_decay=cfg.weight_decay, head_weight_decay=cfg.weight_decay,
        embedding_weight_decay=cfg.weight_decay)
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
    """Global batches from a BatchSampler, sharded over the mesh's data-parallel axes."""

    def __init__(self, tokens, cfg, mesh, *, batch_size, seed, replicated=False):
        share = (0, 1) if replicated else (jax.process_index(), jax.process_count())
        self.sampler = data.BatchSampler(tokens, batch_size=batch_size, seq_len=cfg.seq_len,
                                         seed=seed, process_index=share[0],
                                         process_count=share[1], vocab_size=cfg.vocab_size)
        self.mesh, self.replicated = mesh, replicated

    def get(self, index):
        inputs, targets = self.sampler.get(index)
        sharding = (mesh_lib.replicated(self.mesh) if self.replicated
                    else mesh_lib.batch_sharding(self.mesh))
        put = lambda x: jax.make_array_from_process_local_data(sharding, x)
        return put(inputs), put(targets)


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


def _check_resume(meta: dict, cfg: configs.Config, out) -> None:
    saved = meta.get("config")
    if not isinstance(saved, dict) or not isinstance(meta.get("step"), int):
        raise ValueError("cannot resume: the checkpoint's metadata has no config and step "
                         f"(not written by this trainer?): {str(meta)[:200]}")
    changed = {k: (saved.get(k), v) for k, v in dataclasses.asdict(cfg).items()
               if k in saved and saved[k] != v}
    # These fix the shapes and structure of the saved state (or the step count in micro-steps).
    fixed = (*MODEL_FIELDS, "seq_len", "head", "grad_accum_steps")
    clip_toggled = (saved.get("grad_clip") is None) != (cfg.grad_clip is None)
    structural = {k: c for k, c in changed.items() if k in fixed or (k == "grad_clip"
                                                                     and clip_toggled)}
    if structural:
        raise ValueError(f"cannot resume: these fields differ from the checkpoint's "
                         f"(saved, now): {structural}")
    if changed:
        out(f"resuming with changed settings (saved, now): {changed}")


def train(cfg: configs.Config, workdir: str | Path, *, resume: bool = False,
          stop_after: int | None = None, progress: bool = True, print_fn=print) -> dict:
    """Train `cfg` in `workdir`; return the last evaluation record.

    resume: continue from the latest complete checkpoint (fresh start when there is none).
    stop_after: stop after this many optimizer steps without a final save, as if interrupted
    (the schedule still follows `cfg.steps`); for tests of exact resumption.
    """
    cfg = cfg.validate()
    workdir = Path(workdir)
    lead = jax.process_index() == 0
    out = print_fn if lead else (lambda *a, **k: None)
    mesh = mesh_lib.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor)
    _check_batch(cfg, mesh)

    data_dir = Path(cfg.data_dir) if cfg.data_dir else workdir / "data"
    tokens = data.prepare_tokens(source=cfg.data_source, workdir=data_dir,
                                 vocab_size=cfg.vocab_size)
    if tokens.vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokens.vocab_size} tokens but vocab_size is "
                         f"{cfg.vocab_size}")
    trainer = Trainer(cfg, mesh)
    ckpt = checkpointing.Checkpointer(cfg.checkpoint_dir or workdir / "checkpoints",
                                      keep=cfg.keep_checkpoints)
    writer = metrics.MetricsWriter(workdir, enabled=lead)

    latest = ckpt.latest_step()
    if latest is not None and not resume:
        raise ValueError(f"{ckpt.directory} already holds checkpoints (latest step {latest}): "
                         "pass --resume to continue, or use a new --workdir")
    with jax.set_mesh(mesh):
        if resume and latest is not None:
            _check_resume(ckpt.restore_meta(latest), cfg, out)
            state, _ = ckpt.restore(latest, trainer.abstract_state)
            out(f"resumed from step {latest} ({ckpt.directory})")
        else:
            state = trainer.init()
            if resume:
                out(f"no checkpoint in {ckpt.directory}: starting fresh")
    accum = cfg.grad_accum_steps
    start = int(jax.device_get(state["micro_step"])) // accum
    writer.truncate_after(start)
    head = "tied head (trained as the embedding)" if cfg.tied_embeddings else f"{cfg.head} head"
    out(f"{mesh_lib.describe(mesh)}; {head}; "
        f"{sum(x.size for x in jax.tree.leaves(state['params'])):,} parameters; "
        f"{'exact' if trainer.exact_diameter else 'bracketed'} head diameter")
    out(str(rowgeom.describe(  # each parameter's label, geometry, peak learning rate and decay
        state["params"], cfg.learning_rate, tied="embedding" if cfg.tied_embeddings else None,
        head="rownorm" if cfg.head in configs.ROWNORM_HEADS else cfg.head,
        head_learning_rate=cfg.resolved_head_learning_rate(), weight_decay=cfg.weight_decay,
        embedding_learning_rate=cfg.embedding_learning_rate,
        vector_learning_rate=cfg.vector_learning_rate)))

    train_batches = _Batches(tokens.train, cfg, mesh, batch_size=cfg.batch_size, seed=cfg.seed)
    val_batches = _Batches(tokens.val, cfg, mesh, batch_size=cfg.batch_size, seed=VAL_SEED)
    probe_inputs = _Batches(tokens.val, cfg, mesh, batch_size=cfg.hilbert_sequences,
                            seed=PROBE_SEED, replicated=True).get(0)[0]
    tokens_per_step = cfg.batch_size * cfg.seq_len * accum

    last_eval: dict = {}
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    bar = _progress(total=cfg.steps, initial=start, enabled=progress and lead)
    window_start, window_steps = time.perf_counter(), 0
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
                          "learning_rate": _scalar(lr_schedule(cfg.learning_rate, cfg)(step - 1)),
                          "head_learning_rate": _scalar(trainer.head_lr(step - 1))}
            if is_eval:
                record |= _evaluate(trainer, state, head_old, val_batches, probe_inputs, step)
                last_eval = record
            elif is_probe:
                record |= _probe(trainer, state, head_old, probe_inputs, step)
            if is_log:
                elapsed = time.perf_counter() - window_start
                speed = {"tokens_per_sec": window_steps * tokens_per_step / elapsed,
                         "sec_per_step": elapsed / window_steps}
                writer.write(record, extra_scalars=speed)
                bar.set_postfix(loss=f"{record['train_loss']:.4f}",
                                tok_s=f"{speed['tokens_per_sec']:.0f}")
                window_start, window_steps = time.perf_counter(), 0
            if step % cfg.save_every == 0 or step == cfg.steps:
                ckpt.save(step, state, _meta(cfg, step, accum, mesh))
            bar.update(1)
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
    cfg = trainer.cfg
    total = 0.0
    for i in range(cfg.eval_batches):
        total += _scalar(trainer.val_loss(state["params"], state["rest"], *val_batches.get(i)))
    record = {"val_loss": total / cfg.eval_batches}
    return record | _probe(trainer, state, head_old, probe_inputs, step)


def _meta(cfg, step, accum, mesh) -> dict:
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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workdir", default=None,
                        help="metrics, TensorBoard, plot, data cache, checkpoints "
                             "(default runs/<config>)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest complete checkpoint (fresh if none)")
    parser.add_argument("--distributed", choices=("auto", "on", "off"), default="auto",
                        help="jax.distributed.initialize(): auto-detect multi-process launches")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--benchmark", type=int, default=0, metavar="N",
                        help="instead of training, time N steps with and without the optimizer")
    configs.add_config_arguments(parser)
    args = parser.parse_args(argv)
    try:
        cfg = configs.config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    mesh_lib.maybe_initialize_distributed(args.distributed)
    if args.benchmark:
        return benchmark(cfg, steps=args.benchmark)
    workdir = args.workdir or f"runs/{args.config}"
    return train(cfg, workdir, resume=args.resume, progress=not args.no_progress)


if __name__ == "__main__":
    main()
