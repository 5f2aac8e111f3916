"""RL: GRPO math (truncated-sampler ratios, the KL term), reward parsing and the reward sandbox,
the async loop's staleness bound, step records and failure handling, MTP strategies never
touching the policy, GrowMTP's target and growing a head, kill-and-resume."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bebop import config as config_lib
from bebop import model, mtp_train, policies, rollout, sampling, sharding, speculative, tasks
from bebop import mtp as mtp_lib
from bebop.config import MeshConfig, OptimConfig, TaskConfig
from bebop.metrics import read_jsonl
from bebop.mtp_losses import mtp_loss
from bebop.rl import grpo, learner, loop, records, rewards
from bebop.rl import stage as rl_stage
from bebop.speculative import ACCEPTED, REJECTED
from bebop.tokenizer import CharTokenizer
from bebop.train import NonFiniteError, TrainState, make_optimizer, make_train_step

from . import reward_fns
from .conftest import REPO
from .helpers import perturb, random_policy

# ----------------------------------------------------------------------------- GRPO


def test_advantages_sum_to_zero_per_group():
    r = np.random.default_rng(0).random((5, 8)).astype(np.float32)
    for std_norm in (True, False):
        a = grpo.advantages(r, std_norm)
        np.testing.assert_allclose(a.sum(1), 0.0, atol=1e-5)
    np.testing.assert_allclose(grpo.advantages(r, True).std(1), 1.0, atol=1e-3)


T1 = sampling.SamplingConfig(temperature=1.0)


def _batch(tiny_cfg, pol, shift=0.0):
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, tiny_cfg.vocab_size, (4, 10)), jnp.int32)
    logp, _ = grpo.token_logprobs(*pol, tokens, T1)
    mask = jnp.zeros((4, 10)).at[:, 4:].set(1.0)
    adv = jnp.asarray([1.0, -1.0, 0.5, -0.5])
    return loop.LearnerBatch(tokens, mask, logp + shift, adv)


def test_on_policy_ratio_is_exactly_one(tiny_cfg):
    pol = random_policy(tiny_cfg, 0)
    _, m = grpo.policy_loss(*pol, _batch(tiny_cfg, pol), 0.2, 0.28, 0.0, "token", T1)
    assert float(m["ratio_mean"]) == 1.0 and float(m["ratio_max"]) == 1.0
    assert float(m["clip_frac"]) == 0.0


def test_clipped_objective_has_no_gradient_outside_the_clip_range(tiny_cfg):
    pol = random_policy(tiny_cfg, 0)
    gd, params = pol

    def grad_norm(batch):
        g = jax.grad(lambda p: grpo.policy_loss(gd, p, batch, 0.2, 0.28, 0.0, "token", T1)[0])(
            params
        )
        return float(sum(jnp.abs(x).sum() for x in jax.tree.leaves(g)))

    # ratio = e^{+1} ≈ 2.7 > 1.28 with A > 0 (and e^{-1} < 0.8 with A < 0): clipped, no gradient
    hi = _batch(tiny_cfg, pol, shift=-1.0)
    hi = hi.replace(adv=jnp.abs(hi.adv))
    lo = _batch(tiny_cfg, pol, shift=+1.0)
    lo = lo.replace(adv=-jnp.abs(lo.adv))
    assert grad_norm(hi) == 0.0 and grad_norm(lo) == 0.0
    assert grad_norm(_batch(tiny_cfg, pol)) > 0.0  # inside the range it does move


def _sampled_batch(tiny_cfg, pol, scfg, adv):
    """Rollouts of the real sampler laid out as the RL stage does (behaviour log-probs aligned)."""
    prompts = [[1, 5, 6], [1, 3], [1, 4, 4, 9], [1, 8]]
    toks, lens = sampling.pad_prompts(prompts)
    out = jax.device_get(sampling.sample_jit(*pol, toks, lens, jax.random.key(0), scfg))
    b, p = toks.shape
    tokens = np.zeros((b, p + scfg.max_new_tokens), np.int32)
    mask, behaviour = np.zeros(tokens.shape, np.float32), np.zeros(tokens.shape, np.float32)
    tokens[:, :p] = toks
    for r in range(b):
        s, n = lens[r], out.lengths[r]
        tokens[r, s : s + n] = out.tokens[r, :n]
        mask[r, s : s + n] = 1.0
        behaviour[r, s : s + n] = out.logprobs[r, :n]
    return loop.LearnerBatch(tokens, mask, behaviour, np.asarray(adv))


TOP_P = sampling.SamplingConfig(top_p=0.5, max_new_tokens=8, eos_ids=(-1,))


@pytest.mark.parametrize(
    "scfg",
    [TOP_P, sampling.SamplingConfig(temperature=0.7, top_k=3, max_new_tokens=8, eos_ids=(-1,))],
    ids=["top_p0.5", "t0.7_top_k3"],
)
def test_truncated_sampler_on_policy_ratio_is_one_and_negative_advantages_get_gradient(
    tiny_cfg, scfg
):
    """Behaviour log-probs from the real sampler with top-p 0.5 (or top-k 3 at T = 0.7): the
    learner's on-policy ratio is 1 (1e-4) at every token, and with every advantage −1 the policy
    gets a gradient. (The untruncated softmax gave ratio = nucleus mass < 1 and, once that is
    below 1 − clip_low, exactly zero gradient.)"""
    gd, params = random_policy(tiny_cfg, 0)
    batch = _sampled_batch(tiny_cfg, (gd, params), scfg, [-1.0] * 4)

    def loss(p):
        return grpo.policy_loss(gd, p, batch, 0.2, 0.28, 0.0, "token", scfg)

    (_, m), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    assert abs(float(m["ratio_max"]) - 1) < 1e-4 and abs(float(m["ratio_min"]) - 1) < 1e-4
    norms = [float(jnp.abs(x).max()) for x in jax.tree.leaves(g)]
    assert all(np.isfinite(norms)) and max(norms) > 1e-4
    if scfg is TOP_P:  # the old learner's untruncated log-probs: ratio = the nucleus mass
        full = grpo.untruncated(scfg)
        _, m_full = jax.jit(
            lambda p: grpo.policy_loss(gd, p, batch, 0.2, 0.28, 0.0, "token", full)
        )(params)
        assert float(m_full["ratio_min"]) < 0.99


def test_kl_term_is_zero_at_the_reference_and_trains_towards_it(tiny_cfg):
    """k3 KL to the reference through the real optimizer and train step, advantages 0: exactly
    0 when the policy is the reference; with the reference elsewhere, 5 steps cut it by more
    than half."""
    gd, params = random_policy(tiny_cfg, 0)
    batch = _sampled_batch(tiny_cfg, (gd, params), TOP_P, [0.0] * 4)
    ref = jax.jit(lambda p: perturb(p, 1, 0.1))(params)
    same = jax.tree.map(jnp.copy, params)  # the state's own buffers are donated

    def loss(p, b, _, ref_params):
        return grpo.policy_loss(gd, p, b, 0.2, 0.28, 1.0, "token", TOP_P, ref_params)

    opt = make_optimizer(OptimConfig(lr=3e-2, warmup_steps=0, schedule="constant"), 5)
    step = make_train_step(loss, opt)
    state, m = step(TrainState.create(params, opt, 0), batch, same)
    assert float(m["kl"]) == 0.0 and float(m["loss"]) == 0.0
    kls = []
    for _ in range(5):
        state, m = step(state, batch, ref)
        kls.append(float(m["kl"]))
    assert kls[0] > 1e-3 and kls[-1] < 0.5 * kls[0], kls


# ----------------------------------------------------------------------------- rewards

ADVERSARIAL = [
    "",
    ">",
    ">>>",
    ">" + "9" * 5000,
    "7+8+0=15>٣٥",
    ">{{{}}}",
    "import os; os.system('x')>12",
    "__import__('os')",
    ">1e309",
    ">-5",
    "\x00>12\x00",
    "<script>>12",
    ">12 13",
    "((((((((((((",
]


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_reward_parsing_survives_adversarial_completions(text):
    for fn in (lambda t: tasks.reward(t, 12), tasks.extract_number, tasks.evaluate_expression):
        out = fn(text)
        assert out is None or isinstance(out, (int, float))
    cd = tasks.CountdownProblem("3,4>12?", (3, 4), 12)
    assert tasks.countdown_reward(text, cd) in (0.0, 1.0)


def test_rewards_are_exact_and_never_execute(tmp_path):
    assert tasks.reward("1+2+0=3>3", 3) == 1.0 and tasks.reward("1+2+0=3>4", 3) == 0.0
    cd = tasks.CountdownProblem("3,4,2>14?", (3, 4, 2), 14)
    assert tasks.countdown_reward(">3*4+2", cd) == 1.0
    assert tasks.countdown_reward(">3*4+2+0", cd) == 0.0  # 0 is not one of the numbers
    assert tasks.countdown_reward(">4*4-2", cd) == 0.0  # 4 used twice
    marker = tmp_path / "pwned"
    text = f">__import__('pathlib').Path('{marker}').touch()"
    assert tasks.evaluate_expression(text[1:]) is None and not marker.exists()
    assert tasks.extract_number("The answer is 1,234.5 apples") == 1234.5
    assert tasks.extract_number("\\boxed{{7}} then #### 42") == 42.0


def test_gsm8k_loader(tmp_path):
    f = tmp_path / "g.jsonl"
    f.write_text('{"question": "2+2?", "answer": "so #### 4"}\n{"question": "q", "answer": "7"}\n')
    probs = tasks.load_gsm8k_jsonl(f)
    assert [p.answer for p in probs] == [4.0, 7.0]
    assert tasks.gsm8k_reward("... #### 4", probs[0]) == 1.0
    f.write_text('{"question": "no answer"}\n')
    with pytest.raises(ValueError, match="g.jsonl:1"):
        tasks.load_gsm8k_jsonl(f)


def test_gsm8k_holds_out_an_eval_split_and_shuffles_each_epoch(tmp_path):
    """50 problems, `task.eval_size=10`: evaluation draws only the 10 held-out problems (the same
    in every run), training streams never do; each training epoch visits the other 40 exactly
    once, in an order that changes with the epoch and the stream's seed."""
    f = tmp_path / "g.jsonl"
    f.write_text("".join(f'{{"question": "q{i}", "answer": "{i}"}}\n' for i in range(50)))
    task = tasks.make_task(TaskConfig(name="gsm8k", path=str(f), eval_size=10))
    held = {task.eval_problem(7, i).answer for i in range(30)}
    assert len(held) == 10
    again = tasks.make_task(TaskConfig(name="gsm8k", path=str(f), eval_size=10))
    assert {again.eval_problem(99, i).answer for i in range(10)} == held
    epochs = [[task.problem(3, e * 40 + j).answer for j in range(40)] for e in range(3)]
    for order in epochs:
        assert len(set(order)) == 40 and not set(order) & held
    assert epochs[0] != epochs[1] != epochs[2]
    assert [task.problem(4, j).answer for j in range(40)] != epochs[0]
    with pytest.raises(ValueError, match="task.eval_size=50"):
        tasks.make_task(TaskConfig(name="gsm8k", path=str(f), eval_size=50))


