"""Packing plans (cembed/model/packing.py): which rows share a pack, the capacity and pack count of
least estimated cost, and the exact index tensors between the padded and the packed layout."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cembed.model.packing import attention_cost, choose_packs, deal_rows, pack_rows, plan_packing


def test_best_fit_puts_a_row_where_the_least_room_still_fits_it():
    # longest first: 5 -> pack 0 (room 1), 4 -> pack 1 (room 2), 3 -> pack 2 (room 3); 2 fills pack 1
    # exactly (not pack 2, which has more room), 1 fills pack 0
    assert pack_rows([5, 3, 4, 2, 1], 6) == [[0, 4], [2, 3], [1]]
    assert pack_rows([3, 3, 1], 4) == [[0, 2], [1]]  # equal rooms: the earlier pack
    assert pack_rows([2, 2], 4) == [[0, 1]] and pack_rows([4], 4) == [[0]] and pack_rows([], 4) == []
    with pytest.raises(ValueError) as err:
        pack_rows([3, 5], 4)
    assert str(err.value) == "a row of 5 tokens does not fit a pack of 4"


def test_attention_cost_is_one_over_twice_hidden_plus_intermediate():
    assert attention_cost(SimpleNamespace(hidden_size=8, intermediate_size=16)) == 1 / 32
    assert attention_cost(SimpleNamespace(hidden_size=8)) == 1 / 48  # intermediate 4 x hidden
    assert attention_cost(SimpleNamespace(hidden_size=8, intermediate_size=None)) == 1 / 48
    for config in (SimpleNamespace(), SimpleNamespace(hidden_size=None), SimpleNamespace(hidden_size=0)):
        assert attention_cost(config) == 0.0


def test_the_packs_of_least_estimated_cost():
    # width free: one pack of every token costs 14, as little as any layout can
    assert choose_packs([5, 3, 3, 3], 0.0) == ([[0, 1, 2, 3]], 14)
    # width dear: capacity 6 gives 3 packs of width 6 (3 x 6 x 2.2 = 39.6) against 4 x 5 x 2 = 40 (one
    # row a pack), 2 x 8 x 2.6 = 41.6 and 1 x 14 x 3.8 = 53.2
    assert choose_packs([5, 3, 3, 3], 0.2) == ([[0], [1, 2], [3]], 6)
    plan = plan_packing([5, 3, 3, 3], 0.2)  # a few rows: best fit, as chosen here
    assert (plan.packs, plan.pack_width) == (3, 6)
    assert plan.segments.tolist() == [[0, 0, 0, 0, 0, -1], [1, 1, 1, 2, 2, 2], [3, 3, 3, -1, -1, -1]]
    # a tie keeps the smaller capacity: 2 packs of 4 and 1 of 8 both cost 8
    assert choose_packs([4, 4], 0.0) == ([[0], [1]], 4)
    # capacity 6 packs 5 + 1 and 4 + 2: 2 x 6 x 4 = 48, against 3 x 5 x 3.5 = 52.5 (capacity 5) and
    # 2 x 7 x 4.5 = 63 (capacity 7: best fit packs 5 + 2 and 4 + 1)
    assert choose_packs([5, 4, 2, 1], 0.5) == ([[0, 3], [1, 2]], 6)


def test_rows_are_dealt_longest_first_to_the_emptiest_pack():
    lengths = np.array([8, 7, 6, 5, 4, 3, 2, 1])
    # one row a round (2 packs): 8 -> 0, 7 -> 1, 6 -> 1, 5 -> 0, 4 -> 0 (a tie: the first), 3 -> 1, 2 -> 1, 1 -> 0
    assert deal_rows(lengths, 2).tolist() == [0, 1, 1, 0, 0, 1, 1, 0]
    assert deal_rows(lengths, 1).tolist() == [0] * 8
    assert deal_rows(np.array([10, 1, 1, 1]), 2).tolist() == [0, 1, 1, 1]  # 2 packs: one row a round
    # 8 packs, 2 rows a round: a round's rows go to the two emptiest packs, even where the first would
    # still be the emptiest after its row: the last round's 2 + 2 go to pack 7 (2 tokens) and pack 6 (5),
    # where one row at a time would put both in pack 7 (2, then 4 < 5)
    dealt = deal_rows(np.array([20, 20, 20, 20, 20, 20, 5, 2, 2, 2]), 8)
    assert dealt.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 7, 6]


def test_a_plan_moves_each_token_to_its_packed_place():
    # rows of 3, 1 and 2 tokens (padded to 3) at capacity 3: pack 0 holds row 0, pack 1 rows 2 then 1
    plan = plan_packing([3, 1, 2], 0.0, capacity=3)
    assert (plan.rows, plan.width, plan.packs, plan.pack_width, plan.real, plan.processed) == (3, 3, 2, 3, 6, 6)
    assert plan.gather.tolist() == [0, 1, 2, 6, 7, 3]  # padded flat index = row x 3 + position
    assert plan.scatter.tolist() == [0, 1, 2, 5, 0, 0, 3, 4, 0]
    assert plan.segments.tolist() == [[0, 0, 0], [2, 2, 1]]
    assert plan.positions.tolist() == [[0, 1, 2], [0, 1, 0]]
    assert all(t.dtype == torch.int64 for t in (plan.gather, plan.scatter, plan.segments, plan.positions))
    # a pack shorter than the fullest: its tail reads position 0 and belongs to no row
    short = plan_packing([3, 1], 0.0, capacity=3)
    assert (short.packs, short.pack_width, short.real, short.processed) == (2, 3, 4, 6)
    assert short.gather.tolist() == [0, 1, 2, 3, 0, 0] and short.scatter.tolist() == [0, 1, 2, 3, 0, 0]
    assert short.segments.tolist() == [[0, 0, 0], [1, -1, -1]] and short.positions.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_more_rows_than_best_fit_takes_are_dealt_over_the_pack_count_of_least_cost():
    # 66 rows (over BEST_FIT_MAX_ROWS): two of 32 tokens, 64 of 1. Dealt over 4 packs: 32 each (the two
    # long rows alone, 32 short ones in each other pack), 4 x 32 x (1 + 32 c); over 2 packs 2 x 64,
    # 3 packs 3 x 43, 1 pack 1 x 128: with width free (c = 0) 1, 2 and 4 packs tie at 128 and the
    # fewest packs is kept
    lengths = [32, 32] + [1] * 64
    dear = plan_packing(lengths, 0.01)
    assert (dear.packs, dear.pack_width, dear.real) == (4, 32, 128)
    free = plan_packing(lengths, 0.0)
    assert (free.packs, free.pack_width) == (1, 128)
