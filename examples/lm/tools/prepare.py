"""Tokenize text / jsonl files into rowgeom token shards that the trainer memory-maps.

    python -m examples.lm.tools.prepare corpus/ --out shards --tokenizer gpt2/tokenizer.json
    python -m examples.lm.tools.prepare 'docs/*.jsonl' --out shards --vocab_size 8192
    python -m examples.lm.train --data.source shards --data.tokenizer shards/tokenizer.json

Sources are text files, `.jsonl` files (one JSON object with a "text" field per line, each a
document), `.json` files holding such lines or an array of such objects, any of them compressed
with gzip, bzip2 or xz, and directories or globs of them. Several files are split into train
and validation by file (`split_files`), a single file by its last lines / records. Documents
are separated by the tokenizer's end-of-document token. With `--tokenizer` the given
`tokenizer.json` encodes; without it a byte-level BPE of `--vocab_size` is trained on the train
split (`tokenizer.py`). The tokenizer used is saved as OUT/tokenizer.json.

Encoding runs on every core (`tokenizers`' `encode_batch`, in groups of about 8 MiB of text) with
a progress bar. Output: OUT/train_000000.bin, ..., OUT/val_000000.bin, ... in the rowgeom shard
format (`write_shard`; at most `--shard_tokens` tokens each) and OUT/prepare.json.

The trainer runs the same code on a text `--data.source`, and on none (the running interpreter's
standard library `.py` files, tests excluded, split by file; no download): `token_cache` writes
the shards once under its work directory, keyed by the source files (names, sizes, mtimes), the
tokenizer and the split, and checks them when reused.
"""

from __future__ import annotations

import sys

if __package__ in (None, ""):  # run as a file: the package is not importable
    print("prepare.py: error: run it as a module from the repository root: "
          "python -m examples.lm.tools.prepare ...", file=sys.stderr)
    raise SystemExit(2)

import argparse
import bz2
import fcntl
import glob as globlib
import gzip
import hashlib
import json
import logging
import lzma
import os
import shutil
import socket
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

from examples.lm import data
from examples.lm.tools import tokenizer as bpe

log = logging.getLogger(__name__)

_GROUP_CHARS = 8 << 20  # text encoded per encode_batch call (parallel inside)
_CACHE_FORMAT = 3  # bump when the cache layout or the encoding changes
# Third-party packages, tests and build artefacts (which differ between installs) are not corpus.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})

# ----------------------------------------------------------------------------- text corpora


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


# Compressed files the standard library reads (C4 ships .json.gz); zstd (The Pile, SlimPajama)
# needs a package of its own, so such a file is an error saying so.
_CODECS = {".gz": gzip.decompress, ".bz2": bz2.decompress, ".xz": lzma.decompress}
# Binary files people point a text source at (never UTF-8), told apart by their first bytes.
_EXPORT = ("export its text to .jsonl (`datasets`' to_json) or tokenize it into token files "
           "(llm.c / rowgeom shards)")
_NOT_TEXT = {b"\x28\xb5\x2f\xfd": "is zstd-compressed: decompress it first (zstd -d); .gz, .bz2 "
                                  "and .xz files are read as they are",
             b"PAR1": f"is a Parquet file: {_EXPORT}",
             b"ARROW1": f"is an Arrow file: {_EXPORT}",
             b"\xff\xff\xff\xff": f"is an Arrow stream (`datasets`' save_to_disk): {_EXPORT}",
             b"\x93NUMPY": "is a NumPy .npy array: write its token ids as a rowgeom shard "
                           "(tools/prepare.py's write_shard) or an llm.c .bin",
             b"PK\x03\x04": "is a zip archive: extract it first"}


def _read_text(path: Path, strict: bool) -> tuple[str, str]:
    """(text, suffix of what it holds) of one file, decompressed first if it is .gz/.bz2/.xz."""
    path = Path(path)
    raw, suffix = path.read_bytes(), path.suffix
    if suffix in _CODECS:
        try:
            raw = _CODECS[suffix](raw)
        except (OSError, EOFError, lzma.LZMAError) as e:
            raise ValueError(f"{path} cannot be decompressed ({e})") from None
        suffix = Path(path.stem).suffix
    try:
        return _decode(raw, path, strict), suffix
    except ValueError:  # not UTF-8: say what it is, where its first bytes tell
        for magic, what in _NOT_TEXT.items():
            if raw.startswith(magic):
                raise ValueError(f"{path} {what}") from None
        raise


def _text_of(record) -> str | None:
    return record.get("text") if isinstance(record, dict) else None


