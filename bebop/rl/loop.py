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

Several processes (a GPU cluster, a TPU pod, `bebop.local_cluster`): each process runs this
loop, and both its threads launch SPMD programs over the whole mesh. A collective program must
be launched in the same order in every process, and two threads give no order: process A may
launch rollout-then-update where process B launches update-then-rollout, and the collectives
pair up wrongly (a hang, or silently mixed data). Choice: (a) one deterministic dispatch order
(`Turnstile`), not (b) disjoint rollout / learner sub-meshes. The schedule above is already
deterministic, so the order can follow it: W_i (produce batch i) and L_j (learner step j) take
turns as

    W_s0 .. W_s0+s,  L_s0, W_s0+s+1,  L_s0+1, W_s0+s+2,  ...     (s0: first step, s: staleness)

the earliest order that the staleness schedule allows (W_i needs version i - s, made by
L_i-s-1), so every batch comes from the same version as with one process, the bound holds in
every process alike (the learner also checks that all processes agree on step and versions),
and a multi-process run computes what the one-process run computes. Why not (b): it needs a
weight transfer between meshes each version and a split of the devices that the tiny test
meshes cannot exercise, and it changes the numbers against one process; on a pod where rollouts
dominate it is the next step: with the turnstile, a rollout (sampling and reward scoring) and
a learner step (update, publish, evaluation, checkpoint) never overlap; only the queue hand-off
and the learner's host bookkeeping do. One process keeps the free-running threads.
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

from bebop import sharding
from bebop.train import jit_pinned


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
    # [B, S, F*D] the layers an MTP with `mtp.features` reads, as verification computed them
    features: jax.Array | None = None


@dataclasses.dataclass
class RolloutBatch:
    index: int
    policy_version: int
    mtp_version: int
    data: LearnerBatch  # leading axis = rollouts
    stats: dict
    timings: dict
    draft_tokens: np.ndarray | None = None  # `records.DRAFT_TOKEN_DTYPE` records of sampled rows
    # The rows of the global batch that `data` holds (this process's share), and its size;
    # None: `data` is the whole batch.
    rows: np.ndarray | None = None
    batch_size: int | None = None

    def place(self, mesh) -> LearnerBatch:
        """`data` as global arrays laid out over `mesh` by rows."""
        if self.rows is None:
            return sharding.shard_batch(self.data, mesh)
        return sharding.place_rows(self.data, mesh, self.rows, self.batch_size)


@dataclasses.dataclass
class WorkerFailed:
    error: BaseException


def snapshot(tree):
    """A copy whose buffers survive the learner donating its own."""
    return jax.tree.map(jnp.copy, tree)


_CASTS: dict = {}


def behaviour_copy(params, dtype: str):
    """The copy of the policy's parameters the weight store keeps for a behaviour version: every
    floating leaf in the decode (compute) dtype `dtype` (`ModelConfig.dtype`), laid out as
    `params`. The samplers round every weight to that dtype anyway (`model.compute_weight`), so
    rollouts sample exactly what they would from the float32 master; the store then holds one
    bfloat16 copy per version instead of a float32 one. A float32 run keeps a plain copy."""
    dt = jnp.dtype(dtype)
    if all(
        x.dtype == dt or not jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(params)
    ):
        return snapshot(params)
    if dt not in _CASTS:

        def cast(tree):
            one = lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
            return jax.tree.map(one, tree), None

        _CASTS[dt] = jit_pinned(cast, 1)
    return _CASTS[dt](params)[0]


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


def turn_order(start: int, max_staleness: int, end: int) -> list[tuple[str, int]]:
    """The global launch order of the multi-process loop (module doc): ("W", i) produces batch
    i, ("L", j) is learner step j, for steps start .. end - 1."""
    order = [("W", i) for i in range(start, min(start + max_staleness + 1, end))]
    for j in range(start, end):
        order.append(("L", j))
        if j + max_staleness + 1 < end:
            order.append(("W", j + max_staleness + 1))
    return order


_HELD = threading.local()  # the turn the current thread holds, if any


class Turnstile:
    """Lets the rollout worker and the learner launch device work only on their turn of
    `turn_order`. `close()` (a thread died) lets everyone through: the learner then meets the
    worker's error in the queue instead of waiting for a turn that never comes."""

    def __init__(self, start: int, max_staleness: int, end: int):
        self.order = turn_order(start, max_staleness, end)
        self._index = {unit: k for k, unit in enumerate(self.order)}
        self.pos = 0
        self.closed = False
        self.log: list[tuple[str, int]] = []  # the turns taken, in order (tests)
        self._cond = threading.Condition()

    def acquire(self, unit: tuple[str, int], stop: threading.Event | None = None) -> bool:
        with self._cond:
            if self._index.get(unit, -1) < self.pos:
                raise RuntimeError(f"turn {unit} is not ahead in the launch order")
            while not self.closed and self.order[self.pos] != unit:
                if stop is not None and stop.is_set():
                    return False
                self._cond.wait(timeout=0.1)
            if not self.closed:
                self.log.append(unit)
                _HELD.turn = (self, unit)
            return True

    def release(self, unit: tuple[str, int]) -> None:
        """Ends `unit`'s turn (once; later calls do nothing)."""
        with self._cond:
            if getattr(_HELD, "turn", None) == (self, unit):
                _HELD.turn = None
                self.pos += 1
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class RolloutWorker(threading.Thread):
    """Produces batches start_index, start_index + 1, ... (up to `end_index`, if given) into
    `out`; with a `turnstile` each on its turn."""

    def __init__(
        self,
        produce: Callable,
        store: WeightStore,
        out: queue.Queue,
        start_index: int,
        max_staleness: int,
        stop: threading.Event,
        first_version: int = 0,
        end_index: int | None = None,
        turnstile: Turnstile | None = None,
    ):
        super().__init__(daemon=True, name="rollout-worker")
        self.produce, self.store, self.out = produce, store, out
        self.start_index, self.max_staleness, self.stop = start_index, max_staleness, stop
        self.first_version, self.end_index, self.turnstile = first_version, end_index, turnstile

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run(self) -> None:
        i, turns = self.start_index, self.turnstile
        try:
            while not self.stop.is_set() and (self.end_index is None or i < self.end_index):
                if turns is not None and not turns.acquire(("W", i), self.stop):
                    return
                try:
                    version = max(self.first_version, i - self.max_staleness)
                    weights = self.store.get(version, self.stop)
                    if weights is None:
                        return
                    policy, mtp, mtp_version = weights
                    batch = self.produce(i, version, policy, mtp, mtp_version)
                finally:
                    if turns is not None:
                        turns.release(("W", i))
                if not self._put(batch):
                    return
                i += 1
        except BaseException as e:  # noqa: BLE001 - handed to the learner, which re-raises
            if turns is not None:
                turns.close()
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


def check_agreement(step: int, batch: RolloutBatch, version: int) -> None:
    """Several processes: all are at the same learner step with a batch of the same index and
    versions (a collective, on the learner's turn); a difference is an error naming them."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    mine = np.array([step, batch.index, batch.policy_version, batch.mtp_version, version])
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.size)
    if not (every == mine).all():
        raise StalenessError(
            f"processes disagree on (step, batch, batch policy version, batch MTP version, "
            f"policy version): {every.tolist()}"
        )
