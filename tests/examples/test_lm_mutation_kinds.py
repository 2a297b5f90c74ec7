"""Fast checks of the example LM for the kinds of bug a held-out mutation test found surviving the
fast subset (issue 35, "Tests that catch what slipped through"); each is a mutant of
benchmarks/mutation_test.py:

- the remat policy ignored: `dots` recomputes the whole block like `block` (the compiled
  gradient's matmul count);
- the parameters not cast to the compute dtype, on their own shardings, before the forward pass
  (FSDP would gather float32; read from the lowered step);
- the chunked loss's backward pass ignoring its incoming cotangent (a scaled loss's gradient,
  against the plain computation's);
- under gradient accumulation, the logged `train_loss` being the last micro-batch's, not the mean;
- the compile report's (`tools/train_compile.py`) model FLOPs not divided per device.
"""

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from examples.lm import configs, train
from examples.lm import loss as loss_lib
from examples.lm import model as model_lib
from examples.lm import sharding as mesh_lib
from examples.lm import train as trainer_lib
from examples.lm.tools import train_compile

CFG = model_lib.ModelConfig(vocab_size=61, d_model=32, num_layers=1, num_heads=4, mlp_dim=48,
                            max_seq_len=16)


def _gradient_program(remat: str) -> str:
    """The optimized HLO of the loss's gradient, blocks unrolled, under `remat`."""
    cfg = dataclasses.replace(CFG, scan_layers=False, remat=remat)
    abstract = nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    gd, params, rest = nnx.split(abstract, nnx.Param, ...)
    loss = lambda p, x, y: nnx.merge(gd, p, rest).loss(x, y)
    tokens = jax.ShapeDtypeStruct((2, 12), jnp.int32)
    return jax.jit(jax.grad(loss)).lower(nnx.to_pure_dict(params), tokens, tokens).compile() \
        .as_text()


def _matmuls(hlo: str) -> int:
    return len(re.findall(r"= \S+ dot\(", hlo))


def test_remat_dots_saves_the_weight_matmuls_that_block_recomputes():
    """`dots` keeps the matmuls against weights (no batch dimension) and recomputes only the
    rest; `block` recomputes the whole block's forward pass, matmuls included. Counted in the
    compiled gradient: none < dots < block. A policy ignored makes dots equal block; remat
    without its CSE guard outside a scan (`prevent_cse`) lets XLA merge the recomputed attention
    matmuls back into the forward pass, which makes dots equal none (nothing recomputed, the
    activations kept after all)."""
    none, dots, block = (_matmuls(_gradient_program(r)) for r in ("none", "dots", "block"))
    # The attention's two batched matmuls (scores, weighted values), recomputed by dots.
    assert none < dots < block, (none, dots, block)
    # The block's weight matmuls: q, k, v, o and the MLP's two or three.
    assert block - dots >= 6, (none, dots, block)


def test_params_are_cast_on_their_shardings_before_the_forward_pass():
    """With compute_dtype bfloat16, every float32 parameter enters the forward pass as a bfloat16
    copy pinned to the parameter's own sharding (so FSDP gathers the narrow copy): one sharding
    constraint of a bfloat16 array of the parameter's shape per parameter, in the lowered step."""
    cfg = configs.override(configs.get_config("test"), {"model.compute_dtype": "bfloat16"})
    mesh = mesh_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    trainer = trainer_lib.Trainer(cfg, mesh)
    tokens = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.seq_len), jnp.int32,
                                  sharding=mesh_lib.batch_sharding(mesh))
    with jax.set_mesh(mesh):
        text = trainer.grad_step.lower(trainer.abstract_state, tokens, tokens).as_text()
    pinned = re.findall(r"(?:sdy\.sharding_constraint|custom_call @Sharding)[^\n]*"
                        r"tensor<([0-9x]*)xbf16>", text)
    params = jax.tree.leaves(trainer.abstract_state["params"])
    assert all(p.dtype == jnp.float32 for p in params)
    want = collections.Counter("x".join(map(str, p.shape)) for p in params)
    assert not want - collections.Counter(pinned), (pinned, want)


