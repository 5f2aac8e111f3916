"""GrowMTP with tail-aware rollouts: every bucket drafts `rollout.num_draft`, so the recorded
verify cycles (what its DCA loss is gated by) reach every draft step; and draft tables that
would draft past `num_draft` (or below it, for GrowMTP) are config errors naming the key."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from bebop import compaction, model, tasks
from bebop import config as config_lib
from bebop import mtp as mtp_lib
from bebop.config import ConfigError
from bebop.rl import learner
from bebop.rl import rollouts as rl_rollouts
from bebop.tokenizer import CharTokenizer

from .conftest import REPO

ROWS, MIN_BUCKET = 16, 4


def _cfg(*overrides):
    base = [
        "rl.prompts_per_step=4",
        "rl.group_size=4",
        "rollout.compact=True",
        f"rollout.min_bucket={MIN_BUCKET}",
    ]
    return config_lib.load(str(REPO / "configs/demo.py:runlocal"), base + list(overrides))[0]


def _init(make):
    return nnx.split(nnx.eval_shape(make))[0], jax.jit(lambda: nnx.split(make())[1])()


def _two_rollouts(cfg, tiny_cfg):
    """Two recorded rollouts of a near-uniform policy and MTP (acceptance near 1), with costs
    under which the derived draft table drafts nowhere (a draft costs 100 decode steps)."""
    tok = CharTokenizer()
    mcfg = dataclasses.replace(tiny_cfg, vocab_size=tok.vocab_size, init_std=0.02)
    pol_gd, pol_params = _init(lambda: model.Policy(mcfg, nnx.Rngs(params=0)))
    mtp_gd, mtp_params = _init(lambda: mtp_lib.MTP(mcfg, 1, nnx.Rngs(params=1)))
    g = cfg.rollout.num_draft
    costs = {
        b: {"step": 1.0, "draft": 100.0, **{f"verify_{w}": 100.0 for w in range(2, g + 2)}}
        for b in compaction.bucket_sizes(ROWS, MIN_BUCKET)
    }
    record, keep_hidden = learner.rollout_records(cfg.rl)
    assert record
    src = rl_rollouts.Rollouts(
        cfg,
        pol_gd,
        mtp_gd,
        tok,
        tasks.make_task(cfg.task),
        record,
        keep_hidden=keep_hidden,
        draft_costs=costs,
    )
    batches = [src(i, 0, pol_params, mtp_params, 0) for i in range(2)]
    return src, batches


@pytest.mark.slow
def test_growmtp_with_compaction_records_cycles_over_every_draft_step(tiny_cfg):
    """The second rollout comes after the table would have been derived (γ = 0 at every bucket
    under these costs, as the control below shows): GrowMTP keeps γ = num_draft, so with an
    acceptance near 1 its cycles emit num_draft + 1 tokens and its DCA gate (terms l <= cycle
    length) reaches draft step num_draft."""
    cfg = _cfg("rl.mtp_strategy='growmtp'")
    g = cfg.rollout.num_draft
    assert g >= 2
    src, (_, second) = _two_rollouts(cfg, tiny_cfg)
    assert src.table == () and "draft_table" not in second.stats
    cyc = np.asarray(second.data.cycle_len)
    assert cyc.max() == g + 1
    # every draft step is attempted in that rollout
    for k in range(1, g + 1):
        assert second.stats[f"accept_rate_{k}"] > 0.5, (k, second.stats)
    # the share of cycles whose gate reaches step g: far from none (near-uniform p and q)
    anchored = cyc[cyc > 0]
    assert (anchored >= g).mean() > 0.3


def test_control_derived_table_drafts_nowhere_under_these_costs(tiny_cfg):
    """The same rollouts for another strategy that records cycles (online DCA): the derived
    table goes to γ = 0 everywhere and every recorded cycle is 1 token long -- what GrowMTP's
    DCA was trained on before (step 1 only)."""
    cfg = _cfg("rl.mtp_strategy='online'", "rl.mtp_loss='dca'")
    src, (_, second) = _two_rollouts(cfg, tiny_cfg)
    assert all(gamma == 0 for _, gamma in src.table) and src.table
    cyc = np.asarray(second.data.cycle_len)
    assert cyc.max() == 1


def test_draft_table_gamma_above_num_draft_is_a_config_error():
    with pytest.raises(ConfigError, match=r"rollout\.draft_table.*num_draft = 2"):
        _cfg("rollout.num_draft=2", "rollout.draft_table=((8, 3),)")
    cfg = _cfg("rollout.num_draft=2", "rollout.draft_table=((8, 2), (16, 0))")
    assert cfg.rollout.draft_table == ((8, 2), (16, 0))


def test_growmtp_from_a_fresh_head_refuses_a_draft_vocabulary():
    """A draft vocabulary is chosen from an MTP stage's distill data: a head GrowMTP grows
    without `mtp.init_from` has none, and drafting over the full vocabulary instead of the
    configured `mtp.draft_vocab` would be a silent change of the head's shape and cost."""
    with pytest.raises(ConfigError, match=r"mtp\.draft_vocab.*mtp\.init_from"):
        _cfg("rl.mtp_strategy='growmtp'", "mtp.draft_vocab=64")
    assert _cfg("rl.mtp_strategy='growmtp'", "mtp.draft_vocab=0").mtp.draft_vocab == 0
    grown = _cfg("rl.mtp_strategy='growmtp'", "mtp.draft_vocab=64", "mtp.init_from='/x/ckpt'")
    assert grown.mtp.draft_vocab == 64  # a trained head brings its vocabulary
    assert _cfg("rl.mtp_strategy='frozen'", "mtp.draft_vocab=64").mtp.draft_vocab == 64


def test_growmtp_refuses_a_draft_table_below_num_draft():
    with pytest.raises(ConfigError, match=r"rollout\.draft_table.*growmtp"):
        _cfg("rl.mtp_strategy='growmtp'", "rollout.num_draft=2", "rollout.draft_table=((8, 0),)")
    cfg = _cfg("rl.mtp_strategy='growmtp'", "rollout.num_draft=2", "rollout.draft_table=((8, 2),)")
    assert cfg.rollout.draft_table == ((8, 2),)
