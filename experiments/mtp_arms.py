"""Studies whose arms are MTP trainings of one recipe that differ in a few config keys
(`experiments.mtp_loss_ablation`: `mtp.loss`; `experiments.draft_features`: `mtp.features`,
`mtp.depth`): training an arm on the base run's distilled data and target cache, keeping a
finished arm's figures in the repository, and the held-out evaluation of its final MTP.

An arm is a name and its config overrides. Every arm runs the recipe (`MODELS[model]['config']`)
with those overrides and no early stop (`mtp.patience=0`: every arm runs all the steps). It
lives in `ROOT/<name>/`, which hard-links the base run's stages before `mtp` (the policy and the
distilled data) and the frozen target's cache (hiddens, log-normalisers, and the chosen layers'
features: computed by the first arm that needs them and linked back into the base), so an arm
costs only its MTP's own steps. An arm is reused once finished (`mtp/summary.json`) and resumes
from its last checkpoint when interrupted. The base run itself is the arm whose config it ran
with, when its `mtp` stage ran every step.

Kept arms: a finished arm's figures (held-out evaluations and the curves' metric records) are
written to the study's `arms/<model>_<name>.json` with the arm's config; a later launch whose arm
config is the same uses them instead of training the arm again, so a study's arms can be trained
in separate launches (run directories do not survive a fresh checkout).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from bebop.io import DamagedFileError, read_json, write_json_atomic
from experiments.arms import launch, link_tree

MODELS = {
    "smollm2": dict(config="configs/mtp_smollm2.py", stages=("distill", "mtp")),
    "demo": dict(config="configs/demo.py", stages=("sft", "distill", "mtp")),
}
ARM_KEYS = ("seed", "model", "policy", "task", "rollout", "distill", "mtp")
CURVE_KEYS = ("alpha_1", "alpha_2", "alpha_3", "eval/rejection/accept_len")


def arm_overrides(spec: dict, overrides, extra) -> list[str]:
    """The launch overrides of an arm: the MTP stage alone (after the base's stages), the arm's
    own keys, no early stop, then the study's `extra`."""
    return [f"stages={spec['stages']!r}", *overrides, "mtp.patience=0", *extra]


def arm_config(cfg) -> dict:
    """What makes two runs the same arm: the config's sections that shape the MTP (defaults
    filled in, tuples as JSON lists), early stop aside."""
    from bebop import config as config_lib

    c = json.loads(json.dumps(config_lib.to_dict(cfg)))
    c["mtp"].pop("patience")
    return {k: c[k] for k in ARM_KEYS}


def wanted_config(spec: dict, overrides, extra) -> dict:
    from bebop import config as config_lib

    return arm_config(config_lib.load(spec["config"], arm_overrides(spec, overrides, extra))[0])


def base_is_arm(base: Path, want: dict) -> bool:
    """The base run's `mtp` stage counts as the arm whose config is `want` when it ran every step
    (an early stop would make it a shorter arm) with that config, early stop aside."""
    from bebop import config as config_lib

    done = base / "mtp" / "summary.json"
    if not done.exists():
        return False
    summary = json.loads(done.read_text())
    if summary["steps_run"] < summary["steps"]:
        return False
    saved = json.loads((base / "config.json").read_text())
    return arm_config(config_lib.from_dict(config_lib.RunConfig, saved)) == want


def kept_arm(arms_dir: Path, model: str, name: str, want: dict) -> dict | None:
    """The figures of a finished arm kept in `arms_dir` (`keep_arm`) if its config is `want`.
    They stand on whatever number of held-out prompts the arm was evaluated on (its weights are
    not kept, so a larger evaluation means training it again)."""
    path = arms_dir / f"{model}_{name}.json"
    if not path.exists():
        return None
    kept = json.loads(path.read_text())
    return kept if same_arm(kept["config"], want) else None


def same_arm(kept: dict, want: dict) -> bool:
    """Whether a kept arm's config is `want`. A key the kept config lacks (it was added to the
    config after the arm was kept) counts as equal when `want` has its default value."""
    from bebop import config as config_lib

    default = json.loads(json.dumps(config_lib.to_dict(config_lib.RunConfig())))
    for section, value in want.items():
        have = kept.get(section)
        if not isinstance(value, dict):
            if have != value:
                return False
            continue
        if have is None:
            return False
        for key, v in value.items():
            if have.get(key, default[section].get(key)) != v:
                return False
    return True


def keep_arm(arms_dir: Path, model: str, name: str, want: dict, wd: Path, held: dict) -> dict:
    """Keeps arm `name`'s figures in `arms_dir`: its config, held-out evaluation(s) and the metric
    records the curves use (`CURVE_KEYS`)."""
    from bebop import plots

    recs = [
        {"step": r["step"], **{k: r[k] for k in CURVE_KEYS if k in r}}
        for r in plots.read_metrics(wd / "mtp" / "metrics.jsonl")
    ]
    summary = json.loads((wd / "mtp" / "summary.json").read_text())
    kept = {"config": want, "heldout": held, "metrics": recs, "steps": summary["steps"]}
    path = arms_dir / f"{model}_{name}.json"
    path.parent.mkdir(exist_ok=True)
    write_json_atomic(path, kept, indent=None)
    return kept


def share_target_cache(src: Path, dst: Path) -> None:
    """Hard-links the complete target caches (`target_T*/` with their `meta.json`, written by
    the MTP stage of whichever run needed them first) of distill dir `src` into `dst` where it
    has none, so that the backbone pass (~15 min for SmolLM2 here) runs once per study and
    feature set."""
    for cache in src.glob("target_T*"):
        if (cache / "meta.json").exists() and not (dst / cache.name).exists():
            link_tree(cache, dst / cache.name)


def ensure_base(spec: dict, base: Path, extra) -> None:
    """Runs the base's stages before `mtp` (the policy, the recipe's distilled data) where
    missing. A base without a finished `mtp` stage is fine: each arm trains its own."""
    before = spec["stages"][:-1]
    if not all((base / stage / "summary.json").exists() for stage in before):
        print(f"running the base's {before} stages (the recipe's data) in {base}", flush=True)
        launch(spec["config"], base, [f"stages={before!r}", "mtp.patience=0", *extra])


def train_arm(spec: dict, root: Path, base: Path, name: str, overrides, extra) -> Path:
    """Arm `name`'s run directory (`root/name`, or the base run if it is that arm), trained or
    resumed where not finished yet."""
    ensure_base(spec, base, extra)
    if base_is_arm(base, wanted_config(spec, overrides, extra)):
        return base
    wd = root / name
    for stage in spec["stages"][:-1]:  # the policy (demo) and the distilled data + cache
        link_tree(base / stage, wd / stage)
    if not (wd / "mtp" / "summary.json").exists():
        share_target_cache(base / "distill", wd / "distill")
        t0 = time.perf_counter()
        launch(spec["config"], wd, arm_overrides(spec, overrides, extra))
        print(f"{name}: trained in {time.perf_counter() - t0:.0f} s", flush=True)
    share_target_cache(wd / "distill", base / "distill")  # for the arms after this one
    return wd


def heldout(
    wd: Path,
    num_prompts: int,
    batch: int,
    temperature: float | None = None,
    gamma: int | None = None,
) -> dict:
    """The final MTP of run `wd` on `num_prompts` held-out task prompts (RS, γ = `gamma`,
    default `mtp.eval_draft`, at `temperature`, default the run's rollout temperature): pooled
    figures and per-prompt acceptance (for paired differences)."""
    import jax

    from bebop import config as config_lib
    from bebop import policies, prompts, rollout, sampling, sharding, speculative

    cfg = config_lib.from_dict(config_lib.RunConfig, json.loads((wd / "config.json").read_text()))
    if temperature is not None:
        cfg = dataclasses.replace(
            cfg, rollout=dataclasses.replace(cfg.rollout, temperature=temperature)
        )
    mesh = sharding.make_mesh(config_lib.MeshConfig(data=1), jax.devices()[:1])
    policy = policies.load(cfg.policy, cfg.model, wd, mesh)
    pol = (policy.graphdef, policy.params)
    mtp_gd, mtp_params, vocab = policies.load_mtp(cfg.mtp, wd / "mtp" / "ckpt", policy.cfg, mesh)
    ids = prompts.prompt_ids(cfg.task, cfg.seed, policy.tok, num_prompts, "eval", "task")
    toks, lens = sampling.pad_prompts(ids, policy.tok.pad_id)
    scfg = rollout.sampling_config(cfg.rollout, policy.tok)
    spec = speculative.SpecConfig(cfg.mtp.eval_draft if gamma is None else gamma, "rejection")
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
        temperature=cfg.rollout.temperature,
        gamma=spec.num_draft,
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


def cached_heldout(
    wd: Path, cache: Path, num_prompts: int, batch: int, temperature: float | None = None
) -> dict:
    """`heldout`, saved as `cache` and reused while its prompts, batch, run, steps and
    temperature are the same."""
    steps_run = json.loads((wd / "mtp" / "summary.json").read_text())["steps_run"]
    try:
        saved = read_json(cache) if cache.exists() else {}
    except DamagedFileError:  # a cache: computed again
        saved = {}
    keys = ("prompts", "eval_batch", "run", "steps_run")
    same = tuple(saved.get(k) for k in keys) == (num_prompts, batch, str(wd), steps_run)
    if same and (temperature is None or saved.get("temperature") == temperature):
        return saved
    saved = heldout(wd, num_prompts, batch, temperature)
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(cache, saved, indent=None)
    return saved


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
