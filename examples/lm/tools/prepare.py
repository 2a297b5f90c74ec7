"""Tokenize text / jsonl files into rowgeom token shards that the trainer memory-maps.

    python -m examples.lm.tools.prepare corpus/ --out shards --tokenizer gpt2/tokenizer.json
    python -m examples.lm.tools.prepare 'docs/*.jsonl' --out shards --vocab_size 8192
    python -m examples.lm.train --data.source shards --data.tokenizer shards/tokenizer.json

Sources are text files, `.jsonl` files (one JSON object with a "text" field per line, each a
document) and directories or globs of them. Several files are split into train and validation by
file (`data.split_files`), a single file by its last lines / records. Documents are separated by
the tokenizer's end-of-document token. With `--tokenizer` the given `tokenizer.json` encodes;
without it a byte-level BPE of `--vocab_size` is trained on the train split. The tokenizer used is
saved as OUT/tokenizer.json.

Encoding runs on every core (`tokenizers`' `encode_batch`, in groups of about 8 MiB of text) with
a progress bar. Output: OUT/train_000000.bin, ..., OUT/val_000000.bin, ... in the rowgeom shard
format (formats.py; at most `--shard_tokens` tokens each) and OUT/prepare.json with the counts.
"""

from __future__ import annotations

import sys

if __package__ in (None, ""):  # run as a file: the package is not importable
    print("prepare.py: error: run it as a module from the repository root: "
          "python -m examples.lm.tools.prepare ...", file=sys.stderr)
    raise SystemExit(2)

import argparse
import json
from pathlib import Path

import numpy as np

from examples.lm import data, formats, tokenization

_GROUP_CHARS = 8 << 20  # text encoded per encode_batch call (parallel inside)


def _source_files(sources) -> list[Path]:
    files = []
    for source in sources:
        if formats.find_token_files(source) is not None:
            raise ValueError(f"{source} holds token files already; train.py reads them directly")
        files.extend(data.text_files(source)[1])
    if not files:
        raise ValueError("no input files")
    return sorted(set(files))


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
        self.paths.append(formats.write_shard(path, whole[:n]))
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


def _file_documents(files):
    for f in files:
        yield from data.read_documents([f])


def prepare(sources, out, *, tokenizer=None, vocab_size: int = 4096, val_fraction: float = 0.05,
            shard_tokens: int = 100_000_000, progress: bool = True) -> dict:
    """Tokenize `sources` into rowgeom shards under `out`; returns the summary written to
    OUT/prepare.json."""
    from tqdm.auto import tqdm

    if shard_tokens < 1:
        raise ValueError(f"--shard_tokens must be >= 1, got {shard_tokens}")
    files = _source_files(sources)
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.bin")):
        raise ValueError(f"{out} already holds .bin files; use an empty directory")
    if len(files) > 1:
        train_files, val_files = data.split_files(files, val_fraction=val_fraction)
        splits = {"train": (train_files, None), "val": (val_files, None)}
    else:
        train_docs, val_docs = data.split_documents(files, val_fraction=val_fraction)
        splits = {"train": (files, train_docs), "val": (files, val_docs)}
    if tokenizer is not None:
        tok = tokenization.load_tokenizer(tokenizer)
    else:  # the BPE needs the whole train split at once
        train_files, train_docs = splits["train"]
        tok = tokenization.train_bpe(train_docs or data.read_documents(train_files),
                                     vocab_size)
    vocab = tokenization.vocab_size(tok)
    dtype = formats.token_dtype(vocab)
    summary = {"tokenizer_vocab_size": vocab, "files": len(files)}
    for split, (split_files, docs) in splits.items():
        writer = _ShardWriter(out, split, shard_tokens)
        size = sum(f.stat().st_size for f in split_files) if docs is None else sum(map(len, docs))
        bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"{split} ({len(split_files)} "
                   "files)", disable=not progress)
        for group in _groups(_file_documents(split_files) if docs is None else docs):
            writer.add(tokenization.encode_documents(tok, group, dtype))
            bar.update(sum(len(d.encode()) for d in group))
        bar.close()
        paths = writer.close()
        summary[split] = {"tokens": writer.total, "shards": [p.name for p in paths]}
    tok.save(str(out / "tokenizer.json"))
    (out / "prepare.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="prepare.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("sources", nargs="+", metavar="SOURCE",
                        help="text or .jsonl files, directories or globs")
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
