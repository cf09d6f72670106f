"""``cembed sweep``: the learning-rate search the sqrt rule starts.

The maintainers' advice after :func:`cembed.plan.lr.scale_lr` is to start at the scaled LR "and then
double or halve the value until I get the strongest results". :func:`run_sweep` does that loop with
short runs: the same config (same data order and seed) at the effective LR times each factor, each
trained for ``steps`` optimizer steps through :func:`cembed.train.recipe.run_training` and scored on
the config's eval sets after training; if the best factor is at an edge of the list, one more factor
beyond it (x2 above the largest, x0.5 below the smallest) is tried.

Trial bookkeeping is Optuna's (an RDB study in ``<out>/study.db``, sqlite): each factor is a trial
whose parameter ``factor`` is enqueued and asked; a finished (COMPLETE) trial is read back on a rerun
and not trained again, a trial left RUNNING by a killed process is marked FAIL and trained again.
One process runs a sweep at a time: a RUNNING trial found at the start is taken to be a dead one.

A study holds one sweep: the study records what its trials train and are scored on (:func:`sweep_record`:
the resolved config minus the LR factor and the fields of :data:`NOT_RECORDED`, plus ``--steps`` and a
hash of the rows of each training source and eval set, :func:`contents_record`, and of each local model
folder's files, :func:`files_record`; each trial carries its hash), and a rerun whose record differs is
refused naming each changed field, the data edited in place, or a model folder trained again in place
(read back, the old trials would be another config's, other rows' or other weights' scores). ``overwrite`` moves the old study and its runs aside, into
``<out>/study-<time>/``, and starts a fresh one.

Each trial's run is checked as ``cembed train`` checks it (:func:`cembed.train.recipe.check_run_inputs`,
then :func:`cembed.train.facts.run_facts`): the rows the no-duplicates sampler cannot place are handed
to the run as warnings (its ``run_summary.json`` records them) and kept in the trial's record
(``SweepTrial.warnings``, ``sweep.json``).

Because every LR rule is linear in ``optim.learning_rate`` (the LR at ``base_batch_size``), the
effective LR x factor is the effective LR of ``optim.learning_rate`` x factor; that config value is
the override the sweep recommends. Nothing here prints.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cembed.config.file import load_config
from cembed.data.batchable import load_checked_data
from cembed.data.batching.rules import predicted_by_placement
from cembed.errors import UserError
from cembed.eval.sets import load_eval_sets
from cembed.files import display_path, write_json_atomic
from cembed.plan.resolve import resolve_plan
from cembed.train.evaluation import check_metric_name, greater_is_better, headline_keys, metric_names
from cembed.train.facts import run_facts
from cembed.train.preflight import flatten
from cembed.train.recipe import check_run_inputs, run_training

STUDY_NAME = "lr-sweep"
DEFAULT_FACTORS = (0.5, 1.0, 2.0)


def _space():
    from optuna.distributions import FloatDistribution

    return {"factor": FloatDistribution(1e-6, 1e6, log=True)}  # every factor is enqueued, never sampled


def parse_factors(text: str | None) -> list[float]:
    """``--lr-factors`` (e.g. ``"0.5,1,2"``) as sorted distinct floats.

    Raises:
        UserError: empty, not a number, or not a positive finite number.
    """
    items = [s.strip() for s in (text or "").split(",") if s.strip()]
    if not items:
        raise UserError("--lr-factors is empty; give comma-separated positive factors, e.g. --lr-factors 0.5,1,2")
    factors = []
    for item in items:
        try:
            value = float(item)
        except ValueError:
            raise UserError(f"--lr-factors: {item!r} is not a number; e.g. --lr-factors 0.5,1,2") from None
        if not (value > 0 and math.isfinite(value)):
            raise UserError(f"--lr-factors: {item} is not a positive factor; e.g. --lr-factors 0.5,1,2")
        factors.append(value)
    return sorted(set(factors))


@dataclass
class SweepTrial:
    """One factor's short run."""

    factor: float
    learning_rate: float  # the effective LR the optimizer got (the plan's, x factor)
    config_learning_rate: float  # optim.learning_rate of the trial (the config's x factor)
    metric: float  # the sweep metric after training
    last_loss: float | None  # the last optimizer step's loss
    output_dir: str
    trained_now: bool  # False: a COMPLETE trial read back from the study
    edge: bool = False  # the extra factor beyond an edge
    # What the run found before training (RunFacts.warnings: rows the no-duplicates sampler cannot
    # place), handed to the run as `cembed train` hands them; also in its run_summary.json.
    warnings: list[str] = field(default_factory=list)