@pytest.mark.parametrize("vocab_axis", [1, 0])
def test_chunked_backward_scales_with_the_incoming_cotangent(vocab_axis):
    """The gradient of 3.5 * loss - the chunked loss inside a larger expression, as under a
    loss scale or gradient accumulation - is 3.5 times the plain computation's."""
    rng = np.random.default_rng(0)
    B, T, D, V = 2, 7, 8, 11
    hidden = rng.standard_normal((B, T, D)).astype(np.float32)
    head = rng.standard_normal((D, V) if vocab_axis else (V, D)).astype(np.float32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)

    @jax.jit  # every gradient below in one program (eagerly, each op would compile its own)
    def gradients(hidden, head, targets):
        def scaled(chunk_size):
            def f(h, w):
                return 3.5 * loss_lib.cross_entropy(h, w, targets, vocab_axis=vocab_axis,
                                                    chunk_size=chunk_size) + 1.0
            return jax.grad(f, argnums=(0, 1))(hidden, head)

        unscaled = jax.grad(lambda h: loss_lib.cross_entropy(h, head, targets,
                                                             vocab_axis=vocab_axis))(hidden)
        return scaled(None), scaled(3), unscaled

    want, got, unscaled = gradients(hidden, head, targets)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-7)
    # and the plain gradient itself is 3.5 times the unscaled one (an independent anchor)
    np.testing.assert_allclose(want[0], 3.5 * np.asarray(unscaled), rtol=1e-5, atol=1e-8)


class _Trainer:
    """What `_Loop.step` calls of a Trainer: a jitted step whose loss is the micro-batch's id."""

    head_lr = staticmethod(lambda step: jnp.float32(0.0))
    rates = None
    train_step = staticmethod(jax.jit(
        lambda state, inputs, targets, rates: (state + 1, inputs * 1.0)))


class _Batches:
    def get(self, index):
        return jnp.float32(index), None


def test_logged_train_loss_is_the_mean_over_the_micro_batches():
    cfg = configs.override(configs.get_config("test"), {
        "optim.grad_accum_steps": 3, "log_every": 1, "steps": 100, "eval.every": 100,
        "eval.diameter_every": 0, "eval.probe_last_steps": 0})
    written = []
    loop = object.__new__(train._Loop)
    loop.cfg, loop.trainer, loop.accum = cfg, _Trainer(), 3
    loop.train_batches, loop.lr = _Batches(), lambda step: 0.0
    loop.writer = type("W", (), {"write": staticmethod(written.append)})()
    loop.tokens_per_step, loop.flops_per_token, loop.peak_flops = 1, 1.0, None
    loop.window_start, loop.window_steps = 0.0, 0
    state, record = loop.step(jnp.int32(0), step=2)
    # step 2 applies micro-batches 3, 4, 5 (their losses here): the mean is 4, the last 5
    assert int(state) == 3 and written == [record]
    assert record["step"] == 2 and record["train_loss"] == pytest.approx(4.0)


def test_train_compile_model_flops_are_per_device(monkeypatch):
    """`train_compile`'s model FLOPs are the whole batch's (6N + attention per token) divided by the
    devices, like the compiled step's matmul FLOPs it is compared with. The compile is stubbed
    (one device here): a stand-in step on a one-device mesh, `devices` naming two."""
    cfg = configs.override(configs.get_config("test"), {"mesh.data": 1, "mesh.fsdp": 2})
    one = jax.devices()[:1]

    class Stub:
        def __init__(self, cfg, mesh):
            self.abstract_state = {"params": {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}}
            self.grad_step = jax.jit(lambda state, inputs, targets: inputs.sum())

    monkeypatch.setattr(trainer_lib, "Trainer", Stub)
    make_mesh = mesh_lib.make_mesh
    monkeypatch.setattr(train_compile.mesh_lib, "make_mesh",
                        lambda *sizes, devices: make_mesh(1, 1, 1, devices=one))
    out = train_compile.compile_step(cfg, one * 2, step="grad_step")
    whole = model_lib.flops_per_token(cfg.model) * cfg.data.batch_size * cfg.seq_len
    assert out["devices"] == 2
    assert out["model_flops"] == pytest.approx(whole / 2)
