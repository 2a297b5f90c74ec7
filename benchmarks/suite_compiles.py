"""How many programs the test suite compiles, how long that takes, and where: the suite's time
is mostly XLA compiling (CONTRIBUTING.md), so this is the figure to compare before and after a
change to the tests.

    python benchmarks/suite_compiles.py -m "not slow" -n auto          # the fast subset
    python benchmarks/suite_compiles.py -n auto --dist loadfile        # README's first command
    python benchmarks/suite_compiles.py -m sharded -n auto --dist loadfile
    python benchmarks/suite_compiles.py tests/rowgeom/test_rownorm.py  # one file

The arguments go to `python -m pytest -p benchmarks.suite_compiles`. Loaded that way, this module
is a pytest plugin: every test process (xdist's workers too) counts jax's compile events against
the test running then (its setup, call and teardown) and writes them to a JSON file; the command
then prints the totals (wall and CPU time of the whole run, compiles, seconds spent compiling),
the modules, tests and programs that compile most, and the programs one test compiles most (a
fixture could share them). A persistent-cache hit is counted, and timed,
as a compile (jax times the lookup in the same event) and also listed apart. Compiles in a
process a test starts (a killed run, a second host) are not counted: it does not load the plugin.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

_ENV = "ROWGEOM_SUITE_COMPILES_DIR"  # where each test process writes its counts
_COMPILE = "/jax/core/compile/backend_compile_duration"
_HIT = "/jax/compilation_cache/cache_hits"
# Per test: [compiles, compile seconds, persistent-cache hits, wall seconds]
_tests: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
_programs: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
# Per "test::program": [compiles, compile seconds], to find the test behind a program's count
_pairs: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
_current = {"test": "<collection>", "start": 0.0}


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event == _COMPILE:
        entry = _tests[_current["test"]]
        entry[0] += 1
        entry[1] += duration
        program = _programs[kwargs.get("fun_name", "?")]
        program[0] += 1
        program[1] += duration
        pair = _pairs[f"{_current['test']} {kwargs.get('fun_name', '?')}"]
        pair[0] += 1
        pair[1] += duration


def _on_event(event: str, **kwargs) -> None:
    if event == _HIT:
        _tests[_current["test"]][2] += 1


# --- the plugin (hooks pytest finds in this module when it is loaded with `-p`)


def pytest_configure(config) -> None:
    if os.environ.get(_ENV):  # only under this command: importing the module records nothing
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)


def pytest_runtest_logstart(nodeid, location) -> None:
    _current.update(test=nodeid, start=time.perf_counter())


def pytest_runtest_logfinish(nodeid, location) -> None:
    _tests[nodeid][3] += time.perf_counter() - _current["start"]
    _current["test"] = "<between tests>"


def pytest_sessionfinish(session) -> None:
    out = os.environ.get(_ENV)
    if out and _tests and (os.environ.get("PYTEST_XDIST_WORKER") or not _is_controller(session)):
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(out, f"compiles-{name}.json"), "w") as f:
            json.dump({"tests": _tests, "programs": _programs, "pairs": _pairs}, f)


def _is_controller(session) -> bool:
    """Whether this is xdist's controller, which runs no test (its workers report them)."""
    return getattr(session.config.option, "numprocesses", None) not in (None, 0)


# --- the command


def _table(title: str, header: tuple[str, ...], rows: list[tuple]) -> str:
    lines = [f"\n{title}\n", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def report(directory: str, *, top: int = 15) -> str:
    """The markdown tables of the counts the test processes wrote to `directory`."""
    tests: dict[str, list[float]] = {}
    programs: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    pairs: dict[str, list[float]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "compiles-*.json"))):
        with open(path) as f:
            data = json.load(f)
        tests.update(data["tests"])
        for name, (n, s) in data["programs"].items():
            programs[name][0] += n
            programs[name][1] += s
        pairs.update(data.get("pairs", {}))
    modules: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0, 0, 0.0])
    for nodeid, (n, s, hits, wall) in tests.items():
        m = modules[nodeid.split("::")[0]]
        m[0] += 1
        m[1] += n
        m[2] += s
        m[3] += hits
        m[4] += wall
    total = [sum(t[i] for t in tests.values()) for i in range(4)]
    share = f"{100 * total[1] / total[3]:.0f} %" if total[3] else "-"
    out = [f"{int(total[0])} compiles, {total[1]:.0f} s compiling ({share} of the {total[3]:.0f} s"
           f" the tests took, summed over processes), {int(total[2])} persistent-cache hits"]
    by_seconds = lambda item: -item[1][2]  # noqa: E731
    out.append(_table("Modules", ("module", "tests", "compiles", "compile s", "hits", "test s"),
                      [(m, a[0], a[1], f"{a[2]:.1f}", a[3], f"{a[4]:.1f}")
                       for m, a in sorted(modules.items(), key=by_seconds)[:top]]))
    out.append(_table("Tests", ("test", "compiles", "compile s", "test s"),
                      [(t, a[0], f"{a[1]:.1f}", f"{a[3]:.1f}")
                       for t, a in sorted(tests.items(), key=lambda i: -i[1][1])[:top]]))
    out.append(_table("Programs (by the jitted function's name)", ("program", "compiles",
                                                                   "compile s"),
                      [(f"`{p}`", a[0], f"{a[1]:.1f}")
                       for p, a in sorted(programs.items(), key=lambda i: -i[1][1])[:top]]))
    out.append(_table("Programs by test (a program one test compiles often: share it)",
                      ("test", "program", "compiles", "compile s"),
                      [(*pair.rsplit(" ", 1), a[0], f"{a[1]:.1f}")
                       for pair, a in sorted(pairs.items(), key=lambda i: -i[1][1])[:top]]))
    return "\n".join(out)


def main(argv: list[str]) -> int:
    root = pathlib.Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="rowgeom-suite-compiles-") as directory:
        env = {**os.environ, _ENV: directory, "PYTHONPATH": os.pathsep.join(
            [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
        start = time.perf_counter()
        status = subprocess.call([sys.executable, "-m", "pytest", "-p", "benchmarks.suite_compiles",
                                  *argv], cwd=root, env=env)
        wall = time.perf_counter() - start
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        print(f"\npytest {' '.join(argv)}: exit status {status}, {wall:.0f} s wall, "
              f"{usage.ru_utime:.0f} s user + {usage.ru_stime:.0f} s system CPU")
        print(report(directory))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
