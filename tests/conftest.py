"""Strict test configuration shared by every test module.

- Rank promotion raises, so a silently broadcast axis is a test failure.
- Hypothesis: a `ci` profile (few examples, few shapes: JIT compiles dominate the suite's time)
  and a `thorough` profile (>= 1000 examples per property), chosen with HYPOTHESIS_PROFILE.
- Markers are strict; `slow` marks end-to-end, subprocess and long tests, which
  `python -m pytest -q -m "not slow"` skips (CI runs everything; see CONTRIBUTING.md).
- Every test has a timeout (pytest-timeout, `[tool.pytest.ini_options]` in pyproject.toml);
  scripts that need their own process (8 simulated devices) run once per module through
  `_subprocess.ModuleSubprocess`, with a shorter timeout of their own.
- Cheaper XLA:CPU compiles, since compiling dominates the suite: `--xla_cpu_use_fusion_emitters=
  false` is appended to XLA_FLAGS (before jax starts its backend; subprocesses inherit it: the
  older loop emitters compile about a third faster), and this process compiles with
  `jax_disable_most_optimizations` (LLVM's expensive passes off; another third). The HLO the
  tests read (fusions, collectives) comes from the same HLO passes, and results are compared
  with float64 references, not with bits. Subprocesses that read memory or collectives from a
  compiled program compile with XLA's optimizations. Many tests build the same small programs
  from fresh closures (jit's own cache keys on the function), so this process also keeps
  jax's persistent compilation cache, keyed on the program itself, in a temporary directory of
  its own (empty at the start, removed at exit: every program is still compiled once per run).
  `ROWGEOM_TEST_XLA_DEFAULTS=1` keeps every default (CI's minimum-versions step runs that way).
"""

import atexit
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

_CHEAP_COMPILES = os.environ.get("ROWGEOM_TEST_XLA_DEFAULTS") != "1"
if _CHEAP_COMPILES:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()

import jax  # noqa: E402  (after XLA_FLAGS)

jax.config.update("jax_numpy_rank_promotion", "raise")
if _CHEAP_COMPILES:
    jax.config.update("jax_disable_most_optimizations", True)
    _CACHE = tempfile.mkdtemp(prefix="rowgeom-tests-xla-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

settings.register_profile(
    "ci", max_examples=20, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "thorough", max_examples=1000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _mapped_regions() -> tuple[int, int]:
    """(memory mappings this process holds, the most it may hold), or (0, 1) off Linux."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, 1


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drops jax's compiled programs after a module once the process holds half the memory
    mappings it may. Every XLA:CPU executable keeps a few mappings, and a process may hold only
    `vm.max_map_count` (65530 by default): the whole suite in one process compiles more than
    ten thousand programs, and the compiler then crashes (SIGSEGV or SIGABRT) in whichever test
    comes next."""
    yield
    held, limit = _mapped_regions()
    if held > limit // 2:
        import gc

        jax.clear_caches()
        gc.collect()


@pytest.fixture
def rng():
    """A fresh, seeded numpy Generator per test (independent of test order)."""
    import numpy as np

    return np.random.default_rng(0)


@pytest.fixture(scope="module")
def fast_compile():
    """Cheaper XLA compiles for modules that train the example (numbers change, not semantics)."""
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)


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
