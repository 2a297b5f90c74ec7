"""Every guarantee the guides and the top-level docs pages state names the test that checks it.

A guarantee sentence is a prose sentence (outside code blocks and display math; a list item and
a table row count as their own units) with "never", "always", "exactly", "bit-identical",
"byte-identical", "≤", "<=" or a LaTeX ``\\le``. Each needs a marker right after it (or inside
it), naming test functions:

    ... come out zero. <!-- checked-by: test_padded_vocabulary, test_padding_rows_hold_any -->

and every name a marker gives must be a ``def test_...`` somewhere under tests/ (any depth, so
test files can move). A marker may also sit on a sentence without those words.
"""

from __future__ import annotations

import re

import pytest
from _doc_extract import ROOT, claim_pages, is_guarantee, prose_sentences

# Pages whose guarantee sentences are not all marked yet (none now). `test_allow_list_is_not_stale`
# fails once a listed page has no unmarked guarantee left, so this set can only shrink.
NOT_YET_MARKED: set[str] = set()


def _test_functions() -> set[str]:
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names.update(re.findall(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(test_\w+)", path.read_text(),
                                re.M))
    return names


TESTS = _test_functions()


def _unmarked(page: str) -> list[str]:
    return [f"{s.where}: {s.text}" for s in prose_sentences(page) if is_guarantee(s)
            and not s.tests]


@pytest.mark.parametrize("page", claim_pages())
def test_every_guarantee_names_an_existing_test(page):
    missing = [f"{s.where}: names {name}, which is no test function under tests/"
               for s in prose_sentences(page) for name in s.tests if name not in TESTS]
    assert not missing, "\n".join(missing)
    if page not in NOT_YET_MARKED:
        unmarked = _unmarked(page)
        assert not unmarked, ("guarantee sentences without a <!-- checked-by: test_... --> "
                              "marker:\n" + "\n".join(unmarked))


def test_allow_list_is_not_stale():
    pages = set(claim_pages())
    assert NOT_YET_MARKED <= pages, NOT_YET_MARKED - pages
    done = sorted(p for p in NOT_YET_MARKED if not _unmarked(p))
    assert not done, f"every guarantee of {done} is marked: remove them from NOT_YET_MARKED"


def test_pages_link_guarantees_to_tests():
    """The count the docs issue reports: guarantee sentences linked to a test."""
    linked = [s for p in claim_pages() for s in prose_sentences(p) if is_guarantee(s) and s.tests]
    assert len(linked) >= 50, len(linked)


# ----------------------------------------------------------------------------- the extractor

PAGE = """# A heading that says never

Plain prose. The step is never NaN. <!-- checked-by: test_a --> Rows move by exactly r,
e.g. in a table.
<!-- checked-by: test_b, test_c -->

```python
assert x <= 2  # code: never a guarantee sentence
```

$$
D \\le 2r
$$

- an item whose bound is \\(D \\le 2\\) <!-- checked-by: test_d -->
- an item that is always true

| guarantee | test |
|---|---|
| never hidden | `x.py` <!-- checked-by: test_e --> |
| always exact. Twice. | `y.py` |
"""


def test_extractor_reads_sentences_markers_items_and_rows():
    found = {s.text: s.tests for s in prose_sentences("page.md", PAGE)}
    assert found["The step is never NaN."] == ("test_a",)
    assert found["Rows move by exactly r, e.g. in a table."] == ("test_b", "test_c")
    assert found["Plain prose."] == ()
    assert found[r"- an item whose bound is \(D \le 2\)"] == ("test_d",)
    assert found["- an item that is always true"] == ()
    assert found["| never hidden | `x.py` |"] == ("test_e",)
    assert found["| always exact. Twice. | `y.py` |"] == ()  # a row is one unit
    guarantees = {s.text for s in prose_sentences("page.md", PAGE) if is_guarantee(s)}
    assert guarantees == {"The step is never NaN.", "Rows move by exactly r, e.g. in a table.",
                          r"- an item whose bound is \(D \le 2\)", "- an item that is always true",
                          "| never hidden | `x.py` |", "| always exact. Twice. | `y.py` |"}
    # Headings, code and display math are not prose; the table's header row neither.
    assert not any("heading" in t or "assert" in t or "guarantee | test" in t for t in found)


def test_extractor_keeps_line_numbers():
    lines = {s.text: s.line for s in prose_sentences("page.md", PAGE)}
    assert lines["Plain prose."] == 3
    assert lines[r"- an item whose bound is \(D \le 2\)"] == 15
