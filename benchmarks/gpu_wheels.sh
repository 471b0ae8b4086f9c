#!/usr/bin/env bash
# Downloads, on a machine with network, the wheels benchmarks/gpu.sh installs offline on a
# GPU machine that has torch and Triton but not TorchRec: fbgemm_gpu's CPU build (torchrec
# imports it; our Triton path needs none of its CUDA kernels, only FBGEMM's TBE baseline
# does), TorchRec, tensordict, pyvers and iopath, of the releases that pair with the GPU
# machine's torch (FBGEMM/TorchRec 1.N with torch 2.(N+5)).
#
# Usage: bash benchmarks/gpu_wheels.sh [FOLDER]      (default .whl; about 7 MB)
# Environment: GPU_PYTHON (the GPU machine's Python, default 3.12), GPU_TORCH (its torch
# minor version, default 2.11), FBGEMM_RELEASE / TORCHREC_RELEASE to override the pairing.
# Then, on the GPU machine: WHEELS=FOLDER bash benchmarks/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."

folder="${1:-.whl}"
python_version="${GPU_PYTHON:-3.12}"
torch_minor="${GPU_TORCH:-2.11}"
n=$(( ${torch_minor#*.} - 5 ))
fbgemm="${FBGEMM_RELEASE:-1.$n.0}"
# TorchRec 1.6.0 was never published; 1.6.1 pairs with FBGEMM 1.6.
torchrec="${TORCHREC_RELEASE:-$([ "$n" -eq 6 ] && echo 1.6.1 || echo "1.$n.0")}"
mkdir -p "$folder"
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$python_version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -d "$folder" "fbgemm-gpu-cpu==$fbgemm" "torchrec==$torchrec" \
  "tensordict==0.15.3" "pyvers" "iopath"
echo "gpu_wheels: torch $torch_minor, Python $python_version -> fbgemm-gpu-cpu $fbgemm," \
  "torchrec $torchrec in $folder ($(du -sh "$folder" | cut -f1)):"
ls -1 "$folder"
case "$folder" in
  .whl|.whl/) grep -qx '/.whl/' .git/info/exclude 2>/dev/null \
    || echo "gpu_wheels: add /.whl/ to .git/info/exclude so the folder is not committed" ;;
esac
