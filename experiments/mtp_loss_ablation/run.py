"""Bebop's Table 2 and Fig. 4 on SmolLM2: which MTP training loss gives the best acceptance, and
does CE's acceptance decline during training while TV's holds?

Every arm is the pre-RL recipe of `configs/mtp_smollm2.py` (its distilled data -- the RL task's
own samples at the rollout temperature, with a quarter of mixed chat --, its steps, warm-up,
init, draft vocabulary and seed) with only `mtp.loss` changed, and no early stop (every arm
runs all the steps). The frozen target's hiddens and log-normalisers are cached once with the
distilled data and shared by every arm, so an arm costs only its MTP's own steps.

Measured per arm:
- curves (Fig. 4): the training batches' own per-position α (teacher-forced, analytic; logged
  every `mtp.log_every` steps) and the 16-prompt held-out RS accept length every
  `mtp.eval_every` steps;
- the final MTP on `--eval_prompts` held-out prompts of the task (RS, γ = `mtp.eval_draft`, the
  rollout temperature, the same prompts and keys for every arm): per-position acceptance,
  accept length, and the analytic acceptance Σ min(p, q) of the drafted tokens, with the
  acceptance's difference to CE paired by prompt (mean ± 1 s.e. over prompts).

    python -m experiments.mtp_loss_ablation.run                   # SmolLM2, ~55 min an arm here
    python -m experiments.mtp_loss_ablation.run --model demo      # the demo policy, minutes

Runs live under `OUT/<model>/` (`--out`): `base/` is a run of the recipe (`--base DIR` to use one,
e.g. `runs/mtp_smollm2`; else its stages before `mtp` run there first); its `mtp` stage, when it
has one that ran every step with the e2e TV loss, is that arm. Each other arm `<loss>/`
hard-links the base's distilled data and target cache (the first arm to need the cache computes
it and links it back into the base). An arm is reused once finished (`mtp/summary.json`) and
resumes from its last checkpoint when interrupted; its held-out evaluation is saved as
`<loss>/heldout.json`. A finished arm's figures (held-out evaluation and curves) are also kept
here, in `arms/<model>_<loss>.json` with the arm's config: a later launch whose arm config is the
same uses them instead of training the arm again, so the arms of this study can be trained in
separate launches (run directories do not survive a fresh checkout). Writes
`results_<model>.json` and the curves here. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

# This process evaluates each arm (JAX) before the next arm's training launch starts: on a GPU it
# must not hold three quarters of the memory that launch needs.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from experiments.common import launch, link_tree

HERE = Path(__file__).resolve().parent
LOSSES = ("ce", "kl", "reverse_kl", "tv", "e2e_tv", "e2e_tv_partial")
# Bebop Table 2: RS acceptance gain over CE, in points, over five benchmarks (docs/method.md §7).
PAPER_DELTA = {
    "ce": "0",
    "kl": "≈ +0",
    "reverse_kl": "≤ +1.3",
    "tv": "+1.4 to +5.2",
    "e2e_tv": "+2.3 to +8.0",
    "e2e_tv_partial": "(not in the paper)",
}
MODELS = {
    "smollm2": dict(config="configs/mtp_smollm2.py", stages=("distill", "mtp")),
    "demo": dict(config="configs/demo.py", stages=("sft", "distill", "mtp")),
}


def arm_overrides(spec: dict, loss: str, extra) -> list[str]:
    return [f"stages={spec['stages']!r}", f"mtp.loss={loss!r}", "mtp.patience=0", *extra]


def base_is_arm(spec: dict, base: Path, loss: str, extra) -> bool:
    """The base run's `mtp` stage counts as the `loss` arm when it ran every step (an early stop
    would make it a shorter arm) with the arm's config, early stop aside."""
    from bebop import config as config_lib

    done = base / "mtp" / "summary.json"
    if not done.exists():
        return False
    summary = json.loads(done.read_text())
    if summary["steps_run"] < summary["steps"]:
        return False

    saved = json.loads((base / "config.json").read_text())
    have = arm_config(config_lib.from_dict(config_lib.RunConfig, saved))
    return wanted_config(spec, loss, extra) == have


ARM_KEYS = ("seed", "model", "policy", "task", "rollout", "distill", "mtp")


def arm_config(cfg) -> dict:
    """What makes two runs the same arm: the config's sections that shape the MTP (defaults
    filled in, tuples as JSON lists), early stop aside."""
    from bebop import config as config_lib

    c = json.loads(json.dumps(config_lib.to_dict(cfg)))
    c["mtp"].pop("patience")
    return {k: c[k] for k in ARM_KEYS}


