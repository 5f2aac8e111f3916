"""The RL cost model (`bebop/costs.py`) on hand-made timings."""

import numpy as np
import pytest

from bebop import costs as C

# Per-iteration seconds by bucket size: a decode step, verifies of 2 and 3 tokens, a draft step.
COSTS = {
    4: {"step": 1.0, "verify_2": 1.2, "verify_3": 1.5, "draft": 0.25, "switch": 0.1},
    2: {"step": 0.6, "verify_2": 0.7, "verify_3": 1.0, "draft": 0.2},
}
LENGTHS = [3, 5, 2, 8]
PLAIN = C.ArmSpec()
PLAIN_TAIL = C.ArmSpec(compact=True, min_bucket=2)


def spec(compact=False, table=(), num_draft=2):
    return C.ArmSpec(
        speculative=True, compact=compact, num_draft=num_draft, draft_table=table, min_bucket=2
    )


def test_plain_hand_computed():
    # static: 8 steps at 4 rows. Tail-aware: 4 rows while more than 2 are live (after 3 steps
    # rows of length 2 and 3 have ended), one switch, then 5 more steps at 2 rows.
    assert C.rollout_time(LENGTHS, COSTS, PLAIN)["seconds"] == pytest.approx(8.0)
    r = C.rollout_time(LENGTHS, COSTS, PLAIN_TAIL)
    assert r["iterations"] == {4: 3.0, 2: 5.0}
    assert r["seconds"] == pytest.approx(3 * 1.0 + 5 * 0.6 + 0.1)


def test_speculative_hand_computed_at_full_and_zero_acceptance():
    # α = 1, γ = 2: every cycle emits 3 tokens; rows need 1, 2, 1, 3 cycles.
    assert C.rollout_time(LENGTHS, COSTS, spec(), 1.0)["seconds"] == pytest.approx(3 * 2.0)
    # tail-aware: after cycle 1 only the rows of 5 and 8 tokens are live -> 2 rows, 2 cycles more
    r = C.rollout_time(LENGTHS, COSTS, spec(compact=True), 1.0)
    assert r["iterations"] == {4: 1.0, 2: 2.0}
    assert r["seconds"] == pytest.approx(1 * 2.0 + 2 * (1.0 + 2 * 0.2) + 0.1)
    # α = 0: one token per cycle, each cycle still pays the verify and both drafts
    assert C.rollout_time(LENGTHS, COSTS, spec(), 0.0)["seconds"] == pytest.approx(8 * 2.0)


def test_expected_cycles_of_one_short_row():
    """One row of 2 tokens, γ = 1, α = 0.5: 1 cycle w.p. 1/2, else 2: 1.5 cycles. 4000 simulated
    batches: the mean's standard error is 0.5 / sqrt(4000) = 0.008; tolerance 0.04 (5 s.e.)."""
    c = {1: {"step": 1.0, "verify_2": 1.0, "draft": 0.0}}
    r = C.rollout_time([2], c, C.ArmSpec(speculative=True, num_draft=1, min_bucket=1), 0.5, 4000)
    assert r["iterations"][1] == pytest.approx(1.5, abs=0.04)


def test_long_row_runs_at_the_expected_tokens_per_cycle():
    """1000 tokens at α = (0.8, 0.5), γ = 2: E = 1 + 0.8 + 0.4 = 2.2 tokens per cycle, so about
    1000 / 2.2 = 454.5 cycles (+ <= 1 for the cut last one); 64 batches, tolerance 1 %."""
    c = {1: {"step": 1.0, "verify_3": 1.0, "draft": 0.0}}
    r = C.rollout_time([1000], c, C.ArmSpec(speculative=True, num_draft=2), [0.8, 0.5])
    assert r["iterations"][1] == pytest.approx(1000 / 2.2 + 0.5, rel=0.01)


@pytest.mark.parametrize("arm", [PLAIN_TAIL, spec(compact=True)])
def test_equal_lengths_tail_aware_equals_static(arm):
    # every row ends at once: no bucket ever hands over (α = 1: speculative rows too)
    static = C.ArmSpec(speculative=arm.speculative, num_draft=arm.num_draft)
    for n in (1, 7, 40):
        a = C.rollout_time([n] * 4, COSTS, arm, 1.0)
        b = C.rollout_time([n] * 4, COSTS, static, 1.0)
        assert a["seconds"] == pytest.approx(b["seconds"]) and a["iterations"][2] == 0


