"""The train state and the jitted functions of one config on one mesh.

The train state is one pytree of plain arrays, `{params, rest, opt_state, micro_step, rng}`,
updated by a single jitted step that donates it (parameters and optimizer state are updated in
place). Parameters are placed by their logical axis names (model.py) through `sharding.RULES`,
fitted to the mesh; optimizer-state leaves shaped like a parameter are sharded like it, and
batches are split over (data, fsdp).

The forward pass sees the parameters cast to `model.compute_dtype` while they are still sharded
(`compute_params`), so FSDP all-gathers bf16 weights, not the float32 master copies, and the
gradients come back reduce-scattered in that dtype before the optimizer, which runs in float32 on
each device's shard.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from examples.lm import configs, evaluate, sharding
from examples.lm import mesh as mesh_lib
from examples.lm import model as model_lib
from examples.lm.optimizer import build_optimizer, head_group, lr_schedule, optimizer_options


class Trainer:
    """Model, optimizer, jitted functions and shardings for one config on one mesh.

    `init()` builds the state in place on the mesh; `abstract_state` (shapes, dtypes and target
    shardings) is what a checkpoint is restored onto. `train_step(state, inputs, targets)`
    applies one micro-batch; `grad_step` is the same forward and backward pass without the
    optimizer (for timing); `val_loss` and `head_probe` evaluate (evaluate.py).
    """

    def __init__(self, cfg: configs.Config, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.tx = build_optimizer(cfg)
        group = head_group(cfg)  # the head step's rate and decay, for the head probe
        self.head_lr, self.head_wd = lr_schedule(group.learning_rate, cfg), group.weight_decay
        mc, tx, seed = cfg.model, self.tx, cfg.seed

        def init_state():
            model = model_lib.Transformer(mc, rngs=nnx.Rngs(seed))
            _, params, rest = nnx.split(model, nnx.Param, ...)
            params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
            return {"params": params, "rest": rest, "opt_state": tx.init(params),
                    "micro_step": jnp.zeros((), jnp.int32),
                    "rng": jax.random.key_data(jax.random.key(seed))}

        # Outside the mesh: flax would turn the logical names into (mesh) shardings itself.
        abstract_model = nnx.eval_shape(lambda: model_lib.Transformer(mc, rngs=nnx.Rngs(seed)))
        self.graphdef, abs_params, _ = nnx.split(abstract_model, nnx.Param, ...)
        names = nnx.to_pure_dict(nnx.get_partition_spec(abs_params))
        param_shardings = jax.tree.map(
            lambda a, n: jax.NamedSharding(mesh, sharding.param_spec(a.shape, n, mesh)),
            nnx.to_pure_dict(abs_params), names,
            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        with jax.set_mesh(mesh):
            abstract = jax.eval_shape(init_state)
        self.shardings = mesh_lib.state_shardings(abstract, param_shardings, mesh)
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
            self.shardings)
        self._init = jax.jit(init_state, out_shardings=self.shardings)
        self._build_functions()

    def _build_functions(self):
        gd, tx = self.graphdef, self.tx
        batch = mesh_lib.batch_sharding(self.mesh)
        repl = mesh_lib.replicated(self.mesh)
        compute = self.compute_params

        def loss_fn(params, rest, inputs, targets):
            return nnx.merge(gd, compute(params), rest).loss(inputs, targets)

        def train_step(state, inputs, targets):
            loss, grads = jax.value_and_grad(loss_fn)(state["params"], state["rest"], inputs,
                                                      targets)
            updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            return {**state, "params": params, "opt_state": opt_state,
                    "micro_step": state["micro_step"] + 1}, loss

        def grad_step(state, inputs, targets):  # for timing: the step without the optimizer
            return jax.value_and_grad(loss_fn)(state["params"], state["rest"], inputs, targets)

        self.train_step = jax.jit(
            train_step, in_shardings=(self.shardings, batch, batch),
            out_shardings=(self.shardings, repl), donate_argnums=0)
        self.grad_step = jax.jit(
            grad_step, in_shardings=(self.shardings, batch, batch),
            out_shardings=(repl, self.shardings["params"]))
        self.val_loss = jax.jit(loss_fn, out_shardings=repl)
        # A fresh copy of the head (jit outputs never alias donated inputs).
        head_of = lambda p, r: model_lib.head_matrix(nnx.merge(gd, p, r))[0] + 0
        self.head_of = jax.jit(head_of)
        head_shape = jax.eval_shape(head_of, self.abstract_state["params"],
                                    self.abstract_state["rest"]).shape
        self.exact_diameter = math.prod(head_shape) <= self.cfg.eval.exact_diameter_max_elements
        self.head_probe = evaluate.make_head_probe(
            gd, model_lib.head_matrix, exact=self.exact_diameter, out_sharding=repl)
        self.step_diameter = evaluate.make_step_diameter(
            gd, model_lib.head_matrix, exact=self.exact_diameter, out_sharding=repl)
        # With eval.centring, a RowNorm head's step against the uncentred one
        # (evaluate.centring_diagnostics): where the optimizer state holds the head's EMA moment.
        self.centring_probe = None
        hp = head_group(self.cfg)
        full_head = self.abstract_state["params"]["lm_head"]["kernel"].shape if (
            "lm_head" in self.abstract_state["params"]) else None
        rownorm = optimizer_options(self.cfg)["head"].optimizer == "rownorm"
        if (self.cfg.eval.centring and rownorm and full_head is not None
                and evaluate.head_ema(self.abstract_state["opt_state"], full_head) is not None):
            o = self.cfg.optim
            self.centring_probe = evaluate.make_centring_probe(
                gd, model_lib.head_matrix, full_head, momentum=hp.momentum,
                debias=o.head_bias_correction, eps=1e-8 if o.head_eps is None else o.head_eps,
                exact=self.exact_diameter, out_sharding=repl)

    def compute_params(self, params):
        """`params` in the model's compute dtype, each kept on its own sharding (so the cast runs
        on the shards and FSDP gathers the narrow copy)."""
        dtype = jnp.dtype(self.cfg.model.compute_dtype)
        if dtype == jnp.dtype(self.cfg.model.param_dtype):
            return params
        shardings = self.shardings["params"]
        return jax.tree.map(
            lambda p, s: jax.lax.with_sharding_constraint(p.astype(dtype), s), params, shardings)

    def init(self):
        """A fresh train state, created in place with its shardings."""
        with jax.set_mesh(self.mesh):
            return self._init()
