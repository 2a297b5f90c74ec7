"""MkDocs hook: fail the build when a public symbol is undocumented or missing from the reference.

Every name in ``rowgeom.__all__`` must

1. have a non-empty docstring (for a module-level constant: the string literal right after its
   assignment, which griffe reads as the attribute's docstring), and
2. be rendered by a ``::: rowgeom.<name>`` block on one of the ``docs/api/*.md`` pages.

mkdocstrings itself silently skips undocumented objects (``show_if_no_docstring: false``), so
without this hook a new export without a docstring or a reference entry would build cleanly.
The package is read statically with griffe (no import of JAX), so the check costs milliseconds.
"""

from __future__ import annotations

import pathlib
import re

import griffe
from mkdocs.exceptions import PluginError

DIRECTIVE = re.compile(r"^:::\s+rowgeom\.(\w+)\s*$", re.M)


def api_problems(root: pathlib.Path) -> list[str]:
    """The list of coverage problems (empty when every public symbol is documented)."""
    package = griffe.load("rowgeom", search_paths=[str(root)], resolve_aliases=True)
    public = sorted(package.exports or ())
    if not public:
        return ["rowgeom.__all__ is empty or could not be read"]
    rendered = set()
    for page in sorted((root / "docs" / "api").glob("*.md")):
        rendered.update(DIRECTIVE.findall(page.read_text(encoding="utf-8")))
    problems = []
    for name in public:
        obj = package[name]
        target = obj.final_target if obj.is_alias else obj
        doc = target.docstring.value.strip() if target.docstring else ""
        if not doc:
            problems.append(f"rowgeom.{name} has no docstring")
        if name not in rendered:
            problems.append(f"rowgeom.{name} is not rendered by any '::: rowgeom.{name}' block "
                            "in docs/api/*.md")
    for name in sorted(rendered - set(public)):
        problems.append(f"docs/api renders rowgeom.{name}, which is not in rowgeom.__all__")
    return problems


def on_config(config, **kwargs):
    root = pathlib.Path(config["docs_dir"]).resolve().parent  # docs/ sits in the repo root
    problems = api_problems(root)
    if problems:
        raise PluginError("API reference check failed:\n  " + "\n  ".join(problems))
    return config
