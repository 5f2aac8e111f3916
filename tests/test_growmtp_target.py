"""GrowMTP's MTP target: the DCA loss on a recorded speculative rollout measures the behaviour
version's acceptance, and non-finite MTP updates stop the run."""

import dataclasses
from types import SimpleNamespace

import jax
import pytest
from flax import nnx

from bebop import model, tasks
from bebop import mtp as mtp_lib
from bebop.mtp_losses import mtp_loss
from bebop.rl import learner, loop
from bebop.rl import rollouts as rl_rollouts
from bebop.tokenizer import CharTokenizer
from bebop.train import NonFiniteError

from .helpers import perturb
from .rl_config import rl_cfg as _rl_cfg

# ----------------------------------------------------------------------------- GrowMTP target


def _jit_init(make):
    """(graphdef, params) of the module `make()` builds, initialised in one compiled call."""
    return nnx.split(nnx.eval_shape(make))[0], jax.jit(lambda: nnx.split(make())[1])()


@pytest.mark.slow
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
    record, keep_hidden = learner.rollout_records(cfg.rl)
    assert record and keep_hidden
    rollouts = rl_rollouts.Rollouts(
        cfg, pol_gd, mtp_gd, tok, tasks.make_task(cfg.task), record, keep_hidden=keep_hidden
    )
    store = loop.WeightStore(keep=3)
    store.publish(0, pol_params, mtp_params, 0)
    batch = rollouts(0, 0, pol_params, mtp_params, 0)
    updated = jax.jit(lambda p: perturb(p, 2, 0.1))(pol_params)  # the learner's update
    store.publish(1, updated, mtp_params, 0)
    # GrowMTP's loss: the `dca` entry
    loss_name, steps = learner.mtp_objective(cfg.rl, cfg.mtp.train_steps, cfg.rollout.num_draft)
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
