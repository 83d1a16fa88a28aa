"""The model executor: owns the weights, the KV tensors, the attention backend, the sampler and every
tensor of a step. `run(plan)` takes the scheduler's plain-data plan and answers with plain data,
read back from the device in one transfer."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from radixlm_runtime.attention.base import AttentionBackend
from radixlm_runtime.attention.registry import create_attention_backend
from radixlm_runtime.config import EngineConfig
from radixlm_runtime.distributed.group import TPGroup
from radixlm_runtime.executor.cuda_graph import CudaGraphCapturer, CudaGraphRunner, GraphCapturer
from radixlm_runtime.executor.kv_tiers import KVTiers
from radixlm_runtime.executor.memory import Scratch, ScratchShape, StepLimits, kv_dtype_for, kv_pool_size
from radixlm_runtime.executor.step_io import StepOutputs, build_batch
from radixlm_runtime.forward_batch import ForwardBatch
from radixlm_runtime.kvcache.pool import KVPool, ReqToTokenTable
from radixlm_runtime.layers.linear_kernels import BF16, FP32, bf16_available
from radixlm_runtime.models.builder import build_model
from radixlm_runtime.models.config import ModelConfig
from radixlm_runtime.models.llama_cpu import LlamaCpuDecoder
from radixlm_runtime.sampling.sampler import Sampler, SamplingBatchInfo, build_token_bitmask
from radixlm_runtime.step import KVCopy, RunnerInfo, SampleSpec, StepPlan, StepResult
from radixlm_runtime.utils import cpu
from radixlm_runtime.utils.logging import get_logger
from radixlm_runtime.utils.transfer import to_device

logger = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The model's tensor dtype and the arithmetic of the CPU linear kernels. On CPU, bfloat16 is bf16
    weights and dot products in those kernels (AVX512-BF16), with float32 accumulation and float32
    tensors between them (norms, rotary, attention, the residual stream); a CPU without bf16 dot
    products runs float32 instead, as the log says, rather than torch's bf16 matmul at a fraction of
    the speed."""
    if name == "auto":
        return (torch.bfloat16, FP32) if device.type == "cuda" else (torch.float32, FP32)
    dtype = _DTYPES[name]
    if device.type != "cpu" or dtype != torch.bfloat16:
        return dtype, FP32
    if bf16_available():
        logger.info("dtype bfloat16 on CPU: bf16 weights and dot products, float32 accumulation")
        return torch.float32, BF16
    logger.warning(
        "dtype bfloat16: this CPU has no bf16 dot products (AVX512-BF16), so the model runs in float32 (%s)",
        cpu.detect().describe(),
    )
    return torch.float32, FP32


