"""Training machinery shared by every stage: optimizer, train state, a pure jitted train step.

`make_train_step(loss_fn, optimizer)` returns `train_step(state, batch, *frozen) -> (state,
metrics)`, jitted with the state donated. `loss_fn(params, batch, rng, *frozen) -> (loss,
aux_metrics)` is differentiated with respect to `params` only, so a stage trains exactly what it
puts in `TrainState.params` (a filter, not a copy): frozen weights (the policy under an MTP, the KL
reference) are the explicit extra arguments `frozen`, traced, never compile-time constants.

Non-finite loss or gradient: the update is skipped (params and optimizer state unchanged), counted
in `skips_total`, and `skips_in_row` grows; the driver stops the run after `max_nonfinite` in a row
(`check_nonfinite`). A finite loss does not mean a live model (a huge learning rate can leave
parameters at 1e10 with a finite loss for a few steps before everything turns NaN), so the
driver never checkpoints a skipped step and `DivergenceGuard` also stops on a loss spike or a
parameter-norm blow-up (`max_loss_spike`, `max_param_growth`); each step reports `param_norm`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from bebop import sharding
from bebop.config import OptimConfig


class NonFiniteError(RuntimeError):
    """Training stopped by a guard (non-finite updates or divergence)."""


class DivergenceError(NonFiniteError):
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


def split_rows(batch, num_chunks: int, shards: int | None = None):
    """Every array leaf of `batch` [B, ...] as [num_chunks, B / num_chunks, ...] (None leaves
    stay None). `shards` (default: the activation mesh's batch shards, `sharding.batch_shards`)
    > 1 and dividing a chunk: chunk c takes rows c*m .. c*m+m-1 of each of the `shards` equal
    blocks of the batch (m = B / num_chunks / shards), i.e. the rows each device already holds,
    so every chunk stays split over the devices (contiguous chunks would each sit on one or two
    devices, and GSPMD ran each chunk whole on every device). Any split sums to the same
    gradient."""
    shards = sharding.batch_shards() if shards is None else shards

    def split(x):
        b = x.shape[0]
        if b % num_chunks:
            raise ValueError(f"batch of {b} rows does not split into {num_chunks} chunks")
        rows = b // num_chunks
        if shards <= 1 or rows % shards:
            return x.reshape(num_chunks, rows, *x.shape[1:])
        blocks = x.reshape(shards, num_chunks, rows // shards, *x.shape[1:]).swapaxes(0, 1)
        chunks = blocks.reshape(num_chunks, rows, *x.shape[1:])
        return sharding.constrain(chunks, (None, "batch") + (None,) * (x.ndim - 1))

    return jax.tree.map(split, batch)


def accumulated_value_and_grad(loss_fn: Callable, num_chunks: int, chunk_weight: Callable):
    """`jax.value_and_grad(loss_fn, has_aux=True)` over a batch split into `num_chunks` row
    chunks, one chunk's activations alive at a time (gradient accumulation in a `lax.scan`).
    `loss_fn` returns a mean over its chunk and `chunk_weight(chunk)` that mean's denominator (a
    token count, a row count), so the weighted mean of the chunks' losses, gradients and aux
    metrics is exactly the whole batch's; aux keys ending in `_max` / `_min` are combined by
    max / min. Every chunk sees the same `rng`."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if num_chunks == 1:
        return grad_fn

    def combine(name, a, b, w):
        if name.endswith("_max"):
            return jnp.maximum(a, b)
        if name.endswith("_min"):
            return jnp.minimum(a, b)
        return a + w * b

    def value_and_grad(params, batch, rng, *frozen):
        chunks = split_rows(batch, num_chunks)
        first = jax.tree.map(lambda x: x[0], chunks)
        shapes = jax.eval_shape(grad_fn, params, first, rng, *frozen)
        (_, aux_shape), _ = shapes
        zero = lambda s: jnp.zeros(s.shape, s.dtype)  # noqa: E731
        init_aux = {
            k: jnp.full(s.shape, -jnp.inf if k.endswith("_max") else jnp.inf, s.dtype)
            if k.endswith(("_max", "_min"))
            else zero(s)
            for k, s in aux_shape.items()
        }
        # (total weight, weighted loss sum, aux, weighted gradient sum)
        init = (jnp.zeros(()), jnp.zeros(()), init_aux, jax.tree.map(zero, shapes[1]))

        def body(acc, chunk):
            total_w, loss_sum, aux_sum, grad_sum = acc
            (loss, aux), grads = grad_fn(params, chunk, rng, *frozen)
            w = jnp.asarray(chunk_weight(chunk), jnp.float32)
            aux_sum = {k: combine(k, aux_sum[k], aux[k], w) for k in aux_sum}
            grad_sum = jax.tree.map(lambda a, g: a + w * g, grad_sum, grads)
            return (total_w + w, loss_sum + w * loss, aux_sum, grad_sum), None

        (total_w, loss_sum, aux_sum, grad_sum), _ = jax.lax.scan(body, init, chunks)
        total_w = jnp.maximum(total_w, 1e-12)
        aux = {k: v if k.endswith(("_max", "_min")) else v / total_w for k, v in aux_sum.items()}
        grads = jax.tree.map(lambda g: (g / total_w).astype(g.dtype), grad_sum)
        return (loss_sum / total_w, aux), grads

    return value_and_grad


