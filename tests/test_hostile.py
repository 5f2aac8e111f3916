"""Careless or hostile input: each case ends in a defined outcome or one clear error that names
the config key, file, record or tensor (never a silently wrong run, a crash dump or a hang)."""

import dataclasses
import json
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bebop import config as config_lib
from bebop import model, policies, prompts, rewards, rollout, sampling, sharding, tasks
from bebop import mtp as mtp_lib
from bebop.checkpoints import hf
from bebop.checkpoints.tokenizer_files import write_tokenizer
from bebop.ckpt import Checkpointer, CheckpointRestoreError, restore_params
from bebop.config import ConfigError, MeshConfig, ModelConfig, RunConfig, TaskConfig
from bebop.finite import NonFiniteWeightsError
from bebop.io import DamagedFileError
from bebop.rl import grpo
from bebop.stages import sft
from bebop.tokenizer import CharTokenizer

from . import hostile_fns
from .conftest import REPO

DEMO = str(REPO / "configs/demo.py")


def _mesh():
    return sharding.make_mesh(MeshConfig(data=1), jax.devices()[:1])


def _save_params(ckpt_dir, params):
    ckpt = Checkpointer(ckpt_dir, async_save=False)
    ckpt.save(1, {"params": params, "step": 1}, {})
    ckpt.close()


# ---------------------------------------------------------------------- 1: exported demo policy


def test_an_exported_demo_tokenizer_reads_back_as_the_character_tokenizer(tmp_path):
    """The demo's tokenizer as `bebop.export` writes it, loaded as `policy.source=hf`: task
    prompts are the raw characters the demo policy was trained on, not a chat template."""
    tok = CharTokenizer()
    write_tokenizer(tmp_path, "sft", tok)
    back = policies.hf_tokenizer(tmp_path)
    assert not back.is_chat
    for i in range(5):
        prob = tasks.problem_at(TaskConfig(), 0, i)
        want = tok.encode(prob.prompt, bos=True)
        assert tasks.arithmetic_prompt_ids(back, prob) == want
        assert back.decode(want) == prob.prompt
    assert back.eos_ids == tok.eos_ids and back.vocab_size == tok.vocab_size


# ---------------------------------------------------------------------- 2: NaN / inf weights


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_policy_with_non_finite_weights_is_refused_naming_the_tensor(tmp_path, tiny_cfg, bad):
    graphdef, params = model.init(tiny_cfg, 0)
    w_up = params["layers"]["mlp"]["w_up"]
    w_up[...] = w_up[...].at[0, 1, 2].set(bad)
    _save_params(tmp_path / "sft" / "ckpt", params)
    cfg = RunConfig(model=tiny_cfg)
    with pytest.raises(NonFiniteWeightsError, match=r"layers\.mlp\.w_up.*(NaN|inf)"):
        policies.load(cfg.policy, cfg.model, tmp_path, _mesh())


def test_an_mtp_with_non_finite_weights_is_refused_naming_the_tensor(tmp_path, tiny_cfg):
    _, params = mtp_lib.init(tiny_cfg, 1, 3)
    leaf = params["layers"]["w_fc"]
    leaf[...] = leaf[...].at[0, 0, 0].set(jnp.nan)
    _save_params(tmp_path / "mtp" / "ckpt", params)
    cfg = RunConfig(model=tiny_cfg)
    with pytest.raises(NonFiniteWeightsError, match=r"w_fc.*1 NaN"):
        policies.load_mtp(cfg.mtp, tmp_path / "mtp" / "ckpt", tiny_cfg, _mesh())


# ---------------------------------------------------------------------- 3: reward values, records


@pytest.mark.parametrize(
    "fn, shown",
    [
        (hostile_fns.nan_reward, "nan"),
        (hostile_fns.inf_reward, "inf"),
        (hostile_fns.string_reward, "'1.0'"),
        (hostile_fns.none_reward, "None"),
    ],
)
def test_a_reward_that_is_not_a_finite_number_fails_naming_the_function(fn, shown):
    with pytest.raises(rewards.RewardError, match=rf"{fn.__name__} returned {shown}.*finite"):
        rewards.score(fn, ["a", "b"], [None, None], timeout_s=60, retries=0)


