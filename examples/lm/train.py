"""Train the example language model with rowgeom.lm_optimizer, measuring the head step's geometry.

Run from the repository root, as a module:

    python -m examples.lm.train                      # cpu-tiny, on CPU
    python -m examples.lm.train --config cpu-small --steps 3000 --head adamw --workdir runs/a
    python -m examples.lm.train --workdir runs/a     # rerun on a workdir: resume its latest one
    python -m examples.lm.train --config 190m --mesh.fsdp 8 --workdir gs://bucket/run

Top to bottom: `Trainer` (the state, its shardings, the jitted step and probes), `start` (resume
or fresh, mesh, data), `train` (the loop; SIGTERM saves the current step and exits 0: `Preempted`)
and `main`.
"""

from __future__ import annotations

import sys

if __package__ in (None, ""):  # `python examples/lm/train.py`: the package is not importable
    print("train.py: error: run it as a module from the repository root: "
          "python -m examples.lm.train ...", file=sys.stderr)
    raise SystemExit(2)

import contextlib
import dataclasses
import functools
import os
import signal
import threading
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

import rowgeom
from examples.lm import checkpointing, configs, data, evaluate, metrics, optimizer, sharding
from examples.lm import model as model_lib
from examples.lm.tools import tokenizer as bpe


class Trainer:
    """Model, optimizer, jitted functions and shardings for one config on one mesh: `init()`
    builds the state `{params, rest, opt_state, micro_step, rng}` in place, `abstract_state` is
    what a checkpoint restores onto, `train_step(state, inputs, targets, rates)` applies one
    micro-batch at the groups' peak rates and decays `rates` (`self.rates`; `abstract_rates` to
    lower it), `grad_step` is its forward and backward pass alone (for timing)."""

    def __init__(self, cfg: configs.Config, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.tx = tx = optimizer.build_optimizer(cfg)
        self.head_group = optimizer.head_group(cfg)  # "embedding" for a tied table
        self.head_lr = optimizer.lr_schedule(self.head_group.learning_rate, cfg)
        mc, seed = cfg.model, cfg.seed

        # The seed and (train_step) the rates are arguments, not constants: runs that differ
        # only in them (a seed study, a rate sweep) lower to one program, compiled once.
        def init_state(seed):
            model = model_lib.Transformer(mc, rngs=nnx.Rngs(jax.random.key(seed)))
            _, params, rest = nnx.split(model, nnx.Param, ...)
            params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
            return {"params": params, "rest": rest, "opt_state": tx.init(params),
                    "micro_step": jnp.zeros((), jnp.int32),
                    "rng": jax.random.key_data(jax.random.key(seed))}

        # Outside the mesh: flax would turn the logical names into (mesh) shardings itself.
        abstract_model = nnx.eval_shape(lambda: model_lib.Transformer(mc, rngs=nnx.Rngs(seed)))
        self.graphdef, abs_params, _ = nnx.split(abstract_model, nnx.Param, ...)
        names = nnx.to_pure_dict(nnx.get_partition_spec(abs_params))
        param_shardings = jax.tree.map(
            lambda a, n: jax.NamedSharding(mesh, sharding.fit_spec(a.shape, sharding.mesh_axes(n),
                                                                   mesh)),
            nnx.to_pure_dict(abs_params), names,
            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        with jax.set_mesh(mesh):
            abstract = jax.eval_shape(init_state, seed)
        self.shardings = sharding.state_shardings(abstract, param_shardings, mesh)
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
            self.shardings)
        self._init = jax.jit(init_state, out_shardings=self.shardings)
        gd, compute = self.graphdef, self.compute_params
        batch, repl = sharding.batch_sharding(mesh), sharding.replicated(mesh)

        def loss_fn(params, rest, inputs, targets):
            return nnx.merge(gd, compute(params), rest).loss(inputs, targets)

        def train_step(state, inputs, targets, rates):
            loss, grads = jax.value_and_grad(loss_fn)(state["params"], state["rest"], inputs,
                                                      targets)
            tx = optimizer.build_optimizer(cfg, rates)
            updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            return {**state, "params": params, "opt_state": opt_state,
                    "micro_step": state["micro_step"] + 1}, loss

        def grad_step(state, inputs, targets):  # for timing: the step without the optimizer
            return jax.value_and_grad(loss_fn)(state["params"], state["rest"], inputs, targets)

        self.abstract_rates = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=repl),
            optimizer.group_rates(cfg))
        self.train_step = jax.jit(
            train_step, in_shardings=(self.shardings, batch, batch, repl),
            out_shardings=(self.shardings, repl), donate_argnums=0)
        self.grad_step = jax.jit(
            grad_step, in_shardings=(self.shardings, batch, batch),
            out_shardings=(repl, self.shardings["params"]))
        self.val_loss = jax.jit(loss_fn, out_shardings=repl)
        # A fresh copy of the head (jit outputs never alias donated inputs).
        head_of = lambda p, r: model_lib.head_matrix(nnx.merge(gd, p, r))[0] + 0
        self.head_of = jax.jit(head_of)
        self.exact_diameter = mc.num_tokens * mc.d_model <= cfg.eval.exact_diameter_max_elements
        exact, jit = self.exact_diameter, functools.partial(jax.jit, out_shardings=repl)
        self.head_probe = jit(functools.partial(evaluate.head_probe, gd, exact=exact))
        self.step_diameter = jit(functools.partial(evaluate.step_diameter, gd, exact=exact))
        # With eval.centring, a RowNorm head's step against the uncentred one, where the
        # optimizer state holds the head's EMA moment.
        self.centring_probe = None
        full_head = self.abstract_state["params"].get("lm_head", {}).get("kernel")
        rownorm = optimizer.optimizer_options(cfg)["head"].optimizer == "rownorm"
        if (cfg.eval.centring and rownorm and full_head is not None
                and evaluate.head_ema(self.abstract_state["opt_state"], full_head.shape)):
            o = cfg.optim
            self.centring_probe = jit(functools.partial(
                evaluate.centring_probe, gd, head_shape=full_head.shape,
                momentum=self.head_group.momentum, debias=o.head_bias_correction,
                eps=1e-8 if o.head_eps is None else o.head_eps, exact=exact))

    def compute_params(self, params):
        """`params` in the model's compute dtype, each kept on its own sharding (so the cast runs
        on the shards and FSDP gathers the narrow copy)."""
        dtype = jnp.dtype(self.cfg.model.compute_dtype)
        if dtype == jnp.dtype(self.cfg.model.param_dtype):
            return params
        return jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(p.astype(dtype), s),
                            params, self.shardings["params"])

    @functools.cached_property
    def rates(self):
        """The config's rates (`optimizer.group_rates`) on the mesh, `train_step`'s last argument;
        made when first asked for (a compile-only target has no device to hold them)."""
        repl = sharding.replicated(self.mesh)
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(repl, x),
                            optimizer.group_rates(self.cfg))

    def init(self):
        """A fresh train state, created in place with its shardings."""
        with jax.set_mesh(self.mesh):
            return self._init(self.cfg.seed)


