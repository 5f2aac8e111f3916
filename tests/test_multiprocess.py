"""The pipeline as 2 JAX processes on localhost (`bebop.local_cluster`, gloo CPU collectives, 2 CPU
devices each: a 4-device global mesh) against 1 process on the same 4-device mesh; a process
SIGKILLed mid-RL stops the job within a bound and a restart resumes; the multi-process RL loop's
launch order (`loop.Turnstile`)."""

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from bebop.local_cluster import process_env
from bebop.metrics import read_jsonl
from bebop.rl import loop, records

from .conftest import REPO

# The runlocal demo shrunk further: every stage runs, RL is async (max_staleness 1, the default)
# with speculative rollouts, and every RL step is checkpointed (the kill test resumes from one).
SMALL = [
    "sft.steps=8",
    "sft.batch_size=8",
    "sft.eval_samples=8",
    "distill.num_samples=16",
    "distill.batch_size=16",
    "mtp.steps=2",
    "mtp.warmup_loss_steps=0",
    "mtp.eval_every=2",
    "mtp.eval_prompts=8",
    "mtp.batch_size=8",
    "rl.steps=4",
    "rl.prompts_per_step=2",
    "rl.group_size=4",
    "rl.eval_samples=8",
    "rollout.max_new_tokens=8",
    "ckpt.every=1",
]
ARGS = ["--config", "configs/demo.py:runlocal", *[f"--config.{o}" for o in SMALL]]
# Summaries that must agree: losses, accuracies, rewards, acceptance (not times, not speeds).
COMPARED = {
    "sft": ("final_loss", "accuracy"),
    "distill": ("response_tokens", "seq_len"),
    "mtp": ("final_loss", "before", "after"),
    "rl": (
        "accuracy_before",
        "accuracy_after",
        "reward_first",
        "reward_last",
        "accept_rate",
        "accept_len",
        "mean_entropy",
        "max_staleness_seen",
    ),
}
RTOL = 1e-4  # collectives sum in another order over 2 processes than within 1