@pytest.mark.parametrize(
    "record, complaint",
    [
        ({"question": None, "answer": "#### 4"}, "'question' must be a non-empty string"),
        ({"answer": "#### 4"}, "'question' must be a non-empty string, got missing"),
        ({"question": "2+2?", "answer": [1, 2]}, "'answer' must be a string or a number"),
        ({"question": "2+2?", "answer": None}, "'answer' must be a string or a number"),
        ({"question": "2+2?", "answer": True}, "'answer' must be a string or a number"),
    ],
)
def test_a_gsm8k_record_with_a_wrong_field_type_is_named(tmp_path, record, complaint):
    f = tmp_path / "g.jsonl"
    good = json.dumps({"question": "1+1?", "answer": "#### 2"})
    f.write_text(good + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DamagedFileError, match=rf"g\.jsonl:2: {complaint}"):
        tasks.load_gsm8k_jsonl(f)


# ---------------------------------------------------------------------- 4: config values


@pytest.mark.parametrize(
    "override, key",
    [
        ("rl.clip_high=1e309", "rl.clip_high"),
        ("rl.kl_coef=1e309", "rl.kl_coef"),
        ("rl.optim.b1=2.0", "rl.optim.b1"),
        ("sft.optim.b2=-1.0", "sft.optim.b2"),
        ("mtp.optim.b2=1.0", "mtp.optim.b2"),
        ("rl.clip_low=5.0", "rl.clip_low"),
        ("rollout.num_draft=100000", "rollout.num_draft"),
        ("rollout.draft_table=((8, 100000),)", "rollout.draft_table"),
        ("stages=('rl','sft')", "stages"),
        ("stages=('sft','sft')", "stages"),
    ],
)
def test_out_of_range_config_values_fail_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"'{key}'"):
        config_lib.load(DEMO, [override])


# ------------------------------------------------------------------ 5: coordinator never answers


