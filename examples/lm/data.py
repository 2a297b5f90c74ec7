"""The trainer's token data: memory-mapped token files and the batches the loop reads of them.

`prepare_tokens(source=...)` gives the train and validation splits of token files (a directory,
a glob or a `.bin` file, split by name) in one of three layouts, told apart by their first bytes
(`open_shard`): **rowgeom** (`HEADER`, written by `tools/prepare.py`), **llm.c / modded-nanogpt**
(`LLMC_LAYOUTS`) and **nanoGPT** (`train.bin` / `val.bin`, raw uint16). Text, or None (the
standard library), is tokenized once by `tools/prepare.py` into cached rowgeom shards.
`BatchSampler` (the training epochs) and `ValidationSet` (the split's first sequences) are pure
functions of `(seed, index)`: a resumed run replays the same data, and each process reads only
the rows its devices hold.
"""

from __future__ import annotations

import functools
import glob as globlib
import json
import os
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROWGEOM_MAGIC = b"RGTOKENS"
# 32 bytes, little-endian: magic, version 1, dtype code (DTYPE_CODES), token count, largest id.
HEADER = struct.Struct("<8sIIQQ")
DTYPE_CODES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
LLMC_HEADER_BYTES = 1024  # 256 int32: magic, version, token count, then zeros
# llm.c's two shard layouts (its dev/data/data_common.py, HEADERS_INFO): int32 magic ->
# (layout, version, token dtype). The tokenizers differ, so one source may not mix them.
LLMC_LAYOUTS = {20240520: ("llmc", 1, np.dtype("<u2")),          # "gpt-2"
                20240801: ("llmc-llama3", 7, np.dtype("<u4"))}   # "llama-3"


class TokenSplits(NamedTuple):
    train: np.ndarray  # 1-D token ids: a read-only memmap, or ShardedTokens over several
    val: np.ndarray
    vocab_size: int  # every id is < vocab_size
    # "text" (tokenized here), "rowgeom", "llmc", "llmc-llama3" or "nanogpt"
    format: str = "text"
    tokenizer: str | None = None  # text: its tokenizer.json's sha256 (16 hex digits)

    def identity(self) -> str:
        """What a checkpoint records of the data it was trained on, so that a resume on other
        data (a text source edited, and so tokenized anew) is refused: the format, the splits'
        lengths and a text source's tokenizer. It reads no token."""
        return (f"{self.format}, {len(self.train):,} train / {len(self.val):,} validation "
                f"tokens" + (f", tokenizer sha256 {self.tokenizer}" if self.tokenizer else ""))


def open_shard(path) -> tuple[str, np.memmap, int]:
    """(layout, read-only memmap of the tokens, largest id) of one token file, its header checked
    against the file size. The largest id is the rowgeom header's, else a scan of the map."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    top = None
    if head[:8] == ROWGEOM_MAGIC:
        if len(head) < HEADER.size:
            raise ValueError(f"token shard {path} is truncated: {len(head)} bytes, shorter than "
                             f"its {HEADER.size}-byte header")
        _, version, code, count, top = HEADER.unpack(head)
        if version != 1 or code not in DTYPE_CODES:
            raise ValueError(f"token shard {path} has version {version}, dtype code {code}; this "
                             "code reads version 1 with codes 1 (uint16) and 2 (uint32)")
        layout, offset, dtype = "rowgeom", HEADER.size, DTYPE_CODES[code]
    elif len(head) >= 12 and struct.unpack("<i", head[:4])[0] in LLMC_LAYOUTS:
        magic, version, count = struct.unpack("<3i", head[:12])
        layout, known, dtype = LLMC_LAYOUTS[magic]
        if version != known:
            raise ValueError(f"llm.c shard {path} has version {version}; this code reads "
                             f"version {known} ({dtype.name} tokens) under magic {magic}")
        offset = LLMC_HEADER_BYTES
    elif path.name in ("train.bin", "val.bin"):
        layout, offset, dtype, count = "nanogpt", 0, np.dtype("<u2"), path.stat().st_size // 2
    else:
        raise ValueError(f"{path} is not a known token file: no rowgeom header (b'RGTOKENS'), no "
                         f"llm.c header (int32 magic {' or '.join(map(str, LLMC_LAYOUTS))}), "
                         "and not named train.bin / val.bin (nanoGPT raw uint16)")
    expected, actual = offset + count * dtype.itemsize, path.stat().st_size
    if actual != expected or count == 0:
        raise ValueError(f"token file {path}: header says {count} {dtype.name} tokens "
                         f"({expected} bytes with header) but the file has {actual} bytes "
                         "(truncated, corrupt or empty)")
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))
    return layout, tokens, _largest_id(path, tokens) if top is None else int(top)


def _largest_id(path: Path, tokens: np.memmap) -> int:
    """The largest id of a token file whose header has none (llm.c, nanoGPT): a scan of every
    token, remembered per file (path, size, mtime) in `$XDG_CACHE_HOME/rowgeom/` (default
    `~/.cache`), so that a relaunch, the next run or another process on the same files (the
    paper's 89B tokens of FineWeb100B: minutes) does not read them all again."""
    stat, name = path.stat(), str(path.resolve())
    key = f"{name}:{stat.st_size}:{stat.st_mtime_ns}"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "rowgeom" / (
        "largest-token-ids.json")
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = None
    known = known if isinstance(known, dict) else {}
    if isinstance(known.get(key), int):
        return known[key]
    known = {k: v for k, v in known.items()  # entries of files gone, or of this one before, go
             if (f := k.rsplit(":", 2)[0]) != name and os.path.exists(f)}
    known[key] = top = int(tokens.max())
    try:  # written whole, then renamed: a reader never sees half a file
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f".{cache.name}.{os.getpid()}")
        partial.write_text(json.dumps(known))
        os.replace(partial, cache)
    except OSError:  # a read-only home: scanned again next time
        pass
    return top


