#!/usr/bin/env bash
# The checks that need a CUDA GPU (CI has none): the Triton kernels compiled for the device against their
# float64 reference, the whole engine on CUDA against transformers (tiny random models, torch and Triton
# backends, eager and graph replay, the prefix cache with the strict KV sanitizer), then the kernels' and the
# engine's speed at Gemma 3 270M's shapes.
# Usage: bash benchmarks/gpu_check.sh [LOG_DIR]   (from the repository root, on a machine with a GPU)
# A machine that cannot reach a package index but lacks the core's pure-Python dependencies takes them from
# wheels/ (ignored by git) when it is there: fill it beforehand with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d wheels \
#       structlog prometheus-client gguf tqdm pyyaml
set -uo pipefail
log_dir=${1:-${OUT:-/tmp}}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L
if [ -d wheels ]; then python3 -m pip install -q --no-deps --break-system-packages wheels/*.whl; fi
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/attention/test_triton_kernels.py \
    tests/executor/test_oracle_tiny.py -k "cuda or not oracle_tiny" 2>&1 | tee "$log_dir/gpu_tests.log" | tail -15
tests=${PIPESTATUS[0]}
python3 benchmarks/gpu_attention.py 2>&1 | tee "$log_dir/gpu_attention.log"
kernels=${PIPESTATUS[0]}
timeout 300 python3 benchmarks/gpu_engine.py 2>&1 | grep -v "Capturing" | tee "$log_dir/gpu_engine.log"
engine=${PIPESTATUS[0]}
echo "tests rc=$tests kernels rc=$kernels engine rc=$engine"
exit $(( tests || kernels || engine ))
