"""The example's nested config: every named config keeps the values it had as a flat dataclass,
and a checkpoint's config (nested, or flat as written before) reads back as the same Config."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from examples.lm import configs, resume

# Every named config's fields before the config was nested (flat names), as they were then.
FLAT_BEFORE = {
    "190m": {
        "batch_size": 256, "checkpoint_dir": None, "compute_dtype": "bfloat16", "d_model": 768,
        "data_dir": None, "data_source": None, "decay_fraction": 0.2,
        "embedding_learning_rate": None, "eval_batches": 32, "eval_every": 500,
        "eval_tokens": None, "exact_diameter_max_elements": 16777216, "grad_accum_steps": 1,
        "grad_clip": 1.0, "head": "rownorm", "head_learning_rate": None,
        "head_weight_decay": None, "hilbert_sequences": 2, "keep_checkpoints": 3,
        "learning_rate": 0.003, "log_every": 50, "mesh_data": -1, "mesh_fsdp": 1,
        "mesh_tensor": 1, "min_lr_ratio": 0.1, "mlp_dim": 2560, "norm_eps": 1e-06,
        "num_heads": 12, "num_layers": 14, "param_dtype": "float32", "probe_last_steps": 0,
        "rope_theta": 10000.0, "save_every": 1000, "schedule": "wsd", "seed": 0, "seq_len": 1024,
        "steps": 20000, "tied_embeddings": False, "tokenizer": None, "valid_vocab_size": None,
        "vector_learning_rate": None, "vocab_size": 50304, "warmup_steps": 500,
        "weight_decay": 0.1,
    },
    "380m": {
        "batch_size": 256, "checkpoint_dir": None, "compute_dtype": "bfloat16", "d_model": 1024,
        "data_dir": None, "data_source": None, "decay_fraction": 0.2,
        "embedding_learning_rate": None, "eval_batches": 32, "eval_every": 500,
        "eval_tokens": None, "exact_diameter_max_elements": 16777216, "grad_accum_steps": 1,
        "grad_clip": 1.0, "head": "rownorm", "head_learning_rate": None,
        "head_weight_decay": None, "hilbert_sequences": 2, "keep_checkpoints": 3,
        "learning_rate": 0.003, "log_every": 50, "mesh_data": -1, "mesh_fsdp": 1,
        "mesh_tensor": 1, "min_lr_ratio": 0.1, "mlp_dim": 2816, "norm_eps": 1e-06,
        "num_heads": 16, "num_layers": 22, "param_dtype": "float32", "probe_last_steps": 0,
        "rope_theta": 10000.0, "save_every": 1000, "schedule": "wsd", "seed": 0, "seq_len": 1024,
        "steps": 20000, "tied_embeddings": False, "tokenizer": None, "valid_vocab_size": None,
        "vector_learning_rate": None, "vocab_size": 50304, "warmup_steps": 500,
        "weight_decay": 0.1,
    },
    "640m": {
        "batch_size": 256, "checkpoint_dir": None, "compute_dtype": "bfloat16", "d_model": 1280,
        "data_dir": None, "data_source": None, "decay_fraction": 0.2,
        "embedding_learning_rate": None, "eval_batches": 32, "eval_every": 500,
        "eval_tokens": None, "exact_diameter_max_elements": 16777216, "grad_accum_steps": 1,
        "grad_clip": 1.0, "head": "rownorm", "head_learning_rate": None,
        "head_weight_decay": None, "hilbert_sequences": 2, "keep_checkpoints": 3,
        "learning_rate": 0.003, "log_every": 50, "mesh_data": -1, "mesh_fsdp": 1,
        "mesh_tensor": 1, "min_lr_ratio": 0.1, "mlp_dim": 3456, "norm_eps": 1e-06,
        "num_heads": 20, "num_layers": 26, "param_dtype": "float32", "probe_last_steps": 0,
        "rope_theta": 10000.0, "save_every": 1000, "schedule": "wsd", "seed": 0, "seq_len": 1024,
        "steps": 20000, "tied_embeddings": False, "tokenizer": None, "valid_vocab_size": None,
        "vector_learning_rate": None, "vocab_size": 50304, "warmup_steps": 500,
        "weight_decay": 0.1,
    },
    "cpu-small": {
        "batch_size": 16, "checkpoint_dir": None, "compute_dtype": "float32", "d_model": 256,
        "data_dir": None, "data_source": None, "decay_fraction": 0.2,
        "embedding_learning_rate": None, "eval_batches": 32, "eval_every": 250,
        "eval_tokens": None, "exact_diameter_max_elements": 16777216, "grad_accum_steps": 1,
        "grad_clip": 1.0, "head": "rownorm", "head_learning_rate": None,
        "head_weight_decay": None, "hilbert_sequences": 4, "keep_checkpoints": 3,
        "learning_rate": 0.006, "log_every": 10, "mesh_data": -1, "mesh_fsdp": 1,
        "mesh_tensor": 1, "min_lr_ratio": 0.1, "mlp_dim": 768, "norm_eps": 1e-06, "num_heads": 4,
        "num_layers": 4, "param_dtype": "float32", "probe_last_steps": 0, "rope_theta": 10000.0,
        "save_every": 500, "schedule": "cosine", "seed": 0, "seq_len": 256, "steps": 2000,
        "tied_embeddings": False, "tokenizer": None, "valid_vocab_size": None,
        "vector_learning_rate": None, "vocab_size": 8192, "warmup_steps": 100,
        "weight_decay": 0.1,
    },
    "cpu-tiny": {
        "batch_size": 16, "checkpoint_dir": None, "compute_dtype": "float32", "d_model": 128,
        "data_dir": None, "data_source": None, "decay_fraction": 0.2,
        "embedding_learning_rate": None, "eval_batches": 32, "eval_every": 100,
        "eval_tokens": None, "exact_diameter_max_elements": 16777216, "grad_accum_steps": 1,
        "grad_clip": 1.0, "head": "rownorm", "head_learning_rate": None,
        "head_weight_decay": None, "hilbert_sequences": 4, "keep_checkpoints": 3,
        "learning_rate": 0.006, "log_every": 10, "mesh_data": -1, "mesh_fsdp": 1,
        "mesh_tensor": 1, "min_lr_ratio": 0.1, "mlp_dim": 384, "norm_eps": 1e-06, "num_heads": 4,
        "num_layers": 2, "param_dtype": "float32", "probe_last_steps": 0, "rope_theta": 10000.0,
        "save_every": 200, "schedule": "cosine", "seed": 0, "seq_len": 128, "steps": 600,
        "tied_embeddings": False, "tokenizer": None, "valid_vocab_size": None,
        "vector_learning_rate": None, "vocab_size": 4096, "warmup_steps": 30, "weight_decay": 0.1,
    },
    "test": {
        "batch_size": 8, "checkpoint_dir": None, "compute_dtype": "float32", "d_model": 32,
        "data_dir": None, "data_source": None, "decay_fraction": 0.2,
        "embedding_learning_rate": None, "eval_batches": 1, "eval_every": 4, "eval_tokens": None,
        "exact_diameter_max_elements": 16777216, "grad_accum_steps": 1, "grad_clip": 1.0,
        "head": "rownorm", "head_learning_rate": None, "head_weight_decay": None,
        "hilbert_sequences": 2, "keep_checkpoints": 3, "learning_rate": 0.05, "log_every": 1,
        "mesh_data": -1, "mesh_fsdp": 1, "mesh_tensor": 1, "min_lr_ratio": 0.1, "mlp_dim": 64,
        "norm_eps": 1e-06, "num_heads": 2, "num_layers": 2, "param_dtype": "float32",
        "probe_last_steps": 0, "rope_theta": 10000.0, "save_every": 4, "schedule": "cosine",
        "seed": 0, "seq_len": 32, "steps": 8, "tied_embeddings": False, "tokenizer": None,
        "valid_vocab_size": None, "vector_learning_rate": None, "vocab_size": 512,
        "warmup_steps": 2, "weight_decay": 0.1,
    },
}


def _flat_names(cfg):
    old = {new: old for old, new in configs.LEGACY_NAMES.items()}
    return {old.get(path, path): value for path, value in configs.flatten(cfg).items()}


@pytest.mark.parametrize("name", sorted(FLAT_BEFORE))
def test_named_configs_keep_their_values(name):
    assert set(configs.CONFIGS) == set(FLAT_BEFORE)
    assert _flat_names(configs.get_config(name)) == FLAT_BEFORE[name]


def test_saved_configs_read_back_nested_and_flat():
    cfg = configs.override(configs.get_config("test"), {"model.d_model": 48, "steps": 5})
    assert configs.from_dict(dataclasses.asdict(cfg)) == cfg
    assert configs.from_dict(_flat_names(cfg)) == cfg  # a checkpoint written before nesting
    meta = {"step": 3, "config": _flat_names(cfg)}
    assert resume.resolve_config(configs.get_config("test"), meta, explicit=())[0] == cfg


def test_every_field_is_one_flag_and_validation_names_the_path():
    flags = {a.option_strings[0] for a in _parser()._actions if a.help != "==SUPPRESS=="}
    assert {f"--{p}" for p in configs.flatten(configs.Config())} <= flags
    for changes, match in (({"optim.decay_fraction": 2.0}, "optim.decay_fraction must be in"),
                           ({"data.batch_size": 0}, "data.batch_size must be >= 1"),
                           ({"model.num_heads": 3}, "divisible by num_heads")):
        with pytest.raises(ValueError, match=match):
            configs.override(configs.get_config("test"), changes)


def _parser():
    import argparse

    parser = argparse.ArgumentParser()
    configs.add_config_arguments(parser)
    return parser


def test_the_script_form_names_the_module_form():
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "examples" / "lm" / "train.py")],
                          capture_output=True, text=True, cwd=root, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "python -m examples.lm.train" in done.stderr


@pytest.mark.parametrize("steps,every,probes,expected", [
    (600, 100, 0, 100), (250, 100, 0, 50), (7, 5, 0, 1), (600, 100, 10, 1)])
def test_head_tracker_measures_every_step_the_trainer_reads(steps, every, probes, expected):
    from examples.lm import optimizer
    cfg = configs.override(configs.get_config("test"), {
        "steps": steps, "eval.every": every, "eval.probe_last_steps": probes})
    k = optimizer.track_every_k_steps(cfg)
    assert k == expected
    # The trainer reads the tracker at every evaluation and on the last step: all are measured
    # (the tracker measures update 1 and every multiple of k).
    reads = [s for s in range(1, steps + 1) if s % every == 0 or s == steps
             or s > steps - probes]
    assert all(s == 1 or s % k == 0 for s in reads)
