"""Training configurations: one nested, frozen `Config` (model, data, optim, eval, checkpoint,
mesh, and the run fields). A field's dotted path (`model.d_model`) is also its command-line flag
(`--model.d_model`) and its name in every error message. Named configs (`get_config`): `test`,
`cpu-tiny` (the default, ~1.5M parameters), `cpu-small` (~7.6M), the paper's `190m`, `380m`, `640m`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from examples.lm import sharding
from examples.lm.model import REMAT_POLICIES, ModelConfig

DTYPES = ("float32", "bfloat16", "float16")
# Fields whose values are checked against a fixed set (shown by --help).
CHOICES = {"head": ("rownorm", "adamw", "muon", "rownorm-rescaled"),
           "optim.schedule": ("cosine", "wsd"),
           "data.shuffle": ("sequences", "batches"),  # data.BatchSampler's granularity
           "model.compute_dtype": DTYPES, "model.param_dtype": DTYPES,
           "model.remat": REMAT_POLICIES, "optim.muon_scale": ("rms", "keller", "spectral", "none"),
           "optim.head_impl": ("auto", "xla", "cpu")}  # rowgeom.HeadOptions.impl
# Magnitudes (rates, decays, epsilons), >= 0: a negative rate is gradient ascent.
NON_NEGATIVE = ("optim.learning_rate", "optim.head_learning_rate",
                "optim.embedding_learning_rate", "optim.vector_learning_rate",
                "optim.weight_decay", "optim.head_weight_decay", "optim.muon_eps",
                "optim.adam_eps", "model.norm_eps")
# Fields that count something: >= 1.
COUNTS = ("data.batch_size", "optim.grad_accum_steps", "steps", "eval.every", "eval.batches",
          "eval.tokens", "eval.hilbert_sequences", "log_every", "checkpoint.every",
          "checkpoint.keep")
VOCAB_MULTIPLE = 128  # a padded vocabulary's multiple (lane- and shard-friendly)


def padded_vocab(num_tokens: int) -> int:
    """The `vocab_size` for `num_tokens` real tokens: rounded up to a multiple of VOCAB_MULTIPLE."""
    return -(-num_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """`source`: token files or text / jsonl (data.py); None: the standard library."""

    source: str | None = None
    dir: str | None = None  # tokenizer / token cache; None -> WORKDIR/data
    tokenizer: str | None = None  # a tokenizer.json: model.vocab_size follows it, padded
    batch_size: int = 16  # sequences per micro-batch (global, over all processes)
    # What an epoch shuffles within a file (data.BatchSampler): its aligned sequences, so that a
    # batch mixes the corpus, or, as the paper's loader does, whole updates' groups of
    # consecutive sequences (a batch of a small corpus is then a few documents' text).
    shuffle: str = "sequences"


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """rowgeom.lm_optimizer's peak rates and decays (None: `rowgeom.group_options`' defaults),
    the schedule, clipping and accumulation."""

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
    # rowgeom.MuonOptions: "rms" matches AdamW's step RMS; "keller" (the paper's) is
    # sqrt(max(1, fan_out / fan_in)).
    muon_scale: str = "rms"
    muon_eps: float = 1e-7
    adam_b2: float = 0.95  # rowgeom.AdamOptions (embedding, vector, an AdamW head)
    adam_eps: float = 1e-8
    head_bias_correction: bool = False  # a RowNorm head's EMA debiased (HeadOptions)
    head_eps: float | None = None  # a RowNorm head's eps (None: 1e-8)
    # rowgeom.HeadOptions.impl: "auto" decides by where the head lives; compiling for a TPU or GPU
    # target from a one-CPU host (tools/topology.py) needs "xla" said.
    head_impl: str = "auto"


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Validation loss and the head-step probe."""

    every: int = 100
    # The fixed validation set: the validation split's first `tokens` tokens, in whole batches
    # (None: `batches` batches).
    tokens: int | None = None
    batches: int = 32
    hilbert_sequences: int = 4  # validation sequences whose final hidden states probe the head
    exact_diameter_max_elements: int = 1 << 24  # V*d above this: report the O(Vd) bracket only
    probe_last_steps: int = 0  # also probe the head (no val loss) on each of the last K steps
    diameter_every: int = 0  # the head step's diameter alone every N updates and the last; 0: off
    centring: bool = False  # evaluate.centring_probe at evaluations (a RowNorm head)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 200
    keep: int = 3
    dir: str | None = None  # None -> WORKDIR/checkpoints (may be a gs:// path)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh over (data, fsdp, tensor); at most one axis is -1, taking the remaining devices."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1


