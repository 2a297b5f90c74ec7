"""MkDocs hook: fail the build when a public symbol is undocumented or missing from the reference.

Every name in the ``__all__`` of a public module (`PUBLIC_MODULES`: ``rowgeom`` and its public
submodules such as ``rowgeom.testing``) must

1. have a non-empty docstring (for a module-level constant: the string literal right after its
   assignment, which griffe reads as the attribute's docstring), and
2. be rendered by a ``::: <module>.<name>`` block (e.g. ``::: rowgeom.row_diameter``,
   ``::: rowgeom.testing.assert_rows_zero_sum``) on one of the ``docs/api/*.md`` pages.

mkdocstrings itself silently skips undocumented objects (``show_if_no_docstring: false``), so
without this hook a new export without a docstring or a reference entry would build cleanly.
The package is read statically with griffe (no import of JAX), so the check costs milliseconds.
"""

from __future__ import annotations

import pathlib
import re

import griffe
from mkdocs.exceptions import PluginError

PUBLIC_MODULES = ("rowgeom", "rowgeom.testing", "rowgeom.testing.strategies")
DIRECTIVE = re.compile(r"^:::\s+(rowgeom(?:\.\w+)*)\.(\w+)\s*$", re.M)


def api_problems(root: pathlib.Path) -> list[str]:
    """The list of coverage problems (empty when every public symbol is documented)."""
    package = griffe.load("rowgeom", search_paths=[str(root)], resolve_aliases=True)
    rendered = set()
    for page in sorted((root / "docs" / "api").glob("*.md")):
        rendered.update(DIRECTIVE.findall(page.read_text(encoding="utf-8")))
    problems, public = [], set()
    for module_name in PUBLIC_MODULES:
        module = package
        for part in module_name.split(".")[1:]:
            module = module[part]
        names = sorted(module.exports or ())
        if not names:
            problems.append(f"{module_name}.__all__ is empty or could not be read")
        for name in names:
            public.add((module_name, name))
            obj = module[name]
            target = obj.final_target if obj.is_alias else obj
            doc = target.docstring.value.strip() if target.docstring else ""
            if not doc:
                problems.append(f"{module_name}.{name} has no docstring")
            if (module_name, name) not in rendered:
                problems.append(f"{module_name}.{name} is not rendered by any "
                                f"'::: {module_name}.{name}' block in docs/api/*.md")
    for module_name, name in sorted(rendered - public):
        problems.append(f"docs/api renders {module_name}.{name}, which is not in the __all__ "
                        f"of a public module ({', '.join(PUBLIC_MODULES)})")
    return problems


def on_config(config, **kwargs):
    root = pathlib.Path(config["docs_dir"]).resolve().parent  # docs/ sits in the repo root
    problems = api_problems(root)
    if problems:
        raise PluginError("API reference check failed:\n  " + "\n  ".join(problems))
    return config
