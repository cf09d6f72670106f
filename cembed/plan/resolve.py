"""The resolved plan: what a validated config means on this machine.

Device, world size, samples per optimizer step and the effective learning rate are decided here,
once, and every later stage reads them from the :class:`Plan` instead of re-deriving them from the
config. What the stages need to know about the model as resolved (device, precision, save dtype)
is a :class:`ModelSpec` (:attr:`Plan.model`, or :func:`resolve_model` without a plan): functions
that need a resolved value take it, or the precision, next to the config's ``ModelConfig``, never a
config copy with the resolved value written in.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import asdict, dataclass, replace

from cembed.config.schema import BatchConfig, CembedConfig, ModelConfig
from cembed.errors import UserError
from cembed.plan.lr import derivation, scale_lr
from cembed.plan.precision import resolve_device, resolve_precision, save_dtype


@dataclass(frozen=True)
class ModelSpec:
    """The model as a run resolves it: what the stages need beside the config's ``ModelConfig``.

    Attributes:
        name_or_path: ``model.name_or_path``.
        device: ``cpu`` or ``cuda`` (``model.device: auto`` resolved).
        precision: ``fp32`` | ``bf16`` | ``fp16`` (``model.precision: auto`` resolved for ``device``,
            :func:`cembed.plan.precision.resolve_precision`).
        save_dtype: ``model.save_dtype`` as a torch dtype name (``bfloat16``); None: the training dtype.
        tf32: TF32 on for fp32 matmuls (a CUDA GPU of compute capability 8.0+).
        precision_reason: how the precision was chosen, one line.
    """

    name_or_path: str
    device: str
    precision: str
    save_dtype: str | None = None
    tf32: bool = False
    precision_reason: str = ""


def resolve_model(model_cfg: ModelConfig) -> ModelSpec:
    """Resolve ``model_cfg``'s device and precision on this machine (``probe-minibatch`` without a
    config uses this directly; :func:`resolve_plan` puts the same on the :class:`Plan`).

    Raises:
        UserError: cuda requested without a GPU; fp16 on CPU, bf16 on a GPU without bf16 (see
            :func:`cembed.plan.precision.resolve_precision`).
    """
    device = resolve_device(model_cfg.device)
    precision = resolve_precision(model_cfg.precision, device)
    return ModelSpec(
        name_or_path=model_cfg.name_or_path,
        device=device,
        precision=precision.precision,
        save_dtype=save_dtype(model_cfg.save_dtype),
        tf32=precision.tf32,
        precision_reason=precision.reason,
    )


@dataclass(frozen=True)
class Plan:
    """What a validated config means on this machine, decided once by :func:`resolve_plan`.

    The one later change is the probe's answer for ``batch.mini_batch_size: auto``
    (:meth:`with_probe`, from :func:`cembed.probe.auto.resolve_auto`, once the process group exists).
    Every other stage's findings (the data's warnings, rows the sampler cannot place, the changes a
    resume applies) are values of their own, printed and recorded beside the plan's ``warnings``.
    """

    device: str  # "cpu" or "cuda"
    world_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    samples_per_step: int  # per_device_train_batch_size x world_size x gradient_accumulation_steps
    learning_rate: float  # effective (scaled) LR handed to the optimizer
    lr_derivation: str
    precision: str  # fp32 | bf16 | fp16: model.precision, auto resolved for the device (cembed.plan.precision)
    gather_across_devices: bool = False  # each anchor sees all ranks' candidates (world_size > 1)
    global_batch_size: int | None = (
        None  # batch.global_batch_size when the config set it (the per-device batch follows)
    )
    warnings: tuple[str, ...] = ()
    # Rows embedded at once by a cached loss; None until the probe fills batch.mini_batch_size: auto
    # (cembed.probe.auto.resolve_auto), which also records its measurements here.
    mini_batch_size: int | None = None
    mini_batch_probe: dict | None = None
    # Token positions per mini-batch (rows x padded width, cembed.losses.token_budget); with it set it cuts
    # the mini-batches, not mini_batch_size. From batch.mini_batch_num_tokens, or the probe under auto.
    mini_batch_num_tokens: int | None = None
    save_dtype: str | None = None  # model.save_dtype as a torch name (bfloat16); None: the training dtype
    # Data-loader worker processes (train.dataloader_num_workers, auto resolved) and how it was decided.
    dataloader_num_workers: int = 0
    dataloader_workers: str = ""
    lora_merge: bool | None = None  # model.lora.merge; None: no LoRA (every weight trains)

    @property
    def contrast_rows(self) -> int:
        """Rows an anchor is contrasted with in one batch: the per-device batch, times the world size
        when the candidates are gathered across processes (``gather_across_devices``)."""
        return self.per_device_train_batch_size * (self.world_size if self.gather_across_devices else 1)

    tf32: bool = False  # TF32 on for fp32 matmuls (a CUDA GPU of compute capability 8.0+)
    precision_reason: str = ""  # how the precision was chosen, e.g. "bf16 (auto: NVIDIA H200 ... has bf16)"
    name_or_path: str = ""  # model.name_or_path (with the fields above: the ModelSpec, Plan.model)

    @property
    def model(self) -> ModelSpec:
        """The resolved model (device, precision, save dtype) as a :class:`ModelSpec`."""
        return ModelSpec(
            self.name_or_path, self.device, self.precision, self.save_dtype, self.tf32, self.precision_reason
        )

    def with_probe(
        self,
        mini_batch_size: int,
        mini_batch_num_tokens: int | None = None,
        probe: dict | None = None,
        warning: str | None = None,
    ) -> Plan:
        """This plan with the mini-batch that ``batch.mini_batch_size: auto`` resolved to: the
        mini-batch rows and token budget (None: none), the probe's run-summary record (None: no
        probe ran) and the probe's warning, added to ``warnings``.

        The only amendment of a plan after :func:`resolve_plan` (see the class docstring).
        """
        return replace(
            self,
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            mini_batch_probe=probe,
            warnings=self.warnings + ((warning,) if warning else ()),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    def config_as_run(self, cfg: CembedConfig) -> dict:
        """``cfg`` as JSON (a record of the run, e.g. ``run_summary.json``'s ``config``) with the values
        this plan resolved in place of those the config left to it: ``batch.per_device_train_batch_size``
        the rows each process trains (derived from ``batch.global_batch_size`` when that is set, not
        the schema's unused default) and ``batch.mini_batch_size`` / ``mini_batch_num_tokens`` the
        probed ones once ``auto`` is probed."""
        config = cfg.model_dump(mode="json")
        config["batch"]["per_device_train_batch_size"] = self.per_device_train_batch_size
        if self.mini_batch_size is not None:
            config["batch"].update(
                mini_batch_size=self.mini_batch_size, mini_batch_num_tokens=self.mini_batch_num_tokens
            )
        return config


def valid_world_sizes(global_batch_size: int, accumulation: int, min_per_device: int = 1) -> list[int]:
    """The process counts that split ``global_batch_size`` into equal per-device batches of at least
    ``min_per_device`` rows (a fixed ``mini_batch_size``): the divisors ``d`` of
    ``global_batch_size / accumulation`` with ``global / (accumulation x d) >= min_per_device``
    (empty when the accumulation does not divide it)."""
    if global_batch_size % accumulation:
        return []
    rows = global_batch_size // accumulation
    small = [d for d in range(1, math.isqrt(rows) + 1) if rows % d == 0]
    return sorted(d for d in set(small + [rows // d for d in small]) if rows // d >= min_per_device)


def _counts(sizes: list[int], limit: int = 12) -> str:
    shown = ", ".join(map(str, sizes[:limit]))
    return shown + (f", ... ({len(sizes)} in all)" if len(sizes) > limit else "")


def per_device_batch(batch: BatchConfig, world: int) -> int:
    """Rows per process per step: ``batch.per_device_train_batch_size``, or with
    ``batch.global_batch_size`` set, ``global / (world x gradient_accumulation_steps)``.

    Raises:
        UserError: the world size (times the accumulation) does not divide ``global_batch_size``
            (the message names the process counts that do), or the derived batch is smaller than
            ``mini_batch_size``.
    """
    if batch.global_batch_size is None:
        return batch.per_device_train_batch_size
    g, accumulation = batch.global_batch_size, batch.gradient_accumulation_steps
    mini = 1 if batch.mini_batch_size == "auto" else batch.mini_batch_size
    if g % (world * accumulation):
        valid = valid_world_sizes(g, accumulation, mini)
        fix = (
            f"run on {_counts(valid)} processes or change it"
            if valid
            else f"make it a multiple of batch.gradient_accumulation_steps ({accumulation})"
        )
        raise UserError(
            f"batch.global_batch_size={g} does not split over {world} process(es) x {accumulation} accumulation "
            f"step(s) into equal per-device batches; {fix}"
        )
    per_device = g // (world * accumulation)
    if mini > per_device:
        raise UserError(
            f"batch.mini_batch_size ({mini}) is larger than the per-device batch {per_device} "
            f"(batch.global_batch_size={g} over {world} process(es) x {accumulation} accumulation); "
            f"set it to at most {per_device}, or run on {_counts(valid_world_sizes(g, accumulation, mini))} processes"
        )
    return per_device


def resolve_plan(cfg: CembedConfig, world_size: int | None = None) -> Plan:
    """Resolve device, world size, samples per step and the effective LR for ``cfg``.

    Args:
        cfg: a validated config.
        world_size: number of training processes; defaults to ``$WORLD_SIZE`` or 1.

    ``gather_across_devices`` is ``loss.gather_across_devices``, or ``world_size > 1`` when unset.
    ``model.precision: auto`` becomes fp32 on CPU, bf16 on a GPU with bf16 (see :mod:`cembed.plan.precision`).
    The LR is scaled from the global samples per step (``per_device x world_size x accumulation``,
    or ``batch.global_batch_size``; the per-device batch is then derived by :func:`per_device_batch`).

    Raises:
        UserError: fp16 requested on CPU, bf16 on a GPU without bf16, cuda requested without a GPU,
            a world size below 1, or one that does not divide ``batch.global_batch_size``.
    """
    model = resolve_model(cfg.model)
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if world < 1:
        raise UserError(f"world size {world}: --nproc-per-node x --nnodes (or $WORLD_SIZE) must be at least 1")
    b, o = cfg.batch, cfg.optim
    per_device = per_device_batch(b, world)
    samples = per_device * world * b.gradient_accumulation_steps
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
            f"{per_device} rows of its own rank as negatives, not the whole global batch"
        )
    if world > 1 and not b.drop_last:
        warnings.append(
            f"batch.drop_last=false has no effect with {world} processes: every rank needs a full batch of the "
            "same size, so rows that cannot fill a whole global batch at the end of an epoch are left out"
        )
    n_columns = cfg.data.max_columns()  # the widest source: the worst case of a step
    workers, how, shm = resolve_workers(
        cfg.train.dataloader_num_workers,
        per_device,
        n_columns,
        cfg.model.max_seq_length,
        processes_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
    )
    warnings += [shm] if shm else []
    return Plan(
        device=model.device,
        world_size=world,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=b.gradient_accumulation_steps,
        samples_per_step=samples,
        global_batch_size=b.global_batch_size,
        learning_rate=scale_lr(o.learning_rate, o.base_batch_size, samples, o.lr_scaling),
        lr_derivation=derivation(o.learning_rate, o.base_batch_size, samples, o.lr_scaling),
        precision=model.precision,
        gather_across_devices=gather,
        warnings=tuple(warnings),
        mini_batch_size=None if b.mini_batch_size == "auto" else b.mini_batch_size,
        mini_batch_num_tokens=b.mini_batch_num_tokens,
        save_dtype=model.save_dtype,
        dataloader_num_workers=workers,
        dataloader_workers=how,
        lora_merge=cfg.model.lora.merge if cfg.model.lora is not None else None,
        tf32=model.tf32,
        precision_reason=model.precision_reason,
        name_or_path=model.name_or_path,
    )


SHM_PATH = "/dev/shm"
# Per token and text column, what the collator's batch holds: int64 input_ids, attention_mask and
# (BERT-style models) token_type_ids.
TOKEN_BYTES = 24
PREFETCH = 2  # batches each data-loader worker keeps in flight (torch's default prefetch_factor)
# train.dataloader_num_workers: auto uses workers from this many texts (rows x columns) per device
# batch: below it a batch is produced in the main process in tens of milliseconds.
AUTO_WORKERS_MIN_TEXTS = 8192
AUTO_WORKERS_MAX = 2  # a vectorised batch of 65536 x 256 takes ~1 s; two workers keep ahead of any step


def _shm_need(batch_rows: int, n_columns: int, max_seq_length: int | None, workers: int) -> tuple[int, int]:
    """(bytes of one batch at the widest padding, bytes of ``workers x PREFETCH`` such batches)."""
    per_batch = batch_rows * n_columns * (max_seq_length or 512) * TOKEN_BYTES
    return per_batch, per_batch * workers * PREFETCH


def _shm_size(path: str) -> int | None:
    try:
        return shutil.disk_usage(path).total
    except OSError:
        return None


def available_cpus() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def resolve_workers(
    setting: int | str,
    batch_rows: int,
    n_columns: int,
    max_seq_length: int | None,
    processes_per_node: int = 1,
    cpus: int | None = None,
    path: str = SHM_PATH,
) -> tuple[int, str, str | None]:
    """Decide ``train.dataloader_num_workers``.

    A number is kept (with :func:`shm_warning`'s warning when ``path`` is too small). ``auto``: 0
    when a device batch has fewer than :data:`AUTO_WORKERS_MIN_TEXTS` texts (rows x columns) or the
    node's cores (``cpus`` / ``processes_per_node``) leave none beside the training process; else
    ``min(AUTO_WORKERS_MAX, cores - 1)`` workers, each prefetching :data:`PREFETCH` batches, unless
    those batches (at the widest padding, :data:`TOKEN_BYTES` per token and column) would not fit in
    the shared memory at ``path``: then 0, with a warning naming the field.

    Args:
        setting: ``train.dataloader_num_workers`` (an int >= 0 or ``"auto"``).
        batch_rows: rows per device batch; n_columns: texts per row; max_seq_length: the width bound
            (None: 512 assumed).
        processes_per_node: training processes sharing this machine's cores.
        cpus: cores available (default :func:`available_cpus`).

    Returns:
        ``(workers, how it was decided, warning or None)``.
    """
    if setting != "auto":
        return (
            int(setting),
            f"{setting} (train.dataloader_num_workers)",
            shm_warning(batch_rows, n_columns, max_seq_length, int(setting), path),
        )
    texts = batch_rows * n_columns
    if texts < AUTO_WORKERS_MIN_TEXTS:
        return (
            0,
            f"auto: 0, batches of {texts} texts (< {AUTO_WORKERS_MIN_TEXTS}) are produced in the main process",
            None,
        )
    cores = max(1, (cpus or available_cpus()) // max(1, processes_per_node))
    if cores < 2:
        return 0, f"auto: 0, {cores} CPU core per training process leaves none for workers", None
    workers = min(AUTO_WORKERS_MAX, cores - 1)
    per_batch, need = _shm_need(batch_rows, n_columns, max_seq_length, workers)
    size = _shm_size(path)
    if size is not None and need > size:
        mib = 1024**2
        return (
            0,
            "auto: 0, shared memory too small for workers",
            f"train.dataloader_num_workers: auto uses 0 workers (batches are produced in the main process, the GPU "
            f"waits for each): {workers} workers x {PREFETCH} prefetched batches of up to {per_batch / mib:.0f} MiB "
            f"need {need / mib:.0f} MiB of shared memory, but {path} holds {size / mib:.0f} MiB. Enlarge it (docker "
            f"run --shm-size={-(-need // 1024**3) + 1}g) or set train.dataloader_num_workers to a number to use workers anyway",
        )
    return workers, f"auto: {workers}, batches of {texts} texts, {cores} CPU cores per training process", None


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
    per_batch, need = _shm_need(batch_rows, n_columns, max_seq_length, workers)
    size = _shm_size(path)
    if size is None or need <= size:
        return None
    mib = 1024**2
    return (
        f"train.dataloader_num_workers={workers}: a batch of {batch_rows} rows x {n_columns} columns x "
        f"{max_seq_length or 512} tokens is up to {per_batch / mib:.0f} MiB, and {workers} workers x {PREFETCH} "
        f"batches in flight need up to {need / mib:.0f} MiB of shared memory, but {path} holds {size / mib:.0f} "
        f"MiB: workers may die with 'Bus error'. Enlarge it (docker run --shm-size={-(-need // 1024**3) + 1}g, or "
        f"mount -o remount,size=... {path}) or set train.dataloader_num_workers: 0"
    )
