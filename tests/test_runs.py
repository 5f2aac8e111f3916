"""Runs a researcher can trust: guards never lose the last good checkpoint, readers clean nothing,
finished stages refuse a changed config, one run per workdir, damaged files are named, and the
tools (TensorBoard, profiler, preemption, sweeps) work. Most tests drive the real `fit` loop on a
4-parameter model so that they take about a second each."""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import launch
from bebop import config as config_lib
from bebop import io as bio
from bebop import sharding, tasks
from bebop.checkpoints import hf
from bebop.ckpt import Checkpointer, restore_params
from bebop.fit import PREEMPTED, Preempted, fit, install_preemption_handler
from bebop.metrics import MetricsWriter, read_jsonl
from bebop.stages import pipeline
from bebop.train import (
    DivergenceError,
    DivergenceGuard,
    NonFiniteError,
    TrainState,
    make_train_step,
)

from .conftest import REPO

DEMO = str(REPO / "configs/demo.py")
SGD = optax.sgd(0.1)


class Toy(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.linspace(0.5, 2.0, 4))


def toy_loss(params, batch, rng):
    w = jax.tree.leaves(params)[0]
    return batch["scale"] * jnp.sum((w - batch["target"]) ** 2), {}


class Stream:
    """Batch i (1-based) has loss scale `scales.get(i, 1)`; with the iterator-state interface
    that `fit` checkpoints. `on_batch(i)` runs as batch i is drawn."""

    def __init__(self, scales=None, on_batch=None):
        self.i, self.scales, self.on_batch = 0, dict(scales or {}), on_batch

    def __next__(self):
        self.i += 1
        if self.on_batch is not None:
            self.on_batch(self.i)
        return {"scale": np.float32(self.scales.get(self.i, 1.0)), "target": np.float32(self.i % 3)}

    def get_state(self):
        return {"i": self.i}

    def set_state(self, s):
        self.i = int(s["i"])


def toy_cfg(*overrides):
    base = ["ckpt.every=2", "ckpt.keep=2", "ckpt.async_save=False"]
    return config_lib.load(DEMO + ":runlocal", base + list(overrides))[0]


def toy_fit(stage_dir, cfg, stream=None, steps=8, **kw):
    _, params = nnx.split(Toy())
    state = TrainState.create(params, SGD, seed=0)
    step = make_train_step(toy_loss, SGD, donate=False)
    return fit(
        "toy",
        stage_dir,
        cfg,
        state,
        step,
        stream or Stream(),
        lambda b: b,
        total_steps=steps,
        log_every=1,
        tokens_per_step=1,
        **kw,
    )


def ckpt_steps(stage_dir):
    return sorted(int(p.name) for p in (stage_dir / "ckpt").iterdir() if p.name.isdigit())


def restored_w(stage_dir):
    _, abstract = nnx.split(nnx.eval_shape(Toy))
    mesh = sharding.make_mesh(config_lib.MeshConfig(data=1), jax.devices()[:1])
    return np.asarray(jax.tree.leaves(restore_params(stage_dir / "ckpt", abstract, mesh))[0])


# ----------------------------------------------------------------------------- item 1: guards


def test_divergence_keeps_the_last_good_checkpoint_and_a_rerun_resumes_from_it(tmp_path):
    """lr x 1e5 at steps 5-8: finite loss, parameters x2e4 per step (the reported lr=1e6 case)."""
    cfg = toy_cfg()
    good = toy_fit(tmp_path / "ref", cfg)  # the same data without the blow-up, uninterrupted
    with pytest.raises(
        DivergenceError, match=r"parameter norm .* step 5.*last good checkpoint is step 4"
    ):
        toy_fit(tmp_path / "run", cfg, Stream({i: 1e5 for i in range(5, 9)}))
    assert ckpt_steps(tmp_path / "run") == [2, 4]  # the dead step 5 was never saved
    assert np.abs(restored_w(tmp_path / "run")).max() < 10
    again = toy_fit(tmp_path / "run", cfg)  # rerun with the cause fixed: resumes at step 4
    assert again.steps_run == 4
    chex.assert_trees_all_equal(again.state.params, good.state.params)
    assert [r["step"] for r in read_jsonl(tmp_path / "run/metrics.jsonl")] == list(range(1, 9))


