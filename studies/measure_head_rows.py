"""What one projected-RowNorm step does to each token row, on a real head gradient.

    python -m studies.measure_head_rows [workdir]     # about a minute on two CPU cores

Trains the example model (examples/lm, V = 1024, d = 128, 2 layers) with `lm_optimizer(6e-3)` on
standard-library source files and, at initialisation and after 200 steps, takes the head's
cross-entropy gradient of one batch (16 x 64 tokens) and its projected-RowNorm step S (radius 1).
Prints, per unit radius: |mean unit row| = |ubar|, the row lengths |s_i| (min, 1 %, median, 99 %,
max, mean), RMS * sqrt(d), the distance of every row to the common centre -ubar (1 by theory),
and the exact row diameter. docs/geometry.md ("What one step does to each token row") quotes it.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import rowgeom
from examples.lm import configs, data
from examples.lm import model as model_lib

V, D, STEPS, BATCH, SEQ = 1024, 128, 200, 16, 64


def main(workdir: Path) -> None:
    corpus = workdir / "corpus"
    if not corpus.exists():
        corpus.mkdir(parents=True)
        src = Path(os.__file__).parent
        files = sorted((p for p in src.glob("*.py") if 2_000 < p.stat().st_size < 40_000),
                       key=lambda p: p.name)[:80]
        for f in files:
            shutil.copy(f, corpus / f.name)
    tokens = np.asarray(data.prepare_tokens(source=corpus, workdir=workdir / "tok",
                                            vocab_size=V).train)
    cfg = configs.override(configs.get_config("test"), {
        "model.vocab_size": V, "model.d_model": D, "model.num_heads": 4, "model.mlp_dim": 384,
        "model.max_seq_len": SEQ})
    model = model_lib.Transformer(cfg.model, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    tx = rowgeom.lm_optimizer(6e-3)
    opt_state = tx.init(params)
    rng = np.random.default_rng(0)

    def loss_fn(p, x, y):
        return nnx.merge(graphdef, p, rest).loss(x, y)

    @jax.jit
    def step(p, o, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss, g

    for t in range(STEPS + 1):
        idx = rng.integers(0, len(tokens) - SEQ - 1, size=BATCH)
        batch = np.stack([tokens[i:i + SEQ + 1] for i in idx]).astype(np.int32)
        params, opt_state, loss, grads = step(params, opt_state, batch[:, :-1], batch[:, 1:])
        if t not in (0, STEPS):
            continue
        _, axis = model_lib.head_matrix(nnx.merge(graphdef, params, rest))
        g = np.asarray(grads["lm_head"]["kernel"], np.float64)
        g = g if axis == 0 else g.T                                     # (V, d) token rows
        s = np.asarray(rowgeom.rownorm_direction(jnp.asarray(g, jnp.float32), vocab_axis=0),
                       np.float64)
        x = g - g.mean(axis=0)
        ubar = (x / np.linalg.norm(x, axis=1, keepdims=True)).mean(axis=0)
        lengths = np.linalg.norm(s, axis=1)
        to_centre = np.linalg.norm(s + ubar, axis=1)
        diameter = float(rowgeom.row_diameter(jnp.asarray(s, jnp.float32), vocab_axis=0))
        q = np.quantile(lengths, [0, 0.01, 0.5, 0.99, 1])
        print(f"step {t}: loss {float(loss):.3f}, |ubar| {np.linalg.norm(ubar):.3f}, "
              f"|s_i| min/1%/median/99%/max {np.round(q, 3).tolist()} mean {lengths.mean():.3f}, "
              f"RMS*sqrt(d) {np.sqrt((s ** 2).mean() * D):.3f} "
              f"(sqrt(1-|ubar|^2) {np.sqrt(1 - ubar @ ubar):.3f}), "
              f"|s_i - c| in [{to_centre.min():.6f}, {to_centre.max():.6f}], D {diameter:.4f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))
