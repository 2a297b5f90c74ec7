"""Docstring examples and the benchmarks that write the generated docs blocks.

- Every ``>>>`` example in a rowgeom docstring runs as a doctest (module, function, class and
  module-constant docstrings), and every public symbol has at least one example.
- ``benchmarks/run_all.py --quick`` runs end to end and writes its table and JSON (a smoke test:
  no timing thresholds).

Elsewhere: the strict docs build (`.ci/run`; ``docs/hooks/api_coverage.py``) fails on a public
symbol without a docstring or an API-reference entry, a broken link and a page outside the nav;
test_docs_output.py runs the pages' code, test_generated.py checks the generated pages and
blocks, test_readme_commands.py runs README's commands.
"""

import ast
import doctest
import importlib
import inspect
import json
import pathlib
import pkgutil
import subprocess
import sys

import pytest

import rowgeom

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules():
    """rowgeom and every module under it, the public submodules (rowgeom.testing, ...) included."""
    names = [rowgeom.__name__] + [m.name for m in
                                  pkgutil.walk_packages(rowgeom.__path__, "rowgeom.")]
    return [importlib.import_module(name) for name in names]


def _constant_docstrings(module) -> dict[str, str]:
    """Docstrings of module constants: the string literal right after ``NAME = ...``."""
    tree = ast.parse(inspect.getsource(module))
    docs = {}
    for node, following in zip(tree.body, tree.body[1:], strict=False):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.targets[0].id] = inspect.cleandoc(following.value.value)
    return docs


def _doctests():
    finder, parser = doctest.DocTestFinder(), doctest.DocTestParser()
    tests = []
    for module in _modules():
        tests += [t for t in finder.find(module) if t.examples]
        for name, doc in _constant_docstrings(module).items():
            test = parser.get_doctest(doc, {}, f"{module.__name__}.{name}", module.__file__, 0)
            if test.examples:
                tests.append(test)
    return sorted(tests, key=lambda t: t.name)


DOCTESTS = _doctests()


def _public_docstring(name: str) -> str:
    obj = getattr(rowgeom, name)
    if inspect.isfunction(obj) or inspect.isclass(obj):
        return inspect.getdoc(obj) or ""
    # The module that assigns it (others may import it): the one with its docstring.
    docs = [_constant_docstrings(m).get(name, "") for m in _modules()[1:]
            if getattr(m, name, None) is obj]
    return max(docs, key=len, default="")


@pytest.mark.slow
@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_docstring_example(test):
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    test.globs = {}
    result = runner.run(test, out=lambda text: print(text, end=""))
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"


def test_every_public_symbol_has_a_docstring_with_an_example():
    undocumented, without_example = [], []
    for name in rowgeom.__all__:
        doc = _public_docstring(name)
        if not doc.strip():
            undocumented.append(name)
        elif ">>>" not in doc:
            without_example.append(name)
    assert not undocumented, f"public symbols without a docstring: {undocumented}"
    assert not without_example, f"public symbols without a >>> example: {without_example}"


@pytest.mark.commands
@pytest.mark.slow
@pytest.mark.timeout(660)  # its subprocess has 600 s
def test_benchmark_suite_quick_mode(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick", "--out",
         str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert {"rownorm", "muon", "row_diameter", "lm", "state", "sharding"} <= set(results)
    assert results["sharding"] is not None and results["sharding"]["devices"] == 8
    table = (tmp_path / "results.md").read_text()
    for heading in ("projected_rownorm vs", "muon_orthogonalize vs optax", "Row diameter",
                    "One optimizer step", "Head optimizer-state bytes", "Collectives",
                    "in-chain tracker's cost per step"):
        assert heading in table
    # The state-size comparison is exact arithmetic, not timing: RowNorm keeps one moment.
    for row in results["state"].values():
        rownorm, adamw = row["state_bytes"]["RowNorm (lm_optimizer)"], row["state_bytes"][
            "AdamW (lm_optimizer head='adamw')"]
        assert rownorm < adamw <= 2 * row["param_bytes"] + 64
