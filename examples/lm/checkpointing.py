"""Checkpoints with orbax: the train state plus JSON metadata (the run's config), local or remote.

Saves are asynchronous and complete-only (orbax renames a finished temporary directory), so a
run killed mid-save resumes from the previous one. `restore` reads arrays straight into the
*target* shardings (another mesh is fine). An unreadable checkpoint raises `DamagedCheckpoint`,
and the trainer sets it aside (`set_aside`) and falls back to the previous one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os

import jax
import orbax.checkpoint as ocp
from etils import epath

STATE = "state"
META = "meta"
DAMAGED = ".damaged"  # suffix of a checkpoint directory set aside as unreadable


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files cannot be read (truncated, deleted, corrupt)."""


def is_remote(path: str | os.PathLike) -> bool:
    """True for URL-style paths (`gs://`, `s3://`, ...), which must not go through pathlib."""
    return "://" in os.fspath(path)


@contextlib.contextmanager
def workdir_lock(workdir: str | os.PathLike, *, enabled: bool = True):
    """Hold an exclusive `flock` on the local directory `workdir` (created if missing) while the
    block runs, so that two runs never write one workdir; another holder is a ValueError. The
    kernel drops the lock however the process dies, so a killed run never blocks its relaunch.
    Remote workdirs, a file (the trainer names that error) and file systems without `flock` go
    unlocked."""
    path = os.path.expanduser(os.fspath(workdir))
    fd, created = None, not os.path.exists(path)
    if enabled and not is_remote(path) and not (os.path.exists(path) and not os.path.isdir(path)):
        os.makedirs(path, exist_ok=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            fd = None
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ValueError(
                    f"another process is training in --workdir {workdir} (it holds the "
                    "directory's lock): wait for it to end, or use another --workdir") from None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # and with it the lock
            if created:  # a launch that failed before writing anything leaves no directory
                with contextlib.suppress(OSError):
                    os.rmdir(path)  # only if empty


# In a workdir whose run keeps its checkpoints elsewhere (--checkpoint.dir): where they are.
CHECKPOINT_DIR_FILE = "checkpoint_dir.txt"


def recorded_directory(workdir) -> str | None:
    """The checkpoint directory `workdir`'s run recorded (`record_directory`), or None."""
    path = as_path(workdir) / CHECKPOINT_DIR_FILE
    return (path.read_text().strip() or None) if path.exists() else None


def has_checkpoints(directory) -> bool:
    """Whether `directory` holds a complete checkpoint (a `<step>` directory), without opening
    it with orbax."""
    path = as_path(directory)
    return path.is_dir() and any(p.name.isdigit() for p in path.iterdir())


def record_directory(workdir, directory) -> None:
    """Record in `workdir` that its run keeps its checkpoints in `directory`, so that the
    relaunch finds them without --checkpoint.dir; the default place needs no record."""
    path, directory = as_path(workdir) / CHECKPOINT_DIR_FILE, str(directory)
    if directory == str(as_path(workdir) / "checkpoints"):
        path.unlink(missing_ok=True)
    elif not path.exists() or path.read_text().strip() != directory:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(directory + "\n")


def as_path(path: str | os.PathLike) -> epath.Path:
    """An `etils.epath.Path`: remote paths stay URLs (pathlib would turn `gs://b` into
    `gs:/b`); local ones are made absolute."""
    path = os.fspath(path)
    return epath.Path(path if is_remote(path) else os.path.abspath(os.path.expanduser(path)))


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager` keeping the last `keep` complete checkpoints."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
        self.directory = as_path(directory)
        # Explicit handlers (rather than item names) so stored metadata is readable before restore.
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=async_save),
            item_handlers={STATE: ocp.StandardCheckpointHandler(),
                           META: ocp.JsonCheckpointHandler()})

    def latest_step(self) -> int | None:  # the newest complete checkpoint's step
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def reached_preemption(self, step: int) -> bool:
        """Whether every host has reached JAX's preemption sync point at `step` (multi-host)."""
        return self._manager.reached_preemption(step)

    def delete_all(self) -> None:
        """Delete every checkpoint, damaged ones included (--overwrite)."""
        self._manager.wait_until_finished()
        for step in self.all_steps():
            self._manager.delete(step)
        for path in self.damaged():
            path.rmtree()
        self._manager.reload()

    def damaged(self) -> list[epath.Path]:
        """The checkpoint directories set aside by `set_aside`."""
        if not self.directory.exists():
            return []
        return sorted(p for p in self.directory.iterdir() if DAMAGED in p.name)

    def set_aside(self, step: int) -> epath.Path:
        """Rename checkpoint `step` to `<step>.damaged` (`<step>.damaged-2`, ... when taken), out
        of orbax's sight but kept for inspection; return the new path."""
        self._manager.wait_until_finished()
        source = self.directory / str(step)
        target, n = self.directory / f"{step}{DAMAGED}", 1
        while target.exists():
            n += 1
            target = self.directory / f"{step}{DAMAGED}-{n}"
        try:
            source.rename(target)
        except FileNotFoundError:  # another process (multi-host) moved it first
            target = self.directory / f"{step}{DAMAGED}"
        self._manager.reload()
        return target

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving `state` (a pytree of arrays) and JSON-serialisable `meta` at `step`."""
        self._manager.save(
            step, args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(state),
                                             META: ocp.args.JsonSave(meta)}), force=True)

    def _unreadable(self, step: int, error: Exception) -> DamagedCheckpoint:
        first = (str(error).strip().splitlines() or [""])[0][:200]
        return DamagedCheckpoint(
            f"checkpoint {step} in {self.directory} cannot be read (truncated, corrupt or not "
            f"written by this trainer): {type(error).__name__}: {first}")

    def restore_meta(self, step: int) -> dict:
        """Only the JSON metadata of checkpoint `step` (cheap; check it before restoring)."""
        try:
            meta = self._manager.restore(
                step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
        except Exception as e:
            raise self._unreadable(step, e) from e
        if not isinstance(meta, dict):
            raise self._unreadable(step, TypeError(f"metadata is {type(meta).__name__}, "
                                                   "expected a JSON object"))
        return meta

    def restore(self, step: int, abstract_state):
        """(state, meta) of checkpoint `step`, laid out and sharded as `abstract_state` says; a
        ValueError unless the checkpoint stores exactly its tree, shapes and dtypes (orbax would
        cast a dtype silently)."""
        try:
            stored = self._manager.item_metadata(step)[STATE].tree
        except Exception as e:
            raise self._unreadable(step, e) from e
        stored, wanted = _layout(stored), _layout(abstract_state)
        problems = [f"{k}: missing from the checkpoint" for k in wanted if k not in stored]
        problems += [f"{k}: not in the target state" for k in stored if k not in wanted]
        problems += [f"{k}: stored {stored[k]}, expected {wanted[k]}" for k in wanted
                     if k in stored and stored[k] != wanted[k]]
        if problems:
            raise ValueError(f"checkpoint {step} in {self.directory} does not match the train "
                             f"state ({len(problems)} differences): " + "; ".join(problems[:5]))
        try:
            out = self._manager.restore(
                step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract_state),
                                                 META: ocp.args.JsonRestore()}))
        except Exception as e:
            raise self._unreadable(step, e) from e
        return out[STATE], out[META]

    def wait(self) -> None:  # until the pending asynchronous saves are on disk
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _layout(tree) -> dict[str, tuple]:
    """{"a/b/0": (shape, dtype name)} of the array leaves of a state or of orbax metadata."""
    return {jax.tree_util.keystr(path, simple=True, separator="/"): (tuple(leaf.shape),
                                                                    str(leaf.dtype))
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
