"""Where swa-runtime keeps what it makes once and reuses: assembled models, converted tokenizers, built kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$SWA_RUNTIME_CACHE_DIR`, else `$XDG_CACHE_HOME/swa-runtime`, else `~/.cache/swa-runtime`."""
    explicit = os.environ.get("SWA_RUNTIME_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "swa-runtime"
