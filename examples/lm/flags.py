"""The trainer's command line: one flag per config field, named by its dotted path.

`--model.d_model 256` (or `--model.d_model=256`) sets `model.d_model`, parsed by the field's type
(`none` for an optional field: `--optim.grad_clip none`); the run-level fields are short
(`--steps 100 --head adamw --seed 1`), and `--config NAME` picks the named config they override.
Next to them are the options of an invocation that are not part of the run's config: `--workdir`,
`--overwrite`, `--change_horizon`, `--distributed`, `--no-progress` and `--benchmark`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from examples.lm import configs


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `train.py: error: ...` and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def _metavar(path: str) -> str:
    typ, optional = configs.field_types()[path]
    text = ("{" + ",".join(configs.CHOICES[path]) + "}" if path in configs.CHOICES
            else typ.__name__.upper())
    return text + ("|none" if optional else "")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and one `--<dotted path>` option per Config field.

    The field options default to None ("not given"), so `explicit_fields` can tell which ones the
    command line set; --help shows each field's type, choices and value in the default config.
    """
    parser.add_argument("--config", default=None, choices=sorted(configs.CONFIGS),
                        help=f"named configuration (default: {configs.DEFAULT_CONFIG})")
    group = parser.add_argument_group("config fields (each overrides the named config)")
    defaults = configs.flatten(configs.get_config(configs.DEFAULT_CONFIG))
    for path in configs.field_types():
        group.add_argument(f"--{path}", dest=f"field__{path}", default=None,
                           metavar=_metavar(path),
                           help=f"(default: {defaults[path]!r} in {configs.DEFAULT_CONFIG})")


def parser(description: str | None = None) -> argparse.ArgumentParser:
    """The trainer's parser: the config flags and the invocation's own options."""
    out = Parser(prog="train.py", description=description, allow_abbrev=False,
                  epilog="Resuming: rerunning a command on a workdir with checkpoints resumes "
                         "the run from the latest complete one, following its saved config.")
    out.add_argument("--workdir", default=None, metavar="PATH",
                     help="metrics, TensorBoard, plot, data cache, checkpoints; local or remote, "
                          "e.g. gs://bucket/run (default: runs/<config>)")
    out.add_argument("--overwrite", action="store_true",
                     help="delete the workdir's checkpoints and metrics and start fresh")
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


def _overrides(args: argparse.Namespace) -> dict:
    overrides = {}
    for path in configs.field_types():
        text = getattr(args, f"field__{path}")
        if text is not None:
            overrides[path] = configs.parse_value(path, text)
    return overrides


def config_from_args(args: argparse.Namespace) -> configs.Config:
    """The named config with the command line's `--<dotted path>` overrides applied.

    `--head` picks the named config's version for that head first (a paper config's head rate
    and decay are the head's, `configs.paper_config`), then every override applies."""
    overrides = _overrides(args)
    base = configs.get_config(args.config or configs.DEFAULT_CONFIG, head=overrides.get("head"))
    return configs.override(base, overrides)


def explicit_fields(args: argparse.Namespace) -> frozenset[str]:
    """Config fields (dotted paths) the command line set: every field when `--config` is given,
    else the overrides. A resumed run takes the others from its checkpoint."""
    if args.config is not None:
        return frozenset(configs.field_types())
    return frozenset(_overrides(args))


def parse_config(argv: Sequence[str]) -> configs.Config:
    """Parse only config options (for tests and notebooks); errors raise ValueError."""
    config_parser = _RaisingParser(allow_abbrev=False)
    add_config_arguments(config_parser)
    return config_from_args(config_parser.parse_args(list(argv)))
