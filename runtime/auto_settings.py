"""`--dtype auto` and `--quantization auto`: the fastest setting measured on this kind of CPU within the quality
bounds, chosen from the CPU's features at start-up (the table and its measurements: docs/performance.md).

The choice depends on what the CPU can multiply natively:

| CPU features | dtype | quantization | why |
|---|---|---|---|
| AMX-BF16 or AVX512-BF16 | bfloat16 | int8-head | bfloat16 units for activations, norms and attention; the LM head and projections read the GGUF's own low-bit blocks (int4 / int8 per block, used exactly) on the fused kernels, prefill too where the CPU has AVX512-VNNI but no AMX, there on int8 in blocks of 128 requantised at load and smoothed by a calibration run (`--prefill-weights`: prefill's projections 1.2x the GGUF's blocks, which ran 1.5x prepacked bfloat16; with AMX, oneDNN's AMX tiles, as fast as ours there, and decode batches up to 64 rows on ours), decode at the memory's pace; with VNNI a batch-1 step's LM head screened in 4 bits, its top refined in 8 (runtime/layers/head_screen.py) |
| AVX2 (with FMA and F16C) or AVX-512 without bfloat16 units | bfloat16 | int8-head | bfloat16 matmuls are emulated; the same low-bit copies and kernels as above, built for AVX2 (`vpmaddubsw`; runtime/kernels/quant_avx2.h) where the CPU has no AVX512-VNNI: on a 2-core Zen 1 EPYC, batch-1 steps 2.8x the `int8` format's and 1.93-2.10x llama.cpp through the server (the GGUF's int4 and Q5_0 blocks for every row count, a block summed in 16 bits: `decode_linear.own_blocks_faster`; the other projections' prefill copies within the AVX2 tiles' pair budget: `decode_linear.tile_pair_budget`; the LM head screened in 4 bits at decode batches of up to 32 rows too, each row's top refined in 8: runtime/layers/head_screen.py) |
| AVX2 without FMA or F16C | bfloat16 | int8 | int8 weight-only projections on torch's kernels read a quarter of float32's bytes |
| anything else (no AVX2, not x86) | float32 | none | nothing measured there: the exact path |

Each choice keeps perplexity within 1% of float32 on the fixed text (tests/models/test_quality_dtypes.py). The
tiny random model (a test fixture) and a model handed in pre-built keep what they are: `auto` on them means
float32 / none and the model's own dtype and format. No torch import here: `--help` and argument parsing stay
fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"


@dataclass(frozen=True)
class AutoChoice:
    dtype: str
    quantization: str
    reason: str  # the CPU feature (or fact) the choice follows from, for the start-up line


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (empty where it cannot be read: not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def choose(flags: frozenset[str]) -> AutoChoice:
    """The setting for a CPU with `flags` (see the module docstring's table)."""
    if "amx_bf16" in flags:
        return AutoChoice("bfloat16", "int8-head", "the CPU has AMX-BF16 (bfloat16 units)")
    if "avx512_bf16" in flags:
        return AutoChoice("bfloat16", "int8-head", "the CPU has AVX512-BF16 (bfloat16 units)")
    if {"avx2", "fma", "f16c"} <= flags:
        return AutoChoice("bfloat16", "int8-head", "the CPU has AVX2 (the low-bit kernels' AVX2 build) but no bfloat16 units")
    if "avx2" in flags:
        return AutoChoice("bfloat16", "int8", "the CPU has AVX2 but no bfloat16 units")
    return AutoChoice("float32", "none", "no AVX2: nothing faster was measured on this kind of CPU")


def resolve_auto(dtype: str, quantization: str, *, tiny: bool = False, model=None,
                 flags: frozenset[str] | None = None) -> tuple[str, str, str | None]:
    """(dtype, quantization, reason) with `auto` replaced; reason is None when nothing was `auto`.

    `model`: a model built beforehand (its dtype and format are what runs); `tiny`: the random test model."""
    if AUTO not in (dtype, quantization):
        return dtype, quantization, None
    if model is not None:
        param = next((p for p in model.parameters() if p.is_floating_point()), None)
        own = str(param.dtype).removeprefix("torch.") if param is not None else "float32"
        choice = AutoChoice(own, getattr(model, "quantization", "none"), "the model was built beforehand")
    elif tiny:
        choice = AutoChoice("float32", "none", "the tiny random model is a test fixture: kept exact")
    else:
        choice = choose(cpu_flags() if flags is None else flags)
    return (choice.dtype if dtype == AUTO else dtype,
            choice.quantization if quantization == AUTO else quantization, choice.reason)


def describe(dtype: str, quantization: str, reason: str | None) -> str:
    """The start-up line that says what `auto` became."""
    if reason is None:
        return f"dtype {dtype}, quantization {quantization} (as given)"
    return f"dtype {dtype}, quantization {quantization} (auto: {reason})"
