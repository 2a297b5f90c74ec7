"""Commands beside the trainer: the ahead-of-time compile report (`plan`, `topology`,
`compiled`), the paper's run launcher (`paper_runs`) and the text-to-shards converter
(`prepare`). Training never imports them."""
