"""Token data for the LM example: a corpus, a cached byte-level BPE, token shards and batches.

The default corpus needs no download: the `.py` sources of the running interpreter's standard
library (about 11 MiB on CPython 3.11, tests excluded), split by file into train and validation. A
byte-level BPE (`tokenizers`) is trained on the train split and cached under the work directory
together with the encoded tokens, stored as token shards. A text file or directory of the user's
goes the same way; a directory of pre-tokenized `train*.bin` / `val*.bin` shards is memory-mapped
as is.

Nothing here unpickles or evaluates: shards are a fixed binary header plus raw little-endian
integers, the tokenizer and cache metadata are JSON, and every header, size and dtype is checked
before use.
"""

import hashlib
import json
import logging
import os
import shutil
import struct
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"  # separates documents (files); the tokenizer's only special token, id 0
_CACHE_FORMAT = 1  # bump when the cache layout or the encoding changes
_CHUNK_CHARS = 1 << 20  # texts are encoded in ~1 MiB pieces so encode_batch can use every core


class TokenSplits(NamedTuple):
    train: np.ndarray  # 1-D token ids (a read-only memmap, or ShardedTokens for several shards)
    val: np.ndarray
    vocab_size: int  # every id is < vocab_size


# ---------------------------------------------------------------------------------------------
# Corpus files and the train / validation split.

# Third-party packages, tests and build artefacts (which differ between installs) are not corpus.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


def stdlib_source_files() -> list[Path]:
    """The running interpreter's standard library `.py` files, without tests, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
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


# ---------------------------------------------------------------------------------------------
# Token shards: header (magic, version, dtype code, token count, max token id) + raw tokens.

_MAGIC = b"RGTOKENS"
_VERSION = 1
_HEADER = struct.Struct("<8sIIQQ")  # 32 bytes, little-endian
_DTYPE_CODES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}


class _ShardHeader(NamedTuple):
    dtype: np.dtype
    num_tokens: int
    max_token: int


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab_size <= 65536): half the disk and page cache of uint32."""
    return _DTYPE_CODES[1] if vocab_size <= 1 << 16 else _DTYPE_CODES[2]