def _dead_port() -> int:
    """A loopback port where nothing listens (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_waiting_for_a_coordinator_that_never_answers_ends_in_a_named_error():
    import launch

    t0 = time.monotonic()
    with pytest.raises(launch.CoordinatorUnreachable, match=r"'distributed\.coordinator_addr"):
        launch.wait_for_coordinator(f"127.0.0.1:{_dead_port()}", timeout_s=1.5)
    assert 1.2 < time.monotonic() - t0 < 10


@pytest.mark.slow
def test_a_launch_whose_coordinator_never_answers_fails_within_its_timeout(tmp_path):
    port = _dead_port()
    cmd = [
        sys.executable,
        "launch.py",
        "--config",
        DEMO + ":runlocal",
        "--workdir",
        str(tmp_path / "w"),
        "--config.distributed.num_processes=2",
        "--config.distributed.process_id=1",
        f"--config.distributed.coordinator_address=127.0.0.1:{port}",
        "--config.distributed.init_timeout_s=3",
    ]
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr[-2000:]
    assert time.monotonic() - t0 < 90
    last = res.stderr.strip().splitlines()[-1]
    assert f"no coordinator answered at 127.0.0.1:{port}" in last
    assert "distributed.init_timeout_s=3s" in last


# ---------------------------------------------------------------------- 6: prompts too long


class _CharChat:
    """A chat tokenizer of one id per character (what matters here is the length)."""

    is_chat = True

    def chat(self, messages):
        return [7] * sum(len(m["content"]) for m in messages)


def test_a_prompt_longer_than_the_supported_length_is_refused_naming_the_record(tmp_path):
    f = tmp_path / "g.jsonl"
    rows = [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"} for i in range(4)]
    rows.insert(2, {"question": "word " * 60_000, "answer": "#### 1"})
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = tasks.make_task(TaskConfig(name="gsm8k", path=str(f), eval_size=1))
    probs = [task.problem(0, i) for i in range(4)] + [task.eval_problem(0, 0)]
    long = [p for p in probs if len(p.question) > 1000]
    assert len(long) == 1
    with pytest.raises(
        tasks.PromptTooLongError, match=r"g\.jsonl:3: the prompt is 3000\d\d tokens"
    ):
        task.prompt_ids(_CharChat(), long[0])
    short = [p for p in probs if p is not long[0]][0]
    assert len(task.prompt_ids(_CharChat(), short)) < 100


def _jsonl_demo(tmp_path, long_prompt: str, *overrides):
    """The demo (runlocal) on a 5-record jsonl task whose first held-out record (the permutation
    of `tasks._file_task`) is `long_prompt`; returns (cfg, its "file:line")."""
    held = int(np.random.default_rng(0).permutation(5)[0])
    rows = [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(5)]
    rows[held] = {"prompt": long_prompt, "answer": 1}
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["task.name='jsonl'", f"task.path='{f}'", "task.eval_size=2", *overrides]
    return config_lib.load(DEMO + ":runlocal", args)[0], f"t.jsonl:{held + 1}"


def test_a_prompt_past_the_policys_positions_is_refused_naming_the_record_before_any_cache(
    tmp_path, monkeypatch
):
    """A record whose prompt (124 tokens with BOS) with the run's 32 new tokens and the 2 drafted
    past them needs 158 positions of a policy with 128: the greedy evaluation (RL's, SFT's
    sampler) and the prompt sets (distillation, MTP evaluation) stop with a config error naming
    the record, its length, the new tokens, the limit and the keys, before a cache exists."""
    cfg, where = _jsonl_demo(tmp_path, "1+" * 61 + "1", "model.max_positions=128")
    monkeypatch.setattr(model, "new_cache", lambda *a: pytest.fail("a KV cache was allocated"))
    limits = prompts.PromptLimits.of(cfg, cfg.model)
    task = tasks.make_task(cfg.task, limits)
    pol = model.abstract(cfg.model)  # never run: the check comes first
    want = (
        rf"{where}: the prompt is 124 tokens; with 32 new tokens \(config key "
        r"'rollout\.max_new_tokens'\) \+ 2 drafted past them \(speculative verification\) it "
        r"needs 158 positions, more than the 128 the policy supports \(config key "
        r"'model\.max_positions'\)\. Shorten or drop the record, or lower config key "
        r"'rollout\.max_new_tokens'"
    )
    with pytest.raises(prompts.PromptDoesNotFitError, match=want) as e:
        rollout.greedy_accuracy(pol, CharTokenizer(), task, cfg.seed, 2, 32)
    assert isinstance(e.value, ConfigError)  # launch.py: "config error: ...", exit 2
    with pytest.raises(prompts.PromptDoesNotFitError, match=want):
        prompts.prompt_ids(cfg.task, cfg.seed, CharTokenizer(), 2, "eval", "task", limits)
    # the same record fits a policy with 8 more positions; the other records fit anyway
    roomy = dataclasses.replace(limits, max_positions=158)
    assert (
        len(prompts.prompt_ids(cfg.task, cfg.seed, CharTokenizer(), 2, "eval", "task", roomy)[0])
        == 124
    )
    short = tasks.make_task(cfg.task, limits).prompt_ids
    assert len(short(CharTokenizer(), tasks.make_task(cfg.task).problem(0, 0))) <= 5
    # SFT's greedy evaluation: the arithmetic prompts against `sft.seq_len` new tokens
    tiny, _ = config_lib.load(DEMO + ":runlocal", ["model.max_positions=16"])
    with pytest.raises(prompts.PromptDoesNotFitError, match=r"'sft\.seq_len'.*'model\."):
        sft.evaluate(*model.abstract(tiny.model), tiny, CharTokenizer(), 4)


def test_a_gsm8k_record_past_a_checkpoints_positions_or_the_kv_cache_bound_is_named(tmp_path):
    """A Qwen3-4B run (its config.json: 40,960 positions): a 14,999-token question fits the
    16,384-token prompt bound, but with 32,768 new tokens not the positions; with 1,024 new tokens
    a distillation batch of 256 rows of it would allocate ~150 GiB of KV cache on one device."""
    f = tmp_path / "g.jsonl"
    rows = [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"} for i in range(4)]
    rows.insert(1, {"question": "w" * 14_950, "answer": "#### 1"})
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    arch = hf.known_architecture("qwen3-4b", dtype="bfloat16")
    gpu = str(REPO / "configs/qwen3_gpu.py")
    task_keys = ["task.name='gsm8k'", f"task.path='{f}'", "task.eval_size=1", "policy.path='/q'"]
    for new, want in [
        (
            32768,
            r"g\.jsonl:2: the prompt is 14999 tokens; with 32768 new tokens .* it needs 47770 "
            r"positions, more than the 40960 the policy supports \(max_position_embeddings of "
            r"the policy's config\.json\)",
        ),
        (
            1024,
            r"g\.jsonl:2: the prompt is 14999 tokens; a batch of 256 rows \(distill\.batch_size\) "
            r"with it allocates KV caches of 17408 slots per row \(16384 prompt \+ 1024 new\), "
            r"612\.0 GiB per device \(1 device\(s\) share the rows\), more than the 64\.0 GiB of "
            r"the KV cache bound\. .*'rollout\.max_new_tokens' or 'distill\.batch_size'",
        ),
    ]:
        cfg = config_lib.load(gpu, [*task_keys, f"rollout.max_new_tokens={new}"])[0]
        task = tasks.make_task(cfg.task, prompts.PromptLimits.of(cfg, arch))
        long = [task.problem(0, i) for i in range(4) if len(task.problem(0, i).question) > 99]
        with pytest.raises(prompts.PromptDoesNotFitError, match=want):
            task.prompt_ids(_CharChat(), long[0])


# ---------------------------------------------------------------------- 7: mtp.init_from elsewhere


def test_mtp_init_from_an_sft_checkpoint_names_what_the_directory_holds(tmp_path, tiny_cfg):
    _, params = model.init(tiny_cfg, 0)
    _save_params(tmp_path / "sft" / "ckpt", params)
    cfg = RunConfig(
        model=tiny_cfg,
        mtp=dataclasses.replace(RunConfig().mtp, init_from=str(tmp_path / "sft" / "ckpt")),
    )
    policy = policies.load(cfg.policy, cfg.model, tmp_path, _mesh())
    with pytest.raises(
        ConfigError,
        match=r"'mtp\.init_from': .* holds a policy checkpoint.*expected an MTP checkpoint",
    ):
        policies.init_mtp(cfg.mtp, cfg.policy, cfg.seed, policy, _mesh())
    with pytest.raises(ConfigError, match=r"holds a policy checkpoint.*expected an MTP checkpoint"):
        policies.load_mtp(cfg.mtp, tmp_path / "sft" / "ckpt", tiny_cfg, _mesh())


# ---------------------------------------------------------------------- 8: export, edited config


def test_export_of_a_workdir_whose_config_was_edited_ends_in_one_clear_line(tmp_path, tiny_cfg):
    cfg = RunConfig(model=tiny_cfg)
    _, params = model.init(tiny_cfg, 0)
    _save_params(tmp_path / "sft" / "ckpt", params)
    edited = config_lib.to_dict(cfg)
    edited["model"]["ffw_dim"] = 2 * tiny_cfg.ffw_dim  # valid, but not what was trained
    (tmp_path / "config.json").write_text(json.dumps(edited))
    cmd = [
        sys.executable,
        "-m",
        "bebop.export",
        "--workdir",
        str(tmp_path),
        "--out",
        str(tmp_path / "out"),
        "--stage",
        "sft",
    ]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if not line.startswith("WARNING:")]
    assert len(lines) == 1, res.stderr[-3000:]  # log warnings, then the error alone
    assert (
        lines[0].startswith("bebop.export: error: ") and "config.json does not describe" in lines[0]
    )
    assert "Traceback" not in res.stderr and "Event loop is closed" not in res.stderr


# ---------------------------------------------------------------------- 9: every checkpoint damaged


def test_when_every_checkpoint_is_damaged_the_error_says_so_in_one_line(tmp_path, tiny_cfg):
    _, params = model.init(tiny_cfg, 0)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2, async_save=False)
    for step in (1, 2):
        ckpt.save(step, {"params": params, "step": step}, {})
    ckpt.close()
    for f in (tmp_path / "ckpt").rglob("ocdbt.process_0/d/*"):
        f.write_bytes(b"damaged" * 8)
    with pytest.raises(CheckpointRestoreError) as e:
        restore_params(tmp_path / "ckpt", params, _mesh())
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 600, msg
    assert "every checkpoint under" in msg and "is damaged (steps 2, 1" in msg
    assert "config changed" not in msg


# ---------------------------------------------------------------------- 10: checked at config time


def test_a_missing_gsm8k_file_and_a_chat_task_for_the_demo_policy_fail_at_config_time(tmp_path):
    with pytest.raises(ConfigError, match=r"'task\.path': no such file"):
        config_lib.load(
            DEMO,
            ["task.name='gsm8k'", f"task.path='{tmp_path / 'none.jsonl'}'", "policy.source='gguf'"],
        )
    for name in ("wordmath", "gsm8k"):
        f = tmp_path / "g.jsonl"
        f.write_text(json.dumps({"question": "q", "answer": 1}) + "\n")
        with pytest.raises(ConfigError, match=r"'task\.name': .*demo policy"):
            config_lib.load(DEMO, [f"task.name='{name}'", f"task.path='{f}'"])


# ---------------------------------------------------------------------- 11: two SIGTERMs


_CHILD = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda *a: got.append(1))
try:  # the first child to start saves quickly, the other slowly
    os.close(os.open(os.path.join(sys.argv[1], "quick"), os.O_CREAT | os.O_EXCL))
    save_s = 0.5
except FileExistsError:
    save_s = 3.0
open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()  # the handler is in place
while not got:
    time.sleep(0.01)
time.sleep(save_s)  # saving a checkpoint
sys.exit(143 if len(got) == 1 else 1)  # 1: signalled again while saving
"""


