"""Training configurations of the example language model, and the command-line overrides.

One nested `Config`: the model (`model.ModelConfig` itself), the data, the optimizer, evaluation,
checkpoints and the mesh, plus a few run-level fields (`steps`, `head`, `seed`, `log_every`).
Every field is a command-line flag named by its dotted path, generated from the dataclasses and
parsed by the field's type: `--model.d_model 256` (or `--model.d_model=256`), `--optim.grad_clip
none`, and, for the run-level fields, `--steps 100 --head adamw --seed 1`.

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
from collections.abc import Mapping, Sequence
from typing import Any

from examples.lm.model import ModelConfig

SCHEDULES = ("cosine", "wsd")
HEADS = ("rownorm", "adamw", "muon", "rownorm-rescaled")
DTYPES = ("float32", "bfloat16", "float16")
# Fields whose values are checked against a fixed set (shown by --help).
CHOICES = {"head": HEADS, "optim.schedule": SCHEDULES, "model.compute_dtype": DTYPES,
           "model.param_dtype": DTYPES}
# The padded vocabulary of a --data.tokenizer run is a multiple of this (lane- and shard-friendly).
VOCAB_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """`source` None: the interpreter's standard library; else token files (a directory or glob of
    llm.c / rowgeom shards, a nanoGPT directory) or text / jsonl (see data.py)."""

    source: str | None = None
    dir: str | None = None  # tokenizer / token cache; None -> WORKDIR/data
    # A Hugging Face tokenizer.json: the vocabulary follows it, padded up to a multiple of 128
    # (model.vocab_size), with model.valid_vocab_size its real size.
    tokenizer: str | None = None
    batch_size: int = 16  # sequences per micro-batch (global, over all processes)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """rowgeom.lm_optimizer's rates and decays (peak values of the schedule), the schedule,
    clipping and accumulation. None rates and decays: `rowgeom.lm_optimizer_hparams`' defaults."""

    # Muon's step is RMS-matched to AdamW (rowgeom: scale="rms"), so one base rate serves the
    # hidden (Muon), embedding and vector (AdamW) groups.
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
    grad_accum_steps: int = 1  # micro-batches per optimizer step (optax.MultiSteps)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Validation loss and the head-step probe."""

    every: int = 100
    # The fixed validation set: the first `tokens` tokens of the validation split, in whole
    # batches of data.batch_size sequences (None: `batches` batches, 32 x 16 x 128 = 65536 tokens
    # here). The same at every evaluation and in every run on the same data.
    tokens: int | None = None
    batches: int = 32
    hilbert_sequences: int = 4  # validation sequences whose final hidden states probe the head
    exact_diameter_max_elements: int = 1 << 24  # V*d above this: report the O(Vd) bracket only
    # Also probe the head step (diameter, Hilbert perturbation; no validation loss) on each of the
    # last `probe_last_steps` steps, so that "mean over the last K steps" can be computed.
    probe_last_steps: int = 0


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 200
    keep: int = 3
    dir: str | None = None  # None -> WORKDIR/checkpoints (may be a gs:// path)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh over (data, fsdp, tensor); -1 takes the remaining devices."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1


def _cpu_tiny_model() -> ModelConfig:
    return ModelConfig(vocab_size=4096, d_model=128, num_layers=2, num_heads=4, mlp_dim=384,
                       max_seq_len=128)


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a training run needs; `steps` counts optimizer steps. Validated on creation
    (the model by `ModelConfig`, the rest here), so a bad value fails where it is set."""

    model: ModelConfig = dataclasses.field(default_factory=_cpu_tiny_model)
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()
    steps: int = 600
    head: str = "rownorm"  # "rownorm-rescaled": each direction rescaled to the diameter budget
    seed: int = 0
    log_every: int = 10

    def __post_init__(self):
        self.validate()

    @property
    def seq_len(self) -> int:
        """Training sequence length: the model's `max_seq_len`."""
        return self.model.max_seq_len

    def validate(self) -> Config:
        """Raise ValueError naming the field when a value is out of range; return self."""
        flat = flatten(self)
        for name, allowed in CHOICES.items():
            if flat[name] not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {flat[name]!r}")
        for name in ("data.batch_size", "optim.grad_accum_steps", "steps", "eval.every",
                     "eval.batches", "eval.hilbert_sequences", "log_every", "checkpoint.every",
                     "checkpoint.keep"):
            if flat[name] < 1:
                raise ValueError(f"{name} must be >= 1, got {flat[name]}")
        for name, low, high in (("eval.probe_last_steps", 0, self.steps),
                                ("optim.decay_fraction", 0.0, 1.0),
                                ("optim.min_lr_ratio", 0.0, 1.0)):
            if not low <= flat[name] <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {flat[name]}")
        if self.optim.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.optim.warmup_steps}")
        if self.optim.grad_clip is not None and self.optim.grad_clip <= 0:
            raise ValueError(f"optim.grad_clip must be > 0 or None, got {self.optim.grad_clip}")
        if self.eval.tokens is not None and self.eval.tokens < 1:
            raise ValueError(f"eval.tokens must be >= 1 or None, got {self.eval.tokens}")
        return self

    def effective_warmup(self) -> int:
        """Warmup updates actually used: `optim.warmup_steps`, or half the run when the warmup
        would fill the whole run (so that any `steps >= 1` trains, with part of the run left to
        decay)."""
        warmup = self.optim.warmup_steps
        return warmup if warmup < self.steps else self.steps // 2

    def resolved_eval_tokens(self) -> int:
        """Size of the fixed validation set in tokens (before rounding to whole batches)."""
        if self.eval.tokens is not None:
            return self.eval.tokens
        return self.eval.batches * self.data.batch_size * self.seq_len