def test_failing_reward_function_fails_loudly():
    with pytest.raises(rewards.RewardError, match="KeyError"):
        rewards.score(reward_fns.broken, ["a"], [None], timeout_s=5, retries=2)
    with pytest.raises(rewards.RewardError, match="rl.reward_timeout_s"):
        rewards.score(reward_fns.slow, ["a"], [None], timeout_s=0.2, retries=0)

    def local(text, problem):  # cannot be sent to a worker process
        return 1.0

    with pytest.raises(rewards.RewardError, match="module-level function"):
        rewards.score(local, ["a"], [None], timeout_s=5, retries=0)
    np.testing.assert_array_equal(  # the pool still works after all that
        rewards.score(
            tasks.arithmetic_reward, [">3", ">4"], [tasks.Problem("1+2=", 3, "")] * 2, 5, 0
        ),
        [1.0, 0.0],
    )


HANG = """
import sys, time
from bebop.rl import rewards
from tests import reward_fns
t0 = time.monotonic()
r = rewards.score(reward_fns.hangs_on_b, ["a", "b", "c"], [None] * 3, {t}, 1, "zero")
print("zero", r.tolist(), time.monotonic() - t0, flush=True)
t0 = time.monotonic()
try:
    rewards.score(reward_fns.hangs_on_b, ["a", "b", "c"], [None] * 3, {t}, 0, "error")
finally:
    print("error after", time.monotonic() - t0, flush=True)
"""


