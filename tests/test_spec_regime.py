"""The regime study's arithmetic (experiments/spec_regime): settings parse or fail naming the
flag; Amdahl's bound and the end-to-end ratio on hand-made arm figures."""

import pytest

from experiments.spec_regime.run import parse_setting, setting_figures


def test_settings_parse_and_bad_ones_name_the_flag():
    assert parse_setting("4x8:96") == (4, 8, 96)
    for bad in ("4x8", "4*8:96", "1x1:96", "0x8:96"):
        with pytest.raises(SystemExit, match="--settings"):
            parse_setting(bad)


def _arm(rl_s, rollout_s, train_s, tokens):
    return dict(
        rl_s_after_step_1=rl_s, rollout_s=rollout_s, train_s=train_s, response_tokens=tokens
    )


def test_amdahl_bound_and_ratios_on_hand_made_arms():
    # plain: 100 s of which 40 s rollouts; speculative rollouts take 20 s (2x), RL 85 s
    plain, spec = _arm(100.0, 40.0, 55.0, 1000), _arm(85.0, 20.0, 60.0, 1000)
    f = setting_figures(plain, spec)
    assert f["rollout_speedup"] == pytest.approx(2.0)
    assert f["rollout_share_of_plain_step"] == pytest.approx(0.4)
    assert f["amdahl_bound"] == pytest.approx(1 / (0.6 + 0.2))  # 1.25x at most
    assert f["e2e_speedup"] == pytest.approx(100 / 85)
    assert f["learner_s_per_sampled_token"] == pytest.approx(0.055)
    # the speculative arm sampled a quarter fewer tokens: said beside the ratios of times
    g = setting_figures(plain, _arm(85.0, 20.0, 60.0, 750))
    assert g["e2e_speedup"] == pytest.approx(100 / 85)
    assert g["token_ratio_spec_over_plain"] == pytest.approx(0.75)
    # rollouts that are not faster bound the end to end at 1
    assert setting_figures(plain, _arm(100.0, 40.0, 55.0, 1000))["amdahl_bound"] == 1.0


def test_a_finished_arm_is_reused_only_for_the_same_launch(tmp_path, monkeypatch):
    """experiments.arms.run_arm: a finished arm of another base (or setting) runs again; the
    same launch is reused; a run recorded before launches were is reused as it is. (`launch`,
    the subprocess, is replaced by one that writes a finished RL stage.)"""
    import json

    from experiments import arms

    launches = []

    def fake_launch(config, wd, overrides):
        launches.append(list(overrides))
        (wd / "rl").mkdir(parents=True)
        (wd / "rl" / "summary.json").write_text("{}")
        (wd / "rl" / "metrics.jsonl").write_text('{"step": 1}\n')
        return {}

    monkeypatch.setattr(arms, "launch", fake_launch)
    arm = arms.Arm("spec", "speculative")
    short, full = tmp_path / "short_base", tmp_path / "full_base"
    arms.run_arm(arm, short, tmp_path / "out", "configs/rl_smollm2.py", ("rl.steps=3",))
    arms.run_arm(arm, short, tmp_path / "out", "configs/rl_smollm2.py", ("rl.steps=3",))
    assert len(launches) == 1  # the same launch: reused
    arms.run_arm(arm, full, tmp_path / "out", "configs/rl_smollm2.py", ("rl.steps=3",))
    assert len(launches) == 2 and str(full / "mtp" / "ckpt") in launches[1][1]
    arms.run_arm(arm, full, tmp_path / "out", "configs/rl_smollm2.py", ("rl.steps=4",))
    assert len(launches) == 3  # another setting
    record = tmp_path / "out" / "spec" / "arm.json"
    record.write_text(json.dumps({"wall_s": 1.0, "overrides": []}))  # an older record
    res = arms.run_arm(arm, short, tmp_path / "out", "configs/rl_smollm2.py", ("rl.steps=3",))
    assert len(launches) == 3 and res.wall_s == 1.0


