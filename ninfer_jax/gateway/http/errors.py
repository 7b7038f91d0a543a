"""Product errors of the HTTP gateway: one `ApiError` type, rendered in each API's own schema.

Owns the mapping from Engine outcomes (`RejectedError.reason`, a failed `Finished`) to HTTP
statuses, and the two error bodies: OpenAI's `{"error": {message, type, param, code}}` and
Anthropic's `{"type": "error", "error": {type, message}}`. Bad input is always a 4xx.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from starlette.responses import Response

from ninfer_jax.engine import RejectedError


class Api(enum.Enum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"


# status -> (OpenAI type, Anthropic type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    408: ("invalid_request_error", "timeout_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("service_unavailable", "overloaded_error"),
}


class ApiError(Exception):
    """An error answer: HTTP status, message, the request field at fault and a short code."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def invalid(cls, param: str, message: str, code: str = "invalid_value") -> ApiError:
        """A 400 naming `param`; the message starts with the field name."""
        return cls(400, f"{param}: {message}", param=param, code=code)

    def body(self, api: Api) -> dict[str, Any]:
        oa_type, an_type = _TYPES.get(self.status, _TYPES[500])
        if api is Api.ANTHROPIC:
            return {"type": "error", "error": {"type": an_type, "message": self.message}}
        return {"error": {"message": self.message, "type": oa_type, "param": self.param,
                          "code": self.code}}

    def response(self, api: Api) -> Response:
        headers = {"retry-after": "1"} if self.status in (429, 503) else None
        if self.status == 408:  # the server stops waiting for this client (RFC 9110 15.5.9)
            headers = {"connection": "close"}
        return Response(json.dumps(self.body(api)), status_code=self.status,
                        media_type="application/json", headers=headers)


_REJECTED_STATUS = {"overload": 429, "unavailable": 503, "invalid": 400, "too_long": 400}


def from_rejected(e: RejectedError, *, prompt_field: str, budget_field: str) -> ApiError:
    """Maps an Engine refusal at submit; `too_long` names the prompt or the budget field."""
    status = _REJECTED_STATUS.get(e.reason, 500)
    message = str(e)
    if status != 400:
        return ApiError(status, message, code=e.reason)
    if e.reason == "too_long":
        param = budget_field if message.startswith("max_new_tokens") else prompt_field
        return ApiError(400, f"{param}: {message}", param=param, code="context_length_exceeded")
    param = e.field if e.field not in (None, "prompt", "prompt_token_ids") else prompt_field
    return ApiError(400, message, param=param, code="invalid_value")


def from_failure(error: str | None, engine_available: bool) -> ApiError:
    """Maps a request the Engine ended with an error: 503 when it is (now) not available or
    the request was not admitted in time, else 500."""
    message = error or "the request ended without a result"
    if not engine_available or message.startswith("queue_timeout"):
        return ApiError(503, message, code="unavailable")
    return ApiError(500, message, code="engine_error")
