"""A small decoder-only transformer in flax.nnx for the rowgeom LM example.

Pre-norm blocks (RMSNorm -> causal self-attention with RoPE -> residual, RMSNorm -> SwiGLU MLP ->
residual), a final RMSNorm and an LM head that is a separate `nnx.Linear` (kernel (d, V)) unless
`tied_embeddings`, in which case the logits reuse the embedding table (V, d).

Shapes are suffixed to names: B batch, T sequence, D model width, N heads, H head width, F MLP
width, V vocabulary. Every parameter carries an `out_sharding` annotation in the mesh axis names
("data", "fsdp", "tensor"). The annotation is metadata only (see `_sharded`), so the same code runs
on one device or, with parameters placed by their specs, on a mesh whose axes are
`jax.sharding.AxisType.Auto` (XLA propagates activation shardings from parameters and inputs).

Mixed precision: parameters are stored in `param_dtype` (fp32 master weights) and cast to
`compute_dtype` (e.g. bf16) for matmuls and activations. Norm statistics, RoPE, the attention
softmax and the logits are computed in fp32.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

# Mesh axis names used by the sharding annotations below.
FSDP, TENSOR = "fsdp", "tensor"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The transformer's shape, dtypes and vocabulary; validated on creation. Its fields are the
    trainer's `--model.*` flags, and its errors name them so."""

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    max_seq_len: int
    tied_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    compute_dtype: str = "float32"
    param_dtype: str = "float32"
    # Token ids >= valid_vocab_size are padding (a vocabulary rounded up to a multiple of 128):
    # their embedding and head rows start at zero and their logits are masked, so they are never
    # predicted and get no gradient. None: every id is a token.
    valid_vocab_size: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--model.{name} must be a positive int, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"--model.d_model ({self.d_model}) must be divisible by --model.num_heads "
                f"({self.num_heads})")
        if self.head_dim % 2:
            raise ValueError(
                f"the head width --model.d_model / --model.num_heads = {self.head_dim} must be "
                "even for RoPE")
        valid = self.valid_vocab_size
        if valid is not None and (not isinstance(valid, int) or not 1 <= valid <= self.vocab_size):
            raise ValueError(f"--model.valid_vocab_size must be an int in [1, --model.vocab_size"
                             f" = {self.vocab_size}] or none, got {valid!r}")
        for name in ("compute_dtype", "param_dtype"):
            dtype = jnp.dtype(getattr(self, name))
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"--model.{name} must be a floating dtype, got {dtype}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def num_tokens(self) -> int:
        """Number of real (predictable) tokens."""
        return self.vocab_size if self.valid_vocab_size is None else self.valid_vocab_size


def _zero_padding(init, num_tokens: int, vocab_axis: int):
    """`init` with the rows >= num_tokens along `vocab_axis` set to zero."""

    def padded_init(key, shape, dtype=jnp.float32):
        value = init(key, shape, dtype)
        if num_tokens >= shape[vocab_axis]:
            return value
        ids = jnp.arange(shape[vocab_axis]).reshape([-1 if a == vocab_axis else 1
                                                     for a in range(len(shape))])
        return jnp.where(ids < num_tokens, value, jnp.zeros((), dtype))

    return padded_init


def _sharded(names: tuple) -> dict:
    """Variable metadata for a parameter sharded over mesh axes `names`.

    The annotation is metadata only (`eager_sharding=False`): flax 0.12 would otherwise shard each
    variable as it is created, which needs an active mesh and fails when a mesh axis does not
    divide the dimension (a vocabulary of 50257 over 4 "tensor" devices). Placement is the
    trainer's job: read the specs with `nnx.get_partition_spec`, drop the axes that do not divide,
    and create the parameters under `jax.jit(..., out_shardings=...)`.
    """
    return {"out_sharding": names, "eager_sharding": False}


