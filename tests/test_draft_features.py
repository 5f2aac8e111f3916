"""The MTP-arm studies' bookkeeping (experiments/mtp_arms, experiments/draft_features): a kept
arm is reused only for the same config (a key added to the config since counts at its default),
the speed figures are medians over processes with the best γ, a benchmark reads an MTP's
structure from the run that trained it, and bad `--arms` name the flag."""

import json
from pathlib import Path

import pytest

from bebop import config as config_lib
from benchmarks.common import trained_mtp_config
from experiments import mtp_arms
from experiments.draft_features import loop_costs
from experiments.draft_features import run as draft_features


def _want(*overrides):
    return mtp_arms.wanted_config(mtp_arms.MODELS["smollm2"], list(overrides), [])


def test_kept_arm_is_reused_only_for_its_config(tmp_path: Path):
    want = _want("mtp.depth=2")
    (tmp_path / "smollm2_d2.json").write_text(json.dumps({"config": want, "heldout": {}}))
    assert mtp_arms.kept_arm(tmp_path, "smollm2", "d2", want) is not None
    assert mtp_arms.kept_arm(tmp_path, "smollm2", "d2", _want("mtp.depth=3")) is None
    assert mtp_arms.kept_arm(tmp_path, "smollm2", "missing", want) is None


def test_study_figures_cover_every_kept_arm_in_arms_order(tmp_path: Path):
    this_launch = {"last_d1": {"config": _want(), "heldout": "ran now"}}
    for name, config in [
        ("last_d2", _want("mtp.depth=2")),
        ("layers3_d1", _want("mtp.features=(2, 15, 29)")),
        ("layers3_d2", _want("mtp.depth=3")),  # another arm's config under this name: left out
    ]:
        kept = {"config": config, "heldout": f"kept {name}"}
        (tmp_path / f"smollm2_{name}.json").write_text(json.dumps(kept))
    (tmp_path / "smollm2_last_d1.json").write_text(json.dumps({"config": _want(), "heldout": 0}))
    out = draft_features.with_kept_arms(this_launch, tmp_path, [])
    assert list(out) == ["last_d1", "layers3_d1", "last_d2"]
    assert out["last_d1"]["heldout"] == "ran now"  # this launch's figures win over a kept file
    assert out["last_d2"]["heldout"] == "kept last_d2"
    # arms kept for the recipe without an override are not those of a recipe with one
    assert draft_features.with_kept_arms({}, tmp_path, ["mtp.steps=2000"]) == {}


def test_a_key_added_since_counts_at_its_default():
    want = _want()
    older = json.loads(json.dumps(want))
    del older["mtp"]["features"], older["mtp"]["depth"]  # kept before those keys existed
    assert mtp_arms.same_arm(older, want)
    # ...but not when the arm asks for another value than the default
    assert not mtp_arms.same_arm(older, _want("mtp.depth=2"))
    assert not mtp_arms.same_arm(older, _want("mtp.features=(2, 15, 29)"))
    older["mtp"]["loss"] = "ce" if want["mtp"]["loss"] != "ce" else "tv"
    assert not mtp_arms.same_arm(older, want)


def _rows(speedups, draft):
    """One benchmark process's rows: per γ its speedup, and a draft cost of `draft` x γ (so a
    figure read at the wrong γ shows)."""
    return [
        {
            "gamma": g,
            "speedup": s,
            "accept_len": 1 + g / 2,
            "draft_cost": draft * g,
            "verify_cost": 1 + g / 10,
        }
        for g, s in zip(draft_features.GAMMAS, speedups, strict=True)
    ]


