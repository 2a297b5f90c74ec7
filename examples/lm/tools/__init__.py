"""Commands beside the trainer: the ahead-of-time compile report (`train_compile`, `topology`,
`compiled`), the paper's run launcher (`paper_runs`), the text-to-shards converter (`prepare`), the
byte-level BPE (`tokenizer`), the step timer (`benchmark`) and the metrics plot (`plot`). Training
imports `prepare` and `tokenizer` for a text source (the default: the standard library) or a
`--data.tokenizer`, `plot` at the end of a run and `benchmark` for `--benchmark N`."""