def test_skipped_steps_are_never_checkpointed(tmp_path):
    """NaN from step 5 on, param guard off, keep=2, a save every step: before, the skipped steps
    6 and 7 were saved and the good ones deleted."""
    cfg = toy_cfg("ckpt.every=1", "max_nonfinite=3", "max_param_growth=0.0")
    with pytest.raises(NonFiniteError, match="3 consecutive.*last good checkpoint is step 4"):
        toy_fit(tmp_path, cfg, Stream({i: np.nan for i in range(5, 9)}))
    assert ckpt_steps(tmp_path) == [3, 4]


def test_divergence_guard_thresholds():
    g = DivergenceGuard(max_loss_spike=10.0, max_param_growth=100.0, window=20)
    for i, loss in enumerate(np.geomspace(10.0, 0.1, 30)):  # a falling loss never trips it
        assert g.check(i, float(loss), 1.0, skipped=False) is None
    assert g.check(31, 0.5, 1.0, skipped=False) is None  # 4x the median: noise, not divergence
    assert "max_loss_spike" in g.check(32, 5.0, 1.0, skipped=False)  # > 10x the median
    assert g.check(33, float("nan"), 1.0, skipped=True) is None  # left to the non-finite guard
    resumed = DivergenceGuard(10.0, 100.0)
    resumed.load_state_dict(json.loads(json.dumps(g.state_dict())))  # via checkpoint meta
    assert resumed.check(34, 0.2, 99.0, skipped=False) is None
    assert "max_param_growth" in resumed.check(35, 0.2, 101.0, skipped=False)


# ----------------------------------------------------------------------------- item 2: readers


def test_a_reader_leaves_another_runs_in_flight_save_alone(tmp_path):
    res = toy_fit(tmp_path, toy_cfg(), steps=4)
    ck = tmp_path / "ckpt"
    tmp_save = ck / "7.orbax-checkpoint-tmp"  # how orbax 0.12 names a save in flight
    shutil.copytree(ck / "4", tmp_save)
    np.testing.assert_array_equal(restored_w(tmp_path), jax.tree.leaves(res.state.params)[0])
    with Checkpointer(ck, read_only=True).manager as m:
        assert m.latest_step() == 4
    assert tmp_save.exists()
    toy_fit(tmp_path, toy_cfg(), steps=6)  # the owner (it holds the workdir lock) cleans its own
    assert not tmp_save.exists() and ckpt_steps(tmp_path) == [4, 6]


