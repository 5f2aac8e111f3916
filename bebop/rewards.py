"""Reward scoring in worker processes with a time bound and loud failures (the tasks and their
reward functions: `bebop/tasks.py`).

Reward code parses text; it never evaluates model output as code. Completions are truncated
(tasks.py caps lengths) and every batch of reward calls has a wall-clock bound, `timeout_s`
(`rl.reward_timeout_s`). Rewards run in a persistent pool of worker processes (spawned, never
forked from the multithreaded JAX parent; started once, so the common case pays no start-up): a
call that hangs is ended by terminating the pool, which is rebuilt on the next batch, so a stuck
reward can neither hang the run nor keep the interpreter from exiting. A reward function that
raises fails the whole group with `RewardError` (after `retries` further attempts) instead of
silently becoming a zero; one that exceeds the bound does the same, or scores 0 when
`on_timeout="zero"` (`rl.reward_timeout_action`). Reward functions and problems cross a process
boundary, so they must be picklable: module-level functions and plain dataclasses.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Sequence

import numpy as np


class RewardError(RuntimeError):
    pass


# What a reward call may print (stdout and stderr together) that reaches the run's log.
MAX_PRINTED = 2000


class _Bounded(io.TextIOBase):
    """A text sink keeping the first `limit` characters and counting the rest."""

    def __init__(self, limit: int):
        self.limit, self.kept, self.total = limit, [], 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        room = self.limit - min(self.limit, self.total)
        if room:
            self.kept.append(text[:room])
        self.total += len(text)
        return len(text)

    def text(self) -> str:
        return "".join(self.kept)


def _name(reward_fn) -> str:
    spec = getattr(reward_fn, "spec", None)
    if spec:
        return spec
    return (
        f"{getattr(reward_fn, '__module__', '?')}.{getattr(reward_fn, '__qualname__', reward_fn)}"
    )


def check_value(value, reward_fn) -> float:
    """A reward must be a real, finite number (a Python or NumPy int / float, or a 0-d numeric
    array); anything else -- NaN, inf, a string, None, a list -- is an error naming the function."""
    arr = np.asarray(value) if isinstance(value, np.ndarray | np.generic) else None
    numeric = isinstance(value, int | float) or (
        arr is not None and arr.ndim == 0 and arr.dtype.kind in "biuf"
    )
    if not numeric or not np.isfinite(float(value)):
        raise ValueError(
            f"reward function {_name(reward_fn)} returned {value!r} "
            f"({type(value).__name__}); a reward must be a finite number"
        )
    return float(value)


def _call(reward_fn, text, problem):  # runs in a worker process
    """(the checked reward, what the call printed (bounded), how many characters it printed)."""
    sink = _Bounded(MAX_PRINTED)
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        value = reward_fn(text, problem)
    return check_value(value, reward_fn), sink.text(), sink.total


def _ready(_) -> None:
    return None


STARTUP_TIMEOUT_S = 120.0


class RewardPool:
    """Worker processes that score rewards; `score` is serialised by a lock (the rollout worker
    and the learner's evaluations share one pool)."""

    def __init__(self, processes: int | None = None):
        self.processes = processes or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._pool = None
        self._lock = threading.Lock()

    def _get(self):
        if self._pool is None:
            self._pool = multiprocessing.get_context("spawn").Pool(self.processes)
            # Start-up (interpreter, imports) before any deadline runs: it is not the reward's.
            try:
                self._pool.map_async(_ready, range(self.processes)).get(STARTUP_TIMEOUT_S)
            except multiprocessing.TimeoutError:
                self.terminate()
                raise RewardError(
                    f"reward worker processes did not start within {STARTUP_TIMEOUT_S}s. Spawned "
                    "workers re-import the main script: guard its entry point with "
                    "`if __name__ == '__main__':`"
                ) from None
        return self._pool

    def terminate(self) -> None:
        """Kills the workers (a stuck reward included); the next call starts new ones."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def run(self, reward_fn, texts, problems, timeout_s: float):
        """One attempt: (values [N], finished [N] bool, first error or None). Calls unfinished
        at the deadline (or after an error) are killed with the pool."""
        with self._lock:
            pool = self._get()
            jobs = [
                pool.apply_async(_call, (reward_fn, t, p))
                for t, p in zip(texts, problems, strict=True)
            ]
            deadline = time.monotonic() + timeout_s
            vals, done, error = np.zeros(len(jobs), np.float32), np.zeros(len(jobs), bool), None
            printed = []
            for i, job in enumerate(jobs):
                job.wait(max(0.0, deadline - time.monotonic()))
                if not job.ready():
                    break
                try:
                    vals[i], out, n = job.get()
                    done[i] = True
                    printed.append((out, n))
                except Exception as e:  # noqa: BLE001 - reported by `score`, loudly
                    error = e
                    break
            for i, job in enumerate(jobs):  # whatever finished meanwhile
                if not done[i] and job.ready() and job.successful():
                    vals[i], out, n = job.get()
                    done[i] = True
                    printed.append((out, n))
            if not all(job.ready() for job in jobs):
                self.terminate()
            _log_printed(reward_fn, printed)
            return vals, done, error


def _log_printed(reward_fn, printed) -> None:
    """One bounded log line for what a batch of reward calls printed (not the raw output)."""
    total = sum(n for _, n in printed)
    if not total:
        return
    first = next(out for out, n in printed if n)
    calls = sum(1 for _, n in printed if n)
    logging.info(
        "reward function %s printed %d characters in %d of %d calls (the first %d of one: %r)",
        _name(reward_fn),
        total,
        calls,
        len(printed),
        min(len(first), 500),
        first[:500],
    )


_POOL = RewardPool()
atexit.register(_POOL.terminate)


def shutdown() -> None:
    """Ends the shared pool's workers and frees its semaphores now: for an exit through
    `os._exit` (launch.py), which skips the interpreter's clean-up, where multiprocessing's
    resource tracker would report them leaked."""
    import gc

    _POOL.terminate()
    gc.collect()  # the pool's queues and locks: their finalizers unlink the semaphores


def _failure(e: BaseException) -> RewardError:
    msg = f"reward function failed: {type(e).__name__}: {e}"
    if "pickle" in str(e).lower():
        msg += (
            " (rewards run in worker processes: the reward function must be a module-level "
            "function and problems plain picklable data)"
        )
    err = RewardError(msg)
    err.__cause__ = e
    return err


def score(
    reward_fn,
    texts: Sequence[str],
    problems: Sequence,
    timeout_s: float,
    retries: int,
    on_timeout: str = "error",
    pool: RewardPool | None = None,
):
    """Rewards for a batch, computed in worker processes. A reward that raises: `RewardError`
    (after `retries` further attempts of the whole batch). Calls unfinished after `timeout_s`
    seconds are killed and retried (`retries`), then raise `RewardError` naming
    `rl.reward_timeout_s`, or score 0.0 with `on_timeout="zero"`."""
    if on_timeout not in ("error", "zero"):
        raise ValueError(f"rl.reward_timeout_action={on_timeout!r}: error | zero")
    pool = pool or _POOL
    texts, problems = list(texts), list(problems)
    if len(texts) != len(problems):
        raise ValueError(f"score: {len(texts)} texts but {len(problems)} problems")
    vals = np.zeros(len(texts), np.float32)
    todo, failure = np.arange(len(texts)), None
    for _attempt in range(retries + 1):
        sub_t, sub_p = [texts[i] for i in todo], [problems[i] for i in todo]
        v, done, error = pool.run(reward_fn, sub_t, sub_p, timeout_s)
        if error is not None:  # a failure retries the whole batch
            failure, todo = _failure(error), np.arange(len(texts))
            continue
        failure = None
        vals[todo[done]] = v[done]
        todo = todo[~done]
        if not len(todo):
            return vals
        # The pool hands out calls in order: the first unfinished ones were running (the stuck
        # ones among them), the rest only queued behind them. Retry those first.
        todo = np.roll(todo, -min(pool.processes, len(todo)))
    if failure is not None:
        raise failure
    if on_timeout == "zero":
        logging.warning("%d reward calls exceeded %ss: scored 0", len(todo), timeout_s)
        return vals
    raise RewardError(
        f"reward computation exceeded rl.reward_timeout_s={timeout_s}s for {len(todo)} of "
        f"{len(texts)} completions (after {retries} retries); rl.reward_timeout_action='zero' "
        f"scores them 0 instead"
    )
