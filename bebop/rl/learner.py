"""The RL learner's step: a GRPO update of the policy and, by `rl.mtp_strategy`, what happens to
the MTP. `MTP_STRATEGIES` maps each strategy to its step function

    step(learner, split, pol_state, mtp_state, batch, behaviour_version, step)
        -> (pol_state, mtp_state, metrics, mtp_updated)

(`batch`: the step's `loop.LearnerBatch` on the device; `behaviour_version`: the policy version
that generated it; `split`: the step's `metrics.Timer`). In every strategy no gradient of an MTP
loss reaches the policy (the policy's parameters enter MTP losses only as the frozen argument of
`mtp_losses.mtp_loss`, under `stop_gradient`):

  frozen   Bebop's recipe: the pre-RL MTP, never updated.
  online   every `rl.mtp_every` learner steps, an MTP update (`rl.mtp_loss`) on the newest rollout
           batch, with the updated policy's hiddens; own optimizer, LR and clipping.
  joint    the MTP update is fused into the learner's jitted step (same batch, the pre-update
           policy's hiddens), with its own optimizer, LR and grad-norm clipping.
  growmtp  GrowMTP: a randomly initialised MTP trained with the `dca` loss on what verification
           already computed: the recorded backbone hiddens (and the layers `mtp.features` names,
           from the same verify) seed the MTP (no extra backbone pass),
           each verify cycle's length gates its chain, and the target p is the behaviour
           version's (the weights the verifier used, kept by the weight store), over
           min(mtp.train_steps, rollout.num_draft) chain steps (no cycle ever drafts more).
With `rl.mtp_loss = "dca"` under online / joint, rollouts record each cycle's length too.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import jax

from bebop.config import ModelConfig, RLConfig, RolloutConfig, RunConfig
from bebop.mtp_losses import MTPBatch, mtp_loss
from bebop.rl import grpo, loop, microbatch
from bebop.train import NonFiniteError, check_nonfinite, jit_pinned, make_train_step, schedule

log = logging.getLogger(__name__)


def mtp_objective(rl: RLConfig, train_steps: int, num_draft: int) -> tuple[str, int]:
    """(MTP loss name, chain steps trained) of the strategy's MTP updates: `rl.mtp_loss` over
    `train_steps` (`mtp.train_steps`) chained steps, or GrowMTP's DCA over the steps a cycle
    drafts (at most `num_draft`, `rollout.num_draft`)."""
    if rl.mtp_strategy == "growmtp":
        return "dca", min(train_steps, num_draft)
    return rl.mtp_loss, train_steps


def rollout_records(rl: RLConfig) -> tuple[bool, bool]:
    """(record each verify cycle's length, also keep verification's hiddens): what the
    strategy's MTP updates read from the rollouts."""
    grow = rl.mtp_strategy == "growmtp"
    return grow or (rl.mtp_loss == "dca" and rl.mtp_strategy in ("online", "joint")), grow


def mtp_batch(batch: loop.LearnerBatch, hidden: bool) -> MTPBatch:
    """The MTP loss's view of a learner batch; `hidden=False` drops recorded hiddens and
    features (the policy the update uses recomputes its own)."""
    return MTPBatch(
        batch.tokens,
        batch.mask,
        batch.hidden if hidden else None,
        cycle_len=batch.cycle_len,
        features=batch.features if hidden else None,
    )


def growmtp_update_inputs(store: loop.WeightStore, batch: loop.LearnerBatch, version: int):
    """GrowMTP's MTP update: (batch, policy params). The behaviour version's weights (`version`,
    still in the store): the recorded hiddens are that version's, so the DCA target p is exactly
    the distribution the verifier used, not the updated head applied to old hiddens."""
    return mtp_batch(batch, hidden=True), store.peek(version)[0]


def online_update_inputs(batch: loop.LearnerBatch, pol_params):
    """online: the current policy, which recomputes the hiddens (recorded ones dropped)."""
    return mtp_batch(batch, hidden=False), pol_params


