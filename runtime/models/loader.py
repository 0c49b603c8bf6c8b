"""Weights and config from a GGUF file or a Hugging Face directory, and the model built from them.

Every source yields the same thing: a `Gemma3Config` and a state dict in this runtime's parameter names
(Hugging Face's, see `gemma3.py`) and parameterisation (norm weights zero-centred, applied as `1 + w`).
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from runtime.models.config import (
    DEFAULT_ROPE_LOCAL_BASE_FREQ,
    DEFAULT_SLIDING_WINDOW_PATTERN,
    Gemma3Config,
    RopeScaling,
    pattern_layer_types,
)
from runtime.layers.weight_arena import place_decode_weights
from runtime.models.gguf_dequant import dequantize
from runtime.models.gguf_file import GGUFFile
from runtime.models.gemma3 import Gemma3ForCausalLM

StateDict = dict[str, torch.Tensor]

# GGUF tensor name -> ours. `blk.N.` becomes `model.layers.N.`.
_GGUF_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


def gguf_to_param_name(name: str) -> str:
    """`blk.3.ffn_norm.weight` -> `model.layers.3.pre_feedforward_layernorm.weight`."""
    if name in _GGUF_TOP_LEVEL:
        return _GGUF_TOP_LEVEL[name]
    m = _GGUF_LAYER_RE.match(name)
    if m is None or m.group(2) not in _GGUF_PER_LAYER:
        raise ValueError(f"unexpected tensor {name!r} in a Gemma 3 GGUF file")
    return f"model.layers.{m.group(1)}.{_GGUF_PER_LAYER[m.group(2)]}.weight"


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


# ---- GGUF ------------------------------------------------------------------------------------------------


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True
) -> tuple[Gemma3Config, StateDict]:
    """Read a Gemma 3 GGUF file: its config and its dequantised tensors under our names."""
    gguf_file = GGUFFile(path)
    return config_from_gguf(gguf_file), state_dict_from_gguf(gguf_file, dtype, progress)


def state_dict_from_gguf(gguf_file: GGUFFile, dtype: torch.dtype = torch.float32, progress: bool = True) -> StateDict:
    """Dequantise every tensor of an open GGUF file into our names and parameterisation.

    NOTE: ggml applies RMSNorm weights as plain multipliers, so llama.cpp's converter stores Gemma's
    `1 + w`; we subtract the 1 back. Quantised tensors are dequantised (`gguf_dequant.dequantize`: the values of
    `gguf.quants.dequantize`, the oracle's) into numpy's row-major (out_features, in_features) layout, which is
    already `torch.nn.functional.linear`'s; ggml lists the same shape reversed.
    """
    from tqdm import tqdm

    state: StateDict = {}
    for tensor in tqdm(gguf_file.tensors, desc="Loading GGUF tensors", unit="tensor", disable=not progress):
        values = dequantize(tensor.data, tensor.tensor_type)
        expected = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        got = tuple(values.shape)
        if got != expected:
            raise ValueError(f"{tensor.name}: dequantised shape {got} != ggml shape reversed {expected}")
        if _is_norm(tensor.name):
            values = values - 1.0
        state[gguf_to_param_name(tensor.name)] = values.contiguous().to(dtype)
    return state


def config_from_gguf(gguf_file: GGUFFile) -> Gemma3Config:
    """The config of an open GGUF file's Gemma 3 model (metadata under `gemma3.*`)."""
    arch = gguf_file.field("general.architecture")
    if arch != "gemma3":
        raise ValueError(f"only Gemma 3 GGUF files are supported, this one is {arch!r}")

    def key(name: str, default=None):
        value = gguf_file.field(f"gemma3.{name}", default)
        if value is None:
            raise ValueError(f"GGUF file lacks gemma3.{name}")
        return value

    tensors = {t.name: t for t in gguf_file.tensors}
    num_layers = int(key("block_count"))
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length"))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise ValueError("Gemma 3 needs key_length == value_length")
    # The file states no per-layer pattern, no local RoPE base and no query scale: llama.cpp hard-codes
    # them for gemma3 (swa pattern 6; local base 10 000; queries scaled by head_dim**-0.5, except the 27B
    # model, 62 layers, which uses (hidden / heads)**-0.5). We follow the same rules.
    query_scalar = hidden // heads if num_layers == 62 else head_dim
    scaling = None
    scaling_type = gguf_file.field("gemma3.rope.scaling.type")
    if scaling_type not in (None, "none"):
        scaling = RopeScaling(rope_type=scaling_type, factor=float(key("rope.scaling.factor")))
    eos = int(gguf_file.field("tokenizer.ggml.eos_token_id", 1))
    return Gemma3Config(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv")),
        head_dim=head_dim,
        sliding_window=int(key("attention.sliding_window")),
        layer_types=pattern_layer_types(num_layers, DEFAULT_SLIDING_WINDOW_PATTERN),
        query_pre_attn_scalar=query_scalar,
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base")),
        rope_local_base_freq=DEFAULT_ROPE_LOCAL_BASE_FREQ,
        rope_scaling=scaling,
        final_logit_softcapping=gguf_file.field("gemma3.final_logit_softcapping"),
        attn_logit_softcapping=gguf_file.field("gemma3.attn_logit_softcapping"),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=int(gguf_file.field("tokenizer.ggml.bos_token_id", 2)),
        eos_token_ids=(eos,),
        pad_token_id=int(gguf_file.field("tokenizer.ggml.padding_token_id", 0)),
    )


# ---- Hugging Face directory ------------------------------------------------------------------------------

# Prefixes of the text model's weights in Hugging Face checkpoints -> ours.
_HF_PREFIXES = (
    ("model.language_model.", "model."),  # Gemma3ForConditionalGeneration, transformers v5
    ("language_model.model.", "model."),  # Gemma3ForConditionalGeneration, transformers v4
    ("language_model.lm_head.", "lm_head."),
    ("model.", "model."),
    ("lm_head.", "lm_head."),
)


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Gemma3Config, StateDict]:
    """`config.json` plus `*.safetensors` of a Gemma 3 (text) checkpoint; vision weights are ignored."""
    from safetensors.torch import load_file

    path = Path(path)
    config = Gemma3Config.from_hf_dict(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    state: StateDict = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            ours = _hf_param_name(name)
            if ours is not None:
                state[ours] = tensor.to(dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return config, state


_HF_VISION_PREFIXES = (
    "model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector."
)


def _hf_param_name(name: str) -> str | None:
    if name.startswith(_HF_VISION_PREFIXES):
        return None
    for prefix, replacement in _HF_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    raise ValueError(f"unexpected tensor {name!r} in a Gemma 3 checkpoint")


# ---- random weights (the tiny test model) ---------------------------------------------------------------


LIVELY_POST_NORM_GAIN = 11.0


def random_state_dict(config: Gemma3Config, seed: int = 0, dtype: torch.dtype = torch.float32,
                      lively: bool = True) -> StateDict:
    """Deterministic random weights for `config` (same seed, same weights on every machine).

    Scaled so that activations stay O(1) and the logits spread widely: a random model whose logits are
    all near zero would make argmax comparisons meaningless. Norm weights are non-zero so that `1 + w`
    is exercised. The post-attention/post-MLP norm gains are large so that the layers, not the scaled
    embedding, decide the next token: otherwise greedy decoding repeats the last token and a KV mix-up
    between requests or positions would go unnoticed. `lively=False` keeps the gains small (wide logit
    margins, for comparisons at low precision).
    """
    gen = torch.Generator().manual_seed(seed)
    state: StateDict = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            values = 0.2 * torch.randn(shape, generator=gen) + (LIVELY_POST_NORM_GAIN if lively and ".post_" in name else 0.0)
        elif name.endswith("embed_tokens.weight"):
            values = torch.randn(shape, generator=gen)
        else:  # (out, in) projections
            values = torch.randn(shape, generator=gen) * shape[1] ** -0.5
        state[name] = values.to(dtype)
    return state


def expected_shapes(config: Gemma3Config) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q_out, hidden),
            p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_out),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (config.intermediate_size, hidden),
            p + "mlp.up_proj.weight": (config.intermediate_size, hidden),
            p + "mlp.down_proj.weight": (hidden, config.intermediate_size),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "pre_feedforward_layernorm.weight": (hidden,),
            p + "post_feedforward_layernorm.weight": (hidden,),
        })
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


