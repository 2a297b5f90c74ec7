"""Token data in the layouts people already have (written by `_lm_fixtures.py` the way their
projects write them): llm.c / modded-nanogpt shards, nanoGPT `train.bin` / `val.bin`, a Hugging
Face `tokenizer.json`, jsonl documents, and the `prepare` command's shards read back through the
trainer's loader. None of these files is written with the example's own writer.
"""

import json
import os
import re

import numpy as np
import pytest
from _lm_fixtures import (
    JSON_PACKAGE,
    copy_json_package,
    make_tokenizer,
    write_llmc_shard,
    write_nanogpt_split,
)

from examples.lm import data, train
from examples.lm.tools import prepare

# --------------------------------------------------------------------------- llm.c


def test_a_files_largest_id_is_scanned_once_and_again_when_the_file_changes(tmp_path,
                                                                          monkeypatch):
    """llm.c and nanoGPT headers hold no largest id: the first opening scans every token, the
    next ones (a relaunch, another run) read it from the cache; a rewritten file is scanned
    again, so an id that no longer fits is still caught."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "fineweb_train_000001.bin"
    write_llmc_shard(path, np.arange(1000) % 50257)
    assert data.open_shard(path)[2] == 999
    cached = json.loads((tmp_path / "cache" / "rowgeom" / "largest-token-ids.json").read_text())
    assert list(cached.values()) == [999]
    scans = []
    real = np.memmap.max
    monkeypatch.setattr(np.memmap, "max", lambda self, *a, **k: scans.append(1) or real(
        self, *a, **k))
    assert data.open_shard(path)[2] == 999 and scans == []  # read from the cache
    before = path.stat().st_mtime_ns
    write_llmc_shard(path, np.full(1000, 50300))  # the same size, another mtime
    os.utime(path, ns=(before + 10**9, before + 10**9))  # whatever the clock's granularity
    assert data.open_shard(path)[2] == 50300 and scans == [1]
    gone = tmp_path / "gone_train.bin"
    write_llmc_shard(gone, np.arange(10))
    data.open_shard(gone)
    gone.unlink()
    data.open_shard(tmp_path / "fineweb_train_000001.bin")  # known: nothing written
    write_llmc_shard(path, np.arange(5))
    data.open_shard(path)  # its new entry replaces its old one, and the gone file's goes
    cached = json.loads((tmp_path / "cache" / "rowgeom" / "largest-token-ids.json").read_text())
    assert [k.rsplit(":", 2)[0] for k in cached] == [str(path.resolve())]
    assert list(cached.values()) == [4]


@pytest.mark.parametrize("as_glob", [False, True])
def test_llmc_shards_by_directory_or_glob(tmp_path, rng, as_glob):
    parts = {name: rng.integers(0, 50257, size=n) for name, n in
             (("fineweb_train_000001.bin", 300), ("fineweb_train_000002.bin", 120),
              ("fineweb_val_000000.bin", 90))}
    for name, tokens in parts.items():
        write_llmc_shard(tmp_path / name, tokens)
    (tmp_path / "README.md").write_text("not a shard")  # other files are ignored
    source = str(tmp_path / "fineweb_*.bin") if as_glob else str(tmp_path)
    splits = data.prepare_tokens(source=source, workdir=tmp_path / "w", vocab_size=50304)
    assert splits.format == "llmc" and splits.vocab_size == 50304
    np.testing.assert_array_equal(
        np.asarray(splits.train), np.concatenate([parts["fineweb_train_000001.bin"],
                                                  parts["fineweb_train_000002.bin"]]))
    np.testing.assert_array_equal(np.asarray(splits.val), parts["fineweb_val_000000.bin"])
    # A window across the shard boundary reads both files.
    np.testing.assert_array_equal(splits.train[295:305], np.asarray(splits.train)[295:305])


def test_llmc_llama3_shards_hold_uint32_ids_and_do_not_mix_with_gpt2_ones(tmp_path, rng):
    """llm.c's Llama 3 layout (magic 20240801, version 7, uint32): ids past uint16 read back
    exactly; a source that mixes it with GPT-2 shards (another tokenizer) is refused."""
    train, val = rng.integers(0, 128256, size=400), rng.integers(0, 128256, size=90)
    train[7] = 128255  # Llama 3's largest id, beyond uint16
    write_llmc_shard(tmp_path / "edu_fineweb_train_000001.bin", train, "llama-3")
    write_llmc_shard(tmp_path / "edu_fineweb_val_000000.bin", val, "llama-3")
    splits = data.prepare_tokens(source=tmp_path, workdir=tmp_path / "w", vocab_size=128256)
    assert splits.format == "llmc-llama3"
    np.testing.assert_array_equal(np.asarray(splits.train), train)
    np.testing.assert_array_equal(np.asarray(splits.val), val)
    with pytest.raises(ValueError, match=r"holds token id 128255, not below the vocabulary "
                                         r"size 50304"):
        data.prepare_tokens(source=tmp_path, workdir=tmp_path / "w", vocab_size=50304)
    write_llmc_shard(tmp_path / "edu_fineweb_train_000002.bin", train[:100] % 50257)  # GPT-2
    with pytest.raises(ValueError, match=r"mixes token file layouts \['llmc', 'llmc-llama3'\]"):
        data.prepare_tokens(source=tmp_path, workdir=tmp_path / "w", vocab_size=128256)


def test_llmc_header_errors_name_the_file(tmp_path):
    write_llmc_shard(tmp_path / "x_train_0.bin", np.arange(100))
    write_llmc_shard(tmp_path / "x_val_0.bin", np.arange(100))
    raw = bytearray((tmp_path / "x_val_0.bin").read_bytes())
    (tmp_path / "x_val_0.bin").write_bytes(raw[:-6])
    with pytest.raises(ValueError, match=r"x_val_0\.bin: header says 100 uint16 tokens"):
        data.prepare_tokens(source=tmp_path, workdir=tmp_path / "w", vocab_size=512)
    raw[4:8] = np.int32(2).tobytes()  # version 2 stores uint32 tokens
    (tmp_path / "x_val_0.bin").write_bytes(raw)
    with pytest.raises(ValueError, match=r"x_val_0\.bin has version 2"):
        data.prepare_tokens(source=tmp_path, workdir=tmp_path / "w", vocab_size=512)


def test_split_by_name_and_unknown_files(tmp_path):
    write_llmc_shard(tmp_path / "data_train_0.bin", np.arange(100))
    with pytest.raises(ValueError, match=r"no val token file.*\*train\* and \*val\*"):
        data.prepare_tokens(source=tmp_path, workdir=tmp_path / "w", vocab_size=512)
    write_llmc_shard(tmp_path / "extra.bin", np.arange(100))
    with pytest.raises(ValueError, match=r"extra\.bin: cannot tell its split"):
        data.prepare_tokens(source=tmp_path, workdir=tmp_path / "w", vocab_size=512)
    (tmp_path / "extra.bin").unlink()
    (tmp_path / "data_val_0.bin").write_bytes(b"\x01\x02" * 50)  # raw, but not nanoGPT's name
    with pytest.raises(ValueError, match=r"data_val_0\.bin is not a known token file"):
        data.prepare_tokens(source=tmp_path, workdir=tmp_path / "w", vocab_size=512)
    prepare.write_shard(tmp_path / "data_val_0.bin", np.arange(50))
    with pytest.raises(ValueError, match=r"mixes token file layouts \['llmc', 'rowgeom'\]"):
        data.prepare_tokens(source=tmp_path, workdir=tmp_path / "w", vocab_size=512)


def test_out_of_vocabulary_ids_stop_the_run_when_the_shard_is_opened(tmp_path):
    write_llmc_shard(tmp_path / "d_train_0.bin", np.arange(200))
    tokens = np.zeros(200, dtype=np.int64)
    tokens[150] = 700
    write_llmc_shard(tmp_path / "d_train_1.bin", tokens)
    write_llmc_shard(tmp_path / "d_val_0.bin", np.arange(100))
    with pytest.raises(ValueError, match=r"d_train_1\.bin holds token id 700, not below the "
                                         r"vocabulary size 512: .*--model.vocab_size 701"):
        data.prepare_tokens(source=tmp_path, workdir=tmp_path / "w", vocab_size=512)


def test_out_of_vocabulary_nanogpt_shard_is_a_usage_error_before_training(tmp_path, capsys):
    """The command line stops before the first step with one line naming the file, the largest
    id, the vocabulary and the fix (the test config's vocabulary is 512)."""
    write_nanogpt_split(tmp_path / "train.bin", np.arange(1000) % 600)
    write_nanogpt_split(tmp_path / "val.bin", np.arange(300))
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--config", "test", "--workdir", str(tmp_path / "w"), "--no-progress",
                    "--data.source", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train.py: error: "), err
    assert "train.bin holds token id 599, not below the vocabulary size 512" in err
    assert "--data.tokenizer" in err and "--model.vocab_size 600" in err
    assert not (tmp_path / "w" / "metrics.jsonl").exists()


# --------------------------------------------------------------------------- nanoGPT


def test_nanogpt_train_and_val_bin(tmp_path, rng):
    train, val = rng.integers(0, 50257, size=1000), rng.integers(0, 50257, size=101)
    write_nanogpt_split(tmp_path / "train.bin", train)
    write_nanogpt_split(tmp_path / "val.bin", val)
    splits = data.prepare_tokens(source=tmp_path, workdir=tmp_path / "w", vocab_size=50304)
    assert splits.format == "nanogpt"
    np.testing.assert_array_equal(np.asarray(splits.train), train)
    np.testing.assert_array_equal(np.asarray(splits.val), val)
    (tmp_path / "val.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match=r"val\.bin: header says 3 uint16 tokens .* file has 7"):
        data.prepare_tokens(source=tmp_path, workdir=tmp_path / "w", vocab_size=50304)


# --------------------------------------------------------------------------- validation set


def test_validation_set_is_the_start_of_the_split_whatever_the_seed():
    tokens = np.arange(1000, dtype=np.uint16)
    val = data.ValidationSet(tokens, batch_size=4, seq_len=10, eval_tokens=100)
    assert (val.num_batches, val.num_tokens) == (2, 80)  # whole batches of 40 tokens
    inputs = np.concatenate([val.get(i)[0] for i in range(val.num_batches)])
    targets = np.concatenate([val.get(i)[1] for i in range(val.num_batches)])
    np.testing.assert_array_equal(inputs.ravel(), np.arange(80))  # consecutive, no overlap
    np.testing.assert_array_equal(targets, inputs + 1)
    halves = [data.ValidationSet(tokens, batch_size=4, seq_len=10, eval_tokens=100,
                                 rows=(2 * i, 2 * i + 2)).get(1) for i in range(2)]
    np.testing.assert_array_equal(np.concatenate([h[0] for h in halves]), val.get(1)[0])
    assert data.ValidationSet(tokens, batch_size=4, seq_len=10, eval_tokens=10**9).num_batches \
        == 24  # capped by the split: (1000 - 1) // 40
    with pytest.raises(ValueError, match="fewer than one batch of batch_size x seq_len"):
        data.ValidationSet(tokens[:40], batch_size=4, seq_len=10, eval_tokens=100)


# --------------------------------------------------------------------------- text, jsonl, tokenizer


def _jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))