def _records(path: Path, text: str, suffix: str) -> list[str] | None:
    """The documents of a JSON Lines file (`.jsonl`: a bad line is an error naming it), or of a
    `.json` file holding JSON Lines or an array of objects with a string "text" field (what
    `datasets`' `to_json` and many corpora write); None for any other file, a document of its
    own (a `.json` that is not such a dataset included)."""
    if suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number} is not JSON ({e.msg})") from None
            if not isinstance(_text_of(record), str):
                raise ValueError(f'{path}:{number}: each jsonl line must be an object with a '
                                 'string "text" field')
            records.append(record["text"])
        return records
    if suffix != ".json":
        return None
    try:
        if text.lstrip().startswith("["):
            items = json.loads(text)
        else:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError:
        return None
    texts = [_text_of(item) for item in items] if isinstance(items, list) else [None]
    return texts if texts and all(isinstance(t, str) for t in texts) else None


def read_documents(files, *, strict: bool = True) -> list[str]:
    """One document per text file, one per record of a JSON Lines or JSON dataset file
    (`_records`)."""
    docs = []
    for f in files:
        text, suffix = _read_text(f, strict)
        records = _records(f, text, suffix)
        docs.extend([text] if records is None else records)
    return docs


def split_documents(files, *, val_fraction: float, strict: bool = True):
    """(train documents, validation documents): by file when there are several files, else the
    last `val_fraction` of the single file's lines (text) or records (a JSON dataset)."""
    if len(files) > 1:
        train_files, val_files = split_files(files, val_fraction=val_fraction)
        return (read_documents(train_files, strict=strict),
                read_documents(val_files, strict=strict))
    path = Path(files[0])
    text, suffix = _read_text(path, strict)
    records = _records(path, text, suffix)
    units = text.splitlines(keepends=True) if records is None else records
    if len(units) < 2:
        raise ValueError(f"{path} needs at least 2 {'lines' if records is None else 'records'} "
                         "to split into train and validation")
    n_val = min(len(units) - 1, max(1, round(len(units) * val_fraction)))
    if records is not None:
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


# ----------------------------------------------------------------------------- shards


def write_shard(path, tokens) -> Path:
    """Write 1-D non-negative integer `tokens` as a rowgeom shard (`data.HEADER`; uint16 if they
    fit, else uint32), atomically (a temporary name renamed into place)."""
    path, tokens = Path(path), np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"write_shard({path}): tokens must be a non-empty 1-D integer array, "
                         f"got shape {tokens.shape} dtype {tokens.dtype}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= 1 << 32:
        raise ValueError(f"write_shard({path}): token ids must be in [0, 2**32), got [{lo}, {hi}]")
    code = 1 if hi < 1 << 16 else 2
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data.HEADER.pack(data.ROWGEOM_MAGIC, 1, code, tokens.size, hi))
        f.write(tokens.astype(data.DTYPE_CODES[code]).tobytes())
    os.replace(tmp, path)
    return path


class _ShardWriter:
    """Collects token arrays and writes `{split}_{index:06d}.bin` shards of `limit` tokens."""

    def __init__(self, out: Path, split: str, limit: int):
        self.out, self.split, self.limit = out, split, limit
        self.pending, self.count, self.paths, self.total = [], 0, [], 0

    def add(self, tokens: np.ndarray) -> None:
        self.pending.append(tokens)
        self.count += tokens.size
        while self.count >= self.limit:
            self._flush(self.limit)

    def _flush(self, n: int) -> None:
        whole = np.concatenate(self.pending)
        path = self.out / f"{self.split}_{len(self.paths):06d}.bin"
        self.paths.append(write_shard(path, whole[:n]))
        self.total += n
        self.pending, self.count = [whole[n:]], whole.size - n

    def close(self) -> list[Path]:
        if self.count:
            self._flush(self.count)
        if not self.paths:
            raise ValueError(f"the {self.split} split encodes to no tokens")
        return self.paths


def _groups(documents):
    group, size = [], 0
    for doc in documents:
        group.append(doc)
        size += len(doc)
        if size >= _GROUP_CHARS:
            yield group
            group, size = [], 0
    if group:
        yield group


