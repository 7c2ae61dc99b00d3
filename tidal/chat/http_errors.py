"""Errors as HTTP responses, in the shape the route's clients read (FastAPI: the one module of
`tidal.chat` that needs it). Every error is

    {"error": {"message": "<field>: <what is wrong>", "type": "...", "param": "<field>" | null, "code": <status>}}

(OpenAI's shape, which OpenAI clients turn into exceptions carrying the message), but Anthropic's
`{"type": "error", "error": {"type", "message"}}` on its route, `/v1/messages`. `add_error_handlers`
answers every error of an app so (`tidal serve`'s and the agent door's).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidal.chat.anthropic import speaks_anthropic
from tidal.chat.errors import RETRY_AFTER_S, ApiError, Busy

_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "function-after", "function-plain"}

# Anthropic's error type for each HTTP status (its clients pick the exception by status; the type
# is what a user reads)
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_response(
    status: int, message: str, kind: str | None = None, param: str | None = None, extra: dict | None = None
) -> JSONResponse:
    """The one error shape; `extra` adds top-level fields a route family's clients read (SGLang's
    weight routes: `success`, `message`)."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}, **(extra or {})}
    return JSONResponse(body, status_code=status)


def anthropic_error_response(status: int, message: str) -> JSONResponse:
    """An error in Anthropic's shape."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)


def error_for(path: str, status: int, message: str, kind: str | None = None, param: str | None = None) -> JSONResponse:
    """An error in the shape the route's clients read: Anthropic's on `/v1/messages`, else the one
    shape."""
    if speaks_anthropic(path):
        return anthropic_error_response(status, message)
    return error_response(status, message, kind, param)


def _format_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """(one "field.path: message" per bad field, without pydantic's union-branch tags; the first field)."""
    errors: list[tuple[tuple[str, ...], str]] = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"body: invalid JSON ({err.get('ctx', {}).get('error', err.get('msg'))})", "body"
        loc = tuple(
            str(x)
            for x in err.get("loc", ())
            if x != "body" and not (isinstance(x, str) and (x[:1].isupper() or "[" in x or x in _TYPE_TAGS))
        )
        errors.append((loc, err.get("msg", "invalid")))
    # A union reports one error per branch: keep the most specific one(s) for each field.
    kept: dict[tuple[str, ...], str] = {}
    for loc, msg in errors:
        if not any(len(o) > len(loc) and o[: len(loc)] == loc for o, _ in errors):
            kept.setdefault(loc, msg)
    first = ".".join(next(iter(kept), ())) or "body"
    return "; ".join(f"{'.'.join(loc) or 'body'}: {msg}" for loc, msg in kept.items()), first


async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, field = _format_validation_error(exc)
    return error_for(request.url.path, 400, message, param=field)


async def _on_api_error(request: Request, exc: ApiError) -> JSONResponse:
    response = error_for(request.url.path, exc.status, str(exc), exc.kind, exc.param)
    if isinstance(exc, Busy):
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    what = "no such route" if exc.status_code == 404 else str(exc.detail)
    return error_for(request.url.path, exc.status_code, f"{request.method} {request.url.path}: {what}")


async def _on_error(request: Request, exc: Exception) -> JSONResponse:
    return error_for(request.url.path, 500, f"{type(exc).__name__}: {exc}", "server_error")


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error of `app` in its route's shape (`error_for`)."""
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(Exception, _on_error)