def test_speed_figures_are_medians_over_processes_at_the_best_gamma():
    runs = [
        _rows([1.2, 1.5, 1.4, 1.1], draft=0.08),
        _rows([1.3, 1.1, 1.6, 1.0], draft=0.09),
        _rows([1.1, 1.7, 1.5, 1.2], draft=0.30),
    ]
    f = draft_features.speed_figures(runs)
    # medians per γ: 1.2, 1.5, 1.5, 1.1 -> γ = 2 is the first best
    assert f["per_gamma"]["3"]["speedup"] == pytest.approx(1.5)
    assert f["best_gamma"] == 2 and f["speedup_b1"] == pytest.approx(1.5)
    # the draft cost at γ = 2: the median of 0.16, 0.18, 0.60
    assert f["draft_cost"] == pytest.approx(0.18) and f["processes"] == 3
    assert f["per_gamma"]["4"]["verify_cost"] == pytest.approx(1.4)
    assert f["per_gamma"]["1"]["accept_len"] == pytest.approx(1.5)


def test_table_rows_say_how_many_prompts_and_processes_each_figure_stands_on():
    def kept(prompts, speed=None):
        held = {
            f"t{t}": {"rs_accept_len": 2.0 + t, "rs_accept": 0.5, "prompts": prompts}
            for t in draft_features.TEMPERATURES
        }
        return {"heldout": held, **({"speed": speed} if speed else {})}

    speed = draft_features.speed_figures([_rows([1.2, 1.5, 1.4, 1.1], draft=0.08)])
    rows = {
        "last_d1": draft_features.arm_figures(kept(768, speed)),
        "last_d2": draft_features.arm_figures(kept(64)),  # a smaller evaluation, never timed
    }
    assert rows["last_d2"]["eval_prompts"] == 64
    lines = draft_features.table(rows, {"last_d1": (0, 0, 768), "last_d2": (1.5, 0.5, 64)})
    assert lines.splitlines()[2].split(" | ")[1:3] == ["768", "2.70"]
    # the verify's cost where the speedup was read (γ = 2: 1 + 2/10), the host's bound on it
    assert "1.50x (γ=2, 1; verify 1.20)" in lines.splitlines()[2]
    assert lines.splitlines()[3].split(" | ")[1] == "64"
    assert "+1.5 ± 0.5 (64)" in lines.splitlines()[3] and lines.count("—") == 2


def test_loop_costs_are_paired_per_round():
    """A machine twice as slow in one round moves no figure: each cycle is divided by the step
    timed before it and by the reference arm's cycle of that round; the cost model's cycle is
    a (γ+1)-token verify and γ of the arm's own draft steps, in 1-token verifies."""

    def round_(scale, mine):
        costs = {"verify_1": 0.01, "verify_4": 0.014, "draft": {"last_d1": 0.001, "d2": 0.002}}
        return {
            "step_s": {3: 0.008 * scale},  # a sampler's step: not the 1-token verify loop
            "cycle_s": {"last_d1": {3: 0.016 * scale}, "d2": {3: mine * scale}},
            "costs_s": {
                k: ({a: x * scale for a, x in v.items()} if isinstance(v, dict) else v * scale)
                for k, v in costs.items()
            },
        }

    rounds = [round_(1, 0.020), round_(2, 0.020), round_(1, 0.027)]
    f = loop_costs.cost_figures(rounds)
    assert f["d2"]["3"]["cycle_cost"] == pytest.approx(2.5)  # of 2.5, 2.5, 3.4
    assert f["d2"]["3"]["vs_last_d1"] == pytest.approx(1.25)  # of 1.25, 1.25, 1.69
    assert f["d2"]["3"]["model_cost"] == pytest.approx(1.4 + 3 * 0.2)
    assert f["last_d1"]["3"] == pytest.approx(
        {"cycle_cost": 2.0, "vs_last_d1": 1.0, "model_cost": 1.4 + 3 * 0.1}
    )
    with pytest.raises(SystemExit, match="--arms"):
        loop_costs.main(["--arms", "layers3_d1"])
    with pytest.raises(SystemExit, match="--trained"):
        loop_costs.main(["--trained", "last_d2=/nonexistent"])


