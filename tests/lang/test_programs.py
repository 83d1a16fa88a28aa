"""SGLang's frontend test programs (sglang/test/test_programs.py), ported: `import radixlm as sgl`,
run against a real radixlm server on the default model. Structural checks always; answer checks
only where a 135M model gets them right."""

from __future__ import annotations

import json
import re

import pytest

import radixlm as sgl

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def default_backend(backend: sgl.RuntimeEndpoint) -> None:
    sgl.set_default_backend(backend)


def test_few_shot_qa() -> None:
    @sgl.function
    def few_shot_qa(s, question):
        s += "The following are questions with answers.\n\n"
        s += "Q: What is the capital of France?\nA: Paris\n"
        s += "Q: What is the capital of Germany?\nA: Berlin\n"
        s += "Q: What is the capital of Italy?\nA: Rome\n"
        s += "Q: " + question + "\n"
        s += "A:" + sgl.gen("answer", stop="\n", temperature=0)

    state = few_shot_qa.run(question="What is the capital of Spain?")
    assert "madrid" in state["answer"].lower()
    assert state.text().endswith("A:" + state["answer"]) and "\n" not in state["answer"]
    meta = state.get_meta_info("answer")
    assert meta["finish_reason"]["type"] == "stop" and meta["prompt_tokens"] > 40


def test_mt_bench_multi_turn() -> None:
    @sgl.function
    def answer_mt_bench(s, question_1, question_2):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question_1)
        s += sgl.assistant(sgl.gen("answer_1", max_tokens=24))
        with s.user():
            s += question_2
        with s.assistant():
            s += sgl.gen("answer_2", max_tokens=24)

    state = answer_mt_bench.run(
        question_1="Name a primary color.", question_2="Name another one.", temperature=0
    )
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["answer_1"] and messages[4]["content"] == state["answer_2"]
    assert state["answer_1"] and state["answer_2"]
    # The second turn is sent as the first turn's text plus more: its prompt comes from the cache.
    meta = state.get_meta_info("answer_2")
    assert meta["cached_tokens"] >= state.get_meta_info("answer_1")["prompt_tokens"] - 1
    assert state.text().count("<|im_start|>") == 5


def test_select() -> None:
    @sgl.function
    def true_or_false(s, statement):
        s += "Determine whether the statement below is true or false.\n"
        s += "Statement: " + statement + "\n"
        s += "Answer: " + sgl.select("answer", choices=["True", "False"])

    # A 135M model answers "False" to most statements: only the structure is checked here (the
    # select-methods test below checks a choice the model does get right).
    for statement in ("The sky is blue.", "Two plus two is five."):
        state = true_or_false.run(statement=statement)
        assert state["answer"] in ("True", "False")
        assert state.text().endswith("Answer: " + state["answer"])
        assert len(state.get_meta_info("answer")["scores"]) == 2


def test_select_methods_each_pick_a_choice() -> None:
    @sgl.function
    def capital(s, method):
        s += "The capital of France is" + sgl.select(
            "city", choices=[" Paris", " London", " Berlin"], choices_method=method
        )

    for method in (
        sgl.token_length_normalized,
        sgl.greedy_token_selection,
        sgl.unconditional_likelihood_normalized,
    ):
        assert capital.run(method=method)["city"] == " Paris"


def test_decode_int() -> None:
    @sgl.function
    def decode_int(s):
        s += "The number of hours in a day is " + sgl.gen_int("hours", max_tokens=6) + "\n"
        s += "The number of days in a year is " + sgl.gen_int("days", max_tokens=6) + "\n"

    state = decode_int.run(temperature=0.1)
    for name in ("hours", "days"):
        assert re.fullmatch(r"[-+]?[0-9]+[ \n]*", state[name]), state.text()
    # The 135M model starts with the right digits but, kept to digits, rarely stops after them.
    assert state["hours"].startswith("24"), state.text()


def test_decode_json_regex() -> None:
    @sgl.function
    def decode_json(s):
        from radixlm_runtime.constrained import REGEX_FLOAT, REGEX_INT, REGEX_STR

        s += "Generate a JSON object to describe the basic city information of Paris.\n"
        with s.var_scope("json_output"):
            s += "{\n"
            s += '  "name": ' + sgl.gen(regex=REGEX_STR) + ",\n"
            s += '  "population": ' + sgl.gen(regex=REGEX_INT, stop=[" ", "\n"]) + ",\n"
            s += '  "area": ' + sgl.gen(regex=REGEX_INT, stop=[" ", "\n"]) + ",\n"
            s += '  "latitude": ' + sgl.gen(regex=REGEX_FLOAT, stop=[" ", "\n"]) + "\n"
            s += "}"

    state = decode_json.run(temperature=0.0)
    js = json.loads(state["json_output"])
    assert isinstance(js["name"], str) and isinstance(js["population"], int)
    assert isinstance(js["latitude"], int | float)


