"""The precision names a run is configured with, and what they mean: defined here once for the settings, the
runtime and the planner.

``--precision`` names the dtype the model's parameters and activations are computed in (the optimizer keeps
an fp32 master copy under bf16 and fp16). ``--grad-dtype`` names the dtype gradients are accumulated and
reduced in, relative to it (:func:`megazero.zero.grads.grad_dtype_for` says which dtype each setting gives).
"""

from __future__ import annotations

import torch

__all__ = ["ELEMENT_BYTES", "GRAD_DTYPES", "PRECISION_DTYPES"]

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # --precision
ELEMENT_BYTES = {name: dtype.itemsize for name, dtype in PRECISION_DTYPES.items()}  # bytes per element
GRAD_DTYPES = ("auto", "fp32", "model")  # --grad-dtype (or the --precision name itself, meaning "model")