@dataclass
class SweepResult:
    """What :func:`run_sweep` found; :meth:`as_json` is ``sweep.json``."""

    metric: str
    greater_is_better: bool
    base_learning_rate: float  # the plan's effective LR (factor 1)
    base_config_learning_rate: float  # optim.learning_rate of the config
    lr_derivation: str
    steps: int
    trials: list[SweepTrial]  # sorted by factor
    best: SweepTrial
    out: Path
    metric_before: float | None = None  # the base model's metric (evaluated before every trial's training)
    storage: str = ""
    ran: list[float] = field(default_factory=list)  # factors trained by this call
    moved_aside: Path | None = None  # where overwrite moved the previous study and its runs

    @property
    def warnings(self) -> list[str]:
        """The trials' warnings, each once, in trial order (every trial trains the same rows)."""
        return list(dict.fromkeys(w for t in self.trials for w in t.warnings))

    @property
    def override(self) -> str:
        """The chosen LR as a config override (the value at ``optim.base_batch_size``)."""
        return f"optim.learning_rate={self.best.config_learning_rate:.6g}"

    def as_json(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "greater_is_better": self.greater_is_better,
            "metric_before_training": self.metric_before,
            "steps": self.steps,
            "base_learning_rate": self.base_learning_rate,
            "base_config_learning_rate": self.base_config_learning_rate,
            "lr_derivation": self.lr_derivation,
            "trials": [asdict(t) for t in self.trials],
            "best": asdict(self.best),
            "override": self.override,
            "warnings": self.warnings,
            "study": {"storage": self.storage, "name": STUDY_NAME},
            "trained_this_call": self.ran,
            "moved_aside": str(self.moved_aside) if self.moved_aside else None,
        }


def sweep_metric(cfg, metric: str | None, sets=None) -> tuple[str, bool]:
    """The metric trials are compared on and whether greater is better: ``metric`` (``--metric``),
    else ``eval.metric_for_best_model``, else the first set's headline metric (NDCG@10 / Spearman).
    ``sets``: the config's eval sets, loaded (None: loaded here).

    Raises:
        UserError: no eval sets in the config, or an unknown ``--metric`` (with the choices).
    """
    if cfg.eval is None:
        raise UserError(
            "eval: the config has no eval sets; sweep scores each trial on them: add an eval section "
            "(eval.retrieval or eval.sts)"
        )
    sets = sets if sets is not None else load_eval_sets(cfg.eval)
    if metric is not None:
        bare = metric.removeprefix("eval_")
        known = metric_names(sets, cfg.model.similarity)
        if bare not in known:
            raise UserError(f"--metric: {metric!r} is not a metric of the eval sets (e.g. {', '.join(known[:6])})")
        chosen = bare
    else:
        similarity = cfg.model.similarity  # the model kind's: retrieval metrics are keyed by it
        chosen = (
            check_metric_name(cfg.eval.metric_for_best_model, sets, similarity) or headline_keys(sets, similarity)[0]
        )
    return chosen, greater_is_better(chosen, cfg.eval.greater_is_better)


def _factor_key(factor: float) -> str:
    return f"{factor:.6g}"


def trial_overrides(config_lr: float, steps: int, run_dir: Path) -> list[str]:
    """A trial's overrides on top of the user's: its LR and length and folder; no checkpoints, no
    evaluation during training (only before and after), no trackers, no hub push."""
    return [
        f"optim.learning_rate={config_lr!r}",
        "train.num_train_epochs=null",
        f"train.max_steps={steps}",
        f"train.output_dir={run_dir.resolve()}",
        "train.save_steps=null",
        "train.push_to_hub=false",
        "train.report_to=[none]",
        "eval.eval_steps=null",
        "eval.metric_for_best_model=null",
    ]


