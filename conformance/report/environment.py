"""Where a certification ran: the device, its CUDA and driver versions, the dtype the backend
computed in and torch's TF32 settings, recorded in report.json and the certificate. A result
on a GPU is only comparable with another on the same stack, and TF32 matmuls change float32
logits enough to move near-ties, so the certificate says which were in force."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from conformance.report.results import Scalar

UNKNOWN = "unknown"


def driver_version(run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run
                   ) -> str:
    """The NVIDIA driver's version as ``nvidia-smi`` reports it (the first GPU's); "unknown"
    where nvidia-smi is missing, fails or says nothing."""
    try:
        done = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                   capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    lines = done.stdout.strip().splitlines() if done.returncode == 0 else []
    return lines[0].strip() if lines and lines[0].strip() else UNKNOWN


def run_environment(device: str, dtype: str,
                    driver: Callable[[], str] = driver_version) -> dict[str, Scalar]:
    """The environment record of a run on ``device`` whose backend computes in ``dtype``: on
    the CPU device "cpu" and no CUDA or driver version; on CUDA the device's name."""
    import torch

    on_cuda = device != "cpu"
    return {
        "device": torch.cuda.get_device_name(torch.device(device)) if on_cuda else "cpu",
        "cuda": torch.version.cuda if on_cuda else None,
        "driver": driver() if on_cuda else None,
        "dtype": dtype,
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
