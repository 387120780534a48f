"""Errors as the OpenAI API returns them: {"error": {"message", "type", "param", "code"}}.

What fails inside the server or the engine reaches a client as one short line and a request id;
the whole story (a rank's traceback, internal paths) goes to the server log under that id.
"""

from __future__ import annotations

import logging
import re
import traceback
import uuid
from typing import Any, Optional, Sequence

from pydantic import ValidationError
from starlette.responses import JSONResponse

TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
         404: "invalid_request_error", 405: "invalid_request_error",
         408: "invalid_request_error", 413: "invalid_request_error",
         415: "invalid_request_error", 500: "server_error", 503: "service_unavailable_error"}
PUBLIC_LINE_CHARS = 200
# absolute paths (two or more parts) inside an exception's message: a client does not see them
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.\-~+@]+){2,}[\\/]?")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: Optional[str] = None,
                code: Optional[str] = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def traceback_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def unknown_model(name: str, served: Sequence[str]) -> APIError:
    return APIError(404, f"the model '{name}' does not exist; this server serves "
                    f"{served[0]!r} (GET /v1/models)", "model", "model_not_found")


def parse_body(cls: Any, body: bytes, served: Sequence[str]) -> Any:
    """`body` as the strict pydantic model `cls` (a 400 naming the field), whose `model`, when
    given, is one of the `served` names (else a 404)."""
    try:
        req = cls.model_validate_json(body, strict=True)
    except ValidationError as exc:
        raise from_validation(exc) from None
    if req.model is not None and req.model not in served:
        raise unknown_model(req.model, served)
    return req


def from_validation(exc: ValidationError) -> APIError:
    """The first problem pydantic found, with the field path as OpenAI's `param`."""
    err = exc.errors()[0]
    loc = [str(x) for x in err["loc"]]
    if err["type"] == "json_invalid":
        return bad_request(f"the body is not valid JSON: {err['msg']}", None, "invalid_json")
    if not loc:
        return bad_request(f"the body must be a JSON object: {err['msg']}", None, "invalid_type")
    # a union's alternatives add their type names to the path: keep the field's path only
    path = [x for x in loc if not (x.startswith(("list[", "str", "int", "dict[", "float"))
                                   or x in ("TextPart", "ChatMessage"))]
    param = ".".join(path) or loc[0]
    if err["type"] == "extra_forbidden":
        return bad_request(f"unknown field '{param}': moeserve does not support it; remove it",
                           param, "unsupported_parameter")
    if err["type"] == "missing":
        return bad_request(f"'{param}' is required", param, "missing_required_parameter")
    got = err.get("input")
    got_text = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
    code = "invalid_type" if err["type"].endswith("_type") else "invalid_value"
    return bad_request(f"'{param}': {err['msg']}{got_text}", param, code)


def unsupported(field: str) -> APIError:
    return bad_request(f"'{field}' is not supported by moeserve; remove it or leave it unset",
                       field, "unsupported_parameter")


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


def public_line(detail: str) -> str:
    """The first line of `detail` with paths taken out, short enough for a client."""
    line = detail.strip().split("\n", 1)[0].strip()
    line = _PATH.sub("<path>", line)
    if len(line) > PUBLIC_LINE_CHARS:
        line = line[:PUBLIC_LINE_CHARS - 3] + "..."
    return line or "internal error"


def internal_error(log: logging.Logger, request_id: str, what: str, detail: str,
                   status: int = 500, code: str = "internal_error",
                   headers: Optional[dict[str, str]] = None) -> APIError:
    """An error for the client (`what`: the first line of `detail`, and the request id);
    `detail` in full goes to `log` under the same id."""
    log.error("request %s: %s\n%s", request_id, what, detail.rstrip())
    return APIError(status, f"{what}: {public_message(detail, request_id)}", None, code, headers)


def public_message(detail: str, request_id: str) -> str:
    return f"{public_line(detail)} (request id {request_id}; the server log has the details)"
