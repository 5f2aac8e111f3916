"""Training machinery shared by every stage: optimizer, train state, a pure jitted train step.

`make_train_step(loss_fn, optimizer)` returns `train_step(state, batch) -> (state, metrics)`, jitted
with the state donated. `loss_fn(params, batch, rng) -> (loss, aux_metrics)` is differentiated with
respect to `params` only, so a stage trains exactly what it puts in `TrainState.params` (a filter,
not a copy: frozen weights travel in the batch or a closure).

Non-finite loss or gradient: the update is skipped (params and optimizer state unchanged), counted
in `skips_total`, and `skips_in_row` grows; the driver stops the run after `max_nonfinite` in a row
(`check_nonfinite`). A skipped state is always finite, so it is safe to checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from bebop.config import OptimConfig


class NonFiniteError(RuntimeError):
    pass


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warm = optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1))
    decay_steps = max(total_steps - cfg.warmup_steps, 1)
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(cfg.lr, end, decay_steps)
    else:
        decay = optax.constant_schedule(cfg.lr)
    return optax.join_schedules([warm, decay], [cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(
            schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay
        ),
    )


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: updates attempted
    params: object  # pytree being trained (e.g. an nnx.State)
    opt_state: object
    rng: jax.Array  # raw uint32 key data (checkpointable)
    skips_in_row: jax.Array
    skips_total: jax.Array

    @classmethod
    def create(cls, params, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
        # Distinct buffers: the state is donated, and one buffer may not be donated twice.
        zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
        rng = jax.random.key_data(jax.random.key(seed))
        return cls(zero(), params, optimizer.init(params), rng, zero(), zero())


def _select(ok, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def make_train_step(
    loss_fn: Callable, optimizer: optax.GradientTransformation, donate: bool = True, jit=True
) -> Callable:
    def train_step(state: TrainState, batch):
        rng, key = jax.random.split(jax.random.wrap_key_data(state.rng))
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, key)
        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = state.replace(
            step=state.step + 1,
            params=_select(ok, params, state.params),
            opt_state=_select(ok, opt_state, state.opt_state),
            rng=jax.random.key_data(rng),
            skips_in_row=jnp.where(ok, 0, state.skips_in_row + 1),
            skips_total=state.skips_total + (~ok).astype(jnp.int32),
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "skipped": (~ok).astype(jnp.int32)}
        return new_state, {**metrics, **aux}

    if not jit:  # to be composed inside another jitted function
        return train_step
    return jax.jit(train_step, donate_argnums=(0,) if donate else ())


def check_nonfinite(state: TrainState, max_in_row: int) -> None:
    n = int(state.skips_in_row)
    if n >= max_in_row:
        raise NonFiniteError(
            f"{n} consecutive non-finite updates (max_nonfinite={max_in_row}); stopping. "
            f"The last checkpoint holds the last finite state."
        )


def token_cross_entropy(logits_BxTxV, targets_BxT, mask_BxT):
    """Mean over masked tokens of -log softmax(logits)[target], in float32."""
    logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    nll_BxT = -jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1)[..., 0]
    denom = jnp.maximum(mask_BxT.sum(), 1.0)
    return (nll_BxT * mask_BxT).sum() / denom
