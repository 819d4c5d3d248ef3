"""Load an HF-format Llama directory: config.json, model.safetensors, tokenizer.json.

Only what the engine needs is read; every problem is reported as one line naming the file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

from refengine.model.configs import (
    EAGLE_ARCHITECTURES,
    MTP_ARCHITECTURE,
    EagleLayout,
    FrozenKVMTPConfig,
    ModelConfig,
    architectures,
)

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
DRAFT_FILES = ("config.json", "model.safetensors")  # a draft head uses the target's tokenizer

# Bytes per element of the safetensors dtypes whose tensor sizes are checked; other dtypes (the
# sub-byte F4/F6 kinds, later additions) still get the offset checks.
SAFETENSORS_ITEMSIZE: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}
# A clone made without git-lfs holds this text pointer in place of the weights.
LFS_POINTER = b"version https://git-lfs"


def _corrupt(path: Path, problem: str) -> ValueError:
    return ValueError(f"corrupt safetensors file {path}: {problem}")


def _is_int(value: object) -> bool:
    # JSON true/false arrive as bool, a subclass of int, and are neither offsets nor dimensions.
    return isinstance(value, int) and not isinstance(value, bool)


def _read_safetensors_header(path: Path) -> tuple[object, int]:
    """The parsed JSON header of ``path`` and the size of the data section that follows it."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size  # of the file actually read
            if size < 8:
                raise _corrupt(path, f"truncated: {size} bytes, less than the 8-byte header "
                                     "length")
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little")
            if length == 0 or 8 + length > size:
                if (prefix + f.read(len(LFS_POINTER))).startswith(LFS_POINTER):
                    raise _corrupt(path, "a Git LFS pointer, not the weights (run git lfs pull)")
                raise _corrupt(path, f"header length {length} does not fit in a {size}-byte "
                                     "file (truncated, or not safetensors)")
            raw = f.read(length)
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as err:  # ValueError covers JSON and UTF-8 errors
        raise _corrupt(path, f"header is not valid JSON ({err})") from None
    return header, size - 8 - length


def _tensor_span(path: Path, name: str, entry: object) -> tuple[int, int]:
    """The [begin, end) data offsets of one header entry, checked against its shape and dtype."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise _corrupt(path, f"tensor {name!r} lacks dtype, shape or data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise _corrupt(path, f"tensor {name!r}: data_offsets {offsets!r} are not two integers")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise _corrupt(path, f"tensor {name!r}: data_offsets [{begin}, {end}] are out of order")
    if not isinstance(dtype, str):
        raise _corrupt(path, f"tensor {name!r}: dtype {dtype!r} is not a string")
    if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
        raise _corrupt(path, f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    itemsize = SAFETENSORS_ITEMSIZE.get(dtype)
    if itemsize is not None and end - begin != math.prod(shape) * itemsize:
        raise _corrupt(path, f"tensor {name!r}: data_offsets [{begin}, {end}] hold "
                             f"{end - begin} bytes, shape {shape} of {dtype} needs "
                             f"{math.prod(shape) * itemsize}")
    return begin, end


def check_safetensors_header(path: Path) -> None:
    """Check a safetensors file's header against itself and the file's size, reading only the
    header: a truncated or garbled file fails here, with one line, instead of in every test
    that loads it. ValueError names the file and the problem."""
    header, data_size = _read_safetensors_header(path)
    if not isinstance(header, dict):
        raise _corrupt(path, f"header is a JSON {type(header).__name__}, not an object")
    spans = sorted((*_tensor_span(path, name, entry), name)
                   for name, entry in header.items() if name != "__metadata__")
    # The tensors must tile the data section, as the safetensors loader itself requires: a gap
    # or an overlap means the offsets were damaged even when every size still matches.
    covered = 0
    for begin, end, name in spans:
        if begin != covered:
            raise _corrupt(path, f"tensor {name!r} starts at data byte {begin}, expected "
                                 f"{covered} (gap or overlap in data_offsets)")
        covered = end
    if covered > data_size:
        raise _corrupt(path, f"truncated: header promises {covered} data bytes, file has "
                             f"{data_size}")
    if covered < data_size:
        raise _corrupt(path, f"{data_size - covered} trailing bytes after the {covered} data "
                             "bytes the header describes")


def require_files(path: Path, required: tuple[str, ...], kind: str) -> None:
    """FileNotFoundError naming the first of ``required`` missing from ``path``."""
    for name in required:
        if not (path / name).is_file():
            raise FileNotFoundError(f"{kind} directory {path} is missing {name}")


def check_model_dir(path: Path) -> None:
    """Fail fast on a model directory the engine could not load: FileNotFoundError for a missing
    file, a one-line ValueError for a config.json that does not parse or a damaged
    model.safetensors. Reads config.json and the safetensors header only, so it takes
    milliseconds whatever the model's size."""
    require_files(path, REQUIRED_FILES, "model")
    load_config(path)
    check_safetensors_header(path / "model.safetensors")


