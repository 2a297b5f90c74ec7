"""A decoder-only transformer in flax.nnx: pre-norm blocks (RMSNorm -> causal attention with
RoPE, RMSNorm -> SwiGLU MLP), a final RMSNorm and an LM head (kernel (d, V)) or the tied embedding
table (V, d). Shape suffixes: B batch, T sequence, D width, N heads, H head width, F MLP width,
V vocabulary, L layers. Every parameter and activation is named by logical axes, which
sharding.py maps onto the mesh (inside `jax.set_mesh` only). Norm statistics, RoPE, the softmax
and the logits are float32 whatever `compute_dtype`, and so are the weight gradients' sums across
devices (`_matmul`, `_lookup`).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from examples.lm import loss as loss_lib
from examples.lm.sharding import constrain, num_shards

# Logical names of the activations (sharding.RULES maps them onto the mesh).
_BTD = ("activation_batch", "activation_length", "activation_embed")
_BTNH = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
_BTF = ("activation_batch", "activation_length", "activation_mlp")
_BTV = ("activation_batch", "activation_length", "activation_vocab")

# How a block's activations are kept for the backward pass: "none" keeps them all; "block"
# recomputes the block from its input (jax.checkpoint, nothing saved); "dots" saves the outputs
# of its weight matmuls and recomputes the rest (attention scores, norms, activations).
REMAT_POLICIES = ("none", "block", "dots")
WEIGHT_MATMUL = "weight_matmul"  # the checkpoint name of the Linear layers' outputs


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The transformer's shape, dtypes and vocabulary, validated on creation; its fields are the
    trainer's `--model.*` flags."""

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
    # Ids >= valid_vocab_size are padding (a vocabulary padded to a multiple of 128): zero rows,
    # masked logits, never predicted, no gradient. None: every id is a token.
    valid_vocab_size: int | None = None
    scan_layers: bool = False  # stacked (L, ...) blocks under nnx.scan (another checkpoint layout)
    remat: str = "none"  # one of REMAT_POLICIES
    loss_chunk: int | None = None  # loss positions per logits chunk (loss.py); None: all at once
    # The paper's block (arXiv 2608.22253, Table 1): qk_norm (RMS-normalised queries and keys
    # before RoPE), no norm gains (no vector parameters at all), every weight from N(0, init_std^2)
    # (None: LeCun with depth-scaled residual writes and a unit-variance embedding).
    qk_norm: bool = False
    norm_gain: bool = True
    init_std: float | None = None

    def __post_init__(self):
        positive_int = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim", "max_seq_len",
                     "loss_chunk"):
            value = getattr(self, name)
            if not (positive_int(value) or (name == "loss_chunk" and value is None)):
                raise ValueError(f"--model.{name} must be a positive int"
                                 f"{' or none' if name == 'loss_chunk' else ''}, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"--model.d_model ({self.d_model}) must be divisible by --model.num_heads "
                f"({self.num_heads})")
        if self.head_dim % 2:
            raise ValueError(
                f"the head width --model.d_model / --model.num_heads = {self.head_dim} must be "
                "even for RoPE")
        valid = self.valid_vocab_size
        if valid is not None and not (positive_int(valid) and valid <= self.vocab_size):
            raise ValueError(f"--model.valid_vocab_size must be an int in [1, --model.vocab_size"
                             f" = {self.vocab_size}] or none, got {valid!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"--model.remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        for name in ("qk_norm", "norm_gain"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"--model.{name} must be a bool, got {getattr(self, name)!r}")
        std = self.init_std
        if std is not None and (isinstance(std, bool) or not isinstance(std, (int, float))
                                or not 0 < std < math.inf):
            raise ValueError(f"--model.init_std must be a positive float or none, got {std!r}")
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

    @property
    def num_valid(self) -> int | None:
        """`num_tokens` when some ids are padding, else None: what the loss masks by."""
        return self.num_tokens if self.num_tokens < self.vocab_size else None


def _zero_padding(init, num_tokens: int, vocab_axis: int):
    """`init` with the rows >= num_tokens along `vocab_axis` set to zero."""

    def padded_init(key, shape, dtype=jnp.float32):
        ids = jax.lax.broadcasted_iota(jnp.int32, shape, vocab_axis)
        return jnp.where(ids < num_tokens, init(key, shape, dtype), jnp.zeros((), dtype))

    return padded_init


def _sharded(names: tuple) -> dict:
    """Variable metadata naming a parameter's logical axes. `eager_sharding=False`: flax would
    otherwise shard the variable as it is created, which fails when a mesh axis does not divide
    the dimension (a vocabulary of 50257 over 4 devices); the trainer places the parameters."""
    return {"out_sharding": names, "eager_sharding": False}


def apply_rope(x_BTNH: jax.Array, positions_T: jax.Array, *, theta: float) -> jax.Array:
    """Rotary position embedding (arXiv 2104.09864), half-split: feature pairs (i, i + H/2)
    rotated by position * theta^(-2i/H). In fp32 (bf16 angles lose large positions' low bits)."""
    half = x_BTNH.shape[-1] // 2
    inv_freq_K = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_TK = positions_T.astype(jnp.float32)[:, None] * inv_freq_K[None, :]
    cos_1T1K = jnp.cos(angle_TK)[None, :, None, :]
    sin_1T1K = jnp.sin(angle_TK)[None, :, None, :]
    x_BTNH32 = x_BTNH.astype(jnp.float32)
    x1, x2 = x_BTNH32[..., :half], x_BTNH32[..., half:]
    out = jnp.concatenate([x1 * cos_1T1K - x2 * sin_1T1K, x2 * cos_1T1K + x1 * sin_1T1K], axis=-1)
    return out.astype(x_BTNH.dtype)


# Weight gradients are summed across devices in float32, as PyTorch's DDP sums the float32
# gradients of float32 parameters under autocast (the paper's setup). Formed by the matmul (or
# the scatter) in the compute dtype, each device's partial sum would be all-reduced (or FSDP's
# reduce-scatter) in bf16; formed in float32, the sum is float32 and rounded once, after it.
# Twice the bytes of a bf16 reduction; the forward pass and activation gradients are unchanged.
@jax.custom_vjp
def _matmul(x, kernel):
    """`x (..., d_in) @ kernel (d_in, d_out)` whose kernel gradient is formed in float32."""
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def _matmul_bwd(residuals, dy):
    x, kernel = residuals
    batch = tuple(range(x.ndim - 1))
    dkernel = jax.lax.dot_general(x, dy, ((batch, batch), ((), ())),
                                  preferred_element_type=jnp.float32)
    dx = jax.lax.dot_general(dy, kernel, (((dy.ndim - 1,), (1,)), ((), ())))
    return dx, dkernel.astype(kernel.dtype)


_matmul.defvjp(lambda x, kernel: (_matmul(x, kernel), (x, kernel)), _matmul_bwd)


def _linear_dot(lhs, rhs, dimension_numbers, precision=None, **kwargs):
    """nnx.Linear's `dot_general`: its one contraction (inputs' last axis with the kernel's
    first) by `_matmul`."""
    del precision  # the default, as nnx.Linear passes it
    assert dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ())) and not any(kwargs.values())
    # Named: remat's "dots" saves it (its policy sees a custom_vjp whole, not the matmul inside).
    return checkpoint_name(_matmul(lhs, rhs), WEIGHT_MATMUL)


