"""The example LM (examples/lm/model.py): shapes, causality, RoPE, tying, param paths, sharding
annotations, mixed precision, parameter and FLOP counts."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from examples.lm import model as model_lib
from examples.lm import sharding
from examples.lm.tools import train_compile

# Odd vocabulary and unequal widths, so a swapped axis cannot pass a shape check.
CFG = model_lib.ModelConfig(vocab_size=61, d_model=32, num_layers=2, num_heads=4, mlp_dim=48,
                            max_seq_len=16)
TIED = dataclasses.replace(CFG, tied_embeddings=True)


def _tokens(rng, b=2, t=12, v=CFG.vocab_size):
    return rng.integers(0, v, size=(b, t)).astype(np.int32)  # host ids: no device op to compile


@functools.cache
def _model(cfg, seed=0) -> model_lib.Transformer:
    """`Transformer(cfg, rngs=nnx.Rngs(seed))`, built once per module (no test changes a model).
    Eagerly: its initialisers compile once per parameter shape, shared by every config of these
    shapes, where a jitted constructor per config compiles all of its random draws again (the
    five configs here: 15 s CPU jitted against 5 s eagerly)."""
    return model_lib.Transformer(cfg, rngs=nnx.Rngs(seed))


def _abstract(cfg) -> model_lib.Transformer:
    """The model of `cfg` as shapes, dtypes and metadata only (nothing computed or compiled)."""
    return nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))


def _paths(model) -> dict[str, nnx.Param]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, path)): var for path, var in flat}


@nnx.jit
def _forward(model, tokens):
    return model(tokens, return_hidden=True)


@functools.partial(nnx.jit, static_argnames="with_grads")
def _forward_and_loss(model, tokens, targets, *, with_grads):
    """Logits, hidden state and `model.loss`, with the loss's parameter gradients if
    `with_grads` (they triple the compile time): one program per config for the tests that need
    more than the forward pass."""
    logits, hidden = model(tokens, return_hidden=True)
    if not with_grads:
        return logits, hidden, model.loss(tokens, targets), None
    loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens, targets))(model)
    return logits, hidden, loss, grads


def test_forward_shapes_and_dtypes(rng):
    model = _model(CFG, 0)
    tokens = _tokens(rng)
    logits, hidden = _forward(model, tokens)
    assert logits.shape == (2, 12, CFG.vocab_size) and logits.dtype == jnp.float32
    assert hidden.shape == (2, 12, CFG.d_model)
    assert np.isfinite(np.asarray(logits)).all()
    # The final norm makes every hidden row unit-RMS before the (all-ones at init) scale.
    hidden = np.asarray(hidden, np.float64)
    np.testing.assert_allclose(np.sqrt(np.mean(hidden**2, axis=-1)), 1.0, rtol=1e-3)


def test_causal_future_tokens_do_not_change_earlier_logits(rng):
    model = _model(CFG, 1)
    tokens = _tokens(rng)
    k = 7
    changed = tokens.copy()
    changed[:, k] = (tokens[:, k] + 1) % CFG.vocab_size
    before, after = (np.asarray(_forward(model, t)[0]) for t in (tokens, changed))
    np.testing.assert_allclose(after[:, :k], before[:, :k], rtol=0, atol=1e-6)
    assert np.abs(after[:, k:] - before[:, k:]).max(axis=-1).min() > 1e-4  # k and later see it


def _rope_reference(x, positions, theta):
    """fp64 complex rotation: pair (i, i + H/2) is z_i = x_i + 1j x_{i+H/2}, times e^{1j p w_i}."""
    half = x.shape[-1] // 2
    freq = theta ** (-np.arange(half) / half)
    z = x[..., :half] + 1j * x[..., half:]
    z = z * np.exp(1j * positions[None, :, None, None] * freq)
    return np.concatenate([z.real, z.imag], axis=-1)


# One compiled program for every call below (same shapes): eagerly, each op compiles its own.
_rope = jax.jit(model_lib.apply_rope, static_argnames="theta")


def test_rope_matches_complex_rotation_and_is_relative(rng):
    x = rng.standard_normal((1, 9, 2, 8))
    positions = np.arange(9, dtype=np.int32) * 37  # large positions: the fp32 angle path
    out = np.asarray(_rope(x.astype(np.float32), positions, theta=1e4), np.float64)
    np.testing.assert_allclose(out, _rope_reference(x, positions, 1e4), rtol=0, atol=2e-4)
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    # Attention scores of one query vector and one key vector placed at every position depend on
    # the offset m - n only. The query and the key go in as the two heads of one call.
    q = np.broadcast_to(rng.standard_normal(8), (1, 9, 8))
    k = np.broadcast_to(rng.standard_normal(8), (1, 9, 8))
    rotated = np.asarray(_rope(np.stack([q, k], axis=2).astype(np.float32),
                               np.arange(9, dtype=np.int32), theta=1e4), np.float64)
    rq, rk = rotated[0, :, 0], rotated[0, :, 1]
    scores = rq @ rk.T
    for offset in range(-8, 9):
        diagonal = np.diagonal(scores, offset=offset)
        np.testing.assert_allclose(diagonal, diagonal[0], rtol=0, atol=1e-4)
    assert np.ptp(scores) > 0.1  # and the offset does matter


UNTIED_PATHS = {"embed/embedding", "final_norm/scale", "lm_head/kernel"} | {
    f"layers/{i}/{name}" for i in range(CFG.num_layers) for name in (
        "attn/q_proj/kernel", "attn/k_proj/kernel", "attn/v_proj/kernel", "attn/o_proj/kernel",
        "mlp/gate_proj/kernel", "mlp/up_proj/kernel", "mlp/down_proj/kernel",
        "attn_norm/scale", "mlp_norm/scale")}


def test_param_paths_are_the_contract():
    assert set(_paths(_abstract(CFG))) == UNTIED_PATHS
    assert set(_paths(_abstract(TIED))) == UNTIED_PATHS - {"lm_head/kernel"}
    scanned = _paths(_abstract(dataclasses.replace(CFG, scan_layers=True)))
    assert set(scanned) == {p.replace("layers/0/", "layers/") for p in UNTIED_PATHS
                            if not p.startswith("layers/1/")}
    assert scanned["layers/mlp/up_proj/kernel"].shape == (CFG.num_layers, CFG.d_model,
                                                          CFG.mlp_dim)


@pytest.mark.parametrize("cfg", [dataclasses.replace(CFG, valid_vocab_size=50), TIED],
                         ids=["padded", "tied"])
def test_loss_is_the_cross_entropy_of_the_logits(rng, cfg):
    model = _model(cfg, 2)
    x, y = _tokens(rng, v=50), _tokens(rng, v=50)
    # (the tied config's program is also test_head_matrix_untied_and_tied's, which reads the
    # gradients)
    logits, _, loss, _ = _forward_and_loss(model, x, y, with_grads=cfg.tied_embeddings)
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    expected = np.mean(logz - np.take_along_axis(logits, y[..., None], -1)[..., 0])
    np.testing.assert_allclose(loss, expected, rtol=1e-6)


def test_head_matrix_untied_and_tied(rng):
    tokens = _tokens(rng)
    untied = _model(CFG, 0)
    head, axis = model_lib.head_matrix(untied)
    assert axis == 1 and head.shape == (CFG.d_model, CFG.vocab_size)
    np.testing.assert_array_equal(head, untied.lm_head.kernel[...])
    logits, hidden = _forward(untied, tokens)
    np.testing.assert_allclose(logits, np.asarray(hidden, np.float64) @ np.asarray(head),
                               rtol=1e-4, atol=1e-4)

    tied = _model(TIED, 0)
    assert tied.lm_head is None
    table, axis = model_lib.head_matrix(tied)
    assert axis == 0 and table.shape == (CFG.vocab_size, CFG.d_model)
    np.testing.assert_array_equal(table, tied.embed.embedding[...])
    # (test_loss_is_the_cross_entropy_of_the_logits[tied]'s program: the same config and shapes)
    logits, hidden, _, grads = _forward_and_loss(tied, tokens, _tokens(rng), with_grads=True)
    np.testing.assert_allclose(logits, np.asarray(hidden, np.float64) @ np.asarray(table).T,
                               rtol=1e-4, atol=1e-4)
    # One table, two uses: rows of tokens absent from the input still get a gradient (the head's).
    grad = np.asarray(grads["embed"]["embedding"][...])
    absent = np.setdiff1d(np.arange(CFG.vocab_size), tokens)
    assert absent.size and (np.abs(grad[absent]).max(axis=1) > 0).all()


EXPECTED_NAMES = {
    "embed/embedding": ("vocab", "embed"), "lm_head/kernel": ("embed", "vocab"),
    "q_proj": ("embed", "heads"), "k_proj": ("embed", "heads"), "v_proj": ("embed", "heads"),
    "gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"),
    "o_proj": ("heads", "embed"), "down_proj": ("mlp", "embed"), "scale": ("norm",)}
# What the names mean on a (data, fsdp, tensor) mesh (sharding.RULES): FSDP along the model width,
# tensor parallelism along heads, MLP width and vocabulary.
EXPECTED_SPECS = {
    "embed/embedding": ("tensor", "fsdp"), "lm_head/kernel": ("fsdp", "tensor"),
    "q_proj": ("fsdp", "tensor"), "k_proj": ("fsdp", "tensor"), "v_proj": ("fsdp", "tensor"),
    "gate_proj": ("fsdp", "tensor"), "up_proj": ("fsdp", "tensor"),
    "o_proj": ("tensor", "fsdp"), "down_proj": ("tensor", "fsdp"), "scale": (None,)}


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_every_param_is_annotated_with_logical_axes(scan):
    model = _abstract(dataclasses.replace(CFG, scan_layers=scan))
    mesh = jax.sharding.AbstractMesh((1, 4, 2), ("data", "fsdp", "tensor"))
    stacked = ("layers",) if scan else ()
    for path, var in _paths(model).items():
        key = next(k for k in EXPECTED_NAMES if k in path)
        in_block = path.startswith("layers/")
        names = (stacked if in_block else ()) + EXPECTED_NAMES[key]
        assert var.get_metadata()["out_sharding"] == names, path
        assert len(names) == var.ndim, path
        spec = sharding.fit_spec(var.shape, sharding.mesh_axes(names), mesh)
        want = ((None,) if scan and in_block else ()) + EXPECTED_SPECS[key]
        # An axis that does not divide its dimension (vocabulary 61 over 2) is dropped.
        want = tuple(None if a is not None and var.shape[i] % mesh.shape[a] else a
                     for i, a in enumerate(want))
        assert tuple(spec) == want, path


def test_sharding_rules_name_mesh_axes_and_unknown_names_fail():
    mesh_axes = {"data", "fsdp", "tensor"}
    for name, axes in sharding.RULES.items():
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        assert set(axes) <= mesh_axes, name
    assert sharding.RULES["activation_batch"] == ("data", "fsdp")
    assert sharding.RULES["activation_embed"] is None  # the residual stream stays whole
    with pytest.raises(KeyError, match="'activation_typo'.*not in examples.lm.sharding.RULES"):
        sharding.mesh_axes(("activation_typo",))
    x = np.zeros((2, 3))  # host arrays: nothing to compile, and constrain reads only the shape
    assert sharding.constrain(x, "activation_batch", None) is x  # no mesh: nothing to do
    with pytest.raises(ValueError, match="2 axis names"):
        sharding.constrain(np.zeros((2, 3, 4)), "activation_batch", None)


def _stack(unrolled_params):
    """The unrolled model's parameters in the scanned layout: layers/i/x -> layers/x (L, ...)."""
    blocks = unrolled_params["layers"]
    out = dict(unrolled_params)
    out["layers"] = jax.tree.map(lambda *xs: np.stack(xs), *[blocks[i] for i in sorted(blocks)])
    return out


