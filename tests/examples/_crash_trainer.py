"""The example trainer's command line with one test-only kill point (for test_crash_resume.py).

    ROWGEOM_TEST_KILL=POINT:STEP python tests/examples/_crash_trainer.py TRAINER_ARGS...

runs the trainer's command line (`ENTRY` as `__main__`, with TRAINER_ARGS) and stops the process
itself at a known point of its run, instead of at a wall-clock moment chosen from outside:

- ``restore:N``    SIGKILL on entering the restore of checkpoint N (start-up, before any step).
- ``step:N``       SIGKILL after step N's metrics line, before its checkpoint; earlier
                   asynchronous saves are waited for first, so what is on disk is known.
- ``writing:N``    SIGKILL while checkpoint N is being written: its save has started and orbax has
                   created its (temporary) directory; its finalization is held back, so it stays
                   half-written.
- ``finalizing:N`` SIGKILL from orbax's background thread once every array of checkpoint N is
                   written, as the checkpoint handler's `finalize` (the last step before orbax
                   marks the checkpoint complete) begins.
- ``sigterm:N``    SIGTERM after step N's metrics line (a preemption notice: the trainer saves a
                   checkpoint at step N and exits 0).

A kill point that is never reached lets the run finish (exit status 0), which the test reports.
Without ROWGEOM_TEST_KILL this is the plain command. The hooks use the trainer's
`checkpointing.Checkpointer` (save / restore / wait), `metrics.MetricsWriter.write`, and orbax's
public `CheckpointHandler.finalize` and `orbax.checkpoint.path.step` helpers.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ENTRY = "examples.lm.train"  # the trainer's command line, run as `python -m ENTRY`
KILL_ENV = "ROWGEOM_TEST_KILL"
POINTS = ("restore", "step", "writing", "finalizing", "sigterm")
DIR_TIMEOUT_S = 60  # for orbax to create a checkpoint's directory once its save has started


def _die(message: str):
    """Exit with a message (status 3): the kill point could not be placed as asked."""
    print(f"_crash_trainer: {message}", file=sys.stderr, flush=True)
    os._exit(3)


def _kill():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def unfinalized_steps(directory) -> set[int]:
    """Steps of the checkpoints in `directory` that orbax has not finalized (half-written)."""
    from orbax.checkpoint.path import step as step_lib

    found = set()
    directory = Path(directory)
    if not directory.is_dir():
        return found
    for p in directory.iterdir():
        try:
            step = step_lib.step_from_checkpoint_name(p.name)
        except ValueError:  # not a checkpoint (orbax's own metadata files)
            continue
        if not step_lib.is_path_finalized(p):
            found.add(step)
    return found


def install(point: str, at: int) -> None:
    """Patch the trainer's checkpointing / metrics (and orbax's handler) to stop at `point`."""
    import orbax.checkpoint as ocp

    from examples.lm import checkpointing, metrics

    if point not in POINTS:
        _die(f"{KILL_ENV}: unknown point {point!r}, expected one of {POINTS}")
    checkpointers: list = []
    finalize_mode = {"mode": None}  # None, "kill" or "hold", armed for checkpoint `at` only
    cls = checkpointing.Checkpointer
    init, save, restore = cls.__init__, cls.save, cls.restore
    write = metrics.MetricsWriter.write
    finalize = ocp.StandardCheckpointHandler.finalize

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        checkpointers.append(self)

    def patched_restore(self, step, *args, **kwargs):
        if point == "restore":
            if step != at:
                _die(f"restoring checkpoint {step}, but the kill was planned at {at}")
            _kill()
        return restore(self, step, *args, **kwargs)

    def patched_save(self, step, *args, **kwargs):
        if point not in ("writing", "finalizing") or step != at:
            return save(self, step, *args, **kwargs)
        self.wait()  # earlier saves finish first: only checkpoint `at` meets the armed hook
        finalize_mode["mode"] = "kill" if point == "finalizing" else "hold"
        save(self, step, *args, **kwargs)
        if point == "writing":
            deadline = time.monotonic() + DIR_TIMEOUT_S
            while at not in unfinalized_steps(self.directory):
                if time.monotonic() > deadline:
                    _die(f"checkpoint {at}'s directory did not appear in {DIR_TIMEOUT_S}s")
                time.sleep(0.001)
            _kill()

    def patched_finalize(self, directory, *args, **kwargs):
        if finalize_mode["mode"] == "kill":
            _kill()
        if finalize_mode["mode"] == "hold":  # the main thread kills the process meanwhile
            threading.Event().wait()
        return finalize(self, directory, *args, **kwargs)

    def patched_write(self, record, *args, **kwargs):
        write(self, record, *args, **kwargs)
        if record.get("step") != at:
            return
        if point == "step":
            for c in checkpointers:
                c.wait()
            _kill()
        elif point == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)

    cls.__init__, cls.save, cls.restore = patched_init, patched_save, patched_restore
    metrics.MetricsWriter.write = patched_write
    ocp.StandardCheckpointHandler.finalize = patched_finalize


def main(argv: list[str]) -> None:
    spec = os.environ.get(KILL_ENV)
    if spec:
        point, _, at = spec.partition(":")
        if not at.isdigit():
            _die(f"{KILL_ENV}={spec!r}: expected POINT:STEP, e.g. writing:4")
        install(point, int(at))
    sys.argv = [ENTRY, *argv]
    runpy.run_module(ENTRY, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