def wanted_config(spec: dict, loss: str, extra) -> dict:
    from bebop import config as config_lib

    return arm_config(config_lib.load(spec["config"], arm_overrides(spec, loss, extra))[0])


CURVE_KEYS = ("alpha_1", "alpha_2", "alpha_3", "eval/rejection/accept_len")


def kept_arm(model: str, loss: str, want: dict) -> dict | None:
    """The figures of a finished arm kept in `arms/` (`keep_arm`) if its config is `want`. They
    stand on whatever number of held-out prompts the arm was evaluated on (its weights are not
    kept, so a larger evaluation means training it again: `--retrain`)."""
    path = HERE / "arms" / f"{model}_{loss}.json"
    if not path.exists():
        return None
    kept = json.loads(path.read_text())
    return kept if kept["config"] == want else None


def keep_arm(model: str, loss: str, want: dict, wd: Path, held: dict) -> dict:
    """Keeps arm `loss`'s figures in `arms/`: its config, held-out evaluation and the metric
    records the curves use (`CURVE_KEYS`)."""
    from bebop import plots

    recs = [
        {"step": r["step"], **{k: r[k] for k in CURVE_KEYS if k in r}}
        for r in plots.read_metrics(wd / "mtp" / "metrics.jsonl")
    ]
    summary = json.loads((wd / "mtp" / "summary.json").read_text())
    kept = {"config": want, "heldout": held, "metrics": recs, "steps": summary["steps"]}
    path = HERE / "arms" / f"{model}_{loss}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(kept) + "\n")
    return kept


def share_target_cache(src: Path, dst: Path) -> None:
    """Hard-links the complete target caches (`target_T*/` with their `meta.json`, written by
    the MTP stage of whichever run needed them first) of distill dir `src` into `dst` where it
    has none, so that the backbone pass (~15 min for SmolLM2 here) runs once per study."""
    for cache in src.glob("target_T*"):
        if (cache / "meta.json").exists() and not (dst / cache.name).exists():
            link_tree(cache, dst / cache.name)


def train_arms(spec, root: Path, base: Path, losses, extra) -> dict[str, Path]:
    """Each arm's run directory, trained (or resumed) where not finished yet (`losses`: the
    arms to train). The arms share the base run's stages before `mtp` (the policy, the distilled
    data and its target cache); those are run first where missing. A base without a finished
    `mtp` stage (e.g. `--config.stages="('distill',)"` of the recipe) is fine: its e2e TV arm,
    if asked for, then trains like any other arm."""
    if not losses:
        return {}
    before = spec["stages"][:-1]
    if not all((base / stage / "summary.json").exists() for stage in before):
        print(f"running the base's {before} stages (the recipe's data) in {base}", flush=True)
        launch(spec["config"], base, [f"stages={before!r}", "mtp.patience=0", *extra])
    dirs = {}
    for loss in losses:
        if base_is_arm(spec, base, loss, extra):
            dirs[loss] = base
            continue
        wd = root / loss
        for stage in before:  # the policy (demo) and the distilled data + cache
            link_tree(base / stage, wd / stage)
        if not (wd / "mtp" / "summary.json").exists():
            share_target_cache(base / "distill", wd / "distill")
            t0 = time.perf_counter()
            launch(spec["config"], wd, arm_overrides(spec, loss, extra))
            print(f"{loss}: trained in {time.perf_counter() - t0:.0f} s", flush=True)
        share_target_cache(wd / "distill", base / "distill")  # for the arms after this one
        dirs[loss] = wd
    return dirs