def test_pretrained_tokenizer_encodes_text_and_jsonl(tmp_path):
    texts = [f.read_text() for f in sorted(JSON_PACKAGE.glob("*.py"))]
    tok = make_tokenizer(tmp_path / "tokenizer.json", texts)
    eos = tok.token_to_id("<|endoftext|>")
    _jsonl(tmp_path / "docs.jsonl", texts)
    splits = data.prepare_tokens(source=tmp_path / "docs.jsonl", workdir=tmp_path / "w",
                                 vocab_size=4096, tokenizer=tmp_path / "tokenizer.json")
    assert splits.vocab_size == tok.get_vocab_size() == 300
    # One jsonl record per document: the last record is the validation split.
    expected = tok.encode(texts[-1], add_special_tokens=False).ids + [eos]
    np.testing.assert_array_equal(np.asarray(splits.val), expected)
    assert np.asarray(splits.train).tolist().count(eos) == len(texts) - 1

    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(ValueError, match=r'bad\.jsonl:2: .*string "text" field'):
        data.prepare_tokens(source=tmp_path / "bad.jsonl", workdir=tmp_path / "w",
                            vocab_size=4096, tokenizer=tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match=r"tokenizer .*missing\.json does not exist"):
        data.prepare_tokens(source=tmp_path / "docs.jsonl", workdir=tmp_path / "w",
                            vocab_size=4096, tokenizer=tmp_path / "missing.json")
    # A directory save_pretrained wrote names the tokenizer.json in it.
    saved = tmp_path / "saved"
    saved.mkdir()
    with pytest.raises(ValueError, match=r"tokenizer directory .*saved has no tokenizer\.json"):
        data.prepare_tokens(source=tmp_path / "docs.jsonl", workdir=tmp_path / "w",
                            vocab_size=4096, tokenizer=saved)
    (saved / "tokenizer.json").write_bytes((tmp_path / "tokenizer.json").read_bytes())
    by_directory = data.prepare_tokens(source=tmp_path / "docs.jsonl", workdir=tmp_path / "w",
                                       vocab_size=4096, tokenizer=saved)
    np.testing.assert_array_equal(np.asarray(by_directory.val), expected)


