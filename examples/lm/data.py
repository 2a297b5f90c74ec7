"""The trainer's token data: a data source turned into train and validation token arrays.

`prepare_tokens(source=...)`:

- None: the running interpreter's standard library `.py` sources (about 11 MiB on CPython 3.11,
  tests excluded), split by file. No download.
- Token files (a directory, a glob or a `.bin` file; see formats.py): rowgeom shards, llm.c /
  modded-nanogpt shards, nanoGPT `train.bin` / `val.bin`. Memory-mapped as they are.
- Text: a UTF-8 file, a `.jsonl` file (one JSON object with a "text" field per line, each a
  document) or a directory or glob of them; several files are split into train and validation by
  file (`split_files`), a single file by its last lines or records. Tokenized with a given
  `tokenizer.json` or with a byte-level BPE trained on the train split (tokenization.py), and
  cached under the work directory as rowgeom shards.

Nothing here unpickles or evaluates: shards are a checked binary header plus raw little-endian
integers, and the tokenizer and cache metadata are JSON.

The loop reads the result through `BatchSampler` (random training windows) and `ValidationSet`
(the fixed validation set): pure functions of `(seed, step)` and of the split, so a resumed run
replays the same data, and each process reads only its share of every global batch. To train on
other data, give `--data.source` token files or text; in code, `train.start` is the one place
that calls `prepare_tokens`, and any `TokenSplits` of 1-D integer arrays serves the loop.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from examples.lm import formats, tokenization

log = logging.getLogger(__name__)

_CACHE_FORMAT = 1  # bump when the cache layout or the encoding changes


class TokenSplits(NamedTuple):
    train: np.ndarray  # 1-D token ids (a read-only memmap, or formats.ShardedTokens)
    val: np.ndarray
    vocab_size: int  # every id is < vocab_size (the tokenizer's size, or the given bound)
    format: str = "text"  # "text" (tokenized here) or one of formats.FORMATS


def _fingerprint(name, root, files, vocab_size, val_fraction, tokenizer_hash) -> dict:
    # Sizes and mtimes, not contents: a cache hit must not read a large corpus.
    stats = [[f.relative_to(root).as_posix() if root else f.name, st.st_size, st.st_mtime_ns]
             for f, st in ((f, f.stat()) for f in files)]
    return {"format": _CACHE_FORMAT, "source": name, "vocab_size": vocab_size,
            "val_fraction": val_fraction, "tokenizers": tokenization.library_version(),
            "tokenizer": tokenizer_hash, "files": stats}


def _load_cache(directory: Path, fingerprint: dict, vocab_size: int) -> TokenSplits:
    """The cached splits, after checking they are the ones `fingerprint` describes."""
    meta = json.loads((directory / "meta.json").read_text())
    if meta.get("fingerprint") != fingerprint:
        raise ValueError("fingerprint mismatch")
    size = tokenization.vocab_size(tokenization.load_tokenizer(directory / "tokenizer.json"))
    if size > vocab_size:
        raise ValueError(f"tokenizer has {size} > {vocab_size} entries")
    splits = []
    for name in ("train", "val"):
        shard = formats.read_token_file(directory / f"{name}.bin")
        if (shard.format != "rowgeom" or len(shard.tokens) != meta[f"{name}_tokens"]
                or shard.max_token >= vocab_size):
            raise ValueError(f"{name}.bin does not match meta.json")
        splits.append(shard.tokens)
    return TokenSplits(splits[0], splits[1], vocab_size)


def _token_files(found: formats.TokenFiles, vocab_size: int) -> TokenSplits:
    if found.max_token is not None and found.max_token >= vocab_size:
        for shard in (*found.train.paths, *found.val.paths):
            top = formats.read_token_file(shard).max_token
            if top >= vocab_size:
                raise ValueError(f"token file {shard} holds token id {top}, which is not below "
                                 f"the vocabulary size {vocab_size}")
    return TokenSplits(found.train, found.val, vocab_size, found.format)


def prepare_tokens(*, source=None, workdir, vocab_size: int, val_fraction: float = 0.05,
                   tokenizer=None) -> TokenSplits:
    """Token ids for training and validation (see the module docstring for `source`).

    vocab_size: the BPE's size when a text source is tokenized without `tokenizer`; the bound
    every id of token files must be below. tokenizer: path of a `tokenizer.json` for text
    sources; the vocabulary is then the tokenizer's (and the bound for token files too).
    Text is cached under `workdir/tokens/`, keyed by the source files (names, sizes, mtimes), the
    tokenizer and `val_fraction`, and checked when reused. Each process builds the same cache
    (training and encoding are deterministic); a shared directory is written atomically.
    """
    workdir = Path(workdir).expanduser().resolve()
    pretrained = None if tokenizer is None else tokenization.load_tokenizer(tokenizer)
    if pretrained is not None:
        vocab_size = tokenization.vocab_size(pretrained)
    if source is None:
        name, strict = "stdlib", False
        root, files = stdlib_root(), stdlib_source_files()
    else:
        found = formats.find_token_files(source)
        if found is not None:
            return _token_files(found, vocab_size)
        name, strict = str(source), True
        root, files = text_files(source)
        # A work directory inside the source must not feed its own cache back into the corpus.
        files = [f for f in files if not f.is_relative_to(workdir)]
    tokenizer_hash = None
    if pretrained is not None:
        tokenizer_hash = hashlib.sha256(Path(tokenizer).expanduser().read_bytes()).hexdigest()
    fingerprint = _fingerprint(name, root, files, vocab_size, val_fraction, tokenizer_hash)
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    label = "stdlib" if source is None else Path(str(source).rstrip("*/")).stem or "data"
    cache = workdir / "tokens" / f"{label}-v{vocab_size}-{key}"
    if cache.is_dir():
        try:
            return _load_cache(cache, fingerprint, vocab_size)
        except Exception as e:  # any damage (missing file, bad JSON, bad shard): rebuild it
            log.warning("token cache %s is unusable (%s); rebuilding it", cache, e)
            shutil.rmtree(cache, ignore_errors=True)
    _build_cache(cache, fingerprint, files, name=name, strict=strict, pretrained=pretrained,
                 vocab_size=vocab_size, val_fraction=val_fraction)
    return _load_cache(cache, fingerprint, vocab_size)


def _build_cache(cache: Path, fingerprint: dict, files, *, name, strict, pretrained, vocab_size,
                 val_fraction) -> None:
    """Split and tokenize `files` (training the BPE unless `pretrained`) into `cache`."""
    train_texts, val_texts = split_documents(files, val_fraction=val_fraction,
                                                    strict=strict)
    t0 = time.perf_counter()
    tok = pretrained if pretrained is not None else tokenization.train_bpe(train_texts,
                                                                             vocab_size)
    t1 = time.perf_counter()
    dtype = formats.token_dtype(vocab_size)
    train_ids = tokenization.encode_documents(tok, train_texts, dtype)
    val_ids = tokenization.encode_documents(tok, val_texts, dtype)
    t2 = time.perf_counter()
    log.info("tokenizer ready in %.1f s, %d + %d tokens encoded in %.1f s",
             t1 - t0, train_ids.size, val_ids.size, t2 - t1)
    for split, ids in (("train", train_ids), ("validation", val_ids)):
        if ids.size == 0:
            raise ValueError(f"the {split} split of {name} encodes to no tokens")

    # Build in a private directory and rename it into place: readers never see a partial cache.
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=f".{cache.name}."))
    tok.save(str(tmp / "tokenizer.json"))
    formats.write_shard(tmp / "train.bin", train_ids)
    formats.write_shard(tmp / "val.bin", val_ids)
    meta = {"fingerprint": fingerprint, "train_tokens": int(train_ids.size),
            "val_tokens": int(val_ids.size), "python": sys.version,
            "train_seconds": round(t1 - t0, 3), "encode_seconds": round(t2 - t1, 3)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as the work directory
    try:
        os.replace(tmp, cache)
    except OSError:  # another process finished first; its cache is identical
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- batches


def check_ids(windows, vocab_size, tokens, starts, what: str) -> None:
    """Raise naming the file and position when a window holds an id >= vocab_size (the embedding
    lookup would otherwise return garbage far from the cause)."""
    if vocab_size is None or windows.size == 0 or windows.max() < vocab_size:
        return
    row, col = np.argwhere(windows >= vocab_size)[0]
    position = int(starts[row]) + int(col)
    where = f"position {position}"
    if hasattr(tokens, "locate"):
        path, offset = tokens.locate(position)
        where = f"{path}, token {offset}" if path is not None else where
    raise ValueError(f"{what}: token id {windows[row, col]} at {where} is not below the model's "
                     f"vocabulary size {vocab_size}; the data was made with another tokenizer "
                     "(pass --data.tokenizer or --model.vocab_size to match it)")


class BatchSampler:
    """Random windows of `seq_len + 1` tokens; inputs are the first `seq_len`, targets the last.

    `get(step)` is a pure function of (seed, step), so resuming at a step replays the same data.
    All processes draw the same global batch of `batch_size` window starts and each reads only its
    own `batch_size / process_count` consecutive rows, so processes partition the global batch and
    touch (through the memory map) only their share of the tokens.
    """

    def __init__(self, tokens, *, batch_size: int, seq_len: int, seed: int,
                 process_index: int = 0, process_count: int = 1, vocab_size: int | None = None):
        if min(batch_size, seq_len, process_count) < 1 or seed < 0:
            raise ValueError(
                "BatchSampler: batch_size, seq_len, process_count must be >= 1 and seed >= 0, "
                f"got {batch_size}, {seq_len}, {process_count}, {seed}")
        if batch_size % process_count or not 0 <= process_index < process_count:
            raise ValueError(
                f"BatchSampler: batch_size {batch_size} is not divisible by process_count "
                f"{process_count}, or process_index {process_index} is not in [0, process_count)")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"BatchSampler: {len(tokens)} tokens are fewer than seq_len + 1 = {seq_len + 1}")
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed
        self.local_batch_size = batch_size // process_count
        self.process_index, self.vocab_size = process_index, vocab_size

    def get(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs_BT, targets_BT), int32, B = local batch size; targets_BT[:, t] follows
        inputs_BT[:, t] in the token stream."""
        if step < 0:
            raise ValueError(f"BatchSampler.get: step must be >= 0, got {step}")
        rng = np.random.default_rng([self.seed, step])
        starts_B = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        lo = self.process_index * self.local_batch_size
        local_B = starts_B[lo: lo + self.local_batch_size]
        rows = [np.asarray(self.tokens[s: s + self.seq_len + 1]) for s in local_B]
        windows_BT1 = np.stack(rows).astype(np.int32)
        check_ids(windows_BT1, self.vocab_size, self.tokens, local_B, f"batch of step {step}")
        return windows_BT1[:, :-1], windows_BT1[:, 1:]