class UsageError(ValueError):
    """A problem with the command line, the data or the work directory, explained in one line."""


class Preempted(SystemExit):
    """Raised by `train` once it has saved a run stopped by SIGTERM (or, on several hosts, at
    JAX's preemption sync point): uncaught, the process exits with status 0; a caller training
    several runs stops there rather than take it for finished. The same call resumes it."""

    def __init__(self, step: int, directory):
        super().__init__(0)
        self.step, self.directory = step, directory


class Run(NamedTuple):  # what `start` resolves before the first step
    cfg: configs.Config
    mesh: jax.sharding.Mesh
    ckpt: checkpointing.Checkpointer
    latest: int | None  # the checkpoint to resume from
    tokens: data.TokenSplits
    train_set: data.BatchSampler
    val_set: data.ValidationSet
    probe: data.BatchSampler  # the validation sequences whose hidden states probe the head


def start(cfg: configs.Config, workdir: str, *, explicit=None, overwrite: bool = False,
          change_horizon: bool = False, out=print) -> Run:
    """Resolve `cfg` against `workdir`'s checkpoints, then build the mesh and load the data.
    explicit, change_horizon: see `configs.resolve_config`. overwrite: delete the checkpoints and
    start fresh. `out` prints what was decided (one line each)."""
    ckpt = None
    try:
        if cfg.data.tokenizer is not None:  # its size, padded up to a multiple of 128
            n = bpe.vocab_size(bpe.load_tokenizer(cfg.data.tokenizer))
            cfg = configs.override(cfg, {"model.vocab_size": configs.padded_vocab(n),
                                         "model.valid_vocab_size": n})
        for flag, path in (("--workdir", workdir), ("--checkpoint.dir", cfg.checkpoint.dir)):
            if path is not None and os.path.exists(path) and not os.path.isdir(path):
                raise ValueError(f"{flag} {path} is a file, not a directory: pass a directory "
                                 "(a missing one is created)")
        recorded = checkpointing.recorded_directory(workdir)
        if recorded is not None and cfg.checkpoint.dir is None:
            cfg = configs.override(cfg, {"checkpoint.dir": recorded})
            out(f"checkpoints in {recorded} (the run's --checkpoint.dir, recorded in "
                f"{checkpointing.CHECKPOINT_DIR_FILE})")
        ckpt = checkpointing.Checkpointer(
            cfg.checkpoint.dir or checkpointing.as_path(workdir) / "checkpoints",
            keep=cfg.checkpoint.keep)
        latest, meta = ckpt.latest_step(), None
        if (latest is None and not overwrite and recorded not in (None, str(ckpt.directory))
                and checkpointing.has_checkpoints(recorded)):
            raise ValueError(
                f"--checkpoint.dir {ckpt.directory} holds no checkpoint, but the run in "
                f"{workdir} saved its checkpoints in {recorded}: pass --checkpoint.dir "
                f"{recorded} (or leave it out), or start over with --overwrite")
        if jax.process_index() == 0:
            checkpointing.record_directory(workdir, ckpt.directory)
        if overwrite and (latest is not None or ckpt.damaged()):
            listed = ckpt.all_steps() + [p.name for p in ckpt.damaged()]
            out(f"--overwrite: deleting checkpoints {listed} in {ckpt.directory}")
            ckpt.delete_all()
            latest = None
        if latest is not None or ckpt.damaged():
            latest, meta = _newest_intact(ckpt, ckpt.restore_meta, out)
            cfg, changed = configs.resolve_config(cfg, meta, explicit=explicit,
                                                 change_horizon=change_horizon)
            if "steps" in changed:
                step, (was, now) = meta["step"], changed["steps"]
                before, after = (_scalar(optimizer.lr_schedule(cfg.optim.learning_rate, c)(step))
                                 for c in (dataclasses.replace(cfg, steps=was), cfg))
                out(f"--change_horizon: steps {was} -> {now}; the learning rate of update "
                    f"{step + 1} changes from {before:.6g} to {after:.6g}")
            if changed:
                listed = ", ".join(f"--{name} {was!r} -> {now!r}"
                                   for name, (was, now) in changed.items())
                out(f"resuming with changed settings: {listed}")
        mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
        rows = sharding.check_batch(cfg.data.batch_size, mesh)  # this process's share
        shape = {a: int(mesh.shape[a]) for a in sharding.AXES}
        if meta is not None and meta.get("mesh", shape) != shape:
            out(f"resuming on mesh {shape}, checkpoint {latest} was saved from mesh "
                f"{meta['mesh']}: the same run, its sums reduced in another order (results "
                "differ from an uninterrupted run's in float rounding)")
        if cfg.effective_warmup() != cfg.optim.warmup_steps:
            out(f"--optim.warmup_steps {cfg.optim.warmup_steps} does not fit --steps "
                f"{cfg.steps}: warming up over {cfg.effective_warmup()} steps instead")
        data_dir = cfg.data.dir or str(  # the token cache is memory-mapped: keep it local
            Path("~/.cache/rowgeom/lm-data").expanduser() if checkpointing.is_remote(workdir)
            else Path(workdir) / "data")
        tokens = data.prepare_tokens(source=cfg.data.source, workdir=data_dir,
                                     vocab_size=cfg.model.num_tokens,
                                     tokenizer=cfg.data.tokenizer)
        if meta is not None and meta.get("data", tokens.identity()) != tokens.identity():
            raise ValueError(
                f"checkpoint {latest} in {ckpt.directory} was trained on other data "
                f"({meta['data']}; this launch reads {tokens.identity()}): restore the data the "
                "run used (a text source whose files changed is tokenized anew), or start over "
                "with --overwrite")
        train_set = data.BatchSampler(
            tokens.train, batch_size=cfg.data.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
            grad_accum_steps=cfg.optim.grad_accum_steps, shuffle=cfg.data.shuffle, rows=rows)
        unread = [len(f) for f, n in zip(train_set.shards, train_set.groups, strict=True) if not n]
        if unread:
            out(f"warning: {len(unread)} of {len(train_set.shards)} training files hold less than "
                f"one update's batch_size x grad_accum_steps x seq_len + 1 = "
                f"{cfg.data.batch_size * cfg.optim.grad_accum_steps * cfg.seq_len + 1} tokens "
                f"and are never read ({sum(unread):,} tokens); join them into larger files")
        val_set = data.ValidationSet(
            tokens.val, batch_size=cfg.data.batch_size, seq_len=cfg.seq_len,
            eval_tokens=cfg.resolved_eval_tokens(), rows=rows)
        try:  # the same sequences on every process (replicated), for every seed
            probe = data.BatchSampler(tokens.val, batch_size=cfg.eval.hilbert_sequences,
                                      seq_len=cfg.seq_len, seed=PROBE_SEED)
        except ValueError:
            raise ValueError(
                f"no validation file holds the head probe's --eval.hilbert_sequences x seq_len "
                f"+ 1 = {cfg.eval.hilbert_sequences * cfg.seq_len + 1} tokens; use more "
                "validation data or a smaller --eval.hilbert_sequences") from None
        return Run(cfg, mesh, ckpt, latest, tokens, train_set, val_set, probe)
    except BaseException as e:
        if ckpt is not None:
            _close(ckpt)
        if isinstance(e, (ValueError, FileNotFoundError, NotADirectoryError)):
            raise UsageError(str(e)) from e
        raise