@pytest.fixture(scope="module")
def layouts():
    """One set of weights in both layouts, and a jitted loss-and-gradient per (scan, remat)."""
    unrolled = _model(CFG, 5)
    params = nnx.to_pure_dict(nnx.state(unrolled, nnx.Param))

    @functools.cache  # one compile per layout: the unrolled reference is shared
    def value_and_grad(scan, remat):
        cfg = dataclasses.replace(CFG, scan_layers=scan, remat=remat)
        abstract = nnx.eval_shape(lambda: model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
        gd, _, rest = nnx.split(abstract, nnx.Param, ...)
        loss = lambda p, x, y: nnx.merge(gd, p, rest).loss(x, y)
        return jax.jit(jax.value_and_grad(loss))

    return params, value_and_grad


@pytest.mark.parametrize("scan,remat", [(True, "none"), (False, "block"), (True, "dots")])
def test_scan_and_remat_give_the_unrolled_loss_and_gradients(layouts, rng, scan, remat):
    params, value_and_grad = layouts
    x, y = _tokens(rng), _tokens(rng)
    loss, grads = value_and_grad(False, "none")(params, x, y)
    as_layout = _stack if scan else (lambda p: p)
    loss2, grads2 = value_and_grad(scan, remat)(as_layout(params), x, y)
    np.testing.assert_allclose(loss2, loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7),
                 grads2, as_layout(grads))


