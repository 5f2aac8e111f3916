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
    run = _Records(name, Path(stage_dir), cfg, it)
    state = run.resume(state)
    start = int(state.step)
    profiler = _Profiler(run.stage_dir / "profile", start + 1, cfg.profile_steps)
    bar = Progress(total_steps, start, name)
    last, last_eval = {}, {}
    t0 = time.perf_counter()
    try:
        while (step := int(state.step)) < total_steps:
            profiler.before_step(step)
            state, m = train_step(state, make_batch(next(it)))
            step += 1
            profiler.after_step(step, state)
            skipped = run.check(step, state, m)
            bar.update(1, tokens_per_step)
            if step % log_every == 0 or step == total_steps:
                extra = {"lr": lr_at(step - 1)} if lr_at is not None else {}
                last = run.writer.write(step, {**m, **extra})
                bar.bar.set_postfix(loss=f"{float(m['loss']):.4f}", refresh=False)
            if (
                eval_fn is not None
                and eval_every
                and (step % eval_every == 0 or step == total_steps)
            ):
                last_eval = eval_fn(state)
                run.writer.write(step, {f"eval/{k}": v for k, v in last_eval.items()})
                if stop_fn is not None and stop_fn(last_eval):
                    if not skipped:
                        run.save(step, state)
                    break
            run.save_if_due(step, state, skipped, last_step=step == total_steps)
            if stop_at_step is not None and step >= stop_at_step:
                raise Interrupted(f"stopped at step {step}")
        if run.saved != int(state.step):
            log.warning(
                "%s: the last step was skipped; newest checkpoint: step %s", name, run.saved
            )
    finally:
        profiler.stop()
        bar.close()
        run.close()
    return FitResult(state, int(state.step) - start, time.perf_counter() - t0, last, last_eval)


class _Records:
    """A training stage's checkpoints (with the data iterator's and the divergence guard's
    state), its metrics writer and its guards."""

    def __init__(self, name: str, stage_dir: Path, cfg: RunConfig, it):
        self.name, self.stage_dir, self.cfg, self.it = name, stage_dir, cfg, it
        self.ckpt = Checkpointer(stage_dir / "ckpt", cfg.ckpt.keep, cfg.ckpt.async_save)
        self.writer = MetricsWriter(
            stage_dir / "metrics.jsonl",
            stage_dir / "tb" if cfg.tensorboard else None,
            config=config_lib.to_dict(cfg),
        )
        self.guard = DivergenceGuard(cfg.max_loss_spike, cfg.max_param_growth)
        self.saved = None  # newest step checkpointed (restored or saved by this launch)
        self.save_due = False

    def resume(self, state: TrainState) -> TrainState:
        """The newest checkpoint's state (the data iterator and the guard restored with it), or
        `state`. A fresh start also drops the records of an earlier launch killed before its
        first save."""
        restored = self.ckpt.restore_latest(state)
        if restored is not None:
            self.saved, state, meta = restored
            self.it.set_state(meta["data"])
            self.guard.load_state_dict(meta.get("guard"))
        self.writer.truncate_after(self.saved or 0)
        return state

    def check(self, step: int, state: TrainState, m: dict) -> bool:
        """The non-finite and divergence guards after `step`; returns whether it was skipped."""
        loss, skipped = float(m["loss"]), bool(m["skipped"])
        check_nonfinite(state, self.cfg.max_nonfinite, self.last_good())
        why = self.guard.check(step, loss, float(m.get("param_norm", 0.0)), skipped)
        if why is not None:
            self.writer.write(step, m)
            raise DivergenceError(f"{self.name}: {why}; stopping. {self.last_good()}")
        return skipped

    def save(self, step: int, state: TrainState, force: bool = False) -> None:
        meta = {"data": self.it.get_state(), "guard": self.guard.state_dict()}
        self.ckpt.save(step, state, meta, force=force)
        self.saved = step

    def save_if_due(self, step: int, state: TrainState, skipped: bool, last_step: bool) -> None:
        """A checkpoint every `ckpt.every` steps and at the last (a skipped step is saved at the
        next good one); on SIGTERM, one now and `Preempted`."""
        self.save_due = self.save_due or step % self.cfg.ckpt.every == 0 or last_step
        if self.save_due and not skipped:
            self.save(step, state)
            self.save_due = False
        if preempted(step):
            if self.saved != step and not skipped:
                self.save(step, state, force=True)
            raise Preempted(
                f"{self.name}: SIGTERM at step {step}; checkpoint step {self.saved} in "
                f"{self.ckpt.directory}. Rerun the same command to resume."
            )

    def last_good(self) -> str:
        if self.saved is None:
            return "No checkpoint was saved: a rerun starts this stage afresh."
        return (
            f"The last good checkpoint is step {self.saved} in {self.ckpt.directory} (skipped and "
            f"diverged steps are never saved): fix the cause (e.g. a lower learning rate) and "
            f"rerun to resume from it."
        )

    def close(self) -> None:
        self.ckpt.close()
        self.writer.close()
