"""Token files on disk: three layouts, told apart by magic bytes and file names, memory-mapped.

- **rowgeom shards** (written by `prepare.py` and the trainer's token cache): a 32-byte
  little-endian header `struct("<8sIIQQ")` = (magic `b"RGTOKENS"`, version 1, dtype code
  1 = uint16 / 2 = uint32, token count, largest token id), then the tokens.
- **llm.c / modded-nanogpt shards**: a header of 256 little-endian int32 (`[0]` = magic 20240520,
  `[1]` = version 1, `[2]` = token count, the rest zero), then uint16 tokens
  (`dev/data/data_common.py:write_datafile` in karpathy/llm.c).
- **nanoGPT**: `train.bin` and `val.bin`, raw uint16 tokens with no header
  (`data/openwebtext/prepare.py` in karpathy/nanoGPT). Recognised by these two names only.

A directory or glob of shards is split by file name: names containing `train` are the training
split, names containing `val` the validation split. Every header is checked against the file
size, and a file in none of the layouts is an error that names it. Nothing is unpickled.
"""

from __future__ import annotations

import glob as globlib
import os
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROWGEOM_MAGIC = b"RGTOKENS"
ROWGEOM_VERSION = 1
_HEADER = struct.Struct("<8sIIQQ")  # 32 bytes, little-endian
_DTYPE_CODES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}

LLMC_MAGIC = 20240520
LLMC_VERSION = 1
LLMC_HEADER_INTS = 256

FORMATS = ("rowgeom", "llmc", "nanogpt")


class TokenFile(NamedTuple):
    path: Path
    format: str  # one of FORMATS
    tokens: np.memmap  # 1-D, read-only
    max_token: int | None  # from the header when it records one (rowgeom), else None


# ---------------------------------------------------------------------------------------------
# rowgeom shards


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab_size <= 65536): half the disk and page cache of uint32."""
    return _DTYPE_CODES[1] if vocab_size <= 1 << 16 else _DTYPE_CODES[2]


def write_shard(path, tokens) -> Path:
    """Write 1-D non-negative integer `tokens` as a rowgeom shard (uint16 if they fit, else
    uint32), atomically (a temporary name renamed into place)."""
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
    header = _HEADER.pack(ROWGEOM_MAGIC, ROWGEOM_VERSION, code, tokens.size, hi)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(tokens.astype(_DTYPE_CODES[code]).tobytes())
    os.replace(tmp, path)
    return path


def _check_size(path: Path, header_bytes: int, num_tokens: int, dtype: np.dtype) -> None:
    expected = header_bytes + num_tokens * dtype.itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise ValueError(
            f"token shard {path}: header says {num_tokens} {dtype.name} tokens ({expected} bytes "
            f"with header) but the file has {actual} bytes (truncated or corrupt)")
    if num_tokens == 0:
        raise ValueError(f"token shard {path} holds no tokens")


def _read_rowgeom(path: Path) -> TokenFile:
    with open(path, "rb") as f:
        raw = f.read(_HEADER.size)
    if len(raw) < _HEADER.size:
        raise ValueError(f"token shard {path} is truncated: {len(raw)} bytes, shorter than its "
                         f"{_HEADER.size}-byte header")
    magic, version, code, num_tokens, max_token = _HEADER.unpack(raw)
    if magic != ROWGEOM_MAGIC:
        raise ValueError(f"{path} is not a rowgeom token shard (magic {magic!r}, expected "
                         f"{ROWGEOM_MAGIC!r})")
    if version != ROWGEOM_VERSION:
        raise ValueError(f"token shard {path} has version {version}, this code reads "
                         f"{ROWGEOM_VERSION}")
    if code not in _DTYPE_CODES:
        raise ValueError(f"token shard {path} has unknown dtype code {code} "
                         "(known: 1 = uint16, 2 = uint32)")
    dtype = _DTYPE_CODES[code]
    _check_size(path, _HEADER.size, num_tokens, dtype)
    if max_token >= 1 << (8 * dtype.itemsize):
        raise ValueError(f"token shard {path}: header max token {max_token} does not fit "
                         f"{dtype.name}")
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=_HEADER.size, shape=(num_tokens,))
    return TokenFile(path, "rowgeom", tokens, int(max_token))


def read_shard(path) -> np.memmap:
    """Memory-map a rowgeom shard read-only after validating its header against the file size."""
    return _read_rowgeom(Path(path)).tokens


# ---------------------------------------------------------------------------------------------
# llm.c and nanoGPT


def _read_llmc(path: Path) -> TokenFile:
    header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
    if header.size < LLMC_HEADER_INTS:
        raise ValueError(f"llm.c shard {path} is truncated: shorter than its "
                         f"{4 * LLMC_HEADER_INTS}-byte header")
    if header[1] != LLMC_VERSION:
        raise ValueError(f"llm.c shard {path} has version {header[1]}; this code reads version "
                         f"{LLMC_VERSION} (uint16 tokens)")
    num_tokens, dtype = int(header[2]), np.dtype("<u2")
    _check_size(path, 4 * LLMC_HEADER_INTS, num_tokens, dtype)
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=4 * LLMC_HEADER_INTS,
                       shape=(num_tokens,))
    return TokenFile(path, "llmc", tokens, None)


def _read_nanogpt(path: Path) -> TokenFile:
    size = path.stat().st_size
    if size == 0 or size % 2:
        raise ValueError(f"nanoGPT token file {path} has {size} bytes; raw uint16 tokens need a "
                         "positive even size")
    return TokenFile(path, "nanogpt", np.memmap(path, dtype="<u2", mode="r"), None)


def detect_format(path) -> str:
    """"rowgeom", "llmc" or "nanogpt" from the first bytes and the name; ValueError otherwise."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(ROWGEOM_MAGIC):
        return "rowgeom"
    if len(head) >= 4 and struct.unpack("<i", head[:4])[0] == LLMC_MAGIC:
        return "llmc"
    if path.name in ("train.bin", "val.bin"):
        return "nanogpt"
    raise ValueError(
        f"{path} is not a known token file: no rowgeom header (b'RGTOKENS'), no llm.c header "
        f"(int32 magic {LLMC_MAGIC}), and not named train.bin / val.bin (nanoGPT raw uint16)")


