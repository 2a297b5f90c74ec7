"""Checkpoints with orbax: train state (params, optimizer state, step, RNG) plus JSON metadata.

- Saves are asynchronous: `save` returns once the arrays are copied off the accelerator, and the
  files are written in the background (call `wait` before reading them or exiting).
- Orbax writes each checkpoint into a temporary directory and renames it when complete, and
  `latest_step` / `restore` only see finalized checkpoints, so a run killed mid-save resumes from
  the previous complete one.
- `restore` takes an abstract target (`jax.ShapeDtypeStruct`s carrying the *target* shardings), so a
  checkpoint written on one mesh restores onto another (e.g. 1 device -> 8 devices, or a different
  pod slice); arrays are read straight into their target shards.
- The directory may be local or a `gs://` path (orbax/tensorstore handle Cloud Storage).
"""

from __future__ import annotations

import os

import orbax.checkpoint as ocp

STATE = "state"
META = "meta"


def _absolute(directory: str | os.PathLike) -> str:
    directory = os.fspath(directory)
    return directory if "://" in directory else os.path.abspath(directory)


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager` keeping the last `keep` complete checkpoints."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
        self.directory = _absolute(directory)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=(STATE, META))

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving `state` (a pytree of arrays) and JSON-serialisable `meta` at `step`."""
        self._manager.save(
            step, args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(state),
                                             META: ocp.args.JsonSave(meta)}), force=True)

    def restore_meta(self, step: int) -> dict:
        """Only the JSON metadata of checkpoint `step` (cheap; check it before restoring)."""
        return self._manager.restore(
            step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]

    def restore(self, step: int, abstract_state):
        """Return (state, meta) of checkpoint `step`, laid out as `abstract_state` says.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with shardings for the current mesh.
        """
        out = self._manager.restore(
            step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract_state),
                                             META: ocp.args.JsonRestore()}))
        return out[STATE], out[META]

    def wait(self) -> None:
        """Block until pending asynchronous saves are complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