def test_json_datasets_and_compressed_files_read_as_their_records(tmp_path):
    """The same documents as .jsonl, as .json holding JSON Lines (`datasets`' to_json) or an
    array of {"text": ...} objects, and gzip-, bzip2- and xz-compressed: the same tokens, never
    the JSON syntax itself. A .json that is no such dataset stays a text document; zstd is an
    error saying what to do."""
    import bz2
    import gzip
    import lzma

    texts = [f.read_text() for f in sorted(JSON_PACKAGE.glob("*.py"))]
    make_tokenizer(tmp_path / "tokenizer.json", texts)
    lines = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts))
    sources = {"docs.jsonl": lines.encode(), "lines.json": lines.encode(),
               "array.json": json.dumps([{"text": t} for t in texts]).encode(),
               "c4.json.gz": gzip.compress(lines.encode()),
               "docs.jsonl.bz2": bz2.compress(lines.encode()),
               "docs.jsonl.xz": lzma.compress(lines.encode())}
    read = {}
    for name, raw in sources.items():
        (tmp_path / name).write_bytes(raw)
        splits = data.prepare_tokens(source=tmp_path / name, workdir=tmp_path / "w",
                                     vocab_size=4096, tokenizer=tmp_path / "tokenizer.json")
        read[name] = (np.asarray(splits.train).tolist(), np.asarray(splits.val).tolist())
    assert all(tokens == read["docs.jsonl"] for tokens in read.values()), list(read)
    (tmp_path / "PAR1.txt").write_text("PAR1: a text that starts like a Parquet file\n" * 3)
    assert prepare.read_documents([tmp_path / "PAR1.txt"]) == [(tmp_path / "PAR1.txt").read_text()]
    config = tmp_path / "package.json"  # a text document that happens to be JSON
    config.write_text('{"name": "x",\n "version": "1.0"}\n')
    assert prepare.read_documents([config]) == [config.read_text()]
    binary = {"pile.jsonl.zst": (b"\x28\xb5\x2f\xfd", "is zstd-compressed: decompress it"),
              "train.parquet": (b"PAR1", "is a Parquet file: export its text to .jsonl"),
              "data-00000-of-00001.arrow": (b"\xff\xff\xff\xff", "is an Arrow stream"),
              "ids.npy": (b"\x93NUMPY", "is a NumPy .npy array: write its token ids as")}
    for name, (magic, message) in binary.items():
        (tmp_path / name).write_bytes(magic + b"\xfe" * 20)  # binary: never UTF-8
        with pytest.raises(ValueError, match=re.escape(f"{name} {message}")):
            data.prepare_tokens(source=tmp_path / name, workdir=tmp_path / "w",
                                vocab_size=4096, tokenizer=tmp_path / "tokenizer.json")