# Fields that change neither what a trial trains nor how it is scored, each named (a field not listed,
# a new one included, is recorded): a rerun may change them and still read its trials back. A name
# covers the fields under it; ``data.train.<field>`` also stands for each of several sources' own.
NOT_RECORDED = (
    # what every trial's overrides set (trial_overrides; its length is --steps)
    "train.max_steps",
    "train.num_train_epochs",
    "train.save_steps",
    "train.push_to_hub",
    "train.report_to",
    "eval.eval_steps",
    "eval.metric_for_best_model",
    # where a run writes and what it keeps
    "train.output_dir",
    "train.save_total_limit",
    "train.save_every_minutes",
    "train.hub_model_id",
    "train.hub_private_repo",
    "eval.save_total_limit",
    "data.cache_dir",
    # how it logs
    "train.logging_steps",
    "train.peak_tflops",
    # how it runs: the same rows in the same batches for the same steps (memory, speed, processes)
    "model.device",
    "model.gradient_checkpointing",
    "batch.mini_batch_size",
    "batch.mini_batch_num_tokens",
    "batch.sort_by_length",
    "batch.pad_to_multiple_of",
    "batch.unpad",
    "train.dataloader_num_workers",
    "train.torch_compile",
    "data.pretokenize",
    "data.num_proc",
    "eval.batch_size",
    "distributed",
    # MaxSim's scoring tiles (cached_maxsim): the same scores in other tiles (issue 40: the result does
    # not depend on the tile sizes; tests/losses/test_maxsim_loss.py)
    "loss.score_query_tokens",
    "loss.score_document_tokens",
    "loss.score_document_rows",
    # and its kernel: a fused kernel is used only where it agrees with the tiled path (within a TF32 /
    # bf16 matmul's rounding, as batch.unpad's packed rows agree with padded ones)
    "loss.score_kernel",
    # columns declared not trained (dropped either way)
    "data.columns.ignore",
    "data.train.columns.ignore",
)


def not_recorded(field: str) -> bool:
    """Whether a dotted config field is left out of a sweep's record (:data:`NOT_RECORDED`)."""
    return any(field == name or field.startswith(name + ".") for name in NOT_RECORDED)


