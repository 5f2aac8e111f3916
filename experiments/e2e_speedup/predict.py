"""The cost model's prediction of each measured arm of `experiments.e2e_speedup.run`
(`bebop/costs.py`).

    python -m experiments.e2e_speedup.predict --base runs/demo --out runs/exp_rl_speed
    python -m experiments.e2e_speedup.predict --model smollm2 --base runs/mtp_smollm2 \\
        --out runs/exp_rl_speed_smollm2

`--out`: the study's output folder (`experiments.e2e_speedup.run --out`), whose arms it reads
(an arm whose run directory is gone: the one kept in `experiments/kept_arms/`, if it ran from
the same base); the prediction goes to the results file (`--results`).

Measured here, on the base run's models, with nothing else running: the per-bucket loop costs,
the learner step and the contention κ (`timing.measure`, whose docstring lists them); for an arm
whose loop differs from the one timed (GrowMTP's, which also records what its head trains on,
with its own head: `loop_variant`), that loop's cycle at each bucket it runs, timed beside the
measured loop in one process (`timing.variant_costs`); the arm's cycle is the measured one times
that ratio (`arm_bucket_costs`). A loop the inputs lack is timed, also with `--measured`, and
kept with them.
Read from each arm's own records (`rl/metrics.jsonl`), step by step from step 2 (step 1 also
compiles): the batch's response lengths (`response_len_hist`), the per-position acceptance
(`accept_rate_k`), the draft table each rollout used (the last `draft_table` recorded before the
step), the reward's seconds and the step's host overhead (step time minus the learner's wait and
update: publish, evaluation, records); and its arm config (`config.json`). Prediction per arm:
`costs.predict_step` summed over steps 2..N, against the measured RL time over the same steps;
`pred_error` = (predicted - measured) / measured, for the RL time and for the rollout time (the
rollouts' own seconds inside the steps, `costs.rollout_in_step`: beside the learner in an
asynchronous arm; `predicted_rollout_alone_s`: as if alone). `--measured FILE` takes the
measured inputs from an earlier prediction's results file instead of timing them again (the
arms of another study predicted from one measurement, e.g. `experiments/growmtp`'s).

Writes the prediction into the study's results file (`results.json`, `results_smollm2.json`):
per arm `measured_s`, `predicted_s`, `pred_error` (and the rollout's), and `prediction` (the
measured inputs). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from bebop import compaction, costs, plots
from bebop import config as config_lib
from bebop.rl import learner
from experiments import arms, common
from experiments.e2e_speedup import timing

HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- per arm


def loop_variant(cfg: config_lib.RunConfig) -> str | None:
    """The speculative loop arm `cfg` ran where it is not the one `loop_costs` times (the base's
    MTP, nothing recorded), by name: an arm whose MTP updates read the rollouts (GrowMTP, an
    online DCA loss: `learner.rollout_records`) runs a loop that also records each verify's
    backbone hiddens and per-cycle accept lengths (`SpecConfig.record`), drafting with the
    arm's own head (its layers, depth, features and draft vocabulary) at γ = `rollout.num_draft`
    under `rollout.mode`. None: the loop `loop_costs` times."""
    if cfg.rollout.mode == "plain" or not learner.rollout_records(cfg.rl)[0]:
        return None
    m, r = cfg.mtp, cfg.rollout
    return (
        f"record, γ {r.num_draft}, {r.mode}, {m.num_layers} layer(s), depth {m.depth}, "
        f"features {tuple(m.features)}, draft vocabulary {m.draft_vocab or 'full'}"
    )


def variant_buckets(cfg: config_lib.RunConfig) -> list[int]:
    """The bucket sizes arm `cfg`'s loop runs at: every bucket when tail-aware, else the batch
    (a recording loop drafts `rollout.num_draft` at each: `config.py` refuses another table)."""
    r, rows = cfg.rollout, cfg.rl.prompts_per_step * cfg.rl.group_size
    return compaction.bucket_sizes(rows, r.min_bucket) if r.compact else [rows]


def missing_buckets(measured: dict, cfg: config_lib.RunConfig) -> list[int]:
    """The buckets of arm `cfg`'s `loop_variant` whose ratio `measured` lacks."""
    name = loop_variant(cfg)
    if name is None:
        return []
    have = (measured.get("variant_costs_s") or {}).get(name, {}).get("buckets", {})
    key = f"cycle_{cfg.rollout.num_draft}"
    return [b for b in variant_buckets(cfg) if key not in have.get(str(b), {})]


