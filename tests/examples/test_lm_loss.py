"""The example's memory-lean cross-entropy (examples/lm/loss.py): the chunked custom VJP against
the plain loss and an independent float64 reference, both head layouts, padding ids, a sequence
that is not a multiple of the chunk, jit / remat / scan, the compiled program's memory, bad
arguments. The sharded loss on 8 devices is test_lm_sharded.py's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from examples.lm import loss as loss_lib
from examples.lm import model as model_lib

# Odd, unequal sizes (a swapped axis cannot pass a shape check); T = 13 is not a multiple of the
# chunk, so the chunked path has a padded remainder chunk.
B, T, D, V, NUM_VALID, CHUNK = 3, 13, 16, 37, 30, 4
LAYOUTS = [1, 0]  # vocab_axis: a (D, V) kernel, a tied (V, D) table
PADDING = [None, NUM_VALID]


def _inputs(vocab_axis, dtype, num_valid, seed=0):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((B, T, D))
    head = rng.standard_normal((D, V) if vocab_axis else (V, D)) / np.sqrt(D) * 3
    targets = rng.integers(0, num_valid or V, (B, T))
    # The values the computation sees (bf16-rounded for bf16), so the float64 reference gets them.
    # Rounded on the host: no device op to compile.
    dtype = np.dtype(dtype)
    return hidden.astype(dtype), head.astype(dtype), targets.astype(np.int32)


def _loss(vocab_axis, num_valid, chunk_size, batch_groups=1):
    return functools.partial(loss_lib.cross_entropy, vocab_axis=vocab_axis, num_valid=num_valid,
                             chunk_size=chunk_size, batch_groups=batch_groups)


@functools.cache
def _value_and_grads(vocab_axis, num_valid, chunk_sizes, batch_groups=1):
    """One jitted program: the loss's value and gradients (d hidden, d head) for each of
    `chunk_sizes` (a tuple), on the same inputs. The unchunked loss and a chunked one are the
    pairs the tests compare; one program per pair compiles as fast as two, once instead of
    twice."""
    def f(hidden, head, targets):
        return tuple(jax.value_and_grad(_loss(vocab_axis, num_valid, c, batch_groups),
                                        argnums=(0, 1))(hidden, head, targets)
                     for c in chunk_sizes)
    return jax.jit(f)


# The chunk size each dtype's tests set beside the unchunked loss (None), in one program.
CHUNKS = {"float32": (None, CHUNK), "bfloat16": (None, 1)}


def _runs(vocab_axis, dtype, num_valid, chunk_sizes, **kwargs):
    """[(value, d hidden, d head)] per chunk size, float64 on the host."""
    out = _value_and_grads(vocab_axis, num_valid, chunk_sizes, **kwargs)(
        *_inputs(vocab_axis, dtype, num_valid))
    return [(float(value), np.asarray(d_hidden, np.float64), np.asarray(d_head, np.float64))
            for value, (d_hidden, d_head) in out]


def _reference(vocab_axis, dtype, num_valid):
    """float64 numpy: loss, d hidden, d head of the mean CE over the real tokens only."""
    hidden, head, targets = (np.asarray(x, np.float64 if x.dtype != jnp.int32 else np.int64)
                             for x in _inputs(vocab_axis, dtype, num_valid))
    W = head if vocab_axis else head.T  # (D, V)
    n = num_valid or V
    z = np.einsum("btd,dv->btv", hidden, W[:, :n])
    m = z.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
    loss = np.mean(lse - np.take_along_axis(z, targets[..., None], -1)[..., 0])
    dz = np.exp(z - lse[..., None]) - np.eye(n)[targets]
    dz = np.concatenate([dz, np.zeros((B, T, V - n))], -1) / (B * T)
    d_hidden = np.einsum("btv,dv->btd", dz, W)
    d_W = np.einsum("btd,btv->dv", hidden, dz)
    return loss, d_hidden, d_W if vocab_axis else d_W.T


def _close(actual, expected, rel):
    """max |actual - expected| <= rel * max |expected| (the gradients' scale, not each entry's)."""
    err, scale = np.max(np.abs(actual - expected)), np.max(np.abs(expected))
    assert err <= rel * scale, f"max error {err:.3g} > {rel:.1g} * {scale:.3g}"


@pytest.mark.parametrize("num_valid", PADDING)
@pytest.mark.parametrize("vocab_axis", LAYOUTS)
def test_float32_chunked_equals_plain_and_float64_reference(vocab_axis, num_valid):
    ref = _reference(vocab_axis, jnp.float32, num_valid)
    plain, chunked = _runs(vocab_axis, jnp.float32, num_valid, CHUNKS["float32"])
    for got in (plain, chunked):
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
        _close(got[1], ref[1], 1e-6)
        _close(got[2], ref[2], 1e-6)
    np.testing.assert_allclose(chunked[0], plain[0], rtol=2e-7)
    _close(chunked[1], plain[1], 5e-7)
    _close(chunked[2], plain[2], 5e-7)


BF16_ULP = 2.0**-8  # bf16 keeps 8 significant bits: one unit in the last place, relative


@pytest.mark.parametrize("vocab_axis", LAYOUTS)
def test_bfloat16_equals_plain_and_head_gradient_accumulates_in_float32(vocab_axis):
    """Same bf16 inputs: the value to float32 rounding, every gradient entry within one bf16 unit
    of the plain one (both round a float32 result once). One position per chunk makes 13 chunks:
    a head gradient summed in bf16 across them would be several units off the float64 value."""
    dtype = jnp.bfloat16
    ref = _reference(vocab_axis, dtype, NUM_VALID)
    plain, chunked = _runs(vocab_axis, dtype, NUM_VALID, CHUNKS["bfloat16"])
    np.testing.assert_allclose(chunked[0], plain[0], rtol=1e-6)
    for got, want in zip(chunked[1:], plain[1:], strict=True):
        np.testing.assert_allclose(got, want, rtol=BF16_ULP, atol=1e-3 * np.abs(want).max())
    # Against float64: a float32 sum rounded once to bf16 (half a unit) plus float32 noise.
    np.testing.assert_allclose(chunked[2], ref[2], rtol=BF16_ULP, atol=1e-4 * np.abs(ref[2]).max())


def _todays_loss(hidden, head, targets, *, vocab_axis, num_valid):
    """The example's loss before this module: the model's head and mask, then evaluate's CE."""
    if vocab_axis == 1:
        z = jax.lax.dot_general(hidden, head, (((2,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)
    else:
        z = jnp.einsum("btd,vd->btv", hidden, head, preferred_element_type=jnp.float32)
    z = z.astype(jnp.float32)
    if num_valid is not None:
        z = jnp.where(jnp.arange(V) < num_valid, z, jnp.finfo(jnp.float32).min / 2)
    return optax.softmax_cross_entropy_with_integer_labels(z, targets).mean()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("vocab_axis", LAYOUTS)
def test_unchunked_is_exactly_todays_computation(vocab_axis, dtype):
    """chunk_size None or >= T: bit for bit the plain loss and its autodiff gradients."""
    today = jax.jit(jax.value_and_grad(
        functools.partial(_todays_loss, vocab_axis=vocab_axis, num_valid=NUM_VALID),
        argnums=(0, 1)))
    inputs = _inputs(vocab_axis, dtype, NUM_VALID)
    want = today(*inputs)
    # chunk_size None: compiled and run (the program the dtype's other tests compile).
    got = _value_and_grads(vocab_axis, NUM_VALID, CHUNKS[np.dtype(dtype).name])(*inputs)[0]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    # chunk_size T: the very program of chunk_size None (lowered, the same StableHLO text), so
    # the same bits.
    lowered = {c: _value_and_grads(vocab_axis, NUM_VALID, (c,)).lower(*inputs).as_text()
               for c in (None, T)}
    assert lowered[T] == lowered[None]


@pytest.mark.parametrize("tied", [False, True], ids=["kernel", "tied"])
def test_logits_are_the_models_logits(tied):
    """`logits(hidden, head)` reproduces the Transformer's logits bit for bit (bf16 compute,
    padded vocabulary), so the model can call it instead of its own head and mask."""
    cfg = model_lib.ModelConfig(vocab_size=V, valid_vocab_size=NUM_VALID, d_model=D,
                                num_layers=1, num_heads=2, mlp_dim=24, max_seq_len=T,
                                compute_dtype="bfloat16", tied_embeddings=tied)
    # The model's structure with host-drawn parameters: the property holds for any values (the
    # padding rows are not zero here, so the mask alone hides them), and the initialisers, run
    # eagerly, would compile about twenty programs of their own.
    graphdef, abstract = nnx.split(
        nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    model = nnx.merge(graphdef, jax.tree.map(
        lambda x: (rng.standard_normal(x.shape) / np.sqrt(x.shape[0])).astype(x.dtype), abstract))
    tokens = np.random.default_rng(1).integers(0, NUM_VALID, (B, T)).astype(np.int32)

    @nnx.jit
    def both(model, tokens):
        want, hidden = model(tokens, return_hidden=True)
        head = model.embed.embedding[...] if tied else model.lm_head.kernel[...]
        got = loss_lib.logits(hidden, head.astype(hidden.dtype), vocab_axis=0 if tied else 1,
                              num_valid=NUM_VALID)
        return got, want

    got, want = both(model, tokens)
    assert got.dtype == jnp.float32 and got.shape == (B, T, V)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("chunk_size", [None, CHUNK])
@pytest.mark.parametrize("vocab_axis", LAYOUTS)
def test_padding_ids_get_exactly_zero_gradient(vocab_axis, chunk_size):
    chunks = CHUNKS["float32"]  # the float32 test's program
    _, _, d_head = _runs(vocab_axis, jnp.float32, NUM_VALID, chunks)[chunks.index(chunk_size)]
    padding = np.take(d_head, np.arange(NUM_VALID, V), axis=vocab_axis)
    real = np.take(d_head, np.arange(NUM_VALID), axis=vocab_axis)
    assert np.all(padding == 0.0) and np.all(np.abs(real).max(axis=1 - vocab_axis) > 0)


def test_under_remat_and_inside_a_scan_body():
    """jax.checkpoint around the chunked loss, and the loss in a scan over two micro-batches (as
    gradient accumulation runs it), give the same value and gradients as the plain call."""
    vocab_axis = 1
    hidden, head, targets = _inputs(vocab_axis, jnp.float32, NUM_VALID)
    f = _loss(vocab_axis, NUM_VALID, CHUNK)
    # The plain calls: the chunked loss of the float32 test's program, on each micro-batch.
    plain = _value_and_grads(vocab_axis, NUM_VALID, CHUNKS["float32"])
    want_value, (want_h, want_w) = plain(hidden, head, targets)[1]

    # Two micro-batches: this batch and the same one with another seed's hidden states.
    other, _, other_targets = _inputs(vocab_axis, jnp.float32, NUM_VALID, seed=1)
    other_value, (_, other_w) = plain(other, head, other_targets)[1]

    @jax.jit  # both checks in one program: the remat and the scan are separate computations
    def remat_and_accumulated(hidden_2, head, targets_2):
        remat = jax.value_and_grad(jax.checkpoint(f), argnums=(0, 1))(
            hidden_2[0], head, targets_2[0])

        def micro(acc, xs):
            value, (_, d_head) = jax.value_and_grad(f, argnums=(0, 1))(xs[0], head, xs[1])
            return jax.tree.map(jnp.add, acc, (value, d_head)), None
        return remat, jax.lax.scan(micro, (jnp.zeros(()), jnp.zeros_like(head)),
                                   (hidden_2, targets_2))[0]

    remat, (value, d_head) = remat_and_accumulated(
        np.stack([hidden, other]), head, np.stack([targets, other_targets]))
    np.testing.assert_allclose(remat[0], want_value, rtol=1e-6)
    _close(np.asarray(remat[1][0]), np.asarray(want_h), 1e-6)
    _close(np.asarray(remat[1][1]), np.asarray(want_w), 1e-6)
    np.testing.assert_allclose(value, float(want_value) + float(other_value), rtol=1e-6)
    _close(np.asarray(d_head), np.asarray(want_w, np.float64) + np.asarray(other_w), 1e-6)


def test_batch_groups_change_only_the_summation_order():
    """batch_groups = 3 (one group per row here): the same value, gradients to float32 order."""
    plain = _runs(0, jnp.float32, NUM_VALID, CHUNKS["float32"])[1]  # the float32 test's
    grouped, = _runs(0, jnp.float32, NUM_VALID, (CHUNK,), batch_groups=B)
    assert grouped[0] == plain[0]
    _close(grouped[1], plain[1], 0.0)  # the hidden gradient does not depend on the groups
    _close(grouped[2], plain[2], 5e-7)


def test_constrain_logits_sees_every_chunk_and_its_gradient():
    seen = []

    def record(z):
        seen.append((z.shape, z.dtype))
        return z

    hidden, head, targets = _inputs(1, jnp.bfloat16, None)
    f = functools.partial(loss_lib.cross_entropy, vocab_axis=1, chunk_size=CHUNK,
                          constrain_logits=record)
    jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(hidden, head, targets)
    # Traced once per scan body: the forward's logits; the backward's logits and their gradient.
    assert seen == [((B, CHUNK, V), jnp.float32)] * 3
    seen.clear()
    jax.make_jaxpr(functools.partial(f, chunk_size=None))(hidden, head, targets)
    assert seen == [((B, T, V), jnp.float32)]


# One device, abstract inputs (nothing allocated): the compiled value-and-gradient's temporaries.
MEM_B, MEM_T, MEM_D, MEM_V, MEM_CHUNK = 8, 256, 64, 4096, 16


@pytest.mark.parametrize("vocab_axis", LAYOUTS)
def test_compiled_chunked_program_holds_no_full_logits(vocab_axis):
    """Plain autodiff needs at least the whole float32 logits (B·T·V·4 bytes) as temporaries; the
    chunked program at most three float32 logits chunks plus a few float32 head- and
    hidden-sized buffers (the head's gradient sum, d hidden), a third of the whole logits here."""
    args = (jax.ShapeDtypeStruct((MEM_B, MEM_T, MEM_D), jnp.bfloat16),
            jax.ShapeDtypeStruct((MEM_D, MEM_V) if vocab_axis else (MEM_V, MEM_D), jnp.bfloat16),
            jax.ShapeDtypeStruct((MEM_B, MEM_T), jnp.int32))
    full_logits = MEM_B * MEM_T * MEM_V * 4
    temp = {}
    for chunk_size in (None, MEM_CHUNK):
        f = functools.partial(loss_lib.cross_entropy, vocab_axis=vocab_axis,
                              chunk_size=chunk_size)
        compiled = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(*args).compile()
        temp[chunk_size] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[None] >= full_logits, temp
    chunk, head, hidden = (4 * MEM_B * MEM_CHUNK * MEM_V, 4 * MEM_D * MEM_V,
                           4 * MEM_B * MEM_T * MEM_D)
    bound = 3 * chunk + 4 * head + 4 * hidden
    assert bound < full_logits / 2 and temp[MEM_CHUNK] <= bound, (temp, bound)


def _bad(**kwargs):
    hidden, head, targets = _inputs(1, jnp.float32, None)
    args = {"hidden_BTD": hidden, "head": head, "targets_BT": targets, "vocab_axis": 1} | kwargs
    return loss_lib.cross_entropy(args.pop("hidden_BTD"), args.pop("head"),
                                  args.pop("targets_BT"), **args)


BAD = {
    "vocab_axis": dict(vocab_axis=2),
    "vocab_axis_swapped": dict(vocab_axis=0),  # a (D, V) kernel read as a (V, D) table
    # Host arrays: the checks read shapes and dtypes, and nothing compiles at collection.
    "hidden_BTD": dict(hidden_BTD=np.zeros((B * T, D), np.float32)),
    "head": dict(head=np.zeros((D, V, 1), np.float32)),
    "head_dtype": dict(head=np.zeros((D, V), jnp.bfloat16)),
    "targets_BT": dict(targets_BT=np.zeros((B, T + 1), np.int32)),
    "targets_BT_dtype": dict(targets_BT=np.zeros((B, T), np.float32)),
    "num_valid": dict(num_valid=V + 1),
    "num_valid_zero": dict(num_valid=0),
    "chunk_size": dict(chunk_size=0),
    "chunk_size_float": dict(chunk_size=4.0),
    "batch_groups": dict(batch_groups=2),  # does not divide B = 3
    "constrain_logits": dict(constrain_logits="tensor"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_arguments_raise_naming_the_parameter(case):
    name = {"head_dtype": "hidden_BTD", "vocab_axis_swapped": "vocab_axis"}.get(
        case, case.removesuffix("_dtype").removesuffix("_zero").removesuffix("_float"))
    with pytest.raises(ValueError, match=name):
        _bad(**BAD[case])