@jax.custom_vjp
def _lookup(table_VD, ids):
    """`table_VD[ids]` whose table gradient (a scatter-add of rows) is formed in float32."""
    return jnp.take(table_VD, ids, axis=0)


def _lookup_bwd(residuals, d_rows):
    table_VD, ids = residuals
    dtable = jnp.zeros(table_VD.shape, jnp.float32).at[ids].add(d_rows.astype(jnp.float32))
    return dtable.astype(table_VD.dtype), None


_lookup.defvjp(lambda table_VD, ids: (_lookup(table_VD, ids), (table_VD, ids)), _lookup_bwd)


def _linear(d_in, d_out, names, cfg, rngs, *, std=None):
    """A bias-free Linear, kernel (d_in, d_out) named `names`; LeCun normal init (activations
    O(1) after a pre-norm) unless `std`, and `cfg.init_std` (the paper's 0.02) over both."""
    std = cfg.init_std or std or 1.0 / math.sqrt(d_in)
    return nnx.Linear(
        d_in, d_out, use_bias=False, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype,
        dot_general=_linear_dot, kernel_init=nnx.initializers.normal(std),
        kernel_metadata=_sharded(names), rngs=rngs)


def _rmsnorm(cfg, rngs, features=None):
    # The scale vector is tiny: replicated ("norm") rather than left unannotated. flax computes
    # the mean square in float32 even for bf16 inputs.
    return nnx.RMSNorm(
        cfg.d_model if features is None else features, epsilon=cfg.norm_eps,
        dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype, use_scale=cfg.norm_gain,
        scale_metadata=_sharded(("norm",)), rngs=rngs)


