"""The compute precision of a run: the one place that knows what a precision name means.

- :data:`PRECISIONS` / :data:`RUN_PRECISIONS`: the names ``model.precision`` takes, and those a run
  resolves to; :data:`DTYPE_NAMES`: the ONE map from a run precision to its torch dtype name
  (``bf16`` -> ``bfloat16``); :data:`MASTER_DTYPE`: the fp32 master weights' dtype.
- :func:`torch_dtype`, :func:`autocast_dtype`, :func:`autocast` (the forward's compute dtype: none
  for fp32), :func:`trainer_flags` (``TrainingArguments``' ``bf16=``/``fp16=``) and
  :func:`precision_from_flags` (the way back), :func:`save_dtype` (``model.save_dtype`` as a torch name).
- :func:`resolve_device` (``model.device: auto``) and :func:`resolve_precision`
  (``model.precision: auto``) for the device, and :func:`enable_tf32`.

Every other module asks these instead of keeping its own name -> dtype or flag map
(``tests/plan/test_precision_map.py`` checks that no other module defines one).

``auto`` (the default) picks, once, in the plan (:func:`cembed.plan.resolve.resolve_plan`):

- CPU: ``fp32``;
- a CUDA GPU with native bf16 (compute capability 8.0 or newer: A100, H100, H200, L4, RTX 30xx+):
  ``bf16`` autocast over fp32 master weights;
- an older GPU with fp16 tensor cores (7.x: V100, T4): ``fp16`` autocast with loss scaling;
- older still: ``fp32``.

TF32 is switched on for fp32 matrix products and cuDNN convolutions on every CUDA GPU that has it
(8.0+), whatever the precision: under bf16/fp16 autocast the loss stage (the cached loss's
similarity matrices, computed outside autocast) and the ops autocast keeps in fp32 are such
products. TF32 keeps fp32's range with a 10-bit mantissa, as bf16 autocast's inputs already have
7 (NVIDIA, "Accelerating AI Training with NVIDIA TF32 Tensor Cores", 2020; PyTorch's CUDA notes,
"TensorFloat-32 (TF32) on Ampere (and later) devices").
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

from cembed.errors import UserError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # model.precision
RUN_PRECISIONS = ("fp32", "bf16", "fp16")  # what a run computes in (auto resolved); also model.save_dtype
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # run precision -> torch dtype name
AUTOCAST_PRECISIONS = ("bf16", "fp16")  # autocast over fp32 master weights; fp32 runs without autocast
MASTER_DTYPE = DTYPE_NAMES["fp32"]  # the dtype a model trains (and the optimizer updates) in, whatever its stored one


def _run_precision(precision: str) -> str:
    if precision not in DTYPE_NAMES:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(RUN_PRECISIONS)} (resolve auto first)")
    return precision


def dtype_name(precision: str) -> str:
    """The torch dtype name of a run precision: ``fp32`` -> ``float32``, ``bf16`` -> ``bfloat16``,
    ``fp16`` -> ``float16``.

    Raises:
        ValueError: ``auto`` (resolve it first) or an unknown name.
    """
    return DTYPE_NAMES[_run_precision(precision)]


def torch_dtype(precision: str):
    """The ``torch.dtype`` of a run precision (``bf16`` -> ``torch.bfloat16``); ValueError as :func:`dtype_name`."""
    import torch

    return getattr(torch, dtype_name(precision))


def uses_autocast(precision: str) -> bool:
    """Whether a run in ``precision`` wraps its forward in autocast (bf16/fp16: yes; fp32: no).

    Raises:
        ValueError: ``auto`` or an unknown name.
    """
    return _run_precision(precision) in AUTOCAST_PRECISIONS


def autocast_name(precision: str) -> str | None:
    """The autocast dtype's torch name (``bfloat16`` / ``float16``), None for fp32."""
    return dtype_name(precision) if uses_autocast(precision) else None


def autocast_dtype(precision: str):
    """The autocast ``torch.dtype`` (``torch.bfloat16`` / ``torch.float16``), None for fp32."""
    return torch_dtype(precision) if uses_autocast(precision) else None