def write_shards(files, out, *, tokenizer=None, vocab_size: int = 4096,
                 val_fraction: float = 0.05, shard_tokens: int = 100_000_000,
                 progress: bool = True, strict: bool = True) -> dict:
    """Split and tokenize text `files` into rowgeom shards and `tokenizer.json` under `out` (an
    existing directory); returns the summary written to OUT/prepare.json. tokenizer: a
    `tokenizer.json` path; None trains a byte-level BPE of `vocab_size` on the train split."""
    from tqdm.auto import tqdm

    if shard_tokens < 1:
        raise ValueError(f"--shard_tokens must be >= 1, got {shard_tokens}")
    if len(files) > 1:
        train_files, val_files = split_files(files, val_fraction=val_fraction)
        splits = {"train": (train_files, None), "val": (val_files, None)}
    else:
        train_docs, val_docs = split_documents(files, val_fraction=val_fraction, strict=strict)
        splits = {"train": (files, train_docs), "val": (files, val_docs)}
    if tokenizer is not None:
        tok = bpe.load_tokenizer(tokenizer)
    else:  # the BPE needs the whole train split at once
        train_files, train_docs = splits["train"]
        tok = bpe.train_bpe(train_docs or read_documents(train_files, strict=strict), vocab_size)
    vocab = bpe.vocab_size(tok)
    # uint16 while every id fits: half the disk and page cache of uint32
    dtype = data.DTYPE_CODES[1 if vocab <= 1 << 16 else 2]
    summary = {"tokenizer_vocab_size": vocab, "files": len(files)}
    for split, (split_files_, docs) in splits.items():
        writer = _ShardWriter(Path(out), split, shard_tokens)
        size = (sum(f.stat().st_size for f in split_files_) if docs is None
                else sum(map(len, docs)))
        bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"{split} ({len(split_files_)} "
                   "files)", disable=not progress)
        documents = docs if docs is not None else (
            doc for f in split_files_ for doc in read_documents([f], strict=strict))
        for group in _groups(documents):
            writer.add(bpe.encode_documents(tok, group, dtype))
            bar.update(sum(len(d.encode()) for d in group))
        bar.close()
        paths = writer.close()
        summary[split] = {"tokens": writer.total, "shards": [p.name for p in paths]}
    tok.save(str(Path(out) / "tokenizer.json"))
    (Path(out) / "prepare.json").write_text(json.dumps(summary, indent=1))
    return summary


def prepare(sources, out, **options) -> dict:
    """Tokenize text `sources` (files, directories, globs) into rowgeom shards under `out`, an
    empty or new directory (`write_shards` for the options)."""
    files = []
    for source in sources:
        if data.token_files(source):
            raise ValueError(f"{source} holds token files already; train.py reads them directly")
        files.extend(text_files(source)[1])
    if not files:
        raise ValueError("no input files")
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.bin")):
        raise ValueError(f"{out} already holds .bin files; use an empty directory")
    return write_shards(sorted(set(files)), out, **options)


# ----------------------------------------------------------------------------- the trainer's cache


def token_cache(source, workdir, *, vocab_size: int, val_fraction: float = 0.05,
                tokenizer=None) -> data.TokenSplits:
    """The splits of text `source` (None: the standard library), tokenized once into
    `workdir/tokens/<name>-v<vocab>-<key>/` and checked when reused (a damaged cache is rebuilt).
    Each process builds the same cache (training and encoding are deterministic); a shared
    directory is written atomically."""
    workdir = Path(workdir).expanduser().resolve()
    if source is None:
        name, strict, root, files = "stdlib", False, stdlib_root(), stdlib_source_files()
    else:
        name, strict = str(source), True
        root, files = text_files(source)
        # A work directory inside the source must not feed its own cache back into the corpus.
        files = [f for f in files if not f.is_relative_to(workdir)]
    tokenizer_hash = None if tokenizer is None else hashlib.sha256(
        bpe.tokenizer_file(tokenizer).read_bytes()).hexdigest()
    # Sizes and mtimes, not contents: a cache hit must not read a large corpus.
    stats = [[f.relative_to(root).as_posix() if root else f.name, st.st_size, st.st_mtime_ns]
             for f, st in ((f, f.stat()) for f in files)]
    fingerprint = {"format": _CACHE_FORMAT, "source": name, "vocab_size": vocab_size,
                   "val_fraction": val_fraction, "tokenizers": bpe.library_version(),
                   "tokenizer": tokenizer_hash, "files": stats}
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    label = "stdlib" if source is None else Path(str(source).rstrip("*/")).stem or "data"
    cache = workdir / "tokens" / f"{label}-v{vocab_size}-{key}"
    if cache.is_dir():
        try:
            return _load_cache(cache, fingerprint, vocab_size)
        except Exception as e:  # any damage (missing file, bad JSON, bad shard): rebuild it
            log.warning("token cache %s is unusable (%s); rebuilding it", cache, e)
            shutil.rmtree(cache, ignore_errors=True)
    # Build in a private directory and rename it into place: readers never see a partial cache.
    cache.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_builds(cache)
    tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=_build_prefix(cache)))
    lock = _lock(tmp)  # held until the directory is in place or gone; a killed process drops it
    try:
        try:
            write_shards(files, tmp, tokenizer=tokenizer, vocab_size=vocab_size,
                         val_fraction=val_fraction, progress=False, strict=strict)
            meta = json.loads((tmp / "prepare.json").read_text())
            (tmp / "meta.json").write_text(json.dumps({"fingerprint": fingerprint, **meta},
                                                      indent=1))
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as the workdir
        except BaseException as e:  # also a full disk or Ctrl-C: no half-written copy stays
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, ValueError):
                raise ValueError(f"{name}: {e}") from None
            raise
        try:
            os.replace(tmp, cache)
        except OSError:  # another process finished first; its cache is identical
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if lock is not None:
            os.close(lock)
    return _load_cache(cache, fingerprint, vocab_size)


