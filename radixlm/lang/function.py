"""@function programs: run one, run a batch (warming the prefix the batch shares), trace one."""

from __future__ import annotations

import dataclasses
import inspect
import os
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixlm.lang import ir
from radixlm.lang.backend_api import BaseBackend
from radixlm.lang.interpreter import ProgramError, ProgramState, run_program
from radixlm.lang.tracer import CallGraph, trace_program

# A shared prefix shorter than this is not worth a separate warm-up request.
MIN_WARM_PREFIX_CHARS = 64

_default_backend: BaseBackend | None = None


def set_default_backend(backend: Any) -> None:
    global _default_backend
    _default_backend = backend


def resolve_backend(backend: Any) -> BaseBackend:
    backend = backend if backend is not None else _default_backend
    if backend is None:
        raise ValueError(
            "no backend: pass backend=... or call radixlm.set_default_backend(radixlm.RuntimeEndpoint(url))"
        )
    # A Runtime (local server) runs programs through its endpoint.
    return getattr(backend, "endpoint", backend)


def _run_defaults(**options: Any) -> ir.GenParams:
    """`f.run(max_new_tokens=..., temperature=...)`: every gen's defaults, over SGLang's."""
    return ir.GenParams(**options).merged_over(ir.RUN_DEFAULTS)


# Sampling options a run takes (constraints belong to individual gens).
_RUN_OPTIONS = {f.name for f in dataclasses.fields(ir.GenParams)} - {"dtype", "regex", "json_schema", "ebnf"}


class Function:
    def __init__(self, func: Callable[..., Any], num_api_spec_tokens: int | None = None) -> None:
        self.func = func
        self.name = func.__name__
        self.num_api_spec_tokens = num_api_spec_tokens
        self.signature = inspect.signature(func)
        params = list(self.signature.parameters.values())
        if not params:
            raise TypeError(f"@function {self.name}: the first parameter must be the program state (s)")
        self.arg_names = [p.name for p in params[1:]]

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            bound = self.signature.bind(None, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"@function {self.name}: {e}") from e
        bound.apply_defaults()
        return dict(list(bound.arguments.items())[1:])

    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], ir.GenParams]:
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _RUN_OPTIONS and k not in self.arg_names}
        return kwargs, _run_defaults(**options)

    def run(self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any) -> ProgramState:
        """Runs the program; sampling options (max_new_tokens, temperature, ...) are the defaults of
        every gen in it."""
        kwargs, defaults = self._split(kwargs)
        arguments = self.bind(args, kwargs)
        return run_program(
            self.name,
            self.func,
            resolve_backend(backend),
            arguments,
            defaults,
            stream,
            num_api_spec_tokens=self.num_api_spec_tokens,
        )

    __call__ = run

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        warm_prefix: bool = True,
        **options: Any,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Runs the program once per kwargs dict, concurrently. First the prompt prefix every item
        shares (found by tracing each item up to its first gen) is prefilled once and pinned, so the
        items hit the cache instead of prefilling it side by side."""
        if not isinstance(batch_kwargs, list) or not all(isinstance(k, dict) for k in batch_kwargs):
            raise ValueError("run_batch: batch_kwargs must be a list of dicts of program arguments")
        unknown = sorted(set(options) - _RUN_OPTIONS)
        if unknown:
            raise ValueError(f"run_batch: unknown option(s) {unknown}")
        defaults = _run_defaults(**options)
        backend_ = resolve_backend(backend)
        items = [self.bind((), dict(k)) for k in batch_kwargs]
        if num_threads == "auto":
            num_threads = max(96, (os.cpu_count() or 1) * 16)
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"run_batch: num_threads must be a positive int or 'auto', got {num_threads!r}")
        num_threads = max(1, min(num_threads, len(items)))

        warm_session = f"{self.name}-batch-{uuid.uuid4().hex[:12]}"
        warmed = warm_prefix and len(items) > 1 and self._warm_shared_prefix(items, backend_, warm_session)

        def one(arguments: dict[str, Any]) -> ProgramState:
            return run_program(
                self.name,
                self.func,
                backend_,
                arguments,
                defaults,
                sync=True,
                num_api_spec_tokens=self.num_api_spec_tokens,
            )

        def results() -> Iterator[ProgramState]:
            bar = _progress(len(items)) if progress_bar else None
            failures: list[tuple[int, BaseException]] = []
            try:
                with ThreadPoolExecutor(num_threads, thread_name_prefix=f"radixlm-{self.name}") as pool:
                    for i, future in enumerate([pool.submit(one, a) for a in items]):
                        try:
                            state = future.result()
                        except Exception as e:
                            failures.append((i, e))
                            continue
                        finally:
                            if bar is not None:
                                bar.update(1)
                        yield state
            finally:
                if bar is not None:
                    bar.close()
                if warmed:
                    backend_.end_session(warm_session)
            if failures:
                i, first = failures[0]
                raise ProgramError(
                    f"run_batch {self.name}: {len(failures)} of {len(items)} programs failed; "
                    f"first, item {i}: {first}"
                ) from first

        return results() if generator_style else list(results())

    def _warm_shared_prefix(self, items: list[dict[str, Any]], backend: BaseBackend, session_id: str) -> bool:
        prefixes = [
            trace_program(self.name, self.func, self.arg_names, a, stop_at_first_gen=True).leading_text(
                backend.chat_template
            )
            for a in items
        ]
        shared = os.path.commonprefix(prefixes)
        # Cut at a line or word boundary: the items' tokenizations agree up to there.
        cut = max(shared.rfind("\n"), shared.rfind(" "))
        shared = shared[: cut + 1] if cut >= 0 else ""
        if len(shared) < MIN_WARM_PREFIX_CHARS:
            return False
        backend.cache_prefix(shared, session_id=session_id)
        return True

    def trace(self, *, backend: Any = None, **arguments: Any) -> CallGraph:
        """The program's call graph; arguments not given are placeholders."""
        unknown = sorted(set(arguments) - set(self.arg_names))
        if unknown:
            raise ValueError(f"trace {self.name}: unknown argument(s) {unknown}; arguments: {self.arg_names}")
        defaults = {
            p.name: p.default
            for p in list(self.signature.parameters.values())[1:]
            if p.default is not inspect.Parameter.empty
        }
        return trace_program(self.name, self.func, self.arg_names, defaults | arguments)

    def __repr__(self) -> str:
        return f"<radixlm function {self.name}({', '.join(self.arg_names)})>"


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total)