@dataclasses.dataclass
class Learner:
    """The jitted steps and what the strategies read, built once per RL launch (`build`)."""

    policy_step: Callable  # (pol_state, batch, ref_params) -> (pol_state, metrics)
    mtp_step: Callable  # (mtp_state, MTPBatch, pol_params) -> (mtp_state, metrics)
    joint_step: Callable  # (pol_state, mtp_state, batch, ref_params) -> (both, metrics)
    store: loop.WeightStore
    mtp_every: int
    mtp_lr: Callable  # the MTP optimizer's schedule
    ref_params: object = None  # the KL reference (None without a KL term)

    def train_policy(self, split, pol_state, batch):
        with split("train_s"):
            pol_state, m = self.policy_step(pol_state, batch, self.ref_params)
            jax.block_until_ready(pol_state.params)
        return pol_state, m

    def train_mtp(self, split, mtp_state, batch: MTPBatch, pol_params):
        with split("mtp_train_s"):
            mtp_state, mm = self.mtp_step(mtp_state, batch, pol_params)
            jax.block_until_ready(mtp_state.params)
        return mtp_state, {f"mtp_{k}": v for k, v in mm.items()}

    def with_mtp_lr(self, m: dict, mtp_state) -> dict:
        return {**m, "mtp_lr": self.mtp_lr(int(mtp_state.step) - 1)}


def microbatch_rows(
    rl: RLConfig,
    rollout: RolloutConfig,
    model_cfg: ModelConfig,
    seq_len: int,
    batch_shards: int = 1,
) -> int:
    """Rows per gradient-accumulation chunk of the policy update for rows of `seq_len` tokens:
    `rl.microbatch` when > 0, the whole batch when 0, and for -1 (auto) the largest divisor of
    the batch whose estimated activations (`microbatch.learner_row_bytes` of the policy
    `model_cfg`) on one of the `batch_shards` devices the rows are split over fit
    `rl.memory_budget_gb` (`microbatch.auto_microbatch`; a `ConfigError` if one row does not)."""
    rows = rl.prompts_per_step * rl.group_size
    if rl.microbatch >= 0:
        return rl.microbatch or rows
    truncated = rollout.top_k > 0 or rollout.top_p < 1.0
    row = microbatch.learner_row_bytes(
        model_cfg, seq_len, rl.logit_chunk, kl=rl.kl_coef > 0, truncated=truncated
    )
    return microbatch.auto_microbatch(rows, row, rl.memory_budget_gb * 1e9, batch_shards)


def _by_width(make: Callable, rows: int, pick: Callable, batch_arg: int) -> Callable:
    """A step that, per row width of its batch (argument `batch_arg`), runs `make(chunks)` with
    `rows // pick(width)` accumulation chunks (made once per chunk count)."""
    steps: dict[int, Callable] = {}

    def for_args(*args):
        width = args[batch_arg].tokens.shape[1]
        chunks = rows // pick(width)
        if chunks not in steps:
            log.info("rl: learner rows of %d tokens: %d accumulation chunk(s)", width, chunks)
            steps[chunks] = make(chunks)
        return steps[chunks]

    def call(*args):
        return for_args(*args)(*args)

    call._cache_size = lambda: sum(f._cache_size() for f in steps.values())
    call.lower = lambda *args: for_args(*args).lower(*args)
    return call