def test_a_second_sigterm_to_the_local_cluster_does_not_kill_its_processes(monkeypatch, tmp_path):
    from bebop import local_cluster

    child = [sys.executable, "-c", _CHILD, str(tmp_path)]
    monkeypatch.setattr(local_cluster, "launch_command", lambda *a: child)
    cluster = local_cluster.Cluster(["--config", "x"], n=2, devices=1, port=1)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.iterdir())) < 3:  # both children have installed their handlers
        assert time.monotonic() < deadline, "the children did not start"
        time.sleep(0.05)
    cluster.on_signal(signal.SIGTERM)
    cluster.on_signal(signal.SIGTERM)  # `timeout` and the group signal: the same request twice
    rc, failed = cluster.wait(shutdown_timeout_s=30)
    assert [p.returncode for p in cluster.procs] == [143, 143]
    assert (rc, failed) == (143, None)  # stopping as asked is no failure: no peer is signalled


# ---------------------------------------------------------------------- 12: noise


_EXIT = """
import sys
sys.path.insert(0, {repo!r})
import launch
from bebop import rewards
from tests import hostile_fns

if __name__ == "__main__":
    print(rewards.score(hostile_fns.chatty_reward, ["a", "b"], [0, 1], timeout_s=60, retries=0))
    launch.exit_now(0)
"""


