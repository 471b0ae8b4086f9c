#!/usr/bin/env bash
# The GPU run of torchrec_cowclip, for a machine with one NVIDIA GPU, torch and Triton,
# and no network. In under 8 minutes (GPU_SH_BUDGET, default 470 s, bounds every step):
#   1. prints the GPU, driver, torch, CUDA, Triton, fbgemm_gpu and torchrec versions;
#   2. if torchrec does not import and WHEELS names a folder of wheels, installs them
#      offline into this python (pip --no-index --find-links, --no-deps: the folder is
#      the exact set; torch, triton and nvidia-* wheels in it are left out so the
#      machine's CUDA build of torch stays);
#   3. runs the device tests, `pytest -m gpu` (at most GPU_SH_TEST_BUDGET s, default 240):
#      the Triton kernels compiled for real and the Inductor row step against the
#      functional core, the collection on every update path against float64 CPU
#      references; without torchrec only the torch-only ones (tests/conftest.py);
#   4. runs benchmarks/gpu_timing.py with what is left: the Triton kernels alone (torch
#      only), the embedding step (ours on Triton and on Inductor vs FBGEMM's CUDA TBE in
#      three modes), a CUDA-graph-captured DeepFM step, and DeepFM samples/s at 16K-128K
#      with the extrapolated epoch time on Criteo-Kaggle-sized synthetic data; without
#      torchrec the first part only.
#
# Usage (from anywhere; extra arguments go to gpu_timing.py):
#   WHEELS=/path/to/wheels bash benchmarks/gpu.sh
#   bash benchmarks/gpu.sh --parts embedding
# Environment: PYTHON (default python3), WHEELS (optional), RESULTS (where gpu_tests.log,
# gpu_timing.json and gpu_timing.log go; default benchmarks/results/gpu), GPU_SH_BUDGET and
# GPU_SH_TEST_BUDGET (seconds).
#
# Wheels: torchrec and fbgemm-gpu must be the releases that match the machine's torch
# (FBGEMM/TorchRec 1.N pair with torch 2.(N+5): torch 2.11 -> 1.6.x), plus tensordict
# and pyvers if absent. Without fbgemm_gpu, torchrec cannot be imported at all (its
# __init__ imports torchrec.distributed, which imports fbgemm_gpu).
# Exit status: 1 a device test failed; 2 nothing failed but something could not run (no
# CUDA device, no torchrec, a timing part); 124 out of time; 0 all ran and passed.
set -uo pipefail
cd "$(dirname "$0")/.."

start=$SECONDS
# Triton compiles for the GPU here; its CPU interpreter is for machines without one.
unset TRITON_INTERPRET
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

if ! timeout 120 "$PY" -c "import torchrec, pytest" >/dev/null 2>&1; then
  if [ -n "${WHEELS:-}" ] && [ -d "${WHEELS}" ]; then
    mapfile -t wheels < <(ls "$WHEELS"/*.whl 2>/dev/null | grep -Ev '/((torch|triton)-[0-9]|nvidia_)[^/]*$')
    if [ "${#wheels[@]}" -gt 0 ]; then
      echo "== torchrec or pytest missing: installing ${#wheels[@]} wheel(s) from $WHEELS (offline, --no-deps)"
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
      echo "== torchrec or pytest missing and $WHEELS holds no usable wheel"
    fi
  else
    echo "== torchrec or pytest is not importable and WHEELS is unset: without torchrec only"
    echo "   the row step's device tests run (they need torch and pytest), gpu_timing.py not"
  fi
fi

status=0
test_s=${GPU_SH_TEST_BUDGET:-240}
if [ "$test_s" -gt "$(($(left) - 60))" ]; then test_s=$(($(left) - 60)); fi
if ! timeout 60 "$PY" -c "import pytest" >/dev/null 2>&1; then
  echo "gpu.sh: pytest is not importable (put its wheels, with pluggy and iniconfig, in WHEELS): no device tests"
  status=2
else
  echo "== pytest -m gpu (at most ${test_s}s; log in $RESULTS/gpu_tests.log)"
  timeout --kill-after=10 "$test_s" env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" -m pytest -q -m gpu -rs tests 2>&1 | tee "$RESULTS/gpu_tests.log"
  tests=${PIPESTATUS[0]}
  case "$tests" in
    0) if grep -q "no CUDA device" "$RESULTS/gpu_tests.log"; then status=2; fi ;;
    1) status=1 ;;
    124|137) echo "gpu.sh: pytest -m gpu ran out of time"; status=124 ;;
    *) echo "gpu.sh: pytest -m gpu exited with status $tests"; status=2 ;;
  esac
fi

# Leave 20 s for the shell's own exit; the timings stop 30 s before their budget.
timing_s=$(($(left) - 20))
parts=()
if ! timeout 120 "$PY" -c "import torchrec" >/dev/null 2>&1; then
  echo "gpu.sh: torchrec is not importable: gpu_timing.py runs its torch-only part (kernels)"
  parts=(--parts kernels)
  [ "$status" -eq 0 ] && status=2
fi
if [ "$timing_s" -lt 60 ]; then
  echo "gpu.sh: only ${timing_s}s left: gpu_timing.py not run" >&2
  [ "$status" -eq 0 ] && status=124
else
  echo "== gpu_timing.py (at most ${timing_s}s; results in $RESULTS)"
  timeout --kill-after=10 "$timing_s" env PYTHONUNBUFFERED=1 "$PY" benchmarks/gpu_timing.py \
    --out "$RESULTS" --time-budget $((timing_s - 30)) "${parts[@]+"${parts[@]}"}" "$@" 2>&1 \
    | tee "$RESULTS/gpu_timing.log"
  timing=${PIPESTATUS[0]}
  if [ "$timing" -ne 0 ] && [ "$status" -eq 0 ]; then status=$timing; fi
fi
case "$status" in
  0) echo "gpu.sh: PASS ($((SECONDS - start)) s)" ;;
  1) echo "gpu.sh: FAIL - a device test failed ($((SECONDS - start)) s)" ;;
  2) echo "gpu.sh: INCOMPLETE - nothing failed, but something could not run ($((SECONDS - start)) s)" ;;
  *) echo "gpu.sh: out of time or an error (status $status); what finished is in $RESULTS" ;;
esac
exit "$status"
