#!/usr/bin/env bash
# Creates .venv with the project's pinned stack. Idempotent; `make` calls it when
# .venv/.installed is missing or older than the files that define the stack.
#
# torch is pinned: an unpinned torch pulls a multi-GB CUDA build from PyPI.
# fbgemm: the CUDA build (fbgemm-gpu) where an NVIDIA GPU is visible, else the CPU build
# (fbgemm-gpu-cpu) and Triton (for the interpreter). Override with FBGEMM_VARIANT=cpu|cuda.
# torchrec 1.8.0 declares the CUDA fbgemm-gpu as a dependency, so it is installed with
# --no-deps and its real needs come from requirements.txt. It goes in after them: a later
# install with dependency checks would see it and print pip's resolver "ERROR: torchrec
# 1.8.0 requires fbgemm-gpu, which is not installed" (harmless where fbgemm-gpu-cpu is
# there, alarming to read); an install with --no-deps checks nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=.venv
TORCH_VERSION=2.13.0
FBGEMM_VERSION=1.8.0
TORCHREC_VERSION=1.8.0
# Triton: a CUDA torch brings the version it was built with; on a CPU machine the tests run
# the project's Triton kernels under Triton's interpreter, with the version of the GPU
# machines (docs/triton.md).
TRITON_VERSION=3.6.0

variant="${FBGEMM_VARIANT:-}"
if [ -z "$variant" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    variant=cuda
  else
    variant=cpu
  fi
fi
case "$variant" in
  cpu) fbgemm_pkg="fbgemm-gpu-cpu==$FBGEMM_VERSION"; extra_pkgs=("triton==$TRITON_VERSION") ;;
  cuda) fbgemm_pkg="fbgemm-gpu==$FBGEMM_VERSION"; extra_pkgs=() ;;
  *) echo "setup_venv: FBGEMM_VARIANT must be cpu or cuda, got '$variant'" >&2; exit 2 ;;
esac

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "torch==$TORCH_VERSION" "$fbgemm_pkg" ${extra_pkgs[@]+"${extra_pkgs[@]}"} -r requirements.txt
"${PIP[@]}" --no-deps "torchrec==$TORCHREC_VERSION"
"${PIP[@]}" --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import torch, fbgemm_gpu, torchrec, torchrec_cowclip; print('setup_venv: torch', torch.__version__, '| fbgemm $variant | torchrec', torchrec.__version__)"
touch "$VENV/.installed"