def _recorded_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The config dump's recorded fields, dotted; several sources' fields as ``data.train.<name>.<field>``."""
    data = dict(config["data"])
    train = data.pop("train")
    fields = {k: v for k, v in flatten({**config, "data": data}).items() if not not_recorded(k)}
    for source in train if isinstance(train, list) else [train]:
        prefix = f"data.train.{source['name']}" if isinstance(train, list) else "data.train"
        for key, value in flatten(source).items():
            if not not_recorded(f"data.train.{key}"):
                fields[f"{prefix}.{key}"] = value
    return fields


CONTENTS = " (contents)"  # the suffix of a record key that holds what a source or eval set holds


def contents_record(data, sets=None) -> dict[str, dict[str, str]]:
    """What a sweep's trials read, by content: each training source's rows as trained (after column
    mapping, ``max_samples`` and dropped rows; :func:`cembed.data.identity.rows_digest`) and each eval
    set's (:meth:`cembed.eval.sets.RetrievalSet.digest`), so that an edit in place of a file is seen.
    A streamed source holds only its first rows here (those checked): the rest is not read.

    Args:
        data: the :class:`cembed.data.rows.TrainingData` of the sweep's config.
        sets: its loaded eval sets (:class:`cembed.eval.sets.EvalSets`; None: none).

    Returns:
        ``{"<field> (contents)": {"source", "rows", "xxh3"}}``: a source by its config field
        (``data.train``, ``data.train.<name>``), an eval set as ``eval.<kind>.<set name>``.
    """
    from cembed.data.identity import rows_digest

    out: dict[str, dict[str, str]] = {}
    spans = [(s.key, s.label, s.offset, s.rows) for s in data.sources] or [("data.train", "", 0, len(data.dataset))]
    for key, label, offset, rows in spans:
        what = f"first {rows} rows (streamed)" if data.streamed is not None else f"{rows} rows"
        digest = rows_digest(data.dataset, offset, offset + rows)
        out[key + CONTENTS] = {"source": label, "rows": what, "xxh3": digest}
    for kind in ("retrieval", "sts"):
        for item in getattr(sets, kind, None) or []:
            out[f"eval.{kind}.{item.name}{CONTENTS}"] = {"source": item.path, "rows": item.size, "xxh3": item.digest()}
    return out


FILES = " (files)"  # the suffix of a record key that holds what a model folder holds


def files_record(cfg) -> dict[str, dict[str, str]]:
    """What a sweep's trials start from, by its files: each model the config names that is a local
    folder (``model.name_or_path``; the loss's ``model_paths``, such as ``cached_gist``'s guide) as a
    hash of its files' paths, sizes and modification times, so a folder trained again in place (the
    same path, other weights) is another sweep. A hub id is recorded by the snapshot of it in the local
    hub cache that loading it offline reads (``model.revision``, else the cache's ``main``: its folder
    names the commit), so a newer snapshot fetched since is another sweep; a hub id not in the cache is
    recorded by its name (and ``model.revision``) only. Nothing is read but the folders' listings.

    Returns:
        ``{"<field> (files)": {"source", "files", "xxh3"}}``: ``files`` as ``"N files, B bytes"``.
    """
    import xxhash

    from cembed.model.load import resolve_model_path

    named = {"model.name_or_path": cfg.model.name_or_path}
    named |= {f"loss.{f}": getattr(cfg.loss, f) for f in type(cfg.loss).model_paths if getattr(cfg.loss, f, None)}
    out: dict[str, dict[str, str]] = {}
    for key, name in named.items():
        if not isinstance(name, str):
            continue
        try:
            folder = Path(resolve_model_path(name))
        except UserError:  # a packaged name without its package: loading the model says so
            continue
        if not folder.is_dir():
            folder = _cached_snapshot(name, cfg.model.revision if key == "model.name_or_path" else None)
        if folder is None:
            continue
        digest, count, size = xxhash.xxh3_64(), 0, 0
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            stat = path.stat()
            digest.update(f"{path.relative_to(folder).as_posix()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
            count, size = count + 1, size + stat.st_size
        out[key + FILES] = {"source": str(folder), "files": f"{count} files, {size} bytes", "xxh3": digest.hexdigest()}
    return out


def _cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The folder of ``repo_id``'s snapshot at ``revision`` (None: ``main``) in the local hub cache
    (``.../models--org--name/snapshots/<commit>``), read without the network; None when it is not
    cached or ``repo_id`` is not a hub id."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # not cached, or not a repo id: recorded by its name
        return None


def sweep_record(cfg, precision: str, steps: int, contents: dict[str, dict[str, str]] | None = None) -> dict[str, Any]:
    """What every trial of a sweep trains and is scored on, minus its LR factor: the resolved config
    flattened to dotted fields (``optim.learning_rate`` is the base LR the factors multiply;
    ``model.precision`` as resolved, so ``auto`` equals what it chose), without :data:`NOT_RECORDED`,
    plus ``--steps``, the data's ``contents`` (:func:`contents_record`) and the model folders' files
    (:func:`files_record`). Two runs with equal records train the same trial at each factor and score
    it on the same sets."""
    config = cfg.model_dump(mode="json")
    config["model"]["precision"] = precision
    return {**_recorded_fields(config), "--steps": steps, **(contents or {}), **files_record(cfg)}


def record_fingerprint(record: dict[str, Any]) -> str:
    """A short hash of a :func:`sweep_record` (stored with each trial)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _shown(value: Any) -> str:
    return "unset" if value is None else value if isinstance(value, str) else json.dumps(value)


