"""The tests the pages name exist: "checked by `tests/x.py::test_y`" points at a real test.

A page names the test that checks a claim by its pytest node id (`tests/x.py::test_y`, which
`python -m pytest tests/x.py::test_y` runs). A renamed or moved test fails here, not silently.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
NODE = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")


def _pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_named_tests_exist():
    missing, named = [], 0
    for page in _pages():
        text = page.read_text()
        for match in NODE.finditer(text):
            named += 1
            path, name = ROOT / match.group(1), match.group(2)
            if not (path.exists() and re.search(rf"^\s*(?:async\s+)?def {name}\(", path.read_text(),
                                                 re.M)):
                line = text.count("\n", 0, match.start()) + 1
                missing.append(f"{page.relative_to(ROOT)}:{line}: {match.group(0)}")
    assert not missing, "pages name tests that do not exist:\n" + "\n".join(missing)
    assert named > 0
