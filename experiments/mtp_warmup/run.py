"""Does a KL warm-up help the end-to-end TV loss when the MTP starts from random init?

Trains the demo's runlocal MTP (100 steps, same SFT policy, data and seed) three ways -- e2e TV
only, KL only, 50 KL + 50 e2e TV -- and reports the real speculative sampler's accept length and
step-1 acceptance (γ = 3, rejection sampling, 32 held-out prompts). Last line: JSON.

    python -m experiments.mtp_warmup.run [--out runs/exp_mtp_warmup]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {
    "e2e_tv": ["mtp.loss='e2e_tv'", "mtp.warmup_loss_steps=0"],
    "kl": ["mtp.loss='kl'", "mtp.warmup_loss_steps=0"],
    "kl50+e2e_tv50": ["mtp.loss='e2e_tv'", "mtp.warmup_loss='kl'", "mtp.warmup_loss_steps=50"],
}


def launch(workdir: Path, *overrides: str) -> dict:
    cmd = [
        sys.executable,
        "launch.py",
        "--config",
        "configs/demo.py:runlocal",
        "--workdir",
        str(workdir),
        *[f"--config.{o}" for o in overrides],
    ]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", "--workdir", default="runs/exp_mtp_warmup", help="the runs' folder")
    root = Path(ap.parse_args().out).absolute()
    base = root / "base"
    launch(base, "stages=('sft','distill')")
    results = {}
    for name, overrides in VARIANTS.items():
        wd = root / name
        shutil.rmtree(wd, ignore_errors=True)
        wd.mkdir(parents=True)
        for stage in ("sft", "distill"):
            shutil.copytree(base / stage, wd / stage)
        after = launch(wd, "stages=('sft','distill','mtp')", *overrides)["mtp"]["after"]
        results[name] = {
            "accept_len": after["rejection/accept_len"],
            "accept_rate_1": after["rejection/accept_rate_1"],
        }
        print(
            f"{name:15s} accept_len {results[name]['accept_len']:.2f}  "
            f"step-1 acceptance {results[name]['accept_rate_1']:.2f}",
            flush=True,
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