def test_a_hanging_reward_scores_zero_or_fails_and_the_process_exits():
    """A reward that never returns, in a fresh interpreter: with `zero` it scores 0 (the others
    are kept) after the timeout and one retry in a rebuilt pool; with `error` a RewardError naming
    rl.reward_timeout_s. Each within 2 x timeout + 3 s (pool start-up), and the process exits
    (the thread pool this replaced raised, then never exited)."""
    t = 0.5
    proc = subprocess.run(
        [sys.executable, "-c", HANG.format(t=t)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = dict(ln.split(" ", 1) for ln in proc.stdout.splitlines())
    scores, took = lines["zero"].rsplit(" ", 1)
    assert scores == "[1.0, 0.0, 1.0]" and 2 * t <= float(took) < 2 * t + 3, proc.stdout
    assert t <= float(lines["error"].split()[1]) < 2 * t + 3, proc.stdout
    assert proc.returncode == 1 and "rl.reward_timeout_s=0.5" in proc.stderr, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- GrowMTP target


def _jit_init(make):
    """(graphdef, params) of the module `make()` builds, initialised in one compiled call."""
    return nnx.split(nnx.eval_shape(make))[0], jax.jit(lambda: nnx.split(make())[1])()


def test_growmtp_target_is_the_behaviour_versions_distribution(tiny_cfg):
    """A real recorded speculative rollout (GrowMTP's), then the learner changes the policy, head
    and final norm included, before the MTP update. The DCA loss on the batch the stage hands
    the MTP update measures, over the verify cycles, the same mean step-1 acceptance as the
    verifier did (`gated_alpha_1` = the rollout's `analytic_alpha_1`, 1e-5): its target is the
    behaviour version's distribution. The updated weights (what the stage used before) give a
    different one. The online DCA loss is gated by the same cycles. Non-finite MTP updates in
    a row stop the run like the policy's, naming the MTP."""
    cfg = _rl_cfg("rl.mtp_strategy='growmtp'", "rl.prompts_per_step=4", "rl.group_size=2")
    tok = CharTokenizer()
    mcfg = dataclasses.replace(tiny_cfg, vocab_size=tok.vocab_size, init_std=0.3)
    pol_gd, pol_params = _jit_init(lambda: model.Policy(mcfg, nnx.Rngs(params=0)))
    mtp_gd, mtp_params = _jit_init(lambda: mtp_lib.MTP(mcfg, 1, nnx.Rngs(params=1)))
    record, keep_hidden = learner.rollout_records(cfg)
    assert record and keep_hidden
    rollouts = rollout.Rollouts(
        cfg, pol_gd, mtp_gd, tok, tasks.make_task(cfg.task), record, keep_hidden=keep_hidden
    )
    store = loop.WeightStore(keep=3)
    store.publish(0, pol_params, mtp_params, 0)
    batch = rollouts(0, 0, pol_params, mtp_params, 0)
    updated = jax.jit(lambda p: perturb(p, 2, 0.1))(pol_params)  # the learner's update
    store.publish(1, updated, mtp_params, 0)
    loss_name, steps = learner.mtp_objective(cfg)  # GrowMTP's loss: the `dca` entry
    assert (loss_name, steps) == ("dca", cfg.rollout.num_draft)
    fn = mtp_loss(pol_gd, mtp_gd, loss_name, steps, cfg.mtp.chunk, cfg.rollout.temperature)
    alpha1 = jax.jit(lambda mp, b, pp: fn(mp, b, None, pp)[1]["gated_alpha_1"])
    mb, behaviour = learner.growmtp_update_inputs(store, batch.data, batch.policy_version)
    got = float(alpha1(mtp_params, mb, behaviour))
    assert 0.02 < got < 0.98 and got == pytest.approx(batch.stats["analytic_alpha_1"], abs=1e-5)
    assert abs(float(alpha1(mtp_params, mb, updated)) - got) > 1e-3
    # online / joint with dca: the same gate under the name the MTP loss reads (`cycle_len`);
    # the behaviour policy recomputes its hiddens: the same α_1 (1e-4)
    temp = cfg.rollout.temperature
    online = mtp_loss(pol_gd, mtp_gd, "dca", cfg.rollout.num_draft, cfg.mtp.chunk, temp)
    ob, op = learner.online_update_inputs(batch.data, pol_params)
    got_online = jax.jit(lambda mp, b, pp: online(mp, b, None, pp)[1]["gated_alpha_1"])(
        mtp_params, ob, op
    )
    assert ob.hidden is None and float(got_online) == pytest.approx(got, abs=1e-4)

    # the MTP's run of skipped (non-finite) updates is checked like the policy's
    ok = SimpleNamespace(skips_in_row=0, step=7)
    learner.check_updates(ok, SimpleNamespace(skips_in_row=1, step=7), 2)
    with pytest.raises(NonFiniteError, match="MTP updates: 2 consecutive"):
        learner.check_updates(ok, SimpleNamespace(skips_in_row=2, step=7), 2)


# ----------------------------------------------------------------------------- the RL stage


# The `pretrained` fixture's stages (every RL launch on a copy of it repeats them: a finished
# stage refuses a changed config). Sized so that programs are shared: the SFT and RL greedy
# evaluations (16 rows), the MTP evaluation's rejection sampler and the RL rollouts (16 rows =
# 4 prompts x 4); one MTP loss (no warm-up loss: no RL test needs a good draft, only a trained one).
PRE = [
    "sft.steps=60",
    "sft.eval_samples=16",
    "distill.num_samples=64",
    "mtp.steps=20",
    "mtp.warmup_loss_steps=0",
    "mtp.eval_every=20",
    "mtp.eval_prompts=16",
]


def _rl_cfg(*overrides):
    base = [
        "rl.steps=4",
        "rl.prompts_per_step=4",
        "rl.group_size=4",
        "rl.eval_samples=16",
        "ckpt.every=2",
        *PRE,
    ]
    return config_lib.load(str(REPO / "configs/demo.py:runlocal"), base + list(overrides))[0]


def _mesh():
    return sharding.make_mesh(MeshConfig(data=1), jax.devices()[:1])


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A run directory with sft, distill and mtp done (shared by the RL tests)."""
    from bebop import pipeline

    d = tmp_path_factory.mktemp("pre")
    cfg = _rl_cfg("stages=('sft','distill','mtp')")
    pipeline.run(cfg, d, _mesh())
    return d


def _copy_pre(pretrained, dst):
    import shutil

    for stage in ("sft", "distill", "mtp"):
        shutil.copytree(pretrained / stage, dst / stage)
    return dst


class Capturing(rollout.Rollouts):
    """The real rollout source, keeping the speculative output the sampler returned for each
    batch (`captured[i]`)."""

    captured: dict = {}

    def __call__(self, i, *a):
        self._i = i
        try:
            return super().__call__(i, *a)
        finally:
            self._i = None

    def sample(self, *args):
        out = super().sample(*args)
        if getattr(self, "_i", None) is not None:  # not the speed comparison's calls
            self.captured[self._i] = out[1]
        return out


def test_rollout_prompts_of_some_rows_are_those_rows_of_the_batch():
    """A process builds the prompts of its own rows only (`Rollouts.prompts(i, rows)`): they
    are exactly those rows of the whole batch (groups of `group_size` samples per problem)."""
    cfg = _rl_cfg("rl.prompts_per_step=3", "rl.group_size=2")
    ro = rollout.Rollouts(cfg, None, None, CharTokenizer(), tasks.make_task(cfg.task))
    problems, ids = ro.prompts(5)
    assert len(ids) == 6 and ids[0] == ids[1] and ids[0] != ids[2]
    some_problems, some_ids = ro.prompts(5, [4, 1, 5])
    assert some_ids == [ids[4], ids[1], ids[5]]
    assert some_problems == [problems[4], problems[1], problems[5]]


def test_staleness_bound_and_step_records(pretrained, tmp_path):
    """6 steps with max_staleness 2, a KL penalty, evaluations every 2 steps: the staleness bound
    is reached (the schedule is deterministic: batch i comes from version max(0, i - 2), whatever
    the speeds) and never exceeded; each step's logged per-position acceptance and
    accept-length histogram equal `speculative.summarize` of that step's rollout (captured from
    the real sampler); the KL is exactly 0 at step 1 (policy = reference) and never makes an
    update non-finite; lr, time split, reward spread and evaluations are logged;
    `draft_tokens.bin` holds exactly the emitted drafts of 3 rows per step."""
    captured = Capturing.captured = {}
    cfg = _rl_cfg(
        "rl.max_staleness=2",
        "rl.steps=6",
        "rl.kl_coef=0.05",
        "rl.eval_every=2",
        "rl.draft_log_rows=3",
    )
    summary = rl_stage.run(cfg, _copy_pre(pretrained, tmp_path), _mesh(), make_rollouts=Capturing)
    recs = read_jsonl(tmp_path / "rl/metrics.jsonl")
    stale = [r["policy_version"] - 1 - r["batch_policy_version"] for r in recs]
    assert max(stale) == 2 and min(stale) >= 0  # the bound is reached and never exceeded

    y = cfg.rollout.num_draft
    keys = [f"accept_rate_{k}" for k in range(1, y + 1)] + ["accept_len"]
    keys += [f"accept_hist_{m}" for m in range(1, y + 2)]
    keys += [f"analytic_alpha_{k}" for k in range(1, y + 1)]
    for r in recs:
        summ = speculative.summarize(captured[r["step"] - 1])
        assert [r[k] for k in keys] == [summ[k] for k in keys], r["step"]
    # the policy starts at the reference (the same weights: k3 KL 0 up to float rounding); the KL
    # term adds no non-finite update
    assert abs(recs[0]["kl"]) < 1e-9 and all(r["kl"] >= 0 and r["skipped"] == 0 for r in recs)
    assert all(r["lr"] == pytest.approx(cfg.rl.optim.lr) for r in recs)
    assert (np.diff([r["time"] for r in recs]) > 0).all()
    for k in ("wait_s", "train_s", "sync_s", "rollout_s", "reward_s"):
        assert all(r[k] >= 0 for r in recs), k
    assert all(0 <= r["zero_std_frac"] <= 1 and r["reward_std"] >= 0 for r in recs)
    assert [r["step"] for r in recs if "eval_accuracy" in r] == [2, 4]
    assert [s for s, _ in summary["eval_curve"]] == [0, 2, 4, 6]

    drafts = records.load_draft_tokens(tmp_path / "rl/draft_tokens.bin")
    assert sorted(set(drafts["step"])) == list(range(1, 7))
    for step in range(1, 7):
        d = drafts[drafts["step"] == step]
        rows = sorted(set(d["row"]))
        status = np.asarray(captured[step - 1].stats.status)[rows]
        assert len(rows) == 3 and len(d) == np.isin(status, [ACCEPTED, REJECTED]).sum()
        assert d["accepted"].sum() == (status == ACCEPTED).sum()


def test_mtp_strategies_never_touch_the_policy(pretrained, tmp_path):
    """Given the same rollouts (recorded once, replayed), the policy after 3 learner steps is
    bitwise identical with MTP strategies frozen, online and growmtp, while the MTP does move."""
    recorded = {}

    class Replay(rollout.Rollouts):
        def __init__(self, *a, record=False, keep_hidden=False, **k):
            # hiddens + cycle lengths for growmtp replays
            super().__init__(*a, record=True, keep_hidden=True, **k)

        def __call__(self, i, *a):
            if i not in recorded:
                recorded[i] = super().__call__(i, *a)
            return recorded[i]

    finals = {}
    for strategy in ("frozen", "online", "growmtp"):
        cfg = _rl_cfg(f"rl.mtp_strategy='{strategy}'", "rl.max_staleness=0", "rl.steps=3")
        d = _copy_pre(pretrained, tmp_path / strategy)
        rl_stage.run(cfg, d, _mesh(), make_rollouts=Replay)
        finals[strategy] = policies.load_rl(cfg, d, _mesh())
        versions = [r["mtp_version"] for r in read_jsonl(d / "rl/metrics.jsonl")]
        assert versions[-1] == (0 if strategy == "frozen" else 3)
    for strategy in ("online", "growmtp"):
        for a, b in zip(
            jax.tree.leaves(finals["frozen"][0]), jax.tree.leaves(finals[strategy][0]), strict=True
        ):  # noqa: E501
            np.testing.assert_array_equal(a, b)
        moved = [
            float(jnp.abs(a - b).max())
            for a, b in zip(
                jax.tree.leaves(finals["frozen"][1]),
                jax.tree.leaves(finals[strategy][1]),
                strict=True,
            )
        ]  # noqa: E501
        assert max(moved) > 0


def test_growmtp_grows_a_draft_head_from_random_init(pretrained, tmp_path):
    """12 RL steps of GrowMTP (random MTP, DCA loss on verification's own hiddens): the mean
    accept length of the last 3 rollout batches beats the first 3 by > 0.1 tokens."""
    cfg = _rl_cfg(
        "rl.mtp_strategy='growmtp'",
        "rl.steps=12",
        "rl.prompts_per_step=8",
        "rl.mtp_optim.lr=3e-3",
        "rl.mtp_optim.warmup_steps=2",
    )
    d = _copy_pre(pretrained, tmp_path)
    rl_stage.run(cfg, d, _mesh())
    acc = [r["accept_len"] for r in read_jsonl(d / "rl/metrics.jsonl")]
    assert np.mean(acc[-3:]) > np.mean(acc[:3]) + 0.1, acc


def _launch(workdir, *overrides, wait=True):
    cmd = [
        sys.executable,
        "launch.py",
        "--config",
        "configs/demo.py:runlocal",
        "--workdir",
        str(workdir),
        *[f"--config.{o}" for o in overrides],
    ]
    if wait:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


RESUME = [
    "rl.steps=6",
    "rl.prompts_per_step=4",
    "rl.group_size=4",
    "rl.eval_samples=16",
    "ckpt.every=2",
    "rl.max_staleness=1",
    "ckpt.async_save=False",
    *PRE,
]


def test_rl_kill_and_resume_continues_to_the_same_metrics(pretrained, tmp_path):
    full = _launch(_copy_pre(pretrained, tmp_path / "full"), *RESUME)
    assert full.returncode == 0, full.stderr[-6000:]
    cut = _copy_pre(pretrained, tmp_path / "cut")
    proc = _launch(cut, *RESUME, wait=False)
    deadline = time.time() + 300
    while not (cut / "rl/ckpt/2").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # no clean-up of any kind
    proc.wait()
    assert (cut / "rl/ckpt/2").exists() and not (cut / "rl/summary.json").exists()
    again = _launch(cut, *RESUME)
    assert again.returncode == 0, again.stderr[-2000:]
    a = read_jsonl(tmp_path / "full/rl/metrics.jsonl")
    b = read_jsonl(cut / "rl/metrics.jsonl")
    # staleness 1: the first batch after the resume comes from the version before the
    # checkpoint, as in the uninterrupted run (the checkpoint holds those weights)
    keys = ("loss", "reward_mean", "grad_norm", "entropy", "accept_len", "batch_policy_version")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["staleness"] for r in b] == [0] + [1] * 5
    sa = json.loads((tmp_path / "full/rl/summary.json").read_text())
    sb = json.loads((cut / "rl/summary.json").read_text())
    same = ("accuracy_after", "reward_first", "reward_last", "accept_len", "max_staleness_seen")
    assert [sa[k] for k in same] == [sb[k] for k in same]  # the summary covers all 6 steps


def test_a_failing_reward_fails_the_run(pretrained, tmp_path):
    cfg = _rl_cfg()
    t = tasks.make_task(cfg.task)
    task = tasks.Task(t.problem, t.prompt_ids, reward_fns.backend_down)
    with pytest.raises(rewards.RewardError, match="reward backend down"):
        rl_stage.run(cfg, _copy_pre(pretrained, tmp_path), _mesh(), task=task)


def test_rl_without_the_mtp_stage_loads_the_trained_draft_or_names_the_missing_one(
    pretrained, tmp_path
):
    """Re-running only the RL stage drafts with the `mtp` stage's checkpoint (not a random MTP);
    with no checkpoint the error names `DIR/mtp/ckpt`; GrowMTP starts fresh unless `mtp.init_from`
    names a pre-trained head."""
    cfg = _rl_cfg("stages=('rl',)")
    mesh = _mesh()
    policy = policies.load(cfg, pretrained, mesh)
    pol_cfg = policy.cfg
    _, got, vocab = rl_stage.load_draft_model(cfg, pretrained, policy, mesh)
    want = mtp_train.load_trained(cfg, pretrained, pol_cfg, mesh)[1]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    fresh = mtp_lib.init(pol_cfg, cfg.mtp.num_layers, cfg.seed + 100)[1]
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(fresh), strict=True)
    )
    (tmp_path / "mtp").mkdir()
    with pytest.raises(FileNotFoundError, match=r"mtp/ckpt holds no checkpoint"):
        rl_stage.load_draft_model(cfg, tmp_path, policy, mesh)
    # another run's pre-RL MTP (`mtp.init_from`) when this workdir has none
    other = _rl_cfg("stages=('rl',)", f"mtp.init_from='{pretrained / 'mtp' / 'ckpt'}'")
    _, got_other, _ = rl_stage.load_draft_model(other, tmp_path, policy, mesh)
    for a, b in zip(jax.tree.leaves(got_other), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    missing = _rl_cfg("stages=('rl',)", f"mtp.init_from='{tmp_path / 'none'}'")
    with pytest.raises(FileNotFoundError, match=r"'mtp.init_from': .*none holds no checkpoint"):
        rl_stage.load_draft_model(missing, tmp_path, policy, mesh)
    grow = _rl_cfg("stages=('rl',)", "rl.mtp_strategy='growmtp'")
    _, got_grow, _ = rl_stage.load_draft_model(grow, pretrained, policy, mesh)
    for a, b in zip(jax.tree.leaves(got_grow), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(a, b)
    # GrowMTP's updates from a pre-trained head (`mtp.init_from`) start from its weights
    grow_pre = _rl_cfg(
        "stages=('rl',)",
        "rl.mtp_strategy='growmtp'",
        f"mtp.init_from='{pretrained / 'mtp' / 'ckpt'}'",
    )
    _, got_grow_pre, _ = rl_stage.load_draft_model(grow_pre, tmp_path, policy, mesh)
    for a, b in zip(jax.tree.leaves(got_grow_pre), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
