"""A cost model of an RL run: the rollout time and the step time of plain static, plain
tail-aware and speculative arms, synchronous and asynchronous, from measured per-bucket costs.

Inputs (all seconds are measured elsewhere, e.g. `spec_compacted.bucket_costs`):

* `costs`: batch size b -> {"step": one plain decode step, "verify_{W}": one W-token verify
  iteration of the speculative loop, "draft": one MTP draft step} at b rows (the layout of
  `spec_compacted.bucket_costs` and `compaction.draft_table`); optional "setup" and
  "spec_setup" at the full batch (the prefill and first token of the plain / speculative
  sampler) and "switch" / "spec_switch" (one compaction: the host round trip, gather and
  scatter). A measured loop iteration "cycle_{γ}" (a verify cycle of the real loop at γ, e.g.
  timed with EOS off) replaces `verify_{γ+1} + γ draft` where given.
* the response lengths of one batch (tokens, EOS included);
* the per-position acceptance α_1 .. α_γ (α_k: draft k accepted given drafts 1 .. k-1 were);
* the learner's seconds for the step (e.g. seconds per learner token x the tokens of its
  fixed-shape batch), the reward's, and the step's other host work.

Rollout (`rollout_time`). A decode loop runs every row of its bucket each iteration, so an
iteration costs the bucket's cost whatever the number of live rows: a plain step, or a verify
cycle of `verify_{γ+1} + γ draft` (γ = 0: a plain step). Plain rows emit one token per
iteration. A speculative row emits 1 + (leading accepted drafts) tokens per cycle, drawn
independently per row and cycle from the per-position acceptance, and never past its length
(EOS or the budget cuts the cycle). The static loop runs until its last row ends; the
tail-aware loop (`compaction.run`) runs bucket b while more than b/2 rows are live, then
continues at b/2 (one `switch` each), down to `min_bucket`, where it runs to the end; a bucket
of b rows drafts the γ of `compaction.draft_for_batch(table, b, num_draft)`. The speculative
loop is simulated (`sims` independent batches, a fixed seed: a pure function of its
arguments; one uniform per row, cycle and draft position, drawn in the same order whatever the
acceptance, so a higher acceptance never costs more cycles); the plain loop is exact.

Step (`step_time`). The rollout worker samples and scores a batch (W = rollout + reward:
rewards are scored in the worker, `rl.rollouts.Rollouts.__call__`); the learner updates (L).
Synchronous: step = W + L + overhead. Asynchronous (staleness >= 1: the next batch is sampled
while the learner updates): step = max(W, L) + κ min(W, L) + overhead, where κ, the
contention, is the share of the shorter phase that does not overlap: 0 when sampler and
learner have their own hardware, up to 1 when both saturate the same cores (no gain at all);
on a CPU it is measured by running a rollout and a learner step at once (see
`experiments.e2e_speedup.predict`). Read as both phases slowing down alike while they overlap,
κ also gives the rollout's own seconds inside an asynchronous step (what a run records as its
rollout time, `rollout_in_step`): the shorter phase lasts (1 + κ) times its time alone, the
longer one κ times the shorter's alone time more.

`roofline_costs` gives the same cost layout for an accelerator from a stated roofline (HBM
bandwidth and peak FLOP/s), for the projections printed by `python -m bebop.costs project`:
labelled projections, not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping, Sequence

import numpy as np

from bebop import compaction

Costs = Mapping[int, Mapping[str, float]]


@dataclasses.dataclass(frozen=True)
class ArmSpec:
    """How an arm decodes and steps. `speculative`: verify cycles with an MTP draft of γ =
    `num_draft` (per bucket: `draft_table`, `compaction.draft_for_batch`); `compact`: tail-aware
    buckets down to `min_bucket`; `asynchronous`: the next batch is sampled during the update."""

    speculative: bool = False
    compact: bool = False
    asynchronous: bool = False
    num_draft: int = 0
    draft_table: tuple[tuple[int, int], ...] = ()
    min_bucket: int = 8

    def __post_init__(self):
        if self.speculative and self.num_draft < 0:
            raise ValueError(f"ArmSpec.num_draft: must be >= 0, got {self.num_draft}")
        if self.min_bucket < 1:
            raise ValueError(f"ArmSpec.min_bucket: must be >= 1, got {self.min_bucket}")


def _check_costs(costs: Costs, sizes: Sequence[int], gammas: Sequence[int]) -> None:
    for b, g in zip(sizes, gammas, strict=True):
        if b not in costs:
            raise KeyError(f"costs: no entry for batch size {b} (have {sorted(costs)})")
        need = ["step"] + (
            [f"verify_{g + 1}", "draft"] if g and f"cycle_{g}" not in costs[b] else []
        )
        missing = [k for k in need if k not in costs[b]]
        if missing:
            raise KeyError(f"costs[{b}]: missing {missing} (have {sorted(costs[b])})")


def iteration_cost(costs: Costs, batch: int, gamma: int) -> float:
    """Seconds of one loop iteration at `batch` rows: a plain step (γ = 0) or a verify cycle."""
    c = costs[batch]
    if gamma == 0:
        return float(c["step"])
    if f"cycle_{gamma}" in c:
        return float(c[f"cycle_{gamma}"])
    return float(c[f"verify_{gamma + 1}"] + gamma * c["draft"])


def rates(alpha: float | Sequence[float] | None, num_draft: int) -> np.ndarray:
    """α_1 .. α_`num_draft` (`compaction._rates`: a float for all positions, a shorter sequence
    extended with its last entry), each checked to lie in [0, 1]."""
    if num_draft == 0:
        return np.zeros(0)
    if alpha is None:
        raise ValueError("speculative arm: the per-position acceptance `alpha` is required")
    a = np.asarray(compaction._rates(alpha, num_draft), np.float64)
    if ((a < 0) | (a > 1)).any():
        raise ValueError(f"acceptance rates must lie in [0, 1], got {a.tolist()}")
    return a


def rollout_time(
    lengths: Sequence[int],
    costs: Costs,
    arm: ArmSpec,
    alpha: float | Sequence[float] | None = None,
    sims: int = 64,
    seed: int = 0,
) -> dict:
    """Predicted seconds of one rollout of a batch whose rows emit `lengths` tokens (see the
    module docstring). Returns `seconds` (mean over the simulated batches), `iterations` per
    bucket size (mean), `gammas` per bucket size, and `loop_s` / `setup_s` / `switch_s`."""
    lengths = np.maximum(np.asarray(lengths, np.int64), 1)
    batch = int(lengths.size)
    sizes = compaction.bucket_sizes(batch, arm.min_bucket) if arm.compact else [batch]
    if arm.speculative:
        gammas = [compaction.draft_for_batch(arm.draft_table, b, arm.num_draft) for b in sizes]
    else:
        gammas = [0] * len(sizes)
    _check_costs(costs, sizes, gammas)
    y = max(gammas)
    a = rates(alpha, y)
    cost = np.asarray([iteration_cost(costs, b, g) for b, g in zip(sizes, gammas, strict=True)])
    nxt = np.asarray(sizes[1:] + [0])  # the live count at which each bucket hands over
    g_of = np.asarray(gammas)
    sims = sims if y else 1  # a plain loop is deterministic
    rng = np.random.default_rng(seed)
    emitted = np.zeros((sims, batch), np.int64)
    bucket = np.zeros(sims, np.int64)  # index into sizes
    iters = np.zeros((sims, len(sizes)))
    switches = np.zeros(sims)
    live = emitted < lengths
    while live.any():
        running = live.any(1)
        u = rng.random((sims, batch, y))  # one per row, cycle and draft position
        gam = g_of[bucket]  # [S]
        if y:
            ok = (u < a) & (np.arange(y)[None, None] < gam[:, None, None])
            n_acc = np.cumprod(ok, axis=2).sum(2)
        else:
            n_acc = 0
        emitted = np.where(live, np.minimum(emitted + 1 + n_acc, lengths), emitted)
        iters[np.arange(sims), bucket] += running
        live = emitted < lengths
        n_live = live.sum(1)
        # hand over while the live rows fit the next bucket (several at once if they fit)
        while True:
            go = running & (n_live > 0) & (nxt[bucket] > 0) & (n_live <= nxt[bucket])
            if not go.any():
                break
            bucket = bucket + go
            switches += go
    c = costs[batch]
    setup = float(c.get("spec_setup" if y else "setup", 0.0))
    switch = float(c.get("spec_switch" if y else "switch", c.get("switch", 0.0)))
    loop_s = (iters * cost[None]).sum(1)
    total = loop_s + setup + switches * switch
    return {
        "seconds": float(total.mean()),
        "loop_s": float(loop_s.mean()),
        "setup_s": setup,
        "switch_s": float((switches * switch).mean()),
        "iterations": {b: float(iters[:, i].mean()) for i, b in enumerate(sizes)},
        "gammas": dict(zip(sizes, gammas, strict=True)),
    }


def break_even_accept_len(costs: Costs, batch: int, gamma: int) -> float:
    """Tokens per cycle at which speculation at γ pays at `batch` rows: a cycle costs what that
    many plain steps cost (accept lengths above it make the speculative loop faster)."""
    return iteration_cost(costs, batch, gamma) / iteration_cost(costs, batch, 0)


def derived_table(
    alpha: float | Sequence[float], costs: Costs, num_draft: int, sizes: Sequence[int]
) -> tuple[tuple[int, int], ...]:
    """The derived draft table (`compaction.draft_table`, as `rl.rollouts.Rollouts` derives it) over
    the bucket sizes `sizes`."""
    return compaction.draft_table(alpha, {b: costs[b] for b in sizes}, num_draft)


def step_time(
    rollout_s: float,
    learner_s: float,
    asynchronous: bool,
    reward_s: float = 0.0,
    overhead_s: float = 0.0,
    contention: float = 0.0,
) -> float:
    """Seconds of one RL step (see the module docstring): W = rollout + reward, L = learner;
    synchronous W + L, asynchronous max(W, L) + `contention` * min(W, L); plus `overhead_s`."""
    if not 0.0 <= contention <= 1.0:
        raise ValueError(f"contention: must lie in [0, 1], got {contention}")
    w, lrn = rollout_s + reward_s, learner_s
    if asynchronous:
        return max(w, lrn) + contention * min(w, lrn) + overhead_s
    return w + lrn + overhead_s


def rollout_in_step(
    rollout_s: float, learner_s: float, asynchronous: bool, contention: float = 0.0
) -> float:
    """Seconds of the rollout itself inside a step (see the module docstring): `rollout_s`
    (its time alone) in a synchronous step; asynchronously `rollout_s` + κ min(`rollout_s`,
    `learner_s`), the learner running beside it."""
    if not 0.0 <= contention <= 1.0:
        raise ValueError(f"contention: must lie in [0, 1], got {contention}")
    return rollout_s + (contention * min(rollout_s, learner_s) if asynchronous else 0.0)


def predict_step(
    lengths: Sequence[int],
    costs: Costs,
    arm: ArmSpec,
    learner_s: float,
    alpha: float | Sequence[float] | None = None,
    reward_s: float = 0.0,
    overhead_s: float = 0.0,
    contention: float = 0.0,
    sims: int = 64,
    seed: int = 0,
) -> dict:
    """`rollout_time` and `step_time` of one step: {"rollout_s", "step_s", "rollout": ...}."""
    r = rollout_time(lengths, costs, arm, alpha, sims, seed)
    step = step_time(r["seconds"], learner_s, arm.asynchronous, reward_s, overhead_s, contention)
    return {"rollout_s": r["seconds"], "step_s": step, "rollout": r}


def programs(arm: ArmSpec, batch: int) -> set[tuple[int, int]]:
    """The (bucket size, γ) loop programs a rollout of `batch` rows runs (γ = 0: plain)."""
    sizes = compaction.bucket_sizes(batch, arm.min_bucket) if arm.compact else [batch]
    if not arm.speculative:
        return {(b, 0) for b in sizes}
    return {(b, compaction.draft_for_batch(arm.draft_table, b, arm.num_draft)) for b in sizes}


def predict_run(
    steps: Sequence[Mapping],
    costs: Costs,
    arm: ArmSpec,
    compiled: set[tuple[int, int]] | None = None,
    **kw,
) -> dict:
    """Sums `predict_step` over `steps`, each a mapping of its arguments (`lengths`,
    `learner_s`, and optionally `alpha`, `reward_s`, `overhead_s`, `draft_table`: the table
    that step's rollout used, replacing `arm.draft_table`); `kw`: arguments common to all.
    A rollout that runs a loop program not in `compiled` ((bucket size, γ) pairs, e.g. those
    of the first, excluded step; `programs`) first compiles it: `costs[b]["compile_{γ}"]`
    seconds where given (a new draft table in a tail-aware arm), added to its rollout.
    Returns total `rollout_s` (alone), `rollout_in_step_s` (`rollout_in_step`), `step_s`,
    `compile_s` and the per-step lists."""
    roll, inside, step = [], [], []
    seed = kw.pop("seed", 0)
    seen = set(compiled or ())
    compile_total = 0.0
    for i, s in enumerate(steps):
        s = dict(s)
        a = arm
        if "draft_table" in s:
            a = dataclasses.replace(arm, draft_table=tuple(map(tuple, s.pop("draft_table"))))
        new = programs(a, len(s["lengths"])) - seen
        seen |= new
        comp = sum(float(costs[b].get(f"compile_{g}", 0.0)) for b, g in new)
        compile_total += comp
        p = predict_step(costs=costs, arm=a, seed=seed + i, **s, **kw)
        r = p["rollout_s"] + comp
        roll.append(r)
        both = {**kw, **s}
        contention = both.get("contention", 0.0)
        inside.append(rollout_in_step(r, both["learner_s"], a.asynchronous, contention))
        step.append(
            step_time(
                r,
                both["learner_s"],
                a.asynchronous,
                both.get("reward_s", 0.0),
                both.get("overhead_s", 0.0),
                contention,
            )
        )
    return {
        "rollout_s": float(sum(roll)),
        "rollout_in_step_s": float(sum(inside)),
        "step_s": float(sum(step)),
        "compile_s": compile_total,
        "rollout_per_step": roll,
        "rollout_in_step_per_step": inside,
        "step_per_step": step,
    }


# ----------------------------------------------------------------------------- roofline


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A roofline: a forward costs max(bytes / `hbm_bytes_s`, FLOPs / `flops`) seconds plus
    `launch_s` (per iteration: kernel launches, sampling)."""

    name: str
    flops: float  # dense bf16 FLOP/s
    hbm_bytes_s: float
    launch_s: float = 0.0


H200 = Hardware("H200 (roofline: 4.3 TB/s HBM, 790 TFLOP/s bf16)", 790e12, 4.3e12)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder's shape, for roofline costs."""

    name: str
    num_layers: int
    dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffw_dim: int
    vocab: int
    tied: bool
    mtp_layers: int = 1

    def layer_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        return attn + 3 * self.dim * self.ffw_dim

    def params(self) -> int:
        """Parameters a decode step reads: the layers and the head (the embedding table is a
        lookup of one row per token unless it is the head)."""
        return self.num_layers * self.layer_params() + self.vocab * self.dim

    def draft_params(self) -> int:
        """One MTP draft step: one MTP layer (a decoder layer plus its 2D x D input
        projection) and the head."""
        return self.layer_params() + 2 * self.dim * self.dim + self.vocab * self.dim


SHAPES = {
    # SmolLM2-135M-Instruct (the GGUF's architecture) and Qwen3-8B (its config.json)
    "smollm2": Shape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, True),
    "qwen3_8b": Shape("Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936, False),
}


def _forward_s(hw: Hardware, params: int, layers: int, s: Shape, rows: int, width: int, ctx: int):
    """A forward over `width` new tokens of `rows` rows with `ctx` cached tokens, bf16."""
    tokens = rows * width
    kv_bytes = 2 * rows * ctx * layers * 2 * s.num_kv_heads * s.head_dim  # K and V, read once
    weight_bytes = 2 * params
    flops = 2 * params * tokens + 4 * tokens * ctx * layers * s.num_heads * s.head_dim
    return max((weight_bytes + kv_bytes) / hw.hbm_bytes_s, flops / hw.flops) + hw.launch_s


def roofline_costs(
    shape: Shape, hw: Hardware, sizes: Sequence[int], context: int, max_draft: int
) -> dict:
    """`costs` (the `rollout_time` layout) of `shape` on `hw` at each batch size of `sizes` and
    `context` cached tokens: step, verify_{W} for W = 1 .. max_draft + 1, draft."""
    out = {}
    for b in sizes:
        c = {
            f"verify_{w}": _forward_s(hw, shape.params(), shape.num_layers, shape, b, w, context)
            for w in range(1, max_draft + 2)
        }
        c["step"] = c["verify_1"]
        c["draft"] = _forward_s(hw, shape.draft_params(), shape.mtp_layers, shape, b, 1, context)
        out[b] = c
    return out


def roofline_learner_s(shape: Shape, hw: Hardware, tokens: int, mfu: float = 0.4) -> float:
    """GRPO learner step over `tokens` tokens: forward + backward (6 FLOPs per parameter and
    token, the embedding table included) at `mfu` of peak."""
    n = shape.num_layers * shape.layer_params() + shape.vocab * shape.dim * (1 if shape.tied else 2)
    return 6 * n * tokens / (hw.flops * mfu)


def synthetic_lengths(rows: int, budget: int, median_frac: float = 0.5) -> np.ndarray:
    """A stated length distribution for projections: row quantiles of a log-normal with its
    median at `median_frac` x `budget` and σ = 0.5, cut at the budget."""
    q = (np.arange(rows) + 0.5) / rows
    from statistics import NormalDist

    z = np.asarray([NormalDist().inv_cdf(x) for x in q])
    return np.clip(np.round(budget * median_frac * np.exp(0.5 * z)), 1, budget).astype(np.int64)


def project(
    shape: Shape,
    hw: Hardware,
    rows: int,
    budget: int,
    prompt: int,
    alpha: Sequence[float],
    num_draft: int,
    min_bucket: int = 8,
    mfu: float = 0.4,
    contention: float = 0.0,
) -> dict:
    """Projected rollout and step seconds of the five arms for `shape` on `hw` (a roofline:
    labelled a projection): plain static, plain tail-aware, speculative static at `num_draft`,
    speculative tail-aware with the derived table; sync and async."""
    sizes = compaction.bucket_sizes(rows, min_bucket)
    costs = roofline_costs(shape, hw, sizes, prompt + budget // 2, num_draft)
    lengths = synthetic_lengths(rows, budget)
    learner = roofline_learner_s(shape, hw, rows * (prompt + budget), mfu)
    table = derived_table(alpha, costs, num_draft, sizes)
    arms = {
        "plain_static": ArmSpec(),
        "plain_compact": ArmSpec(compact=True, min_bucket=min_bucket),
        "spec_static": ArmSpec(speculative=True, num_draft=num_draft),
        "spec_compact_derived": ArmSpec(
            speculative=True,
            compact=True,
            num_draft=num_draft,
            draft_table=table,
            min_bucket=min_bucket,
        ),
    }
    res = {}
    for name, arm in arms.items():
        r = rollout_time(lengths, costs, arm, alpha)
        for mode in ("sync", "async"):
            s = step_time(r["seconds"], learner, mode == "async", contention=contention)
            res[f"{name}_{mode}"] = {"rollout_s": r["seconds"], "step_s": s}
    base = res["plain_static_sync"]
    for v in res.values():
        v["rollout_speedup"] = base["rollout_s"] / v["rollout_s"]
        v["step_speedup_vs_plain_static_sync"] = base["step_s"] / v["step_s"]
    return {
        "label": "projection from a roofline, not a measurement",
        "hardware": dataclasses.asdict(hw),
        "shape": dataclasses.asdict(shape),
        "rows": rows,
        "budget": budget,
        "prompt": prompt,
        "alpha": list(alpha),
        "num_draft": num_draft,
        "mfu": mfu,
        "contention": contention,
        "lengths": "log-normal quantiles, median half the budget, sigma 0.5 (synthetic)",
        "length_median": float(np.median(lengths)),
        "length_max": int(lengths.max()),
        "derived_table": [list(e) for e in table],
        "learner_s": learner,
        "bucket_costs_ms": {b: {k: v * 1e3 for k, v in c.items()} for b, c in costs.items()},
        "arms": res,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description="cost-model projections on a roofline")
    ap.add_argument("command", choices=["project"])
    ap.add_argument("--model", choices=sorted(SHAPES), action="append")
    # defaults: configs/rl_smollm2.py's batch (32 rows, 96 new tokens), and the acceptance of
    # the recipe's MTP on SmolLM2 (RS, γ = 3: 0.71 / 0.68 / 0.74 per position, README)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--budget", type=int, default=96, help="max new tokens")
    ap.add_argument("--prompt", type=int, default=96, help="prompt tokens")
    ap.add_argument("--alpha", default="0.71,0.68,0.74", help="per-position acceptance")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--mfu", type=float, default=0.4, help="the learner's share of peak FLOP/s")
    ap.add_argument("--contention", type=float, default=0.0, help="async overlap loss, 0..1")
    ap.add_argument(
        "--launch_us", type=float, default=0.0, help="fixed microseconds per forward (launches)"
    )
    args = ap.parse_args(argv)
    hw = dataclasses.replace(H200, launch_s=args.launch_us * 1e-6)
    alpha = [float(x) for x in args.alpha.split(",")]
    out = {}
    for name in args.model or sorted(SHAPES):
        p = project(
            SHAPES[name],
            hw,
            args.rows,
            args.budget,
            args.prompt,
            alpha,
            args.gamma,
            mfu=args.mfu,
            contention=args.contention,
        )
        out[name] = p
        print(
            f"PROJECTION ({p['label']}): {p['shape']['name']} on {hw.name}, {args.rows} rows, "
            f"{args.launch_us:g} us fixed per forward"
        )
        for arm, v in p["arms"].items():
            print(
                f"  {arm:27s} rollout {v['rollout_s'] * 1e3:9.2f} ms ({v['rollout_speedup']:.2f}x)"
                f"  step {v['step_s'] * 1e3:9.2f} ms "
                f"({v['step_speedup_vs_plain_static_sync']:.2f}x plain static sync)"
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
