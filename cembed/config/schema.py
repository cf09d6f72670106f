"""The config schema: one strict pydantic model per YAML section.

Unknown keys are refused (``extra="forbid"``); :mod:`cembed.config.file` turns a YAML file plus
overrides into a :class:`CembedConfig` and every validation error into a message naming the file,
line and dotted field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from cembed.config.base import Strict as _Strict

# The data and loss sections live in their own modules (cembed.config.data, cembed.config.loss).
from cembed.config.data import DataConfig, streaming_conflict
from cembed.config.loss import (
    DEFAULT_LOSS,
    CachedMNRLLossConfig,
    LossConfig,
    loss_config_class,
)

# The model section lives in cembed.config.model (with the model kinds); named here as before.
from cembed.config.model import (
    DEFAULT_KIND,
    MODEL_CONFIGS,
    OUTPUT_WORDS,
    DenseModelConfig,
    LoraOptions,  # noqa: F401 - re-exported: cembed.config.schema.LoraOptions
    ModelConfig,
    model_config_class,
)

SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "warmup_stable_decay",
)


class BatchConfig(_Strict):
    per_device_train_batch_size: PositiveInt = 64  # rows per process per step: the in-batch negatives
    # Samples per optimizer step over all processes, instead of per_device_train_batch_size: the
    # per-device batch is then global / (world size x accumulation), so any GPU count trains the same
    # global batch (cembed.plan.resolve.per_device_batch). Set one of the two.
    global_batch_size: PositiveInt | None = None
    mini_batch_size: PositiveInt | Literal["auto"] = 32  # auto: `cembed train` probes it first
    gradient_accumulation_steps: PositiveInt = 1  # batches per optimizer step (each its own contrastive batch)
    drop_last: bool = True  # drop the last, smaller batch of an epoch (fewer in-batch negatives)
    mini_batch_num_tokens: PositiveInt | None = None  # token budget: rows x padded width per mini-batch
    sort_by_length: bool = True  # sort each column by length before cutting mini-batches
    # Pad each batch's width up to a multiple of this (at most model.max_seq_length): fewer distinct
    # shapes, e.g. for train.torch_compile. None: the longest row. Needs data.pretokenize (cembed's collator).
    pad_to_multiple_of: PositiveInt | None = None
    # pack each cached-loss mini-batch's rows without padding: auto where the model supports it
    # (cembed.model.unpad.resolve_unpad), true (refuse a model that does not), false (sorted padding)
    unpad: Literal["auto"] | bool = "auto"

    @field_validator("mini_batch_size", mode="before")
    @classmethod
    def _auto_or_positive(cls, value: Any) -> Any:
        # One clear message instead of pydantic's two union-branch errors.
        if value == "auto":
            return value
        try:
            return TypeAdapter(PositiveInt).validate_python(value)
        except ValidationError as err:
            raise ValueError(f"{err.errors()[0]['msg']}, or auto (run the probe)") from None

    @model_validator(mode="after")
    def _mini_le_batch(self) -> BatchConfig:
        if self.global_batch_size is not None:
            if "per_device_train_batch_size" in self.model_fields_set:
                raise ValueError(
                    f"global_batch_size ({self.global_batch_size}) and per_device_train_batch_size "
                    f"({self.per_device_train_batch_size}) are both set; keep one (the other follows from the world size)"
                )
            return self  # the mini-batch is checked against the per-device batch the plan derives
        if self.mini_batch_size != "auto" and self.mini_batch_size > self.per_device_train_batch_size:
            raise ValueError(
                f"mini_batch_size ({self.mini_batch_size}) is larger than per_device_train_batch_size "
                f"({self.per_device_train_batch_size}); set it to at most the batch size"
            )
        return self


class OptimConfig(_Strict):
    learning_rate: PositiveFloat = 2e-5  # the LR at base_batch_size; scaled to the effective batch by lr_scaling
    base_batch_size: PositiveInt = 32  # the batch size learning_rate was tuned for
    lr_scaling: Literal["sqrt", "linear", "none"] = "sqrt"  # LR x sqrt or x (effective batch / base_batch_size)
    warmup_ratio: float = Field(0.1, ge=0.0, lt=1.0)  # share of the optimizer steps spent warming up
    weight_decay: float = Field(0.01, ge=0.0)  # AdamW weight decay
    lr_scheduler_type: Literal[SCHEDULERS] = "linear"  # the trainer's LR schedule  # type: ignore[valid-type]
    # Extra arguments of the scheduler, e.g. {num_decay_steps: 100} (warmup_stable_decay), {lr_end: 1e-8}
    # (polynomial); checked before training (cembed.train.preflight).
    lr_scheduler_kwargs: dict[str, Any] = Field(default_factory=dict)


class SamplerConfig(_Strict):
    no_duplicates: bool = True  # never put one text twice in a batch (it would be its own false negative)
    rule: str = Field(
        "no_duplicates",
        min_length=1,
        description="how batches are drawn: no_duplicates (the full-table sampler; with no_duplicates: false, "
        "shuffled batches) or a rule a plugin registers (cembed.data.batching.rules)",
    )


class DistributedConfig(_Strict):
    # Process-group timeout: how long a rank waits in a collective for the others (NCCL's default is 10 min).
    timeout_minutes: PositiveFloat = 60.0
    # ddp: every rank holds the whole model; fsdp: parameters, gradients and optimizer state sharded
    # across ranks (torch FSDP2 `fully_shard` through accelerate), for models one GPU cannot hold.
    strategy: Literal["ddp", "fsdp"] = "ddp"


REPORT_TO = (
    "none",
    "all",
    "tensorboard",
    "trackio",
    "wandb",
    "mlflow",
    "comet_ml",
    "clearml",
    "neptune",
    "dvclive",
    "swanlab",
)


class TrainConfig(_Strict):
    num_train_epochs: PositiveFloat | None = None  # passes over the data (set this or max_steps)
    max_steps: PositiveInt | None = None  # optimizer steps (set this or num_train_epochs, not both)
    seed: int = 42  # seeds the sampler, dropout and initialisation
    output_dir: str = "runs/cembed"  # the model, checkpoints, run_summary.json and training_curves.png
    logging_steps: PositiveInt = 10  # optimizer steps between logged losses and throughput
    save_steps: PositiveInt | None = (
        None  # optimizer steps between checkpoints (None: no checkpoints, only the final model)
    )
    save_total_limit: PositiveInt | None = None  # keep at most this many checkpoints
    # Also save when this many minutes of wall time passed since the last save (preemptible machines).
    save_every_minutes: PositiveFloat | None = None
    # Seconds a stop signal (SIGTERM, SIGUSR1, Ctrl-C) leaves before the process is killed: a signal during or
    # after the last step finishes the run (final model, evaluation, summary) when that fits, else it
    # stops where --resume finishes it. 90: Slurm's --signal=TERM@120 (or USR1@120) less a margin.
    stop_grace_seconds: PositiveFloat = 90.0
    nonfinite_loss: Literal["stop", "skip"] = "stop"  # on a NaN/inf loss: stop, or skip the step and count it
    # Processes producing batches ahead of the training loop; auto: workers for large batches when the
    # machine has a core to spare and /dev/shm holds their batches, else 0 (cembed.plan.resolve.resolve_workers).
    dataloader_num_workers: NonNegativeInt | Literal["auto"] = "auto"
    # The device's dense peak in TFLOP/s for the meter's MFU (default: cembed.train.flops.PEAKS by GPU name).
    peak_tflops: float | None = Field(None, gt=0)
    # torch.compile the model (the trainer's torch_compile, inductor). Each new padded length compiles
    # again: pair it with batch.pad_to_multiple_of to bound the lengths. Off: measured slower on CPU.
    torch_compile: bool = False
    # Experiment trackers, through the trainer's own integrations (each needs its package installed).
    report_to: list[Literal[REPORT_TO]] = Field(default_factory=lambda: ["none"])  # type: ignore[valid-type]
    # Publishing through the trainer: checkpoints as they are saved, the final model folder at the end.
    push_to_hub: bool = False
    hub_model_id: str | None = None  # the hub repo, e.g. your-name/minilm-coco (needed by push_to_hub)
    hub_private_repo: bool | None = None  # create the repo private (None: the hub's default)

    @field_validator("dataloader_num_workers", mode="before")
    @classmethod
    def _auto_or_count(cls, value: Any) -> Any:
        # One clear message instead of pydantic's two union-branch errors.
        if value == "auto":
            return value
        try:
            return TypeAdapter(NonNegativeInt).validate_python(value)
        except ValidationError as err:
            raise ValueError(f"{err.errors()[0]['msg']}, or auto (workers for large batches)") from None

    @model_validator(mode="before")
    @classmethod
    def _report_to_list(cls, data: Any) -> Any:
        # `report_to: tensorboard` is shorthand for `report_to: [tensorboard]`.
        if isinstance(data, dict) and isinstance(data.get("report_to"), str):
            data = {**data, "report_to": [data["report_to"]]}
        return data

    @model_validator(mode="after")
    def _one_length(self) -> TrainConfig:
        # Both set: the trainer would stop at max_steps and silently ignore the epochs, so neither
        # reading is safe to guess; the user keeps the one they mean.
        if self.num_train_epochs is not None and self.max_steps is not None:
            raise ValueError(
                f"num_train_epochs ({self.num_train_epochs:g}) and max_steps ({self.max_steps}) are both set; "
                "max_steps would win and the epochs be ignored: keep one (e.g. train.num_train_epochs=null)"
            )
        if self.num_train_epochs is None and self.max_steps is None:
            self.__dict__["num_train_epochs"] = 1.0
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError(
                "push_to_hub: true needs train.hub_model_id, the hub repo to publish to (e.g. your-name/minilm-coco)"
            )
        return self


class RetrievalEvalSet(_Strict):
    """A BEIR folder (corpus.jsonl[.gz], queries.jsonl, qrels/<split>.tsv) and the qrels split."""

    path: str
    split: str = "test"
    name: str | None = None  # metric prefix; default <folder name>-<split>


class StsEvalSet(_Strict):
    """An STS file: STS Benchmark TSV, 3-column TSV (sentence1, sentence2, score) or JSONL."""

    path: str
    name: str | None = None  # metric prefix; default the file name without extension


class EvalConfig(_Strict):
    """Evaluation before, during (every ``eval_steps``) and after training."""

    retrieval: list[RetrievalEvalSet] = Field(default_factory=list)
    sts: list[StsEvalSet] = Field(default_factory=list)
    eval_steps: PositiveInt | None = None  # None: evaluate only before and after training
    metric_for_best_model: str | None = None  # e.g. scifact-test_cosine_ndcg@10; keeps the best checkpoint
    greater_is_better: bool | None = None  # default: False for a loss, True otherwise
    save_total_limit: PositiveInt | None = 2  # checkpoints kept; the best one is never deleted
    batch_size: PositiveInt = 32  # encoding batch size

    @model_validator(mode="before")
    @classmethod
    def _path_shorthand(cls, data: Any) -> Any:
        # `retrieval: dir` / `sts: [file, ...]` are shorthand for {path: ...} entries.
        if isinstance(data, dict):
            data = dict(data)
            for key in ("retrieval", "sts"):
                value = data.get(key)
                if isinstance(value, (str, dict)):
                    value = [value]
                if isinstance(value, list):
                    data[key] = [{"path": v} if isinstance(v, str) else v for v in value]
        return data

    @model_validator(mode="after")
    def _consistent(self) -> EvalConfig:
        if not self.retrieval and not self.sts:
            raise ValueError("the eval section needs at least one 'retrieval' folder or 'sts' file")
        if self.metric_for_best_model is not None and self.eval_steps is None:
            raise ValueError("metric_for_best_model needs eval_steps (checkpoints are compared at each evaluation)")
        return self


class CembedConfig(_Strict):
    """The whole config file. Every section has defaults except ``data.train``."""

    model: SerializeAsAny[ModelConfig] = Field(default_factory=DenseModelConfig)
    data: DataConfig
    batch: BatchConfig = Field(default_factory=BatchConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    loss: SerializeAsAny[LossConfig] = Field(default_factory=CachedMNRLLossConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig | None = None
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    @model_validator(mode="before")
    @classmethod
    def _kind_default_loss(cls, data: Any) -> Any:
        # A config that names no loss trains with its model kind's default loss (cached_mnrl for dense).
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            return data
        kind_cls = MODEL_CONFIGS.get(data["model"].get("kind", DEFAULT_KIND))
        if kind_cls is None or kind_cls.default_loss == DEFAULT_LOSS:
            return data
        loss = data.get("loss")
        if loss is None:
            return {**data, "loss": {"name": kind_cls.default_loss}}
        if isinstance(loss, dict) and "name" not in loss:
            return {**data, "loss": {**loss, "name": kind_cls.default_loss}}
        return data

    @field_validator("model", mode="before")
    @classmethod
    def _model_class(cls, value: Any) -> Any:
        # `model.kind` picks the registered class, which then validates (only) its own fields.
        if not isinstance(value, dict):
            return value
        kind = value.get("kind", DEFAULT_KIND)
        try:
            model_cls = model_config_class(kind)
        except ValueError as err:
            raise ValidationError.from_exception_data(
                "ModelConfig", [{"type": "value_error", "loc": ("kind",), "input": kind, "ctx": {"error": err}}]
            ) from None
        return model_cls.model_validate(value)

    @field_validator("loss", mode="before")
    @classmethod
    def _loss_class(cls, value: Any) -> Any:
        # `loss.name` picks the registered class, which then validates (only) its own fields; its
        # errors keep their location (loss.<field>).
        if not isinstance(value, dict):
            return value
        name = value.get("name", DEFAULT_LOSS)
        try:
            loss_cls = loss_config_class(name)
        except ValueError as err:
            raise ValidationError.from_exception_data(
                "LossConfig", [{"type": "value_error", "loc": ("name",), "input": name, "ctx": {"error": err}}]
            ) from None
        return loss_cls.model_validate(value)

    @model_validator(mode="after")
    def _kind_takes(self) -> CembedConfig:
        # What the model kind cannot train: a loss that needs another output, options it does not take.
        kind, loss = self.model.kind, type(self.loss)
        problems = list(self.model.conflicts(self))
        if type(self.model).output not in loss.consumes:
            makes = OUTPUT_WORDS[type(self.model).output]
            trains = " or ".join(OUTPUT_WORDS.get(o, o) for o in sorted(loss.consumes))
            problems.insert(
                0,
                (
                    "loss.name",
                    f"{self.loss.name} trains a model that makes {trains}, but model.kind {kind} makes {makes}; "
                    f"use loss.name {type(self.model).default_loss} (model.kind {kind}'s loss)",
                ),
            )
        if problems:
            raise ValidationError.from_exception_data(
                "CembedConfig",
                [
                    {
                        "type": "value_error",
                        "loc": tuple(field.split(".")),
                        "input": _value_at(self, field),
                        "ctx": {"error": ValueError(why)},
                    }
                    for field, why in problems
                ],
            )
        return self

    @model_validator(mode="after")
    def _streaming(self) -> CembedConfig:
        # What a streamed source (data.train.streaming) cannot do, checked before any data is read.
        problem = streaming_conflict(
            self.data,
            self.train.max_steps,
            self.train.dataloader_num_workers,
            self.sampler.no_duplicates,
            self.sampler.rule,
        )
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _compile_and_unpad(self) -> CembedConfig:
        # A compiled forward does not enter the packing hooks (measured: scripts/bench_compile.py gave
        # the padded path's numbers), so train.torch_compile trains padded mini-batches.
        if self.train.torch_compile and self.batch.unpad is True:
            raise ValueError(
                "batch.unpad: true cannot run with train.torch_compile: true (the compiled forward bypasses "
                "the packing hooks); set batch.unpad: auto (padded under compile) or train.torch_compile: false"
            )
        return self


def _value_at(config: CembedConfig, dotted: str) -> Any:
    """The value at ``section.field`` of ``config`` (None where there is none), for an error's "got"; ``{}``
    for a value that is not a number, text or flag."""
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part, None)
    # A section or a list is not shown (the error formatter leaves out a mapping's "got").
    return value if isinstance(value, (str, int, float, bool)) or value is None else {}