def test_benchmark_reads_the_mtp_structure_of_its_run(tmp_path: Path):
    cfg, _ = config_lib.load("configs/mtp_smollm2.py", ["mtp.depth=2", "mtp.features=(2, 15, 29)"])
    (tmp_path / "config.json").write_text(json.dumps(config_lib.to_dict(cfg)))
    fallback = config_lib.MTPConfig()
    got = trained_mtp_config(tmp_path / "mtp" / "ckpt", fallback)
    assert got.depth == 2 and tuple(got.features) == (2, 15, 29)
    assert trained_mtp_config(tmp_path / "other" / "mtp" / "ckpt", fallback) is fallback


def test_bad_arms_name_the_flag():
    with pytest.raises(SystemExit, match="--arms"):
        draft_features.main(["--arms", "layers3_d1"])  # last_d1 (the reference) first
    with pytest.raises(SystemExit, match="--arms"):
        draft_features.main(["--arms", "last_d1,deep"])


def test_decode_benchmark_restores_an_mtp_with_its_runs_structure(tmp_path: Path, tiny_cfg):
    """`benchmarks.decode --mtp_ckpt`: a depth-2 MTP fed by two layers restores with the
    structure its run's config.json names (a default one-layer MTP would not match)."""
    import types

    import jax
    import numpy as np

    from bebop import mtp as mtp_lib
    from bebop.ckpt import Checkpointer
    from bebop.config import MeshConfig, RunConfig
    from bebop.sharding import make_mesh
    from benchmarks import decode

    mtp_cfg = config_lib.MTPConfig(features=(0, 1), depth=2)
    _, params = mtp_lib.init(tiny_cfg, 1, 3, mtp_cfg.features, mtp_cfg.depth)
    ckpt = Checkpointer(tmp_path / "mtp" / "ckpt", async_save=False)
    ckpt.save(1, {"params": params, "step": 1}, {})
    ckpt.close()
    run = RunConfig(model=tiny_cfg, mtp=mtp_cfg)
    (tmp_path / "config.json").write_text(json.dumps(config_lib.to_dict(run)))
    loaded = types.SimpleNamespace(cfg=tiny_cfg)
    mesh = make_mesh(MeshConfig(data=1), jax.devices()[:1])
    (_, got), vocab = decode.load_mtp(tmp_path / "mtp" / "ckpt", loaded, mesh)
    want, have = jax.tree.leaves(params), jax.tree.leaves(got)
    assert len(want) == len(have) and vocab is None
    for w, h in zip(want, have, strict=True):
        np.testing.assert_array_equal(np.asarray(w), np.asarray(h))


def test_gamma_sweep_sets_each_accept_length_beside_the_geometric_prediction():
    from experiments.draft_features import gamma_sweep

    assert gamma_sweep.geometric_accept_len(0.5, 2) == pytest.approx(1.75)  # 1 + 1/2 + 1/4

    def ev(g, alpha, length):
        return {
            "rs_accept": alpha,
            "rs_accept_len": length,
            **{f"rs_accept_{k}": alpha - 0.01 * k for k in range(1, g + 1)},
        }

    f = gamma_sweep.sweep_figures({3: ev(3, 0.6, 2.1), 5: ev(5, 0.55, 2.3), 8: ev(8, 0.5, 2.2)}, 3)
    # predictions from γ = 3's pooled 0.6, not from each γ's own acceptance
    assert f["per_gamma"]["5"]["predicted_accept_len"] == pytest.approx((1 - 0.6**6) / 0.4)
    assert f["ceiling"] == pytest.approx(2.5) and f["ref_alpha"] == 0.6
    assert f["best_gamma"] == 5 and f["best_accept_len"] == 2.3  # the measured best, not the last
    assert f["per_gamma"]["8"]["rs_accept_by_position"][-1] == pytest.approx(0.42)
    with pytest.raises(ValueError, match="γ = 4"):
        gamma_sweep.sweep_figures({3: ev(3, 0.6, 2.1)}, 4)


