"""Where a sampler's loop spends its time: a `jax.profiler` trace of the compiled plain or
speculative sampler, each executed op attributed to the phase of the loop that emitted it.

    python -m benchmarks.phases --model demo --run runs/demo --batches 1 --gammas 2
    python -m benchmarks.phases --model smollm2 [--mtp_ckpt DIR/mtp/ckpt] --batches 8 --gammas 3
    python -m benchmarks.phases --model demo --gammas 0        # the plain sampler

How: the optimised HLO names every instruction and points it at its Python stack (the module's
`StackFrames` table); the trace has one event per executed op (a thunk of XLA:CPU) under the
same name. An op belongs to the outermost frame that is a phase of `speculative._cycle`
(`_catch_up`, `_draft`, `_verify`, `accept`, `_emit`, `_roll_back`) or, for the plain sampler,
of its step (`model`: the forward; else the function that emitted the op); ops outside the loop
(prefill, set-up, output) are one line. Figures are per loop iteration (cycle or step): traced
op time and op count per phase, their shares, and the costliest ops. Tracing slows every op by
a fixed amount, so phases made of many small ops look larger than they are; the untraced wall
time per iteration is printed next to it. EOS is off (every row emits `--new_tokens`); the
prompts are the task's (`benchmarks.common.load_models`). One cell: `--batches`, `--gammas` and
`--temperatures` take one value each.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
import time

import jax

from bebop import config as config_lib
from bebop import model, sampling, sharding, speculative
from benchmarks.common import load_models

SPEC_PHASES = ("_catch_up", "_draft", "_verify", "accept", "_emit", "_roll_back")
CONTAINERS = ("while", "call", "conditional")


def _table(text: str, name: str) -> list[str]:
    """The lines of one of the HLO module's trailing tables (`FunctionNames`, ...)."""
    parts = text.split(f"\n{name}\n")
    return parts[1].split("\n\n")[0].splitlines() if len(parts) > 1 else []


def _opcode(rhs: str) -> str:
    """The opcode of an HLO instruction from the text after `=`: its type (a tuple type is a
    parenthesised list, possibly with `/*index=N*/` comments), then `opcode(`."""
    end, depth = 0, 0
    while rhs.startswith("(") and end < len(rhs):
        depth += {"(": 1, ")": -1}.get(rhs[end], 0)
        end += 1
        if depth == 0:
            break
    m = re.search(r"\s([a-z][\w-]*)\(", rhs[end:])
    return m.group(1) if m else ""


def op_stacks(hlo_text: str) -> dict[str, list[str]]:
    """Instruction name -> the Python functions of its stack, outermost first; [] for an op that
    XLA made or rewrote without keeping its origin (an inserted copy; on CPU the 1-row matrix
    products, rewritten as transposed-operand dots). Ops that only hold other ops -- a while loop, a
    call -- are left out."""
    functions = {}
    for line in _table(hlo_text, "FunctionNames"):
        i, name = line.split(" ", 1)
        functions[int(i)] = name.strip('"')
    locations = {}
    for line in _table(hlo_text, "FileLocations"):
        i = int(line.split(" ", 1)[0])
        locations[i] = int(re.search(r"function_name_id=(\d+)", line).group(1))
    frames = {}
    for line in _table(hlo_text, "StackFrames"):
        m = re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)", line)
        frames[int(line.split(" ", 1)[0])] = (int(m.group(1)), int(m.group(2)))

    def stack(frame: int) -> list[str]:
        out, seen = [], set()
        while frame in frames and frame not in seen:  # parents are printed as their id + 1
            seen.add(frame)
            loc, parent = frames[frame]
            out.append(functions[locations[loc]])
            frame = parent - 1
        return out[::-1]

    ops = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*)", line)
        if m and _opcode(m.group(2)) not in CONTAINERS:  # their events span the ops inside
            frame = re.search(r"stack_frame_id=(\d+)", m.group(2))
            ops[m.group(1)] = stack(int(frame.group(1))) if frame else []
    return ops


def phase_of(stack: list[str], speculative_loop: bool) -> str:
    """The loop phase an op with this Python stack belongs to (the outermost phase frame)."""
    if not stack:
        return "(no Python stack: made or rewritten by XLA)"
    if speculative_loop and "run_cycles" in stack and "_cycle" not in stack:
        return "loop condition"
    loop = "_cycle" if speculative_loop else "_run"
    if loop not in stack:
        return "outside the loop (prefill, set-up, output)"
    if speculative_loop:
        return next((f for f in stack if f in SPEC_PHASES), "loop (other)")
    if "extend" in stack:
        return "model"
    return stack[-1]  # the plain step's sampling and bookkeeping, by function


