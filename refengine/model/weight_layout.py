"""How a loaded model's weights sit in memory for decoding.

Every ``nn.Linear`` weight keeps its HF shape ``[out, in]`` (state dicts, checks and the
parameter names are unchanged) but is stored input-major: ``weight.t()`` is contiguous. At the
engine's batch sizes a linear layer is a matrix-vector product whose cost is reading the
weight, and MKL's kernel streams an ``[in, out]`` matrix faster than it walks an ``[out, in]``
one. The sums are the same products in another order, so logits move by float32 rounding, like
any change of BLAS kernel.
"""

from __future__ import annotations

from typing import TypeVar

from torch import nn

ModelT = TypeVar("ModelT", bound=nn.Module)


def place_for_decoding(model: ModelT, device: str) -> ModelT:
    """``model`` on ``device``, in eval mode, with every linear weight input-major."""
    model = model.to(device)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            # Idempotent: a weight shared with a module already laid out is left as it is.
            module.weight.data = module.weight.data.t().contiguous().t()
    return model.eval()
