"""The trainer's token data: a data source turned into train and validation token arrays.

`prepare_tokens(source=...)`:

- None: the running interpreter's standard library `.py` sources (about 11 MiB on CPython 3.11,
  tests excluded), split by file. No download.
- Token files (a directory, a glob or a `.bin` file; see formats.py): rowgeom shards, llm.c /
  modded-nanogpt shards, nanoGPT `train.bin` / `val.bin`. Memory-mapped as they are.
- Text (see corpus.py): a UTF-8 file, a `.jsonl` file or a directory or glob of them. Tokenized
  with a given `tokenizer.json` or with a byte-level BPE trained on the train split (see
  tokenization.py), and cached under the work directory as rowgeom shards.

Nothing here unpickles or evaluates: shards are a checked binary header plus raw little-endian
integers, and the tokenizer and cache metadata are JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from examples.lm import corpus, formats, tokenization

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
        root, files = corpus.stdlib_root(), corpus.stdlib_source_files()
    else:
        found = formats.find_token_files(source)
        if found is not None:
            return _token_files(found, vocab_size)
        name, strict = str(source), True
        root, files = corpus.text_files(source)
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
    train_texts, val_texts = corpus.split_documents(files, val_fraction=val_fraction,
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
