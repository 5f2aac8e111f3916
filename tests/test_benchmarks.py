"""The profiling helpers of `benchmarks.phases` (op -> Python stack -> loop phase) and the
rollout cost model (`benchmarks.common.cost_model`, defined in `benchmarks.rollout`)."""

import re

import jax
import jax.numpy as jnp

from benchmarks import common, phases


def _verify(x, w):
    return jnp.tanh(x @ w)


def _emit(y):
    return jnp.cumsum(y, axis=-1)


def _cycle(_, x_w):
    x, w = x_w
    return _emit(_verify(x, w)), w


def test_ops_are_attributed_to_the_phase_that_emitted_them():
    def loop(x, w):
        return jax.lax.fori_loop(0, 3, _cycle, (x, w))[0]

    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    hlo = jax.jit(loop).lower(x, w).compile().as_text()
    ops = phases.op_stacks(hlo)
    loops = re.findall(r"%(\S+) = \([^\n]*\) while\(", hlo)
    by_phase = {}
    for name, stack in ops.items():
        by_phase.setdefault(phases.phase_of(stack, speculative_loop=True), []).append(name)
    # The product belongs to `_verify`, the cumulative sum to `_emit`; the loop itself (a
    # container whose trace event spans both) is not an op of any phase.
    assert any(ops[n][-2:] == ["_cycle", "_verify"] for n in by_phase.get("_verify", []))
    assert by_phase.get("_emit")
    assert loops and not any(n in ops for n in loops)
    assert phases.phase_of(["sample", "init_state"], speculative_loop=True).startswith("outside")
    assert phases.phase_of([], speculative_loop=True).startswith("(no Python stack")
    assert phases.phase_of(["sample", "_run", "extend"], speculative_loop=False) == "model"


def test_opcode_reads_tuple_typed_instructions():
    rhs = "(s32[], u32[1,1]{1,0}, /*index=5*/u32[4]{0}) while(%t), condition=%c, body=%b"
    assert phases._opcode(rhs) == "while"
    assert phases._opcode("f32[16,1280]{1,0} fusion(%a, %b), kind=kCustom") == "fusion"


def test_rollout_cost_model_charges_the_speculative_set_up_and_not_the_plain_one():
    """`benchmarks.rollout`'s figures (`common.cost_model`) on hand-made timings. Plain: 10 s,
    1 s of it set-up, 90 steps -> a 0.1 s step. Speculative: 8 s, 1.6 s set-up, 30 cycles of a
    0.15 s verify + 2 drafts of 0.025 s (0.2 s) -> modelled 1.6 + 6 = 7.6 s; 900 tokens each. So
    the speedup is 10 / 8 = 1.25, the prediction 10 / 7.6, the efficiency 7.6 / 8 = 0.95 and the
    cycles alone 6 / 6.4 = 0.9375 of their model (0.95 = 0.2 + 0.8 x 0.9375: set-up share 0.2)."""
    plain = dict(t=10.0, setup=1.0, steps=90, tokens=900)
    spec = dict(t=8.0, setup=1.6, cycles=30, tokens=900)
    costs = {"verify_1": 0.1, "verify_3": 0.15, "draft": 0.025}
    got = common.cost_model(plain, spec, costs, gamma=2)
    want = {
        "speedup": 1.25,
        "predicted_speedup": 10 / 7.6,
        "efficiency": 0.95,
        "loop_efficiency": 0.9375,
        "step_ms": 100.0,
        "cycle_ms": 6400 / 30,
        "model_cycle_ms": 200.0,
        "setup_share_spec": 0.2,
        "verify_cost": 1.5,
        "verify_cost_vs_1": 1.5,
        "draft_cost": 0.25,
    }
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert abs(got[k] - v) < 1e-9, (k, got[k], v)
