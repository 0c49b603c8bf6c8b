"""swa-runtime: the engine (pools, model, attention backends, runner, CLI)."""

import os

# Triton kernels run in its interpreter when there is no GPU, and the switch only takes effect if it is set
# before triton is first imported (transformers imports it early), hence here, at package import.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
