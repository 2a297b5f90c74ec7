"""README.md's commands run as written: the smoke test of the README.

The commands are read from README.md's ```bash blocks when the tests are collected (a README
edit is what runs next time): backslash continuations joined, comments dropped, `&&` chains
split. Each command runs unchanged, through bash, in README order, in one scratch directory
shared by the module (so a rerun resumes the run an earlier command started) with the
repository on PYTHONPATH (README: "Run from the repository root"; the scratch directory keeps
`runs/` out of the checkout). Nothing is rewritten; a command is skipped, with the reason, only
when this machine cannot run it as written:

- package installs (`pip install ...`): the tests run in the environment they install;
- `python -m pytest`: the suite itself;
- a `--data.source` that does not exist here (the FineWeb shards, `/data/tokens`, `~/tokens`), a
  `gs://` checkpoint directory, or a `--mesh.*` size larger than this machine's device count,
  for commands that train (`examples.lm.tools.train_compile` simulates the devices it compiles for).

Every command is marked `slow`: the training commands train the README's configs for the
README's steps (`cpu-tiny`, 600 steps: minutes each on a CPU), and train_compile compiles a paper
config. `test_readme_commands_are_found` (not slow) reads them.
"""

from __future__ import annotations

import glob
import os
import pathlib
import re
import shlex
import subprocess

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BASH_BLOCK = re.compile(r"^```bash[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
TIMEOUT = 3000  # seconds per command: a 600-step cpu-tiny run on a shared 2-core machine


def readme_commands() -> list[tuple[int, list[str]]]:
    """(line, argv) of every command in README.md's bash blocks, in order."""
    text = README.read_text()
    out = []
    for block in BASH_BLOCK.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).split("\n")
        i = 0
        while i < len(lines):
            start, logical = i, lines[i]
            while logical.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                logical = logical.rstrip()[:-1] + " " + lines[i]
            i += 1
            lexer = shlex.shlex(logical, posix=True, punctuation_chars="&|;")
            lexer.whitespace_split, lexer.commenters = True, "#"
            argv: list[str] = []
            for token in [*lexer, "&&"]:
                if token in ("&&", "||", ";", "|", "&"):
                    if argv:
                        out.append((first + start, argv))
                    argv = []
                else:
                    argv.append(token)
    return out


def _flag(argv: list[str], name: str) -> str | None:
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def why_not_here(argv: list[str], cwd: pathlib.Path) -> str | None:
    """Why this machine cannot run `argv` as written, or None when it can."""
    if argv[:1] == ["pip"] or argv[:3] == ["python", "-m", "pip"]:
        return "installs packages: the tests run in the environment it installs"
    if argv[:3] == ["python", "-m", "pytest"]:
        return "the test suite itself"
    if argv[:3] != ["python", "-m", "examples.lm.train"]:
        return None
    source = _flag(argv, "--data.source")
    if source is not None and not glob.glob(str(cwd / os.path.expanduser(source))):
        return f"needs the data at {source}"
    if (_flag(argv, "--checkpoint.dir") or "").startswith("gs://"):
        return "needs a Cloud Storage bucket"
    sizes = [int(_flag(argv, a.split("=")[0]) or 1) for a in argv if a.startswith("--mesh.")]
    devices = 1
    for size in sizes:
        devices *= max(size, 1)
    if devices > jax.device_count():
        return f"needs {devices} devices, this machine has {jax.device_count()}"
    return None


COMMANDS = readme_commands()


def test_readme_commands_are_found():
    """The README shows the example's training command, and every command is read whole."""
    shown = [shlex.join(argv) for _, argv in COMMANDS]
    assert "python -m examples.lm.train" in shown, shown
    assert all(argv[0] in ("python", "pip") for _, argv in COMMANDS), shown


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


@pytest.mark.commands
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("line, argv", COMMANDS,
                         ids=[f"README.md:{line}:{shlex.join(argv)[:60]}"
                              for line, argv in COMMANDS])
def test_readme_command_runs_as_written(line, argv, scratch):
    reason = why_not_here(argv, scratch)
    if reason is not None:
        pytest.skip(f"README.md:{line}: {reason}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = shlex.join(argv)
    proc = subprocess.run(["bash", "-c", command], cwd=scratch, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, (f"README.md:{line}: `{command}` exited {proc.returncode}\n"
                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
