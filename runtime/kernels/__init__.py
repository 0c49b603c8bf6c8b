"""Fused CPU kernels for a bfloat16 model on the CPU (decode and prefill), compiled on this machine at first use.

At batch 1 a Gemma 3 270M decode step spent more time in small operations than in its weights: an RMSNorm
was six torch operations (about 36 us where its arithmetic takes 2), the q/k norm and rotation ten, and the
attention of one query copied every key and value it read before two batched matmuls (about 380 us a layer).
The sources, one job each:

- `norms.cpp`: RMSNorm (with the residual add that follows it) and the per-head q/k norm with the rotary
  embedding, one pass each;
- `attention.cpp`, `extend_attention.cpp` (`attention_chunk.h`, `attention_values.h` between them): decode and
  prefill attention reading the KV pool in place, and the KV write before it; `extend_tiles.h`: prefill's
  bfloat16 attention 16 query rows at a time over restaged keys (on AMX-BF16 tiles where the CPU has them: `amx.cpp`
  holds the OS's grant of the tile state and each thread's tile configuration); `extend_tiles_f32.h`: the same in
  float32 on AVX2, for CPUs without bfloat16 units (`tile_rows.h`: a tile's rows and the keys they see, for both);
- `activation.cpp`: the MLP's gated GELU in one pass (`vecmath.h`: the vector loads, stores, exp and tanh);
- `argmax.cpp`: greedy sampling's maximum and first index per row of logits, sixteen lanes and two threads;
- `quant.cpp`, `quant_kernels.cpp`: low-bit projections on AVX512-VNNI (`Projection`: int8 per row or per
  block of 32, exactly-4-bit), decode's few rows at the memory's pace, prefill's many in tiles; `quant_avx2.h`:
  the same on AVX2 where the CPU has no AVX512-VNNI;
- `decode_layer.cpp`: a decoder layer's math on each side of its attention call in one call each
  (`layer_pre`, `layer_post`; `runtime/models/fused_decode.py`);
- `decode_stack.cpp`: a decode step's model but its LM head in one call (`DecodeStack`: the token rows, per layer
  `layer_pre`, the KV write, decode attention, `layer_post`, the final norm), at slots and keys the runtime
  translated and checked before;
- `ledger.cpp`: the KV sanitizer's write check in one call, for its common outcome (everything in order);
- `grids.cpp`: at load, the grid a dequantised GGUF weight lies on (int8 with a float16 scale per block of 32, or
  exactly 4-bit per group of 32), one pass a weight (`runtime/layers/int8_blocks.py`, `int4.py`);
- `weight_arena.cpp`: a buffer in 2 MB pages and `Projection.place`, which moves a copy there
  (`runtime/layers/weight_arena.py`);
- `module.cpp`: the Python bindings.

The kernels serve bfloat16 models only (`for_tensor`): float32 keeps the torch path, bit for bit the
reference's (its oracle tests are token-exact). Their float32 arithmetic rounds where the torch path rounds,
so they differ from it by the order of float32 sums (and by attention in float32 where the torch path
multiplies in bfloat16 from three requests on).

The extension is built once per source and CPU (`-march=native`: a cache shared by machines with different
CPUs must not hand one another's instructions around; `SWA_RUNTIME_CPU_KERNELS_MARCH=haswell` builds for another
target instead, so that a developer on an AVX-512 machine can run and time the AVX2 code paths) under `<cache dir>/kernels/`, 35 s to 2.5 minutes
with torch's headers on 2 cores by CPU (1.4-1.7 minutes on a Xeon with AMX), and needs a C++ compiler and ninja
(the `ninja` package). Without them, or with `SWA_RUNTIME_CPU_KERNELS=off`, the model runs the torch path and the start-up log says why.

torch marks a build in progress with a `lock` file and waits, forever, while one exists; a build killed half-way
leaves it behind, and every later start then hung without a word. So `load()` holds an OS lock on
`build.flock` around torch's (the kernel drops it when its holder dies): once held, a `lock` file is stale, and
is removed with a warning.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import threading
from pathlib import Path

import torch

from runtime.paths import cache_dir

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))  # module.cpp binds what the others define
HEADERS = sorted(HERE.glob("*.h"))
ENV_SWITCH = "SWA_RUNTIME_CPU_KERNELS"
ENV_MARCH = "SWA_RUNTIME_CPU_KERNELS_MARCH"

_lock = threading.Lock()
_module = None
_failure: str | None = None


def _cpu_fingerprint() -> str:
    """The CPU's model and feature flags: what `-march=native` compiles for."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _march() -> str:
    """The `-march` target: this CPU's own unless the environment names another (a GCC target name)."""
    march = os.environ.get(ENV_MARCH, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", march):
        raise ValueError(f"{ENV_MARCH}={march!r} is not a compiler target name (such as native, haswell, znver1)")
    return march


def _build_name() -> str:
    digest = hashlib.sha256()
    parts = (*(p.read_bytes() for p in SOURCES + HEADERS), _cpu_fingerprint().encode(), torch.__version__.encode())
    for part in parts:
        digest.update(part)
    if _march() != "native":
        digest.update(_march().encode())
    return f"swa_cpu_kernels_{digest.hexdigest()[:16]}"


def _hold_build_dir(build_dir: Path):
    """An open file whose lock makes this process the only one building in `build_dir` (waiting, and saying so,
    while another is); torch's `lock` file found then was left by a build that died, and is removed."""
    handle = open(build_dir / "build.flock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("waiting for another process building the fused CPU kernels in %s", build_dir)
        fcntl.flock(handle, fcntl.LOCK_EX)
    stale = build_dir / "lock"
    if stale.exists():
        log.warning("removing %s, left by a kernel build that was killed before it finished", stale)
        stale.unlink(missing_ok=True)
    return handle


def load() -> object | None:
    """The compiled kernels, building them on first use; None when they cannot be had (`failure()` says why)."""
    global _module, _failure
    if _module is not None or _failure is not None:
        return _module
    with _lock:
        if _module is not None or _failure is not None:
            return _module
        if os.environ.get(ENV_SWITCH, "").lower() in ("0", "off", "false", "no"):
            _failure = f"{ENV_SWITCH}={os.environ[ENV_SWITCH]}"
            return None
        try:
            build_dir = cache_dir() / "kernels" / _build_name()
            build_dir.mkdir(parents=True, exist_ok=True)
            from torch.utils.cpp_extension import load as load_extension

            with _hold_build_dir(build_dir):
                if not (build_dir / f"{build_dir.name}.so").exists():
                    log.info("building the fused CPU kernels (once per machine, 35 s to 2.5 minutes) in %s", build_dir)
                _module = load_extension(
                    name=build_dir.name, sources=[str(p) for p in SOURCES], build_directory=str(build_dir),
                    extra_cflags=["-O3", f"-march={_march()}", "-fopenmp", "-fno-math-errno"], extra_ldflags=["-fopenmp"],
                    verbose=False)
        except Exception as exc:  # noqa: BLE001 (no compiler, no ninja, an unwritable cache, a failed build)
            _failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            log.warning("fused CPU kernels unavailable, the torch path serves: %s", _failure)
        return _module


def loaded() -> object | None:
    """The kernels if something has already built or loaded them, else None (never builds: for exact operations
    such as the greedy argmax, which a float32 model need not wait a minute or more for)."""
    return _module


def failure() -> str | None:
    """Why `load()` returned None (after it did)."""
    return _failure


def for_tensor(x: torch.Tensor):
    """The kernels when an operation on `x` should take them (bfloat16 on the CPU, outside autograd and
    compilers, and built), else None."""
    if x.dtype != torch.bfloat16 or not x.is_cpu or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    return load()


def has_low_bit() -> bool:
    """Whether the kernels are built and hold the low-bit projections (on AVX512-VNNI or AVX2): the decode copies
    and the int8 head then live in their layouts."""
    module = load()
    return module is not None and module.has_low_bit()


def low_bit_isa() -> str:
    """The instructions the low-bit projections run on: "avx512_vnni", "avx2", or "" (none built)."""
    module = load()
    return module.low_bit_isa() if module is not None else ""
