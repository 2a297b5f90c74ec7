"""The learning-rate schedule and `rowgeom.lm_optimizer` for a `Config`: every group's peak rate
and decay from `rowgeom.group_options`, each following `lr_schedule` of its peak, after
global-norm clipping, in `optax.MultiSteps` to accumulate."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
import optax

import rowgeom
from examples.lm import configs


def lr_schedule(peak, cfg: configs.Config):
    """Learning rate by the number of updates already applied: linear warmup to `peak` over
    `cfg.effective_warmup()` updates, then a cosine ("cosine") or a constant phase and a linear
    decay over the last `decay_fraction` ("wsd"), both ending at `min_lr_ratio·peak`. The peak
    (a float or a traced scalar) multiplies the schedule of peak one: nothing is decided by its
    value, so a train step can take it as an argument."""
    o = cfg.optim
    warm, total = cfg.effective_warmup(), cfg.steps
    if o.schedule == "cosine":
        base = optax.warmup_cosine_decay_schedule(0.0, 1.0, warm, total, o.min_lr_ratio)
    else:
        stable_end = max(total - max(round(total * o.decay_fraction), 1), warm)
        base = optax.join_schedules(
            [optax.linear_schedule(0.0, 1.0, warm), optax.constant_schedule(1.0),
             optax.linear_schedule(1.0, o.min_lr_ratio, total - stable_end)], [warm, stable_end])
    # optax counts from 0 = "at the start of the warmup"; update t (0-based) uses the value at
    # t + 1, so that the first update is not wasted with a zero learning rate.
    return lambda count: peak * base(jnp.asarray(count) + 1)


def optimizer_options(cfg: configs.Config) -> dict:
    """rowgeom.lm_optimizer's options for `cfg` but the rate. "rownorm-rescaled" is RowNorm with
    `rescale="exact"`; a tied table is trained as the embedding; a None rate or decay leaves
    rowgeom's default."""
    o, rescaled = cfg.optim, cfg.head == "rownorm-rescaled"
    rownorm = rescaled or cfg.head == "rownorm"
    head = rowgeom.HeadOptions(optimizer="rownorm" if rescaled else cfg.head,
                               rescale="exact" if rescaled else None,
                               # RowNorm-only fields: None / False for the other heads.
                               eps=o.head_eps if rownorm else None,
                               bias_correction=o.head_bias_correction and rownorm,
                               num_valid=cfg.model.valid_vocab_size,
                               track_every_k_steps=track_every_k_steps(cfg),
                               impl=o.head_impl)
    groups = {"head": rowgeom.GroupOptions(learning_rate=o.head_learning_rate,
                                           weight_decay=o.head_weight_decay),
              "embedding": rowgeom.GroupOptions(learning_rate=o.embedding_learning_rate),
              "vector": rowgeom.GroupOptions(learning_rate=o.vector_learning_rate)}
    muon = rowgeom.MuonOptions(scale=o.muon_scale, eps=o.muon_eps)
    adam = rowgeom.AdamOptions(b2=o.adam_b2, eps=o.adam_eps)
    return dict(head=head, tied="embedding" if cfg.model.tied_embeddings else None,
                weight_decay=o.weight_decay, groups=groups, muon=muon, adam=adam)


def group_hparams(cfg: configs.Config) -> Mapping[str, rowgeom.GroupOptions]:
    """Each optimizer group's peak rate and decay, resolved by rowgeom's own defaults."""
    options = optimizer_options(cfg)
    del options["tied"]  # which group a tied table joins changes no group's settings
    return rowgeom.group_options(cfg.optim.learning_rate, **options)


def head_group(cfg: configs.Config) -> rowgeom.GroupOptions:
    """The group that trains the head: "head", or "embedding" for a tied table."""
    return group_hparams(cfg)["embedding" if cfg.model.tied_embeddings else "head"]


def track_every_k_steps(cfg: configs.Config) -> int:
    """How often the head tracker measures: on the steps the trainer reads it (evaluations,
    the last step and the last `eval.probe_last_steps`), and no other."""
    if cfg.eval.probe_last_steps:
        return 1
    return math.gcd(cfg.eval.every, cfg.steps)


def group_rates(cfg: configs.Config) -> dict[str, dict[str, np.float32]]:
    """Each group's peak learning rate and weight decay, as float32 scalars: the train step's
    argument (`build_optimizer`'s `rates`)."""
    return {group: {"learning_rate": np.float32(o.learning_rate),
                    "weight_decay": np.float32(o.weight_decay)}
            for group, o in group_hparams(cfg).items()}


def build_optimizer(cfg: configs.Config, rates=None) -> optax.GradientTransformation:
    """Global-norm clipping -> rowgeom.lm_optimizer (each group on `lr_schedule` of its peak),
    in optax.MultiSteps to accumulate. `rates` (`group_rates`' structure, default
    `group_rates(cfg)`) may be traced: the train step takes them as an argument, so runs that
    differ only in their rates and decays (a rate sweep, the paper's tuned and matched runs)
    lower to one program. The state's structure does not depend on them."""
    rates = group_rates(cfg) if rates is None else rates
    groups = {group: dataclasses.replace(
        o, learning_rate=lr_schedule(rates[group]["learning_rate"], cfg),
        weight_decay=rates[group]["weight_decay"]) for group, o in group_hparams(cfg).items()}
    tx = rowgeom.lm_optimizer(cfg.optim.learning_rate, **{**optimizer_options(cfg),
                                                          "groups": groups})
    if cfg.optim.grad_clip is not None:
        tx = optax.chain(optax.clip_by_global_norm(cfg.optim.grad_clip), tx)
    if cfg.optim.grad_accum_steps > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=cfg.optim.grad_accum_steps)
    return tx