def test_prepare_command_writes_shards_the_trainer_reads(tmp_path, capsys):
    corpus = copy_json_package(tmp_path / "corpus")
    texts = [f.read_text() for f in sorted(corpus.iterdir())]
    make_tokenizer(tmp_path / "tokenizer.json", texts)
    summary = prepare.main([str(corpus), "--out", str(tmp_path / "shards"), "--tokenizer",
                            str(tmp_path / "tokenizer.json"), "--shard_tokens", "4000",
                            "--no-progress"])
    assert len(summary["train"]["shards"]) > 1  # split into several shards
    splits = data.prepare_tokens(source=tmp_path / "shards", workdir=tmp_path / "w",
                                 vocab_size=300)
    assert splits.format == "rowgeom"
    # The same tokens as the trainer's own text pipeline with the same tokenizer.
    direct = data.prepare_tokens(source=corpus, workdir=tmp_path / "w", vocab_size=300,
                                 tokenizer=tmp_path / "tokenizer.json")
    np.testing.assert_array_equal(np.asarray(splits.train), np.asarray(direct.train))
    np.testing.assert_array_equal(np.asarray(splits.val), np.asarray(direct.val))
    assert (tmp_path / "shards" / "tokenizer.json").is_file()
    with pytest.raises(SystemExit) as exit_info:  # refuses to mix into existing shards
        prepare.main([str(corpus), "--out", str(tmp_path / "shards"), "--no-progress"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