@pytest.mark.parametrize("compact", [False, True])
def test_gamma_zero_everywhere_is_plain(compact):
    plain = C.ArmSpec(compact=compact, min_bucket=2)
    lengths = np.random.default_rng(0).integers(1, 30, 4)
    want = C.rollout_time(lengths, COSTS, plain)["seconds"]
    for arm in (spec(compact, num_draft=0), spec(compact, table=((1, 0),))):
        for alpha in (0.0, 0.6, 1.0):
            assert C.rollout_time(lengths, COSTS, arm, alpha)["seconds"] == pytest.approx(want)


@pytest.mark.parametrize("compact", [False, True])
def test_monotonic_in_acceptance(compact):
    """Higher acceptance never costs more (the same uniforms for every α); from α = 0 to 1 the
    time falls by at least half (8 -> 3 cycles of the longest row)."""
    lengths = [3, 5, 2, 8]
    secs = [
        C.rollout_time(lengths, COSTS, spec(compact), [a, a * 0.9], sims=32)["seconds"]
        for a in np.linspace(0, 1, 11)
    ]
    assert all(x >= y - 1e-12 for x, y in zip(secs, secs[1:], strict=False)), secs
    assert secs[-1] < 0.5 * secs[0]


def test_per_bucket_draft_table_and_setup():
    # 4 rows draft γ = 0, 2 rows γ = 2 at α = 1: 3 plain steps at 4 rows (rows of 2 and 3 end),
    # then the rows at 3 of 5 and 3 of 8 tokens need 1 and 2 cycles
    c = {4: {**COSTS[4], "spec_setup": 0.5}, 2: COSTS[2]}
    r = C.rollout_time(LENGTHS, c, spec(True, table=((2, 2), (4, 0))), 1.0)
    assert r["gammas"] == {4: 0, 2: 2} and r["iterations"] == {4: 3.0, 2: 2.0}
    assert r["seconds"] == pytest.approx(0.5 + 3 * 1.0 + 0.1 + 2 * 1.4)


def test_step_time_sync_async():
    assert C.step_time(1.0, 3.0, False, reward_s=0.2, overhead_s=0.1) == pytest.approx(4.3)
    assert C.step_time(1.0, 3.0, True, reward_s=0.2) == pytest.approx(3.0)
    assert C.step_time(2.5, 1.0, True, reward_s=0.5) == pytest.approx(3.0)
    assert C.step_time(1.0, 3.0, True, contention=0.5) == pytest.approx(3.5)
    assert C.step_time(1.0, 3.0, True, contention=1.0) == C.step_time(1.0, 3.0, False)
    with pytest.raises(ValueError, match="contention"):
        C.step_time(1.0, 3.0, True, contention=1.5)


def test_rollout_in_step_reads_contention_as_both_phases_slowed_alike():
    """Asynchronously a rollout shorter than the learner lasts (1 + κ) times its time alone,
    one longer by κ times the learner's: then it is the step itself (`step_time`); without
    contention, or in a synchronous step, it takes its time alone."""
    assert C.rollout_in_step(1.0, 3.0, True, 0.5) == pytest.approx(1.5)
    assert C.rollout_in_step(4.0, 3.0, True, 0.5) == pytest.approx(5.5)
    assert C.rollout_in_step(4.0, 3.0, True, 0.5) == pytest.approx(
        C.step_time(4.0, 3.0, True, 0, 0, 0.5)
    )
    assert C.rollout_in_step(1.0, 3.0, True, 0.5) < C.step_time(1.0, 3.0, True, contention=0.5)
    assert C.rollout_in_step(1.0, 3.0, False, 0.5) == C.rollout_in_step(1.0, 3.0, True) == 1.0
    with pytest.raises(ValueError, match="contention"):
        C.rollout_in_step(1.0, 3.0, True, -0.1)
    steps = [{"lengths": LENGTHS, "learner_s": 10.0}, {"lengths": LENGTHS, "learner_s": 4.0}]
    r = C.predict_run(steps, COSTS, C.ArmSpec(asynchronous=True), contention=0.25)
    # 8 s alone each (the static plain loop above): 8 x 1.25 beside 10 s, 8 + 0.25 x 4 beside 4 s
    assert r["rollout_s"] == pytest.approx(16.0)
    assert r["rollout_in_step_per_step"] == pytest.approx([10.0, 9.0])
    assert r["rollout_in_step_s"] == pytest.approx(19.0)