def check_draft_dir(path: Path) -> None:
    """``check_model_dir`` for a draft directory (an EAGLE head or a Frozen-KV MTP assistant),
    which has no tokenizer of its own. An EAGLE head's norm weights are checked against the
    layout its config.json declares (``EagleLayout``), from the header alone."""
    require_files(path, DRAFT_FILES, "draft model")
    raw = read_config_json(path)
    if MTP_ARCHITECTURE in raw.get("architectures", []):
        FrozenKVMTPConfig.from_dict(raw, path / "config.json")
        check_safetensors_header(path / "model.safetensors")
        return
    ModelConfig.from_dict(raw, path / "config.json")
    eagle = bool(set(EAGLE_ARCHITECTURES) & set(architectures(raw)))
    layout = EagleLayout.from_dict(raw, path / "config.json") if eagle else None
    check_safetensors_header(path / "model.safetensors")
    if layout is not None:  # not a standalone draft model (a whole Llama, checked as one)
        check_eagle_norms(path, layout)


def check_eagle_norms(path: Path, layout: EagleLayout) -> None:
    """A one-line ValueError when the head's safetensors header stores a norm weight its
    layout has not, or lacks one it has (a head converted to another layout without its
    config.json saying so)."""
    header, _ = _read_safetensors_header(path / "model.safetensors")
    names = set(header) if isinstance(header, dict) else set()
    for name, stored in layout.norm_weights.items():
        if stored != (name in names):
            raise ValueError(f"{path / 'model.safetensors'}: {'lacks' if stored else 'stores'} "
                             f"{name}, but config.json declares an EAGLE layout "
                             f"{'with' if stored else 'without'} that norm (input norm "
                             f"{layout.input_norm}, final norm {layout.final_norm})")


def read_config_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path/config.json``; a one-line ValueError naming the file if it is
    not one."""
    source = path / "config.json"
    try:
        raw = json.loads(source.read_text(encoding="utf-8"))
    except ValueError as err:  # a JSON error, or bytes that are not UTF-8
        raise ValueError(f"{source}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: a JSON {type(raw).__name__}, not an object")
    return raw


def load_config(path: Path) -> ModelConfig:
    return ModelConfig.from_dict(read_config_json(path), path / "config.json")


def check_state_dict(path: Path, model: torch.nn.Module, weights: dict[str, torch.Tensor],
                     what: str) -> None:
    """Names and shapes of ``weights`` against ``model``'s, before ``load_state_dict``: it
    reports a shape mismatch as a bare RuntimeError, and every mismatch should read the same
    way (one ValueError naming the file and ``what`` it is not)."""
    expected = {name: t.shape for name, t in model.state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    reshaped = sorted(name for name in set(expected) & set(weights)
                      if weights[name].shape != expected[name])
    if missing or unexpected or reshaped:
        raise ValueError(f"{path / 'model.safetensors'}: {what} (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}, wrong shape {reshaped[:3]})")


ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


class _WithoutRandomInit(TorchFunctionMode):
    """Modules' random init skipped (this thread only): on the meta device it would be a
    Python decomposition whose first use imports torch._dynamo, a second of every process's
    first engine, for values nobody reads."""

    SKIPPED = frozenset({"uniform_", "normal_"})

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", None) in self.SKIPPED:
            # the tensor to fill: a method's self, or torch.nn.init's ``tensor`` keyword
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))


def build_loaded(path: Path, build: Callable[[], ModuleT], weights: dict[str, torch.Tensor],
                 what: str) -> ModuleT:
    """``build()`` on the meta device, then given ``weights`` themselves (every parameter and
    buffer, checked by ``check_state_dict`` with ``what``): neither a random init nor a copy
    of weights about to be replaced, which cost most of a draft head's load."""
    with torch.device("meta"), _WithoutRandomInit():
        model = build()
    check_state_dict(path, model, weights, what)
    model.load_state_dict(weights, strict=True, assign=True)
    return model


def load_weights(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    source = path / "model.safetensors"
    try:
        tensors = load_file(str(source))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"corrupt safetensors file {source}: {err}") from None
    # Floating tensors in the engine's dtype; index tensors (an EAGLE-3 head's vocabulary map)
    # as stored.
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
