"""The rowgeom.testing documentation stays true (the same checks tests/docs/test_docs.py makes for
the top-level package, applied to the public submodules it does not walk).

- Every name in the ``__all__`` of ``rowgeom.testing`` and ``rowgeom.testing.strategies`` has a
  docstring with an example and a ``::: module.name`` entry in docs/api/testing.md (their
  ``>>>`` examples run in tests/docs/test_docs.py, with every other rowgeom module's).
- The ``python`` blocks of docs/guides/testing.md run (and print what they show) in
  tests/docs/test_docs_output.py, with every other page.
"""

import doctest
import importlib
import inspect
import pathlib
import re

from tests.docs.test_docs import _constant_docstrings, _modules

ROOT = pathlib.Path(__file__).resolve().parents[2]
PUBLIC = ("rowgeom.testing", "rowgeom.testing.strategies")
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


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