def autocast(precision: str, device_type: str):
    """A context manager running its body in ``precision``'s autocast on ``device_type``
    (``cpu`` / ``cuda``, a ``torch.device.type``), as the trainer's forward runs; a no-op for fp32."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type, dtype=dtype)


def trainer_flags(precision: str) -> dict[str, bool]:
    """``TrainingArguments``' mixed-precision flags for a run precision: ``{"bf16": ..., "fp16": ...}``
    (both False for fp32)."""
    p = _run_precision(precision)
    return {"bf16": p == "bf16", "fp16": p == "fp16"}


def precision_from_flags(bf16: bool, fp16: bool) -> str:
    """The run precision that :func:`trainer_flags` turned into ``bf16``/``fp16`` flags."""
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def save_dtype(name: str | None) -> str | None:
    """``model.save_dtype`` (``fp32`` | ``bf16`` | ``fp16``) as a torch dtype name; None (unset: the
    final model is saved in its training dtype) stays None."""
    return dtype_name(name) if name else None


def resolve_device(requested: str) -> str:
    """``auto`` -> ``cuda`` when available, else ``cpu``; anything else is returned unchanged.

    Raises:
        UserError: ``cuda`` requested but no CUDA device is visible.
    """
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("model.device: cuda was requested but no CUDA device is visible; use auto or cpu")
    return requested


class ResolvedPrecision(NamedTuple):
    """:func:`resolve_precision`'s answer: ``precision`` (fp32 | bf16 | fp16), ``tf32`` (TF32 on
    for fp32 matmuls) and ``reason`` (one line for ``cembed validate`` and ``run_summary.json``)."""

    precision: str
    tf32: bool
    reason: str


def cuda_capability() -> tuple[str, tuple[int, int]]:
    """Name and compute capability ``(major, minor)`` of this process's current CUDA device."""
    import torch

    index = torch.cuda.current_device()
    return torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index))


def cuda_bf16_native() -> bool:
    """Whether this process's GPU computes bf16 natively (torch's ``is_bf16_supported`` without
    counting emulation: on a V100 bf16 tensors exist, but every bf16 product is emulated)."""
    import torch

    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch before 2.3 has no including_emulation
        return bool(torch.cuda.is_bf16_supported())


def resolve_precision(requested: str, device: str) -> ResolvedPrecision:
    """Resolve ``model.precision`` for ``device``.

    Args:
        requested: ``auto`` | ``fp32`` | ``bf16`` | ``fp16``.
        device: ``cpu`` or ``cuda`` (``cuda:<n>`` counts as cuda), already resolved.

    Returns:
        The :class:`ResolvedPrecision`; ``tf32`` is true only on a CUDA GPU of compute capability
        8.0 or newer.

    Raises:
        UserError: fp16 on CPU; bf16 on a GPU without native bf16 (naming the GPU and the fix);
            an unknown precision.
    """
    if requested not in PRECISIONS:
        raise UserError(f"model.precision: {requested!r} is not one of {', '.join(PRECISIONS)}")
    if not device.startswith("cuda"):
        if requested == "fp16":
            raise UserError("model.precision: fp16 needs a CUDA device; use fp32 or bf16 on CPU")
        if requested == "auto":
            return ResolvedPrecision("fp32", False, "fp32 (auto: CPU)")
        return ResolvedPrecision(requested, False, f"{requested} (model.precision)")
    name, (major, minor) = cuda_capability()
    tf32 = major >= 8
    note = ", TF32 on for fp32 matmuls" if tf32 else ""
    gpu = f"{name}, compute capability {major}.{minor}"
    if requested == "bf16" and not cuda_bf16_native():
        raise UserError(
            f"model.precision: bf16 is not supported by this GPU ({gpu}; bf16 needs 8.0 or newer, e.g. A100, "
            "H100); use model.precision: fp16 (mixed precision with loss scaling), fp32 or auto"
        )
    if requested != "auto":
        return ResolvedPrecision(requested, tf32, f"{requested} (model.precision; {gpu}{note})")
    if cuda_bf16_native():
        return ResolvedPrecision("bf16", tf32, f"bf16 (auto: {gpu} has bf16{note})")
    if major >= 7:
        return ResolvedPrecision("fp16", tf32, f"fp16 (auto: {gpu} has fp16 tensor cores but no bf16)")
    return ResolvedPrecision("fp32", tf32, f"fp32 (auto: {gpu} has no bf16 or fp16 tensor cores)")


def enable_tf32() -> None:
    """Allow TF32 for fp32 matrix products (cuBLAS) and cuDNN convolutions in this process.

    Uses ``torch.set_float32_matmul_precision("high")`` and ``torch.backends.cudnn.allow_tf32``,
    which leave every backend's setting consistent: setting only the per-backend
    ``fp32_precision`` (as ``TrainingArguments(tf32=True)`` does through
    ``torch.backends.fp32_precision``) makes later reads of ``torch.get_float32_matmul_precision()``
    (torch.compile's inductor does one) raise "mix of the legacy and new APIs" on torch 2.9+.
    """
    import torch

    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
