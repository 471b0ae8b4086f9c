#!/usr/bin/env bash
# Downloads, on a machine with network, the wheels benchmarks/gpu.sh installs offline on a
# GPU machine that has torch and Triton but not TorchRec: fbgemm_gpu's CPU build (torchrec
# imports it; our Triton path needs none of its CUDA kernels, only FBGEMM's TBE baseline
# does), TorchRec, tensordict, pyvers, iopath, pytest and this project's own requirements
# but plots and parquet I/O (matplotlib, pyarrow: about 60 MB, no device test needs them),
# of the releases that pair with the GPU machine's torch (FBGEMM/TorchRec 1.N with torch
# 2.(N+5)), each with its whole dependency closure (benchmarks/gpu_wheels.py) but torch,
# Triton, the CUDA libraries and torch's own requirements, which the machine has.
# When this machine's Python and torch are the GPU machine's, the folder is then checked:
# installed into an empty target beside torch alone, torchrec and fbgemm_gpu import and
# `pytest -m gpu` collects (GPU_WHEELS_CHECK=1 forces the check, 0 skips it).
#
# Usage: bash benchmarks/gpu_wheels.sh [FOLDER]      (default .whl; about 30 MB)
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
python3 benchmarks/gpu_wheels.py download "$folder" --python "$python_version" \
  "fbgemm-gpu-cpu==$fbgemm" "torchrec==$torchrec" "tensordict==0.15.3" pyvers iopath pytest \
  numpy tqdm "torchmetrics==1.0.3" "torchx==0.7.0" tensorboardX
echo "gpu_wheels: torch $torch_minor, Python $python_version -> fbgemm-gpu-cpu $fbgemm," \
  "torchrec $torchrec in $folder ($(du -sh "$folder" | cut -f1)):"
ls -1 "$folder"
case "$folder" in
  .whl|.whl/) grep -qx '/.whl/' .git/info/exclude 2>/dev/null \
    || echo "gpu_wheels: add /.whl/ to .git/info/exclude so the folder is not committed" ;;
esac
here=$(python3 -c 'import platform; print(".".join(platform.python_version_tuple()[:2]))')
local_torch=$(python3 -c 'import torch; print(".".join(torch.__version__.split(".")[:2]))' 2>/dev/null || true)
check="${GPU_WHEELS_CHECK:-$([ "$here" = "$python_version" ] && [ "$local_torch" = "$torch_minor" ] && echo 1 || echo 0)}"
if [ "$check" = 1 ]; then
  python3 benchmarks/gpu_wheels.py check "$folder"
else
  echo "gpu_wheels: not checked here (Python $here, torch ${local_torch:-none}; the GPU machine's:" \
    "$python_version, $torch_minor): GPU_WHEELS_CHECK=1 checks them beside this torch"
fi
