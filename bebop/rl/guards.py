"""The draft-collapse guard: the most common failure of speculative RL is a draft whose
acceptance silently falls to about 0 after a weight sync (draft weights sent to the wrong model, a
stale or re-initialised head). Rollouts still finish -- every drafted token is rejected and the
policy emits one token per verify step -- so nothing fails, the run only gets slower. Each rollout
batch carries the policy and MTP versions it was sampled with; `DraftCollapseGuard` compares each
batch's accept rate with its running level and, below `rl.draft_collapse_ratio` of it, warns
naming both versions or (`rl.draft_collapse_action='error'`) stops the run."""

from __future__ import annotations

import logging
import math

log = logging.getLogger(__name__)


class DraftCollapseError(RuntimeError):
    """The draft's acceptance collapsed and `rl.draft_collapse_action='error'`."""


class DraftCollapseGuard:
    """Running level: an exponential moving average (weight `decay` on the past) of the accept
    rates of healthy batches, armed after `warmup` of them. A batch below `ratio` x the level is a
    collapse: it is not folded into the level (a collapse that lasts keeps being one), it is
    reported once until a healthy batch comes back, and with `action='error'` it raises."""

    def __init__(self, ratio: float, action: str = "warn", warmup: int = 3, decay: float = 0.8):
        if action not in ("warn", "error"):
            raise ValueError(f"rl.draft_collapse_action={action!r}: warn | error")
        self.ratio, self.action, self.warmup, self.decay = ratio, action, warmup, decay
        self.level: float | None = None
        self.seen = 0
        self.last: tuple[int, int] | None = None  # versions of the last healthy batch
        self.collapsed = False

    def update(self, step: int, accept_rate, policy_version: int, mtp_version: int) -> str | None:
        """Checks one batch; returns the warning it logged, if any."""
        if not self.ratio or accept_rate is None or not math.isfinite(accept_rate):
            return None
        rate = float(accept_rate)
        if self.seen >= self.warmup and rate < self.ratio * self.level:
            msg = (
                f"rl: draft acceptance collapsed at step {step}: accept rate {rate:.3f} is below "
                f"rl.draft_collapse_ratio={self.ratio} x its running level {self.level:.3f}, "
                f"for the batch sampled with policy version {policy_version} and MTP version "
                f"{mtp_version} (last healthy batch: policy version {self.last[0]}, MTP version "
                f"{self.last[1]}). The draft weights may not belong to this policy: a sync to "
                "the wrong model, a stale or re-initialised MTP head"
            )
            if self.action == "error":
                raise DraftCollapseError(msg)
            if self.collapsed:
                return None
            self.collapsed = True
            log.warning(msg)
            return msg
        self.collapsed = False
        self.level = (
            rate if self.level is None else self.decay * self.level + (1 - self.decay) * rate
        )
        self.seen += 1
        self.last = (policy_version, mtp_version)
        return None