def test_a_kept_arm_outlives_its_run_directory_only_for_an_identical_base(tmp_path, monkeypatch):
    """experiments.arms.run_arm with `keep`: a finished arm is kept as JSON; with its run
    directory gone (or holding a run of another setting), the same launch from a base trained
    again to the same MTP is taken from the kept file (no launch); another setting, a base whose
    MTP trained to another loss, or an unreadable kept file run the arm again."""
    import json
    import shutil

    from experiments import arms

    launches = []

    def fake_launch(config, wd, overrides):
        launches.append(list(overrides))
        (wd / "rl").mkdir(parents=True)
        (wd / "config.json").write_text(json.dumps({"rl": {"steps": len(launches)}}))
        (wd / "rl" / "summary.json").write_text(json.dumps({"n": len(launches)}))
        (wd / "rl" / "metrics.jsonl").write_text('{"step": 1, "time": 5.0}\n')
        return {}

    def make_base(final_loss):
        base = tmp_path / "base"
        shutil.rmtree(base, ignore_errors=True)
        (base / "mtp").mkdir(parents=True)
        (base / "config.json").write_text(json.dumps({"seed": 0}))
        summary = {"steps_run": 10, "final_loss": final_loss, "train_time_s": final_loss * 7}
        (base / "mtp" / "summary.json").write_text(json.dumps(summary))
        return base

    def arm_of(base, extra=(), launch_missing=True):
        return arms.run_arm(arm, base, out, "configs/rl_smollm2.py", extra, keep, launch_missing)

    monkeypatch.setattr(arms, "launch", fake_launch)
    arm, keep, out = arms.Arm("spec", "speculative"), tmp_path / "kept", tmp_path / "out"
    first = arm_of(make_base(0.5))
    kept = json.loads((keep / "spec.json").read_text())
    assert kept["records"] == [{"step": 1, "time": 5.0}] and kept["summary"] == {"n": 1}
    assert kept["key"]["config"]["mtp"]["init_from"] == "<base>/mtp/ckpt"  # not the path
    assert kept["key"]["config"]["rl"]["steps"] == 40  # the config the launch resolves to
    shutil.rmtree(out)
    again = arm_of(make_base(0.5))  # the base trained again, to the same loss
    assert len(launches) == 1 and again.summary == first.summary == {"n": 1}
    assert again.config == {"rl": {"steps": 1}} and again.wall_s == first.wall_s
    assert arm_of(make_base(0.5), ("rl.steps=3",), launch_missing=False) is None
    other_setting = arm_of(make_base(0.5), ("rl.steps=3",))  # kept file: the new setting's
    assert len(launches) == 2 and other_setting.summary == {"n": 2}
    # the run directory holds the other setting's run; the kept arm of that setting is reused
    # after the directory is gone, and an unreadable kept file runs the arm
    shutil.rmtree(out)
    assert arm_of(make_base(0.5), ("rl.steps=3",)).summary == {"n": 2} and len(launches) == 2
    (keep / "spec.json").write_text('{"key": ')
    assert arm_of(make_base(0.5), ("rl.steps=3",)).summary == {"n": 3}
    other_base = arm_of(make_base(0.25), ("rl.steps=3",))  # another MTP: run again
    assert len(launches) == 4 and other_base.summary == {"n": 4}
    assert json.loads((keep / "spec.json").read_text())["key"]["base"]["mtp"]["final_loss"] == 0.25
    # a base that is only its config (nothing trained): an arm kept from a trained base of
    # that config is reported; of another config, not
    shutil.rmtree(out)
    untrained = make_base(0.5)
    shutil.rmtree(untrained / "mtp")
    assert arm_of(untrained, ("rl.steps=3",), launch_missing=False).summary == {"n": 4}
    (untrained / "config.json").write_text(json.dumps({"seed": 1}))
    assert arm_of(untrained, ("rl.steps=3",), launch_missing=False) is None
    (untrained / "config.json").write_text(json.dumps({"seed": 0}))
    assert arm_of(untrained, ("rl.steps=3",)).summary == {"n": 5}  # launched: not taken
    # an arm that never drafts with the base's MTP does not depend on how the MTP trained
    plain = arms.Arm("plain", "plain", ("rollout.mode='plain'",), pretrained=False)
    arms.run_arm(plain, make_base(0.25), out, "configs/rl_smollm2.py", (), keep)
    shutil.rmtree(out)
    n = len(launches)
    arms.run_arm(plain, make_base(0.125), out, "configs/rl_smollm2.py", (), keep)
    assert len(launches) == n


def test_a_run_directory_of_another_launch_does_not_hide_a_kept_arm(tmp_path, monkeypatch):
    """A smoke run left in the arm's directory: the kept arm of the study's own launch is reused
    rather than run again; another study borrowing that kept directory takes the arm of the same
    launch only; a run directory recorded without a key is never kept."""
    import json

    from experiments import arms

    launches = []

    def fake_launch(config, wd, overrides):
        launches.append(list(overrides))
        (wd / "rl").mkdir(parents=True)
        (wd / "rl" / "summary.json").write_text(json.dumps({"n": len(launches)}))
        (wd / "rl" / "metrics.jsonl").write_text('{"step": 1}\n')
        return {}

    monkeypatch.setattr(arms, "launch", fake_launch)
    base = tmp_path / "base"
    (base / "mtp").mkdir(parents=True)
    arm, keep, out = arms.Arm("spec", "speculative"), tmp_path / "kept", tmp_path / "out"
    arms.run_arm(arm, base, out, "configs/rl_smollm2.py", (), keep)
    arms.run_arm(arm, base, out, "configs/rl_smollm2.py", ("rl.steps=2",))  # a smoke run
    assert len(launches) == 2
    res = arms.run_arm(arm, base, out, "configs/rl_smollm2.py", (), keep)
    assert len(launches) == 2 and res.summary == {"n": 1}
    # another study borrows the kept arm of the same launch (not one of another setting)
    other_study = tmp_path / "other"
    lent = arms.run_arm(
        arm, base, other_study, "configs/rl_smollm2.py", (), other_study / "k", borrow=(keep,)
    )
    assert len(launches) == 2 and lent.summary == {"n": 1}
    arms.run_arm(
        arm,
        base,
        other_study,
        "configs/rl_smollm2.py",
        ("rl.steps=2",),
        other_study / "k",
        borrow=(keep,),
    )
    assert len(launches) == 3
    # a finished directory recorded before launches were: reused as it is, but not kept
    other = arms.Arm("legacy", "legacy")
    (out / "legacy" / "rl").mkdir(parents=True)
    (out / "legacy" / "rl" / "summary.json").write_text("{}")
    (out / "legacy" / "rl" / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "legacy" / "arm.json").write_text(json.dumps({"wall_s": 1.0}))
    assert arms.run_arm(other, base, out, "configs/rl_smollm2.py", (), keep).wall_s == 1.0
    assert len(launches) == 3 and not (keep / "legacy.json").exists()


