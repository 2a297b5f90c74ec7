"""CI runs exactly the test command README shows: keep the two in sync."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _readme_test_command() -> str:
    text = (ROOT / "README.md").read_text()
    commands = re.findall(r"^python -m pip install -e \"\.\[test\]\" && (.+)$", text, re.M)
    assert len(commands) == 1, "README.md must show exactly one install-and-test command"
    return commands[0]


def test_ci_runs_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = _readme_test_command()
    assert command.startswith("python -m pytest")
    assert re.search(rf"^{re.escape(command)}$", ci, re.M), f"{command!r} not run by .ci/run"


def test_ci_installs_from_project_files():
    ci = (ROOT / ".ci" / "run").read_text()
    # CI may add extras (docs) but must install the test extra from this checkout.
    assert re.search(r'pip install --quiet -e "\.\[test(,[a-z]+)*\]"', ci), ci
    assert "ruff check" in ci
