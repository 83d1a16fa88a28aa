"""The interpreter against a real server: variables, errors with the program's context, streaming,
batches, sessions."""

from __future__ import annotations

import httpx
import pytest

import radixlm as sgl
from radixlm.backend.runtime import _free_port

pytestmark = pytest.mark.slow

FEW_SHOT = "".join(f"Q: What is {i} plus {i}?\nA: {2 * i}\n" for i in range(1, 9))


@sgl.function
def few_shot(s, question):
    s += "Answer each question with a number.\n" + FEW_SHOT
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=4, stop="\n")


def test_unknown_variable_fails_with_the_program_name(backend) -> None:
    @sgl.function
    def reads_typo(s):
        s += "Hello" + sgl.gen("greeting", max_tokens=2)
        s += s["greting"]

    with pytest.raises(sgl.ProgramError, match=r"program 'reads_typo': variable 'greting' is not defined"):
        reads_typo.run(backend=backend)


def test_server_rejection_names_the_program_step_and_field(backend) -> None:
    @sgl.function
    def bad(s):
        s += "Hi" + sgl.gen("x", max_tokens=2, top_p=5.0)

    state = bad.run(backend=backend)
    with pytest.raises(sgl.ProgramError, match=r"failed at gen\('x'\).*top_p"):
        state.text()


def test_unreachable_backend_names_the_url() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(sgl.BackendConnectionError, match=f"cannot reach the radixlm server at {url}"):
        sgl.RuntimeEndpoint(url)


def test_var_scope_and_set_var(backend) -> None:
    @sgl.function
    def scoped(s):
        s += "Numbers: "
        with s.var_scope("block"):
            s += "one, two, " + sgl.gen("next", max_tokens=3, stop=",", temperature=0)
        s["copy"] = s["block"]

    state = scoped.run(backend=backend)
    assert state["block"] == "one, two, " + state["next"] and state["copy"] == state["block"]
    assert state.text() == "Numbers: " + state["block"]


def test_role_mismatch_is_reported(backend) -> None:
    @sgl.function
    def bad_roles(s):
        s += sgl.user_begin() + "hi" + sgl.assistant_end()

    with pytest.raises(sgl.ProgramError, match="role 'assistant' ends but the current role is 'user'"):
        bad_roles.run(backend=backend).sync()


def test_calling_a_function_runs_it(backend) -> None:
    state = few_shot(question="What is 4 plus 4?", backend=backend, temperature=0)
    assert state["answer"].strip().isdigit()
    assert (
        state["answer"]
        == few_shot.run(question="What is 4 plus 4?", backend=backend, temperature=0)["answer"]
    )


def test_run_batch_returns_states_in_order_and_warms_the_shared_prefix(backend) -> None:
    questions = [f"What is {i} plus {i}?" for i in range(10, 18)]
    backend.flush_cache()
    states = few_shot.run_batch(
        [{"question": q} for q in questions], backend=backend, temperature=0, progress_bar=True
    )
    assert [s.text().split("Q: ")[-1].split("\n")[0] for s in states] == questions
    answers = [s["answer"].strip() for s in states]
    assert all(a.isdigit() for a in answers), answers
    # Every item found the few-shot prefix in the cache, warmed once before the fan-out.
    metas = [s.get_meta_info("answer") for s in states]
    assert all(m["cached_tokens"] >= m["prompt_tokens"] - 12 for m in metas), metas


def test_run_batch_reports_failing_items_after_finishing_the_rest(backend) -> None:
    @sgl.function
    def maybe_fail(s, i):
        s += f"Item {i}:" + sgl.gen("x", max_tokens=2)
        if i == 2:
            raise KeyError("boom")

    with pytest.raises(sgl.ProgramError, match=r"1 of 4 programs failed; first, item 2: 'boom'"):
        maybe_fail.run_batch([{"i": i} for i in range(4)], backend=backend)
    with pytest.raises(ValueError, match="batch_kwargs must be a list of dicts"):
        maybe_fail.run_batch({"i": 1}, backend=backend)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['temprature'\]"):
        maybe_fail.run_batch([{"i": 1}], backend=backend, temprature=0)
    with pytest.raises(TypeError, match="maybe_fail: missing a required argument: 'i'"):
        maybe_fail.run_batch([{}], backend=backend)


def test_generator_style_yields_every_state(backend) -> None:
    gen = few_shot.run_batch(
        [{"question": "What is 1 plus 1?"}] * 3, backend=backend, temperature=0, generator_style=True
    )
    assert [s["answer"] for s in gen] == [
        few_shot.run(question="What is 1 plus 1?", backend=backend, temperature=0)["answer"]
    ] * 3


