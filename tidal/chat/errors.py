"""The errors a request is refused with, whichever API it came through: each carries its HTTP
status, its type and the field at fault (`tidal.chat.http_errors` answers them in the shape the
route's clients read)."""

from __future__ import annotations

RETRY_AFTER_S = 1  # what a Busy answer's Retry-After header says


class ApiError(Exception):
    """An error answered as `{"error": {...}}` with HTTP `status`."""

    def __init__(
        self, message: str, status: int = 400, kind: str = "invalid_request_error", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind
        self.param = param if param is not None else (message.split(":", 1)[0] if ":" in message else None)


class BadRequest(ApiError):
    """400: the request is malformed or asks for what this server cannot do."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, 400, "invalid_request_error", param)


class Busy(ApiError):
    """503: the server cannot take this request now; the client may retry after `RETRY_AFTER_S`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, 503, "server_busy", param)


class Unavailable(ApiError):
    """503: the engine cannot serve in its present state (asleep, holding no weights, closed);
    no field of the request is at fault, and the message says what brings the engine back."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 503, "engine_unavailable")
        self.param = None  # the message does not start with a field
