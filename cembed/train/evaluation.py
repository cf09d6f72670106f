"""Evaluation during training: the config's ``eval`` section turned into what the trainer needs.

:class:`TrainingEvaluation` loads the sets (:func:`cembed.eval.sets.load_eval_sets`) and builds one
evaluator for ``SentenceTransformerTrainer`` (:func:`build_training_evaluator`: the evaluators of
:mod:`cembed.eval.evaluators` in a ``SequentialEvaluator``), the training-argument overrides
(:func:`training_eval_args`: eval steps, the best checkpoint by ``eval.metric_for_best_model``) and a
callback recording every evaluation (:class:`EvalLogCallback`). The trainer logs the metrics
(prefixed ``eval_``) next to the training loss and to the trackers in ``train.report_to``. The
evaluations before and after training go through :meth:`TrainingEvaluation.evaluate`; before
training (the base model's weights) the corpus embeddings are cached. Nothing here prints: lines go
to an ``on_line`` callable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from cembed.errors import UserError
from cembed.eval.evaluators import (
    STS_HEADLINE,
    evaluate_retrieval,
    evaluate_sts,
    retrieval_evaluator,
    retrieval_headline,
    sts_evaluator,
)
from cembed.eval.sets import EvalSets, load_eval_sets
from cembed.model.fingerprint import model_fingerprint

LineFn = Callable[[str], None]  # receives one finished text line to show


def build_training_evaluator(sets: EvalSets, batch_size: int = 32, prompts=None, similarity: str = "cosine"):
    """One evaluator for the trainer: the sets' evaluators in a ``SequentialEvaluator`` (metrics of
    all sets, each prefixed by its set name; retrieval ``prompts`` and ``similarity``, the model kind's,
    as in :func:`cembed.eval.evaluators.retrieval_evaluator`).
    Corpus embeddings are not cached here: the weights change between evaluations."""
    from sentence_transformers.base.evaluation import SequentialEvaluator

    evaluators = [retrieval_evaluator(r, batch_size, prompts=prompts, similarity=similarity) for r in sets.retrieval]
    evaluators += [sts_evaluator(s, batch_size) for s in sets.sts]
    return SequentialEvaluator(evaluators)


def metric_names(sets: EvalSets, similarity: str = "cosine") -> list[str]:
    """Metric names usable as ``eval.metric_for_best_model`` (the trainer logs them with an
    ``eval_`` prefix); retrieval metrics are keyed by ``similarity`` (the model kind's: ``cosine``, ``maxsim``)."""
    names = []
    for r in sets.retrieval:
        names += [f"{r.name}_{suffix}" for _, suffix in retrieval_headline(similarity)]
        names += [f"{r.name}_{similarity}_{m}@{k}" for m in ("accuracy", "precision") for k in (1, 3, 5, 10)]
        names += [f"{r.name}_{similarity}_recall@{k}" for k in (1, 3, 5)]
        names += [f"{r.name}_{similarity}_precision@100"]
    for s in sets.sts:
        names += [f"{s.name}_{suffix}" for _, suffix in STS_HEADLINE]
    return names


def check_metric_name(metric: str | None, sets: EvalSets, similarity: str = "cosine") -> str | None:
    """Normalise ``eval.metric_for_best_model`` (an optional ``eval_`` prefix is dropped) and check it
    is a metric the sets produce (retrieval metrics keyed by ``similarity``, :func:`metric_names`).

    Raises:
        UserError: unknown metric (or `loss`, which no eval set produces), with a did-you-mean and choices.
    """
    import difflib

    if metric is None:
        return None
    bare = metric.removeprefix("eval_")
    known = metric_names(sets, similarity)
    if bare in known:
        return bare
    if bare == "loss":  # the trainer's eval_loss needs an eval dataset; cembed evaluates with evaluators only
        raise UserError(
            f"eval.metric_for_best_model: {metric!r} needs an evaluation loss, which the eval sets do not produce "
            f"(they are scored, not trained on); pick one of their metrics, e.g. {known[0]!r}"
        )
    close = difflib.get_close_matches(bare, known, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    choices = ", ".join(known[: 6 if sets.retrieval else 2])
    raise UserError(f"eval.metric_for_best_model: {metric!r} is not a metric of the eval sets{hint} (e.g. {choices})")


def greater_is_better(metric: str, explicit: bool | None) -> bool:
    """``explicit`` when set, else False for a loss and True for every other metric."""
    if explicit is not None:
        return explicit
    return not metric.endswith("loss")


def training_eval_args(eval_cfg, metric: str | None, save_steps: int | None) -> dict[str, Any]:
    """Training-argument overrides for evaluation during training.

    ``eval_steps`` -> ``eval_strategy="steps"``; with a ``metric_for_best_model`` a checkpoint is
    saved at every evaluation (or at ``train.save_steps`` when set, which must then be a multiple of
    ``eval_steps``), the best one is kept and loaded at the end.

    Raises:
        UserError: ``train.save_steps`` not a multiple of ``eval.eval_steps`` with a best-model metric.
    """
    if eval_cfg is None or eval_cfg.eval_steps is None:
        return {}
    args: dict[str, Any] = {"eval_strategy": "steps", "eval_steps": eval_cfg.eval_steps}
    if metric is not None:
        if save_steps is not None and save_steps % eval_cfg.eval_steps:
            raise UserError(
                f"train.save_steps ({save_steps}) must be a multiple of eval.eval_steps ({eval_cfg.eval_steps}) "
                "to keep the best checkpoint; change one of them or unset train.save_steps"
            )
        args.update(
            save_strategy="steps",
            save_steps=save_steps or eval_cfg.eval_steps,
            load_best_model_at_end=True,
            metric_for_best_model=metric,
            greater_is_better=greater_is_better(metric, eval_cfg.greater_is_better),
            save_total_limit=eval_cfg.save_total_limit,
        )
    return args


def eval_metrics(logs: dict[str, Any]) -> dict[str, float]:
    """An evaluation's metrics in a trainer log (keys ``eval_<metric>``) without the prefix and
    without the trainer's timings; ``{}`` for a log that holds no evaluation."""
    metrics = {
        k.removeprefix("eval_"): float(v)
        for k, v in logs.items()
        if k.startswith("eval_") and isinstance(v, (int, float))
    }
    return {k: v for k, v in metrics.items() if k not in ("runtime", "samples_per_second", "steps_per_second")}


class EvalLogCallback(TrainerCallback):
    """Trainer callback that records each evaluation (step, metrics without the ``eval_`` prefix)
    and hands ``on_line`` one line per evaluation with the headline metrics
    (``eval step <step>: <metric> <value:.4f>  ...``); ``on_line=None`` shows nothing. A resumed
    run's history starts with the evaluations before its checkpoint (the trainer's restored log
    history), so ``run_summary.json``'s ``eval.during`` lists the whole run's."""

    def __init__(self, on_line: LineFn | None = None, headline_keys: list[str] | None = None) -> None:
        self.on_line = on_line
        self.history: list[dict[str, Any]] = []
        self.headline_keys = headline_keys or []

    def on_train_begin(self, args, state, control, **kwargs):
        # The trainer restored a resumed run's state (its log history included) before this.
        self.history = [
            {"step": entry["step"], "metrics": metrics}
            for entry in state.log_history
            if (metrics := eval_metrics(entry)) and "step" in entry
        ]

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics = eval_metrics(logs or {})
        if not metrics:
            return
        self.history.append({"step": state.global_step, "metrics": metrics})
        if self.on_line is not None:
            shown = [k for k in self.headline_keys if k in metrics] or list(metrics)[:4]
            text = "  ".join(f"{k} {metrics[k]:.4f}" for k in shown)
            self.on_line(f"eval step {state.global_step}: {text}")


def headline_keys(sets: EvalSets, similarity: str = "cosine") -> list[str]:
    """The primary metric of each set: ``<name>_<similarity>_ndcg@10`` / ``<name>_spearman_cosine``."""
    return [f"{r.name}_{similarity}_ndcg@10" for r in sets.retrieval] + [f"{s.name}_spearman_cosine" for s in sets.sts]


def run_evaluator(evaluator, model) -> dict[str, float]:
    """Call a (sequential) evaluator outside the trainer; returns float metrics without the
    ``sequential_score`` entry."""
    metrics = evaluator(model)
    return {k: float(v) for k, v in metrics.items() if k != "sequential_score"}


@dataclass
class TrainingEvaluation:
    """Everything ``run_training`` needs to evaluate before, during and after training."""

    sets: EvalSets
    evaluator: Any
    metric: str | None  # metric_for_best_model without the eval_ prefix
    training_args: dict[str, Any]
    callback: EvalLogCallback
    batch_size: int = 32
    prompts: Any = None  # cembed.model.prompts.RolePrompts: query = anchor prompt, corpus = positive prompt
    seconds: float | None = None  # how long the last evaluate() took (a stop signal's grace estimate)
    similarity: str = "cosine"  # how retrieval scores: the model kind's (ModelConfig.similarity)

    @classmethod
    def from_config(
        cls, eval_cfg, save_steps: int | None, on_line: LineFn | None = None, prompts=None, similarity: str = "cosine"
    ) -> TrainingEvaluation:
        """Load the sets of ``eval_cfg`` and build evaluator, training-argument overrides and log
        callback; retrieval queries get ``prompts.anchor``, corpora ``prompts.positive``, scored by
        ``similarity`` (the model kind's).

        ``on_line`` receives the evaluation lines (see :class:`EvalLogCallback` and :meth:`evaluate`).

        Raises:
            UserError: see :func:`cembed.eval.sets.load_eval_sets`, :func:`check_metric_name`,
                :func:`training_eval_args`.
        """
        sets = load_eval_sets(eval_cfg)
        metric = check_metric_name(eval_cfg.metric_for_best_model, sets, similarity)
        return cls(
            sets=sets,
            evaluator=build_training_evaluator(sets, eval_cfg.batch_size, prompts, similarity),
            metric=metric,
            training_args=training_eval_args(eval_cfg, metric, save_steps),
            callback=EvalLogCallback(on_line, headline_keys(sets, similarity)),
            batch_size=eval_cfg.batch_size,
            prompts=prompts,
            similarity=similarity,
        )

    def evaluate(self, model, label: str, cache_dir: str | Path | None = None) -> dict[str, float]:
        """Run every set's evaluator on ``model``; the callback's ``on_line`` (if any) gets the headline
        metrics as ``eval <label>: <metric> <value:.4f>  ...``.

        With ``cache_dir`` (used before training, when the weights are the base model's) retrieval
        corpora come from / go to the corpus-embedding cache; the metrics are the same.
        """
        started = time.perf_counter()
        if cache_dir is None:
            metrics = run_evaluator(self.evaluator, model)
        else:
            metrics = {}
            fp = model_fingerprint(model) if self.sets.retrieval else None
            for rs in self.sets.retrieval:
                metrics.update(evaluate_retrieval(model, rs, self.batch_size, cache_dir, None, fp, self.prompts)[0])
            for ss in self.sets.sts:
                metrics.update(evaluate_sts(model, ss, self.batch_size))
        self.seconds = time.perf_counter() - started
        if self.callback.on_line is not None:
            shown = "  ".join(
                f"{k} {metrics[k]:.4f}" for k in headline_keys(self.sets, self.similarity) if k in metrics
            )
            self.callback.on_line(f"eval {label}: {shown}")
        return metrics

    def summary(
        self, before: dict[str, float], after: dict[str, float], state, best_loaded: bool = False
    ) -> dict[str, Any]:
        """The ``eval`` block of ``run_summary.json``: metrics before and after training, every
        evaluation during training, and the best checkpoint (when a metric was chosen).

        ``best_loaded``: whether the trainer loaded the best checkpoint at the end of training
        (``CembedTrainer.best_model_loaded``); only then is output_dir's model that checkpoint.
        """
        best = None
        if self.metric is not None:
            ckpt = getattr(state, "best_model_checkpoint", None)
            loaded = bool(best_loaded and ckpt)
            best = {
                "metric": self.metric,
                "greater_is_better": self.training_args.get("greater_is_better"),
                "value": getattr(state, "best_metric", None),
                "step": int(Path(ckpt).name.rsplit("-", 1)[-1]) if ckpt else None,
                "checkpoint": ckpt,
                "loaded": loaded,
                "note": "the model saved in output_dir is this checkpoint (loaded at the end of training)"
                if loaded
                else "not loaded: the model saved in output_dir is the last step's",
            }
        return {
            "sets": [
                {
                    "name": r.name,
                    "kind": "retrieval",
                    "path": r.path,
                    "split": r.split,
                    "queries": len(r.queries),
                    "documents": len(r.corpus),
                }
                for r in self.sets.retrieval
            ]
            + [{"name": s.name, "kind": "sts", "path": s.path, "pairs": len(s.scores)} for s in self.sets.sts],
            "before": before,
            "after": after,
            "during": self.callback.history,
            "best": best,
        }
