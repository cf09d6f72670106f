"""The resolved plan: what a validated config means on this machine.

Device, world size, samples per optimizer step and the effective learning rate are decided here,
once, and every later stage reads them from the :class:`Plan` instead of re-deriving them from the
config.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass

from cembed.config import CembedConfig
from cembed.errors import UserError
from cembed.lr import derivation, scale_lr
from cembed.model import DTYPE_NAMES, resolve_device
from cembed.precision import resolve_precision


@dataclass(frozen=True)
class Plan:
    device: str  # "cpu" or "cuda"
    world_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    samples_per_step: int  # per_device_train_batch_size x world_size x gradient_accumulation_steps
    learning_rate: float  # effective (scaled) LR handed to the optimizer
    lr_derivation: str
    precision: str  # fp32 | bf16 | fp16: model.precision, auto resolved for the device (cembed.precision)
    gather_across_devices: bool = False  # each anchor sees all ranks' candidates (world_size > 1)
    warnings: tuple[str, ...] = ()
    # Rows embedded at once by a cached loss; None until the probe fills batch.mini_batch_size: auto
    # (cembed.probe.resolve_auto), which also records its measurements here.
    mini_batch_size: int | None = None
    mini_batch_probe: dict | None = None
    save_dtype: str | None = None  # model.save_dtype as a torch name (bfloat16); None: the training dtype
    tf32: bool = False  # TF32 on for fp32 matmuls (a CUDA GPU of compute capability 8.0+)
    precision_reason: str = ""  # how the precision was chosen, e.g. "bf16 (auto: NVIDIA H200 ... has bf16)"

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_plan(cfg: CembedConfig, world_size: int | None = None) -> Plan:
    """Resolve device, world size, samples per step and the effective LR for ``cfg``.

    Args:
        cfg: a validated config.
        world_size: number of training processes; defaults to ``$WORLD_SIZE`` or 1.

    ``gather_across_devices`` is ``loss.gather_across_devices``, or ``world_size > 1`` when unset.
    ``model.precision: auto`` becomes fp32 on CPU, bf16 on a GPU with bf16 (see :mod:`cembed.precision`).
    The LR is scaled from the global samples per step (``per_device x world_size x accumulation``).

    Raises:
        UserError: fp16 requested on CPU, bf16 on a GPU without bf16, cuda requested without a GPU,
            or a world size below 1.
    """
    device = resolve_device(cfg.model.device)
    precision = resolve_precision(cfg.model.precision, device)
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if world < 1:
        raise UserError(f"world size {world}: --nproc-per-node x --nnodes (or $WORLD_SIZE) must be at least 1")
    b, o = cfg.batch, cfg.optim
    samples = b.per_device_train_batch_size * world * b.gradient_accumulation_steps
    warnings = []
    if b.gradient_accumulation_steps > 1:
        warnings.append(
            f"batch.gradient_accumulation_steps={b.gradient_accumulation_steps}: accumulation adds no in-batch "
            "negatives (each accumulated batch only sees its own); with loss cached_mnrl raise "
            "per_device_train_batch_size instead"
        )
    gather = cfg.loss.gather_across_devices
    gather = world > 1 if gather is None else gather
    if world > 1 and not gather:
        warnings.append(
            f"loss.gather_across_devices=false with {world} processes: each anchor only sees the "
            f"{b.per_device_train_batch_size} rows of its own rank as negatives, not the whole global batch"
        )
    if world > 1 and not b.drop_last:
        warnings.append(
            f"batch.drop_last=false has no effect with {world} processes: every rank needs a full batch of the "
            "same size, so rows that cannot fill a whole global batch at the end of an epoch are left out"
        )
    n_columns = 2 + len(cfg.data.columns.negatives)
    shm = shm_warning(
        b.per_device_train_batch_size, n_columns, cfg.model.max_seq_length, cfg.train.dataloader_num_workers
    )
    warnings += [shm] if shm else []
    return Plan(
        device=device,
        world_size=world,
        per_device_train_batch_size=b.per_device_train_batch_size,
        gradient_accumulation_steps=b.gradient_accumulation_steps,
        samples_per_step=samples,
        learning_rate=scale_lr(o.learning_rate, o.base_batch_size, samples, o.lr_scaling),
        lr_derivation=derivation(o.learning_rate, o.base_batch_size, samples, o.lr_scaling),
        precision=precision.precision,
        gather_across_devices=gather,
        warnings=tuple(warnings),
        mini_batch_size=None if b.mini_batch_size == "auto" else b.mini_batch_size,
        save_dtype=DTYPE_NAMES[cfg.model.save_dtype] if cfg.model.save_dtype else None,
        tf32=precision.tf32,
        precision_reason=precision.reason,
    )


SHM_PATH = "/dev/shm"
TOKEN_BYTES = 16  # the collator's int64 input_ids + int64 attention_mask per token
PREFETCH = 2  # batches each data-loader worker keeps in flight (torch's default prefetch_factor)


def shm_warning(
    batch_rows: int, n_columns: int, max_seq_length: int | None, workers: int, path: str = SHM_PATH
) -> str | None:
    """A warning when data-loader workers would pass more batch data through shared memory than
    ``path`` holds (a small ``/dev/shm``, Docker's default 64 MB, kills workers with "Bus error").

    Args:
        batch_rows: rows per device batch.
        n_columns: texts per row (anchor, positive, negatives).
        max_seq_length: the padded width's upper bound (None: 512 assumed).
        workers: ``train.dataloader_num_workers`` (0: batches never pass through shared memory).
        path: the shared-memory mount.

    Returns:
        The warning (the numbers and the fix), or None when it fits, there are no workers, or
        ``path`` cannot be read.
    """
    if workers < 1:
        return None
    per_batch = batch_rows * n_columns * (max_seq_length or 512) * TOKEN_BYTES
    need = per_batch * workers * PREFETCH
    try:
        size = shutil.disk_usage(path).total
    except OSError:
        return None
    if need <= size:
        return None
    mib = 1024**2
    return (
        f"train.dataloader_num_workers={workers}: a batch of {batch_rows} rows x {n_columns} columns x "
        f"{max_seq_length or 512} tokens is up to {per_batch / mib:.0f} MiB, and {workers} workers x {PREFETCH} "
        f"batches in flight need up to {need / mib:.0f} MiB of shared memory, but {path} holds {size / mib:.0f} "
        f"MiB: workers may die with 'Bus error'. Enlarge it (docker run --shm-size={-(-need // 1024**3) + 1}g, or "
        f"mount -o remount,size=... {path}) or set train.dataloader_num_workers: 0"
    )
