"""The executor's two translations: a StepPlan into device tensors (one packed host-to-device copy),
and a step's sampled tokens and logprobs back into plain Python (one device-to-host read)."""

from __future__ import annotations

import torch

from radixlm_runtime.forward_batch import ForwardBatch
from radixlm_runtime.sampling.sampler import accepted_draft_len
from radixlm_runtime.step import ItemResult, SampleSpec, StepPlan, StepResult, TopLogprobs
from radixlm_runtime.utils.transfer import host_tensor, to_device

# (rows, positions, slots) of request-to-token entries, and the window slots of those entries
# (None: the pool keeps no window slots).
TableWrites = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def build_batch(plan: StepPlan, device: torch.device) -> tuple[ForwardBatch, TableWrites | None]:
    """The step's ForwardBatch, and the request-to-token entries the plan changes: the new tokens'
    slots, plus a newly admitted request's cached prefix (with window slots, theirs beside)."""
    input_ids: list[int] = []
    out_loc: list[int] = []
    logit_rows: list[int] = []
    w_rows: list[int] = []
    w_cols: list[int] = []
    w_slots: list[int] = []
    windowed = bool(plan.items) and plan.items[0].window_slots is not None
    window_loc: list[int] = []
    w_window: list[int] = []
    offset = 0
    for it in plan.items:
        n = len(it.input_ids)
        start, end = it.prefix_len, it.prefix_len + n
        input_ids += it.input_ids
        out_loc += it.seq_slots[start:end]
        logit_rows += range(offset + n - it.num_logit_rows, offset + n)
        if it.write_from < end:
            w_rows += [it.row] * (end - it.write_from)
            w_cols += range(it.write_from, end)
            w_slots += it.seq_slots[it.write_from : end]
        if windowed:
            assert it.window_slots is not None and len(it.window_slots) == end - it.write_from
            w_window += it.window_slots
            window_loc += it.window_slots[start - it.write_from :]
        offset += n
    batch = ForwardBatch.build(
        input_ids=input_ids,
        req_pool_indices=[it.row for it in plan.items],
        prefix_lens=[it.prefix_len for it in plan.items],
        extend_lens=[len(it.input_ids) for it in plan.items],
        out_cache_loc=out_loc,
        logits_indices=logit_rows,
        seq_slots=[it.seq_slots for it in plan.items],
        device=device,
    )
    if not w_rows:
        return batch, None
    parts = [w_rows, w_cols, w_slots, *((w_window, window_loc) if windowed else ())]
    rows, cols, slots, *windows = to_device(host_tensor(parts), device).split(list(map(len, parts)))
    if not windowed:
        return batch, (rows, cols, slots, None)
    window, batch.window_loc = windows
    return batch, (rows, cols, slots, window)


