"""The training loop every stage shares: resume -> step -> log -> checkpoint -> evaluate.

`fit` restores the newest readable checkpoint in `<stage dir>/ckpt` (train state + data-iterator
state), truncates `metrics.jsonl` to the restored step, then runs `train_step` until
`total_steps`, writing one JSON record every `log_every` steps (plus `eval/*` records from
`eval_fn` every `eval_every` steps), checkpointing every `ckpt.every` steps and at the end, and
stopping after `max_nonfinite` consecutive skipped updates.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import jax

from bebop import sharding
from bebop.ckpt import Checkpointer
from bebop.config import RunConfig
from bebop.metrics import MetricsWriter, Progress
from bebop.train import TrainState, check_nonfinite


class Interrupted(RuntimeError):
    """Raised by `stop_at_step` (tests of kill-and-resume)."""


@dataclasses.dataclass
class FitResult:
    state: TrainState
    steps_run: int
    train_time_s: float
    last_metrics: dict
    last_eval: dict


def fit(
    name: str,
    stage_dir: Path,
    cfg: RunConfig,
    state: TrainState,
    train_step: Callable,
    it,
    make_batch: Callable,
    total_steps: int,
    log_every: int,
    tokens_per_step: int,
    lr_at: Callable | None = None,
    eval_fn: Callable | None = None,
    eval_every: int = 0,
    stop_at_step: int | None = None,
) -> FitResult:
    stage_dir = Path(stage_dir)
    ckpt = Checkpointer(stage_dir / "ckpt", cfg.ckpt.keep, cfg.ckpt.async_save)
    writer = MetricsWriter(
        stage_dir / "metrics.jsonl", stage_dir / "tb" if cfg.tensorboard else None
    )
    restored = ckpt.restore_latest(state)
    if restored is not None:
        step, state, meta = restored
        it.set_state(meta["data"])
        writer.truncate_after(step)
    start = int(state.step)
    bar = Progress(total_steps, start, name)
    last, last_eval = {}, {}
    t0 = time.perf_counter()
    try:
        while (step := int(state.step)) < total_steps:
            state, m = train_step(state, make_batch(next(it)))
            step += 1
            check_nonfinite(state, cfg.max_nonfinite)
            bar.update(1, tokens_per_step)
            if step % log_every == 0 or step == total_steps:
                extra = {"lr": lr_at(step - 1)} if lr_at is not None else {}
                last = writer.write(step, {**m, **extra})
                bar.bar.set_postfix(loss=f"{last['loss']:.4f}", refresh=False)
            if (
                eval_fn is not None
                and eval_every
                and (step % eval_every == 0 or step == total_steps)
            ):
                last_eval = eval_fn(state)
                writer.write(step, {f"eval/{k}": v for k, v in last_eval.items()})
            if step % cfg.ckpt.every == 0 or step == total_steps:
                ckpt.save(step, state, {"data": it.get_state()})
            if stop_at_step is not None and step >= stop_at_step:
                raise Interrupted(f"stopped at step {step}")
    finally:
        bar.close()
        ckpt.close()
        writer.close()
    return FitResult(state, total_steps - start, time.perf_counter() - t0, last, last_eval)


def restore_params(ckpt_dir: Path, abstract_params, optimizer, mesh):
    """The trained params of a stage's newest readable checkpoint, placed on `mesh`."""
    target = sharding.abstract_on_mesh(abstract_params, mesh)
    abstract_state = jax.eval_shape(lambda p: TrainState.create(p, optimizer, 0), target)
    ckpt = Checkpointer(ckpt_dir, keep=1, async_save=False)
    restored = ckpt.restore_latest(abstract_state.replace(params=target))
    ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"no checkpoint under {ckpt_dir}")
    return restored[1].params
