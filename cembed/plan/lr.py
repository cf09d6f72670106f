"""Learning-rate scaling with the batch size.

Rules (``lr = base_lr * factor``):

- ``sqrt``: ``factor = sqrt(bs / base_bs)`` -- Krizhevsky 2014, "One weird trick for parallelizing
  convolutional neural networks" (arXiv:1404.5997); Hoffer et al. 2017, "Train longer, generalize
  better" (arXiv:1705.08741). The default: it keeps the gradient-noise scale constant and is the
  safer choice for Adam-type optimizers at very large batches.
- ``linear``: ``factor = bs / base_bs`` -- Goyal et al. 2017, "Accurate, Large Minibatch SGD"
  (arXiv:1706.02677).
- ``none``: ``factor = 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from cembed.errors import UserError

Rule = Literal["sqrt", "linear", "none"]


def scale_lr(base_lr: float, base_batch_size: int, batch_size: int, rule: Rule = "sqrt") -> float:
    """Scale a learning rate tuned at ``base_batch_size`` to ``batch_size`` samples per step.

    Args:
        base_lr: learning rate that was tuned at ``base_batch_size`` (> 0).
        base_batch_size: samples per optimizer step the base LR was tuned at (> 0).
        batch_size: samples per optimizer step now (> 0): per-device batch x world size x
            gradient accumulation steps.
        rule: ``sqrt`` (Krizhevsky 2014; Hoffer et al. 2017), ``linear`` (Goyal et al. 2017) or ``none``.

    Returns:
        The scaled learning rate.

    Raises:
        UserError: a non-positive input or an unknown rule.
    """
    for name, value in (
        ("base learning rate (--base-lr, optim.learning_rate)", base_lr),
        ("base batch size (--base-bs, optim.base_batch_size)", base_batch_size),
        ("batch size (--bs, samples per optimizer step)", batch_size),
    ):
        if not value > 0 or not math.isfinite(value):
            raise UserError(f"{name} must be a positive number (got {value})")
    ratio = batch_size / base_batch_size
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "linear":
        return base_lr * ratio
    if rule == "none":
        return base_lr
    raise UserError(f"unknown LR scaling rule {rule!r}; use sqrt, linear or none")


def derivation(base_lr: float, base_batch_size: int, batch_size: int, rule: Rule) -> str:
    """A one-line human-readable account of :func:`scale_lr`, e.g. for ``cembed validate``."""
    lr = scale_lr(base_lr, base_batch_size, batch_size, rule)
    if rule == "none":
        return f"{lr:.3e} = learning_rate {base_lr:g} (lr_scaling: none)"
    op = f"sqrt({batch_size}/{base_batch_size})" if rule == "sqrt" else f"({batch_size}/{base_batch_size})"
    return f"{lr:.3e} = {base_lr:g} x {op} (lr_scaling: {rule})"


@dataclass(frozen=True)
class LRSuggestion:
    """What ``cembed suggest-lr`` prints: the suggestion under ``rule`` and both rules' values."""

    rule: Rule
    suggested: float
    sqrt: float
    linear: float

    @property
    def bracket(self) -> tuple[float, float]:
        """LRs to try around the suggestion (x0.5, x2): the best one is found by halving/doubling."""
        return self.suggested * 0.5, self.suggested * 2.0


def suggest_lr(base_lr: float, base_batch_size: int, batch_size: int, rule: Rule = "sqrt") -> LRSuggestion:
    """Compute the ``suggest-lr`` answer; see :func:`scale_lr` for arguments and errors."""
    if rule not in ("sqrt", "linear"):
        raise UserError(f"--rule must be sqrt or linear (got {rule!r})")
    return LRSuggestion(
        rule=rule,
        suggested=scale_lr(base_lr, base_batch_size, batch_size, rule),
        sqrt=scale_lr(base_lr, base_batch_size, batch_size, "sqrt"),
        linear=scale_lr(base_lr, base_batch_size, batch_size, "linear"),
    )
