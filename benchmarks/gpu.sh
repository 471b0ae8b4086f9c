#!/usr/bin/env bash
# The GPU check of torchrec_cowclip, for a machine with one NVIDIA GPU, torch and Triton,
# and no network. In under 8 minutes (GPU_SH_BUDGET, default 470 s, bounds every step):
#   1. prints the GPU, driver, torch, CUDA, Triton, fbgemm_gpu and torchrec versions;
#   2. if torchrec does not import and WHEELS names a folder of wheels, installs them
#      offline into this python (pip --no-index --find-links, --no-deps: the folder is
#      the exact set; torch, triton and nvidia-* wheels in it are left out so the
#      machine's CUDA build of torch stays);
#   3. runs benchmarks/gpu_check.py: correctness of the fused update on the GPU against
#      float64 CPU references (exit 1 on a mismatch), the embedding-step table (ours vs
#      FBGEMM's CUDA TBE when fbgemm_gpu imports) and DeepFM samples/s with the
#      extrapolated epoch time on Criteo-Kaggle-sized synthetic data.
#
# Usage (from anywhere; extra arguments go to gpu_check.py):
#   WHEELS=/path/to/wheels bash benchmarks/gpu.sh
#   bash benchmarks/gpu.sh --parts correctness
# Environment: PYTHON (default python3), WHEELS (optional), RESULTS (where gpu_check.json
# and gpu_check.log go; default benchmarks/results/gpu), GPU_SH_BUDGET (seconds).
#
# Wheels: torchrec and fbgemm-gpu must be the releases that match the machine's torch
# (FBGEMM/TorchRec 1.N pair with torch 2.(N+5): torch 2.11 -> 1.6.x), plus tensordict
# and pyvers if absent. Without fbgemm_gpu, torchrec cannot be imported at all (its
# __init__ imports torchrec.distributed, which imports fbgemm_gpu), so neither can
# torchrec_cowclip: gpu_check.py then runs only the row-step checks and timings.
# Exit status: gpu_check.py's (0 pass, 1 mismatch, 2 incomplete), 124 if it ran out of time.
set -uo pipefail
cd "$(dirname "$0")/.."

start=$SECONDS
budget=${GPU_SH_BUDGET:-470}
PY=${PYTHON:-python3}
RESULTS=${RESULTS:-benchmarks/results/gpu}
mkdir -p "$RESULTS"
left() { echo $((budget - (SECONDS - start))); }

echo "== versions"
timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  || echo "nvidia-smi: not available"
report_versions() {
  timeout 120 "$PY" - <<'EOF' || echo "python: the version probe failed or timed out"
import importlib, platform
import torch
print(f"python {platform.python_version()} | torch {torch.__version__} (CUDA {torch.version.cuda})"
      f" | CUDA available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
for name in ("triton", "fbgemm_gpu", "torchrec", "tensordict", "torchmetrics", "numpy"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '(no __version__)')}")
    except Exception as error:  # a broken binary raises OSError/RuntimeError, not ImportError
        print(f"{name}: NOT importable ({type(error).__name__}: {str(error)[:200]})")
EOF
}
report_versions

if ! timeout 120 "$PY" -c "import torchrec" >/dev/null 2>&1; then
  if [ -n "${WHEELS:-}" ] && [ -d "${WHEELS}" ]; then
    mapfile -t wheels < <(ls "$WHEELS"/*.whl 2>/dev/null | grep -Ev '/((torch|triton)-[0-9]|nvidia_)[^/]*$')
    if [ "${#wheels[@]}" -gt 0 ]; then
      echo "== torchrec missing: installing ${#wheels[@]} wheel(s) from $WHEELS (offline, --no-deps)"
      printf '   %s\n' "${wheels[@]##*/}"
      if ! timeout 180 "$PY" -m pip install --quiet --disable-pip-version-check --no-index \
          --find-links "$WHEELS" --no-deps "${wheels[@]}"; then
        # A read-only environment: install beside it and put that first on the path.
        site="$(mktemp -d)/site"
        echo "   pip could not install into this python; trying --target $site"
        timeout 180 "$PY" -m pip install --quiet --disable-pip-version-check --no-index \
          --find-links "$WHEELS" --no-deps --target "$site" "${wheels[@]}" \
          && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
      fi
      echo "== versions after the install"
      report_versions
    else
      echo "== torchrec missing and $WHEELS holds no usable wheel"
    fi
  else
    echo "== torchrec is not importable and WHEELS is unset: gpu_check.py will run only what"
    echo "   needs neither torchrec nor fbgemm_gpu (the row-step checks and timings)"
  fi
fi

# Leave 20 s for the shell's own exit; the check stops its timings 30 s before its budget.
check_s=$(($(left) - 20))
if [ "$check_s" -lt 60 ]; then
  echo "gpu.sh: only ${check_s}s left for gpu_check.py; not starting it" >&2
  exit 124
fi
echo "== gpu_check.py (at most ${check_s}s; results in $RESULTS)"
timeout --kill-after=10 "$check_s" env PYTHONUNBUFFERED=1 "$PY" benchmarks/gpu_check.py \
  --out "$RESULTS" --time-budget $((check_s - 30)) "$@" 2>&1 | tee "$RESULTS/gpu_check.log"
status=${PIPESTATUS[0]}
case "$status" in
  0) echo "gpu.sh: PASS ($((SECONDS - start)) s)" ;;
  1) echo "gpu.sh: FAIL - a correctness comparison mismatched ($((SECONDS - start)) s)" ;;
  2) echo "gpu.sh: INCOMPLETE - no mismatch, but some checks or parts could not run ($((SECONDS - start)) s)" ;;
  124|137) echo "gpu.sh: gpu_check.py ran out of time; parts finished so far are in $RESULTS/gpu_check.json" ;;
  *) echo "gpu.sh: gpu_check.py exited with status $status" ;;
esac
exit "$status"
