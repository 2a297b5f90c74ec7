"""The rowgeom.testing documentation stays true (the same checks tests/test_docs.py makes for
the top-level package, applied to the public submodules it does not walk).

- Every ``>>>`` example in rowgeom.testing and its modules runs as a doctest, and every name in
  the ``__all__`` of ``rowgeom.testing`` and ``rowgeom.testing.strategies`` has a docstring with
  an example and a ``::: module.name`` entry in docs/api/testing.md.
- The ``python`` blocks of docs/guides/testing.md run (and print what they show) in
  tests/test_docs_output.py, with every other page.
"""

import ast
import doctest
import importlib
import inspect
import pathlib
import pkgutil
import re

import pytest

import rowgeom.testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLIC = ("rowgeom.testing", "rowgeom.testing.strategies")
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules():
    names = ["rowgeom.testing"] + [f"rowgeom.testing.{m.name}"
                                   for m in pkgutil.iter_modules(rowgeom.testing.__path__)]
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


@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_docstring_example(test):
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    test.globs = {}
    result = runner.run(test, out=lambda text: print(text, end=""))
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"


def test_public_names_have_examples_and_reference_entries():
    page = (ROOT / "docs" / "api" / "testing.md").read_text()
    rendered = set(re.findall(r"^:::\s+(rowgeom\.testing(?:\.strategies)?)\.(\w+)\s*$", page,
                              re.M))
    problems = []
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                doc = inspect.getdoc(obj) or ""
            else:
                home = next(m for m in _modules() if getattr(m, name, None) is obj)
                doc = _constant_docstrings(home).get(name, "")
            if ">>>" not in doc:
                problems.append(f"{module_name}.{name}: no docstring with a >>> example")
            if (module_name, name) not in rendered:
                problems.append(f"{module_name}.{name}: not rendered in docs/api/testing.md")
    public = {(m, n) for m in PUBLIC for n in importlib.import_module(m).__all__}
    problems += [f"docs/api/testing.md renders non-public {m}.{n}" for m, n in rendered - public]
    assert not problems, problems
