"""Batches of the LM example: random training windows and the fixed validation set.

Both read 1-D token arrays (memory maps, `formats.ShardedTokens`) without loading them, are pure
functions of their arguments (so a resumed run replays the same data), and give each process only
its share of every global batch. Every id read is checked against the model's vocabulary.
"""

from __future__ import annotations

import numpy as np


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
