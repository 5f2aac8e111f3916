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
from experiments.draft_features import run as draft_features


def _want(*overrides):
    return mtp_arms.wanted_config(mtp_arms.MODELS["smollm2"], list(overrides), [])


def test_kept_arm_is_reused_only_for_its_config(tmp_path: Path):
    want = _want("mtp.depth=2")
    (tmp_path / "smollm2_d2.json").write_text(json.dumps({"config": want, "heldout": {}}))
    assert mtp_arms.kept_arm(tmp_path, "smollm2", "d2", want) is not None
    assert mtp_arms.kept_arm(tmp_path, "smollm2", "d2", _want("mtp.depth=3")) is None
    assert mtp_arms.kept_arm(tmp_path, "smollm2", "missing", want) is None


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


def _rows(speedups, draft=0.1):
    return [
        {"gamma": g, "speedup": s, "accept_len": 1 + g / 2, "draft_cost": draft, "verify_cost": 1.4}
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
    assert f["draft_cost"] == pytest.approx(0.09) and f["processes"] == 3


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
