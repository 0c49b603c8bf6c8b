"""The kernels' AVX2 code paths, built and tested on a CPU with AVX-512 too.

The kernels compile for the CPU they run on (`-march=native`), so on an AVX-512 machine their AVX2 paths
(`quant_avx2.h`, `chunk_avx2`, the float32 extend tiles as the default) are neither built nor run, and CI lands on
AVX-512 machines more often than not. Here they are built for Haswell (`SWA_RUNTIME_CPU_KERNELS_MARCH`, a build of
its own in the cache) and the kernel tests run against that build in a process of their own."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import kernels

HERE = Path(__file__).parent


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _run(code_or_args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *code_or_args], env=env, capture_output=True, text=True, timeout=900,
                          cwd=HERE.parent.parent, stdin=subprocess.DEVNULL)


@pytest.mark.slow  # a build of its own: 1.5-2 minutes on 2 cores
def test_the_avx2_build_passes_the_kernel_tests():
    if "avx512f" not in _cpu_flags():
        pytest.skip("no AVX-512 here: the kernels' own build is the AVX2 one")
    if not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("no AVX2 with FMA and F16C here")
    env = {**os.environ, kernels.ENV_MARCH: "haswell"}
    probe = _run(["-c", "from runtime import kernels; K = kernels.load(); assert K is not None, kernels.failure(); "
                        "print(K.low_bit_isa(), K.extend_tiles())"], env)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.split() == ["avx2", "float32"]  # the AVX2 low-bit kernels, the float32 tiles by default
    tests = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "test_cpu_kernels.py")], env)
    assert tests.returncode == 0, tests.stdout[-5000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout.splitlines()[-1]


def test_a_target_that_is_not_a_compiler_name_is_refused(monkeypatch):
    monkeypatch.setenv(kernels.ENV_MARCH, "haswell -O0")
    with pytest.raises(ValueError, match="not a compiler target name"):
        kernels._march()
    monkeypatch.setenv(kernels.ENV_MARCH, "")
    assert kernels._march() == "native"
