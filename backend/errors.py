"""The API's errors in one place: the domain exceptions services raise, and how each is answered.

Every error answer is JSON `{"detail": "<what was wrong and how to fix it>", ...}`: 4xx for a request the client
can correct, 503 when a service the API depends on (the database, the job queue) is down.
"""
from __future__ import annotations

import functools
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("plab.api")


class InvalidInput(ValueError):
    """Input that passed the schema but not the domain rules (answered with 422)."""


class NotFound(LookupError):
    """A referenced object that does not exist (answered with 404)."""


class Forbidden(PermissionError):
    """A request for something the API never hands out, whoever asks (answered with 403)."""


class Conflict(RuntimeError):
    """A request that contradicts the stored state (answered with 409)."""


class QueueUnavailable(RuntimeError):
    """A job was stored but the job queue refused it (answered with 503); `stored` names what was stored."""

    def __init__(self, message: str, *, stored: dict):
        super().__init__(message)
        self.stored = stored


def _wrong_type(error: dict) -> bool:
    return str(error.get("type", "")).endswith("_type")


# How pydantic names a union's member in an error's location: a type ("str", "dict[str,any]",
# "function-after[known_recipe_and_options(), RecipeRequest]") or a model class; field names are snake_case.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|bytes|none|[a-z][a-z-]*\[.*\]|[A-Z][A-Za-z0-9_]*)$")


def _member_index(loc: tuple) -> int | None:
    return next((i for i, part in enumerate(loc) if isinstance(part, str) and _UNION_MEMBER.match(part)), None)


def _union_branches(errors: list[dict]) -> list[tuple[str, dict]]:
    """Each error with the union member it came from taken out of its location. pydantic tries every member of a
    union (`str | RecipeRequest`) and reports each one that failed, under a location naming the member
    (`recipes.1.str`, `recipes.1.function-after[...]`). A value of one member's type that broke that member's rules
    was not meant as another member: that member's "Input should be a valid string" is dropped. Where every member
    failed on the type alone, one line lists what the value may be."""
    located = []
    for e in errors:
        loc = tuple(e.get("loc", ()))
        i = _member_index(loc)
        located.append((loc, e, None if i is None else loc[:i]))
    members: dict[tuple, set] = {}
    for loc, _e, prefix in located:
        if prefix is not None:
            members.setdefault(prefix, set()).add(loc[len(prefix)])
    out: list[tuple[str, dict]] = []
    type_only: dict[tuple, list[str]] = {}
    for loc, e, prefix in located:
        if prefix is None or len(members[prefix]) < 2:
            out.append((_where(loc), e))
            continue
        if len(loc) == len(prefix) + 1 and _wrong_type(e):
            siblings = [(l2, e2) for l2, e2, p2 in located if p2 == prefix and l2[len(prefix)] != loc[len(prefix)]]
            if any(len(l2) > len(prefix) + 1 or not _wrong_type(e2) for l2, e2 in siblings):
                continue  # the value was of another member's type
            if prefix not in type_only:
                type_only[prefix] = []
                out.append((_where(prefix), {"msg": type_only[prefix]}))  # joined below, in its place
            type_only[prefix].append(str(e.get("msg", "invalid")))
            continue
        out.append((_where(loc[:len(prefix)] + loc[len(prefix) + 1:]), e))
    return [(where, {"msg": " | ".join(dict.fromkeys(e["msg"]))} if isinstance(e.get("msg"), list) else e)
            for where, e in out]


def _where(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if p not in ("body", "query", "path"))


def _body_message(e: dict) -> str | None:
    """What a request whose body is not a JSON object was told, in words: where the JSON broke, or what to send."""
    loc = tuple(e.get("loc", ()))
    if e.get("type") == "json_invalid" and loc[:1] == ("body",):
        at = loc[1] if len(loc) > 1 else None
        why = (e.get("ctx") or {}).get("error")
        return (f"the body is not valid JSON{f' ({why})' if why else ''}"
                f"{f' at character {at}' if isinstance(at, int) else ''}: send one JSON object, UTF-8 encoded, "
                f"with Content-Type: application/json")
    if loc == ("body",) and e.get("type") in ("model_attributes_type", "dict_type", "missing"):
        return ("the body must be a JSON object ({...}) sent with Content-Type: application/json"
                if e.get("type") != "missing" else
                "the request has no body: send a JSON object with Content-Type: application/json")
    return None


