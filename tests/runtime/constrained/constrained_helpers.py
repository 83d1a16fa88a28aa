"""Helpers shared by the constrained-decoding tests: token-graph distances and a sampler-agnostic walk."""

from __future__ import annotations

import random
from collections import deque

import numpy as np

from radixlm_runtime.constrained.regex_fsm import TokenIndex


def token_edges(index: TokenIndex) -> tuple[np.ndarray, np.ndarray]:
    src = np.repeat(np.arange(index.num_states), np.diff(index.offsets))
    return src, index.next_states.astype(np.int64)


def distance_to_accept(index: TokenIndex) -> np.ndarray:
    """Fewest tokens from each state to an accepting state (a large number where unreachable)."""
    src, dst = token_edges(index)
    pairs = np.unique(src * index.num_states + dst)
    reverse: dict[int, list[int]] = {}
    for s, d in zip((pairs // index.num_states).tolist(), (pairs % index.num_states).tolist()):
        reverse.setdefault(d, []).append(s)
    unreachable = 1 << 30
    dist = np.full(index.num_states, unreachable, dtype=np.int64)
    queue = deque(np.flatnonzero(index.dfa.accepting).tolist())
    dist[list(queue)] = 0
    while queue:
        d = queue.popleft()
        for s in reverse.get(d, ()):
            if dist[s] == unreachable:
                dist[s] = dist[d] + 1
                queue.append(s)
    return dist


def random_walk(index: TokenIndex, rng: random.Random, budget: int = 60) -> list[int]:
    """Samples a token sequence the index allows, as any sampler could: uniformly among the allowed
    tokens, taking EOS with probability 1/4 where allowed, and after `budget` steps only along
    shortest paths to acceptance so that every walk ends. Returns the ids without the final EOS."""
    dist = distance_to_accept(index)
    state, ids = index.initial_state, []
    while True:
        allowed = index.allowed(state)
        if len(allowed) == 0 or (index.eos_allowed(state) and rng.random() < 0.25):
            return ids
        if len(ids) >= budget:
            if dist[state] == 0:
                return ids
            nxt = index.next_states[index.offsets[state] : index.offsets[state + 1]]
            allowed = allowed[dist[nxt] < dist[state]]
        token = int(allowed[rng.randrange(len(allowed))])
        ids.append(token)
        state = index.next_state(state, token)
        assert state >= 0