def arm_bucket_costs(measured: dict, cfg: config_lib.RunConfig) -> dict:
    """The per-bucket costs of the loop arm `cfg` ran: `measured`'s, where the arm ran a
    `loop_variant` with its cycle at γ = `rollout.num_draft` scaled by the ratio timed beside
    the measured loop (`timing.variant_costs`: timed in one process, the ratio carries over to
    costs measured on another day; the seconds would not)."""
    bucket = {int(b): dict(c) for b, c in measured["bucket_costs_s"].items()}
    name = loop_variant(cfg)
    if name is None:
        return bucket
    missing = missing_buckets(measured, cfg)
    if missing:
        raise ValueError(
            f"the measured costs have no cycle of this arm's loop ({name}) at {missing} rows: "
            "time it (experiments.e2e_speedup.predict times the loops of the arms it predicts)"
        )
    have = measured["variant_costs_s"][name]["buckets"]
    g = cfg.rollout.num_draft
    for b in variant_buckets(cfg):
        bucket[b][f"cycle_{g}"] = bucket[b][f"cycle_{g}"] * have[str(b)]["ratio"]
    return bucket


def with_variants(
    measured: dict, cfgs: list, base: Path, model_name: str, config: str, repeats: int
) -> dict:
    """`measured` with the loops of the arm configs `cfgs` (dicts, as kept) timed where it lacks
    a bucket of them (`variant_costs` on the base's policy, merged into what it has, each timing
    with its date and machine); arms of another batch or token budget than `measured`'s are
    left to `predict_arm`'s refusal."""
    need: dict[str, tuple] = {}
    for c in cfgs:
        cfg = config_lib.from_dict(config_lib.RunConfig, c)
        rows, budget = cfg.rl.prompts_per_step * cfg.rl.group_size, cfg.rollout.max_new_tokens
        if measured.get("batch", rows) != rows or measured.get("budget", budget) != budget:
            continue  # refused by `predict_arm`, naming the difference
        missing = missing_buckets(measured, cfg)
        if missing:
            name = loop_variant(cfg)
            sizes = sorted(set(missing) | set(need.get(name, (cfg, []))[1]), reverse=True)
            need[name] = (cfg, sizes)
    if not need:
        return measured
    s = timing.load(base, model_name, config)
    have = {k: dict(v) for k, v in (measured.get("variant_costs_s") or {}).items()}
    for name, (cfg, sizes) in need.items():
        print(f"timing the loop of {name} at {sizes} rows beside the measured one", flush=True)
        entry = have.setdefault(name, {})
        entry["buckets"] = {
            **entry.get("buckets", {}),
            **timing.variant_costs(s, cfg, sizes, repeats),
        }
        entry["date"] = time.strftime("%Y-%m-%d", time.gmtime())
        entry["machine"] = f"{jax.devices()[0].platform}, {jax.device_count()} device(s)"
    return {**measured, "variant_costs_s": have}


def arm_spec(cfg: config_lib.RunConfig) -> costs.ArmSpec:
    r = cfg.rollout
    spec = r.mode != "plain"
    return costs.ArmSpec(
        speculative=spec,
        compact=r.compact,
        asynchronous=cfg.rl.max_staleness > 0,
        num_draft=r.num_draft if spec else 0,
        draft_table=tuple(map(tuple, r.draft_table)),
        min_bucket=r.min_bucket,
    )


def arm_steps(records: list[dict], spec: costs.ArmSpec, derived: bool, learner_s: float):
    """`costs.predict_run`'s steps 2..N of one arm from its records (module docstring), and the
    measured seconds of the same steps (RL time, rollout time)."""
    table, steps, dt, roll = spec.draft_table, [], [], []
    for i, rec in enumerate(records):
        if i and "time" in records[i - 1]:
            if "response_len_hist" not in rec:
                raise KeyError(
                    f"step {rec['step']}: no 'response_len_hist' (records from before the "
                    "cost model): rerun the arm"
                )
            hist = np.asarray(rec["response_len_hist"])
            step_dt = rec["time"] - records[i - 1]["time"]
            learn = rec.get("train_s", 0.0) + rec.get("mtp_train_s", 0.0)
            s = {
                "lengths": np.repeat(np.arange(hist.size), hist),
                "learner_s": learner_s + rec.get("mtp_train_s", 0.0),
                "reward_s": rec.get("reward_s", 0.0),
                "overhead_s": max(0.0, step_dt - rec.get("wait_s", 0.0) - learn),
            }
            if spec.speculative:
                s["alpha"] = [
                    rec.get(f"accept_rate_{k}", 0.0) for k in range(1, spec.num_draft + 1)
                ]
                s["draft_table"] = table
            steps.append(s)
            dt.append(step_dt)
            roll.append(rec["rollout_s"])
        if derived and "draft_table" in rec:  # derived after this rollout: the next one's
            table = tuple(map(tuple, rec["draft_table"]))
    return steps, float(np.sum(dt)), float(np.sum(roll))


