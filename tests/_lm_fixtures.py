"""Shared helpers of the example's tests (tests/test_lm_*.py, test_crash_resume.py,
test_determinism.py): corpora, token files in upstream layouts, the `test` config on a corpus,
and reading a run back.

The session fixtures `small_corpus` (about 30 small standard-library modules, optionally with a
prebuilt token cache), `lm_corpus` (one such corpus, tokenized, for the session),
`final_checkpoint` and `shared_trainers` live in conftest.py.

Upstream layouts, written the way their projects write them (never with the example's writer):

- llm.c / modded-nanogpt shards: `dev/data/data_common.py:write_datafile` in karpathy/llm.c
  (256 int32 header: magic 20240520, version 1, token count; then uint16 tokens).
- nanoGPT: `data/openwebtext/prepare.py` in karpathy/nanoGPT (`np.memmap(..., dtype=np.uint16,
  mode="w+")` into `train.bin` / `val.bin`, no header).
- A Hugging Face `tokenizer.json` trained and saved with `tokenizers`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np

from examples.lm import checkpointing, configs, metrics, train
from examples.lm import sharding as mesh_lib

# A small real corpus: the standard library's `json` package (5 files, ~50 KB) tokenizes in well
# under a second, where the whole standard library would take several.
JSON_PACKAGE = Path(json.__file__).parent


def copy_json_package(directory: Path) -> Path:
    """`directory` holding a copy of the `json` package's modules (a text-directory corpus)."""
    directory.mkdir(parents=True)
    for f in sorted(JSON_PACKAGE.glob("*.py")):
        shutil.copy(f, directory / f.name)
    return directory


def write_llmc_shard(path, tokens, model_desc="gpt-2"):
    """llm.c's write_datafile(filename, toks, model_desc) (dev/data/data_common.py)."""
    info = {"gpt-2": (20240520, 1, np.uint16), "llama-3": (20240801, 7, np.uint32)}[model_desc]
    header = np.zeros(256, dtype=np.int32)
    header[0] = info[0]
    header[1] = info[1]
    header[2] = len(tokens)
    toks_np = np.array(tokens, dtype=info[2])
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(toks_np.tobytes())


def write_nanogpt_split(path, tokens):
    """nanoGPT's prepare.py: a raw uint16 memmap, no header."""
    arr = np.memmap(path, dtype=np.uint16, mode="w+", shape=(len(tokens),))
    arr[:] = tokens
    arr.flush()
    del arr


def make_tokenizer(path, texts, vocab_size=300):
    """A byte-level BPE with an end-of-text token, saved as tokenizer.json by `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return tok


def config_on(root: Path, **changes) -> configs.Config:
    """The `test` config on `small_corpus(root)`'s corpus and token cache; `changes` by dotted
    path, with `__` for `.` (`eval__every=2`)."""
    return configs.override(configs.get_config("test"), {
        "data.source": str(root / "corpus"), "data.dir": str(root / "tokens"),
        **{k.replace("__", "."): v for k, v in changes.items()}})


# The 4-step run of test_bad_input.py, test_resume_fast.py and test_determinism.py, and
# test_lm_loop.py's reference without accumulation: checkpoints and evaluations at 2 and 4, the
# head probe on the last two steps (so the first step after a resume from 2 records the head
# step's diameter and the tracker's bracket). One config on `lm_corpus`, so that one pytest
# process builds (and compiles) its Trainer once (`shared_trainers`).
SHORT_RUN = {"steps": 4, "checkpoint__every": 2, "eval__every": 2, "eval__probe_last_steps": 2}


def short_run(root: Path, **changes) -> configs.Config:
    """`SHORT_RUN` on `root`'s corpus (`config_on`), with `changes`."""
    return config_on(root, **{**SHORT_RUN, **changes})


WALL_CLOCK_KEYS = ("tokens_per_sec", "sec_per_step", "mfu")  # train._Loop._throughput's


def deterministic_records(workdir) -> list[dict]:
    """metrics.jsonl without the wall-clock keys: what a rerun or a resumed run must reproduce
    exactly."""
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK_KEYS}
            for r in metrics.read_metrics(workdir)]


def restore_on_one_device(ckdir, step: int):
    """(state as host arrays, metadata) of checkpoint `step` in `ckdir`, restored onto the first
    device with the config saved in it."""
    ckpt = checkpointing.Checkpointer(ckdir)
    try:
        meta = ckpt.restore_meta(step)
        cfg = configs.from_dict(meta["config"])
        trainer = train.Trainer(cfg, mesh_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
        state, _ = ckpt.restore(step, trainer.abstract_state)
    finally:
        ckpt.close()
    return jax.device_get(state), meta
