"""swa-runtime: the engine (pools, model, attention backends, runner, CLI).

Nothing heavy is imported here: `swa-runtime --help` and argument errors must answer without loading torch.
"""

import os

# Triton kernels run in its interpreter when there is no GPU, and the switch only takes effect if it is set
# before triton is first imported (transformers imports it early), hence here, at package import. Whether
# a GPU is present is judged from the NVIDIA driver's device node, without importing torch to ask CUDA.
if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    os.environ["TRITON_INTERPRET"] = "1"
