"""Packing plans (cembed/model/packing.py): which rows share a pack, the capacity and pack count of
least estimated cost, and the exact index tensors between the padded and the packed layout."""

from __future__ import annotations
