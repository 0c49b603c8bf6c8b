"""The OpenAI request fields both `/v1/completions` and `/v1/chat/completions` take, and the completions body.

What OpenAI clients send at their defaults must simply work: LangChain and LiteLLM send `presence_penalty: 0`,
`seed: null`, `logprobs: null`, `best_of: 1`, `logit_bias: {}`, `store`, `metadata` and the like on every
request. So every documented OpenAI field is accepted, `null` meaning its default; fields this server does
not act on (`user`, `store`, `metadata`, `service_tier`, ...) are accepted and ignored; fields it cannot
honour are accepted only at their neutral value (a penalty of 0, no logit bias, no tools) and refused by
name otherwise, never silently ignored. Unknown fields are still refused, so a misspelt option is named.
Both endpoints share one base class, so they accept the same shared fields. Errors are 400s (as OpenAI
and vLLM answer), raised by `protocol.validate`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, Field, field_validator, model_validator

from runtime.core import MAX_TOP_LOGPROBS, SamplingParams
from runtime.server.protocol import MAX_NEW_TOKENS_CAP, OnlyFalse, OnlyTrue, Stop, StrictBody, stop_strings

# One request fans out into (prompts x n) engine requests; bound it like a body size.
MAX_CHOICES = 64
MAX_N = 16
SEED_RANGE = (-(2**63), 2**64 - 1)


def unsupported(why: str, *neutral: Any) -> AfterValidator:
    """Refuse a field unless null or one of the `neutral` values (numbers compare by value, not type)."""

    def is_neutral(value: Any) -> bool:
        for n in neutral:
            if isinstance(n, (int, float)) and not isinstance(n, bool):
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value == n:
                    return True
            elif value == n and type(value) is type(n):
                return True
        return False

    def check(value: Any) -> Any:
        if value is None or is_neutral(value):
            return value
        shown = json.dumps(value)
        raise ValueError(why + (f" (got {shown})" if len(shown) <= 40 else ""))

    return AfterValidator(check)


NO_PENALTIES = "penalties are not supported by this server (only 0)"


class StreamOptions(StrictBody):
    include_usage: bool | None = None
    continuous_usage_stats: Annotated[Any, unsupported("usage is sent once, on the last chunk", False)] = None
    include_obfuscation: bool | None = None  # padding against side channels on OpenAI's network: inert here


class OpenAIRequest(StrictBody):
    """Fields common to both OpenAI endpoints. `top_k` (0 or -1: off) and `ignore_eos` are extensions, as in
    vLLM. `seed` gives the request a generator of its own: with sampling, the same seed and parameters give
    the same tokens whatever else the server runs (choice `i` of `n` draws from `seed + i`)."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_CAP)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: Stop = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    ignore_eos: bool | None = None
    # accepted and ignored: they describe the caller or OpenAI's storage, not the generation
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # accepted at their neutral value only
    presence_penalty: Annotated[Any, unsupported(NO_PENALTIES, 0)] = None
    frequency_penalty: Annotated[Any, unsupported(NO_PENALTIES, 0)] = None
    repetition_penalty: Annotated[Any, unsupported("penalties are not supported by this server (only 1)", 1)] = None
    logit_bias: Annotated[Any, unsupported("logit bias is not supported by this server (only {})", {})] = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @field_validator("stream_options")
    @classmethod
    def _only_streaming(cls, options: StreamOptions | None, info) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed with `stream: true`")
        return options

    @model_validator(mode="after")
    def _best_of_is_n(self) -> "OpenAIRequest":
        if self.best_of is not None and self.best_of != self.choices_per_prompt:
            raise ValueError(f"best_of: only best_of = n is supported (every sample is returned; got best_of "
                             f"{self.best_of}, n {self.choices_per_prompt})")
        return self

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    def top_logprobs_asked(self) -> int | None:
        """How many alternatives per token the caller asked for (None: no log probabilities at all)."""
        raise NotImplementedError

    def to_params(self, max_new_tokens: int, choice: int = 0) -> SamplingParams:
        seed = None if self.seed is None else (self.seed + choice) % 2**64
        return SamplingParams(max_new_tokens=max_new_tokens,
                              temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=max(0, self.top_k or 0),
                              ignore_eos=bool(self.ignore_eos), seed=seed, logprobs=self.top_logprobs_asked())

    def stop_strings(self) -> tuple[str, ...]:
        return stop_strings(self.stop)


# OpenAI's completions take one prompt or a batch: text, token ids, a list of texts, a list of id lists.
Prompt = str | list[int] | list[str] | list[list[int]]


def _is_prompt(p: Any) -> bool:
    if isinstance(p, list):
        return bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
    return isinstance(p, str)


class CompletionRequest(OpenAIRequest):
    """`POST /v1/completions`. `logprobs: k` returns the sampled token's log probability and the k most
    likely per token. Every prompt of a batch gets `n` choices, indexed prompt-major as OpenAI does."""

    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Annotated[Any, unsupported("the prompt is not echoed by this server (only false)", False)] = None
    suffix: Annotated[Any, unsupported("insertion after a suffix is not supported (only null or \"\")", "")] = None
    # The SGLang router adds these to every body it forwards, at these defaults.
    no_stop_trim: OnlyFalse = False
    skip_special_tokens: OnlyTrue = True
    return_hidden_states: OnlyFalse = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("must not be an empty list")
        if not _is_prompt(prompt) and not (isinstance(prompt, list) and all(_is_prompt(p) for p in prompt)):
            raise ValueError("must be a string, a list of token ids, or a list of either (several prompts)")
        return prompt

    @model_validator(mode="after")
    def _bounded(self) -> "CompletionRequest":
        choices = len(self.prompts()) * self.choices_per_prompt
        if choices > MAX_CHOICES:
            raise ValueError(f"prompts x n is {choices} choices; at most {MAX_CHOICES} per request")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: a text or an id list stands alone; a list of texts or of id lists is several prompts."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def max_new_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions
