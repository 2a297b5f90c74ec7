"""The example's nested config: dotted paths, flags, validation naming the flag, the mesh rule,
and a checkpoint's config (`dataclasses.asdict`) reading back as the same Config."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from examples.lm import configs


@pytest.mark.parametrize("name", sorted(configs.CONFIGS))
def test_named_configs_round_trip_through_every_form(name):
    """asdict -> from_dict, flatten -> override, and the flags of every field give back the
    named config; every field has exactly one dotted path."""
    cfg = configs.get_config(name)
    assert configs.from_dict(dataclasses.asdict(cfg)) == cfg
    flat = configs.flatten(cfg)
    assert set(flat) == set(configs.field_types())
    assert configs.override(configs.Config(), flat) == cfg
    argv = [f"--{path}={'none' if value is None else value}" for path, value in flat.items()]
    assert configs.parse_config(argv) == cfg


def test_saved_configs_read_back_and_resume_follows_them():
    cfg = configs.override(configs.get_config("test"), {"model.d_model": 48, "steps": 5})
    assert configs.from_dict(dataclasses.asdict(cfg)) == cfg
    meta = {"step": 3, "config": dataclasses.asdict(cfg)}
    assert configs.resolve_config(configs.get_config("test"), meta, explicit=())[0] == cfg
    with pytest.raises(ValueError, match=r"cannot resume: .*--model.d_model saved 48, now 32"):
        configs.resolve_config(configs.get_config("test"), meta, explicit={"model.d_model"})
    with pytest.raises(ValueError, match=r"unknown config field --d_model"):
        configs.from_dict({"d_model": 48})


def test_every_field_is_one_flag_and_errors_name_the_flag():
    parser = _parser()
    field_flags = {a.option_strings[0] for a in parser._actions if a.dest.startswith("field__")}
    assert field_flags == {f"--{p}" for p in configs.flatten(configs.Config())}
    test = configs.get_config("test")
    for changes, match in (({"optim.decay_fraction": 2.0}, "^--optim.decay_fraction must be in"),
                           ({"data.batch_size": 0}, "^--data.batch_size must be >= 1"),
                           ({"head": "sgd"}, "^--head must be one of"),
                           ({"model.num_heads": 3},
                            "^--model.d_model .* must be divisible by --model.num_heads"),
                           ({"model.valid_vocab_size": 10**6}, "^--model.valid_vocab_size"),
                           ({"mesh.tensor": 0}, "--mesh.data/--mesh.fsdp/--mesh.tensor must be"),
                           ({"nope": 1}, "^unknown config field --nope$")):
        with pytest.raises(ValueError, match=match):
            configs.override(test, changes)
    with pytest.raises(ValueError, match="^--model.d_model expects int, got 'abc'$"):
        configs.parse_value("model.d_model", "abc")


def _parser():
    import argparse

    parser = argparse.ArgumentParser()
    configs.add_config_arguments(parser)
    return parser


def test_a_mesh_axis_set_to_minus_one_takes_every_device():
    """Setting one axis to -1 sets the others that are -1 to 1 (the GPU configs' mesh.data is
    -1); axes set explicitly are kept, and two explicit -1 are refused naming the flags."""
    gpu = configs.get_config("380m")
    assert (gpu.mesh.data, gpu.mesh.fsdp, gpu.mesh.tensor) == (-1, 1, 1)
    for argv, want in ((["--mesh.fsdp", "-1"], (1, -1, 1)),
                       (["--mesh.tensor", "-1", "--mesh.fsdp", "2"], (1, 2, -1)),
                       (["--mesh.fsdp", "-1", "--mesh.data", "2"], (2, -1, 1)),
                       (["--mesh.fsdp", "4"], (-1, 4, 1))):
        mesh = configs.parse_config(["--config", "380m", *argv]).mesh
        assert (mesh.data, mesh.fsdp, mesh.tensor) == want, argv
    assert configs.override(gpu, {"mesh.fsdp": -1}).mesh == configs.MeshConfig(1, -1, 1)
    with pytest.raises(ValueError, match=r"^at most one of --mesh.data/--mesh.fsdp/--mesh.tensor"):
        configs.parse_config(["--mesh.data", "-1", "--mesh.fsdp", "-1"])


def test_the_script_form_names_the_module_form():
    root = Path(__file__).resolve().parents[2]
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
