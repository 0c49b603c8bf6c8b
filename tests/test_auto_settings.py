"""`--dtype auto` / `--quantization auto`: resolved from the CPU's features, printed at start, carried in
build_info; a model built beforehand and the tiny test model keep what they are."""

import subprocess
import sys

import pytest
import torch

from runtime.auto_settings import AutoChoice, choose, cpu_flags, describe, resolve_auto
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.models.config import Gemma3Config
from runtime.models.loader import build_model, random_state_dict

X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile
bogomips\t: 5200.00

processor\t: 1
flags\t\t: fpu sse2
"""
ARM_CPUINFO = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\nCPU implementer\t: 0x41\n"


def test_flags_come_from_the_first_cpu_on_x86_and_arm():
    assert {"avx2", "avx512_bf16", "amx_bf16"} <= cpu_flags(X86_CPUINFO)
    assert "sse2" in cpu_flags(X86_CPUINFO) and "fpu" in cpu_flags(X86_CPUINFO)
    assert cpu_flags(ARM_CPUINFO) == {"fp", "asimd", "bf16", "sve"}
    assert cpu_flags("no flags here") == frozenset()


@pytest.mark.parametrize("flags, dtype, quantization", [
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "bfloat16", "int8-head"),  # Xeon with AMX
    ({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}, "bfloat16", "int8-head"),  # EPYC with AVX512-BF16
    ({"avx2", "fma", "f16c", "avx512f", "avx512_vnni"}, "bfloat16", "int8-head"),  # AVX-512 without bfloat16 units
    ({"avx2", "fma", "f16c"}, "bfloat16", "int8-head"),  # AVX2 only: the kernels' AVX2 build
    ({"avx2", "fma"}, "bfloat16", "int8"),  # AVX2 without F16C: no low-bit kernels
    ({"sse2"}, "float32", "none"),
    ({"fp", "asimd"}, "float32", "none"),  # not x86: nothing measured
])
def test_the_choice_follows_the_features_table(flags, dtype, quantization):
    choice = choose(frozenset(flags))
    assert (choice.dtype, choice.quantization) == (dtype, quantization)
    assert choice.reason


def test_only_what_is_auto_is_replaced():
    amx = frozenset({"avx2", "amx_bf16"})
    assert resolve_auto("float32", "none", flags=amx) == ("float32", "none", None)
    assert resolve_auto("auto", "none", flags=amx)[:2] == ("bfloat16", "none")
    assert resolve_auto("float32", "auto", flags=amx)[:2] == ("float32", "int8-head")
    assert resolve_auto("auto", "auto", tiny=True, flags=amx)[:2] == ("float32", "none")


def test_the_default_config_resolves_for_this_cpu_and_pinned_settings_stay():
    expected = choose(cpu_flags())
    cfg = EngineConfig().concrete()
    assert (cfg.dtype, cfg.quantization, cfg.auto_reason) == (expected.dtype, expected.quantization, expected.reason)
    pinned = EngineConfig(dtype="float32", quantization="none")
    assert pinned.concrete() is pinned
    assert EngineConfig(model="tiny").concrete().dtype == "float32"
    assert EngineConfig().resolve(Gemma3Config.tiny()).engine.dtype == expected.dtype  # resolve() concretes too


def test_a_model_built_beforehand_keeps_its_dtype():
    config = Gemma3Config.tiny()
    model = build_model(config, random_state_dict(config, seed=0), torch.bfloat16)
    engine = Engine(EngineConfig(model="gemma3-270m", max_total_tokens=512, graph_batch_sizes=(1,)), progress=False,
                    model=model)
    assert (engine.cfg.dtype, engine.cfg.quantization) == ("bfloat16", "none")
    assert (engine.stats.build_info.dtype, engine.stats.build_info.quantization) == ("bfloat16", "none")
    assert engine.runner.pool.full_pool.dtype == torch.bfloat16


def test_generate_prints_what_auto_chose_and_what_was_given():
    def stderr(*args):
        out = subprocess.run([sys.executable, "-m", "runtime", "generate", "--model", "tiny", "--input-ids",
                              "2,40,41", "--max-new-tokens", "2", "--json", *args],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stderr

    assert ("s] dtype float32, quantization none (auto: the tiny random model is a test fixture: kept "
            "exact)") in stderr()
    assert "s] dtype bfloat16, quantization none (as given)" in stderr("--dtype", "bfloat16", "--quantization", "none")
    assert describe("bfloat16", "int8-head", AutoChoice("bfloat16", "int8-head", "x").reason).endswith("(auto: x)")
