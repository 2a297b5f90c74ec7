"""Commands beside the trainer: the ahead-of-time compile report (`plan`, `topology`,
`compiled`), the paper's run launcher (`paper_runs`), the text-to-shards converter (`prepare`)
and the byte-level BPE (`tokenizer`). Training imports only the last two, for a text source (the
default: the standard library) or a `--data.tokenizer`."""