def record_differences(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(field, old value, new value)`` for each field two :func:`sweep_record` s differ in, sorted."""
    return [(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def check_study_record(study, record: dict[str, Any], db: Path) -> None:
    """Store ``record`` in a new study; refuse a study another config ran.

    Raises:
        UserError: the study's record differs (naming each field: its old and new value), or it has
            finished trials and no record (an older cembed's study).
    """
    from optuna.trial import TrialState

    fix = "use a new --out or --overwrite to move the old study aside"
    old = study.user_attrs.get("record")
    if old is None:
        if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            raise UserError(f"sweep: {display_path(db)} holds trials without a record of the config they ran; {fix}")
        study.set_user_attr("record", record)
        study.set_user_attr("fingerprint", record_fingerprint(record))
        return
    changed = [c for c in record_differences(old, record) if not c[0].endswith((CONTENTS, FILES))]
    if changed:
        was = ", ".join(f"{k}={_shown(a)}" for k, a, _ in changed)
        now = ", ".join(f"{k}={_shown(b)}" if len(changed) > 1 else _shown(b) for k, _, b in changed)
        raise UserError(f"sweep: {display_path(db)} was run with {was}, this config has {now}; {fix}")
    contents = [c for c in record_differences(old, record) if c[0].endswith(CONTENTS)]
    if contents and not any(key.endswith(CONTENTS) for key in old):
        raise UserError(
            f"sweep: {display_path(db)} holds trials without a record of the data they trained on (an older "
            f"cembed); {fix}"
        )
    if contents:
        raise UserError(f"sweep: {display_path(db)} was run on other data: {_contents_change(*contents[0])}; {fix}")
    files = [c for c in record_differences(old, record) if c[0].endswith(FILES)]
    if files and not any(key.endswith(FILES) for key in old):
        raise UserError(
            f"sweep: {display_path(db)} holds trials without a record of the model files they trained from (an "
            f"older cembed); {fix}"
        )
    if files:
        raise UserError(f"sweep: {display_path(db)} was run on another model: {_files_change(*files[0])}; {fix}")


def _contents_change(key: str, old: dict | None, new: dict | None) -> str:
    """One source's or eval set's change of contents, in words (the record keeps the full hashes)."""
    field = key.removesuffix(CONTENTS)
    item = new or old or {}
    where = f"{field} ({display_path(item['source'])})" if item.get("source") else field

    def held(entry: dict | None) -> str:
        return f"{entry['rows']} (xxh3 {entry['xxh3'][:8]})" if entry else "nothing recorded"

    return f"{where} held {held(old)} and holds {held(new)} now (edited in place?): its trials scored the old rows"


def _files_change(key: str, old: dict | None, new: dict | None) -> str:
    """One model folder's change of files, in words (the record keeps the full hashes)."""
    field = key.removesuffix(FILES)
    item = new or old or {}

    def held(entry: dict | None) -> str:
        return f"{entry['files']} (xxh3 {entry['xxh3'][:8]})" if entry else "no folder"

    if old and new and old.get("source") != new.get("source"):  # a hub id resolved to another cached snapshot
        return (
            f"{field} was read from {display_path(old['source'])} and is read from {display_path(new['source'])} "
            "now (another snapshot?): its trials trained the old weights"
        )
    where = f"{field} ({display_path(item['source'])})" if item.get("source") else field
    return (
        f"{where} held {held(old)} and holds {held(new)} now (retrained in place?): its trials trained the old weights"
    )


SWEEP_FILES = ("study.db", "sweep.json", "sweep.png")


def move_study_aside(out: Path) -> Path | None:
    """Move a previous sweep in ``out`` (its study, sweep.json, plot and ``factor-*`` runs) into a new
    ``out/study-<YYYYmmdd-HHMMSS>`` folder, kept rather than deleted; None when ``out`` holds no study."""
    if not (out / "study.db").exists():
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = out / f"study-{stamp}", 1
    while aside.exists():  # two overwrites within a second
        aside, n = out / f"study-{stamp}-{n}", n + 1
    aside.mkdir()
    for path in [*(out / name for name in SWEEP_FILES), *sorted(out.glob("factor-*"))]:
        if path.exists():
            path.rename(aside / path.name)
    return aside


def open_study(storage: str, greater: bool):
    """The sweep's Optuna study in ``storage`` (created or loaded); a trial left RUNNING by a killed
    sweep is marked FAIL so that its factor is trained again."""
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        storage=storage, study_name=STUDY_NAME, direction="maximize" if greater else "minimize", load_if_exists=True
    )
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(t.number, state=TrialState.FAIL)
    return study


def sweep_study(out: Path, greater: bool, record: dict[str, Any], overwrite: bool):
    """The sweep's study in ``out/study.db`` (:func:`open_study`; with ``overwrite`` a previous one is
    moved aside first, :func:`move_study_aside`) checked against this sweep's ``record``
    (:func:`check_study_record`).

    Returns:
        ``(study, storage URL, the record's fingerprint, the folder moved aside or None)``.

    Raises:
        UserError: the study was run by another config.
    """
    moved = move_study_aside(out) if overwrite else None
    storage = f"sqlite:///{(out / 'study.db').resolve()}"
    study = open_study(storage, greater)
    check_study_record(study, record, out / "study.db")
    return study, storage, record_fingerprint(record), moved


def completed_trials(study, metric: str, steps: int, fingerprint: str) -> dict[str, SweepTrial]:
    """The study's COMPLETE trials of this metric, length and :func:`record_fingerprint`, by factor
    (``_factor_key``)."""
    from optuna.trial import TrialState

    done: dict[str, SweepTrial] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        a = t.user_attrs
        if a.get("metric_name") != metric or a.get("steps") != steps or a.get("fingerprint") != fingerprint:
            continue  # a trial of another metric, length or config is not this sweep's
        done[_factor_key(t.params["factor"])] = SweepTrial(
            factor=t.params["factor"],
            learning_rate=a["learning_rate"],
            config_learning_rate=a["config_learning_rate"],
            metric=t.value,
            last_loss=a.get("last_loss"),
            output_dir=a["output_dir"],
            trained_now=False,
            edge=a.get("edge", False),
            warnings=list(a.get("warnings", [])),
        )
    return done


def record_trial(study, trial, result: SweepTrial, metric: str, steps: int, fingerprint: str) -> None:
    """Store a finished trial: what :func:`completed_trials` reads back as user attributes, the
    metric as its value (COMPLETE)."""
    attrs = {k: v for k, v in asdict(result).items() if k not in ("factor", "metric", "trained_now")}
    for name, value in {**attrs, "metric_name": metric, "steps": steps, "fingerprint": fingerprint}.items():
        trial.set_user_attr(name, value)
    study.tell(trial, result.metric)


def sweep_inputs(cfg, metric: str | None, steps: int):
    """What a sweep of ``cfg`` compares and records before any trial: the metric and its direction
    (:func:`sweep_metric`), the plan, and the study's record (:func:`sweep_record`) with the contents of
    the training rows and eval sets, read now (:func:`contents_record`): a study's trials are read back
    only for the same rows.

    Returns:
        ``(metric, greater_is_better, plan, record)``.

    Raises:
        UserError: no eval sets, an unknown metric, a mistake in the data (as ``cembed train`` says it).
    """
    sets = load_eval_sets(cfg.eval) if cfg.eval is not None else None
    chosen, greater = sweep_metric(cfg, metric, sets)
    plan = resolve_plan(cfg)
    batch = plan.per_device_train_batch_size * plan.world_size
    data = load_checked_data(cfg.data, batch, predicted_by_placement(cfg.sampler))
    return chosen, greater, plan, sweep_record(cfg, plan.precision, steps, contents_record(data, sets))


def run_sweep(
    config: str | Path,
    factors: list[float],
    steps: int,
    out: str | Path | None = None,
    metric: str | None = None,
    overrides: list[str] | None = None,
    on_trial: Callable[[str, float, float], None] | None = None,
    overwrite: bool = False,
) -> SweepResult:
    """Train ``config`` for ``steps`` steps at the effective LR x each factor and score each run.

    Args:
        config: the YAML config (``overrides`` applied to it, then the sweep's own: LR, steps,
            output folder; no checkpoints, no evaluation during training, no trackers, no hub push).
        factors: positive LR factors (see :func:`parse_factors`).
        steps: optimizer steps per trial (> 0).
        out: the sweep's folder (default ``<train.output_dir>-lr-sweep``): ``study.db``, one
            ``factor-<f>`` run folder per trial; the caller writes ``sweep.json`` and the plot there.
        metric: the metric to compare (see :func:`sweep_metric`).
        on_trial: called ``(event, factor, effective_lr)`` with ``"start"`` / ``"done"`` / ``"cached"``.
        overwrite: move a previous study in ``out`` aside (:func:`move_study_aside`) and start afresh;
            without it a study another config ran (:func:`sweep_record`) is refused.

    Returns:
        The :class:`SweepResult`, trials sorted by factor.

    Raises:
        UserError: no eval sets, unknown metric, bad steps, a study of another config in ``out``
            (naming each changed field), or a config mistake of a trial.
        RunFailed, RunInterrupted, KeyboardInterrupt: a trial's; the trial is marked FAIL in the study
            and trained again by the next call.
    """
    from optuna.trial import TrialState

    if steps < 1 or not factors:
        raise UserError(
            f"--steps must be at least 1 (got {steps})" if steps < 1 else "--lr-factors is empty; e.g. 0.5,1,2"
        )
    overrides = list(overrides or [])
    cfg = load_config(config, overrides)
    chosen, greater, plan, record = sweep_inputs(cfg, metric, steps)
    out = Path(out) if out is not None else Path(f"{cfg.train.output_dir.rstrip('/')}-lr-sweep")
    out.mkdir(parents=True, exist_ok=True)
    study, storage, fingerprint, moved = sweep_study(out, greater, record, overwrite)
    done = completed_trials(study, chosen, steps, fingerprint)
    ran: list[float] = []

    def trial_for(factor: float, edge: bool = False) -> SweepTrial:
        key = _factor_key(factor)
        if key in done:
            if on_trial:
                on_trial("cached", factor, done[key].learning_rate)
            return done[key]
        run_dir = out / f"factor-{key}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a killed trial's half-written run starts over
        lr_value = cfg.optim.learning_rate * factor
        trial_cfg = load_config(config, [*overrides, *trial_overrides(lr_value, steps, run_dir)])
        study.enqueue_trial({"factor": factor})
        trial = study.ask(_space())
        try:
            trial_plan, data = check_run_inputs(trial_cfg)
            facts = run_facts(trial_cfg, trial_plan, data)
            if on_trial:
                on_trial("start", factor, trial_plan.learning_rate)
            summary = run_training(trial_cfg, trial_plan, data, warnings=facts.warnings)
        except BaseException:
            study.tell(trial, state=TrialState.FAIL)
            raise
        losses = summary.get("step_losses") or []
        result = SweepTrial(
            factor=factor,
            learning_rate=trial_plan.learning_rate,
            config_learning_rate=lr_value,
            metric=float(summary["eval"]["after"][chosen]),
            last_loss=float(losses[-1][1]) if losses else summary.get("last_loss"),
            output_dir=str(run_dir),
            trained_now=True,
            edge=edge,
            warnings=list(facts.warnings),
        )
        if summary["eval"].get("before"):  # the base model's score: the same for every trial; kept for reruns
            study.set_user_attr(f"before:{chosen}", float(summary["eval"]["before"][chosen]))
        record_trial(study, trial, result, chosen, steps, fingerprint)
        done[key] = result
        ran.append(factor)
        if on_trial:
            on_trial("done", factor, result.learning_rate)
        return result

    def best_of(trials: list[SweepTrial]) -> SweepTrial:
        return (max if greater else min)(trials, key=lambda t: t.metric)

    trials = [trial_for(f) for f in factors]
    best = best_of(trials)
    if len(factors) > 1 and best.factor in (factors[0], factors[-1]):
        beyond = best.factor * (2.0 if best.factor == factors[-1] else 0.5)
        trials.append(trial_for(beyond, edge=True))
        best = best_of(trials)
    return SweepResult(
        metric=chosen,
        greater_is_better=greater,
        base_learning_rate=plan.learning_rate,
        base_config_learning_rate=cfg.optim.learning_rate,
        lr_derivation=plan.lr_derivation,
        steps=steps,
        trials=sorted(trials, key=lambda t: t.factor),
        best=best,
        out=out,
        metric_before=study.user_attrs.get(f"before:{chosen}"),
        storage=storage,
        ran=ran,
        moved_aside=moved,
    )


def write_sweep(result: SweepResult) -> tuple[Path, Path | None]:
    """Write ``sweep.json`` and ``sweep.png`` into the sweep's folder; returns both paths."""
    path = result.out / "sweep.json"
    data = result.as_json()
    plot = plot_sweep(result, result.out / "sweep.png")
    data["plot"] = str(plot) if plot else None
    write_json_atomic(path, data)
    return path, plot


def plot_sweep(result: SweepResult, path: str | Path) -> Path | None:
    """A PNG of the metric against the effective LR (log x), the best trial marked and the base
    model's metric as a dashed line; None without trials."""
    if not result.trials:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = [t.learning_rate for t in result.trials]
    values = [t.metric for t in result.trials]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(lrs, values, marker="o", color="tab:blue", label="after training")
    ax.plot([result.best.learning_rate], [result.best.metric], "*", color="tab:red", markersize=14, label="best")
    for t in result.trials:
        ax.annotate(f"x{t.factor:g}", (t.learning_rate, t.metric), textcoords="offset points", xytext=(0, 6))
    if result.metric_before is not None:
        ax.axhline(result.metric_before, color="gray", linestyle="--", label="before training")
    ax.set_xscale("log")
    ax.margins(x=0.08, y=0.15)  # room for the factor labels above the points
    ax.set_xlabel("effective learning rate")
    ax.set_ylabel(result.metric)
    ax.set_title(f"LR sweep: {result.steps} steps per trial")
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