def build(
    cfg: RunConfig,
    pol_gd,
    mtp_gd,
    scfg,
    vocab,
    opt,
    mtp_opt,
    store,
    ref_params=None,
    model_cfg: ModelConfig | None = None,
    batch_shards: int = 1,
):
    """The learner's jitted steps. `scfg`: the rollout sampler's config (the learner's log-probs
    use its support); `vocab`: the MTP's draft vocabulary. `model_cfg` (the policy's
    architecture, default `cfg.model`) and `batch_shards` (devices the batch rows are split
    over) size the microbatch under `rl.microbatch=-1` (`microbatch_rows`)."""
    rl = cfg.rl
    model_cfg = model_cfg or cfg.model

    def grpo_loss(p, b, _, ref):
        return grpo.policy_loss(
            pol_gd,
            p,
            b,
            rl.clip_low,
            rl.clip_high,
            rl.kl_coef,
            rl.loss_agg,
            scfg,
            ref,
            logit_chunk=rl.logit_chunk,
        )

    loss_name, train_steps = mtp_objective(rl, cfg.mtp.train_steps, cfg.rollout.num_draft)
    temp = max(cfg.rollout.temperature, 1e-3)
    # the verifier's distributions: the rollout sampler's temperature and truncation
    mtp_fn = mtp_loss(
        pol_gd, mtp_gd, loss_name, train_steps, cfg.mtp.chunk, temp, vocab, scfg.top_k, scfg.top_p
    )
    rows = rl.prompts_per_step * rl.group_size
    inner_mtp = make_train_step(mtp_fn, mtp_opt, donate=False, jit=False)

    def pol_kw(chunks):
        return dict(microbatches=chunks, chunk_weight=grpo.chunk_weight(rl.loss_agg))

    def make_policy_step(chunks):
        return make_train_step(grpo_loss, opt, **pol_kw(chunks))

    def make_joint_step(chunks):
        inner_pol = make_train_step(grpo_loss, opt, donate=False, jit=False, **pol_kw(chunks))

        def joint(ps, ms, batch, ref):
            ms, mm = inner_mtp(ms, mtp_batch(batch, hidden=False), ps.params)  # pre-update
            ps, pm = inner_pol(ps, batch, ref)
            return ps, ms, {**pm, **{f"mtp_{k}": v for k, v in mm.items()}}

        return jit_pinned(joint, 2, donate_argnums=(0, 1))

    if rl.microbatch >= 0:
        chunks = rows // rl.microbatch if rl.microbatch else 1
        policy_step, joint_step = make_policy_step(chunks), make_joint_step(chunks)
    else:

        def pick(width):
            return microbatch_rows(rl, cfg.rollout, model_cfg, width, batch_shards)

        policy_step = _by_width(make_policy_step, rows, pick, 1)
        joint_step = _by_width(make_joint_step, rows, pick, 2)

    return Learner(
        policy_step=policy_step,
        mtp_step=make_train_step(mtp_fn, mtp_opt),
        joint_step=joint_step,
        store=store,
        mtp_every=rl.mtp_every,
        mtp_lr=schedule(rl.mtp_optim, rl.steps),
        ref_params=ref_params,
    )


# ----------------------------------------------------------------------------- strategies


def frozen(learner: Learner, split, pol_state, mtp_state, batch, behaviour_version, step):
    pol_state, m = learner.train_policy(split, pol_state, batch)
    return pol_state, mtp_state, m, False


def online(learner: Learner, split, pol_state, mtp_state, batch, behaviour_version, step):
    pol_state, m = learner.train_policy(split, pol_state, batch)
    due = (step + 1) % learner.mtp_every == 0
    if due:
        mtp_state, mm = learner.train_mtp(
            split, mtp_state, *online_update_inputs(batch, pol_state.params)
        )
        m = {**m, **mm}
    return pol_state, mtp_state, learner.with_mtp_lr(m, mtp_state), due


def joint(learner: Learner, split, pol_state, mtp_state, batch, behaviour_version, step):
    with split("train_s"):
        pol_state, mtp_state, m = learner.joint_step(
            pol_state, mtp_state, batch, learner.ref_params
        )
        jax.block_until_ready(pol_state.params)
    return pol_state, mtp_state, learner.with_mtp_lr(m, mtp_state), True


def growmtp(learner: Learner, split, pol_state, mtp_state, batch, behaviour_version, step):
    pol_state, m = learner.train_policy(split, pol_state, batch)
    inputs = growmtp_update_inputs(learner.store, batch, behaviour_version)
    mtp_state, mm = learner.train_mtp(split, mtp_state, *inputs)
    return pol_state, mtp_state, learner.with_mtp_lr({**m, **mm}, mtp_state), True


MTP_STRATEGIES = {"frozen": frozen, "online": online, "joint": joint, "growmtp": growmtp}


def check_updates(pol_state, mtp_state, max_nonfinite: int, last_good: str = "") -> None:
    """Stops after `max_nonfinite` non-finite updates in a row, of the policy or of the MTP."""
    check_nonfinite(pol_state, max_nonfinite, last_good)
    try:
        check_nonfinite(mtp_state, max_nonfinite, last_good)
    except NonFiniteError as e:
        raise NonFiniteError(f"MTP updates: {e}") from None