# ----------------------------------------------------------------------------- dotted paths


def _is_group(value) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def flatten(cfg: Config) -> dict[str, Any]:
    """{"model.d_model": 128, ..., "steps": 600}: every leaf field by its dotted path."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if _is_group(value):
            out |= {f"{f.name}.{k}": v for k, v in flatten(value).items()}
        else:
            out[f.name] = value
    return out


def override(cfg: Config, changes: Mapping[str, Any]) -> Config:
    """`cfg` with `{dotted path: value}` applied (validated); an unknown path raises ValueError."""
    unknown = sorted(set(changes) - set(_field_types()))
    if unknown:
        raise ValueError(f"unknown config field {unknown[0]!r}{_renamed_hint(unknown[0])}")
    groups: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for path, value in changes.items():
        group, _, name = path.rpartition(".")
        (groups.setdefault(group, {}) if group else top)[name] = value
    for group, fields in groups.items():
        top[group] = dataclasses.replace(getattr(cfg, group), **fields)
    return dataclasses.replace(cfg, **top)


def from_dict(saved: Mapping[str, Any]) -> Config:
    """A Config from `dataclasses.asdict(cfg)` (a checkpoint's metadata) or from the flat dict
    written before the config was nested; fields it lacks keep `Config()`'s values."""
    return override(Config(), saved_paths(saved))


def saved_paths(saved: Mapping[str, Any]) -> dict[str, Any]:
    """{dotted path: value} of `dataclasses.asdict(cfg)`, or of the flat dict written before the
    config was nested (`{"d_model": ..., "seq_len": ...}`, see `LEGACY_NAMES`)."""
    flat: dict[str, Any] = {}
    for key, value in saved.items():
        if isinstance(value, Mapping):
            flat |= {f"{key}.{k}": v for k, v in value.items()}
        else:
            flat[LEGACY_NAMES.get(key, key)] = value
    return flat


def _field_types() -> dict[str, tuple[type, bool]]:
    """{dotted path: (type, optional)} of every leaf field, from the dataclasses' annotations."""
    out = {}

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{f.name}.")
                continue
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            optional = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
            out[prefix + f.name] = (args[0] if optional else hint, optional)

    walk(Config, "")
    return out


def parse_value(name: str, text: str):
    """Parse `text` as the type of config field `name` ("none" -> None for optional fields)."""
    types_ = _field_types()
    if name not in types_:
        raise ValueError(f"unknown config field {name!r}{_renamed_hint(name)}")
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


# The flat field names of the config before it was nested -> today's dotted paths (old
# checkpoints resume, and an old flag names its new spelling).
LEGACY_NAMES = {
    **{n: f"model.{n}" for n in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim",
                                 "tied_embeddings", "rope_theta", "norm_eps", "compute_dtype",
                                 "param_dtype", "valid_vocab_size")},
    "seq_len": "model.max_seq_len", "data_source": "data.source", "data_dir": "data.dir",
    "tokenizer": "data.tokenizer", "batch_size": "data.batch_size",
    **{n: f"optim.{n}" for n in ("learning_rate", "head_learning_rate", "embedding_learning_rate",
                                 "vector_learning_rate", "weight_decay", "head_weight_decay",
                                 "schedule", "warmup_steps", "decay_fraction", "min_lr_ratio",
                                 "grad_clip", "grad_accum_steps")},
    "eval_every": "eval.every", "eval_tokens": "eval.tokens", "eval_batches": "eval.batches",
    **{n: f"eval.{n}" for n in ("hilbert_sequences", "exact_diameter_max_elements",
                                "probe_last_steps")},
    "save_every": "checkpoint.every", "keep_checkpoints": "checkpoint.keep",
    "checkpoint_dir": "checkpoint.dir",
    "mesh_data": "mesh.data", "mesh_fsdp": "mesh.fsdp", "mesh_tensor": "mesh.tensor",
}


def _renamed_hint(name: str) -> str:
    new = LEGACY_NAMES.get(name.replace("-", "_"))
    return f"; it is now --{new}" if new else ""


# ----------------------------------------------------------------------------- named configs


def _model(**fields) -> ModelConfig:
    return dataclasses.replace(_cpu_tiny_model(), **fields)