class StepOutputs:
    """Collects a step's device results as flat float64 pieces (token ids are exact in float64)
    and reads them all back with a single `.tolist()`."""

    def __init__(self, plan: StepPlan) -> None:
        self.items = plan.items
        # First logits row of each item, and the total last: items' rows are laid out in plan order.
        self._row_base: list[int] = [0]
        base = 0
        for it in self.items:
            base += it.num_logit_rows
            self._row_base.append(base)
        self._sampled = [i for i, it in enumerate(self.items) if it.sample is not None]
        self._parts: list[torch.Tensor] = []
        self._sample_top = 0
        self._has_sample_lp = False
        self._prompt: list[int] = []  # items with prompt logprobs, in order
        self._prompt_rows = 0
        self._prompt_top = 0

    def sample_specs(self) -> list[SampleSpec]:
        """One spec per sampled row: one per item, plus one per draft token of a speculative item."""
        return [s for i in self._sampled for s in self.items[i].samples]

    def sample_rows(self) -> list[int]:
        """Logits rows sampled: each sampled item's last row, preceded by the rows of the tokens
        before its draft tokens when it has any."""
        rows: list[int] = []
        for i in self._sampled:
            end = self._row_base[i + 1]
            rows.extend(range(end - 1 - self.items[i].draft_len, end))
        return rows

    def add_samples(
        self,
        next_ids: torch.Tensor,
        logprobs: torch.Tensor | None,
        top: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        self._parts.append(next_ids.double())
        if logprobs is not None:
            self._has_sample_lp = True
            self._parts.append(logprobs.double())
        if top is not None:
            values, ids = top
            self._sample_top = values.shape[1]
            self._parts += [values.double().flatten(), ids.double().flatten()]

    def add_prompt_logprobs(self, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens the plan asks for, all items' rows in one gather."""
        rows: list[int] = []
        targets: list[int] = []
        top = 0
        for i, it in enumerate(self.items):
            spec = it.prompt_logprobs
            if spec is None:
                continue
            self._prompt.append(i)
            rows.extend(self._row_base[i] + r for r in spec.rows)
            targets.extend(spec.targets)
            if spec.rows:
                top = max(top, spec.top_logprobs_num)
        if not rows:
            return
        index = to_device(torch.tensor(rows), logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
        chosen = logprobs.gather(1, to_device(torch.tensor(targets), logits.device)[:, None]).squeeze(1)
        self._parts.append(chosen.double())
        self._prompt_rows = len(rows)
        if top:
            values, ids = logprobs.topk(top, dim=-1)
            self._prompt_top = top
            self._parts += [values.double().flatten(), ids.double().flatten()]

    def start_read(self) -> None:
        """Queues one copy of every result to the host, behind the step's kernels; `read` waits for
        it, so the host is free until then."""
        self._event = None
        parts = self._parts
        # A greedy step without logprobs has one part: no concatenation (a kernel launch on CUDA).
        self._host = None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)
        if self._host is not None and self._host.is_cuda:
            host = torch.empty(self._host.shape, dtype=self._host.dtype, pin_memory=True)
            self._host = host.copy_(self._host, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def read(self) -> StepResult:
        if self._event is not None:
            self._event.synchronize()
        flat = self._host.tolist() if self._host is not None else []
        results = [ItemResult() for _ in self.items]
        pos = 0

        def take(n: int) -> list[float]:
            nonlocal pos
            pos += n
            return flat[pos - n : pos]

        n = sum(1 + self.items[i].draft_len for i in self._sampled)
        if n:
            ids = take(n)
            lps = take(n) if self._has_sample_lp else None
            k = self._sample_top
            top_vals, top_ids = (take(n * k), take(n * k)) if k else ([], [])
            j = 0
            for i in self._sampled:
                it, res = self.items[i], results[i]
                rows = range(j, j + 1 + it.draft_len)
                j = rows.stop
                sampled = [int(v) for v in ids[rows.start : j]]
                m = accepted_draft_len(it.draft, sampled) if it.draft_len else 0
                res.accepted, res.next_token = sampled[:m], sampled[m]
                if lps is not None:
                    res.accepted_logprobs, res.logprob = lps[rows[0] : rows[m]], lps[rows[m]]
                spec = it.sample
                if k and spec is not None and spec.top_logprobs_num:
                    width = spec.top_logprobs_num
                    tops = [_top_entries(top_vals, top_ids, r, k, width) for r in rows[: m + 1]]
                    res.accepted_top_logprobs, res.top_logprobs = tops[:m], tops[m]
        if self._prompt_rows:
            chosen = take(self._prompt_rows)
            k = self._prompt_top
            top_vals, top_ids = (take(self._prompt_rows * k), take(self._prompt_rows * k)) if k else ([], [])
            r = 0
            for i in self._prompt:
                spec = self.items[i].prompt_logprobs
                assert spec is not None
                res = results[i]
                res.prompt_logprobs = chosen[r : r + len(spec.rows)]
                if spec.top_logprobs_num:
                    res.prompt_top_logprobs = [
                        _top_entries(top_vals, top_ids, r + q, k, spec.top_logprobs_num)
                        for q in range(len(spec.rows))
                    ]
                r += len(spec.rows)
        return StepResult(results)


def _top_entries(values: list[float], ids: list[float], row: int, width: int, k: int) -> TopLogprobs:
    """The first k of a row of a flattened [rows, width] top-k result."""
    start = row * width
    return list(zip(values[start : start + k], map(int, ids[start : start + k])))
