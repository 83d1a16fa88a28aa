"""Program workloads in the style of the SGLang paper, written in radixlm and run with run_batch:
multi-turn chat with long shared histories, tree-of-thought (fork-heavy), a ReAct agent loop, and
JSON decoding with a regex. Each runs on servers with the radix cache under each cache-aware policy
(lpm, dfs-weight, fcfs) and with the cache disabled.

Besides throughput, each workload's achieved cache hit rate is set against the best possible one,
computed from the workload's own prefix tree: every /generate call actually sent is replayed into a
token trie in order; a prompt token can only be reused if an earlier call's prompt or output held
the same prefix.

python benchmarks/bench_programs.py [--tiny] [--scale S]
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from common import Size, Table, bench_parser, fmt, parse_sizes, pyplot, save_figure, save_result, trie_insert

import radixlm as sgl

SIZES = {
    "num_programs": Size(16, 3, "program runs per workload"),
    "turns": Size(4, 2, "chat turns / agent steps", scales=False),
    "max_new_tokens": Size(24, 6, "tokens per gen call", scales=False),
}
SERVERS = [
    ("lpm", {"schedule_policy": "lpm"}),
    ("dfs-weight", {"schedule_policy": "dfs-weight"}),
    ("fcfs", {"schedule_policy": "fcfs"}),
    ("no cache", {"disable_radix_cache": True}),
]

SYSTEM = (
    "You are a meticulous assistant for a team of engineers. You answer questions about software, "
    "hardware and mathematics. Keep every answer short and concrete, show the key step of any "
    "calculation, and say so plainly when you are not sure. Never invent facts or references."
)
TOPICS = ["caching", "compilers", "networks", "databases", "schedulers", "GPUs", "queues", "hashing"]


@sgl.function
def multi_turn_chat(s, topic, turns, max_new_tokens):
    s += sgl.system(SYSTEM)
    for t in range(turns):
        s += sgl.user(f"Question {t + 1} about {topic}: give one more practical tip.")
        s += sgl.assistant(sgl.gen(f"answer_{t}", max_tokens=max_new_tokens))


@sgl.function
def tree_of_thought(s, topic, turns, max_new_tokens):
    s += SYSTEM + f"\nProblem: plan a small project about {topic}.\n"
    plans = s.fork(3)
    plans += lambda i: f"Plan {i + 1}:" + sgl.gen("plan", max_tokens=max_new_tokens, stop="\n") + "\n"
    for plan in plans:
        steps = plan.fork(2)
        steps += lambda j: f"Risk {j + 1}:" + sgl.gen("risk", max_tokens=max_new_tokens, stop="\n")
        steps.join()
    plans.join()
    s += "The best plan is Plan" + sgl.select("best", choices=[" 1", " 2", " 3"])


REACT_PROMPT = (
    "Answer the question by interleaving Thought, Action and Observation steps.\n"
    "Actions: Search[term] looks a term up; Finish[answer] ends the task.\n"
    "Question: What is the capital of Japan?\nThought: I should look up Japan.\nAction: Search[Japan]\n"
    "Observation: Japan is an island country in East Asia; its capital is Tokyo.\n"
    "Thought: The capital is Tokyo.\nAction: Finish[Tokyo]\n\n"
)


@sgl.function
def react_agent(s, topic, turns, max_new_tokens):
    s += REACT_PROMPT + f"Question: What is the most common use of {topic}?\n"
    for step in range(turns):
        s += "Thought:" + sgl.gen(f"thought_{step}", max_tokens=max_new_tokens, stop="\n") + "\n"
        s += "Action: " + sgl.select(f"action_{step}", choices=["Search", "Finish"]) + "["
        s += sgl.gen(f"arg_{step}", max_tokens=8, stop=["]", "\n"]) + "]\n"
        s += f"Observation: {topic} is widely used in production systems.\n"


JSON_REGEX = r"""\{"name": "[A-Za-z ]{1,16}", "year": [0-9]{4}, "field": "[a-z]{1,12}"\}"""


@sgl.function
def json_decode(s, topic, turns, max_new_tokens):
    s += SYSTEM + "\nDescribe, as JSON, one inventor who worked on " + topic + ".\n"
    s += sgl.gen("json", max_tokens=48, regex=JSON_REGEX)


WORKLOADS: dict[str, Callable[..., Any]] = {
    "multi-turn chat": multi_turn_chat,
    "tree-of-thought": tree_of_thought,
    "react agent": react_agent,
    "json regex": json_decode,
}


class RecordingEndpoint(sgl.RuntimeEndpoint):
    """Notes every /generate prompt it sends and the text generated for it, in sending order, for the
    workload's ideal hit rate."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def _generate(self, body: dict[str, Any], prompt: Any = None) -> Any:
        texts = body.get("text")
        with self._lock:
            start = len(self.calls)
            if texts is not None:
                self.calls += [(t, "") for t in (texts if isinstance(texts, list) else [texts])]
        out = super()._generate(body, prompt)
        for i, o in enumerate(out if isinstance(out, list) else [out]):
            if texts is not None:
                self.calls[start + i] = (self.calls[start + i][0], o["text"])
        return out