def _cpu_tiny_model() -> ModelConfig:
    # Loss chunks of 32 positions: on CPU the chunked loss is faster than forming all the logits
    # at once from about 2**21 of them per step (python benchmarks/bench_lm_step.py).
    return ModelConfig(vocab_size=4096, d_model=128, num_layers=2, num_heads=4, mlp_dim=384,
                       max_seq_len=128, loss_chunk=32)


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a training run needs (`steps` counts optimizer steps), validated on creation."""

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
        return self.model.max_seq_len

    def validate(self) -> Config:
        """Raise ValueError naming the field's flag when a value is out of range; return self."""
        flat = flatten(self)
        # Every number is finite (a nan rate trains to a nan loss, an inf one to nothing useful).
        for name, value in flat.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"--{name} must be a finite number, got {value}")
        optional = {name for name, (_, opt) in field_types().items() if opt}
        or_none = lambda name: " or none" if name in optional else ""
        for name, allowed in CHOICES.items():
            if flat[name] not in allowed:
                raise ValueError(f"--{name} must be one of {allowed}, got {flat[name]!r}")
        # A diameter_every above `steps` is fine (like eval.every): the last update is measured.
        minimum = (dict.fromkeys(NON_NEGATIVE + ("optim.warmup_steps", "eval.diameter_every"), 0)
                   | dict.fromkeys(COUNTS, 1))
        for name, low in minimum.items():
            if flat[name] is not None and flat[name] < low:
                raise ValueError(f"--{name} must be >= {low}{or_none(name)}, got {flat[name]}")
        for name in ("model.rope_theta", "optim.grad_clip", "optim.head_eps"):
            if flat[name] is not None and not flat[name] > 0:
                raise ValueError(f"--{name} must be > 0{or_none(name)}, got {flat[name]}")
        for name, low, high in (("eval.probe_last_steps", 0, self.steps),
                                ("optim.decay_fraction", 0.0, 1.0),
                                ("optim.min_lr_ratio", 0.0, 1.0),
                                ("optim.adam_b2", 0.0, 1.0)):
            if not low <= flat[name] <= high:
                raise ValueError(f"--{name} must be in [{low}, {high}], got {flat[name]}")
        sharding.check_sizes(self.mesh.data, self.mesh.fsdp, self.mesh.tensor)
        return self

    def effective_warmup(self) -> int:
        """`optim.warmup_steps`, or half the run when it would fill it (any `steps >= 1` trains)."""
        warmup = self.optim.warmup_steps
        return warmup if warmup < self.steps else self.steps // 2

    def resolved_eval_tokens(self) -> int:
        """Size of the fixed validation set in tokens (before rounding to whole batches)."""
        if self.eval.tokens is not None:
            return self.eval.tokens
        return self.eval.batches * self.data.batch_size * self.seq_len


def flatten(tree) -> dict[str, Any]:
    """{"model.d_model": 128, ..., "steps": 600}: every leaf field of a Config, or of its
    `dataclasses.asdict` form, by its dotted path."""
    items = (tree.items() if isinstance(tree, Mapping)
             else ((f.name, getattr(tree, f.name)) for f in dataclasses.fields(tree)))
    out: dict[str, Any] = {}
    for name, value in items:
        if isinstance(value, Mapping) or (dataclasses.is_dataclass(value)
                                          and not isinstance(value, type)):
            out |= {f"{name}.{k}": v for k, v in flatten(value).items()}
        else:
            out[name] = value
    return out


