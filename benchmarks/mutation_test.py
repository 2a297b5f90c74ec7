"""Mutation testing of the fast test subset: does each small deliberate bug make a test fail?

Each mutant below is one exact text replacement in one file of the library or the example: a
small semantic bug (a wrong eps rule, a missing transpose, an off-by-one). For each, the working
tree is copied to a temporary directory (without .git and caches), the mutant is applied to the
copy, and the fast subset ``python -m pytest -q -x -m "not slow" -p no:cacheprovider`` runs there
with a timeout, then (if it passed) its 8-device tests, ``-m "sharded and not slow"``. A
mutant is *killed* when a test fails, *survives* when every test passes, and *timed out*
when the run does not finish in time. The score is killed / (killed + survived);
timed-out mutants are listed apart. Before the mutants, the same selection runs once on the
unmutated copy (a failing baseline would make every kill meaningless).

It takes minutes per mutant, so it is not part of CI (CONTRIBUTING.md, "Mutation testing").

Usage, from the repository root:

    python benchmarks/mutation_test.py --list                  # the mutants
    python benchmarks/mutation_test.py                         # every mutant, the fast subset
    python benchmarks/mutation_test.py --only head-lr-multiplier --only ns-no-transpose
    python benchmarks/mutation_test.py --quick                 # each against its own test files
    python benchmarks/mutation_test.py --tests tests/rowgeom/test_recipe.py   # one selection
    python benchmarks/mutation_test.py --quick --exclude tests/rowgeom/test_recipe_defaults.py

Maintenance: every mutant's ``old`` text is the code as it is when the mutant was written. When
that code changes, a mutant whose ``old`` text is no longer found exactly once stops the script
before anything runs, with a message naming the mutant, its file and how often the text was
found: rewrite that entry against the new code (or drop it if the code it broke is gone). Each
mutant's ``tests`` are the files that should kill it, used by ``--quick``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IGNORED = (".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis",
           "*.egg-info", "site", "runs", ".venv", "venv")
PYTEST = ("-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider")
# The fast 8-device tests, in a process of their own (tests/conftest.py), after the above passed.
SHARDED_PYTEST = ("-m", "pytest", "-q", "-x", "-m", "sharded and not slow", "-p",
                  "no:cacheprovider")


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    description: str
    tests: tuple[str, ...]  # the test files that should kill it (--quick)


RECIPE_TESTS = ("tests/rowgeom/test_recipe.py", "tests/rowgeom/test_recipe_defaults.py")
ROWNORM_TESTS = ("tests/rowgeom/test_rownorm.py", "tests/rowgeom/test_reference_numerics.py")
GEOMETRY_TESTS = ("tests/rowgeom/test_geometry.py", "tests/rowgeom/test_diagnostics.py",
                  "tests/rowgeom/test_reference_numerics.py")
NS_TESTS = ("tests/rowgeom/test_newton_schulz.py", "tests/rowgeom/test_muon.py")
LABEL_TESTS = ("tests/rowgeom/test_labels.py",) + RECIPE_TESTS
MUON_TESTS = ("tests/rowgeom/test_muon.py",) + RECIPE_TESTS
RESUME_TESTS = ("tests/examples/test_lm_train.py", "tests/examples/test_resume_fast.py")
SHARDED_TESTS = ("tests/rowgeom/test_muon_sharded.py",)
LOOP_TESTS = ("tests/examples/test_lm_loop.py",)
KIND_TESTS = ("tests/examples/test_lm_mutation_kinds.py",)
ROWGEOM_KIND_TESTS = ("tests/rowgeom/test_mutation_kinds.py",)

MUTANTS: tuple[Mutant, ...] = (
    # --- the kinds the test-suite issue found missed ----------------------------------------
    Mutant("rownorm-eps-cpu-rows", "rowgeom/_cpu.py",
           "    weights = 1.0 / jnp.maximum(jnp.sqrt(sq), eps)\n"
           "    if num_valid < vocab:\n"
           "        weights = jnp.pad(weights, (0, vocab - num_valid))\n"
           "    y = ((x * scale",
           "    weights = 1.0 / (jnp.sqrt(sq) + 10 * eps)\n"
           "    if num_valid < vocab:\n"
           "        weights = jnp.pad(weights, (0, vocab - num_valid))\n"
           "    y = ((x * scale",
           "eps rule x / (||x|| + 10 eps) in the CPU formulation, token rows contiguous",
           ROWNORM_TESTS),
    Mutant("rownorm-eps-cpu-slabs", "rowgeom/_cpu.py",
           "    weights = 1.0 / jnp.maximum(jnp.sqrt(sq), eps)\n"
           "    if num_valid < vocab:\n"
           "        weights = jnp.pad(weights, (0, vocab - num_valid))\n"
           "    write =",
           "    weights = 1.0 / (jnp.sqrt(sq) + 10 * eps)\n"
           "    if num_valid < vocab:\n"
           "        weights = jnp.pad(weights, (0, vocab - num_valid))\n"
           "    write =",
           "eps rule x / (||x|| + 10 eps) in the CPU formulation, a (d, V) kernel",
           ROWNORM_TESTS),
    Mutant("rownorm-eps-reference", "rowgeom/_rownorm.py",
           "    weights = 1.0 / jnp.maximum(jnp.sqrt(sq), eps)\n    if not center_output:",
           "    weights = 1.0 / (jnp.sqrt(sq) + 10 * eps)\n    if not center_output:",
           "eps rule x / (||x|| + 10 eps) in the masked formulation (accelerators, meshes)",
           ROWNORM_TESTS),
    Mutant("ns-no-transpose", "rowgeom/_muon.py",
           "transposed = x.shape[-2] > x.shape[-1]", "transposed = False",
           "Newton–Schulz on a tall matrix without the transpose (an m x m Gram matrix)",
           NS_TESTS),
    Mutant("resume-one-step-late", "examples/lm/train.py",
           "for step in range(done + 1, end + 1):", "for step in range(done + 2, end + 1):",
           "a resumed run starts one step late (skips the step after the checkpoint)",
           RESUME_TESTS),
    Mutant("bracket-upper-xla", "rowgeom/_geometry.py",
           "upper = _times_pow2(2.0 * r_c, unscale)  # 2 max_i",
           "upper = _times_pow2(r_c + jnp.sqrt(sum_n2 / num_rows), unscale)  # 2 max_i",
           "wrong upper end of the bracket (r_c + rms_c) in the XLA formulation",
           GEOMETRY_TESTS),
    Mutant("pow2-remainder-dropped", "rowgeom/_numerics.py",
           "return x * piece * piece * piece * piece * _pow2(k - 4 * quarter)",
           "return x * piece * piece * piece * piece",
           "power-of-two rescaling by 2**(4 * (k / 4)) only: off by up to 2**3 unless 4 | k",
           GEOMETRY_TESTS),
    Mutant("cpu-walk-never-unrolled", "rowgeom/_cpu.py",
           "    if num_tokens < _UNROLL_MIN_TOKENS:\n        return 1",
           "    if num_tokens >= 0:\n        return 1",
           "the CPU formulation's token walks not unrolled for a large head either (slower)",
           ROWNORM_TESTS),
    Mutant("head-lr-multiplier", "rowgeom/_recipe.py",
           '{"rownorm": 5.0, "adamw": 3.0, "muon": 3.0}',
           '{"rownorm": 4.0, "adamw": 3.0, "muon": 3.0}',
           "the RowNorm head's learning-rate multiplier 5 -> 4", RECIPE_TESTS),
    Mutant("ns-coefficient-order", "rowgeom/_muon.py",
           "for a, b, cc in np.asarray(table, np.float64).tolist():",
           "for a, cc, b in np.asarray(table, np.float64).tolist():",
           "Newton–Schulz applies (a, c, b) instead of (a, b, c)", NS_TESTS),
    Mutant("ns-step-order", "rowgeom/_muon.py",
           "for a, b, cc in np.asarray(table, np.float64).tolist():",
           "for a, b, cc in np.asarray(table, np.float64)[::-1].tolist():",
           "Newton–Schulz applies the coefficient table's rows last to first", NS_TESTS),
    Mutant("head-mislabelled", "rowgeom/_labels.py",
           'if c in cfg.head_names:\n            return "head"',
           'if c in cfg.head_names:\n            return "embedding"',
           "a component named as the head labels its leaf 'embedding'", LABEL_TESTS),
    # --- more of our own ------------------------------------------------------------------
    Mutant("rownorm-center-input-ignored", "rowgeom/_rownorm.py",
           "opts = dict(eps=eps, center_input=bool(center_input),",
           "opts = dict(eps=eps, center_input=True,",
           "projected RowNorm ignores center_input=False", ROWNORM_TESTS),
    Mutant("rownorm-padding-in-mean", "rowgeom/_cpu.py",
           "        y = y - acc / num_valid", "        y = y - acc / vocab",
           "CPU formulation: the output mean divides by V, padding rows included", ROWNORM_TESTS),
    Mutant("rownorm-rescale-bound", "rowgeom/_rownorm.py",
           "2.0 / jnp.where(ok, diameter, 1.0)", "1.0 / jnp.where(ok, diameter, 1.0)",
           "rescale multiplies by 1/D instead of 2/D", ROWNORM_TESTS),
    Mutant("vocab-axis-inference", "rowgeom/_structure.py",
           "        if len(axes) == 1:\n            return axes[0]",
           "        if len(axes) == 1:\n            return 1 - axes[0]",
           "the head's vocabulary axis inferred as the other axis", RECIPE_TESTS),
    Mutant("head-decay-twice", "rowgeom/_recipe.py",
           "            direction,\n            optax.add_decayed_weights(group.weight_decay),\n",
           "            direction,\n            optax.add_decayed_weights(group.weight_decay),\n"
           "            optax.add_decayed_weights(\n"
           "                group.weight_decay if label == 'head' else 0.0),\n",
           "the head's weight decay applied twice (a RowNorm or Muon head)", RECIPE_TESTS),
    Mutant("vector-decay-default", "rowgeom/_recipe.py",
           '"vector": group("vector", learning_rate, 0.0, adam_.b1),',
           '"vector": group("vector", learning_rate, weight_decay, adam_.b1),',
           "vectors get the matrices' weight decay (0.1) instead of 0", RECIPE_TESTS),
    Mutant("nesterov-default-off", "rowgeom/_muon.py",
           "    nesterov: bool = True\n", "    nesterov: bool = False\n",
           "lm_optimizer's hidden momentum without Nesterov by default", RECIPE_TESTS),
    Mutant("adam-b2-default", "rowgeom/_recipe.py",
           "    b2: float = 0.95\n", "    b2: float = 0.999\n",
           "AdamW b2 0.999 instead of 0.95", RECIPE_TESTS),
    Mutant("ns-steps-default", "rowgeom/_muon.py",
           "    ns_steps: int = 5\n", "    ns_steps: int = 4\n",
           "four Newton–Schulz steps by default instead of five", RECIPE_TESTS),
    Mutant("muon-rms-factor", "rowgeom/_muon.py",
           "factor = rms_scale * math.sqrt(max(m, n))",
           "factor = rms_scale * math.sqrt(min(m, n))",
           "Muon's RMS scale uses the smaller side", MUON_TESTS),
    Mutant("muon-rms-scale-default", "rowgeom/_muon.py",
           "    rms_scale: float = 0.2\n", "    rms_scale: float = 0.25\n",
           "Muon's target update RMS 0.25 instead of 0.2", MUON_TESTS),
    Mutant("tracker-cadence-off-by-one", "rowgeom/_diagnostics.py",
           "now = (new == 1) | (new % k == 0)", "now = (new == 1) | (new % k == 1)",
           "the tracker measures updates 1, k+1, 2k+1 instead of 1, k, 2k",
           ("tests/rowgeom/test_diagnostics.py",) + RECIPE_TESTS),
    Mutant("tracker-cadence-default", "rowgeom/_recipe.py",
           "    track_every_k_steps: int = 10\n", "    track_every_k_steps: int = 5\n",
           "lm_optimizer's head tracker every 5th update instead of every 10th", RECIPE_TESTS),
    Mutant("tracker-sweeps", "rowgeom/_diagnostics.py",
           "_bounds_and_sum(u, axis=axis, sweeps=2, impl=impl)",
           "_bounds_and_sum(u, axis=axis, sweeps=0, impl=impl)",
           "the tracker records the centroid lower bound instead of two sweeps",
           ("tests/rowgeom/test_diagnostics.py", "tests/rowgeom/test_reference_numerics.py")),
    Mutant("bracket-sweeps0-lower", "rowgeom/_geometry.py",
           "math.sqrt(2 / (num_rows - 1))", "math.sqrt(2 / num_rows)",
           "the centroid lower bound uses sqrt(2) rms_c instead of sqrt(2V/(V-1)) rms_c",
           GEOMETRY_TESTS),
    Mutant("diameter-no-diagonal-blocks", "rowgeom/_geometry.py",
           "rows, cols = np.triu_indices(num_blocks)",
           "rows, cols = np.triu_indices(num_blocks, 1)",
           "the exact diameter skips pairs within one row block", GEOMETRY_TESTS),
    Mutant("hilbert-distance-sign", "rowgeom/_hilbert.py",
           "return jnp.where(jnp.all(both_zero, axis=axis), 0.0, top - bottom)",
           "return jnp.where(jnp.all(both_zero, axis=axis), 0.0, top + bottom)",
           "Hilbert distance of probabilities: max + min of the log-ratio instead of max - min",
           ("tests/rowgeom/test_geometry.py",)),
    Mutant("label-rule-anchored", "rowgeom/_labels.py",
           "if pattern.search(joined):", "if pattern.match(joined):",
           "label rules matched at the start of the path only (re.match, not re.search)",
           ("tests/rowgeom/test_labels.py",)),
    Mutant("tied-head-centred", "rowgeom/_recipe.py",
           'return label == "router" or hp.tied != "head"', "return True",
           "a tied head (an input embedding) is centred", RECIPE_TESTS),
    Mutant("resume-metrics-kept", "examples/lm/train.py",
           "writer.truncate_after(done)", "writer.truncate_after(done + 1)",
           "a resumed run keeps the killed run's metrics line of the step after the checkpoint",
           RESUME_TESTS),
    # --- what the fast subset missed (issue 30): sharded Muon, the sweeps, the loop ------------
    Mutant("muon-sharded-pad-front", "rowgeom/_muon.py",
           "stack = jnp.pad(stack, ((0, pad), (0, 0), (0, 0)))",
           "stack = jnp.pad(stack, ((pad, 0), (0, 0), (0, 0)))",
           "sharded Muon pads its zero matrices in front of the stack", SHARDED_TESTS),
    Mutant("muon-sharded-last-back", "rowgeom/_muon.py",
           "    return polar[:batch]", "    return polar[-batch:]",
           "sharded Muon takes the last `batch` matrices back instead of the first",
           SHARDED_TESTS),
    Mutant("muon-sharded-long-side-choice", "rowgeom/_muon.py",
           "    return long_side < whole", "    return long_side > whole",
           "sharded Muon splits few matrices along the long side when that moves more data",
           SHARDED_TESTS),
    Mutant("muon-sharded-replicated-moved", "rowgeom/_muon.py",
           "    return not used & set(where.axes)", "    return False",
           "sharded Muon spreads replicated Explicit updates over the devices (and back)",
           SHARDED_TESTS),
    Mutant("muon-sharded-all-axes-at-once", "rowgeom/_muon.py",
           "    for k in range(len(where.axes)):\n"
           "        stack = _constrain(stack, P(where.axes[:k] or None, _FREE, _FREE), where)",
           "    for k in range(0):\n"
           "        stack = _constrain(stack, P(where.axes[:k] or None, _FREE, _FREE), where)",
           "sharded Muon spreads a stack over a 2-D mesh in one move (the partitioner gathers it)",
           SHARDED_TESTS),
    Mutant("bracket-anchor-fixed", "rowgeom/_geometry.py",
           "return jnp.maximum(lower, pair), far", "return jnp.maximum(lower, pair), anchor",
           "the bracket's farthest-point sweeps never move their anchor", GEOMETRY_TESTS),
    Mutant("accum-resume-at-micro-step", "examples/lm/train.py",
           'done = int(jax.device_get(state["micro_step"])) // cfg.optim.grad_accum_steps',
           'done = int(jax.device_get(state["micro_step"]))',
           "with accumulation, a resumed run starts at micro_step instead of micro_step / accum",
           LOOP_TESTS),
    Mutant("accum-micro-batch-reuse", "examples/lm/train.py",
           "self.train_batches.get((step - 1) * self.accum + micro)",
           "self.train_batches.get((step - 1) + micro)",
           "consecutive optimizer steps reuse micro-batches (index not times the accumulation)",
           LOOP_TESTS),
    Mutant("accum-every-micro-batch", "examples/lm/optimizer.py",
           "    if cfg.optim.grad_accum_steps > 1:\n", "    if cfg.optim.grad_accum_steps > 2:\n",
           "with --optim.grad_accum_steps 2 every micro-batch is an optimizer step", LOOP_TESTS),
    Mutant("accum-gradient-sum", "examples/lm/optimizer.py",
           "optax.MultiSteps(tx, every_k_schedule=cfg.optim.grad_accum_steps)",
           "optax.MultiSteps(tx, every_k_schedule=cfg.optim.grad_accum_steps, use_grad_mean=False)",
           "accumulation sums the micro-batches' gradients instead of averaging them", LOOP_TESTS),
    Mutant("eval-last-step-skipped", "examples/lm/train.py",
           "is_eval = step % cfg.eval.every == 0 or step == cfg.steps",
           "is_eval = step % cfg.eval.every == 0",
           "no evaluation of the last step when steps is not a multiple of eval.every",
           LOOP_TESTS),
    Mutant("head-probe-decay-sign", "examples/lm/evaluate.py",
           "step = delta + (head_lr * head_wd) * head_old",
           "step = delta - (head_lr * head_wd) * head_old",
           "the head probe's step without decay subtracts lr wd W instead of adding it back",
           LOOP_TESTS),
    # --- what the fast subset missed (issue 35): work done, dtypes, scaled losses, logging -----
    Mutant("remat-policy-ignored", "examples/lm/model.py",
           "return nnx.remat(apply, policy=saved[policy], prevent_cse=not in_scan)",
           "return nnx.remat(apply, policy=None, prevent_cse=not in_scan)",
           "--model.remat dots recomputes the whole block, like block", KIND_TESTS),
    Mutant("remat-cse-allowed", "examples/lm/model.py",
           "return nnx.remat(apply, policy=saved[policy], prevent_cse=not in_scan)",
           "return nnx.remat(apply, policy=saved[policy], prevent_cse=False)",
           "unrolled blocks' remat lets XLA merge the recomputation into the forward pass",
           KIND_TESTS),
    Mutant("params-not-cast-before-forward", "examples/lm/train.py",
           "        gd, compute = self.graphdef, self.compute_params\n",
           "        gd, compute = self.graphdef, lambda params: params\n",
           "the forward pass gets the float32 parameters (FSDP gathers float32; the layers cast)",
           KIND_TESTS),
    Mutant("chunked-loss-cotangent-ignored", "examples/lm/loss.py",
           "jnp.where(jnp.arange(num_chunks * chunk_size) < T, g / (B * T), 0.0)",
           "jnp.where(jnp.arange(num_chunks * chunk_size) < T, 1.0 / (B * T), 0.0)",
           "the chunked loss's backward pass ignores its incoming cotangent", KIND_TESTS),
    Mutant("accum-train-loss-last", "examples/lm/train.py",
           '"train_loss": _scalar(sum(losses) / self.accum)',
           '"train_loss": _scalar(losses[-1])',
           "with accumulation, train_loss is the last micro-batch's, not the mean", KIND_TESTS),
    Mutant("train-step-rates-ignored", "examples/lm/optimizer.py",
           "rates = group_rates(cfg) if rates is None else rates", "rates = group_rates(cfg)",
           "the train step bakes the config's rates in and ignores its rates argument",
           ("tests/examples/test_lm_loop.py",)),
    Mutant("weight-grad-reduced-in-bf16", "examples/lm/model.py",
           "preferred_element_type=jnp.float32)\n    dx =",
           "preferred_element_type=x.dtype)\n    dx =",
           "the Linear layers' weight gradients form (and reduce across devices) in bf16",
           ("tests/examples/test_lm_model.py",)),
    Mutant("embedding-grad-reduced-in-bf16", "examples/lm/model.py",
           "jnp.zeros(table_VD.shape, jnp.float32).at[ids].add(d_rows.astype(jnp.float32))",
           "jnp.zeros(table_VD.shape, table_VD.dtype).at[ids].add(d_rows)",
           "the embedding's gradient rows are scatter-added (and reduced across devices) in bf16",
           ("tests/examples/test_lm_model.py",)),
    Mutant("report-model-flops-whole", "examples/lm/tools/train_compile.py",
           "batch * cfg.seq_len / len(devices),", "batch * cfg.seq_len,",
           "the compile report's model FLOPs are the whole batch's, not per device", KIND_TESTS),
    Mutant("muon-sharded-extra-block", "rowgeom/_muon.py",
           "pad = -stack.shape[0] % where.size", "pad = where.size - stack.shape[0] % where.size",
           "sharded Muon pads a whole block of zero matrices when the stack divides the devices",
           ROWGEOM_KIND_TESTS),
    Mutant("rownorm-guard-scale-padding-xla", "rowgeom/_rownorm.py",
           "_guarded(stats, lambda: jnp.max(jnp.abs(mask(x))), eps)",
           "_guarded(stats, lambda: jnp.max(jnp.abs(x)), eps)",
           "masked RowNorm's overflow guard takes its scale from the padding rows too",
           ROWGEOM_KIND_TESTS),
    Mutant("rownorm-guard-scale-padding-cpu-rows", "rowgeom/_cpu.py",
           "stats, lambda: jnp.max(jnp.abs(lax.slice_in_dim(x, 0, num_valid, axis=axis))), eps)",
           "stats, lambda: jnp.max(jnp.abs(x)), eps)",
           "CPU RowNorm's overflow guard (token rows contiguous) scales by the padding rows too",
           ROWGEOM_KIND_TESTS),
    Mutant("rownorm-guard-scale-padding-cpu-slabs", "rowgeom/_cpu.py",
           "stats, lambda: jnp.max(jnp.abs(lax.slice_in_dim(x, 0, num_valid, axis=1))), eps)",
           "stats, lambda: jnp.max(jnp.abs(x)), eps)",
           "CPU RowNorm's overflow guard (a (d, V) kernel) scales by the padding rows too",
           ROWGEOM_KIND_TESTS),
    # What a preempted machine relaunching the same command, and upstream data, meet.
    Mutant("metrics-cut-line-fatal", "examples/lm/metrics.py",
           "            if number < len(lines):", "            if True:",
           "a metrics.jsonl whose last line was cut short stops the resume",
           ("tests/examples/test_resume_fast.py",)),
    Mutant("train-preempted-returns", "examples/lm/train.py",
           "    if preempted:\n        raise Preempted(end, setup.ckpt.directory)\n", "",
           "a preempted run returns as if finished", ("tests/examples/test_resume_fast.py",)),
    Mutant("token-cache-dead-builds-kept", "examples/lm/tools/prepare.py",
           "    _remove_dead_builds(cache)\n", "",
           "a relaunch keeps the partial token caches a killed run left",
           ("tests/examples/test_crash_resume.py",)),
    Mutant("llmc-llama3-as-uint16", "examples/lm/data.py",
           '20240801: ("llmc-llama3", 7, np.dtype("<u4"))',
           '20240801: ("llmc-llama3", 7, np.dtype("<u2"))',
           "llm.c's Llama 3 shards read as uint16", ("tests/examples/test_lm_formats.py",)),
    Mutant("json-dataset-as-text", "examples/lm/tools/prepare.py",
           '    if suffix != ".json":\n        return None', "    return None",
           "a .json dataset is tokenized as raw JSON", ("tests/examples/test_lm_formats.py",)),
    Mutant("launcher-keeps-sigterm", "examples/lm/tools/paper_runs.py",
           "        for child in children:\n            child.send_signal(signum)\n", "",
           "paper_runs does not pass a SIGTERM on to the run in progress",
           ("tests/examples/test_paper_protocol.py",)),
    Mutant("weight-read-in-out", "rowgeom/_structure.py",
           "fan_in, fan_out = rest[::-1] if out_in(path, structure) else rest",
           "fan_in, fan_out = rest",
           "a matrix stored (out, in) (a weight, GPT-2's Flax Conv1D) gets fan-in on axis 0",
           ("tests/rowgeom/test_structure.py",)),
    Mutant("gpt2-conv1d-as-dense", "rowgeom/_structure.py",
           "shape[-2:] == (3 * width, width)", "shape[-2:] == (width, 3 * width)",
           "HF Flax GPT-2's (3d, d) c_attn is not told from a Dense port's (d, 3d)",
           ("tests/rowgeom/test_structure.py",)),
    Mutant("muon-head-fan-in-on-vocab", "rowgeom/_structure.py",
           "return MuonDimensionNumbers(1 - vocab, vocab), axis",
           "return MuonDimensionNumbers(0, 1), axis",
           "a (V, d) Muon head takes V as its fan-in", ("tests/rowgeom/test_options_plan.py",)),
    Mutant("paper-configs-shuffle-sequences", "examples/lm/configs.py",
           'data=DataConfig(batch_size=micro, shuffle="batches")',
           "data=DataConfig(batch_size=micro)",
           "the paper configs shuffle single sequences, not the paper's whole batches",
           ("tests/examples/test_paper_protocol.py",)),
    Mutant("sampler-same-order-every-epoch", "examples/lm/data.py",
           "for shard in _shuffled(len(self.shards), self.seed, epoch, 0):",
           "for shard in _shuffled(len(self.shards), self.seed, 0, 0):",
           "every epoch reads the files in the first epoch's order",
           ("tests/examples/test_lm_data.py",)),
    Mutant("sampler-micro-batch-ignored", "examples/lm/data.py",
           "first = micro * self.batch_size + self.first_row",
           "first = self.first_row",
           "every micro-batch of an update reads the same sequences",
           ("tests/examples/test_lm_data.py",)),
    Mutant("resume-on-other-data", "examples/lm/train.py",
           'if meta is not None and meta.get("data", tokens.identity()) != tokens.identity():',
           'if False:',
           "a relaunch on other data (an edited text source) resumes silently",
           ("tests/examples/test_bad_input.py",)),
    Mutant("checkpoint-dir-not-followed", "examples/lm/train.py",
           "if recorded is not None and cfg.checkpoint.dir is None:",
           "if False:",
           "a relaunch without --checkpoint.dir starts fresh beside its run's checkpoints",
           ("tests/examples/test_bad_input.py",)),
    Mutant("workdir-unlocked", "examples/lm/checkpointing.py",
           "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", "pass",
           "a second run in a workdir in use is not refused",
           ("tests/examples/test_bad_input.py",)),
    Mutant("sigterm-handler-gone-before-last-save", "examples/lm/train.py",
           "            _close(setup.ckpt)  # waits for the last save\n",
           "            preemption is not None and preemption.close()\n"
           "            _close(setup.ckpt)\n",
           "the SIGTERM handler is restored before the last save is written",
           LOOP_TESTS),
)


# --- running --------------------------------------------------------------------------------


class MutantError(SystemExit):
    """A mutant that cannot be applied (its `old` text is not found exactly once)."""


def check_mutants(mutants, exclude=()) -> None:
    problems = []
    names = [m.name for m in MUTANTS]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems.append(f"duplicate mutant names {duplicates}")
    for m in mutants:
        path = ROOT / m.path
        if not path.is_file():
            problems.append(f"{m.name}: file {m.path} does not exist")
            continue
        count = path.read_text().count(m.old)
        if count != 1:
            problems.append(f"{m.name}: its old text occurs {count} times in {m.path} "
                            f"(expected exactly once; update the mutant): {m.old!r}")
        for test in m.tests:
            if test not in exclude and not (ROOT / test).is_file():
                problems.append(f"{m.name}: test file {test} does not exist")
    if problems:
        raise MutantError("mutation_test.py: cannot apply these mutants:\n  "
                          + "\n  ".join(problems))


def copy_tree(dest: Path) -> Path:
    shutil.copytree(ROOT, dest, symlinks=True, ignore=shutil.ignore_patterns(*IGNORED))
    return dest


def apply(mutant: Mutant, tree: Path) -> None:
    path = tree / mutant.path
    text = path.read_text()
    assert text.count(mutant.old) == 1, mutant.name  # checked up front, on the source tree
    path.write_text(text.replace(mutant.old, mutant.new))


def environment(tree: Path, scratch: Path, mutant: Mutant | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("PYTEST_ADDOPTS", None)
    if mutant is not None and "/csrc/" in "/" + mutant.path:
        # A mutated native kernel gets a build cache of its own (never the user's).
        env["ROWGEOM_CACHE_DIR"] = str(scratch / "native-cache")
    return env


def check_imports(tree: Path, env: dict) -> None:
    """The copy, not an installed rowgeom, must be what the tests import."""
    out = subprocess.run(
        [sys.executable, "-c", "import rowgeom, examples; print(rowgeom.__file__); "
                               "print(examples.__file__)"],
        cwd=tree, env=env, capture_output=True, text=True, check=True).stdout.split()
    if not all(Path(p).resolve().is_relative_to(tree.resolve()) for p in out):
        raise SystemExit(f"mutation_test.py: the copy imports {out}, not its own files under "
                         f"{tree}; is PYTHONPATH overridden?")


def run_pytest(tree: Path, env: dict, tests, exclude, timeout: float) -> dict:
    """The fast subset, then (if it passed, or selected nothing) its 8-device tests; a selection
    without sharded tests (exit status 5 there) is decided by the first run alone."""
    start = time.perf_counter()
    res = _run_pytest(tree, env, PYTEST, tests, exclude, timeout)
    if res["status"] == "survived" or res["rc"] == 5:
        left = timeout - (time.perf_counter() - start)
        sharded = _run_pytest(tree, env, SHARDED_PYTEST, tests, exclude, left)
        if sharded["rc"] != 5:
            res = dict(sharded, output=res["output"] + sharded["output"])
    res["seconds"] = time.perf_counter() - start
    return res


def _run_pytest(tree: Path, env: dict, pytest_args, tests, exclude, timeout: float) -> dict:
    argv = [sys.executable, *pytest_args, *tests, *(f"--ignore={p}" for p in exclude)]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # pytest and anything it started
        out, _ = proc.communicate()
        return {"status": "timed out", "rc": None, "seconds": time.perf_counter() - start,
                "detail": f"no result after {timeout:.0f} s", "output": out}
    seconds = time.perf_counter() - start
    failed = [line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    if proc.returncode == 0:
        status = "survived"
    elif proc.returncode in (1, 2, 3):  # failures, interrupted (collection errors), internal
        status = "killed"
    else:  # 4: usage error, 5: no tests collected: the selection is wrong, not the mutant
        status = "error"
    return {"status": status, "rc": proc.returncode, "seconds": seconds,
            "detail": failed[0] if failed else summary, "output": out}


def run_one(mutant: Mutant | None, tests, exclude, timeout, keep: bool) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix=f"rowgeom-mutant-{mutant.name if mutant else 'base'}-"))
    try:
        tree = copy_tree(scratch / "tree")
        if mutant is not None:
            apply(mutant, tree)
        env = environment(tree, scratch, mutant)
        if mutant is None:
            check_imports(tree, env)
        return run_pytest(tree, env, tests, exclude, timeout)
    finally:
        if keep:
            print(f"  kept {scratch}", flush=True)
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only this mutant (repeatable)")
    parser.add_argument("--tests", nargs="+", default=[], metavar="PATH",
                        help="test files or node ids for every mutant (default: tests/)")
    parser.add_argument("--quick", action="store_true",
                        help="run each mutant against its own test files instead")
    parser.add_argument("--exclude", nargs="+", default=[], metavar="PATH",
                        help="test files left out of every run (pytest --ignore)")
    parser.add_argument("--timeout", type=float, default=900.0, metavar="S",
                        help="seconds per run (default 900)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run in parallel (default 1)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the run on the unmutated tree")
    parser.add_argument("--keep", action="store_true", help="keep the temporary trees")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.quick and args.tests:
        parser.error("--quick and --tests exclude each other")

    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.only if n not in known]
    if unknown:
        parser.error(f"unknown mutant(s) {unknown}; see --list")
    mutants = [known[n] for n in args.only] if args.only else list(MUTANTS)
    check_mutants(mutants, args.exclude)
    if args.list:
        for m in mutants:
            print(f"{m.name:30s} {m.path:28s} {m.description}")
        return 0

    def selection(m: Mutant | None) -> list[str]:
        if not args.quick:
            return args.tests
        files = m.tests if m is not None else sorted({t for mu in mutants for t in mu.tests})
        return [t for t in files if t not in args.exclude]

    if not args.no_baseline:
        print(f"baseline (unmutated copy): {' '.join(selection(None)) or 'tests/'}", flush=True)
        base = run_one(None, selection(None), args.exclude, args.timeout, args.keep)
        print(f"  {base['status']} in {base['seconds']:.0f} s: {base['detail']}", flush=True)
        if base["status"] != "survived":
            print(base["output"][-4000:])
            print("mutation_test.py: the unmutated tree fails its tests; fix that first")
            return 1

    results = {}

    def job(m: Mutant) -> tuple[str, dict]:
        return m.name, run_one(m, selection(m), args.exclude, args.timeout, args.keep)

    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for name, res in pool.map(job, mutants):
            results[name] = res
            print(f"{name:30s} {res['status']:9s} {res['seconds']:6.0f} s  {res['detail']}",
                  flush=True)

    counts = {s: sum(r["status"] == s for r in results.values())
              for s in ("killed", "survived", "timed out", "error")}
    decided = counts["killed"] + counts["survived"]
    score = counts["killed"] / decided if decided else float("nan")
    print(f"\nscore {counts['killed']}/{decided} = {score:.0%} killed"
          f" ({counts['timed out']} timed out, {counts['error']} errors)")
    for name, res in results.items():
        if res["status"] != "killed":
            print(f"  {res['status']}: {name} ({known[name].description})")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"score": score, "counts": counts, "quick": args.quick, "tests": args.tests,
             "exclude": args.exclude,
             "mutants": {n: {k: v for k, v in r.items() if k != "output"}
                         for n, r in results.items()}}, indent=2) + "\n")
    return 0 if counts["error"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
