"""Wire formats: request bodies (validated strictly), response bodies, error bodies and SSE framing.

Bodies are validated in strict mode on the parsed JSON: `"16"` or `16.5` is not a token count and `1` is
not a boolean. Unknown fields are refused rather than silently ignored, so that a misspelt or unsupported
option gets an error naming it instead of a completion that ignored it. A body that breaks its schema is a
400 (as OpenAI and vLLM answer), with one clause per problem. The OpenAI bodies: `openai_request.py`.

Before the schema sees a body, `parse_json` refuses what JSON parsing alone would let through or crash on:
non-UTF-8 bytes, `NaN`/`Infinity`, integers over Python's digit limit, nesting deeper than
`MAX_JSON_DEPTH`, and strings with lone surrogates (valid JSON escapes, but not text). Each is a 400 that
says which.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from runtime.core import SamplingParams

# Above every Gemma 3 context (32k for 270M, 128k for the larger ones); the engine's context length is the
# real limit and is checked at admission with a message that names it.
MAX_NEW_TOKENS_CAP = 131072
# Request bodies are two levels deep (`{"sampling_params": {...}}`); far deeper is an attack on a parser.
MAX_JSON_DEPTH = 32
# OpenAI's limit on stop strings; the length cap bounds the text held back while a stop string may be forming.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256


class StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def _check_stop(value: str | list[str] | None) -> str | list[str] | None:
    stops = [value] if isinstance(value, str) else value or []
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings (got {len(stops)})")
    for s in stops:
        if not s:
            raise ValueError("a stop string must not be empty")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string is at most {MAX_STOP_CHARS} characters (got {len(s)})")
    return value


# OpenAI's `stop`: one string or up to four; the output ends before the first one generated.
Stop = Annotated[str | list[str] | None, AfterValidator(_check_stop)]


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


class SamplingParamsIn(StrictBody):
    max_new_tokens: int = Field(128, ge=1, le=MAX_NEW_TOKENS_CAP)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    ignore_eos: bool = False

    def to_params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, ignore_eos=self.ignore_eos)


def _exactly(expected: bool) -> AfterValidator:
    def check(value: bool) -> bool:
        if value is not expected:
            raise ValueError(f"only {json.dumps(expected)} is supported by this server")
        return value

    return AfterValidator(check)


# Fields the SGLang router adds to the bodies it forwards (runtime/server/router_compat.py), accepted only at
# the value that describes what this server does.
OnlyFalse = Annotated[bool, _exactly(False)]
OnlyTrue = Annotated[bool, _exactly(True)]
MAX_RID_CHARS = 128


class GenerateRequest(StrictBody):
    """`POST /generate`: exactly one of `text` (tokenized with BOS) or `input_ids`. `rid` names the request
    (reported as `meta.id`, taken by /abort_request)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    stream: bool = False
    rid: str | None = Field(None, min_length=1, max_length=MAX_RID_CHARS)
    model: str | None = None  # None: the served model
    # The SGLang router adds these to every body it forwards, at these defaults.
    return_text_in_logprobs: bool = False  # no logprobs are returned: inert
    log_metrics: bool = True  # requests are always counted
    no_logs: bool = False  # request contents are logged only with --log-requests
    return_hidden_states: OnlyFalse = False
    background: OnlyFalse = False
    return_bytes: OnlyFalse = False
    return_entropy: OnlyFalse = False

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        return self


class AbortRequest(StrictBody):
    """`POST /abort_request` (SGLang's): abort the live requests known by `rid` (the client's id or ours),
    or every live request."""

    rid: str | None = Field(None, min_length=1, max_length=MAX_RID_CHARS)
    abort_all: bool = False

    @model_validator(mode="after")
    def _one_target(self) -> "AbortRequest":
        if (self.rid is None) != self.abort_all:
            raise ValueError("give exactly one of `rid` or `abort_all: true`")
        return self


# ---- errors ----------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "code"}}` with this HTTP status (and headers)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type_, headers


