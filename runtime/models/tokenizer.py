"""Tokenizers for every model source, behind one small interface.

A GGUF file embeds its vocabulary but no `tokenizer.json`. Turning one into the other needs transformers and
takes seconds, so it is done once per file and the result is cached as a `tokenizer.json` (plus the special
token ids) under `<cache_dir>/tokenizers/`, keyed by the file's sha256 and size; later loads use only the
`tokenizers` library. Hugging Face directories ship their `tokenizer.json`. The tiny test model uses bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Protocol, Sequence

END_OF_TURN = "<end_of_turn>"  # Gemma's chat turns end here; generation should stop on it as on <eos>


class Tokenizer(Protocol):
    bos_token_id: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, starting with BOS (as Gemma expects)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def control_tokens(self) -> frozenset[str]:
        """Texts that `encode` turns into a control token (not into the characters written)."""


class ByteTokenizer:
    """ids 0..3 are <pad>, <eos>, <bos>, <unk>; byte b is id b + 4. Fits `Gemma3Config.tiny()`."""

    OFFSET = 4
    CONTROL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")

    def __init__(self) -> None:
        self.pad_token_id, self.bos_token_id = 0, 2
        self.eos_token_ids = (1,)
        self.vocab_size = self.OFFSET + 256

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id] + [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if i >= self.OFFSET:
                pending.append(i - self.OFFSET)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if not skip_special_tokens:
                out.append(self.CONTROL_TOKENS[i])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def control_tokens(self) -> frozenset[str]:
        return frozenset()  # every text is encoded byte by byte


class HFTokenizer:
    """A `tokenizers.Tokenizer` with Gemma's BOS convention and the ids that end generation."""

    def __init__(self, tokenizer, bos_token_id: int, eos_token_ids: Sequence[int]) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        stop = list(eos_token_ids)
        end_of_turn = tokenizer.token_to_id(END_OF_TURN)
        if end_of_turn is not None and end_of_turn not in stop:
            stop.append(end_of_turn)
        self.eos_token_ids = tuple(stop)
        self.vocab_size = tokenizer.get_vocab_size()
        # Gemma's tokenizer.json adds BOS in its post-processor; add it ourselves if this one does not.
        self._prepend_bos = tokenizer.encode("").ids[:1] != [bos_token_id]

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text).ids
        return [self.bos_token_id, *ids] if self._prepend_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def control_tokens(self) -> frozenset[str]:
        # the tokenizer splits every added token out of the text (Gemma's: <bos>, <start_of_turn>, <unused0>, ...)
        return frozenset(t.content for t in self._tok.get_added_tokens_decoder().values() if t.content.strip())


def load_tokenizer(model: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a model name or path (anything `registry.resolve_model` accepts)."""
    from runtime.models.registry import resolve_model

    source = resolve_model(model)
    if source.kind == "tiny":
        return ByteTokenizer()
    if source.kind == "gguf":
        return _load_gguf_tokenizer(source.path)
    return _load_hf_dir_tokenizer(source.path)


# ---- GGUF: convert once, then load the cached tokenizer.json ---------------------------------------------


def tokenizer_cache_paths(gguf_path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(tokenizer.json, special-ids json) cached for this GGUF file."""
    from runtime.models.registry import cache_dir

    path = Path(gguf_path)
    key = f"{_sha256(path)}-{path.stat().st_size}"
    folder = cache_dir() / "tokenizers"
    return folder / f"gguf-{key}.tokenizer.json", folder / f"gguf-{key}.special.json"


def _load_gguf_tokenizer(path: Path) -> HFTokenizer:
    from tokenizers import Tokenizer as RustTokenizer

    tok_file, special_file = tokenizer_cache_paths(path)
    if not tok_file.is_file() or not special_file.is_file():
        backend, special = _convert_gguf_tokenizer(path)
        tok_file.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(special_file, json.dumps(special))
        _write_atomic(tok_file, backend.to_str())
    special = json.loads(special_file.read_text())
    return HFTokenizer(RustTokenizer.from_file(str(tok_file)), special["bos_token_id"], special["eos_token_ids"])


def _convert_gguf_tokenizer(path: Path):
    """(tokenizers.Tokenizer, {"bos_token_id", "eos_token_ids"}) built by transformers from the GGUF."""
    try:
        from transformers import GemmaTokenizer
    except ImportError as exc:
        raise RuntimeError(
            "converting a GGUF file's tokenizer needs transformers once (the result is cached): "
            "pip install 'swa-runtime[model]'"
        ) from exc
    # GemmaTokenizer directly rather than AutoTokenizer: the same conversion, without AutoTokenizer first
    # rebuilding the model config from the file (which takes longer than the conversion itself).
    hf = GemmaTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return hf.backend_tokenizer, {"bos_token_id": hf.bos_token_id, "eos_token_ids": [hf.eos_token_id]}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


_SHA_MEMO: dict[tuple[str, int, int], str] = {}


def _sha256(path: Path) -> str:
    stat = path.stat()
    memo_key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if memo_key not in _SHA_MEMO:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        _SHA_MEMO[memo_key] = digest.hexdigest()
    return _SHA_MEMO[memo_key]


# ---- Hugging Face directory ------------------------------------------------------------------------------


def _load_hf_dir_tokenizer(path: Path) -> HFTokenizer:
    from tokenizers import Tokenizer as RustTokenizer

    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{path} has no tokenizer.json")
    tok = RustTokenizer.from_file(str(tok_file))
    config = _read_json(path / "config.json")
    config = config.get("text_config", config)
    generation = _read_json(path / "generation_config.json")
    bos = config.get("bos_token_id", tok.token_to_id("<bos>"))
    eos = generation.get("eos_token_id", config.get("eos_token_id", tok.token_to_id("<eos>")))
    eos_ids = eos if isinstance(eos, list) else [eos]
    return HFTokenizer(tok, int(bos), [int(e) for e in eos_ids if e is not None])


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
