"""From chat messages to the prompt text: a Jinja chat template, or Gemma 3's turn format.

Which template, first found: `--chat-template FILE`; the model's own (a GGUF file's `tokenizer.chat_template`
metadata, a Hugging Face directory's `tokenizer_config.json`); else Gemma 3's turns as `chat.render` writes
them (the default GGUF file carries no template). A Jinja template is rendered in jinja2's immutable
sandbox (it cannot reach Python objects or change its inputs) with `messages`, `add_generation_prompt=True`,
`bos_token`, `eos_token` and `raise_exception`, as Hugging Face renders it; a leading BOS text is dropped
because the tokenizer adds BOS itself.

Control tokens typed in a message are refused (400, naming the token and the message): a user who writes
`<end_of_turn>` in their text would otherwise end their own turn and write the model's, since the
tokenizer turns that text into the control token itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from runtime.models.tokenizer import END_OF_TURN
from runtime.server.chat import START_OF_TURN, ChatMessage, check_turns, render
from runtime.server.protocol import APIError

# What a control token's text looks like (Gemma's: <start_of_turn>, <bos>, <unused12>, [@BOS@]).
_CANDIDATE = re.compile(r"<[^<>\s]{1,64}>|\[[^\[\]\s]{1,64}\]")
MAX_TEMPLATE_BYTES = 1 << 20


class ChatTemplateError(ValueError):
    """A chat template that cannot be read or compiled (start-up refuses it, with the file named)."""


class ChatPrompt:
    """Renders a conversation into prompt text for one model's tokenizer."""

    def __init__(self, template: str | None, origin: str, control_tokens: frozenset[str],
                 bos_token: str = "<bos>", eos_token: str = "<eos>"):
        self.origin = origin  # "--chat-template FILE", "the model's", or Gemma's turns
        self._control = control_tokens | {START_OF_TURN, END_OF_TURN}
        self._bos, self._eos = bos_token, eos_token
        self._template = _compile(template, origin) if template is not None else None

    @classmethod
    def load(cls, path: str | None, model, tokenizer) -> "ChatPrompt":
        """The template of `--chat-template` (`path`), else the model's own, else Gemma's turns."""
        control = tokenizer.control_tokens()
        if path is not None:
            return cls(_read_template_file(Path(path)), f"--chat-template {path}", control)
        template = model_chat_template(model)
        if template is not None:
            return cls(template, "the model's own chat template", control)
        return cls.gemma(tokenizer)

    @classmethod
    def gemma(cls, tokenizer) -> "ChatPrompt":
        """Gemma 3's turn format, built in (`chat.render`)."""
        return cls(None, "Gemma 3's turn format (built in)", tokenizer.control_tokens())

    def render(self, messages: list[ChatMessage]) -> str:
        """The prompt, or a 400 naming the control token typed in a message or what the template refused."""
        for i, m in enumerate(messages):
            typed = self._typed_control_token(m.joined())
            if typed is not None:
                raise APIError(400, f"messages.{i}.content: contains {typed!r}, a control token of this model: "
                                    "refused, since the tokenizer would read it as that token (it would end or "
                                    "start a turn); write it differently (e.g. with a space after '<')")
        if self._template is None:
            try:
                check_turns(messages)
            except ValueError as exc:
                raise APIError(400, f"messages: {exc}") from None
            return render(messages)
        return self._render_template(messages)

    def _typed_control_token(self, text: str) -> str | None:
        for match in _CANDIDATE.finditer(text):
            if match.group() in self._control:
                return match.group()
        return None

    def _render_template(self, messages: list[ChatMessage]) -> str:
        from jinja2 import TemplateError

        data = [{"role": m.role, "content": m.joined()} for m in messages]
        try:
            text = self._template.render(messages=data, add_generation_prompt=True, bos_token=self._bos,
                                         eos_token=self._eos)
        except TemplateError as exc:
            raise APIError(400, f"messages: the chat template refused them: {str(exc)[:200]}") from None
        return text.removeprefix(self._bos)


def _compile(template: str, origin: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise ChatTemplateError(f"{origin}: not a valid Jinja template: {exc}") from None


def _read_template_file(path: Path) -> str:
    try:
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise ChatTemplateError(f"--chat-template {path}: larger than {MAX_TEMPLATE_BYTES} bytes")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"--chat-template {path}: cannot read it ({exc.__class__.__name__}: {exc})") from None


def model_chat_template(model) -> str | None:
    """The chat template a model file carries: GGUF metadata `tokenizer.chat_template`, or a Hugging Face
    directory's tokenizer_config.json `chat_template`; None for the tiny model or a file without one."""
    from runtime.models.registry import resolve_model

    source = resolve_model(model)
    if source.kind == "gguf":
        from runtime.models.gguf_file import GGUFFile

        template = GGUFFile(source.path).field("tokenizer.chat_template")
        return template if isinstance(template, str) else None
    if source.kind == "hf":
        config = source.path / "tokenizer_config.json"
        template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
        return template if isinstance(template, str) else None
    return None