def test_a_run_pins_its_kv_between_calls_and_releases_it_at_the_end(backend) -> None:
    @sgl.function
    def two_calls(s):
        s += "Count with me: one, two," + sgl.gen("a", max_tokens=4, temperature=0)
        s += " and then" + sgl.gen("b", max_tokens=16, temperature=0, ignore_eos=True)

    backend.flush_cache()
    state = two_calls.run(backend=backend, stream=True)
    pieces = state.text_iter("b")
    next(pieces)  # the second call is running: the first call's sequence is pinned under the run's session
    during = backend.get_server_info()
    assert during["num_sessions"] == 1 and during["pinned_tokens"] >= 8
    assert during["pinned_tokens"] <= state.get_meta_info("a")["prompt_tokens"] + 4
    list(pieces)
    state.text()
    after = backend.get_server_info()
    assert after["num_sessions"] == 0 and after["pinned_tokens"] == 0
    # The second call found the whole first call (prompt and output) in the cache.
    assert state.get_meta_info("b")["cached_tokens"] >= state.get_meta_info("a")["prompt_tokens"]


class CountingEndpoint(sgl.RuntimeEndpoint):
    """The real endpoint, counting the generate calls a program makes."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.calls = 0

    def generate(self, prompt, params):
        self.calls += 1
        return super().generate(prompt, params)


def _three_gens(s) -> None:
    s += "Answer each question with a number.\n" + FEW_SHOT
    s += "Q: What is 3 plus 3?\nA:" + sgl.gen("a1", stop="\n")
    s += "\nQ:" + sgl.gen("q2", stop="\n")
    s += "\nA:" + sgl.gen("a2", stop="\n")


def test_api_speculative_execution_serves_later_gens_from_one_call(runtime: sgl.Runtime) -> None:
    """With num_api_spec_tokens the first gen generates ahead without its stop; the program's next
    text matches what the model wrote (the few-shot pattern), so the later gens are read from it:
    one call instead of three, with the greedy outputs of the plain program."""
    endpoint = CountingEndpoint(runtime.url)
    speculative = sgl.function(num_api_spec_tokens=48)(_three_gens).run(backend=endpoint, temperature=0)
    speculative.sync()
    assert endpoint.calls == 1
    endpoint.calls = 0
    plain = sgl.function(_three_gens).run(backend=endpoint, temperature=0)
    plain.sync()
    assert endpoint.calls == 3
    for name in ("a1", "q2", "a2"):
        assert speculative[name] == plain[name] and "\n" not in speculative[name]
    assert speculative.text() == plain.text()
    endpoint.shutdown()


def test_api_speculation_is_dropped_when_the_program_diverges(runtime: sgl.Runtime) -> None:
    """Text the model did not write discards what was generated ahead: the next gen calls again."""

    @sgl.function(num_api_spec_tokens=48)
    def diverging(s):
        s += "Answer each question with a number.\n" + FEW_SHOT
        s += "Q: What is 3 plus 3?\nA:" + sgl.gen("a1", stop="\n")
        s += "\nQ: What is 12 plus 30?\nA:" + sgl.gen("a2", stop="\n")

    endpoint = CountingEndpoint(runtime.url)
    state = diverging.run(backend=endpoint, temperature=0)
    state.sync()
    assert endpoint.calls == 2
    assert state.text().endswith("Q: What is 12 plus 30?\nA:" + state["a2"])
    endpoint.shutdown()


class RecordingEndpoint(sgl.RuntimeEndpoint):
    """The real endpoint, recording each call's place in the call graph."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.calls: list = []

    def generate(self, prompt, params):
        self.calls.append(prompt.call)
        return super().generate(prompt, params)

    def commit_lazy(self, prompt) -> None:
        self.calls.append(prompt.call)
        super().commit_lazy(prompt)


def test_calls_carry_the_run_call_graph_to_the_server(runtime: sgl.Runtime) -> None:
    """Each call names its run, its id and the call it follows; a fork's branches follow the fork's
    prefix commit, the join's next call follows it too; the server's programs feed returns the graph."""

    @sgl.function
    def branchy(s):
        s += "Radix trees share prefixes." + sgl.gen("intro", max_tokens=3)
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" Point {i}:" + sgl.gen("point", max_tokens=2)
        forks.join()
        s += " Done." + sgl.gen("end", max_tokens=2)

    endpoint = RecordingEndpoint(runtime.url)
    branchy.run(backend=endpoint, temperature=0).sync()
    graph = {c.call: (c.parent, c.name) for c in endpoint.calls}
    assert graph == {
        "0.0": (None, "intro"),
        "0.1": ("0.0", "prefix"),
        "0/0.0": ("0.1", "point"),
        "0/1.0": ("0.1", "point"),
        "0.2": ("0.1", "end"),
    }
    run = {c.run for c in endpoint.calls}
    assert len(run) == 1 and next(iter(run)).startswith("branchy-")
    feed = httpx.get(f"{runtime.url}/dashboard/api/programs", timeout=60).json()["sessions"]
    mine = next(s for s in feed if s["session_id"] == next(iter(run)))
    assert mine["call_graph"] and mine["program"] == "branchy"
    served = {c["program_call"]["call"]: c["program_call"]["parent"] for c in mine["calls"]}
    assert served == {k: parent for k, (parent, _) in graph.items()}
    endpoint.shutdown()