def best_hit_rate(tokenizer: Any, calls: list[tuple[str, str]]) -> float:
    """Share of prompt tokens an unbounded cache could reuse: a prompt token is new only if no earlier
    call's prompt or output held the same prefix (outputs count: their KV was computed by decode)."""
    trie: dict[int, dict] = {}
    new = total = 0
    for prompt, output in calls:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        full = tokenizer(prompt + output, add_special_tokens=False)["input_ids"]
        total += len(ids)
        new += trie_insert(trie, ids)
        trie_insert(trie, full)
    return 1 - new / max(total, 1)


def run_workload(url: str, program: Any, sizes: dict[str, int]) -> dict[str, Any]:
    backend = RecordingEndpoint(url)
    backend.flush_cache()
    items = [
        {"topic": TOPICS[i % len(TOPICS)] + ("" if i < len(TOPICS) else f" (case {i})")}
        | {"turns": sizes["turns"], "max_new_tokens": sizes["max_new_tokens"]}
        for i in range(sizes["num_programs"])
    ]
    before = backend.get_server_info()
    t0 = time.perf_counter()
    program.run_batch(items, backend=backend, temperature=0)
    wall = time.perf_counter() - t0
    after = backend.get_server_info()
    prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
    return {
        "wall_s": wall,
        "programs_per_s": len(items) / wall,
        "hit_rate": (after["cached_tokens"] - before["cached_tokens"]) / max(prompt_tokens, 1),
        "calls": backend.calls,
    }


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    args, sizes = parse_sizes(ap, argv, SIZES)
    results: dict[str, dict[str, Any]] = {w: {} for w in WORKLOADS}
    model_path = ""
    for server_name, flags in SERVERS:
        with sgl.Runtime(log_level="warning", **flags) as runtime:
            model_path = runtime.endpoint.model_info["model_path"]
            multi_turn_chat.run(topic="warm-up", turns=1, max_new_tokens=2, backend=runtime).sync()
            for workload, program in WORKLOADS.items():
                results[workload][server_name] = run_workload(runtime.url, program, sizes)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    table = Table(
        f"Program workloads, {sizes['num_programs']} runs each: programs/s (cache hit rate)",
        ["workload", *[name for name, _ in SERVERS], "best hit rate", "lpm vs no cache"],
    )
    summary: dict[str, Any] = {}
    for workload, by_server in results.items():
        best = best_hit_rate(tokenizer, by_server["lpm"]["calls"])
        row = [workload]
        for name, _ in SERVERS:
            r = by_server[name]
            row.append(f"{fmt(r['programs_per_s'])} ({fmt(r['hit_rate'], '.2f')})")
        speedup = by_server["no cache"]["wall_s"] / by_server["lpm"]["wall_s"]
        row += [fmt(best, ".2f"), fmt(speedup, ".2f", "x")]
        table.rows.append(row)
        summary[workload] = {
            "best_hit_rate": best,
            "servers": {n: {k: v for k, v in r.items() if k != "calls"} for n, r in by_server.items()},
            "lpm_speedup_vs_no_cache": speedup,
        }
    notes = [
        f"{w}: lpm reaches {s['servers']['lpm']['hit_rate']:.2f} of a best possible {s['best_hit_rate']:.2f} "
        f"hit rate; {s['lpm_speedup_vs_no_cache']:.2f}x the throughput of no cache"
        for w, s in summary.items()
    ]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.2
    for k, (name, _) in enumerate(SERVERS):
        xs = [i + (k - 1.5) * width for i in range(len(WORKLOADS))]
        ax.bar(xs, [results[w][name]["programs_per_s"] for w in WORKLOADS], width, label=name)
    ax.set_xticks(range(len(WORKLOADS)), list(WORKLOADS))
    ax.set_ylabel("programs / s")
    ax.legend(fontsize=8)
    save_figure(fig, args.out_dir / "programs.png")
    save_result(args.out_dir, "programs", {"workloads": summary}, [table], notes, ["programs.png"], sizes)


if __name__ == "__main__":
    main()
