"""`POST /v1/chat/completions`: the request schema, Gemma 3's turn format and the response bodies.

Gemma 3 converses in turns, `<start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n...`. A GGUF file
carries no chat template, so the runtime owns it: `render()` writes what Gemma 3's own template (the
`chat_template` of its tokenizer_config.json) writes, and the answer ends at `<end_of_turn>`. With Gemma's
tokenizer that is one special token the engine stops on; with a tokenizer that has no such token (the byte
tokenizer of the tiny test model) the text `<end_of_turn>` is matched as a stop string instead, so the turn
ends the same way whichever tokenizer serves.

Gemma 3 has no system role: like its template, `render()` folds a system message (or OpenAI's newer
`developer` message) into the first user turn. Roles then alternate user/assistant, starting and ending with
a user turn; anything else is refused with a message that says so, as Gemma's template refuses it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, field_validator

from runtime.core import SamplingParams
from runtime.models.tokenizer import END_OF_TURN
from runtime.server.protocol import (MAX_NEW_TOKENS_CAP, SSE_DONE, OnlyFalse, OnlyTrue, Stop, StrictBody, error_body,
                                     sse, stop_strings, usage_body)
from runtime.server.stops import text_pieces

START_OF_TURN = "<start_of_turn>"
SYSTEM_ROLES = ("system", "developer")
ROLES = (*SYSTEM_ROLES, "user", "assistant")


# ---- request ---------------------------------------------------------------------------------------------


def _only_text_parts(content: Any) -> Any:
    if isinstance(content, list):
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"part {i} is of type {kind!r}: only text parts are supported (this model reads "
                                 "no images, audio or files)")
    return content


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class ChatMessage(StrictBody):
    role: str
    content: Annotated[str | list[TextPart], BeforeValidator(_only_text_parts)]
    name: str | None = None  # accepted, unused: Gemma's turns carry no names

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role in ("tool", "function"):
            raise ValueError(f"{role!r} messages are not supported: this server does no tool calling")
        if role not in ROLES:
            raise ValueError(f"must be one of {', '.join(ROLES)} (got {json.dumps(role[:40])})")
        return role

    def text(self) -> str:
        """The content as Gemma's template writes it: each text part trimmed, the parts joined."""
        parts = [self.content] if isinstance(self.content, str) else [p.text for p in self.content]
        return "".join(p.strip() for p in parts)


def _unsupported(why: str, *neutral: Any) -> AfterValidator:
    """Refuse a field unless absent, null or one of the `neutral` values (of the same JSON type)."""

    def check(value: Any) -> Any:
        if value is None or any(value == n and type(value) is type(n) for n in neutral):
            return value
        shown = json.dumps(value)
        raise ValueError(why + (f" (got {shown})" if len(shown) <= 40 else ""))

    return AfterValidator(check)


_NO_TOOLS = "not supported: this server does no tool calling"


class StreamOptions(StrictBody):
    include_usage: bool = False


