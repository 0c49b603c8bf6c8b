"""Wire formats: request bodies (validated strictly), response bodies, error bodies and SSE framing.

Bodies are validated in strict mode on the parsed JSON: `"16"` or `16.5` is not a token count and `1` is
not a boolean. Unknown fields are refused rather than silently ignored, so that a misspelt or unsupported
option (`stop`, `logprobs`, ...) gets an error naming it instead of a completion that ignored it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from runtime.layers.sampler import SamplingParams

# Above every Gemma 3 context (32k for 270M, 128k for the larger ones); the engine's context length is the
# real limit and is checked at admission with a message that names it.
MAX_NEW_TOKENS_CAP = 131072


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class SamplingParamsIn(_Strict):
    max_new_tokens: int = Field(128, ge=1, le=MAX_NEW_TOKENS_CAP)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    ignore_eos: bool = False

    def to_params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, ignore_eos=self.ignore_eos)


class GenerateRequest(_Strict):
    """`POST /generate`: exactly one of `text` (tokenized with BOS) or `input_ids`."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    stream: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        return self


class CompletionRequest(_Strict):
    """`POST /v1/completions` (OpenAI-compatible subset; `top_k` and `ignore_eos` are extensions)."""

    model: str | None = None  # None: the served model
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1, le=MAX_NEW_TOKENS_CAP)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    ignore_eos: bool = False
    user: str | None = None  # accepted for compatibility, unused

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            raise ValueError("must be a string or a list of token ids (batched prompts are not supported)")
        if not isinstance(v, (str, list)):
            raise ValueError(f"must be a string or a list of token ids, got {type(v).__name__}")
        return v

    def to_params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, ignore_eos=self.ignore_eos)


# ---- errors ----------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "code"}}` with this HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_


def error_body(status: int, message: str, type_: str) -> dict:
    return {"error": {"message": message, "type": type_, "code": status}}


def parse_json(raw: bytes) -> Any:
    """The body as JSON whatever its content type (`curl -d` sends form-encoded headers)."""
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise APIError(400, "malformed JSON body: not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON body: {exc.msg} at line {exc.lineno} column {exc.colno}") from None


def validate(model: type[_Strict], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise APIError(422, describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    """One clause per problem: `sampling_params.max_new_tokens: Input should be ... (got -1)`."""
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p)) or "body"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "model_type":
            msg = "expected a JSON object"
        elif err["type"] not in ("missing", "value_error") and "input" in err:
            shown = json.dumps(err["input"], default=str)
            if len(shown) <= 40:
                msg += f" (got {shown})"
        parts.append(f"{where}: {msg}")
    return "; ".join(dict.fromkeys(parts))


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


def completion_body(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                    usage: tuple[int, int] | None) -> dict:
    body = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if usage is not None:
        prompt, completion = usage
        body["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                         "total_tokens": prompt + completion}
    return body


def models_body(model: str, created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "swa-runtime", "max_model_len": max_model_len}]}
