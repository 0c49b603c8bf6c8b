"""Gemma 3 text model: config, architecture, weight loading (GGUF / Hugging Face dir), tokenizer, registry."""

from runtime.models.config import Gemma3Config
from runtime.models.gemma3 import Gemma3ForCausalLM
from runtime.models.loader import build_model, load_gguf, load_hf_dir, load_model
from runtime.models.registry import resolve_model
from runtime.models.tokenizer import load_tokenizer

__all__ = [
    "Gemma3Config",
    "Gemma3ForCausalLM",
    "build_model",
    "load_gguf",
    "load_hf_dir",
    "load_model",
    "load_tokenizer",
    "resolve_model",
]