def same_base(kept: dict, base: Path) -> bool:
    """Whether a kept arm ran from a base identical to `base` (`arms.base_identity`; an arm
    that never drafted with the base's MTP does not depend on it), or from a trained base of the
    config of `base` whose MTP has not trained here (its costs are timed on random weights of
    the same shape, `load`)."""
    have = kept.get("key", {}).get("base") or {}
    here = arms.base_identity(base, have.get("mtp") is not None)
    return have == (dict(here, mtp=have.get("mtp")) if here["mtp"] is None else here)


def kept_of(root: Path, base: Path) -> list[str]:
    """The arms kept for the arm directory `root` that ran from a base identical to `base` (the
    others are named and left out)."""
    names = []
    for path in sorted(common.kept_dir(root).glob("*.json")):
        if same_base(json.loads(path.read_text()), base):
            names.append(path.stem)
        else:
            print(f"{path}: kept from another base than {base}; not predicted", flush=True)
    return names


def arm_run(root: Path, name: str, base: Path) -> tuple[dict, list[dict]]:
    """(config, records) of the finished arm `name`: its run directory in `root`, else the arm
    kept in `common.KEPT` (which must have run from a base identical to `base`)."""
    wd = root / name
    if (wd / "rl" / "summary.json").exists():
        cfg = json.loads((wd / "config.json").read_text())
        return cfg, plots.read_metrics(wd / "rl" / "metrics.jsonl")
    path = common.kept_dir(root) / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"arm {name!r}: no finished run in {root} and none kept in {path}")
    kept = json.loads(path.read_text())
    if not same_base(kept, base):
        raise SystemExit(f"arm {name!r}: {path} ran from another base than {base}")
    return kept["config"], kept["records"]


def predict_arm(cfg: dict, records: list[dict], measured: dict, sims: int) -> dict:
    """The cost model's RL and rollout time of the arm run with config `cfg` (its records from
    step 2 on) from the `measured` inputs, which must be of the arm's batch and token budget."""
    cfg = config_lib.from_dict(config_lib.RunConfig, cfg)
    rows = cfg.rl.prompts_per_step * cfg.rl.group_size
    for what, mine, theirs in (
        ("rows per step", rows, measured.get("batch")),
        ("rollout.max_new_tokens", cfg.rollout.max_new_tokens, measured.get("budget")),
    ):
        if theirs is not None and mine != theirs:
            raise ValueError(
                f"the measured costs are of {what} {theirs}, the arm's config has {mine}: "
                "measure them on this config (experiments.e2e_speedup.predict)"
            )
    spec = arm_spec(cfg)
    derived = spec.speculative and spec.compact and not cfg.rollout.draft_table
    derived = derived and cfg.rl.mtp_strategy != "growmtp"
    steps, measured_s, measured_roll = arm_steps(records, spec, derived, measured["learner_s"])
    bucket = arm_bucket_costs(measured, cfg)
    # the programs of step 1 (excluded) are compiled: its table is the configured one
    compiled = costs.programs(spec, max(bucket))
    p = costs.predict_run(
        steps, bucket, spec, compiled, contention=measured["contention"], sims=sims
    )
    changes = sum("draft_table" in r for r in records[1:])
    return {
        "measured_s": measured_s,
        "predicted_s": p["step_s"],
        "pred_error": (p["step_s"] - measured_s) / measured_s,
        "measured_rollout_s": measured_roll,
        # the rollouts' own seconds inside the steps (`costs.rollout_in_step`), and alone
        "predicted_rollout_s": p["rollout_in_step_s"],
        "rollout_pred_error": (p["rollout_in_step_s"] - measured_roll) / measured_roll,
        "predicted_rollout_alone_s": p["rollout_s"],
        "predicted_compile_s": p["compile_s"],
        "steps": len(steps),
        "arm": dataclasses.asdict(spec),
        "draft_table_changes_after_step_1": changes,
    }


