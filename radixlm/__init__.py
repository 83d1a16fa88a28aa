"""radixlm: a structured-generation language for LLM programs; SGLang programs run by changing
their import to `import radixlm as sgl`."""

from radixlm.backend import BackendConnectionError, OpenAI, Runtime, RuntimeEndpoint
from radixlm.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    image,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from radixlm.lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.lang.function import Function, set_default_backend
from radixlm.lang.interpreter import ProgramError, ProgramState, ProgramStateGroup
from radixlm.lang.tracer import CallGraph

__all__ = [
    "BackendConnectionError",
    "CallGraph",
    "Function",
    "OpenAI",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_server_info",
    "greedy_token_selection",
    "image",
    "select",
    "separate_reasoning",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
]