def test_decode_json_with_gen_int_and_gen_string() -> None:
    @sgl.function
    def decode_json(s):
        s += "Generate a JSON object to describe the basic city information of Paris.\n"
        with s.var_scope("json_output"):
            s += "{\n"
            s += '  "name": ' + sgl.gen_string(max_tokens=16) + ",\n"
            s += '  "population": ' + sgl.gen_int(max_tokens=10) + ",\n"
            s += '  "is_capital": ' + sgl.gen(dtype=bool) + ",\n"
            s += '  "area": ' + sgl.gen(dtype=float, max_tokens=8) + "\n"
            s += "}"

    state = decode_json.run(temperature=0.0)
    text = state["json_output"].replace("True", "true").replace("False", "false")
    js = json.loads(text)
    assert isinstance(js["name"], str) and isinstance(js["population"], int)
    assert isinstance(js["is_capital"], bool) and isinstance(js["area"], int | float)


def test_expert_answer() -> None:
    @sgl.function
    def expert_answer(s, question):
        s += "Question: " + question + "\n"
        s += "A good person to answer this question is" + sgl.gen("expert", stop=".", max_tokens=20) + ".\n"
        s += "For instance," + s["expert"] + " would answer that" + sgl.gen("answer", stop=".", max_tokens=30)
        s += "."

    state = expert_answer.run(question="What is the capital of France?", temperature=0.1)
    expert = state["expert"]
    assert expert and "." not in expert
    assert f"For instance,{expert} would answer that{state['answer']}." in state.text()


def test_tool_use() -> None:
    @sgl.function
    def tool_use(s, lhs, rhs):
        s += "To compute " + lhs + " + " + rhs + ", I need to use a "
        s += sgl.select("tool", choices=["calculator", "search engine"]) + ". "
        if s["tool"] == "calculator":
            s += "The result is " + str(eval(lhs + "+" + rhs)) + "."

    state = tool_use.run(lhs="1234", rhs="5678")
    assert state["tool"] == "calculator"
    assert state.text().endswith("The result is 6912.")


def test_react() -> None:
    @sgl.function
    def react(s, question):
        s += (
            "Solve a question answering task with interleaving Thought, Action, Observation steps. "
            "Action can be two types:\n"
            "(1) Search[entity], which searches the entity and returns a paragraph about it.\n"
            "(2) Finish[answer], which returns the answer and finishes the task.\n"
            "Question: Which city is the capital of Germany?\n"
            "Thought 1: I need to search Germany and find its capital.\n"
            "Action 1: Search[Germany]\n"
            "Observation 1: Germany is a country in Europe. Its capital is Berlin.\n"
            "Thought 2: The capital of Germany is Berlin.\n"
            "Action 2: Finish[Berlin]\n\n"
        )
        s += "Question: " + question + "\n"
        for i in range(1, 4):
            s += f"Thought {i}:" + sgl.gen(f"thought_{i}", stop=["\n", "Action"], max_tokens=40) + "\n"
            s += f"Action {i}: " + sgl.select(f"action_{i}", choices=["Search", "Finish"])
            s += "[" + sgl.gen(f"arg_{i}", stop="]", max_tokens=12) + "]\n"
            if s[f"action_{i}"] == "Finish":
                return i
            s += f"Observation {i}: France is a country in Europe. Its capital is Paris.\n"
        return 3

    state = react.run(question="Which city is the capital of France?", temperature=0)
    steps = state.ret_value
    assert 1 <= steps <= 3
    actions = [state[f"action_{i}"] for i in range(1, steps + 1)]
    assert all(a in ("Search", "Finish") for a in actions)
    assert steps == 3 or actions[-1] == "Finish"


def test_parallel_decoding() -> None:
    @sgl.function
    def parallel_decoding(s, topic):
        s += "Act as a helpful assistant.\n"
        s += "USER: Give some tips for " + topic + ".\n"
        s += "ASSISTANT: Okay. Here are three tips, each in a short sentence:\n"
        s += "Tip 1:" + sgl.gen("tip_1", max_tokens=16, stop=["\n", ".", "2."]) + "\n"
        forks = s.fork(3)
        forks += lambda i: (
            f"Now, expand tip {i + 1} into one paragraph:\n" + sgl.gen("detail", max_tokens=24, stop="\n\n")
        )
        forks.join()
        s += "In summary," + sgl.gen("summary", max_tokens=24)

    state = parallel_decoding.run(topic="writing a good blog post", temperature=0.3)
    details = state["detail"]
    assert isinstance(details, list) and len(details) == 3 and all(isinstance(d, str) for d in details)
    assert state["summary"] and "In summary," in state.text()
    # The branches do not write into the parent's text.
    assert "expand tip" not in state.text()


