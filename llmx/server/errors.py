"""Every error the server answers, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

`ApiError` carries the HTTP status with it, so a handler anywhere can refuse a request in one line;
`llmx.server.app` turns it (and a `LlmxError`, a 400) into the response.
"""

from __future__ import annotations

from typing import Any

# The `type` OpenAI's API gives each status; its clients read the status, people read the type.
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    503: "server_unavailable",
    500: "server_error",
}


class ApiError(Exception):
    """A request refused with `status`; `retry_after` (seconds) goes out as the Retry-After header."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.code, self.param)

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


def error_body(message: str, status: int = 400, code: str | None = None, param: str | None = None) -> dict:
    kind = TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
