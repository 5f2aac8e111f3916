"""Study helpers: the fit recovers a known slope inside its interval, Spearman matches its
definition, and every plot function draws what it was given into a PNG of the asked size."""

import json

import numpy as np
import pytest

from bebop import analysis, plots


def test_linear_fit_recovers_a_known_slope_within_its_interval():
    """y = -0.8 x + 0.9 + N(0, 0.1^2), n = 400: the 95 % bootstrap interval contains -0.8 and is
    narrower than 0.1; r is strongly negative. A flat line's interval contains 0."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, 400)
    fit = analysis.linear_fit(x, -0.8 * x + 0.9 + rng.normal(0, 0.1, 400), n_boot=500)
    assert fit.slope_ci[0] < -0.8 < fit.slope_ci[1]
    assert fit.slope_ci[1] - fit.slope_ci[0] < 0.1
    assert fit.intercept_ci[0] < 0.9 < fit.intercept_ci[1] and fit.r < -0.9
    flat = analysis.linear_fit(x, rng.normal(0, 0.1, 400), n_boot=500)
    assert flat.slope_ci[0] < 0 < flat.slope_ci[1]
    with pytest.raises(ValueError, match="linear_fit needs"):
        analysis.linear_fit([1, 2], [1, 2])


def test_spearman_is_the_rank_correlation_with_ties_averaged():
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert analysis.spearman(x, x**3) == pytest.approx(1.0)  # monotone, not linear
    assert analysis.spearman(x, -x) == pytest.approx(-1.0)
    # ties: ranks of y = [1.5, 1.5, 3, 4, 5]; Pearson of ranks by hand = 0.9746794
    assert analysis.spearman(x, [2, 2, 3, 4, 5]) == pytest.approx(0.9746794, abs=1e-6)


def test_binned_means_are_equal_count_bins():
    x = np.arange(100.0)
    bx, by, n = analysis.binned(x, 2 * x, bins=4)
    np.testing.assert_array_equal(n, [25, 25, 25, 25])
    np.testing.assert_allclose(bx, [12, 37, 62, 87])
    np.testing.assert_allclose(by, 2 * bx)


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_rule_check_finds_the_winner_where_the_margin_says_and_not_where_it_lies():
    """Synthetic drafted tokens with known acceptance under each rule (α_TO ~ U[0.4, 0.6],
    margin α_RS − α_TO ~ U[−0.4, 0.4]); half from an "RS run" (accepted ~ Bernoulli(α_RS), diff =
    accepted − α_TO), half from a "TO run" (diff = α_RS − accepted ~ Bernoulli(α_TO)). 40,000
    tokens, 20 bins of 2,000 (s.e. ≈ 0.011): the bins with |margin| above ~0.05 are resolved
    at z = 3 and the rule is right in all of them. A sampler whose RS run accepted at TO's rate
    minus the margin (the rule reversed) is wrong in every resolved bin; one whose acceptance
    equals the other rule's leaves the bins unresolved."""
    rng = np.random.default_rng(0)
    n = 20_000
    m_rs, m_to = rng.uniform(-0.4, 0.4, n), rng.uniform(-0.4, 0.4, n)
    a_to_rs, a_to_to = rng.uniform(0.4, 0.6, n), rng.uniform(0.4, 0.6, n)

    def check(p_rs_run, p_to_run):  # acceptance probabilities the "sampler" really used
        acc_rs, acc_to = rng.uniform(size=n) < p_rs_run, rng.uniform(size=n) < p_to_run
        diff = np.concatenate([acc_rs - a_to_rs, (a_to_to + m_to) - acc_to])
        return analysis.rule_check(np.concatenate([m_rs, m_to]), diff, bins=20)

    chk = check(a_to_rs + m_rs, a_to_to)  # exact samplers
    assert len(chk.margin) == 20 and chk.tokens.sum() == 2 * n and chk.dropped == 0
    assert chk.accuracy == 1.0 and chk.resolved_share > 0.7
    np.testing.assert_allclose(chk.measured, chk.margin, atol=4 * chk.se.max())
    reversed_ = check(a_to_rs - m_rs, a_to_to + 2 * m_to)
    assert reversed_.accuracy == 0.0 and reversed_.resolved_share > 0.7
    null = check(a_to_rs, a_to_to + m_to)  # each run accepted at the other rule's rate
    assert null.resolved_share < 0.1
    with pytest.raises(ValueError, match="differ"):
        analysis.rule_check(m_rs, m_rs[:-1])
    # near-certain drafts: float-level differences with tiny standard errors are no winner, and
    # a float-level margin predicts none
    tiny = analysis.judge_bins([-1e-7, -2e-6, 0.1], [6e-7, -1e-6, 0.1], [1e-8, 1e-8, 0.01], [9] * 3)
    assert tiny.resolved.tolist() == [False, False, True] and tiny.accuracy == 1.0


