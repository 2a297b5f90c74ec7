"""The example LM's data: corpus listing and split and the token cache (tools/prepare.py), the
BPE (tools/tokenizer.py), token shards and their validation, and the batch sampler (data.py)."""

import os
import struct
from pathlib import Path

import numpy as np
import pytest
from _lm_fixtures import JSON_PACKAGE, copy_json_package

from examples.lm import data
from examples.lm.tools import prepare as corpus_lib
from examples.lm.tools import tokenizer as tokenization

VOCAB = 320


@pytest.fixture
def corpus(tmp_path) -> Path:
    return copy_json_package(tmp_path / "corpus")


@pytest.fixture
def counted_training(monkeypatch) -> list:
    """Record each BPE training (what prepare_tokens does on a cache miss)."""
    calls, train = [], tokenization.train_bpe

    def counting(texts, vocab_size):
        calls.append(vocab_size)
        return train(texts, vocab_size)

    monkeypatch.setattr(tokenization, "train_bpe", counting)
    return calls


def _cache_dir(workdir: Path, vocab_size: int) -> Path:
    (cache,) = (workdir / "tokens").glob(f"*-v{vocab_size}-*")
    return cache


def _decode_documents(tokens, cache: Path) -> list[str]:
    """Token stream -> documents, with the cached tokenizer (EOS closes every document)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(cache / "tokenizer.json"))
    eos = tokenizer.token_to_id(tokenization.EOS)
    ids = np.asarray(tokens)
    assert ids[-1] == eos
    ends = np.flatnonzero(ids == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(ids[s:e].tolist()) for s, e in zip(starts, ends, strict=True)]


# --------------------------------------------------------------------------- corpus and split


def test_stdlib_source_files_are_sorted_library_sources_without_tests():
    files = corpus_lib.stdlib_source_files()
    assert files == sorted(files) and len(set(files)) == len(files)
    assert all(f.suffix == ".py" and f.is_file() for f in files)
    assert JSON_PACKAGE / "decoder.py" in files
    for f in files:
        assert not {"test", "tests", "idle_test", "site-packages"} & set(f.parts), f
        assert not f.name.startswith("test_"), f
    assert sum(f.stat().st_size for f in files) > 2**20  # the library, not a stub of it


def test_split_files_is_deterministic_disjoint_and_complete(rng):
    files = corpus_lib.stdlib_source_files()
    train, val = corpus_lib.split_files(files, val_fraction=0.05)
    shuffled = [files[i] for i in rng.permutation(len(files))]
    assert corpus_lib.split_files(shuffled, val_fraction=0.05) == (train, val)  # order-independent
    assert not set(train) & set(val) and sorted(train + val) == files
    assert len(val) == round(0.05 * len(files))
    assert len({f.parent for f in val}) > 1  # spread over the library, not one package
    assert corpus_lib.split_files(files[:2], val_fraction=0.05) == ([files[0]], [files[1]])
    with pytest.raises(ValueError, match="at least 2 files"):
        corpus_lib.split_files(files[:1])
    with pytest.raises(ValueError, match="val_fraction"):
        corpus_lib.split_files(files, val_fraction=1.0)


# --------------------------------------------------------------------------- tokenizer + cache


def test_text_directory_is_tokenized_losslessly_by_file(corpus, tmp_path):
    splits = data.prepare_tokens(source=corpus, workdir=tmp_path / "work", vocab_size=VOCAB)
    assert splits.vocab_size == VOCAB
    for tokens in (splits.train, splits.val):
        assert tokens.dtype == np.uint16 and tokens.ndim == 1
        assert 0 <= tokens.min() and tokens.max() < VOCAB
    train_files, val_files = corpus_lib.split_files(sorted(corpus.glob("*.py")))
    cache = _cache_dir(tmp_path / "work", VOCAB)
    assert _decode_documents(splits.train, cache) == [f.read_text() for f in train_files]
    assert _decode_documents(splits.val, cache) == [f.read_text() for f in val_files]
    chars = sum(f.stat().st_size for f in train_files)
    assert chars / len(splits.train) > 1.4  # 63 merges already compress (1 byte per token without)


def test_cache_is_reused_and_invalidated(corpus, tmp_path, counted_training):
    work = tmp_path / "work"
    first = data.prepare_tokens(source=corpus, workdir=work, vocab_size=VOCAB)
    again = data.prepare_tokens(source=corpus, workdir=work, vocab_size=VOCAB)
    assert counted_training == [VOCAB]  # not retrained
    np.testing.assert_array_equal(again.train, first.train)

    other = data.prepare_tokens(source=corpus, workdir=work, vocab_size=VOCAB + 64)
    other_train = np.array(other.train)  # a copy: the memmap would fault once the file is cut
    del other
    assert counted_training == [VOCAB, VOCAB + 64]  # the vocabulary size is part of the key
    assert other_train.max() >= VOCAB  # it did use the larger vocabulary
    data.prepare_tokens(source=corpus, workdir=work, vocab_size=VOCAB)
    assert len(counted_training) == 2  # the first cache is still valid

    cache = _cache_dir(work, VOCAB + 64)  # damage a cache: it is rebuilt, not trusted
    with open(cache / "train_000000.bin", "r+b") as f:
        f.truncate(100)
    rebuilt = data.prepare_tokens(source=corpus, workdir=work, vocab_size=VOCAB + 64)
    assert len(counted_training) == 3
    np.testing.assert_array_equal(rebuilt.train, other_train)  # training is deterministic

    with open(corpus / "tool.py", "a") as f:  # an edited source file
        f.write("# one more line\n")
    edited = data.prepare_tokens(source=corpus, workdir=work, vocab_size=VOCAB)
    assert len(counted_training) == 4
    assert len(edited.train) + len(edited.val) > len(first.train) + len(first.val)


def test_single_text_file_is_split_by_lines(corpus, tmp_path):
    text = (corpus / "decoder.py").read_text()
    splits = data.prepare_tokens(source=corpus / "decoder.py", workdir=tmp_path / "w",
                                 vocab_size=VOCAB, val_fraction=0.1)
    cache = _cache_dir(tmp_path / "w", VOCAB)
    (train,), (val,) = _decode_documents(splits.train, cache), _decode_documents(splits.val, cache)
    assert train + val == text
    lines = text.splitlines(keepends=True)
    assert val == "".join(lines[-round(0.1 * len(lines)):])


def test_text_source_errors_name_the_file(corpus, tmp_path):
    (corpus / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8"):
        data.prepare_tokens(source=corpus, workdir=tmp_path / "w", vocab_size=VOCAB)
    with pytest.raises(ValueError, match="does not exist"):
        data.prepare_tokens(source=tmp_path / "missing", workdir=tmp_path / "w", vocab_size=VOCAB)
    with pytest.raises(ValueError, match="at least 257"):
        tokenization.train_bpe(["abc"], 100)


def test_work_directory_inside_the_source_is_not_corpus(corpus, counted_training):
    first = data.prepare_tokens(source=corpus, workdir=corpus / "work", vocab_size=VOCAB)
    second = data.prepare_tokens(source=corpus, workdir=corpus / "work", vocab_size=VOCAB)
    assert len(counted_training) == 1  # its own cache files did not change the fingerprint
    np.testing.assert_array_equal(first.val, second.val)


def test_the_data_identity_follows_the_text_not_the_cache(corpus, tmp_path):
    """What a checkpoint records of its data (`TokenSplits.identity`): the same text tokenized
    again into a fresh cache is the same data; an edited file is other data (a new BPE)."""
    first = data.prepare_tokens(source=corpus, workdir=tmp_path / "a", vocab_size=VOCAB)
    again = data.prepare_tokens(source=corpus, workdir=tmp_path / "b", vocab_size=VOCAB)
    assert first.identity() == again.identity()
    assert first.identity().startswith(f"text, {len(first.train):,} train / ")
    assert "tokenizer sha256 " in first.identity()
    edited = sorted(corpus.rglob("*.py"))[0]
    edited.write_text(edited.read_text() + "\n# one more line of text\n")
    assert data.prepare_tokens(source=corpus, workdir=tmp_path / "a",
                               vocab_size=VOCAB).identity() != first.identity()


# --------------------------------------------------------------------------- shards


@pytest.mark.parametrize("high, dtype", [(65535, np.uint16), (70000, np.uint32)])
def test_shard_round_trip(tmp_path, rng, high, dtype):
    tokens = rng.integers(0, high + 1, size=1001)
    tokens[0] = high
    path = corpus_lib.write_shard(tmp_path / "train.bin", tokens)
    shard = data.open_shard(path)[1]
    assert isinstance(shard, np.memmap) and shard.dtype == dtype and not shard.flags.writeable
    np.testing.assert_array_equal(shard, tokens)
    assert path.stat().st_size == 32 + tokens.size * np.dtype(dtype).itemsize
    assert [p.name for p in tmp_path.iterdir()] == ["train.bin"]  # no temporary left behind


def _corrupt(path: Path, how: str) -> str:
    raw = bytearray(path.read_bytes())
    if how == "truncated header":
        path.write_bytes(raw[:20])
        return "truncated"
    if how == "wrong magic":
        raw[:8] = b"NOTTOKEN"
        path.write_bytes(raw)
        return "is not a known token file"
    if how == "wrong dtype code":
        raw[12:16] = struct.pack("<I", 7)
        path.write_bytes(raw)
        return "dtype code 7"
    if how == "wrong version":
        raw[8:12] = struct.pack("<I", 2)
        path.write_bytes(raw)
        return "version 2"
    if how == "truncated tokens":
        path.write_bytes(raw[:-3])
        return "header says 100 uint16 tokens"
    if how == "trailing bytes":
        path.write_bytes(raw + b"\0\0")
        return "header says 100 uint16 tokens"
    if how == "wrong length field":
        raw[16:24] = struct.pack("<Q", 101)
        path.write_bytes(raw)
        return "header says 101 uint16 tokens"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["truncated header", "wrong magic", "wrong dtype code",
                                 "wrong version", "truncated tokens", "trailing bytes",
                                 "wrong length field"])
def test_corrupt_shards_raise_a_clear_error_naming_the_file(tmp_path, how):
    path = corpus_lib.write_shard(tmp_path / "val_000.bin", np.arange(100))
    reason = _corrupt(path, how)
    with pytest.raises(ValueError, match="val_000.bin") as error:
        data.open_shard(path)
    assert reason in str(error.value)


def test_write_shard_rejects_what_it_cannot_store(tmp_path):
    for bad in (np.array([1, -1]), np.zeros((2, 2), int), np.array([0.5]), np.array([], int),
                np.array([2**32])):
        with pytest.raises(ValueError, match="write_shard"):
            corpus_lib.write_shard(tmp_path / "x.bin", bad)


def test_shard_directory_is_memory_mapped_and_validated(tmp_path, rng):
    parts = [rng.integers(0, 1000, size=n) for n in (50, 7, 80)]
    for i, part in enumerate(parts):
        corpus_lib.write_shard(tmp_path / f"train_{i:03d}.bin", part)
    corpus_lib.write_shard(tmp_path / "val_000.bin", np.arange(40))
    splits = data.prepare_tokens(source=tmp_path, workdir=tmp_path / "w", vocab_size=1000)
    assert splits.format == "rowgeom" and isinstance(splits.val, np.memmap)
    assert isinstance(splits.train, data.ShardedTokens) and len(splits.train) == 137
    whole = np.concatenate(parts)
    np.testing.assert_array_equal(np.asarray(splits.train), whole)
    for a, b in [(0, 137), (45, 60), (50, 57), (55, 100), (136, 200), (10, 10)]:
        np.testing.assert_array_equal(splits.train[a:b], whole[a:b])
    assert not (tmp_path / "w").exists()  # no tokenizer, no cache

    with pytest.raises(ValueError, match=r"train_\d+\.bin holds token id \d+, not below the "
                                         r"vocabulary size \d+: .*--data.tokenizer"):
        data.prepare_tokens(source=tmp_path, workdir=tmp_path / "w", vocab_size=int(whole.max()))
    os.remove(tmp_path / "val_000.bin")
    with pytest.raises(ValueError, match=r"no val token file"):
        data.prepare_tokens(source=tmp_path, workdir=tmp_path / "w", vocab_size=1000)


# --------------------------------------------------------------------------- batches


def test_batch_sampler_is_a_pure_function_of_seed_and_index():
    tokens = np.arange(10_000, dtype=np.uint16)
    sampler = data.BatchSampler(tokens, batch_size=8, seq_len=16, seed=3)
    inputs, targets = sampler.get(5)
    assert inputs.shape == targets.shape == (8, 16)
    assert inputs.dtype == targets.dtype == np.int32
    # arange tokens: every row is an aligned window, and targets are inputs shifted by one.
    np.testing.assert_array_equal(np.diff(inputs, axis=1), 1)
    np.testing.assert_array_equal(inputs[:, 0] % 16, 0)
    np.testing.assert_array_equal(targets, inputs + 1)
    assert inputs.min() >= 0 and targets.max() <= 9_999
    fresh = data.BatchSampler(tokens, batch_size=8, seq_len=16, seed=3)
    np.testing.assert_array_equal(fresh.get(5)[0], inputs)  # resuming replays the same batch
    assert not np.array_equal(sampler.get(6)[0], inputs)
    assert not np.array_equal(data.BatchSampler(tokens, batch_size=8, seq_len=16,
                                                seed=4).get(5)[0], inputs)


def test_process_shares_partition_the_global_batch(rng):
    tokens = rng.integers(0, 500, size=5_000).astype(np.uint16)
    full = data.BatchSampler(tokens, batch_size=12, seq_len=8, seed=0).get(2)
    shares = [data.BatchSampler(tokens, batch_size=12, seq_len=8, seed=0,
                                rows=(4 * i, 4 * i + 4)).get(2) for i in range(3)]
    assert all(s[0].shape == (4, 8) for s in shares)
    for k in (0, 1):
        np.testing.assert_array_equal(np.concatenate([s[k] for s in shares]), full[k])


def _epoch_reference(lengths, *, batch, seq_len):
    """Every update-sized group of aligned windows the paper's loader reads in one epoch, as
    (file, first token of each window) tuples, found by brute force from the file lengths."""
    groups = []
    for f, n in enumerate(lengths):
        starts = list(range(0, n - seq_len, seq_len))  # each window needs seq_len + 1 tokens
        for g in range(len(starts) // batch):
            groups.append(tuple((f, s) for s in starts[g * batch: (g + 1) * batch]))
    return groups


@pytest.mark.parametrize("shuffle", ["batches", "sequences"])
def test_an_epoch_reads_each_file_in_whole_groups_once_in_a_shuffled_order(tmp_path, shuffle):
    """Aligned windows that never cross files, each at most once per epoch, each update's from
    one file and a file's updates one after the other, the orders shuffled anew each epoch.
    "batches" (the paper's loader) reads exactly each file's whole groups of consecutive
    windows (brute-force reference); "sequences" reads as many windows of each file, any."""
    lengths, batch, seq_len = (61, 5, 200, 130), 3, 7
    offsets = np.cumsum((0, *lengths))  # token t of file f holds the id offsets[f] + t
    shards = [data.open_shard(corpus_lib.write_shard(
        tmp_path / f"t{f}.bin", np.arange(offsets[f], offsets[f] + n)))[1] for f, n in
        enumerate(lengths)]
    sampler = data.BatchSampler(data.ShardedTokens(shards), batch_size=batch, seq_len=seq_len,
                                seed=1, shuffle=shuffle)
    reference = _epoch_reference(lengths, batch=batch, seq_len=seq_len)
    assert sampler.updates_per_epoch == len(reference) == 2 + 0 + 9 + 6

    def group(update):
        inputs, targets = sampler.get(update)
        np.testing.assert_array_equal(targets, inputs + 1)  # never across a file's end
        file = np.searchsorted(offsets, inputs[:, 0], side="right") - 1
        assert len(set(file)) == 1 and np.all(inputs[:, -1] + 1 < offsets[file + 1])
        return tuple((int(f), int(i - offsets[f])) for f, i in zip(file, inputs[:, 0], strict=True))

    epochs = [[group(e * len(reference) + u) for u in range(len(reference))] for e in range(6)]
    orders = set()
    for epoch in epochs:
        if shuffle == "batches":
            assert sorted(epoch) == sorted(reference)  # each group exactly once
        windows = [w for g in epoch for w in g]
        assert len(set(windows)) == len(windows) == len(reference) * batch  # none twice
        assert all(start % seq_len == 0 for _, start in windows)
        files = [g[0][0] for g in epoch]  # a file's updates one after the other
        runs = [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]
        assert sorted(runs) == [0, 2, 3]
        orders.add(tuple(runs))
        assert sorted(files) == sorted(g[0][0] for g in reference)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != reference
    assert len(orders) > 1  # the file order too is shuffled anew
    consecutive = all(np.all(np.diff([w[1] for w in g]) == seq_len) for e in epochs for g in e)
    assert consecutive == (shuffle == "batches")


@pytest.mark.parametrize("shuffle", ["batches", "sequences"])
def test_the_sequences_of_an_update_do_not_depend_on_the_accumulation_split(rng, shuffle):
    """Update u reads one group: its micro-batches split it, whatever the split and the number
    of processes (so a run with more accumulation steps, or more hosts, sees the same data)."""
    tokens = rng.integers(0, 500, size=20_000).astype(np.uint16)
    kw = dict(seq_len=10, seed=2, shuffle=shuffle)
    whole = data.BatchSampler(tokens, batch_size=8, **kw)
    for update in (0, 7, whole.updates_per_epoch + 3):
        want = whole.get(update)[0]
        split = data.BatchSampler(tokens, batch_size=2, grad_accum_steps=4, **kw)
        got = np.concatenate([split.get(update * 4 + m)[0] for m in range(4)])
        np.testing.assert_array_equal(got, want)
        hosts = [data.BatchSampler(tokens, batch_size=4, grad_accum_steps=2,
                                   rows=(2 * p, 2 * p + 2), **kw) for p in range(2)]
        got = np.concatenate([h.get(update * 2 + m)[0] for m in range(2) for h in hosts])
        np.testing.assert_array_equal(got, want)


def test_batch_sampler_validation():
    tokens = np.arange(100)
    with pytest.raises(ValueError, match=r"rows must be \[lo, hi\) with 0 <= lo < hi <= "
                                         r"batch_size 6, got \(4, 8\)"):
        data.BatchSampler(tokens, batch_size=6, seq_len=4, seed=0, rows=(4, 8))
    with pytest.raises(ValueError, match="rows must be"):
        data.BatchSampler(tokens, batch_size=4, seq_len=4, seed=0, rows=(2, 2))
    with pytest.raises(ValueError, match=r"no training file holds one update's batch_size x "
                       r"grad_accum_steps x seq_len \+ 1 = 193 tokens \(the largest has 100\)"):
        data.BatchSampler(tokens, batch_size=4, seq_len=16, seed=0, grad_accum_steps=3)
    with pytest.raises(ValueError, match="grad_accum_steps must be >= 1"):
        data.BatchSampler(tokens, batch_size=4, seq_len=8, seed=0, grad_accum_steps=0)
    with pytest.raises(ValueError, match="shuffle must be 'sequences' or 'batches', got 'docs'"):
        data.BatchSampler(tokens, batch_size=4, seq_len=8, seed=0, shuffle="docs")


def test_default_source_is_the_standard_library(tmp_path, monkeypatch):
    # The full library takes seconds to tokenize; the code path is the same for a part of it.
    files = [f for f in corpus_lib.stdlib_source_files() if f.parent == JSON_PACKAGE]
    monkeypatch.setattr(corpus_lib, "stdlib_source_files", lambda: files)
    splits = data.prepare_tokens(workdir=tmp_path, vocab_size=VOCAB)
    cache = _cache_dir(tmp_path, VOCAB)
    assert cache.name.startswith("stdlib-")
    train, val = corpus_lib.split_files(files)
    assert _decode_documents(splits.val, cache) == [f.read_text() for f in val]
    assert len(_decode_documents(splits.train, cache)) == len(train)