def _close(ckpt: checkpointing.Checkpointer) -> None:
    """Wait for the saves and close; a failed run leaves no empty (local) checkpoint directory."""
    ckpt.close()
    with contextlib.suppress(OSError):  # best effort: never hide the error that ended the run
        if (not checkpointing.is_remote(ckpt.directory) and ckpt.directory.exists()
                and not any(ckpt.directory.iterdir())):
            ckpt.directory.rmdir()


def _newest_intact(ckpt: checkpointing.Checkpointer, read, out):
    """(step, read(step)) for the newest checkpoint `read` can read. Each damaged one on the way
    is set aside (`<step>.damaged`, never deleted), one line each; none left is a UsageError."""
    while (step := ckpt.latest_step()) is not None:
        try:
            return step, read(step)
        except checkpointing.DamagedCheckpoint as e:
            moved = ckpt.set_aside(step)
            out(f"warning: {e}; moved it aside to {moved} and falling back to the previous "
                "checkpoint")
    names = ", ".join(p.name for p in ckpt.damaged())
    raise UsageError(f"no intact checkpoint in {ckpt.directory} (damaged, kept for inspection: "
                     f"{names}): rerun with --overwrite to start fresh (it deletes them), or use "
                     "a new --workdir")


def describe(setup: Run, trainer: Trainer, state, out=print) -> None:
    """Print the mesh, head, parameter count and data, and `rowgeom.describe`'s table."""
    cfg, tokens = setup.cfg, setup.tokens
    head = ("tied head (trained as the embedding)" if cfg.model.tied_embeddings
            else f"{cfg.head} head")
    shape = ", ".join(f"{a}={n}" for a, n in setup.mesh.shape.items())
    out(f"mesh({shape}) on {setup.mesh.devices.size} {jax.devices()[0].platform} devices, "
        f"{jax.process_count()} process(es); {head}; "
        f"{sum(x.size for x in jax.tree.leaves(state['params'])):,} parameters; "
        f"{'exact' if trainer.exact_diameter else 'bracketed'} head diameter; data: "
        f"{tokens.format}, {len(tokens.train):,} train / {len(tokens.val):,} validation tokens, "
        f"{setup.val_set.num_tokens:,} evaluated, "
        f"{cfg.steps / setup.train_set.updates_per_epoch:.3g} training epochs")
    out(str(rowgeom.describe(state["params"], cfg.optim.learning_rate,
                             **optimizer.optimizer_options(cfg))))