def heldout(wd: Path, num_prompts: int, batch: int) -> dict:
    """The final MTP of run `wd` on `num_prompts` held-out task prompts (RS): pooled figures and
    per-prompt acceptance (for paired differences). Cached in `wd`'s arm dir as heldout.json."""
    import jax

    from bebop import config as config_lib
    from bebop import policies, prompts, rollout, sampling, sharding, speculative

    cfg = config_lib.from_dict(config_lib.RunConfig, json.loads((wd / "config.json").read_text()))
    mesh = sharding.make_mesh(config_lib.MeshConfig(data=1), jax.devices()[:1])
    policy = policies.load(cfg.policy, cfg.model, wd, mesh)
    pol = (policy.graphdef, policy.params)
    mtp_gd, mtp_params, vocab = policies.load_mtp(cfg.mtp, wd / "mtp" / "ckpt", policy.cfg, mesh)
    ids = prompts.prompt_ids(cfg.task, cfg.seed, policy.tok, num_prompts, "eval", "task")
    toks, lens = sampling.pad_prompts(ids, policy.tok.pad_id)
    scfg = rollout.sampling_config(cfg.rollout, policy.tok)
    spec = speculative.SpecConfig(cfg.mtp.eval_draft, "rejection")
    acc, att, hist, overlap, drafted = [], [], [], [], []
    for i in range(0, len(ids), batch):
        key = jax.random.fold_in(jax.random.key(cfg.seed + 7), i)
        out = speculative.sample_jit(
            *pol,
            mtp_gd,
            mtp_params,
            toks[i : i + batch],
            lens[i : i + batch],
            key,
            scfg,
            spec,
            vocab,
        )
        st = jax.device_get(out.stats)
        acc.append(np.asarray(st.accepts))
        att.append(np.asarray(st.attempts))
        hist.append(np.asarray(st.accept_hist))
        kpos = speculative.draft_positions(st.status)
        overlap.append(float((np.asarray(st.overlap) * (kpos >= 0)).sum()))
        drafted.append(int((kpos >= 0).sum()))
    acc, att, hist = (np.concatenate(x) for x in (acc, att, hist))
    pooled_hist = hist.sum(0)
    res = {
        f"rs_accept_{k + 1}": float(acc[:, k].sum() / max(att[:, k].sum(), 1))
        for k in range(acc.shape[1])
    }
    res.update(
        rs_accept=float(acc.sum() / max(att.sum(), 1)),
        rs_accept_len=float(
            (pooled_hist * np.arange(1, len(pooled_hist) + 1)).sum() / pooled_hist.sum()
        ),
        analytic_alpha=sum(overlap) / max(sum(drafted), 1),
        drafted_tokens=int(att.sum()),
        prompts=len(ids),
        # Prompt i and its key depend on the batch size only; the padded width sets the shapes
        # (a wider set can change a row's floats, so two evaluations agree row for row only
        # where these match).
        eval_batch=batch,
        width=int(toks.shape[1]),
        per_prompt=[acc.sum(1).tolist(), att.sum(1).tolist()],  # accepts, attempts per prompt
        run=str(wd),
        steps_run=json.loads((wd / "mtp" / "summary.json").read_text())["steps_run"],
    )
    return res


def paired_delta(a, b) -> tuple[float, float, int]:
    """Pooled acceptance of arm `a` minus arm `b` (accepted / attempted drafts over the prompts
    both were evaluated on), in points, its standard error paired by prompt (the ratio
    estimator's linearisation, z_i = (acc_i - r att_i) / mean(att) per arm, differenced per
    prompt), and the number of prompts it stands on (those with drafts in both arms). `a`, `b`:
    per-prompt [accepts, attempts] of the held-out prompts in order (prompt i and its sampling
    key are the same in every evaluation of the same batch size, whatever their number:
    `heldout`), so two arms share their common prefix."""
    n = min(len(a[0]), len(b[0]))
    (acc_a, att_a), (acc_b, att_b) = (np.asarray(x, np.float64)[:, :n] for x in (a, b))
    keep = (att_a > 0) & (att_b > 0)
    acc_a, att_a, acc_b, att_b = acc_a[keep], att_a[keep], acc_b[keep], att_b[keep]
    r_a, r_b = acc_a.sum() / att_a.sum(), acc_b.sum() / att_b.sum()
    z = (acc_a - r_a * att_a) / att_a.mean() - (acc_b - r_b * att_b) / att_b.mean()
    return float(100 * (r_a - r_b)), float(100 * z.std(ddof=1) / np.sqrt(len(z))), len(z)