def test_scanned_blocks_are_initialised_layer_by_layer():
    model = _model(dataclasses.replace(CFG, scan_layers=True), 0)
    q = np.asarray(model.layers.attn.q_proj.kernel[...])
    assert q.shape == (CFG.num_layers, CFG.d_model, CFG.d_model)
    assert not np.allclose(q[0], q[1])  # each layer has its own key
    np.testing.assert_allclose(q.std(axis=(1, 2)), 1 / np.sqrt(CFG.d_model), rtol=0.15)


def test_explicit_mesh_axes_are_rejected_clearly(rng):
    model = _model(CFG, 0)
    mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 3)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="AxisType.Auto"):
        model(_tokens(rng))


def test_bf16_compute_keeps_f32_params_and_tracks_f32_logits(rng):
    tokens = _tokens(rng)
    f32 = _model(CFG, 3)
    bf16 = _model(dataclasses.replace(CFG, compute_dtype="bfloat16"), 3)
    for var in _paths(bf16).values():
        assert var.dtype == jnp.float32
    ref, _ = _forward(f32, tokens)
    logits, hidden = _forward(bf16, tokens)
    assert logits.dtype == jnp.float32 and hidden.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(logits)).all()
    # bf16 keeps 8 significant bits (2^-8 = 0.4 %); measured 0.5 % here after two blocks.
    err = np.abs(np.asarray(logits) - np.asarray(ref)).max() / np.abs(np.asarray(ref)).max()
    assert err < 0.02, err