def checkpoint_meta(cfg: configs.Config, step: int, mesh, tokens: data.TokenSplits) -> dict:
    """The JSON saved next to the state: a resumed run follows its `config` and must read the
    same `data`."""
    return {"step": step, "data_position": step * cfg.optim.grad_accum_steps,
            "data": tokens.identity(), "config": dataclasses.asdict(cfg),
            "mesh": {a: int(mesh.shape[a]) for a in sharding.AXES},
            "process_count": jax.process_count()}


class PreemptionWatcher:
    """Whether to save and stop after a step because the machine is going away: one process, on
    SIGTERM; several, at orbax's `reached_preemption`, the same step on every host (a Python
    handler would replace JAX's preemption notifier's)."""

    def __init__(self, ckpt):
        self.ckpt, self.signalled, self._previous = ckpt, False, None
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM,
                                           lambda *_: setattr(self, "signalled", True))

    def reached(self, step: int) -> bool:
        return (jax.process_count() > 1 and self.ckpt.reached_preemption(step)) or self.signalled

    def close(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


# The head probe's validation sequences: a fixed seed, not the training one, so runs compare.
PROBE_SEED = 0x5EED + 1


def train(cfg: configs.Config, workdir, *, overwrite: bool = False, change_horizon: bool = False,
          explicit=None, stop_after: int | None = None, progress: bool = True,
          print_fn=print) -> dict:
    """Train `cfg` in `workdir` (local or remote, e.g. gs://); return the last evaluation record.
    A workdir with checkpoints resumes (`start`). stop_after: stop after this many steps without
    a final save, as if interrupted (tests of exact resumption). SIGTERM saves the current step
    and raises `Preempted`; problems with the config, data or workdir raise `UsageError`."""
    workdir = os.fspath(workdir)
    lead = jax.process_index() == 0
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(checkpointing.workdir_lock(workdir, enabled=lead))
        except ValueError as e:
            raise UsageError(str(e)) from e
        return _train(cfg, workdir, overwrite=overwrite, change_horizon=change_horizon,
                      explicit=explicit, stop_after=stop_after, progress=progress,
                      print_fn=print_fn if lead else (lambda *a, **k: None))


def _train(cfg, workdir, *, overwrite, change_horizon, explicit, stop_after, progress,
           print_fn) -> dict:
    lead, out = jax.process_index() == 0, print_fn
    setup = start(cfg, workdir, explicit=explicit, overwrite=overwrite,
                  change_horizon=change_horizon, out=out)
    cfg = setup.cfg
    writer = bar = preemption = None
    preempted = False
    try:
        check_fits(cfg, setup.mesh)
        trainer = Trainer(cfg, setup.mesh)
        writer = metrics.MetricsWriter(workdir, enabled=lead)
        if overwrite and (deleted := writer.clear()):
            out(f"--overwrite: deleting {', '.join(deleted)} in {workdir}")
        ckpt = setup.ckpt
        if setup.latest is None:
            state = trainer.init()
            out(f"no checkpoint in {ckpt.directory}: starting fresh")
        else:
            try:
                with jax.set_mesh(setup.mesh):
                    step, (state, _) = _newest_intact(
                        ckpt, lambda s: ckpt.restore(s, trainer.abstract_state), out)
            except ValueError as e:  # the layout differs from this config's
                raise UsageError(str(e)) from e
            out(f"resumed from step {step} ({ckpt.directory})")
        done = int(jax.device_get(state["micro_step"])) // cfg.optim.grad_accum_steps
        try:
            writer.truncate_after(done)
        except ValueError as e:  # a damaged metrics.jsonl
            raise UsageError(str(e)) from e
        if done >= cfg.steps:
            out(f"the run in {workdir} is finished: {done} of --steps {cfg.steps} done; to train "
                f"further, rerun with a larger --steps N and --change_horizon (the schedule is "
                "rebuilt for N), or start over with --overwrite")
        describe(setup, trainer, state, out)
        end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        loop = _Loop(setup, trainer, writer)
        bar = tqdm(total=cfg.steps, initial=done, unit="step", dynamic_ncols=True,
                   disable=not (progress and lead))
        preemption = PreemptionWatcher(setup.ckpt)
        with jax.set_mesh(setup.mesh):
            for step in range(done + 1, end + 1):
                state, record = loop.step(state, step)
                if record:
                    bar.set_postfix(loss=f"{record['train_loss']:.4f}",
                                    tok_s=f"{record['tokens_per_sec']:.0f}")
                preempted = step < end and preemption.reached(step)
                if preempted or step % cfg.checkpoint.every == 0 or step == cfg.steps:
                    setup.ckpt.save(step, state,
                                    checkpoint_meta(cfg, step, setup.mesh, setup.tokens))
                bar.update(1)
                if preempted:
                    setup.ckpt.wait()
                    out(f"preempted (SIGTERM): saved a checkpoint at step {step} in "
                        f"{setup.ckpt.directory}; rerun the same command to resume")
                    end = step
                    break
    except Exception as e:
        # XLA's RESOURCE_EXHAUSTED: the state or the step does not fit the device.
        if isinstance(e, MemoryError) or (isinstance(e, jax.errors.JaxRuntimeError) and (
                "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e))):
            raise UsageError(_out_of_memory_message(cfg, e)) from e
        raise
    finally:
        try:
            for opened in (bar, writer):
                if opened is not None:
                    opened.close()
            _close(setup.ckpt)  # waits for the last save
        finally:  # a SIGTERM while the last save is written must not kill it half-way
            if preemption is not None:
                preemption.close()
    if preempted:
        raise Preempted(end, setup.ckpt.directory)
    last_eval = loop.last_eval
    if end == cfg.steps:  # finished: the plot and the summary line
        writer.plot()
        if not last_eval and lead:  # resumed a finished run: report its last evaluation
            evals = [r for r in metrics.read_metrics(workdir) if "val_loss" in r]
            last_eval = evals[-1] if evals else {}
        if last_eval:
            out(summary_line(last_eval))
    return last_eval


def _out_of_memory_message(cfg: configs.Config, error: Exception | str) -> str:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
    return (f"the training step does not fit the device memory ({first}); use a smaller "
            f"micro-batch (--data.batch_size {cfg.data.batch_size} with a larger "
            f"--optim.grad_accum_steps), recomputation (--model.remat block), more FSDP "
            f"(--mesh.fsdp) or a shorter --model.max_seq_len ({cfg.seq_len}); "
            "python -m examples.lm.tools.train_compile checks a config without running it")


def attention_bytes(cfg: configs.Config, mesh) -> int:
    """Bytes per device of one layer's attention scores, (batch, heads, T, T) in the compute
    dtype: a lower bound on the step's memory, quadratic in the sequence (`check_fits`)."""
    ranks = int(mesh.shape["data"]) * int(mesh.shape["fsdp"])
    batch = -(-cfg.data.batch_size // ranks)
    heads = -(-cfg.model.num_heads // int(mesh.shape["tensor"]))
    return batch * heads * cfg.seq_len**2 * jnp.dtype(cfg.model.compute_dtype).itemsize


def check_fits(cfg: configs.Config, mesh, *, limit: int | None = None) -> None:
    """Raise UsageError, before anything compiles, when one layer's attention scores alone exceed
    the device memory (`limit`; default: that of this host's first device of `mesh`, as only
    addressable devices report it; for CPUs, the host's memory shared among its CPU devices)."""
    need = attention_bytes(cfg, mesh)
    if limit is None:
        device = next((d for d in mesh.devices.flat if d.process_index == jax.process_index()),
                      mesh.devices.flat[0])
        limit = (device.memory_stats() or {}).get("bytes_limit")
        if limit is None and device.platform == "cpu" and hasattr(os, "sysconf"):
            with contextlib.suppress(ValueError, OSError):
                limit = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                         // max(1, len(jax.local_devices(backend="cpu"))))
    if limit and need > limit:
        raise UsageError(_out_of_memory_message(
            cfg, f"one layer's attention scores alone take {need / 2**30:.1f} GiB per device, "
                 f"the device has {limit / 2**30:.1f} GiB"))


class _Batches:
    """Global batches of a BatchSampler or ValidationSet on the mesh (`sharding.global_batch`)."""

    def __init__(self, source, mesh, *, replicated=False):
        self.source, self.mesh, self.replicated = source, mesh, replicated

    def get(self, index):
        return tuple(sharding.global_batch(x, self.mesh, batch_size=self.source.batch_size,
                                           replicated_rows=self.replicated)
                     for x in self.source.get(index))


def _scalar(x) -> float:
    return float(np.asarray(jax.device_get(x)))


def _floats(out: dict) -> dict:
    return {k: _scalar(v) for k, v in out.items()}


class _Loop:
    """One optimizer step after another: train, probe the head, evaluate, log, save."""

    def __init__(self, setup: Run, trainer: Trainer, writer: metrics.MetricsWriter):
        cfg, mesh = setup.cfg, setup.mesh
        self.cfg, self.trainer, self.writer = cfg, trainer, writer
        self.accum = cfg.optim.grad_accum_steps
        self.train_batches = _Batches(setup.train_set, mesh)
        self.val_batches = _Batches(setup.val_set, mesh)
        self.probe_inputs = _Batches(setup.probe, mesh, replicated=True).get(0)[0]
        self.tokens_per_step = cfg.data.batch_size * cfg.seq_len * self.accum
        self.flops_per_token = model_lib.flops_per_token(cfg.model)
        self.peak_flops = metrics.peak_flops()  # None for an unknown device: no MFU
        self.lr = optimizer.lr_schedule(cfg.optim.learning_rate, cfg)
        self.last_eval: dict = {}
        self.window_start, self.window_steps = time.perf_counter(), 0

    def step(self, state, step: int):
        """Apply optimizer step `step` (1-based); return (state, the record logged or {})."""
        cfg, trainer, every = self.cfg, self.trainer, self.cfg.eval.diameter_every
        is_eval = step % cfg.eval.every == 0 or step == cfg.steps
        is_probe = not is_eval and step > cfg.steps - cfg.eval.probe_last_steps
        # The head step's diameter alone, where no probe measures it anyway.
        is_diameter = (not (is_eval or is_probe) and every > 0
                       and (step % every == 0 or step == cfg.steps))
        measured = is_eval or is_probe or is_diameter
        head_old = trainer.head_of(state["params"], state["rest"]) if measured else None
        losses = []
        for micro in range(self.accum):
            inputs, targets = self.train_batches.get((step - 1) * self.accum + micro)
            state, loss = trainer.train_step(state, inputs, targets, trainer.rates)
            losses.append(loss)
        self.window_steps += 1
        if not (measured or step % cfg.log_every == 0):
            return state, {}
        lr = trainer.head_lr(step - 1)  # the head's rate of the update just applied
        record = {"step": step, "train_loss": _scalar(sum(losses) / self.accum),
                  "learning_rate": _scalar(self.lr(step - 1)), "head_learning_rate": _scalar(lr)}
        if is_eval:
            record |= self._evaluate(state)
        if measured:  # the head and its decay, typed as the probes take them
            head = (state["params"], state["rest"])
            wd = jnp.float32(trainer.head_group.weight_decay)
        if is_eval or is_probe:
            record |= (_floats(trainer.head_probe(*head, head_old, self.probe_inputs, lr, wd))
                       | evaluate.tracked_head_stats(state["opt_state"]))
        if is_diameter:
            record |= _floats(trainer.step_diameter(*head, head_old, lr, wd))
        if is_eval and trainer.centring_probe is not None:
            record |= _floats(trainer.centring_probe(*head, state["opt_state"], head_old, lr, wd))
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

    def _throughput(self) -> dict:
        """Tokens/s, s/step (and model-FLOPs utilisation) since the last record."""
        elapsed = time.perf_counter() - self.window_start
        speed = self.window_steps * self.tokens_per_step / elapsed
        out = {"tokens_per_sec": speed, "sec_per_step": elapsed / self.window_steps}
        if self.peak_flops is not None:  # model-FLOPs utilisation
            out["mfu"] = speed * self.flops_per_token / (self.peak_flops * jax.device_count())
        self.window_start, self.window_steps = time.perf_counter(), 0
        return out


def summary_line(record: dict) -> str:
    """The run's last printed line: validation loss, head diameter and Hilbert RMS."""
    return (f"final step {record['step']}: val_loss {record['val_loss']:.4f}  "
            f"head_diameter {record['head_diameter']:.4g} "
            f"(step without decay {record['head_step_diameter']:.4g})  "
            f"hilbert_rms {record['hilbert_rms']:.4g} "
            f"(step without decay {record['head_step_hilbert_rms']:.4g})")


COMPILATION_CACHE = "~/.cache/rowgeom/jax"
# The default cache's bound: past it, JAX deletes the least recently used programs (a program
# is kept however long it took to compile, and every config and jax version adds its own).
COMPILATION_CACHE_MAX_BYTES = 4 << 30


def use_compilation_cache() -> None:
    """Keep compiled programs in JAX's persistent cache, `COMPILATION_CACHE` of at most
    `COMPILATION_CACHE_MAX_BYTES` (`JAX_COMPILATION_CACHE_DIR` / `_MAX_SIZE` say otherwise,
    `JAX_ENABLE_COMPILATION_CACHE=false` turns it off), so that a relaunched run and runs that
    differ only in their seed or rates load the step instead of compiling it. Call it before
    anything compiles: JAX decides once per process whether it uses the cache."""
    if jax.config.jax_enable_compilation_cache and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(COMPILATION_CACHE))
        if jax.config.jax_compilation_cache_max_size == -1:  # -1: JAX's default, no bound
            jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_MAX_BYTES)


def main(argv=None) -> dict:
    """The command line (configs.py); a user error prints `train.py: error: ...`, exit status 2."""
    use_compilation_cache()
    parser = configs.parser(description=__doc__.split("\n\n")[0])
    args = parser.parse_args(argv)
    try:
        cfg, explicit = configs.config_from_args(args), configs.explicit_fields(args)
        sharding.maybe_initialize_distributed(args.distributed)
    except ValueError as e:
        parser.error(str(e))
    if args.benchmark:
        from examples.lm.tools.benchmark import benchmark

        return benchmark(cfg, steps=args.benchmark)
    workdir = args.workdir or f"runs/{args.config or configs.DEFAULT_CONFIG}"
    try:
        return train(cfg, workdir, overwrite=args.overwrite, change_horizon=args.change_horizon,
                     explicit=explicit, progress=not args.no_progress)
    except UsageError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