def test_plots_draw_every_series_into_a_png(tmp_path):
    steps = np.arange(10.0)
    fig = plots.lines(
        tmp_path / "l.png",
        {"a": (steps, steps**0.5), "b": (steps, steps / 3)},
        "RL step",
        "accept length (tokens / verify)",
        "demo, γ = 2",
    )
    ax = fig.axes[0]
    assert [len(line.get_xdata()) for line in ax.get_lines()] == [10, 10]
    assert ax.get_xlabel() == "RL step" and "γ = 2" in ax.get_title()
    assert _png_size(tmp_path / "l.png") == (600, 400)

    rng = np.random.default_rng(1)
    ent = rng.uniform(0, 3, 500)
    acc = (rng.uniform(size=500) < 0.9 - 0.2 * ent).astype(float)
    fig, fits = plots.binned_fit(
        tmp_path / "b.png",
        {"RS": (ent, acc)},
        "policy entropy (nats)",
        "P(accept)",
        "binned",
        bins=8,
    )
    ax = fig.axes[0]
    markers, fit_line = ax.get_lines()
    assert len(markers.get_xdata()) == 8 and len(fit_line.get_xdata()) == 50
    assert "slope" in ax.get_legend().get_texts()[0].get_text()
    assert fits["RS"].slope_ci[0] < -0.2 < fits["RS"].slope_ci[1]

    fig = plots.scatter(tmp_path / "s.png", {"runs": (ent[:6], acc[:6] + ent[:6])}, "x", "y", "t")
    assert len(fig.axes[0].get_lines()) == 2  # fit line + points
    fig = plots.twin_x(
        tmp_path / "t.png",
        {"spec": (steps, steps * 3.5, steps)},
        ("RL step", "wall clock (s)"),
        "reward",
        "demo",
    )
    assert [len(a.get_lines()) for a in fig.axes] == [1, 1]
    assert _png_size(tmp_path / "t.png") == (1000, 400)
    with pytest.raises(ValueError, match="plot series 'empty'"):
        plots.lines(tmp_path / "e.png", {"empty": ([], [])}, "x", "y", "t")


def test_series_reads_metrics_records_with_the_key(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "loss": 2.0}\n{"step": 2, "eval/a": 1.5}\n{"step": 3, "loss": 1.0}\n'
    )
    x, y = plots.series(plots.read_metrics(path), "loss")
    np.testing.assert_array_equal(x, [1, 3])
    np.testing.assert_array_equal(y, [2.0, 1.0])
    path.write_text('{"step": 1}\n{"ste')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        plots.read_metrics(path)


def test_study2_helpers_pay_from_the_last_crossing_and_split_acceptance_by_entropy():
    """GrowMTP's "starts paying" is the first step after the last one slower than plain (never if
    the last step is); mtp_in_rl's decomposition puts an acceptance change that the entropy
    change predicts exactly under "explained" and nothing under "rest"."""
    from experiments import arms, common
    from experiments.growmtp.run import pays_from
    from experiments.mtp_in_rl.run import decompose

    steps = np.arange(1, 7)
    assert pays_from(steps, [1.3, 1.1, 0.9, 1.05, 0.95, 0.9]) == 5
    assert pays_from(steps, [0.9] * 6) == 1
    assert pays_from(steps, [0.9, 0.9, 0.9, 0.9, 0.9, 1.01]) is None
    np.testing.assert_allclose(common.running_mean([1, 2, 3, 4], 2), [1, 1.5, 2.5, 3.5])

    slope = -0.25  # acceptance per nat, the study-1 fit the arm uses (RS-TV for an RS arm)
    study1 = {"drafts": {"RS-TV": {"slope": slope}, "TO-CE": {"slope": -0.5}}}
    entropy = np.linspace(0.1, 0.5, 40)
    drift = np.linspace(0.0, -0.02, 40)  # what the entropy does not explain
    records = [
        {
            "step": i + 1,
            "accept_rate": 0.9 + slope * (h - 0.1) + d,
            "accept_len": 2.5,
            "accept_rate_1": 0.9,
            "accept_rate_2": 0.9,
            "rollout_entropy": h,
            "reward_mean": 0.5,
        }
        for i, (h, d) in enumerate(zip(entropy, drift, strict=True))
    ]
    arm = common.STUDY2_ARMS["frozen_rs"]
    res = arms.ArmResult(arm, {"accuracy_before": 0.4, "accuracy_after": 0.5}, records, None)
    row = decompose(res, study1, n=10)
    dh = entropy[-10:].mean() - entropy[:10].mean()
    assert row["study1_fit"] == "RS-TV"
    assert row["explained_by_entropy"] == pytest.approx(slope * dh)
    assert row["rest"] == pytest.approx(drift[-10:].mean() - drift[:10].mean())
    to_arm = common.STUDY2_ARMS["to_online_ce"]
    assert decompose(arms.ArmResult(to_arm, res.summary, records, None), study1)["study1_fit"] == (
        "TO-CE"
    )


