"""Text corpora for the LM example: which files a source names, their documents, and the split.

A text source is a UTF-8 file, a `.jsonl` file (one JSON object with a "text" field per line, each
a document), or a directory or glob of them; with no source the corpus is the running
interpreter's standard library (`.py` files, tests excluded). Several files are split into train
and validation by file (`split_files`), a single file by its last lines or records
(`split_documents`). Nothing here unpickles or evaluates.
"""

from __future__ import annotations

import glob as globlib
import json
import os
import sysconfig
from pathlib import Path

# Third-party packages, tests and build artefacts (which differ between installs) are not corpus.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files() -> list[Path]:
    """The running interpreter's standard library `.py` files, without tests, sorted."""
    root = stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place: site-packages alone can hold far more files than the library itself.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS and d != "__pycache__"
                       and not (Path(dirpath) == root and d.startswith("config-"))]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py")
                     and not f.startswith(("test_", "_sysconfigdata")))
    return sorted(files)


def split_files(files, *, val_fraction: float = 0.05) -> tuple[list[Path], list[Path]]:
    """Deterministic split by file: `round(n * val_fraction)` (at least 1) files spread evenly over
    the sorted list go to validation, the rest to training. Depends only on the set of files."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    files = sorted(Path(f) for f in files)
    n = len(files)
    if n < 2:
        raise ValueError(f"split_files needs at least 2 files to split by file, got {n}")
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    val_index = {int((i + 0.5) * n / n_val) for i in range(n_val)}  # n / n_val >= 1: all distinct
    train = [f for i, f in enumerate(files) if i not in val_index]
    val = [f for i, f in enumerate(files) if i in val_index]
    return train, val


def _decode(raw: bytes, path: Path, strict: bool) -> str:
    try:
        return raw.decode("utf-8", errors="strict" if strict else "replace")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _jsonl_records(path: Path, text: str) -> list[str]:
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number} is not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f'{path}:{number}: each jsonl line must be an object with a string '
                             f'"text" field')
        records.append(record["text"])
    return records


def read_documents(files, *, strict: bool = True) -> list[str]:
    """One document per text file, one per record of a `.jsonl` file."""
    docs = []
    for f in files:
        text = _decode(Path(f).read_bytes(), f, strict)
        docs.extend(_jsonl_records(f, text) if Path(f).suffix == ".jsonl" else [text])
    return docs


def split_documents(files, *, val_fraction: float, strict: bool = True):
    """(train documents, validation documents): by file when there are several files, else the
    last `val_fraction` of the single file's lines (text) or records (jsonl)."""
    if len(files) > 1:
        train_files, val_files = split_files(files, val_fraction=val_fraction)
        return (read_documents(train_files, strict=strict),
                read_documents(val_files, strict=strict))
    path = Path(files[0])
    jsonl = path.suffix == ".jsonl"
    units = (read_documents(files, strict=strict) if jsonl
             else _decode(path.read_bytes(), path, strict).splitlines(keepends=True))
    if len(units) < 2:
        raise ValueError(f"{path} needs at least 2 {'records' if jsonl else 'lines'} to split "
                         "into train and validation")
    n_val = min(len(units) - 1, max(1, round(len(units) * val_fraction)))
    if jsonl:
        return units[:-n_val], units[-n_val:]
    return ["".join(units[:-n_val])], ["".join(units[-n_val:])]


def _text_files(directory: Path) -> list[Path]:
    # Hidden files and folders (.git, editor state) are not corpus.
    files = sorted(p for p in directory.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(directory).parts))
    if not files:
        raise ValueError(f"text directory {directory} contains no files")
    return files


def text_files(source) -> tuple[Path | None, list[Path]]:
    """(root, files) of a text source: a file, a directory (recursively) or a glob."""
    text = str(source)
    if any(c in text for c in "*?["):
        files = sorted(Path(p).resolve() for p in globlib.glob(os.path.expanduser(text))
                       if Path(p).is_file())
        if not files:
            raise ValueError(f"data source {text} matches no file")
        return None, files
    path = Path(text).expanduser().resolve()
    if not path.exists():
        raise ValueError(f"data source {path} does not exist")
    return (path, _text_files(path)) if path.is_dir() else (None, [path])