def test_predict_run_sums_steps_with_their_tables():
    steps = [
        {"lengths": LENGTHS, "learner_s": 2.0, "alpha": 1.0, "draft_table": [[2, 2], [4, 0]]},
        {"lengths": LENGTHS, "learner_s": 2.0, "alpha": 1.0},
    ]
    r = C.predict_run(steps, COSTS, spec(True), reward_s=0.5)
    first = 3 * 1.0 + 0.1 + 2 * 1.4  # as in the draft-table test, without the set-up
    second = 1 * 2.0 + 0.1 + 2 * 1.4  # γ = 2 everywhere
    assert r["rollout_per_step"] == pytest.approx([first, second])
    assert r["step_s"] == pytest.approx(first + second + 2 * 2.5)


def test_bad_inputs_are_named():
    with pytest.raises(KeyError, match=r"costs\[2\].*verify_3"):
        C.rollout_time(LENGTHS, {4: COSTS[4], 2: {"step": 1.0}}, spec(True), 0.5)
    with pytest.raises(KeyError, match="batch size 2"):
        C.rollout_time(LENGTHS, {4: COSTS[4]}, PLAIN_TAIL)
    with pytest.raises(ValueError, match="alpha"):
        C.rollout_time(LENGTHS, COSTS, spec())
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        C.rollout_time(LENGTHS, COSTS, spec(), 1.5)


def test_roofline_bandwidth_then_compute_bound():
    s, hw = C.SHAPES["qwen3_8b"], C.H200
    c = C.roofline_costs(s, hw, [1, 4096], context=0, max_draft=2)
    # one row: a weight read, ~2 bytes per parameter over the bandwidth; a 3-token verify costs
    # the same read
    assert c[1]["step"] == pytest.approx(2 * s.params() / hw.hbm_bytes_s)
    assert c[1]["verify_3"] == pytest.approx(c[1]["step"])
    # 4096 rows: compute-bound, a 3-token verify costs 3 steps
    assert c[4096]["verify_3"] == pytest.approx(3 * c[4096]["step"])
    assert c[1]["draft"] < 0.2 * c[1]["step"]


def test_projection_cli_labels_itself(capsys):
    C.main(["project", "--model", "smollm2", "--rows", "8", "--budget", "32", "--prompt", "16"])
    out = capsys.readouterr().out.strip().splitlines()
    assert "PROJECTION" in out[0]
    import json

    last = json.loads(out[-1])
    assert "projection" in last["smollm2"]["label"]
    arms = last["smollm2"]["arms"]
    assert arms["plain_static_sync"]["rollout_speedup"] == 1.0
    assert arms["spec_static_sync"]["rollout_speedup"] > 1.0


def test_rollout_stats_record_the_length_histogram():
    """What `experiments.e2e_speedup.predict` reads the lengths of each step's batch from."""
    from types import SimpleNamespace

    from bebop.rl import records

    lengths = np.array([3, 5, 2, 8, 8, 0])
    sample = SimpleNamespace(
        lengths=lengths, entropy=np.zeros((6, 8)), tokens=np.zeros((6, 8), np.int32)
    )
    st = records.rollout_stats(np.zeros(6), 2, sample, None)
    hist = st["response_len_hist"]
    assert len(hist) == 9 and hist[8] == 2 and hist[0] == 1 and sum(hist) == 6
    assert sorted(np.repeat(np.arange(9), hist)) == sorted(lengths)


def test_measured_cycle_replaces_the_component_sum():
    c = {4: {**COSTS[4], "cycle_2": 3.0}, 2: {"step": 0.6, "cycle_2": 1.0}}
    # α = 1: 3 cycles at 4 rows (static); tail-aware 1 cycle at 4 rows, a switch, 2 at 2 rows
    assert C.rollout_time(LENGTHS, c, spec(), 1.0)["seconds"] == pytest.approx(9.0)
    assert C.rollout_time(LENGTHS, c, spec(True), 1.0)["seconds"] == pytest.approx(3 + 0.1 + 2)


