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
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from runtime.core import MAX_TOP_LOGPROBS
from runtime.models.tokenizer import END_OF_TURN
from runtime.server.openai_request import OpenAIRequest, unsupported
from runtime.server.protocol import MAX_NEW_TOKENS_CAP, OnlyFalse, OnlyTrue, StrictBody, stop_strings, usage_body

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

    def joined(self) -> str:
        """The content as one string (text parts joined as written)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def text(self) -> str:
        """The content as Gemma's template writes it: each text part trimmed, the parts joined."""
        parts = [self.content] if isinstance(self.content, str) else [p.text for p in self.content]
        return "".join(p.strip() for p in parts)


_NO_TOOLS = "not supported: this server does no tool calling"


class ChatCompletionRequest(OpenAIRequest):
    """OpenAI's chat completion request (the shared fields: `openai_request.py`), as far as a text-only
    Gemma 3 server can honour it. `logprobs: true` (with `top_logprobs: k`) returns per-token log
    probabilities. Without a token limit, the answer is bounded by the server's `--max-new-tokens-default`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_CAP)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    parallel_tool_calls: bool | None = None  # no tools are called, in parallel or not: inert
    response_format: Annotated[Any, unsupported(
        'only {"type": "text"} is supported: output is not constrained to JSON', {"type": "text"})] = None
    tools: Annotated[Any, unsupported(_NO_TOOLS, [])] = None
    tool_choice: Annotated[Any, unsupported(_NO_TOOLS, "none")] = None
    functions: Annotated[Any, unsupported(_NO_TOOLS, [])] = None
    function_call: Annotated[Any, unsupported(_NO_TOOLS, "none")] = None
    modalities: Annotated[Any, unsupported('only ["text"] output is supported', ["text"])] = None
    audio: Annotated[Any, unsupported("no audio output: this model writes text")] = None
    prediction: Annotated[Any, unsupported("predicted outputs are not supported")] = None
    reasoning_effort: Annotated[Any, unsupported("this model does no separate reasoning")] = None
    web_search_options: Annotated[Any, unsupported("this server does no web search")] = None
    verbosity: Annotated[Any, unsupported("not supported: answer length follows the model and max_tokens")] = None
    # The SGLang router adds these to every chat body it forwards, at these defaults.
    continue_final_message: OnlyFalse = False
    separate_reasoning: bool = True  # no reasoning is produced to separate: inert
    stream_reasoning: bool = True  # likewise
    skip_special_tokens: OnlyTrue = True
    no_stop_trim: OnlyFalse = False
    return_hidden_states: OnlyFalse = False

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs `logprobs: true`")
        return self

    def max_new_tokens(self) -> int | None:
        """The token budget asked for; None: the server's default (bounded by what the context leaves)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def stop_strings(self) -> tuple[str, ...]:
        """The caller's stop strings, plus the end of the model's turn unless `ignore_eos`."""
        return stop_strings(self.stop) + (() if self.ignore_eos else (END_OF_TURN,))


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
        prefix = messages[0].joined() + "\n\n"
        turns = messages[1:]
    out = []
    for i, m in enumerate(turns):
        role = "model" if m.role == "assistant" else "user"
        out.append(f"{START_OF_TURN}{role}\n{prefix if i == 0 else ''}{m.text()}{END_OF_TURN}\n")
    out.append(f"{START_OF_TURN}model\n")
    return "".join(out)


# ---- responses -------------------------------------------------------------------------------------------


def chat_body(rid: str, created: int, model: str, choices: list[dict], usage: tuple[int, int]) -> dict:
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_body(usage)}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None, include_usage: bool) -> dict:
    """One `chat.completion.chunk` (with `include_usage`, `"usage": null` until the last, usage-only chunk)."""
    body = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if include_usage:
        body["usage"] = None
    return body