def test_parallel_encoding() -> None:
    @sgl.function
    def parallel_encoding(s, question, context_0, context_1, context_2):
        s += "USER: I will ask a question based on some statements.\n"
        forks = s.fork(3)
        forks[0] += "Statement 0: " + context_0 + "\n"
        forks[1] += "Statement 1: " + context_1 + "\n"
        forks[2] += "Statement 2: " + context_2 + "\n"
        forks.join(mode="concate_and_append")
        s += "Now, please answer the following question. Do not list options.\n"
        s += "Question: " + question + "\n"
        s += "ASSISTANT: The father of Julian is" + sgl.gen("answer", stop=["\n", "."], max_tokens=8)

    state = parallel_encoding.run(
        question="Who is the father of Julian?",
        context_0="Ethan is the father of Liam.",
        context_1="Noah is the father of Julian.",
        context_2="Oliver is the father of Carlos.",
        temperature=0,
    )
    text = state.text()
    statements = (
        "Statement 0: Ethan is the father of Liam.\n"
        "Statement 1: Noah is the father of Julian.\n"
        "Statement 2: Oliver is the father of Carlos.\n"
    )
    assert text.startswith("USER: I will ask a question based on some statements.\n" + statements)
    # A 135M model tends to name the first father it read; only the structure is checked.
    assert state["answer"].strip()


def test_stream() -> None:
    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=24))

    state = qa.run(question="Tell me a fun fact about owls.", stream=True, temperature=0)
    pieces = list(state.text_iter(var_name="answer"))
    assert len(pieces) > 3 and "".join(pieces) == state["answer"]
    again = qa.run(question="Tell me a fun fact about owls.", stream=True, temperature=0)
    whole = list(again.text_iter())
    assert "".join(whole) == again.text() and again.text().startswith("<|im_start|>user\n")


def test_regex_ip_address() -> None:
    ip = r"((25[0-5]|2[0-4]\d|[01]?\d\d?).){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"

    @sgl.function
    def regex_gen(s):
        s += "Q: What is the IP address of the Google DNS servers?\n"
        s += "A: " + sgl.gen("answer", temperature=0, regex=ip)

    assert re.fullmatch(ip, regex_gen.run()["answer"])


def test_ebnf_and_json_schema_gen() -> None:
    """gen(ebnf=...) and gen(json_schema=...) over the native API (SGLang's own frontend has
    json_schema but no ebnf argument; its /generate takes `ebnf`, as this server's does)."""
    grammar = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [1-9] [0-9]?'
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}, "population": {"type": "integer"}},
        "required": ["city", "population"],
    }

    @sgl.function
    def constrained(s):
        s += "Q: Write a sum of two small numbers.\nA: " + sgl.gen("sum", max_tokens=12, ebnf=grammar)
        s += "\nQ: A city as JSON.\nA: " + sgl.gen("city", max_tokens=48, json_schema=json.dumps(schema))

    state = constrained.run(temperature=0)
    assert re.fullmatch(r"[1-9][0-9]?([+-][1-9][0-9]?)*", state["sum"]), state["sum"]
    city = json.loads(state["city"])
    assert set(city) == {"city", "population"} and isinstance(city["population"], int)
    assert len(city["city"]) <= 16


def test_dtype_gen() -> None:
    @sgl.function
    def dtype_gen(s):
        s += "Q: What is the full name of DNS?\n"
        s += "A: The full nams is " + sgl.gen("str_res", dtype=str, stop="\n") + "\n"
        s += "Q: Which year was DNS invented?\n"
        s += "A: " + sgl.gen("int_res", dtype=int) + "\n"
        s += "Q: What is the value of pi?\n"
        s += "A: " + sgl.gen("float_res", dtype=float) + "\n"
        s += "Q: Is the sky blue?\n"
        s += "A: " + sgl.gen("bool_res", dtype=bool) + "\n"

    state = dtype_gen.run(temperature=0)
    assert state["str_res"].startswith('"') and state["str_res"].endswith('"')
    assert isinstance(int(state["int_res"]), int)
    assert isinstance(float(state["float_res"]), float)
    assert state["bool_res"] in ("True", "False")