def cluster(workdir, **kw):
    cmd = [sys.executable, "-m", "bebop.local_cluster", "--processes", "2", "--", *ARGS]
    return subprocess.Popen(
        [*cmd, "--workdir", str(workdir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


KILL_BOUND_S = 30.0


@dataclasses.dataclass
class Kill:
    """What the killed launch of the 2-process run showed."""

    returncode: int
    took_s: float  # from the SIGKILL of process 1 to the launcher's exit
    last_error: str
    killed_at: float  # wall-clock time of the SIGKILL
    summary_written: bool
    stderr: str  # the killed launch's (both processes' lines, prefixed [p0] / [p1])


def kill_process_1_after_rl_step_1(workdir) -> Kill:
    """Starts the 2-process run, SIGKILLs process 1 once RL step 1 is checkpointed and waits for
    the launcher to exit."""
    proc = cluster(workdir)
    pids = proc.stderr.readline()  # "local_cluster: 2 processes on port P: p0=PID, p1=PID"
    p1 = int(pids.split("p1=")[1])
    errs = []
    reader = threading.Thread(target=lambda: errs.extend(proc.stderr), daemon=True)
    reader.start()
    metrics = workdir / "rl/metrics.jsonl"
    step1 = workdir / "rl/ckpt/1"  # orbax renames its tmp folder to this when finalized
    deadline = time.monotonic() + 900
    while not (metrics.exists() and read_jsonl(metrics) and step1.is_dir()):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(errs)[-3000:]
        time.sleep(0.05)
    os.kill(p1, signal.SIGKILL)
    killed_at, t0 = time.time(), time.monotonic()
    proc.wait(timeout=120)
    took = time.monotonic() - t0
    reader.join(timeout=10)
    summary = (workdir / "rl/summary.json").exists()
    return Kill(proc.returncode, took, errs[-1] if errs else "", killed_at, summary, "".join(errs))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same config as 2 processes and as 1 process on the same 4-device mesh, side by side.
    The 2-process run is SIGKILLed in RL (process 1, after the step-1 checkpoint) and restarted:
    (2-process workdir, 1-process workdir, the `Kill`)."""
    root = tmp_path_factory.mktemp("multiprocess")
    one = subprocess.Popen(
        [sys.executable, "launch.py", *ARGS, "--workdir", str(root / "one")],
        cwd=REPO,
        env=process_env(4),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    kill = kill_process_1_after_rl_step_1(root / "two")
    again = cluster(root / "two")
    for name, proc in (("2 processes, restarted", again), ("1 process", one)):
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{err[-3000:]}"
    return root / "two", root / "one", kill


def summaries(workdir):
    return {s: json.loads((workdir / s / "summary.json").read_text()) for s in COMPARED}


@pytest.mark.slow
def test_two_processes_match_one_process_on_the_same_mesh(runs):
    """Every stage's results of the 2-process run (RL killed once and resumed) equal the
    uninterrupted 1-process run's within RTOL."""
    two, one = (summaries(w) for w in runs[:2])
    for stage, keys in COMPARED.items():
        for k in keys:
            np.testing.assert_allclose(
                np.asarray(list(_leaves(two[stage][k]))),
                np.asarray(list(_leaves(one[stage][k]))),
                rtol=RTOL,
                err_msg=f"{stage}.{k}",
            )
    # the async loop reached its staleness bound in both (batch i from version i - 1)
    assert two["rl"]["max_staleness_seen"] == 1
    # process 0 alone wrote the records: one line per logged step, across the restart
    assert [r["step"] for r in read_jsonl(runs[0] / "rl/metrics.jsonl")] == [1, 2, 3, 4]
    # Each process handles half of every global batch (the data axis of the 4-device mesh
    # spans both processes), and the results above still match one process: the SFT and MTP
    # loaders read, and the RL rollouts prompt, sample, decode and score, rows 0..3 / 4..7 of
    # each batch of 8; distillation samples rows 0..7 / 8..15 of its batch of 16.
    for i, (rows8, rows16) in enumerate((("0..3", "0..7"), ("4..7", "8..15"))):
        lines = [ln for ln in runs[2].stderr.splitlines() if ln.startswith(f"[p{i}] ")]
        for rows, size, times in ((rows8, 8, 3), (rows16, 16, 1)):
            said = f"process {i} of 2 reads rows {rows} of each global batch of {size}"
            assert sum(said in ln for ln in lines) == times, (said, runs[2].stderr[-3000:])
    # the draft records of the rows each process sampled, gathered by process 0: the same
    # records as one process wrote (entropy and α within RTOL)
    two_d, one_d = (records.load_draft_tokens(w / "rl/draft_tokens.bin") for w in runs[:2])
    assert len(one_d) > 0 and len(set(one_d["row"])) > 1
    for k in ("step", "row", "pos", "k", "accepted"):
        np.testing.assert_array_equal(two_d[k], one_d[k], err_msg=k)
    for k in ("entropy", "alpha"):
        np.testing.assert_allclose(two_d[k], one_d[k], rtol=RTOL, atol=1e-6, err_msg=k)


def _leaves(x):
    if isinstance(x, dict):
        for k in sorted(x):
            yield from _leaves(x[k])
    else:
        yield float(x)


@pytest.mark.slow
def test_a_killed_process_stops_the_job_and_a_restart_resumes(runs):
    """SIGKILL to process 1 once RL step 1 is checkpointed: the launcher stops process 0 and
    exits with 137 naming process 1 within KILL_BOUND_S, before RL finished; the restart resumed
    RL from the newest checkpoint (the step-1 record is the killed launch's, never redone).
    (That the resumed results equal the uninterrupted 1-process run's: the test above.)"""
    kill = runs[2]
    assert kill.returncode == 137 and kill.took_s < KILL_BOUND_S, kill
    assert kill.last_error.startswith("error: process 1 of 2 was killed by SIGKILL"), kill
    assert not kill.summary_written
    recs = read_jsonl(runs[0] / "rl/metrics.jsonl")
    assert recs[0]["time"] < kill.killed_at  # step 1 was restored, not redone
    assert recs[-1]["time"] > kill.killed_at


# ----------------------------------------------------------------------------- launch order


def _batch(i, version, mtp_version=0):
    data = loop.LearnerBatch(np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 1)), np.zeros(1))
    return loop.RolloutBatch(i, version, mtp_version, data, {}, {})


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_turnstile_follows_the_staleness_schedule_in_one_global_order(staleness):
    """Worker and learner threads with a `Turnstile`, the producer slowed at random: the launches
    happen exactly in `turn_order` (hand-checked for s = 1 below), and batch i comes from version
    max(0, i - s)."""
    start, end = 1, 7
    if staleness == 1:
        assert loop.turn_order(1, 1, 5) == [
            ("W", 1), ("W", 2), ("L", 1), ("W", 3), ("L", 2), ("W", 4), ("L", 3), ("L", 4),
        ]  # fmt: skip
    events, rng = [], np.random.default_rng(staleness)
    store, stop = loop.WeightStore(keep=staleness + 2), threading.Event()
    store.publish(start, "w", "m", 0)
    turns = loop.Turnstile(start, staleness, end)

    def produce(i, version, *_):
        time.sleep(rng.uniform(0, 0.01))
        events.append(("W", i))
        return _batch(i, version)

    q = queue.Queue(maxsize=max(1, staleness))
    worker = loop.RolloutWorker(produce, store, q, start, staleness, stop, start, end, turns)
    worker.start()
    for step in range(start, end):
        turns.acquire(("L", step))
        batch = loop.next_batch(q, step, step, staleness)
        assert batch.policy_version == max(start, step - staleness)
        events.append(("L", step))
        store.publish(step + 1, "w", "m", 0)
        turns.release(("L", step))
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert events == turns.log == loop.turn_order(start, staleness, end)


def test_a_worker_failure_reaches_the_learner_through_the_turnstile():
    """The worker fails producing batch 2 (after its turn began): the learner's later turns do
    not wait for it; the learner gets the error at step 2 within a second."""
    store, stop = loop.WeightStore(keep=3), threading.Event()
    store.publish(0, "w", "m", 0)
    turns = loop.Turnstile(0, 1, 6)

    def produce(i, version, *_):
        if i == 2:
            raise ValueError("reward server gone")
        return _batch(i, version)

    q = queue.Queue(maxsize=1)
    worker = loop.RolloutWorker(produce, store, q, 0, 1, stop, 0, 6, turns)
    worker.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rollout worker failed at step 2: reward server gone"):
        for step in range(6):
            turns.acquire(("L", step))
            loop.next_batch(q, step, step, 1)
            store.publish(step + 1, "w", "m", 0)
            turns.release(("L", step))
    assert time.monotonic() - t0 < 1.0
    stop.set()
    worker.join(timeout=5)


def test_local_cluster_environment_replaces_the_device_count():
    env = process_env(2, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1"})
    assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_force_host_platform_device_count=2"]
    assert env["JAX_PLATFORMS"] == "cpu" and env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"