def read_token_file(path) -> TokenFile:
    """Detect the layout of `path` and memory-map its tokens after checking the header."""
    path = Path(path)
    reader = {"rowgeom": _read_rowgeom, "llmc": _read_llmc, "nanogpt": _read_nanogpt}
    return reader[detect_format(path)](path)


# ---------------------------------------------------------------------------------------------
# Several files as one sequence


class ShardedTokens:
    """Token files seen as one 1-D sequence without reading them: `len`, contiguous slices (which
    may cross file boundaries), `np.asarray` (which reads everything) and `locate(i)`, the file
    holding position `i` (for error messages)."""

    ndim = 1

    def __init__(self, shards, paths=None):
        self.shards = list(shards)
        self.paths = list(paths) if paths is not None else [None] * len(self.shards)
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
        # Files outside [start, stop) contribute empty slices; only the overlapping pages are read.
        pieces = [s[max(start - a, 0): max(stop - a, 0)]
                  for s, a in zip(self.shards, self._starts[:-1], strict=True)]
        return np.concatenate(pieces).astype(self.dtype)

    def __array__(self, dtype=None, copy=None):
        return np.concatenate(self.shards).astype(dtype or self.dtype)

    def locate(self, position: int):
        """(path, offset in that file) of global token `position`."""
        i = int(np.searchsorted(self._starts, position, side="right")) - 1
        return self.paths[i], position - int(self._starts[i])


class TokenFiles(NamedTuple):
    format: str
    train: ShardedTokens
    val: ShardedTokens
    max_token: int | None  # the largest id over all files, when every header records it


def _expand(source: str) -> list[Path]:
    if any(c in source for c in "*?["):
        return sorted(Path(p) for p in globlib.glob(os.path.expanduser(source)))
    path = Path(source).expanduser()
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".bin")
    return [path] if path.suffix == ".bin" else []


def find_token_files(source: str) -> TokenFiles | None:
    """The token files `source` (a directory, a glob or a `.bin` file) names, split by name.

    None when `source` names no `.bin` file (it is text). ValueError naming the file when a `.bin`
    file is in no known layout, when layouts are mixed, or when a split has no file.
    """
    paths = _expand(str(source))
    if not paths:
        return None
    files = [read_token_file(p) for p in paths]
    kinds = sorted({f.format for f in files})
    if len(kinds) > 1:
        raise ValueError(f"{source} mixes token file layouts {kinds}; use one layout per dataset")
    for f in files:
        if "train" not in f.path.name and "val" not in f.path.name:
            raise ValueError(f"{f.path}: cannot tell its split; token file names must contain "
                             "'train' or 'val'")
    splits = {}
    for split in ("train", "val"):
        chosen = [f for f in files if split in f.path.name]
        if not chosen:
            names = ", ".join(p.name for p in paths[:5])
            raise ValueError(
                f"{source}: no {split} token file (names containing {split!r}) among {names}; "
                f"pass a directory or glob that matches both *train* and *val* files")
        splits[split] = chosen
    both = {f.path for f in splits["train"]} & {f.path for f in splits["val"]}
    if both:
        raise ValueError(f"{sorted(both)[0]} has both 'train' and 'val' in its name")
    maxima = [f.max_token for f in files]
    return TokenFiles(
        kinds[0],
        *(ShardedTokens([f.tokens for f in splits[s]], [f.path for f in splits[s]])
          for s in ("train", "val")),
        None if None in maxima else max(maxima))
