"""Backends run programs' gen/select calls: a radixlm server (RuntimeEndpoint, or Runtime to start
one locally) or any OpenAI-compatible server."""

from radixlm.backend.base import BackendConnectionError, BaseBackend, Prompt
from radixlm.backend.openai import OpenAI
from radixlm.backend.runtime import Runtime
from radixlm.backend.runtime_endpoint import RuntimeEndpoint

__all__ = ["BackendConnectionError", "BaseBackend", "OpenAI", "Prompt", "Runtime", "RuntimeEndpoint"]