def trace_events(fn, runs: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(runs):
                jax.block_until_ready(fn())
        (path,) = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
        trace = json.load(gzip.open(path))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["demo", "smollm2"], default="demo")
    ap.add_argument("--run", "--workdir", default="runs/demo", help="--model demo: a finished run")
    ap.add_argument("--mtp_ckpt", default="")
    ap.add_argument("--config", default="configs/rl_smollm2.py")
    ap.add_argument("--batches", "--batch", dest="batch", type=int, default=1, help="one value")
    ap.add_argument(
        "--gammas",
        "--gamma",
        dest="gamma",
        type=int,
        default=2,
        help="one value (0: the plain sampler)",
    )
    ap.add_argument(
        "--temperatures",
        "--temperature",
        dest="temperature",
        type=float,
        default=0.7,
        help="one value",
    )
    ap.add_argument("--new_tokens", type=int, default=40)
    ap.add_argument("--repeats", "--runs", type=int, default=5, help="traced (and timed) calls")
    ap.add_argument("--prompts", choices=["task", "mixed"], default="task")
    ap.add_argument("--top", type=int, default=8, help="costliest ops listed")
    ap.add_argument("--phase", default="", help="list the costliest ops of this phase only")
    args = ap.parse_args()
    args.num_prompts = args.batch  # one prompt a row (`load_models` reads it)

    mesh = sharding.make_mesh(config_lib.MeshConfig(data=1), jax.devices()[:1])
    pol, mtp, vocab, tok, ids, _ = load_models(args, mesh)
    vocab = None if vocab is None else jax.numpy.asarray(vocab)
    toks, lens = sampling.pad_prompts(ids, tok.pad_id)
    layers = model.decode_layers_jit(*pol)
    scfg = sampling.SamplingConfig(
        temperature=args.temperature,
        max_new_tokens=args.new_tokens,
        eos_ids=(-1,),
        pad_id=tok.pad_id,
    )
    key = jax.random.key(1)
    if args.gamma:
        spec = speculative.SpecConfig(args.gamma, "rejection")
        jitted = speculative.sample_jit
        call = (*pol, *mtp, toks, lens, key, scfg, spec, vocab, layers)
    else:
        jitted, call = sampling.sample_jit, (*pol, toks, lens, key, scfg, layers)
    out = jax.block_until_ready(jitted(*call))
    iters = int(out.stats.verify_calls.max()) if args.gamma else args.new_tokens
    wall = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(jitted(*call))
        wall = min(wall, time.perf_counter() - t0)
    ops = op_stacks(jitted.lower(*call).compile().as_text())

    per = args.repeats * iters
    time_by, count_by, op_time = collections.Counter(), collections.Counter(), collections.Counter()
    for e in trace_events(lambda: jitted(*call), args.repeats):
        if e["name"] in ops:
            phase = phase_of(ops[e["name"]], bool(args.gamma))
            time_by[phase] += e["dur"] / 1e3 / per
            count_by[phase] += 1 / per
            fn = ops[e["name"]][-1] if ops[e["name"]] else "-"
            op_time[(e["name"], phase, fn)] += e["dur"] / 1e3 / per
    traced = sum(time_by.values())
    kind = f"speculative (γ = {args.gamma}, rejection)" if args.gamma else "plain"
    print(
        f"{args.model}, {kind}, batch {args.batch}: {iters} iterations, "
        f"{1e3 * wall / iters:.3f} ms each untraced, {traced:.3f} ms of traced ops each",
        flush=True,
    )
    for phase, ms in time_by.most_common():
        print(f"  {phase:24s} {ms:8.3f} ms {ms / traced:6.1%} {count_by[phase]:7.1f} ops")
    print(f"  costliest ops{' of ' + args.phase if args.phase else ''}:", flush=True)
    listed = [(k, ms) for k, ms in op_time.most_common() if args.phase in ("", k[1])]
    for (name, phase, fn), ms in listed[: args.top]:
        print(f"    {name:28s} {ms:8.3f} ms  {phase} / {fn}")
    res = {
        "model": args.model,
        "batch": args.batch,
        "gamma": args.gamma,
        "iterations": iters,
        "wall_ms_per_iter": 1e3 * wall / iters,
        "traced_ms_per_iter": traced,
        "phases": {
            p: {"ms": ms, "share": ms / traced, "ops": count_by[p]} for p, ms in time_by.items()
        },
    }
    print(json.dumps(res))


if __name__ == "__main__":
    main()