def test_a_new_draft_table_compiles_its_programs_once():
    c = {4: {**COSTS[4], "compile_0": 5.0, "compile_2": 7.0}, 2: {**COSTS[2], "compile_0": 3.0}}
    arm = spec(True)
    first = C.programs(arm, 4)  # step 1 (excluded): γ = 2 at both buckets
    assert first == {(4, 2), (2, 2)}
    table = [[2, 0], [4, 2]]  # the 2-row bucket goes plain: one new program, compiled once
    steps = [{"lengths": LENGTHS, "learner_s": 0.0, "alpha": 1.0, "draft_table": table}] * 2
    r = C.predict_run(steps, c, arm, compiled=first)
    assert r["compile_s"] == pytest.approx(3.0)
    plain_tail = 1 * 2.0 + 0.1 + 5 * 0.6  # 1 cycle at 4 rows, then 5 plain steps at 2 rows
    assert r["rollout_per_step"] == pytest.approx([plain_tail + 3.0, plain_tail])


def test_predict_reads_each_step_of_an_arm_from_its_records():
    """`experiments.e2e_speedup.predict`: steps 2.. of an arm's records (step 1 compiles),
    each with its batch's lengths, its acceptance and the draft table derived after the
    previous rollout; the host overhead is the step time minus the learner's wait and update."""
    from experiments.e2e_speedup.predict import arm_steps

    def rec(step, t, table=None):
        r = {
            "step": step,
            "time": t,
            "response_len_hist": [0, 1, 0, 2],  # lengths 1, 3, 3
            "rollout_s": 0.5 * step,
            "reward_s": 0.1,
            "wait_s": 0.2,
            "train_s": 1.0,
            "accept_rate_1": 0.9,
            "accept_rate_2": 0.6,
        }
        return r if table is None else {**r, "draft_table": table}

    records = [rec(1, 100.0, [[8, 1]]), rec(2, 102.0), rec(3, 103.5, [[8, 0]]), rec(4, 105.0)]
    arm = C.ArmSpec(speculative=True, compact=True, num_draft=2)
    steps, measured, roll = arm_steps(records, arm, derived=True, learner_s=0.8)
    assert measured == pytest.approx(5.0) and roll == pytest.approx(0.5 * (2 + 3 + 4))
    assert [s["draft_table"] for s in steps] == [((8, 1),), ((8, 1),), ((8, 0),)]
    assert sorted(steps[0]["lengths"]) == [1, 3, 3]
    assert steps[0]["alpha"] == [0.9, 0.6] and steps[0]["learner_s"] == 0.8
    assert [s["overhead_s"] for s in steps] == pytest.approx([0.8, 0.3, 0.3])
    # a plain arm: no acceptance, no table
    plain, _, _ = arm_steps(records, C.ArmSpec(), derived=False, learner_s=0.8)
    assert "alpha" not in plain[0] and "draft_table" not in plain[0]
    with pytest.raises(KeyError, match="response_len_hist"):
        arm_steps([rec(1, 0.0), {"step": 2, "time": 1.0}], arm, True, 0.8)


def test_break_even_accept_length():
    # a cycle at γ = 2 and 4 rows costs 1.5 + 2 x 0.25 = 2 plain steps
    assert C.break_even_accept_len(COSTS, 4, 2) == pytest.approx(2.0)
    # at that accept length (α = 1 at position 1, 0 at 2: 2 tokens per cycle) one long row
    # takes as long speculatively as plain
    c = {1: {"step": 1.0, "verify_3": 1.5, "draft": 0.25}}
    arm = C.ArmSpec(speculative=True, num_draft=2)
    t_spec = C.rollout_time([400], c, arm, [1.0, 0.0])["seconds"]
    assert t_spec == pytest.approx(C.rollout_time([400], c, C.ArmSpec())["seconds"])