def apply_rope(x_BTNH: jax.Array, positions_T: jax.Array, *, theta: float) -> jax.Array:
    """Rotary position embedding (Su et al. 2021, arXiv 2104.09864), half-split layout.

    Feature pairs (i, i + H/2) are rotated by angle position * theta^(-2i/H), so the dot product of
    a rotated query at position m and a rotated key at position n depends on m - n only. Computed
    in fp32 (bf16 angles lose the low bits of large positions) and cast back to the input dtype.
    """
    half = x_BTNH.shape[-1] // 2
    inv_freq_K = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_TK = positions_T.astype(jnp.float32)[:, None] * inv_freq_K[None, :]
    cos_1T1K = jnp.cos(angle_TK)[None, :, None, :]
    sin_1T1K = jnp.sin(angle_TK)[None, :, None, :]
    x_BTNH32 = x_BTNH.astype(jnp.float32)
    x1, x2 = x_BTNH32[..., :half], x_BTNH32[..., half:]
    out = jnp.concatenate([x1 * cos_1T1K - x2 * sin_1T1K, x2 * cos_1T1K + x1 * sin_1T1K], axis=-1)
    return out.astype(x_BTNH.dtype)


def _linear(d_in, d_out, names, cfg, rngs, *, std=None):
    """A bias-free Linear whose kernel (d_in, d_out) is sharded over `names`.

    Default init is LeCun normal (std 1/sqrt(d_in)), which keeps activations O(1) after a pre-norm.
    """
    std = 1.0 / math.sqrt(d_in) if std is None else std
    return nnx.Linear(
        d_in, d_out, use_bias=False, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype,
        kernel_init=nnx.initializers.normal(std), kernel_metadata=_sharded(names), rngs=rngs)


def _rmsnorm(cfg, rngs):
    # The scale vector is tiny: replicate it (None) rather than leave it unannotated.
    return nnx.RMSNorm(
        cfg.d_model, epsilon=cfg.norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype,
        scale_metadata=_sharded((None,)), rngs=rngs)


def _residual_std(fan_in: int, cfg: ModelConfig) -> float:
    # GPT-2 style: shrink the projections that write into the residual stream by 1/sqrt(2L) so its
    # variance at init does not grow with depth (2 residual writes per block).
    return 1.0 / math.sqrt(fan_in * 2 * cfg.num_layers)


class Attention(nnx.Module):
    """Causal multi-head self-attention with RoPE on queries and keys."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.d_model
        # Heads are laid out along the output axis, so "tensor" shards heads (Megatron layout).
        self.q_proj = _linear(d, d, (FSDP, TENSOR), cfg, rngs)
        self.k_proj = _linear(d, d, (FSDP, TENSOR), cfg, rngs)
        self.v_proj = _linear(d, d, (FSDP, TENSOR), cfg, rngs)
        self.o_proj = _linear(d, d, (TENSOR, FSDP), cfg, rngs, std=_residual_std(d, cfg))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        N, H, theta = cfg.num_heads, cfg.head_dim, cfg.rope_theta
        positions_T = jnp.arange(T)
        rope = lambda y_BTD: apply_rope(y_BTD.reshape(B, T, N, H), positions_T, theta=theta)
        q_BTNH, k_BTNH = rope(self.q_proj(x_BTD)), rope(self.k_proj(x_BTD))
        v_BTNH = self.v_proj(x_BTD).reshape(B, T, N, H)
        # The default (XLA) implementation forms the scores and the softmax in fp32 even for bf16
        # inputs; implementation="cudnn" would select the GPU flash-attention kernel instead.
        out_BTNH = jax.nn.dot_product_attention(q_BTNH, k_BTNH, v_BTNH, is_causal=True)
        return self.o_proj(out_BTNH.reshape(B, T, N * H))


class MLP(nnx.Module):
    """SwiGLU feed-forward (Shazeer 2020, arXiv 2002.05202): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.mlp_dim
        self.gate_proj = _linear(d, f, (FSDP, TENSOR), cfg, rngs)
        self.up_proj = _linear(d, f, (FSDP, TENSOR), cfg, rngs)
        self.down_proj = _linear(f, d, (TENSOR, FSDP), cfg, rngs, std=_residual_std(f, cfg))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        h_BTF = jax.nn.silu(self.gate_proj(x_BTD)) * self.up_proj(x_BTD)
        return self.down_proj(h_BTF)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = _rmsnorm(cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = _rmsnorm(cfg, rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD))
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))