def override(cfg: Config, changes: Mapping[str, Any]) -> Config:
    """`cfg` with `{dotted path: value}` applied and validated; an unknown path raises ValueError.
    Setting a mesh axis to -1 sets the others that are -1 to 1 (`{"mesh.fsdp": -1}`: all FSDP)."""
    unknown = sorted(set(changes) - set(field_types()))
    if unknown:
        raise ValueError(f"unknown config field --{unknown[0]}")
    changes = dict(changes)
    if any(changes.get(f"mesh.{axis}") == -1 for axis in sharding.AXES):
        for axis in sharding.AXES:
            if f"mesh.{axis}" not in changes and getattr(cfg.mesh, axis) == -1:
                changes[f"mesh.{axis}"] = 1
    groups: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for path, value in changes.items():
        group, _, name = path.rpartition(".")
        (groups.setdefault(group, {}) if group else top)[name] = value
    for group, fields in groups.items():
        top[group] = dataclasses.replace(getattr(cfg, group), **fields)
    return dataclasses.replace(cfg, **top)


def from_dict(saved: Mapping[str, Any]) -> Config:
    """A Config from `dataclasses.asdict(cfg)` (a checkpoint's metadata); fields it lacks keep
    `Config()`'s values."""
    return override(Config(), flatten(saved))


def field_types() -> dict[str, tuple[type, bool]]:
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
    typ, optional = field_types()[name]
    if optional and text.strip().lower() in ("none", "null"):
        return None
    if typ is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--{name} expects a boolean (true/false), got {text!r}")
    try:
        return typ(text)
    except ValueError:
        raise ValueError(f"--{name} expects {typ.__name__}, got {text!r}") from None


class PaperModel(NamedTuple):
    """One of the paper's models (arXiv 2608.22253, Table 1) and its run (Table 2)."""

    d_model: int
    params: int  # the paper's count: 32*16*d^2 + 2*50257*d, padding rows excluded
    updates: int  # floor(20 * params / 524288): 20 tokens per parameter
    micro_batch_per_gpu: int  # the paper's, on 8 x H200
    accum: int
    adamw_head_lr: float
    rownorm_head_lr: float


PAPER_MODELS: dict[str, PaperModel] = {
    "190m": PaperModel(512, 185_680_896, 7_083, 32, 1, 4.0e-3, 3.2e-3),
    "380m": PaperModel(768, 379_184_640, 14_464, 16, 2, 2.667e-3, 2.133e-3),
    "640m": PaperModel(1024, 639_797_248, 24_406, 8, 4, 2.0e-3, 1.6e-3),
}
PAPER_HEADS = ("rownorm", "adamw")
PAPER_VOCAB = 50_257  # GPT-2; padded to 50,304 (a multiple of 128) for the hardware
PAPER_EVAL_TOKENS = 5_242_880  # the first 2,560 validation sequences of 2,048


def paper_config(size: str, head: str = "rownorm") -> Config:
    """The paper's model `size` trained by its recipe (Table 2) with `head` (examples/lm/README.md,
    "Configs", has the whole recipe)."""
    if size not in PAPER_MODELS:
        raise ValueError(f"size must be one of {sorted(PAPER_MODELS)}, got {size!r}")
    if head not in PAPER_HEADS:
        raise ValueError(f"--head must be one of {PAPER_HEADS} for the paper's config {size!r} "
                         f"(Table 2 gives no other head's rate), got {head!r}")
    p = PAPER_MODELS[size]
    d = p.d_model
    micro = 8 * p.micro_batch_per_gpu  # global micro-batch: the paper's per-GPU one on 8 GPUs
    model = ModelConfig(
        vocab_size=padded_vocab(PAPER_VOCAB),
        valid_vocab_size=PAPER_VOCAB, d_model=d, num_layers=32, num_heads=d // 64,
        mlp_dim=4 * d, max_seq_len=2048, rope_theta=10_000.0, norm_eps=1e-6, qk_norm=True,
        norm_gain=False, init_std=0.02, compute_dtype="bfloat16", param_dtype="float32",
        # Scanned blocks (compile time independent of depth); "dots" keeps the weight matmuls'
        # outputs and recomputes attention (python -m examples.lm.tools.train_compile --paper); a
        # loss that holds one (B, 128, V) chunk of logits at a time.
        scan_layers=True, remat="dots", loss_chunk=128)
    rownorm = head == "rownorm"
    optim = OptimConfig(
        learning_rate=8e-3, embedding_learning_rate=4e-3,
        head_learning_rate=p.rownorm_head_lr if rownorm else p.adamw_head_lr,
        weight_decay=0.1, head_weight_decay=0.0 if rownorm else 0.1,
        schedule="cosine", warmup_steps=p.updates // 10, min_lr_ratio=0.1, grad_clip=1.0,
        grad_accum_steps=p.accum, muon_scale="keller", muon_eps=1e-5, adam_b2=0.999,
        adam_eps=1e-10, head_bias_correction=rownorm, head_eps=1e-8 if rownorm else None)
    return Config(
        model=model, data=DataConfig(batch_size=micro, shuffle="batches"), optim=optim,
        eval=EvalConfig(every=500, tokens=PAPER_EVAL_TOKENS, hilbert_sequences=4,
                        exact_diameter_max_elements=1 << 30, diameter_every=10,
                        centring=rownorm),
        checkpoint=CheckpointConfig(every=1000), steps=p.updates, head=head, log_every=10)