def _residual_std(fan_in: int, cfg: ModelConfig) -> float:
    # GPT-2 style: residual writes shrunk by 1/sqrt(2L), so the stream's variance at init does not
    # grow with depth (2 writes per block).
    return 1.0 / math.sqrt(fan_in * 2 * cfg.num_layers)


class Attention(nnx.Module):
    """Causal multi-head self-attention with RoPE on queries and keys."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.d_model
        # Heads are laid out along the output axis, so "heads" splits whole heads (Megatron).
        self.q_proj = _linear(d, d, ("embed", "heads"), cfg, rngs)
        self.k_proj = _linear(d, d, ("embed", "heads"), cfg, rngs)
        self.v_proj = _linear(d, d, ("embed", "heads"), cfg, rngs)
        self.o_proj = _linear(d, d, ("heads", "embed"), cfg, rngs, std=_residual_std(d, cfg))
        # Per-head query/key RMSNorm over the head width, before RoPE (the paper's block, its
        # Table 1): the attention logits stay bounded whatever the weights' scale.
        self.q_norm = _rmsnorm(cfg, rngs, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = _rmsnorm(cfg, rngs, cfg.head_dim) if cfg.qk_norm else None

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        B, T, _ = x_BTD.shape
        N, H = self.cfg.num_heads, self.cfg.head_dim
        heads = lambda y_BTD: constrain(y_BTD.reshape(B, T, N, H), *_BTNH)
        rope = lambda y_BTNH: apply_rope(y_BTNH, jnp.arange(T), theta=self.cfg.rope_theta)
        q_BTNH, k_BTNH = heads(self.q_proj(x_BTD)), heads(self.k_proj(x_BTD))
        if self.q_norm is not None:
            q_BTNH, k_BTNH = self.q_norm(q_BTNH), self.k_norm(k_BTNH)
        q_BTNH, k_BTNH = rope(q_BTNH), rope(k_BTNH)
        v_BTNH = heads(self.v_proj(x_BTD))
        # The default (XLA) implementation forms the scores and the softmax in fp32 even for bf16
        # inputs; implementation="cudnn" would select the GPU flash-attention kernel instead.
        out_BTNH = jax.nn.dot_product_attention(q_BTNH, k_BTNH, v_BTNH, is_causal=True)
        out_BTNH = constrain(out_BTNH, *_BTNH)
        return constrain(self.o_proj(out_BTNH.reshape(B, T, N * H)), *_BTD)


class MLP(nnx.Module):
    """SwiGLU feed-forward (Shazeer 2020, arXiv 2002.05202): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.mlp_dim
        self.gate_proj = _linear(d, f, ("embed", "mlp"), cfg, rngs)
        self.up_proj = _linear(d, f, ("embed", "mlp"), cfg, rngs)
        self.down_proj = _linear(f, d, ("mlp", "embed"), cfg, rngs, std=_residual_std(f, cfg))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        gate_BTF = constrain(self.gate_proj(x_BTD), *_BTF)
        h_BTF = jax.nn.silu(gate_BTF) * constrain(self.up_proj(x_BTD), *_BTF)
        return constrain(self.down_proj(h_BTF), *_BTD)


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


def _rematted(policy: str, *, in_scan: bool):
    """`block(x)` under `policy` (REMAT_POLICIES). Inside a scan the loop already keeps the
    recomputation from being merged with the forward pass, so CSE prevention is not needed."""
    apply = lambda block, x_BTD: block(x_BTD)
    if policy == "none":
        return apply
    saved = {"block": None, "dots": jax.checkpoint_policies.save_only_these_names(WEIGHT_MATMUL)}
    return nnx.remat(apply, policy=saved[policy], prevent_cse=not in_scan)