def test_reward_prints_are_bounded_and_no_semaphore_is_reported_leaked(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_EXIT.format(repo=str(REPO)))
    res = subprocess.run(
        [sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "[1. 1.]" in res.stdout
    out = res.stdout + res.stderr
    assert len(out) < 10_000, len(out)  # the reward printed 2 MB
    assert "leaked semaphore" not in res.stderr


# ---------------------------------------------------------------------- 13: bf16 truncated support


@pytest.mark.slow
@pytest.mark.parametrize(
    "scfg",
    [
        sampling.SamplingConfig(top_k=20, max_new_tokens=64, eos_ids=(-1,)),
        sampling.SamplingConfig(top_p=0.9, max_new_tokens=64, eos_ids=(-1,)),
    ],
    ids=["top_k20", "top_p0.9"],
)
def test_a_bf16_learner_keeps_every_drawn_token_in_its_truncated_support(scfg):
    """A random dim-128 policy in bf16, 32 rows x 64 sampled tokens (2,048) under top-k 20 or
    top-p 0.9: the learner's log-prob of every drawn token is finite (a token the learner's
    recomputed support dropped had -inf: ratio 0, no gradient), and close to the sampler's (median
    gap < 0.05, max < 1: bf16 rounding of a different computation, forward vs cached decode)."""
    cfg = ModelConfig(
        vocab_size=256,
        dim=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        ffw_dim=256,
        dtype="bfloat16",
        init_std=0.3,
    )
    gd, params = model.init(cfg, 0)
    prompts = [[1 + (i % 7), 2 + (i % 5), 3 + i] for i in range(32)]
    toks, lens = sampling.pad_prompts(prompts)
    out = jax.device_get(sampling.sample_jit(gd, params, toks, lens, jax.random.key(0), scfg))
    p = 3  # every prompt's length: the responses follow at 3 ..
    tokens = np.concatenate([toks[:, :p], out.tokens], axis=1).astype(np.int32)
    assert (lens == p).all() and (out.lengths == scfg.max_new_tokens).all()
    logp, _ = jax.jit(grpo.token_logprobs, static_argnums=(0, 3))(gd, params, tokens, scfg)
    # the learner's chunked path (`rl.logit_chunk`) keeps the drawn tokens the same way
    chunked = jax.jit(grpo.chunked_token_stats, static_argnums=(0, 3, 4))
    logp_chunked = chunked(gd, params, tokens, scfg, 16)[0]
    for got in (logp, logp_chunked):
        learner = np.asarray(got)[:, p:]
        bad = (~np.isfinite(learner)).sum()
        assert np.isfinite(learner).all(), f"{bad} of 2048 tokens at -inf"
        gap = np.abs(learner - out.logprobs)
        assert np.median(gap) < 0.05 and gap.max() < 1.0, (np.median(gap), gap.max())