def _gpu(**model) -> Config:
    return Config(
        model=_model(vocab_size=50304, max_seq_len=1024, compute_dtype="bfloat16", **model),
        data=DataConfig(batch_size=256),
        optim=OptimConfig(learning_rate=3e-3, weight_decay=0.1, warmup_steps=500, schedule="wsd",
                          grad_clip=1.0),
        eval=EvalConfig(every=500, batches=32, hilbert_sequences=2),
        checkpoint=CheckpointConfig(every=1000), steps=20000, log_every=50)


CONFIGS: dict[str, Config] = {
    "test": Config(
        model=_model(vocab_size=512, d_model=32, num_layers=2, num_heads=2, mlp_dim=64,
                     max_seq_len=32),
        data=DataConfig(batch_size=8), optim=OptimConfig(learning_rate=0.05, warmup_steps=2),
        eval=EvalConfig(every=4, batches=1, hilbert_sequences=2),
        checkpoint=CheckpointConfig(every=4), steps=8, log_every=1),
    "cpu-tiny": Config(),
    "cpu-small": Config(
        model=_model(vocab_size=8192, d_model=256, num_layers=4, num_heads=4, mlp_dim=768,
                     max_seq_len=256),
        data=DataConfig(batch_size=16), optim=OptimConfig(warmup_steps=100),
        eval=EvalConfig(every=250), checkpoint=CheckpointConfig(every=500), steps=2000),
    "190m": _gpu(d_model=768, num_layers=14, num_heads=12, mlp_dim=2560),
    "380m": _gpu(d_model=1024, num_layers=22, num_heads=16, mlp_dim=2816),
    "640m": _gpu(d_model=1280, num_layers=26, num_heads=20, mlp_dim=3456),
}
DEFAULT_CONFIG = "cpu-tiny"


def get_config(name: str) -> Config:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"--config must be one of {sorted(CONFIGS)}, got {name!r}") from None


# ----------------------------------------------------------------------------- command line


def _type_name(name: str) -> str:
    typ, optional = _field_types()[name]
    text = "{" + ",".join(CHOICES[name]) + "}" if name in CHOICES else typ.__name__.upper()
    return text + ("|none" if optional else "")


class _Renamed(argparse.Action):
    """An old spelling (`--d_model`, `--d-model`, `--set d_model=...`): fail naming the new one."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == "--set":
            name, _, value = str(values).partition("=")
            new = LEGACY_NAMES.get(name.strip().replace("-", "_"), name.strip().replace("-", "_"))
            parser.error(f"--set is gone: write --{new}={value or 'VALUE'}")
        parser.error(f"{option_string} is now --{self.const}")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and one `--<dotted path>` option per Config field.

    The field options default to None ("not given"), so `explicit_fields` can tell which ones the
    command line set; --help shows each field's type, choices and value in the default config.
    Old spellings (flat names, dashes, `--set NAME=VALUE`) fail with the new spelling named.
    """
    parser.add_argument("--config", default=None, choices=sorted(CONFIGS),
                        help=f"named configuration (default: {DEFAULT_CONFIG})")
    group = parser.add_argument_group("config fields (each overrides the named config)")
    defaults = flatten(CONFIGS[DEFAULT_CONFIG])
    paths = _field_types()
    for path in paths:
        group.add_argument(f"--{path}", dest=f"field__{path}", default=None,
                           metavar=_type_name(path),
                           help=f"(default: {defaults[path]!r} in {DEFAULT_CONFIG})")
    old = {"set": "set"} | {n: new for n, new in LEGACY_NAMES.items() if n not in paths}
    old |= {p.replace("_", "-"): p for p in paths if "_" in p}
    old |= {n.replace("_", "-"): new for n, new in LEGACY_NAMES.items() if "_" in n}
    add_renamed_flags(parser, old)


def add_renamed_flags(parser: argparse.ArgumentParser, renamed: Mapping[str, str]) -> None:
    """Hidden flags `--old` that fail with `--old is now --new` (exit 2 with a one-line parser)."""
    for name, new in renamed.items():
        parser.add_argument(f"--{name}", action=_Renamed, const=new, nargs="?",
                            help=argparse.SUPPRESS)


def _overrides(args: argparse.Namespace) -> dict:
    overrides = {}
    for path in _field_types():
        text = getattr(args, f"field__{path}")
        if text is not None:
            overrides[path] = parse_value(path, text)
    return overrides


def config_from_args(args: argparse.Namespace) -> Config:
    """The named config with the command line's `--<dotted path>` overrides applied."""
    return override(get_config(args.config or DEFAULT_CONFIG), _overrides(args))


def explicit_fields(args: argparse.Namespace) -> frozenset[str]:
    """Config fields (dotted paths) the command line set: every field when `--config` is given,
    else the overrides. A resumed run takes the others from its checkpoint."""
    if args.config is not None:
        return frozenset(_field_types())
    return frozenset(_overrides(args))


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def parse_config(argv: Sequence[str]) -> Config:
    """Parse only config options (for tests and notebooks); errors raise ValueError."""
    parser = _RaisingParser(allow_abbrev=False)
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))
