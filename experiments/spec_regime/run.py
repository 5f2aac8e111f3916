"""Where does speculation pay end to end on this machine? Plain vs speculative GRPO on SmolLM2 at
several rows per step, group sizes and response budgets.

Each setting is one pair of short RL runs from one base run (a distilled SmolLM2 and its pre-RL
MTP, `configs/mtp_smollm2.py`): the RL task of `configs/rl_smollm2.py` (wordmath, T = 0.7,
asynchronous GRPO, tail-aware rollouts), `--steps` GRPO steps each, same seed and prompts:

- `plain`: plain decoding, tail-aware (`rollout.mode='plain'`, `rollout.compact=True`);
- `spec`: the frozen pre-RL MTP, rejection sampling, γ from the draft table derived from the
  measured costs and the running acceptance (`rollout.compact=True`).

A setting is `PROMPTSxGROUP:BUDGET` (rows per step = PROMPTS x GROUP; BUDGET =
`rollout.max_new_tokens`). Per arm: RL time without step 1 (it compiles) and its split
(rollout, learner, reward, wait), tokens sampled, accept length; per setting: the end-to-end
speedup (plain RL time / speculative RL time), the rollout speedup, the plain step's rollout
share, and the bound Amdahl's law puts on the end-to-end figure from those two
(1 / (1 - share + share / rollout speedup); for a serial step -- an asynchronous one overlaps
the rollout with the learner, and the learner's wait says how far it is bound by rollouts).
The two arms sample different answers (the same distribution, other random draws), so their
token counts differ (`token_ratio_spec_over_plain`); the ratios are of times, not of seconds
per token: a rollout's time follows its longest answer (the loop runs until the last row ends)
and the learner's step is fixed-shape, so neither scales with the tokens sampled (over the
steps of the 8-row arms, rollout seconds against tokens sampled correlate at -0.01 and 0.02).
Also per setting, from the plain arm: rollout seconds and learner seconds per sampled token --
what sampling costs against what learning from it costs: speculation can only shrink the first.

    python -m experiments.spec_regime.run --base runs/mtp_smollm2 \
        --settings 1x8:96 4x8:96 1x4:96 --steps 12

Arms land in `OUT/<setting>/<arm>/` (`--out`, default `runs/exp_spec_regime`); a finished arm
is reused and results are written after each arm (`results.json` next to this file), so the
study can run in parts. Run it on an otherwise idle machine: the arms' wall times are compared.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np

from experiments import arms, common

HERE = Path(__file__).resolve().parent
CONFIG = "configs/rl_smollm2.py"
ARMS = (
    arms.Arm("plain", "plain, tail-aware", ("rollout.mode='plain'",), False),
    arms.Arm("spec", "frozen MTP, RS, tail-aware, derived draft table"),
)
# every arm: async tail-aware GRPO, no evaluation during RL, no end-of-RL speed comparison
EXTRA = ("rollout.compact=True", "rl.eval_every=0", "rl.eval_samples=16", "rl.speedup_repeats=0")
SETTING = re.compile(r"^(\d+)x(\d+):(\d+)$")


def parse_setting(text: str) -> tuple[int, int, int]:
    """(prompts per step, group size, response budget) of `PROMPTSxGROUP:BUDGET`."""
    m = SETTING.match(text)
    if not m:
        raise SystemExit(f"--settings {text!r}: expected PROMPTSxGROUP:BUDGET, e.g. 1x8:96")
    prompts, group, budget = (int(g) for g in m.groups())
    if min(prompts, group, budget) < 1 or group < 2:
        raise SystemExit(f"--settings {text!r}: prompts and budget >= 1, group >= 2 (GRPO)")
    return prompts, group, budget


def overrides(prompts: int, group: int, budget: int, steps: int) -> tuple[str, ...]:
    rows = prompts * group
    return (
        *EXTRA,
        f"rl.steps={steps}",
        f"rl.prompts_per_step={prompts}",
        f"rl.group_size={group}",
        f"rl.microbatch={min(rows, 8)}",  # the RL config's 8-row chunks (fewer rows: all)
        f"rollout.max_new_tokens={budget}",
    )


def arm_figures(res: arms.ArmResult) -> dict:
    """RL time after step 1 and its split, tokens, acceptance."""
    _, dt = common.step_times(res)

    def after_1(key):
        return float(res.series(key)[1][1:].sum())

    tokens = after_1("response_tokens")
    _, accept = res.series("accept_len")
    return {
        "rl_s_after_step_1": float(dt.sum()),
        "step_s_median": float(np.median(dt)),
        "rollout_s": after_1("rollout_s"),
        "train_s": after_1("train_s"),
        "reward_s": after_1("reward_s"),
        "wait_s": after_1("wait_s"),
        "response_tokens": tokens,
        "response_len_mean": float(np.mean(res.series("response_len")[1][1:])),
        "accept_len": float(np.mean(accept[1:])) if accept.size > 1 else None,
        "reward_mean": float(np.mean(res.series("reward_mean")[1])),
        "wall_s": res.wall_s,
    }


def setting_figures(plain: dict, spec: dict) -> dict:
    """The pair's ratios, Amdahl's bound and the per-token costs (see the module docstring)."""
    share = plain["rollout_s"] / plain["rl_s_after_step_1"]
    rollout_speedup = plain["rollout_s"] / spec["rollout_s"]
    return {
        "e2e_speedup": plain["rl_s_after_step_1"] / spec["rl_s_after_step_1"],
        "rollout_speedup": rollout_speedup,
        # The two arms sample different answers (the same distribution, other draws): how many
        # tokens the speculative arm sampled against the plain one.
        "token_ratio_spec_over_plain": spec["response_tokens"] / plain["response_tokens"],
        "rollout_share_of_plain_step": share,
        "amdahl_bound": 1.0 / (1.0 - share + share / rollout_speedup),
        "plain_rollout_s_per_sampled_token": plain["rollout_s"] / plain["response_tokens"],
        "learner_s_per_sampled_token": plain["train_s"] / plain["response_tokens"],
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="runs/mtp_smollm2", help="a finished distill + mtp run")
    ap.add_argument("--out", default="runs/exp_spec_regime", help="where the arms' runs land")
    ap.add_argument("--settings", nargs="+", default=["1x8:96", "4x8:96", "1x4:96"])
    ap.add_argument("--steps", type=int, default=12, help="GRPO steps per arm (step 1 not timed)")
    ap.add_argument("--results", default=str(HERE / "results.json"))
    ap.add_argument("--runlocal", action="store_true", help="the configs' :runlocal settings")
    args = ap.parse_args(argv)
    if args.steps < 3:
        raise SystemExit(f"--steps {args.steps}: at least 3 (step 1 compiles and is not timed)")
    local = ":runlocal" if args.runlocal else ""
    base = arms.base_run(Path(args.base), "configs/mtp_smollm2.py" + local, ("distill", "mtp"))
    path = Path(args.results)
    out = json.loads(path.read_text()) if path.exists() else {}
    out.update(study="spec_regime", model="smollm2", base=str(base), steps=args.steps)
    out.setdefault("settings", {})
    t0 = time.perf_counter()
    for text in args.settings:
        prompts, group, budget = parse_setting(text)
        extra = overrides(prompts, group, budget, args.steps)
        root = Path(args.out) / text.replace(":", "_")
        figs = {}
        for arm in ARMS:
            res = arms.run_arm(arm, base, root, CONFIG + local, extra)
            figs[arm.name] = arm_figures(res)
            entry = {"rows": prompts * group, "group": group, "budget": budget, "arms": figs}
            if len(figs) == len(ARMS):
                entry.update(setting_figures(figs["plain"], figs["spec"]))
            out["settings"][text] = entry
            common.write_json(path, out)
        e = out["settings"][text]
        print(
            f"{text:10s} rows {e['rows']:3d}: end to end {e['e2e_speedup']:.2f}x, rollouts "
            f"{e['rollout_speedup']:.2f}x (tokens sampled spec / plain "
            f"{e['token_ratio_spec_over_plain']:.2f}), rollout share "
            f"{e['rollout_share_of_plain_step']:.2f}"
            f" (Amdahl bound {e['amdahl_bound']:.2f}x), accept length "
            f"{figs['spec']['accept_len']:.2f}",
            flush=True,
        )
    out["wall_s"] = time.perf_counter() - t0
    common.write_json(path, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