def test_gamma_sweep_reuses_its_own_evaluations_and_refuses_another_setups_file(
    tmp_path, monkeypatch, capsys
):
    import hashlib
    import sys

    from experiments.draft_features import gamma_sweep

    run = tmp_path / "run"
    (run / "mtp").mkdir(parents=True)
    (run / "mtp" / "summary.json").write_text('{"steps_run": 2100, "final_loss": 0.61}')
    monkeypatch.setattr(gamma_sweep, "HERE", tmp_path)
    calls = []

    def heldout(wd, prompts, batch, t, gamma):  # acceptance 0.6, whatever γ
        calls.append((t, gamma))
        by_pos = {f"rs_accept_{k}": 0.6 for k in range(1, gamma + 1)}
        return {"rs_accept": 0.6, "rs_accept_len": 1.5 + 0.1 * gamma, **by_pos}

    monkeypatch.setattr(gamma_sweep.mtp_arms, "heldout", heldout)
    argv = ["gamma_sweep", "--run", str(run), "--name", "a", "--gammas", "3,5"]
    monkeypatch.setattr(sys, "argv", [*argv, "--temperatures", "0.7", "--prompts", "8"])
    gamma_sweep.main()
    assert calls == [(0.7, 3), (0.7, 5)]
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["figures"]["t0.7"]["best_gamma"] == 5 and last["prompts"] == 8
    digest = hashlib.sha256((run / "mtp" / "summary.json").read_bytes()).hexdigest()[:16]
    assert last["mtp_summary_sha256"] == digest

    # again with one more temperature: only its evaluations run
    monkeypatch.setattr(sys, "argv", [*argv, "--temperatures", "0.7,1.0", "--prompts", "8"])
    gamma_sweep.main()
    assert calls[2:] == [(1.0, 3), (1.0, 5)]

    # another prompt count, or a retrained head, would overwrite the file: refused, file kept
    before = (tmp_path / "gamma_sweep_a.json").read_text()
    monkeypatch.setattr(sys, "argv", [*argv, "--temperatures", "0.7", "--prompts", "16"])
    with pytest.raises(SystemExit):
        gamma_sweep.main()
    assert "prompts differ" in capsys.readouterr().err
    (run / "mtp" / "summary.json").write_text('{"steps_run": 2100, "final_loss": 0.55}')
    monkeypatch.setattr(sys, "argv", [*argv, "--temperatures", "0.7", "--prompts", "8"])
    with pytest.raises(SystemExit):
        gamma_sweep.main()
    assert "mtp_summary_sha256 differ" in capsys.readouterr().err
    assert (tmp_path / "gamma_sweep_a.json").read_text() == before and len(calls) == 4


def test_a_held_out_cache_is_reused_for_its_setup_and_a_damaged_one_computed_again(
    tmp_path: Path, monkeypatch
):
    """`mtp_arms.cached_heldout` returns the saved evaluation while the prompts, batch, run and
    trained steps match, evaluates again when they do not, and treats a damaged cache file (cut
    off, empty) as no cache instead of stopping the study."""
    wd, cache = tmp_path / "run", tmp_path / "cache" / "heldout.json"
    (wd / "mtp").mkdir(parents=True)
    (wd / "mtp" / "summary.json").write_text(json.dumps({"steps_run": 2100}))
    calls = []

    def heldout(run, prompts, batch, temperature=None):
        calls.append(prompts)
        return {"prompts": prompts, "eval_batch": batch, "run": str(run), "steps_run": 2100}

    monkeypatch.setattr(mtp_arms, "heldout", heldout)
    first = mtp_arms.cached_heldout(wd, cache, 768, 64)
    assert mtp_arms.cached_heldout(wd, cache, 768, 64) == first and calls == [768]
    mtp_arms.cached_heldout(wd, cache, 192, 64)  # another setup: evaluated
    assert calls == [768, 192]
    cache.write_text(cache.read_text()[:10])  # cut off
    assert mtp_arms.cached_heldout(wd, cache, 192, 64)["prompts"] == 192 and len(calls) == 3
    assert json.loads(cache.read_text())["prompts"] == 192  # written whole again
