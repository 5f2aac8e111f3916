"""The profiling helpers of `benchmarks/phases.py` (op -> Python stack -> loop phase)."""

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import phases  # noqa: E402


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
