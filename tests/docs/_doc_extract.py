"""Reading the documentation pages the way the drift tests need them (tests/docs/test_doc_*.py).

- `fenced_blocks`: the fenced code blocks of a markdown page, with their language and line.
- `example_commands`: every `python -m examples.lm.train` / `python -m examples.lm.prepare` (and
  `python tests/examples/_crash_trainer.py`) command a shell block shows, as argv lists, with
  the block's environment (`export` lines, `NAME=value` prefixes) applied, backslash
  continuations joined and commands nested in a quoted `--command='...'` (gcloud ssh) found.
- `prose_units`: the prose of a page outside fenced blocks and display math, one unit per
  sentence (list items and table rows are units of their own), with the `checked-by` markers
  that follow each; `is_guarantee` says which units state a guarantee.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex

# The repository root, wherever under tests/ this file lives.
ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "pyproject.toml").exists())

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)[^\n]*\n"
                   r"(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$", re.S | re.M)
SHELL_LANGS = ("bash", "sh", "shell", "console", "")


@dataclasses.dataclass(frozen=True)
class Block:
    lang: str
    line: int  # 1-based line of the opening fence
    body: str
    span: tuple[int, int]  # character offsets of the whole fenced block in the page


def fenced_blocks(text: str) -> list[Block]:
    return [Block(m.group("lang"), text.count("\n", 0, m.start()) + 1, m.group("body"),
                  (m.start(), m.end())) for m in FENCE.finditer(text)]


# ----------------------------------------------------------------------------- commands

# What a shown command runs: the module (or script) and how the test recognises it.
PROGRAMS = {
    ("python", "-m", "examples.lm.train"): "train",
    ("python", "-m", "examples.lm.prepare"): "prepare",
}
CRASH_TRAINER = re.compile(r"tests/(?:\w+/)*_crash_trainer\.py")  # the crash test's wrapper
MENTION = re.compile(r"examples\.lm\.(?:train|prepare)\b|" + CRASH_TRAINER.pattern)
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_OPERATORS = {"&&", "||", ";", "|", "&"}


@dataclasses.dataclass(frozen=True)
class Command:
    page: str
    line: int  # line of the block's opening fence
    index: int  # position of the block among the page's fenced blocks
    program: str  # "train", "prepare" or "crash-trainer"
    argv: tuple[str, ...]  # the arguments after the program
    env: tuple[tuple[str, str], ...]  # NAME=value prefixes
    script: str | None = None  # crash-trainer: the wrapper's path, as the page shows it

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def flag(self, name: str) -> str | None:
        """The value of `--name V` or `--name=V` (the last one given), else None."""
        value = None
        for i, arg in enumerate(self.argv):
            if arg == f"--{name}" and i + 1 < len(self.argv):
                value = self.argv[i + 1]
            elif arg.startswith(f"--{name}="):
                value = arg.split("=", 1)[1]
        return value

    def flags(self) -> list[str]:
        return [a.split("=", 1)[0][2:] for a in self.argv if a.startswith("--")]


def _logical_lines(body: str) -> list[str]:
    """Lines with backslash continuations joined and quoted strings that span lines kept whole."""
    out, pending = [], ""
    for raw in body.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{raw}" if pending else raw
        if _quotes_balanced(pending):
            out.append(pending)
            pending = ""
    if pending:
        out.append(pending)
    return out


def _quotes_balanced(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return False
    return True


def _substitute(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?",
                  lambda m: env.get(m.group(1), m.group(0)), text)


def _tokens(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def _simple_commands(tokens: list[str]) -> list[list[str]]:
    out, current = [], []
    for token in tokens:
        if token in _OPERATORS:
            out.append(current)
            current = []
        else:
            current.append(token)
    out.append(current)
    return [c for c in out if c]


def _commands_in(tokens: list[str], exports: dict[str, str]):
    """(program, argv, env, script) for every example command in a token list, nested ones
    included."""
    for simple in _simple_commands(tokens):
        env = []
        while simple and _ASSIGNMENT.match(simple[0]):
            name, value = simple.pop(0).split("=", 1)
            env.append((name, value))
        for words, program in PROGRAMS.items():
            if tuple(simple[:len(words)]) == words:
                yield program, tuple(simple[len(words):]), tuple(env), None
                break
        else:
            if simple[:1] == ["python"] and CRASH_TRAINER.fullmatch("".join(simple[1:2])):
                yield "crash-trainer", tuple(simple[2:]), tuple(env), simple[1]
                continue
            for token in simple:  # e.g. gcloud ... --command='cd rowgeom && python -m ...'
                if MENTION.search(token):
                    inner = token.split("=", 1)[1] if token.startswith("--") else token
                    yield from _commands_in(_tokens(_substitute(inner, exports)), exports)


def example_commands(page: str, text: str | None = None) -> tuple[list[Command], list[str]]:
    """(commands, problems): every example command in the shell blocks of `page` (relative to
    the repository root), and a line per mention of one that could not be read as a command."""
    text = (ROOT / page).read_text() if text is None else text
    commands: list[Command] = []
    problems: list[str] = []
    for index, block in enumerate(fenced_blocks(text)):
        mentions = len(MENTION.findall(block.body))
        if not mentions:
            continue
        where = f"{page}:{block.line}"
        if block.lang not in SHELL_LANGS:
            problems.append(f"{where}: a ```{block.lang} block mentions an example command; "
                            "show commands in ```bash blocks")
            continue
        exports: dict[str, str] = {}
        found = 0
        for line in _logical_lines(block.body):
            line = _substitute(line, exports)
            try:
                tokens = _tokens(line)
            except ValueError as err:
                problems.append(f"{where}: cannot split {line!r}: {err}")
                continue
            if tokens[:1] == ["export"]:
                exports |= dict(t.split("=", 1) for t in tokens[1:] if "=" in t)
                continue
            for program, argv, env, script in _commands_in(tokens, exports):
                commands.append(Command(page, block.line, index, program, argv, env, script))
                found += 1
        if found != mentions:
            problems.append(f"{where}: {mentions} mention(s) of an example command, {found} "
                            "read as commands")
    return commands, problems


def command_pages() -> list[str]:
    """The pages whose shell blocks the command test runs."""
    pages = ["README.md", "CONTRIBUTING.md", "examples/lm/README.md"]
    pages += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))
    return pages


# ----------------------------------------------------------------------------- prose

GUARANTEE = re.compile(r"\bnever\b|\balways\b|\bexactly\b|\bbit-identical\b|\bbyte-identical\b"
                       r"|≤|<=|\\leq?\b", re.I)
MARKER = re.compile(r"<!--\s*checked-by:\s*([^>]*?)\s*-->")
_DISPLAY_MATH = re.compile(r"^\s*\$\$.*?\$\$[ \t]*$|^\s*\\\[.*?\\\][ \t]*$", re.S | re.M)
_COMMENT = re.compile(r"<!--(?!\s*checked-by:).*?-->", re.S)
# Spans that may hold a ". X" that does not end a sentence.
_OPAQUE = re.compile(r"`[^`\n]*`|\\\(.*?\\\)|\[[^\]\n]*\]\([^)\n]*\)|\[[^\]\n]*\]\[[^\]\n]*\]",
                     re.S)
_ABBREVIATION = re.compile(r"\b(?:e\.g|i\.e|etc|vs|cf|al|approx|Fig|Eq|no)\.")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Za-z(\[`*_\"<\\])")


@dataclasses.dataclass(frozen=True)
class Sentence:
    page: str
    line: int  # 1-based line where the sentence starts
    text: str  # the sentence, markers removed, whitespace collapsed
    tests: tuple[str, ...]  # the test functions its checked-by markers name

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _blank(match: re.Match) -> str:
    """The match replaced by as many newlines as it spans (line numbers are kept)."""
    return "\n" * match.group(0).count("\n")


def _units(text: str):
    """(first line, text) of each prose unit: a paragraph, a list item or a table row.

    Headings, table header rows and separator rows, and the `:::` API directives are left out.
    """
    lines = text.splitlines()
    unit: list[str] = []
    start = 0
    table_header = {i - 1 for i, line in enumerate(lines)
                    if re.match(r"^\s*\|?\s*:?-{3,}", line)}

    def flush():
        if unit:
            yield start, " ".join(s.strip() for s in unit)
            unit.clear()

    for i, line in enumerate(lines, start=1):
        stripped = line.strip()
        if (not stripped or stripped.startswith(("#", ":::")) or i - 1 in table_header
                or re.match(r"^\|?\s*:?-{3,}", stripped)):
            yield from flush()
            continue
        if stripped.startswith("|"):
            yield from flush()
            yield i, stripped
            continue
        if re.match(r"^([-*+]|\d+\.)\s", stripped) or stripped.startswith("!!!"):
            yield from flush()
        if not unit:
            start = i
        unit.append(stripped)
    yield from flush()


def _split_sentences(unit: str) -> list[tuple[int, str]]:
    """(offset, sentence) pairs of one unit, splitting outside code, math and links."""
    masked = _OPAQUE.sub(lambda m: "x" * len(m.group(0)), unit)
    masked = _ABBREVIATION.sub(lambda m: "x" * len(m.group(0)), masked)
    masked = MARKER.sub(lambda m: "<" + "x" * (len(m.group(0)) - 1), masked)
    cuts = [0] + [m.end() for m in _SENTENCE_END.finditer(masked)] + [len(unit)]
    return [(a, unit[a:b]) for a, b in zip(cuts, cuts[1:], strict=False) if unit[a:b].strip()]


def prose_sentences(page: str, text: str | None = None) -> list[Sentence]:
    """Every sentence of `page`'s prose, each with the test names of the markers that follow it
    (before the next sentence) or sit inside it."""
    text = (ROOT / page).read_text() if text is None else text
    text = FENCE.sub(_blank, text)
    text = _DISPLAY_MATH.sub(_blank, text)
    text = _COMMENT.sub(_blank, text)
    out: list[Sentence] = []
    for line, unit in _units(text):
        # A table row is one unit; a marker at the start of a sentence belongs to the one before.
        pieces = [unit] if unit.startswith("|") else [p for _, p in _split_sentences(unit)]
        sentences: list[list] = []
        for piece in pieces:
            lead = re.match(r"^\s*(?:<!--\s*checked-by:[^>]*-->\s*)+", piece)
            if lead and sentences:
                sentences[-1][1] += _names(lead.group(0))
                piece = piece[lead.end():]
            if piece.strip(" |"):
                sentences.append([piece, _names(piece)])
        for piece, names in sentences:
            clean = " ".join(MARKER.sub("", piece).split())
            out.append(Sentence(page, line, clean, tuple(names)))
    return out


def _names(text: str) -> list[str]:
    return [n for m in MARKER.finditer(text) for n in re.split(r"[\s,]+", m.group(1)) if n]


def is_guarantee(sentence: Sentence) -> bool:
    return bool(GUARANTEE.search(sentence.text))


def claim_pages() -> list[str]:
    """The pages whose guarantee sentences must name their tests: the guides and the top-level
    docs pages (not the API reference, which renders docstrings, nor the generated results)."""
    docs = ROOT / "docs"
    pages = sorted(docs.glob("*.md")) + sorted((docs / "guides").glob("*.md"))
    return [str(p.relative_to(ROOT)) for p in pages]
