"""Tokenizers for the LM example: a byte-level BPE trained here, or a Hugging Face `tokenizer.json`.

Both are `tokenizers.Tokenizer`s (imported lazily: token files need no tokenizer). Documents are
encoded in parallel (`encode_batch`) and separated by the tokenizer's end-of-document token.
A `tokenizer.json` is JSON: loading one executes nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"  # separates documents (files); the BPE's only special token, id 0
# Candidates for the end-of-document token of a pretrained tokenizer, most common first.
EOS_CANDIDATES = (EOS, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")
_CHUNK_CHARS = 1 << 20  # texts are encoded in ~1 MiB pieces so encode_batch can use every core


def _tokenizers():
    try:  # imported lazily: token shards need no tokenizer
        import tokenizers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the LM example's BPE needs `pip install 'rowgeom[examples]'`") from e
    return tokenizers


def library_version() -> str:
    """The installed `tokenizers` version (part of the token cache's key)."""
    return _tokenizers().__version__


def train_bpe(texts: list[str], vocab_size: int):
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


def tokenizer_file(path) -> Path:
    """The `tokenizer.json` that `path` names: the file itself, or the one in a directory (what
    `save_pretrained` writes)."""
    path = Path(path).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer directory {path} has no tokenizer.json (a Hugging Face "
                             "tokenizer saved with save_pretrained has one)")
        return path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"tokenizer {path} does not exist (expected a tokenizer.json file)")
    return path


def load_tokenizer(path):
    """A Hugging Face `tokenizers.Tokenizer` from a `tokenizer.json`, or a directory holding one
    (`tokenizer_file`; JSON, nothing executed)."""
    path = tokenizer_file(path)
    try:
        return _tokenizers().Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exceptions
        raise ValueError(f"tokenizer {path} is not a Hugging Face tokenizer.json: {e}") from None


def vocab_size(tokenizer) -> int:
    """Number of ids the tokenizer can produce (added tokens included)."""
    return tokenizer.get_vocab_size(with_added_tokens=True)


def eos_id(tokenizer) -> int | None:
    """The id that separates documents: the first of EOS_CANDIDATES the tokenizer knows."""
    for token in EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


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
    """Encode each document (in parallel, `encode_batch`) and follow it with the tokenizer's
    end-of-document token (none when it has no such token, see `eos_id`)."""
    pieces, ends = [], []
    for text in texts:
        pieces.extend(_chunks(text))
        ends.append(len(pieces))
    encodings = tokenizer.encode_batch(pieces, add_special_tokens=False)
    separator = eos_id(tokenizer)
    eos = np.array([] if separator is None else [separator], dtype)
    arrays, end = [np.zeros(0, dtype)], iter(ends)
    next_end = next(end, None)
    for i, enc in enumerate(encodings, start=1):
        arrays.append(np.asarray(enc.ids, dtype))
        while i == next_end:  # also closes empty documents
            arrays.append(eos)
            next_end = next(end, None)
    return np.concatenate(arrays)