class ValidationSet:
    """The first `num_batches · batch_size · seq_len (+ 1)` tokens of the validation split as
    consecutive, non-overlapping sequences: the same at every evaluation, in every run with the
    same data, whatever the seed. `num_batches` is as many whole batches as `eval_tokens` allows
    (at least one; fewer when the split is shorter). Each process reads its share of each batch.
    """

    def __init__(self, tokens, *, batch_size: int, seq_len: int, eval_tokens: int,
                 process_index: int = 0, process_count: int = 1, vocab_size: int | None = None):
        per_batch = batch_size * seq_len
        available = (len(tokens) - 1) // per_batch
        if available < 1:
            raise ValueError(
                f"the validation split has {len(tokens)} tokens, fewer than one batch of "
                f"batch_size x seq_len + 1 = {per_batch + 1}; use more validation data or a "
                "smaller --data.batch_size / --model.max_seq_len")
        self.num_batches = min(available, max(1, eval_tokens // per_batch))
        self.num_tokens = self.num_batches * per_batch  # target tokens scored per evaluation
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.local = batch_size // process_count
        self.process_index, self.vocab_size = process_index, vocab_size

    def get(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        T, first = self.seq_len, index * self.batch_size + self.process_index * self.local
        window = np.asarray(self.tokens[first * T: (first + self.local) * T + 1]).astype(np.int32)
        check_ids(window[None], self.vocab_size, self.tokens, [first * T], "validation set")
        inputs = window[:-1].reshape(self.local, T)
        targets = window[1:].reshape(self.local, T)
        return inputs, targets


# ----------------------------------------------------------------------------- text corpora

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
