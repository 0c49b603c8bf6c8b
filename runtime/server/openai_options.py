"""What `serve` takes to look like an OpenAI server to its clients (vLLM's option names where they exist).

- `--served-model-name NAME [NAME ...]`: the model ids clients may send; the first is reported.
- `--api-key KEY` (or `$SWA_RUNTIME_API_KEY`): `Authorization: Bearer KEY` required on the inference routes
  (/v1/* and /generate) as vLLM requires it on /v1/*; /health and /metrics stay open for probes and
  Prometheus. Answered 401 otherwise.
- `--chat-template FILE`: a Jinja chat template instead of the model's own (see `chat_template.py`).
- `--max-new-tokens-default N`: a chat request without `max_tokens`/`max_completion_tokens` may generate at
  most N tokens (and never more than the context leaves), so a greedy loop cannot run until the client
  gives up.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

API_KEY_ENV = "SWA_RUNTIME_API_KEY"
MAX_NEW_TOKENS_DEFAULT = 2048


@dataclass(frozen=True)
class OpenAIOptions:
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    chat_template: str | None = None  # a file
    max_new_tokens_default: int = MAX_NEW_TOKENS_DEFAULT

    def __post_init__(self) -> None:
        if self.max_new_tokens_default < 1:
            raise ValueError(f"--max-new-tokens-default must be >= 1, got {self.max_new_tokens_default}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "OpenAIOptions":
        return cls(served_model_names=tuple(args.served_model_name or ()),
                   api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None,
                   chat_template=args.chat_template, max_new_tokens_default=args.max_new_tokens_default)


def add_openai_args(p: argparse.ArgumentParser) -> None:
    d = OpenAIOptions()
    g = p.add_argument_group("OpenAI API")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model id(s) clients send in `model`; the first is reported (default: the model's name)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require `Authorization: Bearer KEY` on /v1/* and /generate (default: ${API_KEY_ENV}; "
                        "none: open); /health and /metrics stay open")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template for /v1/chat/completions (default: the model file's own, else "
                        "Gemma 3's turn format)")
    g.add_argument("--max-new-tokens-default", type=int, default=d.max_new_tokens_default, metavar="N",
                   help="token limit of a chat request that sets none (default %(default)s; never more than "
                        "the context leaves)")
