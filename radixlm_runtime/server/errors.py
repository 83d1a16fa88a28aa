"""The one error type the HTTP side raises; every endpoint renders it in OpenAI's error shape."""

from __future__ import annotations

import re
from typing import Any

_PARAM = re.compile(r"^(sampling_params(?:\.\w+)?|[a-z_]+)\b")


class RequestError(Exception):
    """A request the server will not run: carries the HTTP status and the offending field."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers or {}
        # OpenAI's error `type` where it is not the status's usual one (model_not_found is a 404
        # of type invalid_request_error).
        self.kind = kind

    @classmethod
    def from_value_error(cls, err: ValueError) -> RequestError:
        """Validation errors of the runtime start with the field they name; reuse it as `param`."""
        text = str(err)
        m = _PARAM.match(text)
        return cls(text, param=m.group(1) if m else None)

    def body(self) -> dict[str, Any]:
        kind = self.kind or {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            413: "invalid_request_error",
            415: "invalid_request_error",
            503: "service_unavailable",
        }.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