class Transformer(nnx.Module):
    """Decoder-only LM: tokens (B, T) -> logits (B, T, V) float32, or `loss`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, v = cfg.d_model, cfg.vocab_size
        # Untied: unit-variance rows (the first pre-norm removes the scale anyway). Tied: the table
        # is also the head, so rows of norm ~1 (std 1/sqrt(d)) keep the initial logits O(1).
        embed_std = cfg.init_std or (1.0 / math.sqrt(d) if cfg.tied_embeddings else 1.0)
        self.embed = nnx.Embed(
            v, d, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype,
            embedding_init=_zero_padding(nnx.initializers.normal(embed_std), cfg.num_tokens, 0),
            embedding_metadata=_sharded(("vocab", "embed")), rngs=rngs)
        if cfg.scan_layers:
            # One Block with a leading "layers" axis, each layer from its own split of `rngs`.
            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def stacked(rngs):
                return Block(cfg, rngs=rngs)

            self.layers = stacked(rngs)
        else:
            self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = _rmsnorm(cfg, rngs)
        # Kernel (d, V), vocabulary on axis 1; only the kernel is used (`head`: loss.py makes the
        # logits, accumulated in float32).
        self.lm_head = None if cfg.tied_embeddings else nnx.Linear(
            d, v, use_bias=False, param_dtype=cfg.param_dtype, kernel_init=_zero_padding(
                nnx.initializers.normal(cfg.init_std or 1.0 / math.sqrt(d)), cfg.num_tokens, 1),
            kernel_metadata=_sharded(("embed", "vocab")), rngs=rngs)

    def hidden(self, tokens_BT: jax.Array) -> jax.Array:
        """The final normed hidden state (B, T, D) in compute dtype: what the head multiplies."""
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
        table_VD = self.embed.embedding[...].astype(self.cfg.compute_dtype)
        x_BTD = constrain(_lookup(table_VD, tokens_BT), *_BTD)
        apply = _rematted(self.cfg.remat, in_scan=self.cfg.scan_layers)
        if self.cfg.scan_layers:
            x_BTD = nnx.scan(apply, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.layers, x_BTD)
        else:
            for block in self.layers:
                x_BTD = apply(block, x_BTD)
        return constrain(self.final_norm(x_BTD), *_BTD)

    def head(self) -> tuple[jax.Array, int]:
        """The head in compute dtype, padding rows included, and its vocabulary axis: (kernel
        (D, V), 1) or (table (V, D), 0). Gathered whole along D once: every loss chunk uses it."""
        if self.lm_head is None:
            table_VD = self.embed.embedding[...].astype(self.cfg.compute_dtype)
            return constrain(table_VD, "activation_vocab", "activation_embed"), 0
        kernel_DV = self.lm_head.kernel[...].astype(self.cfg.compute_dtype)
        return constrain(kernel_DV, "activation_embed", "activation_vocab"), 1

    def __call__(self, tokens_BT: jax.Array, *, return_hidden: bool = False):
        """Logits (B, T, V) in float32; with `return_hidden`, also `hidden(tokens_BT)`."""
        h_BTD = self.hidden(tokens_BT)
        head, vocab_axis = self.head()
        logits_BTV = constrain(loss_lib.logits(h_BTD, head, vocab_axis=vocab_axis,
                                               num_valid=self.cfg.num_valid), *_BTV)
        return (logits_BTV, h_BTD) if return_hidden else logits_BTV

    def loss(self, tokens_BT: jax.Array, targets_BT: jax.Array) -> jax.Array:
        """Mean next-token cross entropy (float32), `cfg.loss_chunk` positions at a time (loss.py):
        that of `self(tokens_BT)`'s logits, to float32 rounding."""
        head, vocab_axis = self.head()
        # One head-gradient accumulator per batch shard, summed once (see loss.py).
        groups = num_shards(tokens_BT.shape[0], "activation_batch")
        return loss_lib.cross_entropy(
            self.hidden(tokens_BT), head, targets_BT, vocab_axis=vocab_axis,
            num_valid=self.cfg.num_valid, chunk_size=self.cfg.loss_chunk, batch_groups=groups,
            constrain_logits=lambda z: constrain(z, *_BTV))


def head_matrix(model: Transformer) -> tuple[jax.Array, int]:
    """The head weight's real-token rows and its vocabulary axis: `(kernel (d, V), 1)`, or
    `(table (V, d), 0)` if tied (padding rows, if any, left out)."""
    n = model.cfg.num_tokens
    if model.lm_head is None:
        return model.embed.embedding[...][:n], 0
    return model.lm_head.kernel[...][:, :n], 1


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token for MFU, as PaLM (arXiv 2204.02311, B): 6 per matmul parameter
    (per layer 4 d^2 + 3 d F, plus the d V head, tied or not) and 12 L d T for attention; the
    embedding lookup and the norms are not matmuls."""
    d, L = cfg.d_model, cfg.num_layers
    matmul_params = L * (4 * d * d + 3 * d * cfg.mlp_dim) + d * cfg.vocab_size
    return float(6 * matmul_params + 12 * L * d * cfg.max_seq_len)
