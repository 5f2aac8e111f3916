"""`benchmarks/device.sh`'s summary: reads OUT/<step>.json (each step's last JSON line, or
nothing) and the steps' exit records, writes OUT/summary.json and prints it as one line.

    python -m benchmarks.device_summary OUT STEPS_TSV SETUP_JSON

STEPS_TSV: one line per step, `name<TAB>exit status<TAB>seconds<TAB>limit` (exit status 124: cut
at its limit; `skipped`: no time was left). The summary holds, per step, its status and its
headline figures (`headline`); each step's whole JSON stays in OUT/<step>.json.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

DECODE_KEYS = re.compile(
    r"(bebop_tok_s|minimal_tok_s|hbm_bound_tok_s|bebop_frac_of_hbm_bound|"
    r"minimal_frac_of_hbm_bound|bebop_vs_minimal)_b\d+(_greedy)?$"
)


def decode_headline(d: dict) -> dict:
    keep = ("model", "layers", "dtype", "device", "weight_bytes", "stream_gb_s", "hbm_rate_gb_s")
    out = {k: d[k] for k in keep if k in d}
    out.update({k: v for k, v in d.items() if DECODE_KEYS.match(k) and not k.endswith("_greedy")})
    return out


def rollout_headline(d: dict) -> dict:
    keys = ("batch", "gamma", "step_ms", "verify_cost", "draft_cost", "cycle_ms")
    rows = [{k: r[k] for k in (*keys, "predicted_at_alpha") if k in r} for r in d.get("rows", [])]
    return {k: d[k] for k in ("model", "layers", "dtype") if k in d} | {"rows": rows}


def e2e_headline(d: dict) -> dict:
    rl = d.get("pipeline", {}).get("rl", {})
    out = {k: d[k] for k in ("pipeline_wall_s", "speedup_spec_over_plain", "wall_s") if k in d}
    out["pipeline_rl"] = {
        k: rl[k]
        for k in ("accuracy_before", "accuracy_after", "accept_len", "rl_wall_s", "rollout_speedup")
        if k in rl
    }
    keys = ("rl_s_after_step_1", "rollout_s", "rollout_share", "accept_len", "accuracy_after")
    out["arms"] = {n: {k: a.get(k) for k in keys} for n, a in d.get("arms", {}).items()}
    return out


HEADLINES = {"decode": decode_headline, "rollout": rollout_headline, "e2e": e2e_headline}


def headline(name: str, d: dict) -> dict:
    for prefix, fn in HEADLINES.items():
        if name.startswith(prefix):
            return fn(d)
    out = {}
    for k, v in d.items():  # scalars, and the scalars of each dict (e.g. launch.py's stages)
        if isinstance(v, dict):
            out[k] = {kk: vv for kk, vv in v.items() if not isinstance(vv, (dict, list))}
        elif not isinstance(v, list):
            out[k] = v
    return out


def summarize(out: Path, steps_tsv: str, setup: dict) -> dict:
    steps, errors = {}, {}
    for line in steps_tsv.strip().splitlines():
        name, rc, secs, limit = line.split("\t")
        rec = {"rc": rc, "s": float(secs), "limit_s": int(limit)}
        path = out / f"{name}.json"
        d = None
        if path.exists() and path.stat().st_size:
            try:
                d = json.loads(path.read_text())
            except ValueError:
                d = None
        if d is not None:
            rec["headline"] = headline(name, d)
        if rc != "0":
            why = {"124": "cut at its time limit", "skipped": "no time left"}.get(rc, f"exit {rc}")
            errors[name] = why + ("" if d is None else " (figures so far kept)")
        elif d is None:
            errors[name] = "no JSON line in its output"
        steps[name] = rec
    if "setup_error" in setup:
        errors["setup"] = setup["setup_error"]
    return {**setup, "steps": steps, "errors": errors}


def main():
    out, tsv, setup = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    res = summarize(out, tsv.read_text() if tsv.exists() else "", setup)
    tmp = out / "summary.json.tmp"  # no bebop import: the summary is written even if it fails
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    os.replace(tmp, out / "summary.json")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