class ModelRunner:
    def __init__(
        self, model_dir: Path, config: EngineConfig, max_step_tokens: int, tp: TPGroup | None = None
    ) -> None:
        """max_step_tokens: the most tokens the scheduler puts in one step (its chunked-prefill
        budget), which the memory left beside the KV pool must hold. tp: this process's rank of a
        tensor-parallel group (executor/tp.py); every rank runs the same plans through this code."""
        self.engine_config = config
        self.device = resolve_device(config.device)
        self.dtype, self.compute = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
            environment = cpu.runtime_environment(torch.get_num_threads())
            logger.info("CPU: %s; %s", cpu.detect().describe(), environment)
        self.governor = None
        if self.device.type == "cpu" and config.cpu_thread_policy == "adaptive":
            self.governor = cpu.ThreadGovernor(torch.get_num_threads())
        self.config = ModelConfig.from_dir(model_dir)
        self.context_len = config.context_length or self.config.max_position_embeddings
        if self.context_len > self.config.max_position_embeddings:
            logger.warning(
                "context_length %d exceeds the model's max_position_embeddings %d",
                self.context_len,
                self.config.max_position_embeddings,
            )

        t0 = time.perf_counter()
        self.model = build_model(
            model_dir, self.config, config, self.device, self.dtype, self.context_len, self.compute, tp
        )
        logger.info(
            "loaded %s weights in %.2fs (%s, %s)",
            self.config.architecture,
            time.perf_counter() - t0,
            self.device,
            self.dtype,
        )

        self.sampler = Sampler(device=self.device)
        limits = StepLimits.of(config, max_step_tokens, self.context_len)
        self.window_layers, self.sliding_window = self._window_layers()
        ratio = config.swa_full_tokens_ratio if self.window_layers else 0.0
        self.max_total_tokens = kv_pool_size(
            config,
            self.model.config,
            self.kv_dtype,
            self.device,
            limits,
            self.open_scratch,
            (len(self.window_layers), ratio),
        )
        if tp is not None:  # one pool size that every rank's memory holds
            self.max_total_tokens = tp.min_int(self.max_total_tokens)
        # Room for the largest step beside a request's two windows (the one it locks before its
        # cached end, its own), at least, so that one request can always run (admission.py); where
        # that is the whole pool, window slots would save nothing.
        least = max_step_tokens + 2 * self.sliding_window
        self.window_slots = max(int(self.max_total_tokens * ratio), least) if self.window_layers else 0
        if self.window_slots >= self.max_total_tokens:
            self.window_layers, self.window_slots, self.sliding_window = frozenset(), 0, 0
        self.kv_pool = self._new_kv_pool(self.max_total_tokens, self.window_slots)
        # The host tier keeps window slots in the pool's ratio: a prefix's window KV at its end.
        self.host_window_slots = int(config.kv_host_tokens * self.window_slots / self.max_total_tokens)
        self.host_pool = self._new_host_pool(config.kv_host_tokens, self.host_window_slots)
        # What the bits of the KV depend on beside the weights: a restarted server reads the disk
        # tier's entries only under the same (its cached runs then match its uncached ones).
        numerics = {"dtype": str(self.dtype), "compute": self.compute, "kv": str(self.kv_dtype)}
        numerics.update(quantization=config.quantization, cpu_act_quant=config.cpu_act_quant)
        numerics.update(device=self.device.type, attention=config.attention_backend)
        numerics.update(deterministic=config.deterministic)
        self.tiers = KVTiers.build(
            self.kv_pool, self.host_pool, config.kv_disk_dir, config.kv_disk_bytes, model_dir, numerics
        )
        self.req_to_token = ReqToTokenTable(
            config.max_running_requests + 8, self.context_len + 8, self.device, self.kv_pool.windowed
        )
        self.attn_backend = self._make_attention_backend(self.kv_pool, self.req_to_token)
        self.model.cpu_decoder = LlamaCpuDecoder.build(self.model, self.attn_backend)
        self.graphs = self._capture_cuda_graphs()
        self.info = RunnerInfo(
            vocab_size=self.config.vocab_size,
            context_len=self.context_len,
            max_total_tokens=self.max_total_tokens,
            max_reqs=config.max_running_requests,
            eos_token_ids=tuple(self.config.eos_token_ids),
            host_kv_tokens=config.kv_host_tokens,
            disk_kv_tokens=self.tiers.disk_tokens,
            disk_entries=self.tiers.disk_entries,
            kv_bytes_per_token=self.kv_pool.bytes_per_token(),
            kv_bytes_per_window_slot=self.kv_pool.bytes_per_window_slot() if self.window_slots else 0,
            disk_entry_header=self.tiers.disk_entry_header,
            async_launch=self.device.type == "cuda",
            window_slots=self.window_slots,
            sliding_window=self.sliding_window,
            host_window_slots=self.host_window_slots,
        )
        # Tokens sampled by the last launched step, where the next plan's future tokens come from.
        self._last_sampled: torch.Tensor | None = None
        logger.info(
            "KV pool: %d tokens%s (%.2f GiB, %s), attention backend %s, decoder layers %s",
            self.max_total_tokens,
            f" and {self.window_slots} window slots of {len(self.window_layers)} sliding-window layers"
            if self.window_slots
            else "",
            (
                self.max_total_tokens * self.kv_pool.bytes_per_token()
                + self.window_slots * self.kv_pool.bytes_per_window_slot()
            )
            / 2**30,
            self.kv_pool.dtype,
            type(self.attn_backend).__name__,
            "in one C++ call" if self.model.cpu_decoder else "from Python",
        )

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV pools' dtype: --kv-cache-dtype's, or under 'auto' bf16 under bf16 arithmetic on the CPU,
        else the model's (memory.py)."""
        return kv_dtype_for(self.dtype, self.compute, self.device, self.engine_config.kv_cache_dtype)

    def _window_layers(self) -> tuple[frozenset[int], int]:
        """The sliding-window layers whose KV goes to window slots of their own, and their widest
        window; none where the model has none or --swa-full-tokens-ratio is 1."""
        layers = self.model.attention_layers()
        windowed = frozenset(i for i, layer in enumerate(layers) if layer.sliding_window is not None)
        if not windowed or self.engine_config.swa_full_tokens_ratio >= 1:
            return frozenset(), 0
        return windowed, max(layers[i].sliding_window or 0 for i in windowed)

    def _new_kv_pool(self, size: int, window_slots: int = 0) -> KVPool:
        c = self.model.config  # this rank's KV heads under tensor parallelism
        window_layers = self.window_layers if window_slots else frozenset()
        return KVPool(
            size,
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            self.kv_dtype,
            self.device,
            window_layers=window_layers,
            window_size=window_slots,
        )

    def _new_host_pool(self, size: int, window_slots: int) -> KVPool | None:
        """The host KV tier: in host memory, pinned on CUDA for its copies to and from the GPU; its
        window slots, if any, for the device pool's window layers."""
        if size == 0:
            return None
        c = self.model.config
        pool = KVPool(
            size,
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            self.kv_dtype,
            "cpu",
            self.device.type == "cuda",
            window_layers=self.kv_pool.window_layers if window_slots else frozenset(),
            window_size=window_slots,
        )
        gib = (size * pool.bytes_per_token() + window_slots * pool.bytes_per_window_slot()) / 2**30
        windows = f" and {window_slots} window slots" if window_slots else ""
        logger.info("host KV tier: %d tokens%s (%.2f GiB, %s)", size, windows, gib, pool.dtype)
        return pool

    @torch.inference_mode()
    def move_kv(self, ops: list[KVCopy]) -> list[int]:
        """Runs tier moves now (reads from the disk tier); the disk slots that failed their checksum."""
        return self.tiers.run(ops)

    def prefetch_kv(self, disk_slots: list[int]) -> int:
        """Starts reading these disk slots' entries ahead of a move_kv that reads them."""
        return self.tiers.prefetch(disk_slots)

    def close(self) -> None:
        """Finishes the disk tier's pending writes; nothing else to stop: the executor is this process
        (tensor parallelism's ranks: executor/tp.py)."""
        self.tiers.close()

    def open_scratch(self, shape: ScratchShape) -> Scratch:
        """Steps on a KV pool and table of their own, for measuring the largest steps before the real
        pool is sized (executor/memory.py)."""
        pool = self._new_kv_pool(shape.pool_tokens)
        table = ReqToTokenTable(shape.table_rows, shape.table_cols, self.device)
        attn = self._make_attention_backend(pool, table)

        def run(plan: StepPlan, sampling: SamplingBatchInfo | None) -> object:
            batch, writes = build_batch(plan, self.device)
            assert writes is not None
            table.write(*writes)
            attn.init_forward_metadata(batch)
            logits = self.model(batch, attn)
            return logits if sampling is None else self.sampler(logits, sampling, return_logprob=True)

        return Scratch(run, attn.graph_capturable)

    def _make_attention_backend(self, pool: KVPool, table: ReqToTokenTable) -> AttentionBackend:
        name = self.engine_config.attention_backend
        backend = create_attention_backend(name, pool, table, self.model.attention_layers())
        if self.engine_config.deterministic:
            if not backend.supports_per_token:
                raise ValueError(
                    "deterministic needs the 'cpu' (float32 on CPU) or 'triton' attention backend, not "
                    f"{type(backend).__name__}"
                )
            backend.per_token = True
        return backend

    def _capture_cuda_graphs(self) -> CudaGraphRunner | None:
        config = self.engine_config
        if self.device.type != "cuda" or config.disable_cuda_graph:
            return None
        if not self.attn_backend.graph_capturable:
            logger.info("CUDA graphs off: the %s backend is not capturable", type(self.attn_backend).__name__)
            return None
        return self.capture_decode_graphs(CudaGraphCapturer(self.device))

    def capture_decode_graphs(self, capturer: GraphCapturer) -> CudaGraphRunner:
        """Decode graphs up to --cuda-graph-max-bs, recorded by `capturer`."""
        config = self.engine_config
        max_bs = min(config.cuda_graph_max_bs, config.max_running_requests)
        # The table's last row is never handed to a request (RowAllocator gives out max_reqs rows).
        dummy_row = self.req_to_token.max_reqs - 1
        return CudaGraphRunner(self.model, self.attn_backend, max_bs, dummy_row, self.device, capturer)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.replay(batch)
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch, self.attn_backend)

    def run(self, plan: StepPlan) -> StepResult:
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> StepOutputs:
        """Queues one step on the device: the plan's table entries, the forward, sampling, logprobs
        and the copy of their results to the host. Nothing here waits for the device; the returned
        outputs are read by `collect`."""
        if self.governor is not None:
            self._govern_threads(self.governor)
        if plan.copies:
            # A step's moves read no disk entry (the scheduler reads those through move_kv first).
            failed = self.tiers.run(plan.copies)
            assert not failed, "a step planned on a disk read that failed"
        batch, writes = build_batch(plan, self.device)
        if writes is not None:
            self.req_to_token.write(*writes)
        if any(it.input_ids and it.input_ids[0] < 0 for it in plan.items):
            batch.input_ids = self._resolve_futures(batch.input_ids)
        logits = self.forward(batch)
        outputs = StepOutputs(plan)
        specs = outputs.sample_specs()
        if specs:
            rows = outputs.sample_rows()
            # A pure decode step samples every logits row in order: no gather, no copy.
            to_sample = logits
            if rows != list(range(logits.shape[0])):
                to_sample = logits.index_select(0, to_device(torch.tensor(rows), self.device))
            sampled = self.sampler(
                to_sample,
                self._sampling_info(specs),
                return_logprob=any(s.return_logprob for s in specs),
                top_logprobs_num=max(s.top_logprobs_num for s in specs),
            )
            outputs.add_samples(sampled.next_token_ids, sampled.logprobs, sampled.top_logprobs)
        self._last_sampled = sampled.next_token_ids if specs else None
        outputs.add_prompt_logprobs(logits)
        outputs.start_read()
        return outputs

    @staticmethod
    def _govern_threads(governor: cpu.ThreadGovernor) -> None:
        """The CPU kernels' thread count for this step (they all read torch's)."""
        threads = governor.update()
        if threads != torch.get_num_threads():
            logger.info(
                "CPU kernels on %d threads of %d: other processes keep %.2f cores busy",
                threads,
                governor.max_threads,
                governor.others,
            )
            torch.set_num_threads(threads)

    def _resolve_futures(self, ids: torch.Tensor) -> torch.Tensor:
        """Input ids with each future token (`future_token(i)`) replaced, on the device, by the token
        the previous step sampled at row i."""
        if self._last_sampled is None:
            raise ValueError("input_ids: a future token, but the previous step sampled nothing")
        return torch.where(ids < 0, self._last_sampled[(-ids - 1).clamp_(min=0)], ids)

    @torch.inference_mode()
    def collect(self, outputs: StepOutputs) -> StepResult:
        """Waits for a launched step's results and returns them as plain data."""
        return outputs.read()

    def _sampling_info(self, specs: list[SampleSpec]) -> SamplingBatchInfo:
        params = [s.params for s in specs]
        draws = [None if s.params.is_greedy else (s.seed, s.draw) for s in specs]
        histories = [s.history or ([], []) for s in specs]
        banned = [s.banned_ids for s in specs]
        info = SamplingBatchInfo.build(
            params,
            draws,
            histories if any(s.history for s in specs) else None,
            self.config.vocab_size,
            self.device,
            banned_token_ids=banned if any(banned) else None,
        )
        info.vocab_mask = build_token_bitmask([s.allowed for s in specs], self.config.vocab_size, self.device)
        return info
