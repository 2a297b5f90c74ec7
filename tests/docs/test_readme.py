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
    """Each pytest invocation of README's `a && b` runs in .ci/run as a line of its own, and
    the second is the 8-device (`sharded`) one."""
    ci = (ROOT / ".ci" / "run").read_text()
    commands = _readme_test_command().split(" && ")
    assert len(commands) == 2 and "-m sharded" in commands[1], commands
    for command in commands:
        assert command.startswith("python -m pytest")
        assert re.search(rf"^{re.escape(command)}$", ci, re.M), f"{command!r} not run by .ci/run"
    assert '[ "$rc" -eq 5 ]' in ci  # no tests collected fails each invocation


def test_ci_installs_from_project_files():
    ci = (ROOT / ".ci" / "run").read_text()
    # CI may add extras (docs) but must install the test extra from this checkout.
    assert re.search(r'pip install --quiet -e "\.\[test(,[a-z]+)*\]"', ci), ci
    assert "ruff check" in ci
