"""Named training configurations for the example language model, and command-line overrides.

One flat `Config` dataclass holds the model fields (passed on to `model.ModelConfig`) and the
training fields. Every field can be overridden from the command line, either as `--set name=value`
or as `--name value`; the parser is generated from the dataclass fields, so a new field needs no
parser code.

Named configs:

- `test`: a few thousand parameters, for unit tests (seconds to compile and run).
- `cpu-tiny` (default): ~1.5M parameters; the default run takes about 5 minutes on 2 CPU cores.
- `cpu-small`: ~7.6M parameters (vocab 8192, d 256, 4 layers, seq 256): a longer CPU run.
- `190m`, `380m`, `640m`: the paper's model sizes for GPU/TPU (Muon backbone, bf16 compute,
  fp32 master weights and optimizer state, GPT-2 vocabulary size padded to 50304).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence

# The example passes the head rate explicitly (it needs the value for the head-step diagnostics),
# resolved by the library's own rule (rowgeom.lm_optimizer_hparams), never a copy of it.
import rowgeom

SCHEDULES = ("cosine", "wsd")
HEADS = ("rownorm", "adamw", "muon", "rownorm-rescaled")
# Heads trained by projected RowNorm (rowgeom.lm_optimizer(head="rownorm")); "rownorm-rescaled"
# rescales each direction to the whole diameter budget (head_rescale="exact").
ROWNORM_HEADS = ("rownorm", "rownorm-rescaled")
DTYPES = ("float32", "bfloat16", "float16")
# Fields whose values are checked against a fixed set (shown by --help).
CHOICES = {"head": HEADS, "schedule": SCHEDULES, "compute_dtype": DTYPES, "param_dtype": DTYPES}
# The padded vocabulary of a --tokenizer run is a multiple of this (lane- and shard-friendly).
VOCAB_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a training run needs. Learning rates are peak values of the schedule."""

    # Model (see examples/lm/model.py:ModelConfig).
    vocab_size: int = 4096
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    mlp_dim: int = 384
    seq_len: int = 128
    tied_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    compute_dtype: str = "float32"
    param_dtype: str = "float32"

    # Data. `data_source` None: the interpreter's standard library; else token files (a directory
    # or glob of llm.c / rowgeom shards, a nanoGPT directory) or text / jsonl (see data.py).
    data_source: str | None = None
    data_dir: str | None = None  # tokenizer / token cache; None -> WORKDIR/data
    # A Hugging Face tokenizer.json: the vocabulary follows it, padded up to a multiple of 128.
    tokenizer: str | None = None
    # Rows >= valid_vocab_size of the head and embedding are padding: zero, never predicted, and
    # masked out of the RowNorm head. Set from --tokenizer; None: every row is a token.
    valid_vocab_size: int | None = None
    batch_size: int = 16  # sequences per micro-batch (global, over all processes)
    grad_accum_steps: int = 1  # micro-batches per optimizer step (optax.MultiSteps)

    # Optimizer (rowgeom.lm_optimizer); `steps` counts optimizer steps.
    steps: int = 600
    head: str = "rownorm"
    # Muon's step is RMS-matched to AdamW (rowgeom: scale="rms"), so one base rate serves the hidden
    # (Muon), embedding and vector (AdamW) groups; None below means "derived from learning_rate".
    learning_rate: float = 6e-3
    head_learning_rate: float | None = None  # None: 5x learning_rate (rownorm), 3x (adamw, muon)
    embedding_learning_rate: float | None = None
    vector_learning_rate: float | None = None
    weight_decay: float = 0.1  # decoupled, matrices only (hidden, head, embedding)
    head_weight_decay: float | None = None  # None: weight_decay (an untied head only)
    schedule: str = "cosine"  # "cosine": warmup + cosine; "wsd": warmup-stable-decay
    warmup_steps: int = 30
    decay_fraction: float = 0.2  # wsd: fraction of steps in the final linear decay
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of the peak
    grad_clip: float | None = 1.0  # global-norm clipping of the gradient; None: off

    # Evaluation and diagnostics.
    eval_every: int = 100
    # The fixed validation set: the first `eval_tokens` tokens of the validation split, in whole
    # batches of `batch_size` sequences (None: `eval_batches` batches, 32 x 16 x 128 = 65536
    # tokens here). The same at every evaluation and in every run on the same data.
    eval_tokens: int | None = None
    eval_batches: int = 32
    hilbert_sequences: int = 4  # validation sequences whose final hidden states probe the head step
    exact_diameter_max_elements: int = 1 << 24  # V*d above this: report the O(Vd) bracket only
    log_every: int = 10
    # Also probe the head step (diameter, Hilbert perturbation; no validation loss) on each of the
    # last `probe_last_steps` steps, so that "mean over the last K steps" can be computed.
    probe_last_steps: int = 0

    # Checkpoints. `checkpoint_dir` None -> WORKDIR/checkpoints (may be a gs:// path).
    save_every: int = 200
    keep_checkpoints: int = 3
    checkpoint_dir: str | None = None

    # Mesh over (data, fsdp, tensor); -1 takes the remaining devices.
    mesh_data: int = -1
    mesh_fsdp: int = 1
    mesh_tensor: int = 1

    seed: int = 0

    def resolved_head_learning_rate(self) -> float:
        """Peak head learning rate: rowgeom.lm_optimizer_hparams' (each head's study default)."""
        head = "rownorm" if self.head in ROWNORM_HEADS else self.head
        return rowgeom.lm_optimizer_hparams(self.learning_rate, head=head,
                                            head_learning_rate=self.head_learning_rate
                                            )["head"].learning_rate

    def validate(self) -> Config:
        """Raise ValueError naming the field when a value is out of range; return self."""
        if self.head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {self.head!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim", "seq_len",
                     "batch_size", "grad_accum_steps", "steps", "eval_every", "eval_batches",
                     "hilbert_sequences", "log_every", "save_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads "
                             f"({self.num_heads})")
        if not 0 <= self.probe_last_steps <= self.steps:
            raise ValueError(f"probe_last_steps must be in [0, steps={self.steps}], "
                             f"got {self.probe_last_steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction must be in [0, 1], got {self.decay_fraction}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip}")
        for name in ("compute_dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        if self.valid_vocab_size is not None and not 1 <= self.valid_vocab_size <= self.vocab_size:
            raise ValueError(f"valid_vocab_size must be in [1, vocab_size={self.vocab_size}], "
                             f"got {self.valid_vocab_size}")
        if self.eval_tokens is not None and self.eval_tokens < 1:
            raise ValueError(f"eval_tokens must be >= 1 or None, got {self.eval_tokens}")
        return self

    def effective_warmup(self) -> int:
        """Warmup updates actually used: `warmup_steps`, or half the run when the warmup would
        fill the whole run (so that any `steps >= 1` trains, with part of the run left to
        decay)."""
        return self.warmup_steps if self.warmup_steps < self.steps else self.steps // 2

    def resolved_eval_tokens(self) -> int:
        """Size of the fixed validation set in tokens (before rounding to whole batches)."""
        if self.eval_tokens is not None:
            return self.eval_tokens
        return self.eval_batches * self.batch_size * self.seq_len


_GPU = dict(
    vocab_size=50304, seq_len=1024, compute_dtype="bfloat16", batch_size=256, steps=20000,
    warmup_steps=500, eval_every=500, eval_batches=32, hilbert_sequences=2, log_every=50,
    save_every=1000, learning_rate=3e-3, weight_decay=0.1, schedule="wsd", grad_clip=1.0,
)

CONFIGS: dict[str, Config] = {
    "test": Config(
        vocab_size=512, d_model=32, num_layers=2, num_heads=2, mlp_dim=64, seq_len=32,
        batch_size=8, steps=8, warmup_steps=2, learning_rate=0.05, eval_every=4, eval_batches=1,
        hilbert_sequences=2, log_every=1, save_every=4),
    "cpu-tiny": Config(),
    "cpu-small": Config(
        vocab_size=8192, d_model=256, num_layers=4, num_heads=4, mlp_dim=768, seq_len=256,
        batch_size=16, steps=2000, warmup_steps=100, eval_every=250, save_every=500),
    "190m": Config(d_model=768, num_layers=14, num_heads=12, mlp_dim=2560, **_GPU),
    "380m": Config(d_model=1024, num_layers=22, num_heads=16, mlp_dim=2816, **_GPU),
    "640m": Config(d_model=1280, num_layers=26, num_heads=20, mlp_dim=3456, **_GPU),
}
DEFAULT_CONFIG = "cpu-tiny"


def get_config(name: str) -> Config:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"--config must be one of {sorted(CONFIGS)}, got {name!r}") from None