class Transformer(nnx.Module):
    """Decoder-only LM: tokens (B, T) int -> logits (B, T, V) float32."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, v = cfg.d_model, cfg.vocab_size
        # Untied: unit-variance rows (the first pre-norm removes the scale anyway). Tied: the table
        # is also the head, so rows of norm ~1 (std 1/sqrt(d)) keep the initial logits O(1).
        embed_std = 1.0 / math.sqrt(d) if cfg.tied_embeddings else 1.0
        self.embed = nnx.Embed(
            v, d, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype,
            embedding_init=_zero_padding(nnx.initializers.normal(embed_std), cfg.num_tokens, 0),
            embedding_metadata=_sharded((TENSOR, FSDP)), rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = _rmsnorm(cfg, rngs)
        if cfg.tied_embeddings:
            self.lm_head = None
        else:
            # Kernel (d, V), vocabulary on axis 1 and sharded over "tensor". fp32 accumulation:
            # the logits feed a softmax over V, where bf16 rounding of the logits is visible.
            self.lm_head = nnx.Linear(
                d, v, use_bias=False, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype,
                preferred_element_type=jnp.float32,
                kernel_init=_zero_padding(nnx.initializers.normal(1.0 / math.sqrt(d)),
                                          cfg.num_tokens, 1),
                kernel_metadata=_sharded((FSDP, TENSOR)), rngs=rngs)

    def __call__(self, tokens_BT: jax.Array, *, return_hidden: bool = False):
        """Logits (B, T, V) in float32; with `return_hidden`, also the final normed hidden state
        (B, T, D) in compute dtype, i.e. exactly what the head multiplies."""
        if tokens_BT.ndim != 2:
            raise ValueError(f"tokens_BT must have shape (batch, seq), got {tokens_BT.shape}")
        mesh = jax.sharding.get_abstract_mesh()
        if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
            # Explicit axes would need an out_sharding on every gather and matmul here.
            raise ValueError(
                "Transformer expects a mesh with AxisType.Auto axes (jax.make_mesh(..., "
                f"axis_types=(AxisType.Auto,) * n)), got axis_types={mesh.axis_types}")
        if tokens_BT.shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {tokens_BT.shape[1]} exceeds --model.max_seq_len "
                f"{self.cfg.max_seq_len}")
        x_BTD = self.embed(tokens_BT)
        for layer in self.layers:
            x_BTD = layer(x_BTD)
        h_BTD = self.final_norm(x_BTD)
        if self.lm_head is None:
            table_VD = self.embed.embedding[...].astype(h_BTD.dtype)
            logits_BTV = jnp.einsum(
                "btd,vd->btv", h_BTD, table_VD, preferred_element_type=jnp.float32)
        else:
            logits_BTV = self.lm_head(h_BTD)
        logits_BTV = logits_BTV.astype(jnp.float32)
        if self.cfg.num_tokens < self.cfg.vocab_size:
            # Padding ids are never predicted: a finite floor (not -inf) keeps the softmax's
            # gradient exactly zero there without any inf - inf.
            valid_V = jnp.arange(self.cfg.vocab_size) < self.cfg.num_tokens
            logits_BTV = jnp.where(valid_V, logits_BTV, jnp.finfo(jnp.float32).min / 2)
        return (logits_BTV, h_BTD) if return_hidden else logits_BTV


def head_matrix(model: Transformer) -> tuple[jax.Array, int]:
    """The head weight's real-token rows and its vocabulary axis: `(kernel (d, V), 1)`, or
    `(table (V, d), 0)` if tied (padding rows, if any, left out)."""
    n = model.cfg.num_tokens
    if model.lm_head is None:
        return model.embed.embedding[...][:n], 0
    return model.lm_head.kernel[...][:, :n], 1


def count_params(model: Transformer) -> int:
    """Number of trainable scalars (a tied table is counted once)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward) for MFU, following PaLM (arXiv 2204.02311, B):
    6 N for the matmul parameters N (per layer 4 d^2 attention + 3 d F MLP, plus the d V head, which
    the tied table also costs) and 12 L d T for the attention scores and values at context T; the
    embedding lookup and the norms are not matmuls and are left out.
    """
    d, L = cfg.d_model, cfg.num_layers
    matmul_params = L * (4 * d * d + 3 * d * cfg.mlp_dim) + d * cfg.vocab_size
    return float(6 * matmul_params + 12 * L * d * cfg.max_seq_len)