# ---- building the model ----------------------------------------------------------------------------------


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    config: Gemma3Config,
    state_dict: StateDict,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantization: str = "none",
) -> Gemma3ForCausalLM:
    """Allocate the model directly in `dtype` on `device` and copy `state_dict` in (every weight required).

    With `quantization="int8"` the projections and the embedding/LM head are quantised from the state
    dict's values as they load (hand float32 values for the best scales); `dtype` is then the activation
    dtype, that of the norms and of the int8 kernels' inputs. With "int8-head" only the LM head gets an int8
    copy, made from those values too.

    NOTE: do not `.to(dtype)` a built model: that would also cast the float32 RoPE tables.
    """
    with torch.device(device), _default_dtype(dtype):
        model = Gemma3ForCausalLM(config, quantization)
    model.load_state_dict(state_dict, strict=True)
    model.decode_arena = place_decode_weights(model)  # runtime/layers/weight_arena.py
    return model.eval().requires_grad_(False)


def read_weights(
    name_or_path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True
) -> tuple[Gemma3Config, StateDict]:
    """The config and the state dict (in `dtype`) that a model name (see `registry.resolve_model`) or path
    names, before any model is built: one read serves several builds (e.g. in several dtypes)."""
    from runtime.models.registry import resolve_model

    source = resolve_model(name_or_path)
    if source.kind == "tiny":
        return source.config, random_state_dict(source.config, seed=source.seed, dtype=dtype)
    if source.kind == "gguf":
        return load_gguf(source.path, dtype=dtype, progress=progress)
    return load_hf_dir(source.path, dtype=dtype)


def load_model(
    name_or_path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = True,
    quantization: str = "none",
    compile_layers: bool = False,
) -> tuple[Gemma3Config, Gemma3ForCausalLM]:
    """Read the weights a model name or path names and build the model, ready for inference.

    `quantization` as in `build_model` (the weights are then read in float32 and quantised from that);
    `compile_layers` runs each layer's math through `torch.compile` (`Gemma3ForCausalLM.compile_layers`).
    """
    read_dtype = dtype if quantization == "none" else torch.float32
    config, state = read_weights(name_or_path, read_dtype, progress)
    model = build_model(config, state, dtype=dtype, device=device, quantization=quantization)
    if compile_layers:
        model.compile_layers()
    return config, model