def measured_inputs(path: Path) -> dict:
    """The prediction record (measured inputs, command, date) of the results file `path`."""
    pred = json.loads(path.read_text()).get("prediction") or {}
    if "measured_inputs" not in pred:
        raise SystemExit(
            f"{path}: no prediction with measured inputs in it (experiments.e2e_speedup.predict "
            "writes one into a study's results file)"
        )
    return pred


def print_prediction(predicted: dict) -> None:
    """One line per arm of `predict_arm`'s figures: RL and rollout time, measured and predicted."""
    for n, a in predicted.items():
        print(
            f"{n:24s} RL {a['measured_s']:8.1f} s measured, {a['predicted_s']:8.1f} s predicted "
            f"({a['pred_error']:+.1%}); rollouts {a['measured_rollout_s']:7.1f} s vs "
            f"{a['predicted_rollout_s']:7.1f} s ({a['rollout_pred_error']:+.1%})",
            flush=True,
        )


def measured_by(prediction: dict) -> dict:
    """The command and date that timed a prediction record's measured inputs (an earlier one's
    where the record reused them, `--measured`)."""
    return prediction.get("measured_by") or {k: prediction.get(k) for k in ("command", "date")}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(common.MODELS), default="demo")
    ap.add_argument("--runlocal", action="store_true", help="the models' :runlocal configs")
    ap.add_argument("--base", default=None)
    ap.add_argument("--out", "--workdir", default=None, help="the study's --out (its arms)")
    ap.add_argument("--arms", default="", help="comma-separated (default: every finished arm)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sims", type=int, default=64, help="simulated batches per step")
    ap.add_argument("--results", default=None, help="results file to update")
    ap.add_argument(
        "--measured",
        default=None,
        help="a results file whose prediction's measured inputs to use (no timing here)",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    m = common.MODELS[args.model]
    base = Path(args.base or m.base).absolute()
    root = Path(args.out or m.timed_root).absolute()
    config = m.config + (":runlocal" if args.runlocal else "")
    names = [a for a in args.arms.split(",") if a] or sorted(
        {p.parent.parent.name for p in root.glob("*/rl/summary.json")}
        | set([] if args.runlocal else kept_of(root, base))
    )
    if not names:
        raise SystemExit(f"--out {root}: no finished arm (*/rl/summary.json), none kept")
    t0 = time.perf_counter()
    earlier = measured_inputs(Path(args.measured)) if args.measured else None
    name = "demo" if args.model == "demo" else "smollm2"
    measured = (
        earlier["measured_inputs"] if earlier else timing.measure(base, name, config, args.repeats)
    )
    runs = {n: arm_run(root, n, base) for n in names}
    cfgs = [c for c, _ in runs.values()]
    measured = with_variants(measured, cfgs, base, name, config, args.repeats)
    predicted = {n: predict_arm(c, recs, measured, args.sims) for n, (c, recs) in runs.items()}
    print_prediction(predicted)
    path = Path(args.results) if args.results else common.outputs(args, HERE, root) / m.results
    res = json.loads(path.read_text()) if path.exists() else {}
    res.setdefault("arms", {})
    for n, a in predicted.items():
        res["arms"].setdefault(n, {}).update(
            {k: a[k] for k in ("measured_s", "predicted_s", "pred_error")},
            measured_rollout_s=a["measured_rollout_s"],
            predicted_rollout_s=a["predicted_rollout_s"],
            rollout_pred_error=a["rollout_pred_error"],
        )
    res["prediction"] = {
        "model": "bebop/costs.py (module docstring); inputs: predict.py's docstring",
        "command": " ".join(["python", "-m", "experiments.e2e_speedup.predict", *argv]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "measured_inputs": measured,
        **({"measured_by": measured_by(earlier)} if earlier else {}),
        "arms": predicted,
        "max_abs_pred_error": max(abs(a["pred_error"]) for a in predicted.values()),
        "wall_s": time.perf_counter() - t0,
    }
    common.write_json(path, res)
    print(json.dumps(res["prediction"]))


if __name__ == "__main__":
    main()