def write_shard(path, tokens) -> Path:
    """Write 1-D non-negative integer `tokens` as a shard (uint16 if they fit, else uint32)."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"write_shard({path}): tokens must be a non-empty 1-D integer array, got "
            f"shape {tokens.shape} dtype {tokens.dtype}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= 1 << 32:
        raise ValueError(f"write_shard({path}): token ids must be in [0, 2**32), got [{lo}, {hi}]")
    code = 1 if hi < 1 << 16 else 2
    header = _HEADER.pack(_MAGIC, _VERSION, code, tokens.size, hi)
    # Write to a temporary name and rename, so a crash never leaves a half-written shard behind.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(tokens.astype(_DTYPE_CODES[code]).tobytes())
    os.replace(tmp, path)
    return path


def _read_header(path: Path) -> _ShardHeader:
    with open(path, "rb") as f:
        raw = f.read(_HEADER.size)
    if len(raw) < _HEADER.size:
        raise ValueError(
            f"token shard {path} is truncated: {len(raw)} bytes, shorter than its "
            f"{_HEADER.size}-byte header")
    magic, version, code, num_tokens, max_token = _HEADER.unpack(raw)
    if magic != _MAGIC:
        raise ValueError(
            f"{path} is not a rowgeom token shard (magic {magic!r}, expected {_MAGIC!r})")
    if version != _VERSION:
        raise ValueError(f"token shard {path} has version {version}, this code reads {_VERSION}")
    if code not in _DTYPE_CODES:
        raise ValueError(
            f"token shard {path} has unknown dtype code {code} (known: 1 = uint16, 2 = uint32)")
    dtype = _DTYPE_CODES[code]
    expected = _HEADER.size + num_tokens * dtype.itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise ValueError(
            f"token shard {path}: header says {num_tokens} {dtype.name} tokens ({expected} bytes "
            f"with header) but the file has {actual} bytes (truncated or corrupt)")
    if num_tokens == 0:
        raise ValueError(f"token shard {path} holds no tokens")
    if max_token >= 1 << (8 * dtype.itemsize):
        raise ValueError(
            f"token shard {path}: header max token {max_token} does not fit {dtype.name}")
    return _ShardHeader(dtype, num_tokens, max_token)


def read_shard(path) -> np.memmap:
    """Memory-map a shard read-only after validating its header against the file size."""
    path = Path(path)
    header = _read_header(path)
    return np.memmap(path, dtype=header.dtype, mode="r", offset=_HEADER.size,
                     shape=(header.num_tokens,))


class ShardedTokens:
    """Several shards seen as one 1-D token sequence without reading them: `len`, contiguous
    slices (which may cross shard boundaries) and `np.asarray` (which does read everything)."""

    ndim = 1

    def __init__(self, shards):
        self.shards = list(shards)
        self._starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.dtype = np.result_type(*(s.dtype for s in self.shards))

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, index):
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("ShardedTokens supports contiguous slices only, e.g. tokens[a:b]")
        start, stop, _ = index.indices(len(self))
        # Shards outside [start, stop) contribute empty slices; only the overlapping pages are read.
        pieces = [s[max(start - a, 0): max(stop - a, 0)]
                  for s, a in zip(self.shards, self._starts[:-1], strict=True)]
        return np.concatenate(pieces).astype(self.dtype)

    def __array__(self, dtype=None, copy=None):
        return np.concatenate(self.shards).astype(dtype or self.dtype)


def _load_shard_dir(directory: Path, vocab_size: int) -> TokenSplits:
    splits = []
    for prefix in ("train", "val"):
        paths = sorted(directory.glob(f"{prefix}*.bin"))
        if not paths:
            raise ValueError(f"token shard directory {directory} has no {prefix}*.bin shards")
        for path in paths:
            header = _read_header(path)
            if header.max_token >= vocab_size:
                raise ValueError(
                    f"token shard {path} holds token id {header.max_token}, which is not below "
                    f"vocab_size {vocab_size}")
        shards = [read_shard(p) for p in paths]
        splits.append(shards[0] if len(shards) == 1 else ShardedTokens(shards))
    return TokenSplits(splits[0], splits[1], vocab_size)


# ---------------------------------------------------------------------------------------------
# Byte-level BPE, trained on the train split and cached with the encoded tokens.

def _tokenizers():
    try:  # imported lazily: token shards need no tokenizer
        import tokenizers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the LM example's BPE needs `pip install 'rowgeom[examples]'`") from e
    return tokenizers


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style: any byte sequence is encodable, no unknown token) with
    `vocab_size` entries at most, `EOS` included as id 0. Deterministic for a given input."""
    tk = _tokenizers()
    min_vocab = 256 + 1  # the byte alphabet plus EOS
    if vocab_size < min_vocab:
        raise ValueError(
            f"vocab_size must be at least {min_vocab} for a byte-level BPE, got {vocab_size}")
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS], show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def _chunks(text: str) -> list[str]:
    """Split at line ends into ~_CHUNK_CHARS pieces. The byte-level pre-tokenizer splits at
    whitespace anyway, so this only changes how a run of newline + indentation is cut at a seam."""
    pieces, start = [], 0
    while len(text) - start > _CHUNK_CHARS:
        cut = text.rfind("\n", start, start + _CHUNK_CHARS) + 1
        cut = cut if cut > start else start + _CHUNK_CHARS
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def encode_documents(tokenizer, texts: list[str], dtype) -> np.ndarray:
    """Encode each document (in parallel, `encode_batch`) and follow it with EOS."""
    pieces, ends = [], []
    for text in texts:
        pieces.extend(_chunks(text))
        ends.append(len(pieces))
    encodings = tokenizer.encode_batch(pieces, add_special_tokens=False)
    eos = np.array([tokenizer.token_to_id(EOS)], dtype)
    arrays, end = [], iter(ends)
    next_end = next(end, None)
    for i, enc in enumerate(encodings, start=1):
        arrays.append(np.asarray(enc.ids, dtype))
        while i == next_end:  # also closes empty documents
            arrays.append(eos)
            next_end = next(end, None)
    return np.concatenate(arrays)


def _read_texts(files, *, strict: bool) -> list[str]:
    texts = []
    for f in files:
        try:
            texts.append(f.read_bytes().decode("utf-8", errors="strict" if strict else "replace"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{f} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    return texts


def _text_files(directory: Path) -> list[Path]:
    # Hidden files and folders (.git, editor state) are not corpus.
    files = sorted(p for p in directory.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(directory).parts))
    if not files:
        raise ValueError(f"text directory {directory} contains no files")
    return files


def _fingerprint(name, root, files, vocab_size, val_fraction) -> dict:
    # Sizes and mtimes, not contents: a cache hit must not read a large corpus.
    stats = [[f.relative_to(root).as_posix() if root else f.name, st.st_size, st.st_mtime_ns]
             for f, st in ((f, f.stat()) for f in files)]
    return {"format": _CACHE_FORMAT, "source": name, "vocab_size": vocab_size,
            "val_fraction": val_fraction, "tokenizers": _tokenizers().__version__, "files": stats}


def _load_cache(directory: Path, fingerprint: dict, vocab_size: int) -> TokenSplits:
    """The cached splits, after checking they are the ones `fingerprint` describes."""
    meta = json.loads((directory / "meta.json").read_text())
    if meta.get("fingerprint") != fingerprint:
        raise ValueError("fingerprint mismatch")
    tokenizer = _tokenizers().Tokenizer.from_file(str(directory / "tokenizer.json"))  # JSON only
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} > {vocab_size} entries")
    splits = []
    for name in ("train", "val"):
        header = _read_header(directory / f"{name}.bin")
        if header.num_tokens != meta[f"{name}_tokens"] or header.max_token >= vocab_size:
            raise ValueError(f"{name}.bin does not match meta.json")
        splits.append(read_shard(directory / f"{name}.bin"))
    return TokenSplits(splits[0], splits[1], vocab_size)