def test_loss_ablation_delta_stands_on_the_prompts_both_arms_share():
    """An arm evaluated on more held-out prompts than CE is compared on CE's prompts (the common
    prefix): the extra prompts move neither the difference nor its prompt count."""
    from experiments.mtp_arms import paired_delta

    ce = [[1, 2, 3, 4], [4, 4, 4, 4]]  # accepts, attempts per prompt: 10 / 16
    arm = [[2, 3, 3, 4, 0, 0], [4, 4, 4, 4, 9, 9]]  # 12 / 16 on the first four
    d, se, n = paired_delta(arm, ce)
    assert n == 4
    assert d == pytest.approx(100 * (12 / 16 - 10 / 16))
    # The paired s.e. by hand: per prompt z = (acc - r·att) / mean(att) of each arm, differenced.
    z = (np.array([2, 3, 3, 4]) - 0.75 * 4) / 4 - (np.array([1, 2, 3, 4]) - 0.625 * 4) / 4
    assert se == pytest.approx(100 * z.std(ddof=1) / 2)
    assert paired_delta(ce, arm)[:2] == pytest.approx((-d, se))


def test_wall_times_are_compared_only_between_arms_run_side_by_side():
    """experiments.e2e_speedup.ratios: a pair of arms that started more than 12 h apart (e.g. on
    different days, kept from another launch) gets no ratio of times, a pair 1 h apart does."""
    from experiments.e2e_speedup.run import ratios

    def arm(started, rl_s):
        return dict(started=started, rl_s_after_step_1=rl_s, step_s_median=1.0, rollout_s=rl_s)

    same_day = ratios({"plain_compact": arm(0.0, 120.0), "frozen_rs_compact": arm(3600.0, 100.0)})
    assert same_day["async_compact"]["rl_s_after_step_1"] == pytest.approx(1.2)
    apart = ratios({"plain_compact": arm(0.0, 120.0), "frozen_rs_compact": arm(13 * 3600.0, 100.0)})
    assert "rl_s_after_step_1" not in apart["async_compact"]
    assert "13 h apart" in apart["async_compact"]["not_compared"]
    # the second arm sampled 1.25x the tokens: said beside the 1.2x of times
    tok = {"plain_compact": arm(0.0, 120.0), "frozen_rs_compact": arm(3600.0, 100.0)}
    tok["plain_compact"]["response_tokens"] = 400.0
    tok["frozen_rs_compact"]["response_tokens"] = 500.0
    r = ratios(tok)["async_compact"]
    assert r["tokens_second_over_first"] == pytest.approx(1.25)
    assert r["rl_s_after_step_1"] == pytest.approx(1.2)


def test_growmtp_does_not_compare_step_times_with_a_plain_arm_of_another_day():
    from experiments import arms
    from experiments.growmtp.run import row

    def arm(name, t0):
        recs = [
            {
                "step": s,
                "time": t0 + 10.0 * s,
                "rollout_s": 4.0,
                "accept_len": 1.5,
                "reward_mean": 0.5,
            }
            for s in range(1, 13)
        ]
        return arms.ArmResult(arms.Arm(name, name), {"accuracy_after": 0.5}, recs, None)

    near = row(arm("grow", 3600.0), arm("plain", 0.0), window=5)
    assert near["step_s_ratio"]["all"] == pytest.approx(1.0)
    far = row(arm("grow", 20 * 3600.0), arm("plain", 0.0), window=5)
    assert "not_compared" in far["step_s_ratio"] and "not_compared" in far["rollout_s_ratio"]
    assert far["accept_len_last10"] == pytest.approx(1.5)  # acceptance is still compared