CONFIGS: dict[str, Config] = {
    "test": Config(
        model=dataclasses.replace(_cpu_tiny_model(), vocab_size=512, d_model=32, num_layers=2,
                                  num_heads=2, mlp_dim=64, max_seq_len=32),
        data=DataConfig(batch_size=8), optim=OptimConfig(learning_rate=0.05, warmup_steps=2),
        eval=EvalConfig(every=4, batches=1, hilbert_sequences=2),
        checkpoint=CheckpointConfig(every=4), steps=8, log_every=1),
    "cpu-tiny": Config(),
    "cpu-small": Config(
        model=dataclasses.replace(_cpu_tiny_model(), vocab_size=8192, d_model=256, num_layers=4,
                                  num_heads=4, mlp_dim=768, max_seq_len=256),
        data=DataConfig(batch_size=16), optim=OptimConfig(warmup_steps=100),
        eval=EvalConfig(every=250), checkpoint=CheckpointConfig(every=500), steps=2000),
    **{size: paper_config(size) for size in PAPER_MODELS},
}
DEFAULT_CONFIG = "cpu-tiny"


def get_config(name: str, *, head: str | None = None) -> Config:
    """The named config `name` training `head` (None: its own); a paper config's head rate and
    decay follow the head (`paper_config`)."""
    if name not in CONFIGS:
        raise ValueError(f"--config must be one of {sorted(CONFIGS)}, got {name!r}")
    if head is None:
        return CONFIGS[name]
    if name in PAPER_MODELS:
        return paper_config(name, head)
    return override(CONFIGS[name], {"head": head})


# A resumed run follows its checkpoint's config; only these, which change neither what is trained
# nor the checkpoint (cadence, placement, recomputation, loss chunking), follow the command line.
RUNTIME_FIELDS = frozenset({
    "data.dir", "checkpoint.dir", "checkpoint.keep", "checkpoint.every", "log_every",
    "eval.every", "eval.probe_last_steps", "eval.exact_diameter_max_elements", "mesh.data",
    "mesh.fsdp", "mesh.tensor", "model.remat", "model.loss_chunk"})
# Fields added after checkpoints were first written: a checkpoint without one was written with
# this value (every earlier checkpoint stores its blocks unrolled).
_LEGACY_VALUES = {"model.scan_layers": False}
# Runtime fields that belong to the machine rather than the run: never taken from a checkpoint.
_MACHINE_FIELDS = frozenset({"data.dir", "checkpoint.dir", "mesh.data", "mesh.fsdp",
                             "mesh.tensor"})