def _field_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    out = {}
    for f in dataclasses.fields(Config):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        out[f.name] = (args[0] if optional else hint, optional)
    return out


def parse_value(name: str, text: str):
    """Parse `text` as the type of Config field `name` ("none" -> None for optional fields)."""
    types_ = _field_types()
    if name not in types_:
        raise ValueError(f"unknown config field {name!r}; fields: {sorted(types_)}")
    typ, optional = types_[name]
    if optional and text.strip().lower() in ("none", "null"):
        return None
    if typ is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} expects a boolean (true/false), got {text!r}")
    try:
        return typ(text)
    except ValueError:
        raise ValueError(f"{name} expects {typ.__name__}, got {text!r}") from None


def _type_name(name: str) -> str:
    typ, optional = _field_types()[name]
    text = "{" + ",".join(CHOICES[name]) + "}" if name in CHOICES else typ.__name__.upper()
    return text + ("|none" if optional else "")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config`, `--set name=value` and one `--<field>` option per Config field.

    The field options default to None ("not given"), so `explicit_fields` can tell which ones the
    command line set; --help shows each field's type, choices and value in the default config.
    """
    parser.add_argument("--config", default=None, choices=sorted(CONFIGS),
                        help=f"named configuration (default: {DEFAULT_CONFIG})")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override a config field (repeatable)")
    group = parser.add_argument_group(
        "config fields (each overrides the named config; also --set NAME=VALUE)")
    for f in dataclasses.fields(Config):
        flags = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        default = getattr(CONFIGS[DEFAULT_CONFIG], f.name)
        group.add_argument(*flags, dest=f"field__{f.name}", default=None,
                           metavar=_type_name(f.name),
                           help=f"(default: {default!r} in {DEFAULT_CONFIG})")


def _overrides(args: argparse.Namespace) -> dict:
    overrides = {}
    for item in args.set:
        if "=" not in item:
            raise ValueError(f"--set expects NAME=VALUE, got {item!r}")
        name, text = item.split("=", 1)
        name = name.strip().replace("-", "_")
        overrides[name] = parse_value(name, text)
    for f in dataclasses.fields(Config):
        text = getattr(args, f"field__{f.name}")
        if text is not None:
            overrides[f.name] = parse_value(f.name, text)
    return overrides


def config_from_args(args: argparse.Namespace) -> Config:
    """The named config with `--set` and `--<field>` overrides applied (`--<field>` wins)."""
    name = args.config or DEFAULT_CONFIG
    return dataclasses.replace(get_config(name), **_overrides(args)).validate()


def explicit_fields(args: argparse.Namespace) -> frozenset[str]:
    """Config fields the command line set: every field when `--config` is given, else the
    `--set` / `--<field>` overrides. A resumed run takes the others from its checkpoint."""
    if args.config is not None:
        return frozenset(f.name for f in dataclasses.fields(Config))
    return frozenset(_overrides(args))


def parse_config(argv: Sequence[str]) -> Config:
    """Parse only config options (for tests and notebooks)."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))
