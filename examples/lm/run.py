"""Everything a training run resolves before its first step, and what it saves with a checkpoint.

`start(cfg, workdir)` reads the work directory: with checkpoints, the run resumes from the latest
complete one and follows its saved config (resume.py); it then builds the mesh, checks the batch
against it, and loads the data (data.py) and the fixed validation set (batches.py). Every problem
is a `UsageError` in one line, naming the flag to change.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

import rowgeom
from examples.lm import batches, checkpointing, configs, data, resume, tokenization
from examples.lm import mesh as mesh_lib
from examples.lm.optimizer import lr_schedule, optimizer_options
from examples.lm.trainer import Trainer


class UsageError(ValueError):
    """A problem with the command line, the data or the work directory, explained in one line."""


class Run(NamedTuple):
    """What `start` resolves before the first step."""

    cfg: configs.Config
    mesh: jax.sharding.Mesh
    ckpt: checkpointing.Checkpointer
    latest: int | None  # the checkpoint to resume from
    tokens: data.TokenSplits
    val_set: batches.ValidationSet


def start(cfg: configs.Config, workdir: str, *, explicit=None, overwrite: bool = False,
          change_horizon: bool = False, out=print) -> Run:
    """Resolve `cfg` against `workdir`'s checkpoints, then build the mesh and load the data.

    explicit, change_horizon: see `resume.resolve_config`. overwrite: delete the checkpoints and
    start fresh. `out` prints what was decided (one line each).
    """
    try:
        return _start(cfg, workdir, explicit=explicit, overwrite=overwrite,
                      change_horizon=change_horizon, out=out)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e


def _start(cfg, workdir, *, explicit, overwrite, change_horizon, out) -> Run:
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
        cfg, changed = resume.resolve_config(cfg, meta, explicit=explicit,
                                             change_horizon=change_horizon)
        _report_changes(changed, meta["step"], cfg, out)
    mesh = mesh_lib.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    dp, batch = mesh_lib.data_parallel_size(mesh), cfg.data.batch_size
    if batch % dp or batch % jax.process_count():
        raise ValueError(f"--data.batch_size ({batch}) must be divisible by the data-parallel "
                         f"size --mesh.data x --mesh.fsdp ({dp}) and by the process count "
                         f"({jax.process_count()})")
    if cfg.effective_warmup() != cfg.optim.warmup_steps:
        out(f"--optim.warmup_steps {cfg.optim.warmup_steps} does not fit --steps {cfg.steps}: "
            f"warming up over {cfg.effective_warmup()} steps instead")
    tokens = data.prepare_tokens(source=cfg.data.source,
                                 workdir=cfg.data.dir or _default_data_dir(workdir),
                                 vocab_size=cfg.model.vocab_size, tokenizer=cfg.data.tokenizer)
    if tokens.vocab_size > cfg.model.num_tokens:
        raise ValueError(f"the tokenizer has {tokens.vocab_size} tokens but the model has "
                         f"{cfg.model.num_tokens} (--model.vocab_size / "
                         "--model.valid_vocab_size)")
    need = cfg.data.batch_size * cfg.seq_len + 1
    if len(tokens.train) < need:
        raise ValueError(f"the training split has {len(tokens.train)} tokens, fewer than one "
                         f"batch of batch_size x seq_len + 1 = {need}; use more data or a "
                         "smaller --data.batch_size / --model.max_seq_len")
    val_set = batches.ValidationSet(
        tokens.val, batch_size=cfg.data.batch_size, seq_len=cfg.seq_len,
        eval_tokens=cfg.resolved_eval_tokens(), process_index=jax.process_index(),
        process_count=jax.process_count(), vocab_size=cfg.model.num_tokens)
    return Run(cfg, mesh, ckpt, latest, tokens, val_set)


def with_tokenizer_vocab(cfg: configs.Config) -> configs.Config:
    """With `data.tokenizer`: model.vocab_size = the tokenizer's size rounded up to a multiple of
    128 and model.valid_vocab_size = the tokenizer's size (the rest is padding)."""
    if cfg.data.tokenizer is None:
        return cfg
    n = tokenization.vocab_size(tokenization.load_tokenizer(cfg.data.tokenizer))
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
        listed = ", ".join(f"--{name} {was!r} -> {now!r}" for name, (was, now) in changed.items())
        out(f"resuming with changed settings: {listed}")


def _default_data_dir(workdir: str) -> str:
    if checkpointing.is_remote(workdir):  # the token cache is memory-mapped: keep it local
        return str(Path("~/.cache/rowgeom/lm-data").expanduser())
    return str(Path(workdir) / "data")


def _scalar(x) -> float:
    return float(np.asarray(jax.device_get(x)))


def restore_or_init(run: Run, trainer: Trainer, out=print):
    """The train state: restored from `run.latest` onto the trainer's shardings, or fresh."""
    with jax.set_mesh(run.mesh):
        if run.latest is not None:
            state, _ = run.ckpt.restore(run.latest, trainer.abstract_state)
            out(f"resumed from step {run.latest} ({run.ckpt.directory})")
        else:
            state = trainer.init()
            out(f"no checkpoint in {run.ckpt.directory}: starting fresh")
    return state


def describe(run: Run, trainer: Trainer, state, out=print) -> None:
    """Print the mesh, the head, the parameter count, the data, and each parameter's label,
    geometry, peak learning rate and decay (`rowgeom.describe`)."""
    cfg, tokens = run.cfg, run.tokens
    head = ("tied head (trained as the embedding)" if cfg.model.tied_embeddings
            else f"{cfg.head} head")
    out(f"{mesh_lib.describe(run.mesh)}; {head}; "
        f"{sum(x.size for x in jax.tree.leaves(state['params'])):,} parameters; "
        f"{'exact' if trainer.exact_diameter else 'bracketed'} head diameter; data: "
        f"{tokens.format}, {len(tokens.train):,} train / {len(tokens.val):,} validation tokens, "
        f"{run.val_set.num_tokens:,} evaluated")
    out(str(rowgeom.describe(state["params"], cfg.optim.learning_rate,
                             **optimizer_options(cfg))))


def checkpoint_meta(cfg: configs.Config, step: int, mesh) -> dict:
    """The JSON saved next to the state. `config` is the whole run definition (the schedule
    horizon included): a resumed run follows it."""
    return {"step": step, "data_position": step * cfg.optim.grad_accum_steps,
            "config": dataclasses.asdict(cfg),
            "mesh": {a: int(mesh.shape[a]) for a in mesh_lib.AXES},
            "process_count": jax.process_count()}
