"""Resuming a run: which options a resumed run takes from its checkpoint, and preemption.

A checkpoint's metadata holds the whole config of its run. A resumed run follows it: the schedule
horizon (`steps`), learning rates, data, model and every other field that defines what is trained
or measured. Fields in `RUNTIME_FIELDS` (cadence, placement) follow the command line. A command
line that sets a run-defining field to another value is refused with the field named, except
`steps` with `change_horizon` (an explicit request to re-time the schedule).
"""

from __future__ import annotations

import signal
import threading

import jax

from examples.lm import configs

# Cadence and placement, which do not change what is trained: a resumed run takes them from its
# command line. Every other field defines the run and is followed from the checkpoint. The
# recomputation policy and the loss's chunking trade memory for time and change neither the
# checkpoint nor (beyond float32 rounding) the step; the layer layout (model.scan_layers) is the
# checkpoint's layout and is followed.
RUNTIME_FIELDS = frozenset({
    "data.dir", "checkpoint.dir", "checkpoint.keep", "checkpoint.every", "log_every",
    "eval.every", "eval.probe_last_steps", "eval.exact_diameter_max_elements", "mesh.data",
    "mesh.fsdp", "mesh.tensor", "model.remat", "model.loss_chunk"})
# Fields added after checkpoints were first written: a checkpoint without one was written with
# this value (every earlier checkpoint stores its blocks unrolled).
_LEGACY_VALUES = {"model.scan_layers": False}
# Runtime fields that belong to the machine rather than the run: never taken from a checkpoint.
_MACHINE_FIELDS = frozenset({"data.dir", "checkpoint.dir", "mesh.data", "mesh.fsdp",
                             "mesh.tensor"})


def resolve_config(cfg: configs.Config, meta: dict, *, explicit=None,
                   change_horizon: bool = False) -> tuple[configs.Config, dict]:
    """(config, changes): the config a resumed run follows — the checkpoint's, with runtime
    fields from `cfg` — and the `{dotted path: (saved, now)}` it changed.

    explicit: fields (dotted paths) the command line set (None: all of them). Those that differ
    from the checkpoint raise a ValueError if they define the run, except `steps` with
    `change_horizon` (the schedule is then rebuilt for the new horizon). Fields not set
    explicitly are taken from the checkpoint, so `--workdir DIR` alone resumes any run.
    """
    saved = meta.get("config")
    if not isinstance(saved, dict) or not isinstance(meta.get("step"), int):
        raise ValueError("cannot resume: the checkpoint's metadata has no config and step "
                         f"(not written by this trainer?): {str(meta)[:200]}")
    now_flat = configs.flatten(cfg)
    saved_given = _LEGACY_VALUES | configs.flatten(saved)
    try:
        saved_flat = configs.flatten(configs.override(cfg, saved_given))
    except ValueError as e:
        raise ValueError(f"cannot resume: the checkpoint's config does not fit this trainer: "
                         f"{e}") from None
    explicit = set(now_flat) if explicit is None else set(explicit)
    merged, conflicts, changed = {}, {}, {}
    for name, now in now_flat.items():
        was = saved_flat[name]
        if name in _MACHINE_FIELDS or (name in explicit and now != was and (
                name in RUNTIME_FIELDS or (name == "steps" and change_horizon))):
            merged[name] = now
            if now != was and name not in _MACHINE_FIELDS:
                changed[name] = (was, now)
        elif name in explicit and now != was:
            conflicts[name] = (was, now)
        else:
            merged[name] = was
    if conflicts:
        hint = " (or add --change_horizon to change --steps)" if "steps" in conflicts else ""
        if "model.scan_layers" in conflicts:
            hint += (" (scanned and unrolled blocks are stored in different layouts, "
                     "layers/<name> of shape (L, ...) against layers/<i>/<name>: a checkpoint "
                     "restores only into the layout it was written in)")
        listed = "; ".join(f"--{name} saved {was!r}, now {now!r}"
                           for name, (was, now) in sorted(conflicts.items()))
        raise ValueError(
            f"cannot resume: these fields differ from the checkpoint's: {listed}; rerun with the "
            f"saved values{hint}, or start fresh with --overwrite or a new --workdir")
    return configs.override(cfg, merged), dict(sorted(changed.items()))


class PreemptionWatcher:
    """Whether to save and stop after a step because the machine is going away.

    One process: SIGTERM (what a preempted Cloud TPU VM or a cluster scheduler sends) sets a flag
    that the loop checks after each step. Several processes: JAX's preemption notifier (started by
    `jax.distributed.initialize`) receives the SIGTERM, and orbax's `reached_preemption` tells
    every host the same step at which to save; no Python handler is installed then, as it would
    replace JAX's.
    """

    def __init__(self, ckpt):
        self.ckpt, self.signalled, self._previous = ckpt, False, None
        if (jax.process_count() == 1
                and threading.current_thread() is threading.main_thread()):
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.signalled = True

    def reached(self, step: int) -> bool:
        if jax.process_count() > 1 and self.ckpt.reached_preemption(step):
            return True
        return self.signalled

    def close(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