def test_config_and_input_validation(rng):
    """Each error names the field by its trainer flag (`--model.<field>`)."""
    with pytest.raises(ValueError, match=r"^--model.d_model \(32\) must be divisible by "
                                         r"--model.num_heads \(5\)$"):
        dataclasses.replace(CFG, num_heads=5)
    with pytest.raises(ValueError, match="--model.d_model / --model.num_heads = 9 must be even"):
        dataclasses.replace(CFG, d_model=36, num_heads=4)
    with pytest.raises(ValueError, match="^--model.compute_dtype must be a floating dtype"):
        dataclasses.replace(CFG, compute_dtype="int32")
    with pytest.raises(ValueError, match="^--model.num_layers must be a positive int"):
        dataclasses.replace(CFG, num_layers=0)
    model = _model(CFG, 0)
    with pytest.raises(ValueError, match="exceeds --model.max_seq_len"):
        model(_tokens(rng, t=CFG.max_seq_len + 1))


@pytest.mark.parametrize("cfg", [CFG, TIED], ids=["untied", "tied"])
def test_param_count_and_flops(cfg):
    d, L, f, V = cfg.d_model, cfg.num_layers, cfg.mlp_dim, cfg.vocab_size
    model = _abstract(cfg)
    n = train_compile.param_count(cfg)
    assert n == sum(v.size for v in _paths(model).values())
    norms = (2 * L + 1) * d
    assert n == V * d * (1 if cfg.tied_embeddings else 2) + L * (4 * d * d + 3 * d * f) + norms
    # 6 x (matmul parameters) + attention: the lookup table and the norms are not matmuls, but a
    # tied table is also the head matmul.
    matmul = n - norms - (0 if cfg.tied_embeddings else V * d)
    assert model_lib.flops_per_token(cfg) == 6 * matmul + 12 * L * d * cfg.max_seq_len


def test_weight_gradients_match_float64_and_are_formed_in_float32():
    """`model._matmul` (the Linear layers' matmul) and `model._lookup` (the embedding's rows):
    their gradients against numpy float64, and with bf16 operands, the weight gradients' matmul
    and scatter-add in float32 (the sum over the batch, which devices complete with a
    collective, stays float32 until one rounding to bf16)."""
    rng = np.random.default_rng(0)
    x, kernel = rng.normal(size=(3, 5, 8)), rng.normal(size=(8, 4))
    table, ids = rng.normal(size=(6, 8)), rng.integers(0, 6, (3, 5)).astype(np.int32)

    def loss(x, kernel, table):
        return (jnp.sum(jnp.sin(model_lib._matmul(x, kernel)))
                + jnp.sum(jnp.cos(model_lib._lookup(table, ids))))

    grads = jax.grad(loss, argnums=(0, 1, 2))
    got = jax.jit(grads)(*(a.astype(np.float32) for a in (x, kernel, table)))
    dy = np.cos(x @ kernel)  # float64 reference
    dtable = np.zeros_like(table)
    np.add.at(dtable, ids, -np.sin(table[ids]))
    for g, want in zip(got, (dy @ kernel.T, np.einsum("btd,btf->df", x, dy), dtable),
                       strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float64), want, rtol=1e-5, atol=1e-5)
    bf16 = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in (x, kernel, table)]
    jaxpr = str(jax.make_jaxpr(grads)(*bf16))
    assert "preferred_element_type=float32" in jaxpr, jaxpr  # the kernel's gradient
    assert "scatter-add" in jaxpr and "f32[6,8]" in jaxpr, jaxpr  # the table's, in float32
    assert all(v.dtype == jnp.bfloat16 for v in jax.eval_shape(grads, *bf16))