def test_growmtp_arms_are_predicted_with_their_own_recording_loop(monkeypatch):
    """`experiments.e2e_speedup.predict`: a GrowMTP arm's loop also records what its head
    trains on and drafts with its own head; its cycle at γ = `rollout.num_draft` is the measured
    one scaled by the ratio timed beside it, at each bucket it runs (every bucket when
    tail-aware), other γ and the plain step untouched; an arm whose loop (γ and rule included)
    was not timed is refused, naming the loop; `with_variants` times only the missing buckets
    and merges them into what was timed."""
    import dataclasses

    from bebop import config as config_lib
    from experiments.e2e_speedup import predict as P
    from experiments.e2e_speedup import timing

    from .conftest import REPO

    def replace(cfg, **sections):
        return dataclasses.replace(
            cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()}
        )

    frozen = config_lib.load(str(REPO / "configs/rl_smollm2.py"))[0]
    assert P.loop_variant(frozen) is None  # the loop `loop_costs` times
    grow = replace(
        frozen,
        rl=dict(mtp_strategy="growmtp"),
        mtp=dict(draft_vocab=0),
        rollout=dict(compact=False, num_draft=3),
    )
    name = P.loop_variant(grow)
    assert "record" in name and "γ 3" in name and "draft vocabulary full" in name
    rows = grow.rl.prompts_per_step * grow.rl.group_size
    half = rows // 2
    measured = {
        "bucket_costs_s": {
            str(rows): {"step": 1.0, "cycle_2": 1.5, "cycle_3": 2.0},
            str(half): {"step": 0.5, "cycle_2": 0.8, "cycle_3": 1.0},
        }
    }
    assert P.arm_bucket_costs(measured, frozen)[rows]["cycle_3"] == 2.0
    with pytest.raises(ValueError, match="no cycle of this arm's loop.*draft vocabulary full"):
        P.arm_bucket_costs(measured, grow)
    measured["variant_costs_s"] = {name: {"buckets": {str(rows): {"cycle_3": 9.0, "ratio": 1.25}}}}
    mine = P.arm_bucket_costs(measured, grow)
    assert mine[rows]["cycle_3"] == pytest.approx(2.5)
    assert mine[rows]["cycle_2"] == 1.5 and mine[rows]["step"] == 1.0
    assert mine[half]["cycle_3"] == 1.0  # a static arm runs the full batch only
    assert measured["bucket_costs_s"][str(rows)]["cycle_3"] == 2.0  # not modified
    # another γ is another loop: its ratio was not timed
    with pytest.raises(ValueError, match="γ 2"):
        P.arm_bucket_costs(measured, replace(grow, rollout=dict(num_draft=2)))
    # tail-aware: every bucket's cycle is needed, and each is scaled by its own ratio
    tail = replace(grow, rollout=dict(compact=True, min_bucket=half))
    assert P.loop_variant(tail) == name and P.variant_buckets(tail) == [rows, half]
    with pytest.raises(ValueError, match=rf"\[{half}\] rows"):
        P.arm_bucket_costs(measured, tail)
    timed = []

    def fake_costs(s, cfg, sizes, repeats):
        timed.append(list(sizes))
        return {str(b): {"cycle_3": 0.0, "ratio": 2.0} for b in sizes}

    monkeypatch.setattr(timing, "load", lambda *a: "setup")
    monkeypatch.setattr(timing, "variant_costs", fake_costs)
    cfgs = [config_lib.to_dict(c) for c in (frozen, grow, tail)]
    both = P.with_variants(measured, cfgs, None, "smollm2", "", 1)
    assert timed == [[half]]  # only what was missing
    tail_costs = P.arm_bucket_costs(both, tail)
    assert tail_costs[rows]["cycle_3"] == pytest.approx(2.5)  # the earlier ratio kept
    assert tail_costs[half]["cycle_3"] == pytest.approx(2.0)
    assert P.with_variants(both, cfgs, None, "smollm2", "", 1) is both  # nothing to time
    other = replace(tail, rl=dict(prompts_per_step=grow.rl.prompts_per_step * 2))
    timed.clear()
    assert P.with_variants(measured | {"batch": rows}, [config_lib.to_dict(other)], None, "", "", 1)
    assert timed == []  # another batch: left to predict_arm's refusal
