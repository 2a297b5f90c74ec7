"""Strict test configuration shared by every test module.

- Rank promotion raises, so a silently broadcast axis is a test failure.
- Tests compile with XLA's defaults, the program users run: nothing here changes a compile
  option.
- Hypothesis: a `ci` profile (few examples) and a `thorough` profile (>= 1000 examples per
  property), chosen with HYPOTHESIS_PROFILE.
- Markers are strict. `slow` marks end-to-end and long tests, which `-m "not slow"` skips.
  `sharded` marks the 8-device tests: they run only in a process of their own, selected with
  `-m sharded` (see `_SHARDED`); every other invocation deselects them, and a `sharded`
  invocation deselects everything else (jax's device count is fixed once its backend starts).
- `commands` marks the tests that run a whole command as written, end to end (README's
  commands, the quick benchmark suite: minutes each on a CPU). Only a `-m` expression that names
  `commands` runs them (`python -m pytest -m commands`, before a release or after changing a
  command; CI does not): the suite's time stays the suite's.
- Every test has a timeout (pytest-timeout, `[tool.pytest.ini_options]` in pyproject.toml).
- One JAX persistent compilation cache per pytest invocation (a fresh temporary directory,
  shared by xdist's workers and every subprocess a test starts, removed at the end): a program
  compiled once is not compiled again when a test relaunches the same command (a killed and
  resumed run, two hosts, a rerun), whatever its compile time. It changes no compile option; a
  test that sets `JAX_COMPILATION_CACHE_DIR` itself keeps its own.
- Fixtures for the example trainer's tests: per process, one tokenized corpus (`lm_corpus`) and
  one Trainer per (config, mesh) for the modules that ask for `shared_trainers` (a program
  compiled for one module's run is not compiled again for another's run of an equal config);
  `no_plot` leaves out a run's final metrics.png for a module that never looks at it.
"""

import atexit
import itertools
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

# Set before jax is imported, so that this process and its children read it at import. The
# first process to get here (pytest's, or xdist's controller, whose workers inherit it) owns it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="rowgeom-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    # Every program, not only those that took a second to compile (JAX's default): the example's
    # init, loss and probe programs, which every relaunched run and study run compiles again.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import jax  # noqa: E402  (after the cache's directory)

jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile(
    "ci", max_examples=20, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "thorough", max_examples=1000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SHARDED_DEVICES = 8
_SHARDED = False  # whether this process runs the sharded tests (set in pytest_configure)


def _selects_sharded(markexpr: str) -> bool:
    """Whether the `-m` expression asks for sharded tests: it selects a test marked `sharded`
    (with or without `slow`) that it would not select without that marker. (`-m "not slow"`
    selects every marker set alike: the fast subset, not sharded.)"""
    if not markexpr:
        return False
    from _pytest.mark.expression import Expression

    expression = Expression.compile(markexpr)
    selects = lambda marks: expression.evaluate(lambda name: name in marks)
    return any(selects({"sharded", *extra}) and not selects(set(extra))
               for n in range(2) for extra in itertools.combinations(["slow"], n))


def pytest_configure(config):
    """A `-m` that selects sharded tests gives this process (and xdist's workers, which parse
    the same options) 8 CPU devices, before anything starts jax's backend."""
    global _SHARDED
    _SHARDED = _selects_sharded(config.getoption("markexpr", ""))
    if _SHARDED:
        jax.config.update("jax_num_cpu_devices", SHARDED_DEVICES)


def pytest_collection_modifyitems(config, items):
    """Sharded tests only in a sharded process, and only sharded tests there; `commands` tests
    only when the `-m` expression names them."""
    commands = "commands" in config.getoption("markexpr", "")
    keep, drop = [], []
    for item in items:
        wanted = ((item.get_closest_marker("sharded") is not None) == _SHARDED
                  and (commands or item.get_closest_marker("commands") is None))
        (keep if wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def sharded_devices():
    """The 8 CPU devices of a sharded process (a sharded test that runs elsewhere fails)."""
    devices = jax.devices()
    assert len(devices) == SHARDED_DEVICES, (
        f"sharded tests need {SHARDED_DEVICES} devices (run them with -m sharded): {devices}")
    return devices


@pytest.fixture
def rng():
    """A fresh, seeded numpy Generator per test (independent of test order)."""
    import numpy as np

    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def small_corpus():
    """`small_corpus(root, *, tokenize=False)`: see `_small_corpus`."""
    return _small_corpus


def _small_corpus(root, *, tokenize: bool = False):
    """~30 small stdlib modules copied to `root/corpus`: a text-directory corpus for the example.

    With `tokenize`, the `test` config's tokenizer and token cache are built once in `root/tokens`
    so that runs (and subprocesses) sharing `data_dir=root/tokens` never retrain it.
    """
    import shutil
    from pathlib import Path

    src = Path(os.__file__).parent
    files = sorted((p for p in src.glob("*.py") if 2_000 < p.stat().st_size < 12_000),
                   key=lambda p: p.name)[:30]
    assert len(files) >= 20, f"too few small modules in {src}"
    corpus = Path(root) / "corpus"
    corpus.mkdir()
    for f in files:
        shutil.copy(f, corpus / f.name)
    if tokenize:
        from examples.lm import configs, data

        data.prepare_tokens(source=corpus, workdir=Path(root) / "tokens",
                            vocab_size=configs.get_config("test").model.vocab_size)
    return root


@pytest.fixture(scope="session")
def final_checkpoint():
    """`final_checkpoint(workdir, steps) -> (state, meta)`: see `_final_checkpoint`."""
    return _final_checkpoint


def _final_checkpoint(workdir, steps: int):
    """The example's checkpoint of step `steps` in `workdir`, restored onto the first device
    (asserting it is the latest one), as host arrays, with its metadata."""
    from examples.lm import checkpointing, configs, train
    from examples.lm import sharding as mesh_lib

    cfg = configs.override(configs.get_config("test"), {"steps": steps})
    trainer = train.Trainer(cfg, mesh_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    ckpt = checkpointing.Checkpointer(workdir / "checkpoints")
    try:
        assert ckpt.latest_step() == steps
        state, meta = ckpt.restore(steps, trainer.abstract_state)
    finally:
        ckpt.close()
    return jax.device_get(state), meta


@pytest.fixture(scope="session")
def lm_corpus(tmp_path_factory, small_corpus):
    """`small_corpus(..., tokenize=True)` built once for the session, read-only: runs of the
    `test` config on it (`_lm_fixtures.config_on`) in different modules have equal configs, and
    so share their Trainer (`shared_trainers`). A test writes its workdirs elsewhere."""
    return small_corpus(tmp_path_factory.mktemp("lm_corpus"), tokenize=True)


@pytest.fixture(scope="session")
def _built_trainers() -> dict:
    """`shared_trainers`' Trainers, by (config, mesh), kept for the session."""
    return {}


@pytest.fixture(scope="module")
def shared_trainers(_built_trainers):
    """The example's `train.Trainer` built once per (config, mesh) for the session, for the
    modules that ask for this fixture (`train.Trainer` is replaced while such a module runs):
    runs and resumed runs of one config, in one module or several, share their compiled
    functions instead of compiling them again. The key is the whole config, so a Trainer is
    shared only where it would be built from an equal config. A Trainer holds no train state
    (its config, mesh, optimizer transformation, shardings and jitted functions; the state is
    what `init()` returns and what the jitted step takes and returns); a resume in a fresh
    process, with its own compiles, is test_crash_resume.py's."""
    from examples.lm import train

    real = train.Trainer

    def trainer(cfg, mesh):
        if (cfg, mesh) not in _built_trainers:
            _built_trainers[cfg, mesh] = real(cfg, mesh)
        return _built_trainers[cfg, mesh]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "Trainer", trainer)
        yield trainer


@pytest.fixture(scope="module")
def no_plot():
    """No metrics.png at the end of the example's runs for the module that asks (matplotlib's
    half second a plot; test_lm_train.py and test_bad_input.py check the plot)."""
    from examples.lm import metrics

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metrics.MetricsWriter, "plot", lambda self: None)
        yield