def test_rerun_launches_a_finished_or_kept_arm_again_and_keeps_the_new_run(
    tmp_path, monkeypatch, capsys
):
    """experiments.common: `--rerun` names arms among `--arms` (else a usage error naming it);
    such an arm is launched again although its run is finished and kept, the kept JSON then
    holds the new run; an interrupted rerun leaves the earlier kept JSON and run directory; an
    arm only reported is never launched by it."""
    import argparse
    import json
    import shutil

    from experiments import arms, common

    launches = []

    def fake_launch(config, wd, overrides):
        launches.append(wd.name)
        (wd / "rl").mkdir(parents=True)
        (wd / "rl" / "summary.json").write_text(json.dumps({"n": len(launches)}))
        (wd / "rl" / "metrics.jsonl").write_text('{"step": 1, "time": 5.0}\n')
        return {}

    def interrupted(config, wd, overrides):
        launches.append(wd.name)
        (wd / "rl").mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(arms, "launch", fake_launch)
    monkeypatch.setattr(common, "KEPT", tmp_path / "kept")
    base, out = tmp_path / "base", tmp_path / "exp_rl_speed_smollm2"
    (base / "mtp").mkdir(parents=True)
    kept = tmp_path / "kept" / out.name / "plain.json"
    ap = argparse.ArgumentParser()
    common.add_arms_flag(ap)
    known = ("plain", "grow_scratch")

    def args_of(*argv):
        args = ap.parse_args(argv)
        args.model, args.runlocal, args.set = "smollm2", False, []
        return args, common.chosen_arms(ap, args, known)

    once, names = args_of("--arms", "plain")
    assert names == ("plain",) and once.rerun_arms == ()
    assert common.study2_arms(names, base, out, once)["plain"].summary == {"n": 1}
    assert common.study2_arms(names, base, out, once)["plain"].summary == {"n": 1}  # reused
    assert json.loads(kept.read_text())["summary"] == {"n": 1}
    again, names = args_of("--arms", "plain", "--rerun", "plain")
    assert again.rerun_arms == ("plain",)
    # interrupted: the earlier run stays kept (and in plain.before_rerun), taken without --rerun
    monkeypatch.setattr(arms, "launch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        common.study2_arms(names, base, out, again)
    monkeypatch.setattr(arms, "launch", fake_launch)
    assert json.loads(kept.read_text())["summary"] == {"n": 1}
    assert (out / "plain.before_rerun" / "rl" / "summary.json").exists()
    assert common.study2_arms(names, base, out, once)["plain"].summary == {"n": 1}
    assert len(launches) == 2  # the earlier run directory restored, not run again
    assert (out / "plain" / "rl" / "summary.json").exists()
    assert not (out / "plain.before_rerun").exists()
    # finished: the new run is kept, the earlier directory removed
    assert common.study2_arms(names, base, out, again)["plain"].summary == {"n": 3}
    assert json.loads(kept.read_text())["summary"] == {"n": 3}
    assert not (out / "plain.before_rerun").exists()
    # an arm only kept (its run directory gone) is launched again too
    shutil.rmtree(out / "plain")
    assert common.study2_arms(names, base, out, again)["plain"].summary == {"n": 4}
    # reported (not launched) arms are taken as they are, also when named by --rerun
    assert common.study2_arms(names, base, out, again, False)["plain"].summary == {"n": 4}
    n = len(launches)
    arm = common.STUDY2_ARMS["plain"]
    extra = common.MODELS["smollm2"].extra
    config = common.MODELS["smollm2"].config
    reported = arms.run_arm(arm, base, out, config, extra, kept.parent, False, rerun=True)
    assert reported.summary == {"n": 4} and len(launches) == n
    # study2_chosen: the rerun arm launches once, the study's other arms are only reported
    assert list(common.study2_chosen(names, known, base, out, again)) == ["plain"]
    assert launches == ["plain"] * (n + 1)
    for argv, why in (
        (
            ("--arms", "plain", "--rerun", "grow_scratch"),
            "unknown ['grow_scratch'] (the arms it may name: plain)",
        ),
        (("--rerun", "plain,plain"), "repeated ['plain'] (the arms it may name: plain, grow"),
    ):
        with pytest.raises(SystemExit):
            args_of(*argv)
        assert f"--rerun: {why}" in capsys.readouterr().err


def test_an_acceptance_study_resumes_an_interrupted_arm_and_borrows_timed_ones(
    tmp_path, monkeypatch
):
    """experiments.arms.run_arm with `resume_every` (mtp_in_rl: no wall times compared): the RL
    stage checkpoints every that many steps; a launch killed after a checkpoint is launched again
    into the same directory (its checkpoint kept: the RL stage resumes from it), recording the
    steps it resumed from and no wall time; a timed study (no `resume_every`) or `--rerun` starts
    it over; the cadence is not part of the kept key, so an arm a timed study kept is borrowed."""
    import argparse
    import json
    import shutil

    from experiments import arms, common

    seen = []  # (arm, checkpoint steps found on entry, overrides)

    def launch_until(killed_at):
        def launch(config, wd, overrides):
            ckpt = wd / "rl" / "ckpt"
            seen.append((wd.name, sorted(p.name for p in ckpt.glob("*")), list(overrides)))
            if killed_at is not None:
                (ckpt / str(killed_at)).mkdir(parents=True)
                (ckpt / f"{killed_at + 10}.orbax-checkpoint-tmp-1").mkdir()  # a torn save
                raise KeyboardInterrupt
            (wd / "rl").mkdir(exist_ok=True)
            (wd / "rl" / "summary.json").write_text(json.dumps({"n": len(seen)}))
            (wd / "rl" / "metrics.jsonl").write_text('{"step": 1, "time": 5.0}\n')
            return {}

        return launch

    monkeypatch.setattr(common, "KEPT", tmp_path / "kept")
    base, out = tmp_path / "base", tmp_path / "exp_mtp_in_rl_smollm2"
    (base / "mtp").mkdir(parents=True)
    args = argparse.Namespace(model="smollm2", runlocal=False, set=[], rerun_arms=())
    rerun = argparse.Namespace(**{**vars(args), "rerun_arms": ("online_ce",)})

    def study(argv=args, killed_at=None, resume_every=10, borrow=()):
        monkeypatch.setattr(arms, "launch", launch_until(killed_at))
        return common.study2_arms(("online_ce",), base, out, argv, True, borrow, resume_every)

    with pytest.raises(KeyboardInterrupt):
        study(killed_at=10)
    assert seen[-1][1] == [] and "ckpt.every=10" in seen[-1][2]
    # a study that times its arms starts it over (and without the cadence); so does the
    # resuming study after that launch (another launch's directory)
    for every in (0, 10):
        with pytest.raises(KeyboardInterrupt):
            study(resume_every=every, killed_at=10)
        assert seen[-1][1] == [] and ("ckpt.every=10" in seen[-1][2]) == bool(every)
    with pytest.raises(KeyboardInterrupt):
        study(killed_at=20)  # resumed at 10, killed again after step 20's checkpoint
    assert seen[-1][1] == ["10", "20.orbax-checkpoint-tmp-1"]
    res = study()["online_ce"]
    assert "20" in seen[-1][1] and res.summary == {"n": 5} and res.wall_s is None
    kept = json.loads((tmp_path / "kept" / out.name / "online_ce.json").read_text())
    assert kept["resumed_from"] == [10, 20] and kept["wall_s"] is None
    assert kept["key"]["config"]["ckpt"]["every"] != 10  # the cadence is outside the key
    # --rerun starts over (the finished run set aside, taken back after an interruption)
    with pytest.raises(KeyboardInterrupt):
        study(rerun, killed_at=10)
    assert seen[-1][1] == []
    assert study()["online_ce"].summary == {"n": 5} and len(seen) == 6
    # a study that times its arms never takes a resumed arm (its step times span the gap)
    shutil.rmtree(out / "online_ce")
    timed_run = study(resume_every=0)["online_ce"]
    assert timed_run.summary == {"n": 7} and timed_run.wall_s is not None
    # an arm a timed study kept (no checkpoint cadence) is borrowed by the resuming study
    timed = tmp_path / "timed_kept"
    (timed / "online_ce.json").parent.mkdir()
    (timed / "online_ce.json").write_text(
        (tmp_path / "kept" / out.name / "online_ce.json").read_text()
    )
    (tmp_path / "kept" / out.name / "online_ce.json").unlink()
    (out / "online_ce" / "rl" / "summary.json").unlink()
    assert study(borrow=(timed,))["online_ce"].summary == {"n": 7} and len(seen) == 7


# the study's own SIGTERM handler: the default (it ends by the signal), or one that prints what
# was done so far and exits 3 (as benchmarks/e2e.py's `cut` does)
CUT = "import signal, sys\nsignal.signal(signal.SIGTERM, lambda *a: (print('cut'), sys.exit(3)))\n"


@pytest.mark.parametrize(
    "own, sig, code, printed",
    [("", "SIGTERM", -15, ""), (CUT, "SIGTERM", 3, "cut\n"), ("", "SIGINT", -2, "")],
)
def test_a_study_stopped_by_sigterm_lets_its_launch_save_first(tmp_path, own, sig, code, printed):
    """experiments.arms.run_child passes a SIGTERM on to the launch it waits for and waits for
    its end: the child's SIGTERM handler (launch.py's: save a checkpoint, exit 143) runs, then
    the study's own. (Without it the study's handler runs at once and the child is never told.)
    A SIGINT to the study alone also stops the child with a SIGTERM first; the study's
    KeyboardInterrupt comes after the child ended. A child that prints, sleeps up to 30 s, and on
    SIGTERM writes a file."""
    import signal
    import subprocess
    import sys
    import time

    saved, ready = tmp_path / "saved", tmp_path / "ready"
    child = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(saved)!r}, 'w').write('ok'), "
        "sys.exit(143)))\n"
        f"open({str(ready)!r}, 'w').write('ok')\n"
        "for _ in range(300):\n    print('step', flush=True); time.sleep(0.1)\n"
    )
    run = f"from experiments import arms; arms.run_child({[sys.executable, '-c', child]!r})"
    # as from a terminal: a background job of a non-interactive shell (a script's `cmd &`, e.g.
    # this suite under `nohup ... &`) starts with SIGINT ignored, and Python keeps it ignored
    run = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n" + run
    study = subprocess.Popen(
        [sys.executable, "-c", own + run], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready.exists(), "the child never started"
    t0 = time.monotonic()
    study.send_signal(getattr(signal, sig))
    out, err = study.communicate(timeout=60)
    assert saved.read_text() == "ok"  # the child's handler ran
    assert study.returncode == code and out == printed, err  # then the study's own
    assert time.monotonic() - t0 < 20  # not the child's full 30 s


def test_a_second_sigint_stops_waiting_for_a_launch_that_does_not_end(tmp_path):
    """A launch that ignores SIGTERM (stuck, say) never ends: the first SIGINT to the study is
    passed on to it and the study waits; the second stops the wait, and the study ends by its
    KeyboardInterrupt at once, well before the launch's 30 s."""
    import os
    import signal
    import subprocess
    import sys
    import time

    ready = tmp_path / "ready"
    child = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(ready)!r}, 'w').write(str(os.getpid()))\n"
        "for _ in range(300):\n    print('step', flush=True); time.sleep(0.1)\n"
    )
    run = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"from experiments import arms; arms.run_child({[sys.executable, '-c', child]!r})"
    )
    study = subprocess.Popen(
        [sys.executable, "-c", run], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not (ready.exists() and ready.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not (ready.exists() and ready.read_text()):
        study.kill()
        pytest.fail("the launch never started")
    launch_pid = int(ready.read_text())
    try:
        t0 = time.monotonic()
        study.send_signal(signal.SIGINT)
        time.sleep(2)
        assert study.poll() is None  # waiting for the launch to save
        study.send_signal(signal.SIGINT)
        _, err = study.communicate(timeout=20)
        assert study.returncode == -signal.SIGINT and "KeyboardInterrupt" in err, err
        assert time.monotonic() - t0 < 20
    finally:
        study.kill()
        os.kill(launch_pid, signal.SIGKILL)


def test_a_launch_that_fails_while_saving_has_its_error_printed_by_the_stopped_study(tmp_path):
    """A SIGTERM to a study is passed on to its launch; a launch that then fails while saving
    (exit 1, a traceback on stderr) has that error's tail printed by the study before the study
    ends by its own SIGTERM, instead of losing it with the pipe."""
    import signal
    import subprocess
    import sys
    import time

    ready = tmp_path / "ready"
    child = (
        "import signal, sys, time\n"
        "def fail(*a):\n    sys.stderr.write('disk full while saving step 7\\n'); sys.exit(1)\n"
        "signal.signal(signal.SIGTERM, fail)\n"
        f"open({str(ready)!r}, 'w').write('ok')\n"
        "for _ in range(300):\n    time.sleep(0.1)\n"
    )
    run = f"from experiments import arms; arms.run_child({[sys.executable, '-c', child]!r})"
    study = subprocess.Popen(
        [sys.executable, "-c", run], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert ready.exists(), "the child never started"
        study.send_signal(signal.SIGTERM)
        _, err = study.communicate(timeout=60)
        assert study.returncode == -signal.SIGTERM, err
        assert "ended with exit 1 after the stop request" in err, err
        assert "disk full while saving step 7" in err, err
    finally:
        study.kill()


@pytest.mark.parametrize("model", ["demo", "smollm2"])
def test_growmtp_from_random_init_starts_from_a_random_head_on_every_model(model):
    """The GrowMTP arm labelled "from random init" resolves to `mtp.init='random'` with no MTP
    checkpoint on each model, although SmolLM2's configs initialise an MTP from the policy's last
    block; the head grown from there is its own arm, run by the SmolLM2 study only."""
    from bebop import config as config_lib
    from experiments import common
    from experiments.growmtp.run import ARMS_OF

    m = common.MODELS[model]

    def resolved(name):
        arm = common.STUDY2_ARMS[name]
        init = ["mtp.init_from='runs/base/mtp/ckpt'"] if arm.pretrained else []
        cfg = config_lib.load(m.config, ["stages=('rl',)", *m.extra, *init, *arm.overrides])[0]
        return cfg.mtp.init, cfg.mtp.init_from, cfg.rl.mtp_strategy, arm.pretrained

    assert resolved("grow_scratch") == ("random", "", "growmtp", False)
    assert resolved("grow_last_layer") == ("last_layer", "", "growmtp", False)
    assert resolved("grow_pretrained")[1:] == ("runs/base/mtp/ckpt", "growmtp", True)
    assert ("grow_last_layer" in ARMS_OF[model]) == (model == "smollm2")
    assert {"plain", "grow_scratch", "frozen_rs", "grow_pretrained"} <= set(ARMS_OF[model])


@pytest.mark.parametrize(
    "argv, names, rerun",
    [
        (("--model", "demo", "--rerun", "plain"), None, None),
        (("--model", "demo", "--arms", "plain"), None, None),
        (("--model", "smollm2", "--rerun", "plain_sync"), None, None),
        (("--model", "smollm2", "--sync", "--rerun", "plain_sync"), "every+sync", ("plain_sync",)),
        (("--model", "smollm2", "--arms", "plain_sync"), ("plain_sync",), ()),
        (("--model", "smollm2", "--rerun", "plain"), "every", ("plain",)),
    ],
)
def test_e2e_speedup_arms_and_rerun_flags(monkeypatch, capsys, argv, names, rerun):
    """experiments.e2e_speedup.run: the demo refuses --arms and --rerun; on SmolLM2 --arms may
    name a synchronous arm without --sync, --rerun (without --arms) only the arms that run."""
    import sys

    from experiments import common
    from experiments.e2e_speedup import run

    seen = {}

    class Launched(Exception):
        pass

    def study2_base(args, root_attr, chosen=None):
        seen.update(names=tuple(chosen), rerun=args.rerun_arms)
        raise Launched

    monkeypatch.setattr(common, "study2_base", study2_base)
    monkeypatch.setattr(sys, "argv", ["run", *argv])
    if names is None:
        with pytest.raises(SystemExit):
            run.main()
        error = capsys.readouterr().err.splitlines()[-1]
        assert ("--sync" in error) == ("plain_sync" in argv)  # why a synchronous arm is refused
        return
    with pytest.raises(Launched):
        run.main()
    every = run.SMOLLM2_ARMS + (run.SMOLLM2_SYNC if names == "every+sync" else ())
    assert seen == {"names": every if isinstance(names, str) else names, "rerun": rerun}


def test_predict_takes_kept_arms_of_the_same_base_only(tmp_path, monkeypatch):
    """experiments.e2e_speedup.predict: by default it predicts the kept arms that ran from a base
    identical to the one it measures, and refuses by name an arm kept from another base; a base
    whose MTP has not trained takes the arms kept from trained bases of its config."""
    import json

    import pytest

    from experiments import arms, common
    from experiments.e2e_speedup import predict

    def make_base(name, final_loss):
        base = tmp_path / name
        (base / "mtp").mkdir(parents=True)
        (base / "config.json").write_text("{}")
        (base / "mtp" / "summary.json").write_text(json.dumps({"final_loss": final_loss}))
        return base

    same, other = make_base("a", 0.5), make_base("b", 0.25)
    monkeypatch.setattr(common, "KEPT", tmp_path / "kept")
    root = tmp_path / "exp"
    common.kept_dir(root).mkdir(parents=True)
    for name, base in (("plain", same), ("spec", other)):
        kept = {"key": {"base": arms.base_identity(base)}, "config": {"n": name}, "records": []}
        (common.kept_dir(root) / f"{name}.json").write_text(json.dumps(kept))
    assert predict.kept_of(root, same) == ["plain"]
    assert predict.arm_run(root, "plain", same) == ({"n": "plain"}, [])
    with pytest.raises(SystemExit, match="'spec'.*another base"):
        predict.arm_run(root, "spec", same)
    # a base that is only its config (MTP not trained here) takes the arms of its config only
    bare = tmp_path / "c"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    assert predict.kept_of(root, bare) == ["plain", "spec"]
    (bare / "config.json").write_text('{"seed": 1}')
    assert predict.kept_of(root, bare) == []


def test_plain_arms_of_a_model_without_sft_need_no_trained_base(tmp_path, monkeypatch):
    """experiments.common.study2_base: SmolLM2's plain arms start from the checkpoint's policy,
    so the base is only its config, written so that the base's own launch later finds it equal
    (else kept plain arms would not match); a stale config.json is replaced, or refused where a
    base of it has finished stages; an arm that drafts with the base's MTP trains the base; the
    demo (an SFT stage) always trains it; a smoke run's default base is its own."""
    import argparse
    import json
    from pathlib import Path

    import launch
    from bebop import config as config_lib
    from experiments import arms, common

    launched = []
    monkeypatch.setattr(arms, "launch", lambda config, wd, o: launched.append((config, wd)))
    args = argparse.Namespace(model="smollm2", base=str(tmp_path / "b"), out=None, runlocal=False)
    base, _ = common.study2_base(args, "timed_root", ["plain_compact", "plain"])
    assert not launched and base == (tmp_path / "b").absolute()
    cfg = config_lib.load("configs/mtp_smollm2.py", ["stages=('distill', 'mtp')"])[0]
    launch.update_config_json(cfg, base)  # what the base's launch does when it finishes
    assert sorted(p.name for p in base.iterdir()) == ["config.json"]  # equal: nothing renamed
    assert json.loads((base / "config.json").read_text())["stages"] == ["distill", "mtp"]
    (base / "config.json").write_text('{"stale": 1}')
    common.study2_base(args, "timed_root", ["plain"])
    assert json.loads((base / "config.json").read_text())["stages"] == ["distill", "mtp"]
    (base / "config.json").write_text('{"stale": 1}')
    (base / "distill").mkdir()
    (base / "distill" / "summary.json").write_text("{}")
    with pytest.raises(SystemExit, match="config.json: a base of another config"):
        common.study2_base(args, "timed_root", ["plain"])
    (base / "distill" / "summary.json").unlink()
    common.study2_base(args, "timed_root", ["plain_compact", "frozen_rs_compact"])
    assert launched == [("configs/mtp_smollm2.py", base)]
    demo = argparse.Namespace(model="demo", base=str(tmp_path / "d"), out=None, runlocal=False)
    common.study2_base(demo, "timed_root", ["plain"])
    assert launched[-1] == ("configs/demo.py", (tmp_path / "d").absolute())
    smoke = argparse.Namespace(model="smollm2", base=None, out=None, runlocal=True)
    smoke_base, smoke_root = common.study2_base(smoke, "timed_root", ["frozen_rs_compact"])
    assert launched[-1] == ("configs/mtp_smollm2.py:runlocal", smoke_base)
    assert smoke_base == Path("runs/mtp_smollm2_runlocal").absolute()
    assert str(smoke_root) == "runs/exp_rl_speed_smollm2_runlocal"


def test_a_smoke_run_never_replaces_a_studys_results(tmp_path):
    """experiments.common.outputs: the study's own setting writes next to its script; a
    `--runlocal` or `--set` run writes under its arm directory instead."""
    import argparse

    from experiments import common

    here, root = tmp_path / "study", tmp_path / "arms"
    own = argparse.Namespace(runlocal=False, set=[])
    assert common.outputs(own, here, root) == here and not root.exists()
    smoke = argparse.Namespace(runlocal=True, set=[])
    assert common.outputs(smoke, here, root) == root / "results" and (root / "results").is_dir()
    other = argparse.Namespace(runlocal=False, set=["rl.steps=3"])
    assert common.outputs(other, here, root) == root / "results"


def test_arms_flag_runs_a_studys_arms_in_the_given_order_and_names_unknown_ones(capsys):
    """experiments.common.chosen_arms: `--arms` picks arms in its order (all when absent); an
    unknown or repeated arm is a usage error that lists the study's arms."""
    import argparse

    from experiments import common

    ap = argparse.ArgumentParser()
    common.add_arms_flag(ap)
    known = ("plain", "grow_scratch", "frozen_rs")
    assert common.chosen_arms(ap, ap.parse_args([]), known) == known
    picked = common.chosen_arms(ap, ap.parse_args(["--arms", "grow_scratch,plain"]), known)
    assert picked == ("grow_scratch", "plain")
    for bad, why in (("grow,plain", "unknown ['grow']"), ("plain,plain", "repeated ['plain']")):
        with pytest.raises(SystemExit):
            common.chosen_arms(ap, ap.parse_args(["--arms", bad]), known)
        err = capsys.readouterr().err
        assert why in err and "plain, grow_scratch, frozen_rs" in err


def test_growmtp_reports_a_head_before_its_plain_arm_ran():
    """experiments.growmtp.run.row: without a plain arm the times are not compared, the
    acceptance still is."""
    from experiments import arms
    from experiments.growmtp.run import row

    recs = [
        {
            "step": s,
            "time": 10.0 * s,
            "rollout_s": 4.0,
            "accept_len": 1.0 + s / 10,
            "reward_mean": 0.5,
        }
        for s in range(1, 13)
    ]
    arm = arms.ArmResult(arms.Arm("grow", "grow"), {"accuracy_after": 0.5}, recs, None)
    r = row(arm, None, window=5)
    assert (
        r["step_s_ratio"] == r["rollout_s_ratio"] == {"not_compared": "the plain arm has not run"}
    )
    assert r["accept_len_first"] == pytest.approx(1.1)
    assert r["accept_len_last10"] == pytest.approx(2.0)  # steps 8..12
    assert r["response_tokens_ratio"] is None


def test_growmtp_says_how_many_tokens_each_arm_sampled_beside_its_times():
    """experiments.growmtp.run.row: an arm whose steps take 9 s against plain's 10 s while
    sampling 0.75 of plain's tokens (step 1 left out) is 0.9x plain per step, tokens 0.75x."""
    from experiments import arms
    from experiments.growmtp.run import row

    def arm(name, step_s, tokens):
        recs = [
            {
                "step": s,
                "time": step_s * s,
                "rollout_s": 4.0,
                "accept_len": 2.0,
                "reward_mean": 0.5,
                "response_tokens": tokens if s > 1 else 999,  # step 1 is not compared
            }
            for s in range(1, 13)
        ]
        return arms.ArmResult(arms.Arm(name, name), {"accuracy_after": 0.5}, recs, None)

    r = row(arm("spec", 9.0, 300), arm("plain", 10.0, 400), window=5)
    assert r["step_s_ratio"]["all"] == pytest.approx(0.9)
    assert r["response_tokens_ratio"] == pytest.approx(0.75)
    uncounted = arm("spec", 9.0, 300)
    for rec in uncounted.records:
        del rec["response_tokens"]
    assert row(uncounted, arm("plain", 10.0, 400), window=5)["response_tokens_ratio"] is None


def test_predict_times_random_weights_of_the_trained_mtps_shape(tmp_path):
    """benchmarks.common.shaped_mtp: a random MTP of an `mtp` section has the parameter shapes a
    trained checkpoint of that section restores into (`policies.abstract_mtp`) and a draft
    vocabulary of its size; a draft vocabulary larger than the policy's is an error naming the
    key. timing.load refuses a demo base without a trained MTP by name."""
    import dataclasses

    import jax

    from bebop import config as config_lib
    from bebop import policies
    from benchmarks.common import shaped_mtp
    from experiments.e2e_speedup import timing

    pol_cfg = config_lib.load("configs/demo.py")[0].model
    shape = dataclasses.replace(
        config_lib.MTPConfig(), num_layers=2, features=(0, -1), depth=2, draft_vocab=7
    )
    _, params, vocab = shaped_mtp(shape, pol_cfg)
    _, want = policies.abstract_mtp(pol_cfg, shape)
    got = jax.tree.map(lambda a: (a.shape, a.dtype), params)
    assert got == jax.tree.map(lambda a: (a.shape, a.dtype), want)
    assert vocab.shape == (7,) and len(set(vocab.tolist())) == 7
    assert shaped_mtp(dataclasses.replace(shape, draft_vocab=0), pol_cfg)[2] is None
    too_big = dataclasses.replace(shape, draft_vocab=pol_cfg.vocab_size + 1)
    with pytest.raises(ValueError, match="mtp.draft_vocab"):
        shaped_mtp(too_big, pol_cfg)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="mtp/summary.json"):
        timing.load(tmp_path, "demo", "configs/demo.py")


def test_arms_that_drafted_with_different_pre_rl_mtps_are_not_compared():
    """experiments.common.one_pre_rl_mtp: arms reported beside a config-only base may come from
    different trained bases; two MTP outcomes among a study's arms are refused by name, arms
    without a pre-RL MTP (plain, GrowMTP from scratch) never conflict."""
    from experiments import arms, common

    def arm(name, mtp):
        return arms.ArmResult(arms.Arm(name, name), {}, [], None, {}, mtp)

    one = {"steps_run": 2100, "final_loss": 0.61}
    common.one_pre_rl_mtp({"plain": arm("plain", None), "a": arm("a", one), "b": arm("b", one)})
    other = {"steps_run": 2100, "final_loss": 0.25}
    with pytest.raises(SystemExit, match=r"different pre-RL MTPs \(a: .*0\.61.*; b: .*0\.25"):
        common.one_pre_rl_mtp({"a": arm("a", one), "b": arm("b", other), "p": arm("p", None)})


def test_a_study_launches_the_chosen_arms_and_only_reports_the_others(monkeypatch):
    """experiments.common.study2_chosen: the `--arms` arms may launch, the study's other arms
    are only reported (launch_missing=False; an arm neither finished nor kept is left out), in
    the study's order."""
    from experiments import arms, common

    calls = []

    def fake(names, base, root, args, launch_missing=True, borrow=(), resume_every=0):
        calls.append((tuple(names), launch_missing, borrow, resume_every))
        have = {"b", "c"} if launch_missing else {"a"}  # "d": neither finished nor kept
        return {n: arms.ArmResult(arms.Arm(n, n), {}, [], None) for n in names if n in have}

    monkeypatch.setattr(common, "study2_arms", fake)
    got = common.study2_chosen(("c", "b"), ("a", "b", "c", "d"), None, None, None, ("k",), 10)
    assert list(got) == ["a", "b", "c"]
    assert calls == [(("c", "b"), True, ("k",), 10), (("a", "d"), False, ("k",), 10)]


def test_a_kept_arm_of_another_launch_says_what_happens_next(tmp_path, capsys):
    """experiments.arms.kept_arm: a kept arm of another key is not taken; the message says the
    arm runs again where it is launched, and that it is left out where it is only reported."""
    import json

    from experiments import arms

    arm = arms.Arm("a", "a")
    kept = {"key": {"config": 1}, "wall_s": 1.0, "config": {}, "summary": {}, "records": []}
    (tmp_path / "a.json").write_text(json.dumps(kept))
    assert arms.kept_arm(tmp_path, arm, {"config": 1}) is not None
    assert arms.kept_arm(tmp_path, arm, {"config": 2}) is None
    assert "another launch or base; running the arm" in capsys.readouterr().out
    assert arms.kept_arm(tmp_path, arm, {"config": 2, "base": {"mtp": 1}}, report=True) is None
    assert "another launch or base; not reported" in capsys.readouterr().out