def prepare_tokens(*, source=None, workdir, vocab_size: int, val_fraction: float = 0.05
                   ) -> TokenSplits:
    """Token ids for training and validation.

    source: None (the standard library), a UTF-8 text file (split by lines: the last `val_fraction`
    of them is validation), a directory of text files (split by file, see `split_files`) or a
    directory holding `train*.bin` and `val*.bin` token shards (memory-mapped, no tokenizer).
    Text is tokenized with a BPE trained on the train split at `vocab_size`; tokenizer and tokens
    are cached under `workdir/tokens/`, keyed by the source files (names, sizes, mtimes),
    `vocab_size` and `val_fraction`, and checked when reused. Each process builds the same cache
    (training and encoding are deterministic); a shared directory is written atomically.
    """
    workdir = Path(workdir).resolve()
    if source is None:
        name, strict = "stdlib", False
        root, files = Path(sysconfig.get_paths()["stdlib"]), stdlib_source_files()
    else:
        source = Path(source).resolve()
        if not source.exists():
            raise ValueError(f"data source {source} does not exist")
        if source.is_dir() and any(source.glob("train*.bin")):
            return _load_shard_dir(source, vocab_size)
        name, strict = str(source), True
        root, files = (source, _text_files(source)) if source.is_dir() else (None, [source])
        # A work directory inside the source must not feed its own cache back into the corpus.
        files = [f for f in files if not f.is_relative_to(workdir)]
    fingerprint = _fingerprint(name, root, files, vocab_size, val_fraction)
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    label = "stdlib" if source is None else source.stem
    cache = workdir / "tokens" / f"{label}-v{vocab_size}-{key}"
    if cache.is_dir():
        try:
            return _load_cache(cache, fingerprint, vocab_size)
        except Exception as e:  # any damage (missing file, bad JSON, bad shard): rebuild it
            log.warning("token cache %s is unusable (%s); rebuilding it", cache, e)
            shutil.rmtree(cache, ignore_errors=True)

    if len(files) == 1:
        lines = _read_texts(files, strict=strict)[0].splitlines(keepends=True)
        if len(lines) < 2:
            raise ValueError(f"text file {files[0]} needs at least 2 lines to split")
        n_val = min(len(lines) - 1, max(1, round(len(lines) * val_fraction)))
        train_texts, val_texts = ["".join(lines[:-n_val])], ["".join(lines[-n_val:])]
    else:
        train_files, val_files = split_files(files, val_fraction=val_fraction)
        train_texts = _read_texts(train_files, strict=strict)
        val_texts = _read_texts(val_files, strict=strict)

    t0 = time.perf_counter()
    tokenizer = train_tokenizer(train_texts, vocab_size)
    t1 = time.perf_counter()
    dtype = token_dtype(vocab_size)
    train_ids = encode_documents(tokenizer, train_texts, dtype)
    val_ids = encode_documents(tokenizer, val_texts, dtype)
    t2 = time.perf_counter()
    log.info("BPE %d trained in %.1f s, %d + %d tokens encoded in %.1f s",
             vocab_size, t1 - t0, train_ids.size, val_ids.size, t2 - t1)

    # Build in a private directory and rename it into place: readers never see a partial cache.
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=f".{cache.name}."))
    tokenizer.save(str(tmp / "tokenizer.json"))
    write_shard(tmp / "train.bin", train_ids)
    write_shard(tmp / "val.bin", val_ids)
    meta = {"fingerprint": fingerprint, "train_tokens": int(train_ids.size),
            "val_tokens": int(val_ids.size), "python": sys.version,
            "train_seconds": round(t1 - t0, 3), "encode_seconds": round(t2 - t1, 3)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as the work directory
    try:
        os.replace(tmp, cache)
    except OSError:  # another process finished first; its cache is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return _load_cache(cache, fingerprint, vocab_size)


# ---------------------------------------------------------------------------------------------
# Batches.

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
        rows = [np.asarray(self.tokens[s: s + self.seq_len + 1])
                for s in starts_B[lo: lo + self.local_batch_size]]
        windows_BT1 = np.stack(rows).astype(np.int32)
        if self.vocab_size is not None and windows_BT1.max() >= self.vocab_size:
            # An out-of-range id would make the embedding lookup return NaN, far from the cause.
            raise ValueError(
                f"BatchSampler: step {step} has token id {windows_BT1.max()} >= vocab_size "
                f"{self.vocab_size}")
        return windows_BT1[:, :-1], windows_BT1[:, 1:]
