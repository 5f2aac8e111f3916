"""Async actor/learner machinery with bounded staleness.

One rollout worker thread produces `RolloutBatch`es (the learner's arrays: a `LearnerBatch`) into
a bounded queue; the learner (the caller's thread) consumes them in order. Batch `i` is generated
by policy version `max(0, i - max_staleness)` exactly -- also after a resume, whose checkpoint
holds the versions the next batches need (`first_version` = the resume step only for a
checkpoint without them) --, which the `WeightStore` keeps until the worker took it: the schedule is
deterministic, staleness never exceeds the bound (the learner also checks), and
`max_staleness = 0` is synchronous. After each update the learner publishes copies of its weights
(its own buffers are donated to the next step). A failure in the worker (rollout, reward) is
re-raised in the learner: a group never silently becomes zero rewards.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


class StalenessError(RuntimeError):
    pass


@struct.dataclass
class LearnerBatch:
    """What the learner trains on, one row per rollout (host arrays from the worker, device
    arrays once sharded). Positions are aligned with `tokens` (prompt, then response)."""

    tokens: jax.Array  # [B, S] int32: prompt, response, padding
    mask: jax.Array  # [B, S] float32: 1 on response tokens
    behaviour_logp: jax.Array  # [B, S] float32: the sampler's log-prob of each response token
    adv: jax.Array  # [B] GRPO advantages
    # [B, S] int32, recorded rollouts only: the tokens emitted by the verify cycle whose anchor
    # (last verified position) is t -- accepted drafts + 1 --, 0 where no cycle was anchored
    cycle_len: jax.Array | None = None
    hidden: jax.Array | None = None  # [B, S, D] the backbone hiddens verification computed


@dataclasses.dataclass
class RolloutBatch:
    index: int
    policy_version: int
    mtp_version: int
    data: LearnerBatch  # leading axis = rollouts
    stats: dict
    timings: dict
    draft_tokens: np.ndarray | None = None  # `records.DRAFT_TOKEN_DTYPE` records of sampled rows


@dataclasses.dataclass
class WorkerFailed:
    error: BaseException


def snapshot(tree):
    """A copy whose buffers survive the learner donating its own."""
    return jax.tree.map(jnp.copy, tree)


class WeightStore:
    """Published (policy, mtp, mtp_version) by policy version; keeps the newest `keep`."""

    def __init__(self, keep: int):
        self.keep = keep
        self._cond = threading.Condition()
        self._weights: dict[int, tuple] = {}

    def publish(self, version: int, policy, mtp, mtp_version: int) -> None:
        with self._cond:
            self._weights[version] = (policy, mtp, mtp_version)
            for v in [v for v in self._weights if v <= version - self.keep]:
                del self._weights[v]
            self._cond.notify_all()

    def peek(self, version: int):
        """The weights of `version` now; a `StalenessError` if they are not held."""
        with self._cond:
            if version not in self._weights:
                raise StalenessError(f"weights of version {version} are not held")
            return self._weights[version]

    def get(self, version: int, stop: threading.Event):
        with self._cond:
            while version not in self._weights:
                if stop.is_set():
                    return None
                if self._weights and min(self._weights) > version:
                    raise StalenessError(f"weights of version {version} were already dropped")
                self._cond.wait(timeout=0.1)
            return self._weights[version]


class RolloutWorker(threading.Thread):
    def __init__(
        self,
        produce: Callable,
        store: WeightStore,
        out: queue.Queue,
        start_index: int,
        max_staleness: int,
        stop: threading.Event,
        first_version: int = 0,
    ):
        super().__init__(daemon=True, name="rollout-worker")
        self.produce, self.store, self.out = produce, store, out
        self.start_index, self.max_staleness, self.stop = start_index, max_staleness, stop
        self.first_version = first_version

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run(self) -> None:
        i = self.start_index
        try:
            while not self.stop.is_set():
                version = max(self.first_version, i - self.max_staleness)
                weights = self.store.get(version, self.stop)
                if weights is None:
                    return
                policy, mtp, mtp_version = weights
                batch = self.produce(i, version, policy, mtp, mtp_version)
                if not self._put(batch):
                    return
                i += 1
        except BaseException as e:  # noqa: BLE001 - handed to the learner, which re-raises
            self._put(WorkerFailed(e))


def next_batch(q: queue.Queue, step: int, version: int, max_staleness: int) -> RolloutBatch:
    """The learner's side: the batch for `step`, or the worker's error, or a staleness error."""
    item = q.get()
    if isinstance(item, WorkerFailed):
        raise RuntimeError(f"rollout worker failed at step {step}: {item.error}") from item.error
    if item.index != step:
        raise RuntimeError(f"rollout batch {item.index} arrived for learner step {step}")
    if version - item.policy_version > max_staleness:
        raise StalenessError(
            f"batch {item.index} from policy version {item.policy_version} is "
            f"{version - item.policy_version} versions old (max_staleness={max_staleness})"
        )
    return item