def table(rows: dict) -> str:
    lines = [
        "| loss | prompts | RS acc. step 1 | step 2 | step 3 | RS accept len | analytic α | "
        "Δ RS acc. vs CE (points, ± 1 s.e., on n prompts) | paper Δ |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for loss, r in rows.items():
        d, se, n = r["delta_vs_ce"]
        lines.append(
            f"| {loss} | {r['prompts']} | {r['rs_accept_1']:.3f} | {r['rs_accept_2']:.3f}"
            f" | {r['rs_accept_3']:.3f}"
            f" | {r['rs_accept_len']:.2f} | {r['analytic_alpha']:.3f} | {d:+.1f} ± {se:.1f} ({n}) |"
            f" {PAPER_DELTA[loss]} |"
        )
    return "\n".join(lines)


def plot_curves(recs: dict[str, list], name: str, window: int) -> list[str]:
    """Per-position training α (windowed means) and held-out accept length against the step,
    from each arm's metric records."""
    from bebop import plots

    paths = []
    for k in (1, 2, 3):
        curves = {}
        for loss, r in recs.items():
            x, y = plots.series(r, f"alpha_{k}")
            if len(x):
                edges = np.arange(0, x.max() + window, window)
                idx = np.digitize(x, edges[1:-1])
                keep = np.unique(idx)
                curves[loss] = (edges[keep] + window, np.array([y[idx == i].mean() for i in keep]))
        path = HERE / f"{name}_alpha_{k}.png"
        plots.lines(
            path,
            curves,
            "training step",
            f"training-batch α, draft step {k}",
            f"{name}: MTP losses, draft step {k} (teacher-forced, {window}-step means)",
        )
        paths.append(path.name)
    curves = {loss: plots.series(r, "eval/rejection/accept_len") for loss, r in recs.items()}
    path = HERE / f"{name}_eval_accept_len.png"
    plots.lines(
        path, curves, "training step", "held-out RS accept length (γ = 3)", f"{name}: MTP losses"
    )
    return [*paths, path.name]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(MODELS), default="smollm2")
    ap.add_argument("--out", "--workdir", default="runs/exp_mtp_loss_ablation", help="the runs")
    ap.add_argument("--base", default="", help="a finished recipe run (default OUT/MODEL/base)")
    ap.add_argument("--losses", default=",".join(LOSSES), help="comma-separated; ce first")
    # 768: 1 s.e. of a paired difference 0.48-0.53 points (commit 0111063; 0.88 on 192 prompts).
    ap.add_argument("--eval_prompts", type=int, default=768)
    ap.add_argument(
        "--retrain",
        default="",
        help="comma-separated kept arms not to reuse: evaluated again from their run directory "
        "if it is here, else trained again (e.g. to stand on more prompts)",
    )
    # Prompt i's sampling key depends on the batch it is in: keep this for comparable arms.
    ap.add_argument("--eval_batch", type=int, default=64)
    ap.add_argument("--window", type=int, default=50, help="steps per point of the α curves")
    ap.add_argument(
        "--set", "--override", action="append", default=[], help="config KEY=VALUE (all runs)"
    )
    args = ap.parse_args()
    spec = MODELS[args.model]
    root = Path(args.out).absolute() / args.model
    base = Path(args.base).absolute() if args.base else root / "base"
    losses = args.losses.split(",")
    if losses[0] != "ce" or any(x not in LOSSES for x in losses):
        raise SystemExit(f"--losses: want 'ce' first, then any of {LOSSES}; got {losses}")
    t0 = time.perf_counter()
    want = {loss: wanted_config(spec, loss, args.set) for loss in losses}
    retrain = set(filter(None, args.retrain.split(",")))
    if retrain - set(losses):
        raise SystemExit(f"--retrain: {sorted(retrain - set(losses))} not in --losses {losses}")
    kept = {loss: kept_arm(args.model, loss, want[loss]) for loss in losses if loss not in retrain}
    kept = {loss: k for loss, k in kept.items() if k is not None}
    todo = [loss for loss in losses if loss not in kept]
    if kept:
        print(f"arms kept in {HERE / 'arms'} (same config): {sorted(kept)}", flush=True)
    for loss in todo:  # each arm evaluated and kept as soon as it is trained
        wd = train_arms(spec, root, base, [loss], args.set)[loss]
        cache = (root / loss) / "heldout.json"
        steps_run = json.loads((wd / "mtp" / "summary.json").read_text())["steps_run"]
        saved = json.loads(cache.read_text()) if cache.exists() else {}
        same = tuple(saved.get(k) for k in ("prompts", "eval_batch", "run", "steps_run"))
        if same != (args.eval_prompts, args.eval_batch, str(wd), steps_run):  # not evaluated yet
            saved = heldout(wd, args.eval_prompts, args.eval_batch)
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(saved))
        kept[loss] = keep_arm(args.model, loss, want[loss], wd, saved)
    rows = {loss: kept[loss]["heldout"] for loss in losses}
    if rows["ce"]["prompts"] < args.eval_prompts:
        print(
            f"note: CE was evaluated on {rows['ce']['prompts']} prompts, so every Δ stands on at "
            f"most those (--retrain ce evaluates it on {args.eval_prompts})",
            flush=True,
        )
    for loss, r in rows.items():
        print(f"{loss}: held-out RS accept length {r['rs_accept_len']:.3f}", flush=True)
        r["delta_vs_ce"] = paired_delta(r["per_prompt"], rows["ce"]["per_prompt"])
    print(table(rows), flush=True)
    figures = plot_curves({loss: kept[loss]["metrics"] for loss in losses}, args.model, args.window)
    out = {
        "model": args.model,
        "steps": kept["ce"]["steps"],
        "eval_prompts": args.eval_prompts,
        "wall_s": time.perf_counter() - t0,
        "figures": figures,
        "rows": {k: {kk: v for kk, v in r.items() if kk != "per_prompt"} for k, r in rows.items()},
    }
    (HERE / f"results_{args.model}.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
