"""How a loaded model's weights sit in memory for decoding.

Every ``nn.Linear`` weight keeps its HF shape ``[out, in]`` (state dicts, checks and the
parameter names are unchanged) but is stored input-major: ``weight.t()`` is contiguous. At the
engine's batch sizes a linear layer is a matrix-vector product whose cost is reading the
weight, and MKL's kernel streams an ``[in, out]`` matrix faster than it walks an ``[out, in]``
one. Measured on tiny-code, one torch thread, batch 1, ``specgate bench --spec eagle --graphs
compiled``, the two layouts alternating three times (tok/s, out-major -> input-major): plain
266-282 -> 347-401, plain compiled 300-342 -> 402-503, EAGLE chain S3/N4 compiled 393-455 ->
456-533. The sums are the same products in another order, so logits move by float32 rounding
(about 1e-5 here), like any change of BLAS kernel.
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
