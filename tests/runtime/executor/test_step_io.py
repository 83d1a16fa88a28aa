"""A plan's window slots (a windowed pool, kvcache/pool.py) into the step's tensors: the table
entries' window slots beside theirs, and the new tokens' window slots as the batch's window_loc."""

from __future__ import annotations

import torch

from radixlm_runtime.executor.step_io import build_batch
from radixlm_runtime.step import ForwardItem, StepPlan


def test_window_slots_go_beside_the_table_writes_and_the_new_tokens() -> None:
    # Request in row 0: 3 tokens cached (written before), 2 new; request in row 1: newly admitted
    # with a 2-token cached prefix (written now), 1 new.
    plan = StepPlan(
        [
            ForwardItem(0, 3, [7, 8], [1, 2, 3, 4, 5], write_from=3, logits_from=4, window_slots=[9, 10]),
            ForwardItem(1, 2, [6], [6, 7, 8], write_from=0, logits_from=2, window_slots=[0, 11, 12]),
        ]
    )
    batch, writes = build_batch(plan, torch.device("cpu"))
    assert writes is not None
    rows, cols, slots, window = (t.tolist() for t in writes)
    assert (rows, cols) == ([0, 0, 1, 1, 1], [3, 4, 0, 1, 2])
    assert slots == [4, 5, 6, 7, 8]
    assert window == [9, 10, 0, 11, 12]  # 0: a token out of every window
    assert batch.out_cache_loc.tolist() == [4, 5, 8]
    assert batch.window_loc is not None and batch.window_loc.tolist() == [9, 10, 12]