def make_train_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    donate: bool = True,
    jit=True,
    microbatches: int = 1,
    chunk_weight: Callable | None = None,
) -> Callable:
    """`microbatches > 1`: gradient accumulation over that many row chunks of the batch
    (`accumulated_value_and_grad`; `chunk_weight(chunk)` is the denominator of the chunk's mean
    loss, default its row count)."""
    weight = chunk_weight or (lambda chunk: jax.tree.leaves(chunk)[0].shape[0])
    grad_fn = accumulated_value_and_grad(loss_fn, microbatches, weight)

    def train_step(state: TrainState, batch, *frozen):
        rng, key = jax.random.split(jax.random.wrap_key_data(state.rng))
        (loss, aux), grads = grad_fn(state.params, batch, key, *frozen)
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
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "param_norm": optax.tree.norm(new_state.params),
            "skipped": (~ok).astype(jnp.int32),
        }
        return new_state, {**metrics, **aux}

    if not jit:  # to be composed inside another jitted function
        return train_step
    return jit_pinned(train_step, 1, donate_argnums=(0,) if donate else ())


def _shardings(tree):
    """(treedef, the leaves' shardings), or None when a leaf has none (a tracer, a host array,
    a ShapeDtypeStruct without one) or the leaves do not all live on one device set (jit then
    moves them, unpinned)."""
    leaves, treedef = jax.tree.flatten(tree)

    def placed(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return getattr(x, "sharding", None) is not None
        return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)

    if not all(placed(x) for x in leaves):
        return None
    shards = tuple(x.sharding for x in leaves)
    if len({frozenset(s.device_set) for s in shards}) > 1:
        return None
    return treedef, shards


def jit_pinned(fn: Callable, num_pinned: int, donate_argnums=()) -> Callable:
    """`jax.jit(fn)` of a function returning `num_pinned + 1` values (the last: metrics) whose
    first `num_pinned` outputs (e.g. the new train state) are laid out as
    its first `num_pinned` arguments (`out_shardings`), so feeding the outputs back in -- and
    anything made from them, e.g. the weights the samplers read -- never compiles a second
    program: left to itself, GSPMD lays some outputs out differently from the inputs (norm
    scales sharded on their only axis, specs spelled differently), and every later call then
    misses the cache. One `jax.jit` per input layout; `_cache_size()` counts their programs."""
    jitted: dict = {}

    def for_args(*args):
        pinned = [_shardings(a) for a in args[:num_pinned]]
        key = tuple(pinned)
        f = jitted.get(key)
        if f is None:
            if any(p is None for p in pinned):
                out = None
            else:
                out = tuple(jax.tree.unflatten(td, sh) for td, sh in pinned) + (None,)
            f = jitted[key] = jax.jit(fn, donate_argnums=donate_argnums, out_shardings=out)
        return f

    def call(*args):
        return for_args(*args)(*args)

    call._cache_size = lambda: sum(f._cache_size() for f in jitted.values())
    # `step.lower(*args)`: arrays or ShapeDtypeStructs with shardings (e.g. a memory plan)
    call.lower = lambda *args: for_args(*args).lower(*args)
    call.jitted = jitted
    return call


def check_nonfinite(state: TrainState, max_in_row: int, last_good: str = "") -> None:
    """Raises after `max_in_row` consecutive skipped updates. `last_good` says where the last
    checkpoint the guards trusted is (the caller knows; skipped steps are never saved)."""
    n = int(state.skips_in_row)
    if n >= max_in_row:
        raise NonFiniteError(
            f"{n} consecutive non-finite updates (max_nonfinite={max_in_row}) at step "
            f"{int(state.step)}; stopping.{' ' + last_good if last_good else ''}"
        )


class DivergenceGuard:
    """Stops a run whose loss spikes or whose parameters blow up while still finite.

    A step diverges when its loss > `max_loss_spike` x the median of the previous `window` finite
    losses, or its global parameter norm > `max_param_growth` x the norm at the stage's first
    step (`param_norm0`, kept in the checkpoint so a resume compares against the same baseline).
    0 turns either test off. Skipped (non-finite) steps are left to `check_nonfinite`. The spike
    test is for losses that stay positive (cross-entropy, TV), not for a policy-gradient loss.
    """

    def __init__(self, max_loss_spike: float, max_param_growth: float, window: int = 20):
        self.max_loss_spike, self.max_param_growth = max_loss_spike, max_param_growth
        self.window = window
        self.losses: list[float] = []
        self.param_norm0: float | None = None

    def state_dict(self) -> dict:
        return {"losses": self.losses[-self.window :], "param_norm0": self.param_norm0}

    def load_state_dict(self, d: dict | None) -> None:
        if d:
            self.losses, self.param_norm0 = list(d["losses"]), d["param_norm0"]

    def check(self, step: int, loss: float, param_norm: float, skipped: bool) -> str | None:
        """None if the step looks healthy, else why it does not (and the guard is not updated)."""
        if skipped:
            return None
        if self.param_norm0 is None:
            self.param_norm0 = max(param_norm, 1e-12)
        if self.max_param_growth and param_norm > self.max_param_growth * self.param_norm0:
            return (
                f"parameter norm {param_norm:.4g} at step {step} is more than "
                f"max_param_growth={self.max_param_growth:g} x its value at the stage start "
                f"({self.param_norm0:.4g})"
            )
        recent = self.losses[-self.window :]
        if self.max_loss_spike and len(recent) >= min(5, self.window):
            median = float(np.median(recent))
            if loss > self.max_loss_spike * max(median, 1e-12):
                return (
                    f"loss {loss:.4g} at step {step} is more than max_loss_spike="
                    f"{self.max_loss_spike:g} x the median of the previous {len(recent)} "
                    f"losses ({median:.4g})"
                )
        self.losses = [*recent, loss][-self.window :]
        return None


def token_cross_entropy(logits_BxTxV, targets_BxT, mask_BxT):
    """Mean over masked tokens of -log softmax(logits)[target], in float32."""
    logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    nll_BxT = -jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1)[..., 0]
    denom = jnp.maximum(mask_BxT.sum(), 1.0)
    return (nll_BxT * mask_BxT).sum() / denom