class ChatCompletionRequest(StrictBody):
    """OpenAI's chat completion request, as far as a text-only Gemma 3 server can honour it; `top_k` and
    `ignore_eos` are extensions. Options it cannot honour are refused by name, never ignored."""

    model: str | None = None  # None: the served model
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_CAP)
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_CAP)  # OpenAI's older name
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    ignore_eos: bool = False
    user: str | None = None  # accepted for compatibility, unused
    n: Annotated[Any, _unsupported("only one choice per request is supported (n = 1)", 1)] = None
    logprobs: Annotated[Any, _unsupported("log probabilities are not returned by this server", False)] = None
    top_logprobs: Annotated[Any, _unsupported("log probabilities are not returned by this server", 0)] = None
    presence_penalty: Annotated[Any, _unsupported("penalties are not supported (only 0)", 0, 0.0)] = None
    frequency_penalty: Annotated[Any, _unsupported("penalties are not supported (only 0)", 0, 0.0)] = None
    logit_bias: Annotated[Any, _unsupported("not supported (only {})", {})] = None
    response_format: Annotated[Any, _unsupported(
        'only {"type": "text"} is supported: output is not constrained to JSON', {"type": "text"})] = None
    tools: Annotated[Any, _unsupported(_NO_TOOLS, [])] = None
    tool_choice: Annotated[Any, _unsupported(_NO_TOOLS, "none")] = None
    functions: Annotated[Any, _unsupported(_NO_TOOLS, [])] = None
    function_call: Annotated[Any, _unsupported(_NO_TOOLS, "none")] = None
    # The SGLang router adds these to every chat body it forwards, at these defaults.
    continue_final_message: OnlyFalse = False
    separate_reasoning: bool = True  # no reasoning is produced to separate: inert
    stream_reasoning: bool = True  # likewise
    skip_special_tokens: OnlyTrue = True
    no_stop_trim: OnlyFalse = False
    return_hidden_states: OnlyFalse = False

    @field_validator("messages")
    @classmethod
    def _gemma_turns(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        check_turns(messages)
        return messages

    @field_validator("stream_options")
    @classmethod
    def _only_streaming(cls, options: StreamOptions | None, info) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed with `stream: true`")
        return options

    @field_validator("seed")
    @classmethod
    def _greedy_seed(cls, seed: int | None, info) -> int | None:
        if seed is not None and info.data.get("temperature", 1.0) != 0:
            raise ValueError("per-request seeds are not supported (one random generator serves every request); "
                             "greedy decoding (temperature 0) needs none")
        return seed

    def max_new_tokens(self) -> int | None:
        """The token budget asked for; None: whatever the context leaves after the prompt."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_params(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, ignore_eos=self.ignore_eos)

    def stop_strings(self) -> tuple[str, ...]:
        """The caller's stop strings, plus the end of the model's turn unless `ignore_eos`."""
        return stop_strings(self.stop) + (() if self.ignore_eos else (END_OF_TURN,))

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# ---- Gemma 3's turns -------------------------------------------------------------------------------------


def check_turns(messages: list[ChatMessage]) -> None:
    """Raise ValueError unless the conversation fits Gemma 3's template (see the module docstring)."""
    start = 1 if messages[0].role in SYSTEM_ROLES else 0
    for i, m in enumerate(messages[start:], start=start):
        if m.role in SYSTEM_ROLES:
            raise ValueError(f"message {i} is a {m.role} message: only the first message may be one (Gemma 3 has "
                             "no system role; the runtime folds that message into the first user turn)")
        expected = "user" if (i - start) % 2 == 0 else "assistant"
        if m.role != expected:
            raise ValueError(f"message {i} is from the {m.role}, expected the {expected}: Gemma 3's turns alternate "
                             "user/assistant, starting with the user")
    if len(messages) == start or messages[-1].role != "user":
        raise ValueError("the last message must be from the user: the model answers it")


def render(messages: list[ChatMessage]) -> str:
    """The prompt Gemma 3's chat template writes with `add_generation_prompt=True`, without the leading
    `<bos>` (the tokenizer adds it). Assumes `check_turns` passed."""
    prefix, turns = "", messages
    if messages[0].role in SYSTEM_ROLES:
        first = messages[0].content
        prefix = (first if isinstance(first, str) else "".join(p.text for p in first)) + "\n\n"
        turns = messages[1:]
    out = []
    for i, m in enumerate(turns):
        role = "model" if m.role == "assistant" else "user"
        out.append(f"{START_OF_TURN}{role}\n{prefix if i == 0 else ''}{m.text()}{END_OF_TURN}\n")
    out.append(f"{START_OF_TURN}model\n")
    return "".join(out)


# ---- responses -------------------------------------------------------------------------------------------


def chat_body(rid: str, created: int, model: str, text: str, finish_reason: str | None,
              usage: tuple[int, int]) -> dict:
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage_body(usage)}


async def chat_events(stream, tokenizer, model: str, created: int, stops: Iterable[str],
                      include_usage: bool) -> AsyncIterator[bytes]:
    """`chat.completion.chunk` events: the role first, then the content as it arrives, the finish reason on
    the last chunk, with `include_usage` a last chunk of usage and no choices (every chunk before it has
    `"usage": null`), then `[DONE]`. A request the server ended gets an error event instead."""

    def chunk(delta: dict, finish_reason: str | None = None) -> bytes:
        body = {"id": f"chatcmpl-{stream.rid}", "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                             "finish_reason": finish_reason}]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    yield chunk({"role": "assistant", "content": ""})
    finished = False
    async with stream:
        async for piece in text_pieces(stream, tokenizer, stops):
            if piece.failure is not None:
                if piece.text:
                    yield chunk({"content": piece.text})
                yield sse(error_body(*piece.failure))
                break
            if piece.text or piece.finish_reason is not None:
                yield chunk({"content": piece.text} if piece.text else {}, piece.finish_reason)
            finished = piece.finish_reason is not None
    if include_usage and finished:
        yield sse({"id": f"chatcmpl-{stream.rid}", "object": "chat.completion.chunk", "created": created,
                   "model": model, "choices": [],
                   "usage": usage_body((stream.prompt_tokens, len(stream.output_ids)))})
    yield SSE_DONE
