"""A new loss is a config class and a builder, added through the registries only: a toy loss defined
entirely here validates from a config, builds through ``build_loss`` and trains one step with the
gradient a hand computation gives."""

from __future__ import annotations

from typing import ClassVar, Literal

import pytest
import torch
from pydantic import PositiveFloat
from torch import nn

from cembed.config.file import config_from_dict
from cembed.config.loss import LOSS_CONFIGS, LossConfig, loss_config
from cembed.losses.registry import LOSS_BUILDERS, BuiltLoss, LossSettings, build_loss, register_loss


class ToyL2Config(LossConfig):
    """``toy_l2``: ``weight`` x the mean squared distance between anchor and positive embeddings."""

    uses_gradient_cache: ClassVar[bool] = False

    name: Literal["toy_l2"] = "toy_l2"
    weight: PositiveFloat = 1.0


class ToyL2Loss(nn.Module):
    """``weight / rows x sum_i ||e(anchor_i) - e(positive_i)||^2`` over the model's embeddings."""

    def __init__(self, model: nn.Module, weight: float) -> None:
        super().__init__()
        self.model, self.weight = model, weight

    def forward(self, sentence_features, labels):
        anchor, positive = (self.model(f)["sentence_embedding"] for f in sentence_features)
        return self.weight * (anchor - positive).pow(2).sum(dim=1).mean()


class LinearEmbedder(nn.Module):
    """A tiny model: ``sentence_embedding = W x`` for the features' ``x`` of shape ``(rows, 3)``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 2, bias=False)

    def forward(self, features: dict) -> dict:
        return {"sentence_embedding": self.proj(features["x"])}


@pytest.fixture
def toy_loss():
    """Register ``toy_l2`` for one test (config class and builder); yields the settings each build got."""
    settings_seen: list[LossSettings] = []

    def build(model, cfg: ToyL2Config, settings: LossSettings) -> nn.Module:
        settings_seen.append(settings)
        return ToyL2Loss(model, cfg.weight)

    register_loss(ToyL2Config, build)
    try:
        yield settings_seen
    finally:
        LOSS_CONFIGS.pop("toy_l2", None)
        LOSS_BUILDERS.pop("toy_l2", None)


def test_toy_loss_validates_builds_and_has_the_hand_computed_gradient(toy_loss, tmp_path):
    cfg = config_from_dict({"data": {"train": "x.jsonl"}, "loss": {"name": "toy_l2", "weight": 0.5}}, base=tmp_path)
    assert type(cfg.loss) is ToyL2Config and cfg.loss.weight == 0.5
    assert type(loss_config(name="toy_l2")) is ToyL2Config

    model = LinearEmbedder()
    with torch.no_grad():
        model.proj.weight.copy_(torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]]))
    built = build_loss(model, cfg.loss, mini_batch_size=4)
    assert isinstance(built, BuiltLoss) and isinstance(built.module, ToyL2Loss)
    assert not built.cached and built.cached_module is None and built.filter_counts is None
    assert toy_loss == [LossSettings(mini_batch_size=4)]

    x = torch.tensor([[1.0, 0.0, 2.0], [0.5, -1.0, 1.0], [2.0, 1.0, 0.0], [-1.0, 0.5, 0.5]])
    y = torch.tensor([[0.0, 1.0, 1.0], [1.5, -1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 2.0]])
    loss = built.module([{"x": x}, {"x": y}], None)
    loss.backward()

    # By hand: with D = X - Y (rows d_i), L = w/n sum_i ||W d_i||^2 = w/n tr(W D^T D W^T), so
    # dL/dW = 2w/n W D^T D.
    weight, rows = 0.5, x.shape[0]
    w = model.proj.weight.detach()
    d = x - y
    expected_loss = weight / rows * sum(float((w @ d_i) @ (w @ d_i)) for d_i in d)
    expected_grad = 2 * weight / rows * w @ d.T @ d
    assert torch.isfinite(loss) and torch.isfinite(model.proj.weight.grad).all()
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    torch.testing.assert_close(model.proj.weight.grad, expected_grad, rtol=1e-6, atol=1e-6)


def test_toy_loss_is_gone_after_the_fixture():
    assert "toy_l2" not in LOSS_CONFIGS and "toy_l2" not in LOSS_BUILDERS
