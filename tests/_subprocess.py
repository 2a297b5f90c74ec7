"""A check script run once per test module in its own process (e.g. with 8 simulated devices:
XLA_FLAGS must be set before jax is imported).

`ModuleSubprocess` starts the script at most once; every test of the module reads the same
output. If the script fails or runs past its timeout, the first test that asks reports the exit
status and the stderr tail in full, and the module's other tests fail with one line pointing
there: the script is never re-run per test. Its timeout is kept well below pytest's per-test
timeout (pyproject.toml), so a hang is reported as the script's, with its stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Below the per-test `timeout` in pyproject.toml, which also counts the fixture that waits here.
DEFAULT_TIMEOUT_S = 240
TAIL_CHARS = 4000


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]


class ModuleSubprocess:
    """`python SCRIPT ARGS...` (or any argv), started once; see the module docstring."""

    def __init__(self, argv: list[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 env: dict | None = None, cwd: str | os.PathLike | None = None):
        self.argv, self.timeout_s, self.env, self.cwd = argv, timeout_s, env, cwd
        self.name = ("an inline script" if argv[1:2] == ["-c"]
                     else Path(argv[1]).name if len(argv) > 1 else argv[0])
        self._proc: subprocess.Popen | None = None
        self._stdout: str | None = None
        self._failure: str | None = None
        self._reported_by: str | None = None

    @classmethod
    def script(cls, path: str | os.PathLike, *args: str, **kwargs) -> ModuleSubprocess:
        return cls([sys.executable, str(path), *args], **kwargs)

    def start(self) -> ModuleSubprocess:
        """Start the process now (e.g. at module start, to run beside the in-process tests)."""
        if self._proc is None:
            self._proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=self.env,
                                          cwd=self.cwd)
        return self

    def _wait(self) -> None:
        proc = self.start()._proc
        assert proc is not None
        try:
            out, err = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            self._failure = f"{self.name} ran past its {self.timeout_s:.0f} s timeout"
        except BaseException as e:  # e.g. pytest-timeout's signal: leave no process behind
            self.close()
            self._failure = f"{self.name} was interrupted ({type(e).__name__}: {e})"
            self._reported_by = _current_test()
            raise
        else:
            if proc.returncode == 0:
                self._stdout = out
                return
            self._failure = f"{self.name} exited with status {proc.returncode}"
        self._failure += f"\n--- stderr tail:\n{(err or '')[-TAIL_CHARS:]}"

    def stdout(self) -> str:
        """The script's stdout; fails the calling test (see the module docstring) otherwise."""
        if self._stdout is None and self._failure is None:
            self._wait()
        if self._failure is not None:
            if self._reported_by is None:
                self._reported_by = _current_test()
                pytest.fail(self._failure, pytrace=False)
            headline = self._failure.splitlines()[0]
            pytest.fail(f"{headline} (see the failure of {self._reported_by})",
                        pytrace=False)
        assert self._stdout is not None
        return self._stdout

    def json(self):
        """The JSON object on the script's last stdout line."""
        lines = self.stdout().strip().splitlines()
        if not lines:
            pytest.fail(f"{self.name} printed nothing", pytrace=False)
        return json.loads(lines[-1])

    def close(self) -> None:
        """Kill the process if it still runs (module teardown)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.communicate()