def test_growmtp_pays_by_the_cost_model_from_the_last_step_below_break_even(tmp_path):
    """Break-even = a γ = 3 cycle's cost over a plain step's at the full batch (0.3 / 0.1 s: 3
    tokens per cycle); the arm pays from the first step after the last whose running mean (window
    2) is below it, and the result names the head the costs were timed for and the arm's draft
    vocabulary."""
    from experiments import arms
    from experiments.growmtp.run import pays_by_cost_model

    bucket = {"32": {"step": 0.1, "cycle_1": 0.15, "cycle_3": 0.3}, "8": {"step": 0.05}}
    inputs = {"bucket_costs_s": bucket, "mtp": "a head of 8192 tokens"}
    alen = [1.0, 2.0, 4.0, 2.5, 3.5, 3.5, 4.0]  # running means 1, 1.5, 3, 3.25, 3, 3.5, 3.75
    recs = [{"step": s + 1, "accept_len": a} for s, a in enumerate(alen)]
    res = arms.ArmResult(arms.Arm("g", "g"), {}, recs, None, {"mtp": {"draft_vocab": 0}})
    got = pays_by_cost_model(res, inputs, window=2)
    assert got["break_even_accept_len"] == pytest.approx(3.0)
    assert (got["batch"], got["gamma"], got["pays_from_step"]) == (32, 3, 3)
    assert got["costs_timed_for"] == "a head of 8192 tokens" and got["arm_draft_vocab"] == 0
    recs[-1]["accept_len"] = 1.0  # the last running mean falls to 2.25: never
    assert pays_by_cost_model(res, inputs, window=2)["pays_from_step"] is None


def test_growmtp_predicts_each_arm_from_an_earlier_measurement(tmp_path):
    """experiments.growmtp.run.predicted: the cost model's prediction of an arm from the measured
    inputs of another study's results file (`predict.measured_inputs`), against the arm's own
    step times. Two asynchronous static plain steps of 4 rows (lengths 3, 5, 2, 8: 8 loop
    steps of 1 s alone), a 9 s learner, κ = 0.5, 1 s of host work a step: each step max(8, 9)
    + 0.5 x 8 + 1 = 14 s, the rollout 8 x 1.5 = 12 s beside the learner."""
    from bebop import config as config_lib
    from experiments import arms
    from experiments.e2e_speedup import predict
    from experiments.growmtp.run import predicted

    cfg = config_lib.load(
        "configs/demo.py", ["rollout.mode='plain'", "rollout.compact=False", "rl.max_staleness=1"]
    )[0]
    hist = np.bincount([3, 5, 2, 8]).tolist()
    recs = [
        {"step": 1, "time": 0.0},
        {"step": 2, "time": 10.0, "response_len_hist": hist, "rollout_s": 6.0, "train_s": 9.0},
        {"step": 3, "time": 22.0, "response_len_hist": hist, "rollout_s": 7.0, "train_s": 11.0},
    ]
    res = arms.ArmResult(arms.Arm("plain", "plain"), {}, recs, None, config_lib.to_dict(cfg))
    inputs = {"bucket_costs_s": {"4": {"step": 1.0}}, "learner_s": 9.0, "contention": 0.5}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"prediction": {"measured_inputs": inputs, "date": "d"}}))
    got = predicted({"plain": res}, path, tmp_path, "demo")
    a = got["arms"]["plain"]
    assert (a["measured_s"], a["measured_rollout_s"]) == (22.0, 13.0)
    assert a["predicted_s"] == pytest.approx(28.0)
    assert a["pred_error"] == pytest.approx(6 / 22)
    assert a["predicted_rollout_alone_s"] == pytest.approx(16.0)
    assert a["predicted_rollout_s"] == pytest.approx(24.0)
    assert got["max_abs_pred_error"] == pytest.approx(6 / 22)
    assert got["measured_by"] == {"command": None, "date": "d"}
    first = {"command": "python -m experiments.e2e_speedup.predict", "date": "d0"}
    again = {"measured_inputs": inputs, "date": "d", "measured_by": first}  # a --measured one
    path.write_text(json.dumps({"prediction": again}))
    assert predicted({"plain": res}, path, tmp_path, "demo")["measured_by"] == first
    other = {**inputs, "batch": cfg.rl.prompts_per_step * cfg.rl.group_size // 2}
    path.write_text(json.dumps({"prediction": {"measured_inputs": other}}))
    with pytest.raises(ValueError, match="measured costs are of rows per step"):
        predicted({"plain": res}, path, tmp_path, "demo")
    path.write_text("{}")
    with pytest.raises(SystemExit, match="no prediction with measured inputs"):
        predict.measured_inputs(path)