class ShardedTokens:
    """Token files seen as one 1-D sequence without reading them: `len`, contiguous slices (which
    may cross file boundaries) and `np.asarray` (which reads everything)."""

    ndim = 1

    def __init__(self, shards):
        self.shards = list(shards)
        self._starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.dtype = np.result_type(*(s.dtype for s in self.shards))
        self.shape = (int(self._starts[-1]),)

    def __len__(self) -> int:
        return self.shape[0]

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


def token_files(source) -> list[Path]:
    """The `.bin` files `source` (a directory, a glob or a `.bin` file) names; [] for text."""
    source = str(source)
    if any(c in source for c in "*?["):
        return sorted(Path(p) for p in globlib.glob(os.path.expanduser(source))
                      if p.endswith(".bin"))
    path = Path(source).expanduser()
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".bin")
    return [path] if path.suffix == ".bin" else []


def open_splits(source, paths, vocab_size: int) -> TokenSplits:
    """The train / val splits of token files `paths` (split by name), each file's largest id
    checked against `vocab_size` as it is opened."""
    opened = {}
    for path in paths:
        if ("train" in path.name) == ("val" in path.name):
            raise ValueError(f"{path}: cannot tell its split; token file names must contain "
                             "'train' or 'val' (not both)")
        layout, tokens, top = open_shard(path)
        if top >= vocab_size:
            raise ValueError(
                f"{path} holds token id {top}, not below the vocabulary size {vocab_size}: it was "
                f"made with another tokenizer; pass that tokenizer's --data.tokenizer or "
                f"--model.vocab_size {top + 1} or more")
        opened[path] = layout, tokens
    layouts = sorted({layout for layout, _ in opened.values()})
    if len(layouts) > 1:
        raise ValueError(f"{source} mixes token file layouts {layouts}; use one per dataset")
    splits = []
    for split in ("train", "val"):
        chosen = [tokens for path, (_, tokens) in opened.items() if split in path.name]
        if not chosen:
            raise ValueError(
                f"{source}: no {split} token file (names containing {split!r}) among "
                f"{', '.join(p.name for p in paths[:5])}; pass a directory or glob that matches "
                "both *train* and *val* files")
        splits.append(chosen[0] if len(chosen) == 1 else ShardedTokens(chosen))
    return TokenSplits(*splits, vocab_size, layouts[0])


def prepare_tokens(*, source=None, workdir, vocab_size: int, val_fraction: float = 0.05,
                   tokenizer=None) -> TokenSplits:
    """Token ids for training and validation (`source`: the module docstring). vocab_size bounds
    every id and sizes the BPE trained for text without `tokenizer` (a `tokenizer.json`, whose
    size must not exceed it). Text is tokenized once into `workdir/tokens/`."""
    paths = [] if source is None else token_files(source)
    if tokenizer is not None or not paths:
        from examples.lm.tools import prepare  # text and tokenizers: the tools' side
        from examples.lm.tools import tokenizer as bpe

        if tokenizer is not None:  # its vocabulary, which the model's must hold
            size = bpe.vocab_size(bpe.load_tokenizer(tokenizer))
            if size > vocab_size:
                raise ValueError(f"the tokenizer has {size} tokens but the model has {vocab_size}"
                                 " (--model.vocab_size / --model.valid_vocab_size)")
            vocab_size = size
        if not paths:
            return prepare.token_cache(source, workdir, vocab_size=vocab_size,
                                       val_fraction=val_fraction, tokenizer=tokenizer)
    return open_splits(source, paths, vocab_size)


