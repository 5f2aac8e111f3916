"""The training loop every stage shares: resume -> step -> guard -> log -> checkpoint -> evaluate.

`fit` restores the newest readable checkpoint in `<stage dir>/ckpt` (train state, data-iterator
state, guard baseline), truncates `metrics.jsonl` to the restored step, then runs `train_step`
until `total_steps`, writing one JSON record every `log_every` steps (plus `eval/*` records from
`eval_fn` every `eval_every` steps) and checkpointing every `ckpt.every` steps and at the end.

Guards: a run stops after `max_nonfinite` consecutive skipped updates, or when `DivergenceGuard`
sees a loss spike or a parameter-norm blow-up. A skipped or diverged step is never saved (a due
save waits for the next good step), so the newest checkpoint is always the last one the guards
trusted, `ckpt.keep` never deletes it, and a rerun (say with a lower learning rate) resumes there.

Preemption: after `install_preemption_handler()`, SIGTERM finishes the current step, saves it and
raises `Preempted`; rerunning the same command resumes. `profile_steps > 0` traces that many steps
(after the first of the launch, which compiles) with `jax.profiler` into `<stage dir>/profile`.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax

from bebop import config as config_lib
from bebop.ckpt import Checkpointer
from bebop.config import RunConfig
from bebop.metrics import MetricsWriter, Progress
from bebop.train import DivergenceError, DivergenceGuard, TrainState, check_nonfinite

log = logging.getLogger(__name__)

PREEMPTED = threading.Event()


class Interrupted(RuntimeError):
    """Raised by `stop_at_step` (tests of kill-and-resume)."""


class Preempted(RuntimeError):
    """SIGTERM arrived: the current step was checkpointed; rerun the same command to resume."""


def install_preemption_handler() -> None:
    """SIGTERM (SLURM, a TPU maintenance event, Kubernetes) sets `PREEMPTED`; `fit` then saves and
    raises `Preempted`. With several processes JAX's own SIGTERM notifier is left in place and
    `fit` asks `reached_preemption_sync_point` so that every process saves the same step."""
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: PREEMPTED.set())


def preempted(step: int) -> bool:
    """True once SIGTERM arrived (every process agrees on the step with several processes)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.reached_preemption_sync_point(step)
    return PREEMPTED.is_set()


@dataclasses.dataclass
class FitResult:
    state: TrainState
    steps_run: int
    train_time_s: float
    last_metrics: dict
    last_eval: dict


class _Profiler:
    """Traces steps first < step <= first + n (the first step of a launch compiles)."""

    def __init__(self, directory: Path, first: int, n: int):
        self.directory, self.first, self.last, self.on = directory, first, first + n, False

    def before_step(self, step: int) -> None:  # `step` updates done so far
        if self.last > self.first and step == self.first and not self.on:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.on = True

    def after_step(self, step: int, state) -> None:
        if self.on and step >= self.last:
            self.stop(state)

    def stop(self, state=None) -> None:
        if self.on:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.on = False
            log.info("profile of steps %d-%d in %s", self.first + 1, self.last, self.directory)


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
    stop_fn: Callable[[dict], bool] | None = None,
) -> FitResult:
    """`stop_fn(eval_results)`: after each evaluation, True ends training early (checkpointed)."""
    stage_dir = Path(stage_dir)
    ckpt = Checkpointer(stage_dir / "ckpt", cfg.ckpt.keep, cfg.ckpt.async_save)
    writer = MetricsWriter(
        stage_dir / "metrics.jsonl",
        stage_dir / "tb" if cfg.tensorboard else None,
        config=config_lib.to_dict(cfg),
    )
    guard = DivergenceGuard(cfg.max_loss_spike, cfg.max_param_growth)
    saved = None  # newest step checkpointed (restored or saved by this launch)
    restored = ckpt.restore_latest(state)
    if restored is not None:
        saved, state, meta = restored
        it.set_state(meta["data"])
        guard.load_state_dict(meta.get("guard"))
    # A fresh start also drops the records of an earlier launch killed before its first save.
    writer.truncate_after(saved or 0)
    start = int(state.step)
    profiler = _Profiler(stage_dir / "profile", start + 1, cfg.profile_steps)

    def save(step: int, force: bool = False) -> None:
        nonlocal saved
        meta = {"data": it.get_state(), "guard": guard.state_dict()}
        ckpt.save(step, state, meta, force=force)
        saved = step

    def last_good() -> str:
        if saved is None:
            return "No checkpoint was saved: a rerun starts this stage afresh."
        return (
            f"The last good checkpoint is step {saved} in {ckpt.directory} (skipped and "
            f"diverged steps are never saved): fix the cause (e.g. a lower learning rate) and "
            f"rerun to resume from it."
        )

    bar = Progress(total_steps, start, name)
    last, last_eval = {}, {}
    save_due = False
    t0 = time.perf_counter()
    try:
        while (step := int(state.step)) < total_steps:
            profiler.before_step(step)
            state, m = train_step(state, make_batch(next(it)))
            step += 1
            profiler.after_step(step, state)
            loss, skipped = float(m["loss"]), bool(m["skipped"])
            check_nonfinite(state, cfg.max_nonfinite, last_good())
            why = guard.check(step, loss, float(m.get("param_norm", 0.0)), skipped)
            if why is not None:
                writer.write(step, m)
                raise DivergenceError(f"{name}: {why}; stopping. {last_good()}")
            bar.update(1, tokens_per_step)
            if step % log_every == 0 or step == total_steps:
                extra = {"lr": lr_at(step - 1)} if lr_at is not None else {}
                last = writer.write(step, {**m, **extra})
                bar.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)  # NaN logs as "nan"
            if (
                eval_fn is not None
                and eval_every
                and (step % eval_every == 0 or step == total_steps)
            ):
                last_eval = eval_fn(state)
                writer.write(step, {f"eval/{k}": v for k, v in last_eval.items()})
                if stop_fn is not None and stop_fn(last_eval):
                    if not skipped:
                        save(step)
                    break
            save_due = save_due or step % cfg.ckpt.every == 0 or step == total_steps
            if save_due and not skipped:  # a skipped step is saved at the next good one
                save(step)
                save_due = False
            if preempted(step):
                if saved != step and not skipped:
                    save(step, force=True)
                raise Preempted(
                    f"{name}: SIGTERM at step {step}; checkpoint step {saved} in "
                    f"{ckpt.directory}. Rerun the same command to resume."
                )
            if stop_at_step is not None and step >= stop_at_step:
                raise Interrupted(f"stopped at step {step}")
        if saved != int(state.step):
            log.warning("%s: the last step was skipped; newest checkpoint: step %s", name, saved)
    finally:
        profiler.stop()
        bar.close()
        ckpt.close()
        writer.close()
    return FitResult(state, int(state.step) - start, time.perf_counter() - t0, last, last_eval)