def resolve_config(cfg: Config, meta: dict, *, explicit=None,
                   change_horizon: bool = False) -> tuple[Config, dict]:
    """(config, changes): the checkpoint's config with runtime fields from `cfg`, and the
    `{dotted path: (saved, now)}` it changed. explicit: the fields the command line set (None:
    all); one that differs from the checkpoint and defines the run is a ValueError (`steps` is
    allowed with `change_horizon`). The others come from the checkpoint."""
    saved = meta.get("config")
    if not isinstance(saved, dict) or not isinstance(meta.get("step"), int):
        raise ValueError("cannot resume: the checkpoint's metadata has no config and step "
                         f"(not written by this trainer?): {str(meta)[:200]}")
    now_flat = flatten(cfg)
    saved_given = _LEGACY_VALUES | flatten(saved)
    try:
        saved_flat = flatten(override(cfg, saved_given))
    except ValueError as e:
        raise ValueError(f"cannot resume: the checkpoint's config does not fit this trainer: "
                         f"{e}") from None
    explicit = set(now_flat) if explicit is None else set(explicit)
    merged, conflicts, changed = {}, {}, {}
    for name, now in now_flat.items():
        was = merged[name] = saved_flat[name]
        if name in _MACHINE_FIELDS:
            merged[name] = now
        elif name in explicit and now != was:
            if name in RUNTIME_FIELDS or (name == "steps" and change_horizon):
                merged[name], changed[name] = now, (was, now)
            else:
                conflicts[name] = (was, now)
    if conflicts:
        hint = " (or add --change_horizon to change --steps)" if "steps" in conflicts else ""
        if "model.scan_layers" in conflicts:
            hint += (" (scanned and unrolled blocks are stored in different layouts, "
                     "layers/<name> of shape (L, ...) against layers/<i>/<name>: a checkpoint "
                     "restores only into the layout it was written in)")
        listed = "; ".join(f"--{name} saved {was!r}, now {now!r}"
                           for name, (was, now) in sorted(conflicts.items()))
        raise ValueError(
            f"cannot resume: these fields differ from the checkpoint's: {listed}; rerun with the "
            f"saved values{hint}, or start fresh with --overwrite or a new --workdir")
    return override(cfg, merged), dict(sorted(changed.items()))


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `train.py: error: ...` and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and one `--<dotted path>` option per Config field, None when not given
    (`explicit_fields`), parsed by the field's type (`none` for an optional one)."""
    parser.add_argument("--config", default=None, choices=sorted(CONFIGS),
                        help=f"named configuration (default: {DEFAULT_CONFIG})")
    group = parser.add_argument_group("config fields (each overrides the named config)")
    defaults = flatten(get_config(DEFAULT_CONFIG))
    for path, (typ, optional) in field_types().items():
        metavar = "{" + ",".join(CHOICES[path]) + "}" if path in CHOICES else typ.__name__.upper()
        group.add_argument(f"--{path}", dest=f"field__{path}", default=None,
                           metavar=metavar + ("|none" if optional else ""),
                           help=f"(default: {defaults[path]!r} in {DEFAULT_CONFIG})")


def parser(description: str | None = None) -> argparse.ArgumentParser:
    """The trainer's parser: the config flags and the invocation's own options."""
    out = Parser(prog="train.py", description=description, allow_abbrev=False,
                  epilog="Resuming: rerunning a command on a workdir with checkpoints resumes "
                         "the run from the latest complete one, following its saved config.")
    out.add_argument("--workdir", default=None, metavar="PATH",
                     help="metrics, TensorBoard, plot, data cache, checkpoints; local or remote, "
                          "e.g. gs://bucket/run (default: runs/<config>)")
    out.add_argument("--overwrite", action="store_true",
                     help="delete what the run wrote in the workdir (checkpoints, metrics.jsonl, "
                          "metrics.png, TensorBoard events) and start fresh")
    out.add_argument("--change_horizon", action="store_true",
                     help="on resume, accept a --steps different from the checkpoint's and "
                          "rebuild the learning-rate schedule for it (the rate jumps)")
    out.add_argument("--distributed", choices=("auto", "on", "off"), default="auto",
                     help="jax.distributed.initialize(): auto-detect multi-process launches "
                          "(default: auto)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("--benchmark", type=int, default=0, metavar="N",
                     help="instead of training, time N steps with and without the optimizer")
    add_config_arguments(out)
    return out


def config_from_args(args: argparse.Namespace) -> Config:
    """The named config, for `--head` first (`get_config`), with the command line's overrides."""
    overrides = {path: parse_value(path, text) for path in field_types()
                 if (text := getattr(args, f"field__{path}")) is not None}
    base = get_config(args.config or DEFAULT_CONFIG, head=overrides.get("head"))
    return override(base, overrides)


def explicit_fields(args: argparse.Namespace) -> frozenset[str]:
    """Config fields the command line set: all with `--config`, else the overrides."""
    return frozenset(path for path in field_types()
                     if args.config is not None or getattr(args, f"field__{path}") is not None)


def parse_config(argv: Sequence[str]) -> Config:
    """Parse only config options (for tests and notebooks); errors raise ValueError."""
    config_parser = _RaisingParser(allow_abbrev=False)
    add_config_arguments(config_parser)
    return config_from_args(config_parser.parse_args(list(argv)))
