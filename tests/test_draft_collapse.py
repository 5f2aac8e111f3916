"""The draft-collapse guard (`rl.draft_collapse_ratio`, `rl.draft_collapse_action`): speculative
rollouts whose MTP weights are swapped mid-run for weights that do not belong to the policy are
reported naming both versions, or stop the run; healthy batches never are."""

import dataclasses
import logging

import jax
import pytest

from bebop import config as config_lib
from bebop import sampling, speculative
from bebop.config import ConfigError, ModelConfig
from bebop.rl import rollouts as rl_rollouts
from bebop.rl.guards import DraftCollapseError, DraftCollapseGuard
from bebop.speculative import SpecConfig
from bebop.tokenizer import CharTokenizer

from .conftest import REPO
from .helpers import bigram_policy_and_copy_mtp

CFG = ModelConfig(
    vocab_size=16, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, ffw_dim=48
)
PROMPTS = [[1, 5, 6, 7], [1, 3], [1, 4, 4, 4, 4, 9], [1, 8, 2]] * 4  # 16 rows


def _accept_rate(pol, mtp, seed):
    """The accept rate of one speculative rollout batch (16 rows x 16 new tokens, γ = 3)."""
    scfg = sampling.SamplingConfig(temperature=1.0, max_new_tokens=16, eos_ids=(-1,))
    toks, lens = sampling.pad_prompts(PROMPTS)
    out = speculative.sample_jit(
        *pol, *mtp, toks, lens, jax.random.key(seed), scfg, SpecConfig(3, "rejection")
    )
    return speculative.summarize(jax.device_get(out))["accept_rate"]


def _run(guard, swap_at: int, steps: int = 8):
    """Rollout batches of a policy whose MTP (a copy of it: acceptance 1) is replaced at
    batch `swap_at` by another policy's MTP -- mismatched weights loaded mid-run -- (MTP version
    1 from then on); returns the accept rates and what the guard logged per batch."""
    pol, (mg, mp) = bigram_policy_and_copy_mtp(CFG, 0)
    _, (_, other) = bigram_policy_and_copy_mtp(CFG, 7)  # the MTP of a different policy
    rates, logged = [], []
    for step in range(steps):
        swapped = step >= swap_at
        rate = _accept_rate(pol, (mg, other if swapped else mp), seed=step)
        rates.append(rate)
        logged.append(guard.update(step, rate, policy_version=step, mtp_version=int(swapped)))
    return rates, logged


def test_mismatched_mtp_weights_loaded_mid_run_are_reported_naming_both_versions(caplog):
    guard = DraftCollapseGuard(ratio=0.25, action="warn")
    with caplog.at_level(logging.WARNING, logger="bebop.rl.guards"):
        rates, logged = _run(guard, swap_at=5)
    # 16 rows x 16 tokens per batch: the copy is always accepted, the other policy's MTP rarely
    # (thresholds far from both: 0.8 and 0.2 against the 0.25 x level trigger)
    assert min(rates[:5]) > 0.8 and max(rates[5:]) < 0.2, rates
    assert logged[:5] == [None] * 5  # healthy batches: no report
    assert logged[5] is not None and logged[6:] == [None] * 2  # reported once per collapse
    assert "policy version 5 and MTP version 1" in logged[5]
    assert "last healthy batch: policy version 4, MTP version 0" in logged[5]
    assert caplog.records and "draft acceptance collapsed" in caplog.records[0].getMessage()


def test_with_action_error_the_run_stops_at_the_first_collapsed_batch():
    guard = DraftCollapseGuard(ratio=0.25, action="error")
    with pytest.raises(DraftCollapseError, match=r"step 4: .*policy version 4 and MTP version 1"):
        _run(guard, swap_at=4)


def test_the_guard_is_off_at_ratio_zero_and_waits_for_its_warmup():
    off = DraftCollapseGuard(ratio=0.0, action="error")
    assert [off.update(i, r, i, 0) for i, r in enumerate([0.9, 0.9, 0.9, 0.0])] == [None] * 4
    early = DraftCollapseGuard(ratio=0.25, action="error", warmup=3)
    for i, r in enumerate([0.9, 0.0, 0.9, 0.9, 0.9]):  # a low batch before the level is known
        early.update(i, r, i, 0)
    with pytest.raises(DraftCollapseError):
        early.update(5, 0.1, 5, 0)


def test_the_config_keys_are_checked():
    demo = str(REPO / "configs" / "demo.py")
    cfg = config_lib.load(demo, ["rl.draft_collapse_action='error'"])[0]
    assert cfg.rl.draft_collapse_action == "error" and cfg.rl.draft_collapse_ratio == 0.25
    with pytest.raises(ConfigError, match=r"'rl\.draft_collapse_action'"):
        config_lib.load(demo, ["rl.draft_collapse_action='stop'"])
    with pytest.raises(ConfigError, match=r"'rl\.draft_collapse_ratio'"):
        config_lib.load(demo, ["rl.draft_collapse_ratio=1.5"])


@pytest.mark.slow  # a whole rl stage (~30 s on 2 cores)
def test_the_rl_stage_stops_when_mismatched_mtp_weights_are_loaded_mid_run(tmp_path):
    """The rl stage end to end (sync, 6 steps of 2 x 2 rows) on a bigram policy whose MTP copies
    it (acceptance 1); from batch 3 on the rollouts draft with another policy's MTP (MTP version
    1), as a broken weight sync would: with `rl.draft_collapse_action='error'` the run stops at
    step 3 naming the versions."""
    from bebop.stages import rl as rl_stage

    from .test_hostile import _mesh, _save_params

    # the demo's character tokenizer's vocabulary
    model_cfg = dataclasses.replace(CFG, vocab_size=CharTokenizer().vocab_size)
    (pg, pp), (mg, mp) = bigram_policy_and_copy_mtp(model_cfg, 0)
    _, (_, other) = bigram_policy_and_copy_mtp(model_cfg, 7)
    _save_params(tmp_path / "sft" / "ckpt", pp)
    _save_params(tmp_path / "mtp" / "ckpt", mp)
    m = dataclasses.replace(model_cfg, num_layers=1, init_std=0.5, norm_eps=1e-12)  # the helper's
    overrides = [
        "stages=('rl',)",
        *(f"model.{f.name}={getattr(m, f.name)!r}" for f in dataclasses.fields(m)),
        "mtp.num_layers=1",
        "rl.steps=6",
        "rl.prompts_per_step=2",
        "rl.group_size=2",
        "rl.max_staleness=0",
        "rl.eval_samples=2",
        "rl.speedup_repeats=0",
        "rl.mtp_strategy='frozen'",
        "rl.draft_collapse_action='error'",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "rollout.top_k=0",
        "rollout.num_draft=2",
        "rollout.max_new_tokens=12",
        "rollout.compact=False",
        "ckpt.every=100",
    ]
    cfg = config_lib.load(str(REPO / "configs" / "demo.py:runlocal"), overrides)[0]

    class Swapped(rl_rollouts.Rollouts):
        def __call__(self, i, version, pol_params, mtp_params, mtp_version):
            if i >= 3:  # mismatched MTP weights arrive with the next sync
                mtp_params, mtp_version = jax.device_put(other), mtp_version + 1
            return super().__call__(i, version, pol_params, mtp_params, mtp_version)

    with pytest.raises(DraftCollapseError, match=r"step 3: .*policy version 3 and MTP version 1"):
        rl_stage.run(cfg, tmp_path, _mesh(), make_rollouts=Swapped)