def test_a_reader_does_not_quarantine_and_the_owner_falls_back(tmp_path):
    """A finalized-looking but truncated newest step: readers and the resuming owner both fall
    back to the older step; only the owner renames the bad one to corrupt-<step>."""
    cfg = toy_cfg("ckpt.every=4")
    toy_fit(tmp_path, cfg)
    for p in (tmp_path / "ckpt/8").rglob("*"):
        if p.is_file() and p.stat().st_size > 0:
            p.write_bytes(p.read_bytes()[: max(1, p.stat().st_size // 3)])
    w4 = restored_w(tmp_path)
    assert ckpt_steps(tmp_path) == [4, 8]  # the reader renamed nothing
    res = toy_fit(tmp_path, cfg)  # resume: falls back to 4, quarantines 8, redoes 5-8
    assert res.steps_run == 4 and (tmp_path / "ckpt/corrupt-8").exists()
    assert np.isfinite(w4).all() and ckpt_steps(tmp_path) == [4, 8]


# ----------------------------------------------------------------------------- item 4: records


def finish_stage(workdir, cfg, stage="sft"):
    """A finished stage as `pipeline.run` leaves it: runs.json (the real writer) + summary.json."""
    pipeline.StageRecord.start(workdir / stage, cfg, ["--test"]).finish("done")
    (workdir / stage / "summary.json").write_text(json.dumps({"stage": stage, "accuracy": 0.5}))


def run_launch(capsys, *args):
    old = signal.getsignal(signal.SIGTERM)
    try:
        rc = launch.main(list(args))
    finally:
        signal.signal(signal.SIGTERM, old)
    out = capsys.readouterr()
    return rc, out.out, out.err


SFT_ONLY = ["--config.stages=('sft',)", "--config.compile_cache=False"]


def test_a_changed_config_on_a_finished_stage_is_refused_naming_the_key(tmp_path, capsys):
    cfg = config_lib.load(DEMO, ["stages=('sft',)", "compile_cache=False"])[0]
    finish_stage(tmp_path, cfg)
    config_lib.dump(cfg, tmp_path / "config.json")
    before = (tmp_path / "config.json").read_text()
    rc, _, err = run_launch(
        capsys,
        "--config",
        DEMO,
        "--workdir",
        str(tmp_path),
        *SFT_ONLY,
        "--config.sft.optim.lr=0.01",
        "--config.ckpt.every=7",
    )
    assert rc == 2
    last = err.strip().splitlines()[-1]
    assert "stage 'sft'" in last and "sft.optim.lr: 0.002 -> 0.01" in last
    assert "ckpt.every" not in last  # checkpoint cadence is not an input of the result
    assert (tmp_path / "config.json").read_text() == before  # not overwritten by the refusal
    # same inputs, other cadence: the finished stage is reused, config.json now says so
    rc, out, _ = run_launch(
        capsys, "--config", DEMO, "--workdir", str(tmp_path), *SFT_ONLY, "--config.ckpt.every=7"
    )
    assert rc == 0 and json.loads(out.strip().splitlines()[-1])["sft"]["accuracy"] == 0.5
    assert json.loads((tmp_path / "config.json").read_text())["ckpt"]["every"] == 7
    assert [p.name for p in tmp_path.glob("config.*.json")] != []  # the old one is kept
    assert not (tmp_path / ".lock").exists()


def test_rerun_from_sets_the_stage_and_later_ones_aside(tmp_path):
    old = config_lib.load(DEMO)[0]
    for stage in ("sft", "distill", "mtp"):
        finish_stage(tmp_path, old, stage)
    new = config_lib.load(DEMO, ["distill.num_samples=512"])[0]
    with pytest.raises(pipeline.StageConfigChanged, match="distill.num_samples: 1024 -> 512"):
        pipeline.check_finished_stages(new, tmp_path)
    pipeline.check_finished_stages(new, tmp_path, rerun_from="distill")  # allowed now
    moved = pipeline.set_aside_from(tmp_path, "distill")
    assert sorted(p.name.split(".")[0] for p in moved) == ["distill", "mtp"]
    assert (tmp_path / "sft/summary.json").exists() and not (tmp_path / "distill").exists()
    assert all((p / "summary.json").exists() for p in moved)  # nothing deleted
    runs = json.loads((tmp_path / "sft/runs.json").read_text())["runs"]
    assert runs[-1]["status"] == "done" and runs[-1]["config"]["sft"]["optim"]["lr"] == 0.002
    assert {"argv", "git_commit", "versions", "start_time", "end_time"} <= set(runs[-1])


# ----------------------------------------------------------------------------- item 5: lock


def test_a_second_run_on_a_locked_workdir_fails_and_a_stale_lock_is_taken_over(tmp_path, capsys):
    cfg = config_lib.load(DEMO, ["stages=('sft',)"])[0]
    finish_stage(tmp_path, cfg)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pipeline.WorkdirLock(tmp_path):
            info = json.loads((tmp_path / ".lock").read_text())
            assert info["pid"] == os.getpid()
        (tmp_path / ".lock").write_text(json.dumps({**info, "pid": holder.pid}))
        rc, _, err = run_launch(capsys, "--config", DEMO, "--workdir", str(tmp_path), *SFT_ONLY)
        assert rc == 1 and f"in use by pid {holder.pid}" in err.strip().splitlines()[-1]
        assert not (tmp_path / "config.json").exists()  # a failed launch wrote nothing
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its lock is stale and the next run takes it over
    rc, out, _ = run_launch(capsys, "--config", DEMO, "--workdir", str(tmp_path), *SFT_ONLY)
    assert rc == 0 and not (tmp_path / ".lock").exists()


# ----------------------------------------------------------------------------- item 8: damage


def test_a_torn_last_metrics_line_is_repaired_on_resume(tmp_path):
    cfg = toy_cfg()
    with pytest.raises(Exception, match="stopped at step 5"):
        toy_fit(tmp_path, cfg, stop_at_step=5)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "loss": 0.12')  # killed mid-write
    toy_fit(tmp_path, cfg)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 9))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    lines[2] = lines[2][:10]  # damage inside the file is not a torn write: named, not guessed
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(bio.DamagedFileError, match=r"metrics.jsonl: line 3"):
        MetricsWriter(tmp_path / "metrics.jsonl").truncate_after(4)


def test_an_empty_summary_is_set_aside_and_the_stage_reruns(tmp_path, caplog):
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft/summary.json").write_text("")
    assert not pipeline.is_done(tmp_path / "sft")
    assert "sft/summary.json: empty file" in caplog.text
    assert (tmp_path / "sft/summary.json.damaged").exists()


def test_a_json_write_cut_off_midway_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    """`bebop.io.write_json_atomic` (the writer of summaries and experiments' finished results)
    writes a temporary file and renames it over the old one: a write that dies after half its
    bytes leaves the previous contents, readable, and no temporary file; the next write replaces
    them. (It patches `Path.write_text`, the writer's way of writing.)"""
    path = tmp_path / "results.json"
    bio.write_json_atomic(path, {"arm": "before"})
    real = type(path).write_text

    def dies_midway(self, text, *a, **kw):
        real(self, text[: len(text) // 2], *a, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(type(path), "write_text", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        bio.write_json_atomic(path, {"arm": "after", "pad": "x" * 100})
    monkeypatch.undo()
    assert bio.read_json(path) == {"arm": "before"}
    assert [f.name for f in tmp_path.iterdir()] == ["results.json"]  # no temporary file left
    bio.write_json_atomic(path, {"arm": "after"})
    assert bio.read_json(path) == {"arm": "after"}


def test_damaged_arrays_name_the_file_and_problem(tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(600, dtype=np.int32).reshape(20, 30))
    np.testing.assert_array_equal(bio.load_array(tokens, ndim=2, kind="i")[3], np.arange(90, 120))
    tokens.write_bytes(tokens.read_bytes()[:-100])
    with pytest.raises(bio.DamagedFileError, match=r"tokens.npy: truncated.*\(20, 30\)"):
        bio.load_array(tokens)
    vocab = tmp_path / "draft_vocab.npy"
    np.save(vocab, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(bio.DamagedFileError, match="draft_vocab.npy: holds Python objects"):
        bio.load_array(vocab)
    vocab.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(bio.DamagedFileError, match="draft_vocab.npy: not a readable .npy"):
        bio.load_array(vocab)


def test_bad_hf_config_json_names_the_file(tmp_path):
    mesh = sharding.make_mesh(config_lib.MeshConfig(data=1), jax.devices()[:1])
    (tmp_path / "config.json").write_text('{"model_type": "qwen3",')
    with pytest.raises(hf.CheckpointError, match=r"config.json: invalid JSON at line 1"):
        hf.load(tmp_path, mesh)
    good = hf.config_to_hf(config_lib.ModelConfig(), "qwen3")
    del good["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(good))
    with pytest.raises(hf.CheckpointError, match=r"config.json: missing .*num_attention_heads"):
        hf.load(tmp_path, mesh)


def test_gsm8k_jsonl_damage_is_named_with_the_right_line(tmp_path):
    f = tmp_path / "g.jsonl"
    rows = ['{"question": "a\u2028b?", "answer": "#### 1"}', '{"question": "c", "answer": "2"}']
    f.write_bytes(("\ufeff" + "\n".join(rows) + "\n").encode())  # a BOM and a U+2028 inside
    assert [p.answer for p in tasks.load_gsm8k_jsonl(f)] == [1.0, 2.0]
    f.write_text("\n".join([*rows, '{"question": "d", "answer": ']) + "\n")
    with pytest.raises(bio.DamagedFileError, match=r"g.jsonl:3: invalid JSON"):
        tasks.load_gsm8k_jsonl(f)
    f.write_bytes(b'{"question": "x", "answer": "1"}\n{"question": "\xff", "answer": "2"}\n')
    with pytest.raises(bio.DamagedFileError, match=r"g.jsonl:2: not UTF-8"):
        tasks.load_gsm8k_jsonl(f)


def test_a_launch_error_is_the_last_line_and_names_the_file(tmp_path):
    cfg = config_lib.load(DEMO, ["stages=('sft',)"])[0]
    finish_stage(tmp_path, cfg)
    (tmp_path / "sft/runs.json").write_text('{"runs": [')
    proc = subprocess.run(
        [sys.executable, "launch.py", "--config", DEMO, "--workdir", str(tmp_path), *SFT_ONLY],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: DamagedFileError:") and "sft/runs.json: invalid JSON" in last


# ----------------------------------------------------------------------------- tools


def _tb_events(directory):
    """(tag, kind) of every summary value in the tensorboard event files under `directory`."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in directory.rglob("events.out.tfevents.*"):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            ev = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 12 + n + 4  # length, its crc, payload, its crc
            out += [(v.tag, v.WhichOneof("value")) for v in ev.summary.value]
    return out


def test_tensorboard_gets_scalars_and_the_config(tmp_path):
    toy_fit(tmp_path, toy_cfg("tensorboard=True"), steps=3)
    events = _tb_events(tmp_path / "tb")
    assert events.count(("loss", "simple_value")) == 3
    assert any(tag.startswith("config") for tag, _ in events)  # the config as text
    assert any("hparams" in str(p) for p in (tmp_path / "tb").rglob("events.*"))


def test_profile_steps_writes_a_trace_in_the_stage_dir(tmp_path):
    toy_fit(tmp_path, toy_cfg("profile_steps=2"), steps=4)
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))


def test_sigterm_saves_a_checkpoint_and_resume_matches(tmp_path):
    cfg = toy_cfg("ckpt.every=100")
    good = toy_fit(tmp_path / "ref", cfg)
    old = signal.getsignal(signal.SIGTERM)
    install_preemption_handler()
    try:
        kill_at_3 = Stream(on_batch=lambda i: i == 3 and os.kill(os.getpid(), signal.SIGTERM))
        with pytest.raises(Preempted, match="SIGTERM at step 3; checkpoint step 3"):
            toy_fit(tmp_path / "run", cfg, kill_at_3)
    finally:
        signal.signal(signal.SIGTERM, old)
        PREEMPTED.clear()
    assert ckpt_steps(tmp_path / "run") == [3]
    again = toy_fit(tmp_path / "run", cfg)
    assert again.steps_run == 5
    chex.assert_trees_all_equal(again.state.params, good.state.params)


def test_make_mesh_uses_jax_make_mesh_device_order(devices):
    mesh = sharding.make_mesh(config_lib.MeshConfig(data=2, fsdp=2, tensor=2), devices)
    ref = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), devices=devices)
    assert mesh.devices.tolist() == ref.devices.tolist()
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}  # GSPMD, not explicit sharding


def test_list_sweep_prints_one_command_per_entry_and_sweep_all_runs_each(tmp_path, capsys):
    rc, out, _ = run_launch(capsys, "--config", DEMO, "--list_sweep", "--workdir", str(tmp_path))
    lines = out.strip().splitlines()
    assert rc == 0 and len(lines) == len(config_lib.sweep_entries(DEMO)) == 3
    assert all(f"--sweep_index {i}" in ln and f"sweep{i}" in ln for i, ln in enumerate(lines))
    for i in range(3):  # each entry's stage already finished with that entry's config
        finish_stage(tmp_path / f"sweep{i}", config_lib.load(DEMO, ["stages=('sft',)"], i)[0])
    rc, out, _ = run_launch(
        capsys, "--config", DEMO, "--workdir", str(tmp_path), "--sweep_index", "all", *SFT_ONLY
    )
    summaries = [json.loads(ln) for ln in out.strip().splitlines() if ln.startswith("{")]
    assert rc == 0 and [s["workdir"] for s in summaries] == [
        str(tmp_path / f"sweep{i}") for i in range(3)
    ]


def test_fast_compile_adds_the_xla_flags_once_and_keeps_the_users(monkeypatch):
    """`fast_compile` (SmolLM2's runlocal) appends the flags that XLA reads when JAX starts; a
    flag the user set keeps its value, and a second call adds nothing."""
    from bebop.config import FAST_COMPILE_XLA_FLAGS

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 "
                       "--xla_backend_optimization_level=2")  # fmt: skip
    launch.use_fast_compile()
    launch.use_fast_compile()
    flags = os.environ["XLA_FLAGS"].split()
    assert flags == [
        "--xla_force_host_platform_device_count=2",
        "--xla_backend_optimization_level=2",
        "--xla_llvm_disable_expensive_passes=true",
    ]
    assert set(FAST_COMPILE_XLA_FLAGS) - set(flags) == {"--xla_backend_optimization_level=0"}
    assert config_lib.load("configs/rl_smollm2.py:runlocal")[0].fast_compile
    assert not config_lib.load("configs/rl_smollm2.py")[0].fast_compile