class BatchSampler:
    """The training batches, epoch by epoch, a pure function of `(seed, index)`.

    Each file is cut into aligned sequences of `seq_len + 1` tokens (sequence k is tokens
    `[k·seq_len, (k+1)·seq_len]`). Epoch e reads the files in an order shuffled by `(seed, e)`,
    each file's sequences in groups of one update's `batch_size × grad_accum_steps`, shuffled by
    `(seed, e, file)`: with `shuffle="batches"` (the paper's loader) each group is a run of
    consecutive sequences (a file's last incomplete group is not read); with `"sequences"` the
    sequences themselves are shuffled, so that an update mixes the file's text (those left over
    after whole groups differ by epoch). Within an epoch no token is a target twice, and no
    sequence crosses two files. Micro-batch `index` is micro-batch `index % grad_accum_steps` of
    update `index // grad_accum_steps`, and a process reads its `rows` of it (those its devices
    hold, `sharding.process_rows`): an update's sequences depend neither on the accumulation
    split nor on the processes, and a resumed run replays the same data."""

    def __init__(self, tokens, *, batch_size: int, seq_len: int, seed: int,
                 grad_accum_steps: int = 1, shuffle: str = "sequences",
                 rows: tuple[int, int] | None = None):
        if shuffle not in ("sequences", "batches"):
            raise ValueError(f"BatchSampler: shuffle must be 'sequences' or 'batches', got "
                             f"{shuffle!r}")
        if min(batch_size, seq_len, grad_accum_steps) < 1 or seed < 0:
            raise ValueError(
                "BatchSampler: batch_size, seq_len, grad_accum_steps must be >= 1 and seed >= 0, "
                f"got {batch_size}, {seq_len}, {grad_accum_steps}, {seed}")
        self.shards = list(getattr(tokens, "shards", [tokens]))  # ShardedTokens: its files
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.accum, self.shuffle = grad_accum_steps, shuffle
        self.first_row, self.local_batch_size = _rows(rows, batch_size, "BatchSampler")
        per_update = batch_size * grad_accum_steps
        self.sequences = [(len(s) - 1) // seq_len for s in self.shards]
        self.groups = [n // per_update for n in self.sequences]
        self.updates_per_epoch = sum(self.groups)
        if not self.updates_per_epoch:
            raise ValueError(
                f"no training file holds one update's batch_size x grad_accum_steps x seq_len + 1"
                f" = {per_update * seq_len + 1} tokens (the largest has "
                f"{max(len(s) for s in self.shards)}); use more data, or a smaller "
                "--data.batch_size / --optim.grad_accum_steps / --model.max_seq_len")

    def get(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs_BT, targets_BT) of micro-batch `index`, int32, B = local batch size;
        targets_BT[:, t] follows inputs_BT[:, t] in the token stream."""
        if index < 0:
            raise ValueError(f"BatchSampler.get: index must be >= 0, got {index}")
        update, micro = divmod(index, self.accum)
        epoch, position = divmod(update, self.updates_per_epoch)
        for shard in _shuffled(len(self.shards), self.seed, epoch, 0):
            if position < self.groups[shard]:
                break
            position -= self.groups[shard]
        T, per_update, rows = self.seq_len, self.batch_size * self.accum, self.local_batch_size
        first = micro * self.batch_size + self.first_row  # in the update's group
        if self.shuffle == "batches":  # a run of consecutive sequences: one read
            group = int(_shuffled(self.groups[shard], self.seed, epoch, int(shard), 1)[position])
            start = (group * per_update + first) * T
            window = np.asarray(self.shards[shard][start: start + rows * T + 1]).astype(np.int32)
            return window[:-1].reshape(rows, T), window[1:].reshape(rows, T)
        sequences = _shuffled(self.sequences[shard], self.seed, epoch, int(shard), 2)
        chosen = sequences[position * per_update + first: position * per_update + first + rows]
        windows = np.stack([np.asarray(self.shards[shard][k * T: k * T + T + 1])
                            for k in chosen.tolist()]).astype(np.int32)
        return windows[:, :-1], windows[:, 1:]


def _rows(rows, batch_size: int, name: str) -> tuple[int, int]:
    """(first row, number of rows) a process reads of each batch: `rows` = [lo, hi), or all."""
    lo, hi = (0, batch_size) if rows is None else rows
    if not 0 <= lo < hi <= batch_size:
        raise ValueError(f"{name}: rows must be [lo, hi) with 0 <= lo < hi <= batch_size "
                         f"{batch_size}, got {rows}")
    return lo, hi - lo


@functools.lru_cache(maxsize=8)
def _shuffled(n: int, *entropy: int) -> np.ndarray:
    """0..n-1 in the order numpy's generator seeded with `entropy` shuffles them (cached: every
    micro-batch of an epoch asks for the same shard order)."""
    order = np.arange(n)
    np.random.default_rng(list(entropy)).shuffle(order)
    return order


class ValidationSet:
    """The first `num_batches · batch_size · seq_len (+ 1)` tokens of the validation split as
    consecutive sequences, the same in every run on the same data: as many whole batches as
    `eval_tokens` allows (at least one). A process reads its `rows` of each batch (as
    `BatchSampler`)."""

    def __init__(self, tokens, *, batch_size: int, seq_len: int, eval_tokens: int,
                 rows: tuple[int, int] | None = None):
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
        self.first_row, self.local = _rows(rows, batch_size, "ValidationSet")

    def get(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        T, first = self.seq_len, index * self.batch_size + self.first_row
        window = np.asarray(self.tokens[first * T: (first + self.local) * T + 1]).astype(np.int32)
        return window[:-1].reshape(self.local, T), window[1:].reshape(self.local, T)