def error_body(status: int, message: str, type_: str) -> dict:
    return {"error": {"message": message, "type": type_, "code": status}}


def failure_of(finish_reason: str | None, message: str | None) -> tuple[int, str, str] | None:
    """(status, message, type) of a request the server ended: an engine error, an operator's cancel
    (/abort_request), the request deadline, or a shutdown abort (an abort with a message; a client's own
    abort has none, and nobody is left to read it)."""
    if finish_reason == "error":
        return 500, message or "engine error", "internal_error"
    if finish_reason == "cancelled":
        return 410, "the request was cancelled by an operator (/abort_request)", "request_cancelled"
    if finish_reason == "timeout":
        return 504, message or "the request timed out", "timeout_error"
    if finish_reason == "abort" and message:
        return 503, message, "service_unavailable"
    return None


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or a 400 naming what is malformed (see the module docstring)."""
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise _malformed("not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise _malformed(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise _malformed(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # the integer digit limit, or a constant refused by _no_constant
        if "integer string conversion" in str(exc):
            raise _malformed(f"an integer has more than {sys.get_int_max_str_digits()} digits") from None
        raise _malformed(str(exc)) from None
    _check_tree(data)
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _malformed(why: str) -> APIError:
    return APIError(400, f"malformed JSON body: {why}")


def _check_tree(data: Any) -> None:
    """Depth and Unicode checks, without recursion (the tree may be as deep as the parser allowed)."""
    stack = [(data, 0, "")]
    while stack:
        node, depth, where = stack.pop()
        if isinstance(node, str):
            _check_text(node, where or "body")
            continue
        if depth >= MAX_JSON_DEPTH:
            raise _malformed(f"nested deeper than {MAX_JSON_DEPTH} levels")
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(key, str):
                _check_text(key, f"a key in {where or 'body'}")
            if isinstance(value, (str, list, dict)):
                stack.append((value, depth + 1, f"{where}.{key}" if where else str(key)))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"invalid Unicode in {where}: a lone surrogate ({ascii(text[exc.start])}) at "
                            f"character {exc.start}; strings must be valid UTF-8 text") from None


def validate(model: type[StrictBody], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise APIError(400, describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    """One clause per problem: `sampling_params.max_new_tokens: Input should be ... (got -1)`."""
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p)) or "body"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "model_type":
            msg = "expected a JSON object"
        elif err["type"] not in ("missing", "value_error") and _short_scalar(err.get("input")):
            msg += f" (got {json.dumps(err['input'])})"
        named = not err["loc"] and re.match(r"[a-z_]+: ", msg)  # a body-level check that names its field
        parts.append(msg if named else f"{where}: {msg}")
    return "; ".join(dict.fromkeys(parts))


def _short_scalar(value: Any) -> bool:
    """Worth echoing in a message: a number or a short string (never a whole list or a long text)."""
    if isinstance(value, str):
        return len(value) <= 38
    return isinstance(value, (int, float)) and len(repr(value)) <= 40


def _is_union_tag(part: Any) -> bool:
    # pydantic names the union member in the location ("prompt.str"); the field name is what users wrote
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or part.startswith("list["))


# ---- responses ---------------------------------------------------------------------------------------------


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")


def generate_body(rid: str, text: str, output_ids: list[int], prompt_tokens: int, completion_tokens: int,
                  finish_reason: str | None) -> dict:
    """Whole (or, streamed, one chunk's new) text and ids; `completion_tokens` counts all tokens so far."""
    return {"text": text, "output_ids": output_ids,
            "meta": {"id": rid, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                     "finish_reason": finish_reason}}


def completion_body(rid: str, created: int, model: str, choices: list[dict], usage: tuple[int, int] | None) -> dict:
    body = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
            "choices": choices}
    if usage is not None:
        body["usage"] = usage_body(usage)
    return body


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def usage_body(usage: tuple[int, int]) -> dict:
    """OpenAI's `usage` of (prompt tokens, completion tokens)."""
    prompt, completion = usage
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def models_body(model: str, created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "swa-runtime", "max_model_len": max_model_len}]}
