"""The documentation stays true: docstring examples, reference coverage, page code, benchmarks.

- Every ``>>>`` example in a rowgeom docstring runs as a doctest (module, function, class and
  module-constant docstrings), and every public symbol has at least one example.
- Every name in ``rowgeom.__all__`` has a docstring and a ``::: rowgeom.<name>`` entry in
  ``docs/api/*.md`` (``docs/hooks/api_coverage.py`` fails the strict docs build on the same).
- The fenced ``python`` blocks of the guide pages run, in order, one namespace per page
  (illustrative fragments that cannot run alone are fenced ``py``).
- ``benchmarks/run_all.py --quick`` runs end to end and writes its table and JSON (a smoke test:
  no timing thresholds).
"""

import ast
import doctest
import importlib
import inspect
import json
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import rowgeom

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
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


def test_api_reference_renders_exactly_the_public_symbols():
    rendered = set()
    for page in (DOCS / "api").glob("*.md"):
        rendered.update(re.findall(r"^:::\s+rowgeom\.(\w+)\s*$", page.read_text(), re.M))
    assert set(rowgeom.__all__) - rendered == set(), "missing from docs/api/*.md"
    assert rendered - set(rowgeom.__all__) == set(), "docs/api renders non-public names"


def test_nav_pages_and_figures_exist():
    config = (ROOT / "mkdocs.yml").read_text()
    nav = re.findall(r"^\s+- (?:[^:\n]+: )?([\w/.-]+\.md)\s*$", config, re.M)
    assert "geometry.md" in nav and "benchmarks.md" in nav
    missing = [page for page in nav if not (DOCS / page).exists()]
    assert not missing, f"nav lists missing pages: {missing}"
    for page in DOCS.rglob("*.md"):
        for image in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page.read_text()):
            assert (page.parent / image).exists(), f"{page.name}: missing figure {image}"


def test_every_page_is_in_the_nav():
    """A page outside the nav is found by nobody (docs/results/README.md describes the folder
    for readers of the repository, not of the site)."""
    config = (ROOT / "mkdocs.yml").read_text()
    nav = set(re.findall(r"^\s+- (?:[^:\n]+: )?([\w/.-]+\.md)\s*$", config, re.M))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")} - {"results/README.md"}
    assert pages <= nav, sorted(pages - nav)


def test_api_index_lists_every_public_name():
    text = (DOCS / "api" / "index.md").read_text()
    listed = set(re.findall(r"^\| \[`(\w+)`\]\[rowgeom\.\1\]", text, re.M))
    assert listed == set(rowgeom.__all__), (sorted(set(rowgeom.__all__) - listed),
                                            sorted(listed - set(rowgeom.__all__)))


def _rowgeom_imports(path: pathlib.Path) -> set[str]:
    """The private rowgeom modules `path` imports (``from rowgeom._x import``, ``from rowgeom
    import _x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "rowgeom":
            found |= {a.name for a in node.names if a.name.startswith("_")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rowgeom._"):
            found.add(node.module.split(".")[1])
    return found - {path.stem}


def test_architecture_page_lists_each_modules_imports_and_layers():
    text = (DOCS / "architecture.md").read_text()
    table = {}
    for names, imports in re.findall(r"^\| ((?:`_\w+`(?:, )?)+) \| (—|(?:`_\w+`(?:, )?)+) \|$",
                                     text, re.M):
        for name in re.findall(r"`(_\w+)`", names):
            table[name] = set(re.findall(r"`(_\w+)`", imports))
    layers = {name: int(n) for n, names in re.findall(r"^layer (\d+)\s+(.*)$", text, re.M)
              for name in re.findall(r"_\w+", names)}
    modules = {p.stem: _rowgeom_imports(p) for p in (ROOT / "rowgeom").glob("_*.py")
               if p.stem != "__init__"}
    assert table == modules
    assert set(layers) == set(modules)
    for name, imported in modules.items():
        assert all(layers[i] < layers[name] for i in imported), (name, imported)


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
