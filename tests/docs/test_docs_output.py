"""The pages' code runs, and prints what the pages show.

Every fenced ``python`` block of README.md and of every docs page runs, in order, in one
namespace per page (a block may use what an earlier block of its page defined; each imports
what it uses). A block that prints must be followed directly by a fenced ``text`` block holding
its output, compared as doctest compares (``...`` matches anything, whitespace runs are equal);
a ``text`` block after a block that prints nothing fails. Code that cannot run here (a TPU pod,
your own model) is fenced ``py`` and shown, not run: keep such blocks few and short.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import pathlib
import re
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = ["README.md"] + sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")
    if re.search(r"^```python\s*$", p.read_text(), re.M))
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
CHECKER = doctest.OutputChecker()
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def blocks_with_output(text: str):
    """(line, code, expected output or None) for each python block, in page order."""
    fences = list(FENCE.finditer(text))
    out = []
    for i, m in enumerate(fences):
        if m.group(1) != "python":
            continue
        expected = None
        if i + 1 < len(fences):
            nxt = fences[i + 1]
            if nxt.group(1) == "text" and not text[m.end():nxt.start()].strip():
                expected = nxt.group(2)
        out.append((text.count("\n", 0, m.start()) + 1, m.group(2), expected))
    return out


def test_pages_found():
    assert {"README.md", "docs/getting-started.md", "docs/guides/diagnostics.md",
            "docs/guides/learning-rates.md", "docs/guides/labels.md"} <= set(PAGES)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_page_prints_what_it_shows(page):
    # A module of its own, as a script would have: dataclasses (Flax Linen modules) look their
    # module up in sys.modules.
    module = types.ModuleType("page_" + re.sub(r"\W", "_", page))
    sys.modules[module.__name__] = module
    try:
        _run_page(page, module.__dict__)
    finally:
        del sys.modules[module.__name__]


def _run_page(page, namespace):
    for line, code, expected in blocks_with_output((ROOT / page).read_text()):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(compile(code, f"{page}:{line}", "exec"), namespace)
        got = buffer.getvalue()
        where = f"{page}, python block at line {line}"
        if expected is None:
            assert not got, f"{where} prints but the page shows no ```text output:\n{got}"
            continue
        assert got, f"{where} prints nothing, but the page shows output:\n{expected}"
        assert CHECKER.check_output(expected, got, FLAGS), (
            f"{where}: the page shows\n{expected}\nbut the code prints\n{got}")