def _build_prefix(cache: Path) -> str:
    """The name a build directory of `cache` starts with: the host and process writing it."""
    return f".{cache.name}.{socket.gethostname()}.{os.getpid()}."


def _lock(path: Path) -> int | None:
    """An open descriptor of directory `path` holding an exclusive `flock` on it, or None where
    it is held elsewhere or the file system has no such locks. The kernel drops the lock when
    its process dies, however it dies."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _remove_dead_builds(cache: Path) -> None:
    """Remove the build directories of `cache` that a killed process of this host left (a
    preempted machine relaunching the same command), each a partial copy of the corpus that
    would otherwise stay for good. A directory goes only when its process is gone and nothing
    holds its lock (`_lock`; a process in another PID namespace still holds it); another host's
    are left alone."""
    own = f".{cache.name}.{socket.gethostname()}."
    for path in cache.parent.glob(f"{globlib.escape(own)}*"):
        pid = path.name[len(own):].split(".")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        lock = _lock(path)
        if lock is not None:
            shutil.rmtree(path, ignore_errors=True)
            os.close(lock)


def _alive(pid: int) -> bool:
    if pid == os.getpid():  # a leftover of an earlier process that had this pid
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def _load_cache(cache: Path, fingerprint: dict, vocab_size: int) -> data.TokenSplits:
    """The cached splits, after checking they are the ones `fingerprint` describes."""
    meta = json.loads((cache / "meta.json").read_text())
    if meta.get("fingerprint") != fingerprint:
        raise ValueError("fingerprint mismatch")
    size = bpe.vocab_size(bpe.load_tokenizer(cache / "tokenizer.json"))
    if size > vocab_size:
        raise ValueError(f"tokenizer has {size} > {vocab_size} entries")
    splits = data.open_splits(cache, data.token_files(cache), vocab_size)
    if [len(splits.train), len(splits.val)] != [meta["train"]["tokens"], meta["val"]["tokens"]]:
        raise ValueError("the shards do not match meta.json")
    tokenizer = hashlib.sha256((cache / "tokenizer.json").read_bytes()).hexdigest()[:16]
    return splits._replace(format="text", tokenizer=tokenizer)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="prepare.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("sources", nargs="+", metavar="SOURCE",
                        help="text, .jsonl or .json files (.gz, .bz2, .xz too), directories "
                             "or globs")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (empty)")
    parser.add_argument("--tokenizer", metavar="PATH", default=None,
                        help="a Hugging Face tokenizer.json (default: train a byte-level BPE)")
    parser.add_argument("--vocab_size", type=int, default=4096, metavar="INT",
                        help="size of the BPE trained when no --tokenizer is given")
    parser.add_argument("--val_fraction", type=float, default=0.05, metavar="FLOAT",
                        help="fraction of the files (or of one file's lines) for validation")
    parser.add_argument("--shard_tokens", type=int, default=100_000_000, metavar="INT",
                        help="tokens per shard at most")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        summary = prepare(args.sources, args.out, tokenizer=args.tokenizer,
                          vocab_size=args.vocab_size, val_fraction=args.val_fraction,
                          shard_tokens=args.shard_tokens, progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as e:
        print(f"prepare.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"{summary['train']['tokens']:,} train and {summary['val']['tokens']:,} validation "
          f"tokens in {len(summary['train']['shards']) + len(summary['val']['shards'])} shards "
          f"under {args.out}")
    return summary


if __name__ == "__main__":
    main()