@functools.cache
def _pattern_words() -> dict[str, str]:
    """The rule behind each pattern a field of the API checks, in words (pydantic's message only repeats the
    regular expression)."""
    from backend import schemas

    tag = schemas.Tag.__metadata__[0].metadata
    tag_pattern = next(m.pattern for m in tag if hasattr(m, "pattern"))
    return {schemas.METRIC_KEY_PATTERN: "a metric key holds letters, digits and _ . / : - [ ] only, e.g. train/loss",
            tag_pattern: "a tag is one line of free text up to 64 characters: no comma, no control character, not "
                         "starting with a blank",
            schemas.ONE_LINE: "one line of text, not blank, without control characters"}


def _describe(errors: list[dict]) -> str:
    parts = [m for m in (_body_message(e) for e in errors) if m]
    if parts:
        return "; ".join(dict.fromkeys(parts))
    for loc, e in _union_branches(errors):
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if e.get("type") == "string_pattern_mismatch":
            msg = _pattern_words().get((e.get("ctx") or {}).get("pattern"), msg)
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(dict.fromkeys(parts)) or "invalid request"


def _error(status: int, message: str, **extra) -> JSONResponse:
    return JSONResponse(status_code=status, content={"detail": message, **extra})


def _validation_error(exc: RequestValidationError | ValidationError) -> JSONResponse:
    raw = exc.errors()
    errors = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in raw]
    for e, r in zip(errors, raw):  # for the message only (not echoed: the decoder's reason may hold input)
        if e.get("type") == "json_invalid" and isinstance(r.get("ctx"), dict):
            e["ctx"] = {"error": str(r["ctx"].get("error", ""))[:200]}
        elif e.get("type") == "string_pattern_mismatch" and isinstance(r.get("ctx"), dict):
            e["ctx"] = {"pattern": r["ctx"].get("pattern")}
    return _error(422, _describe(errors), errors=[{k: v for k, v in e.items() if k != "ctx"} for e in errors])


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _request_invalid(_req: Request, exc: RequestValidationError):
        return _validation_error(exc)

    @app.exception_handler(ValidationError)
    async def _invalid(_req: Request, exc: ValidationError):
        return _validation_error(exc)

    @app.exception_handler(InvalidInput)
    async def _domain_invalid(_req: Request, exc: InvalidInput):
        return _error(422, str(exc))

    @app.exception_handler(NotFound)
    async def _not_found(_req: Request, exc: NotFound):
        return _error(404, str(exc))

    @app.exception_handler(Forbidden)
    async def _forbidden(_req: Request, exc: Forbidden):
        return _error(403, str(exc))

    @app.exception_handler(Conflict)
    async def _conflict(_req: Request, exc: Conflict):
        return _error(409, str(exc))

    @app.exception_handler(QueueUnavailable)
    async def _queue_down(_req: Request, exc: QueueUnavailable):
        log.error("job queue unavailable: %s", exc)
        return _error(503, str(exc), stored=exc.stored)

    @app.exception_handler(IntegrityError)
    async def _integrity(_req: Request, exc: IntegrityError):
        log.warning("integrity error: %s", exc)
        return _error(409, "the request conflicts with stored data (a referenced object is missing or a unique "
                           "key is taken)")

    @app.exception_handler(OperationalError)
    async def _db_down(_req: Request, exc: OperationalError):
        log.error("database error: %s", exc)
        return _error(503, "the database is unavailable; try again shortly")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == "There was an error parsing the body":  # e.g. bytes not UTF-8
            detail = ("the body could not be parsed: send one JSON object, UTF-8 encoded, with Content-Type: "
                      "application/json")
        return _error(exc.status_code, detail)

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, exc: Exception):
        # Served by Starlette's outermost middleware, which logs the traceback after sending this: the client gets
        # JSON like every other error, without the traceback.
        return _error(500, f"internal error ({type(exc).__name__}); it is logged on the server - please report it "
                           f"with the request that caused it")
