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


def test_attention_cost_of_a_hidden_size_of_one():
    # 1 / (2 x 1 + 4 x 1): a width of one is a size like any other, not "no size"
    assert attention_cost(SimpleNamespace(hidden_size=1)) == 1 / 6


def test_a_balanced_capacity_beats_every_multiple_of_the_longest_row():
    # rows 10, 9, 2 (21 tokens, c = 0.1). Multiples of the longest: 10 (3 packs: 3 x 10 x 2 = 60), 12 (best fit
    # puts 2 beside 10: 2 x 12 x 2.2 = 52.8), 15 and 17 (the same packs), 20 (10 + 9: 2 x 19 x 2.9) and 21 (one
    # pack: 21 x 3.1 = 65.1). The even split of 21 tokens over 2 packs, capacity 11, puts 2 beside 9:
    # 2 x 11 x 2.1 = 46.2, the least
    assert choose_packs([10, 9, 2], 0.1) == ([[0], [1, 2]], 11)
    # the cost's linear term weighs as much as the width's: 2 packs of 4 cost 2 x 4 x (1 + 2.4) = 27.2 against
    # one pack of 6, 6 x (1 + 3.6) = 27.6
    assert choose_packs([4, 2], 0.6) == ([[0], [1]], 4)


def test_rows_of_equal_length_are_dealt_in_their_order():
    # ten rows of 2 (indices 0, 2, ..., 18) then ten of 1, one a round to the emptier of 2 packs (the first
    # on a tie): rows 0, 4, 8, ... and 1, 5, 9, ... to pack 0; rows 2, 6, ... and 3, 7, ... to pack 1
    assert deal_rows(np.array([2, 1] * 10), 2).tolist() == [0, 0, 1, 1] * 5


def test_the_dealt_pack_count_comes_from_the_neighbours_of_the_capacities_counts():
    # width free (c = 0): every pack count that divides the tokens costs as little as any layout, and the
    # fewest packs tried is kept. 72 rows of 1: capacities 1, 2, 3, 4, 6, 8 give 72, 36, 24, 18, 12 and 9 packs;
    # 8 (= 9 - 1) divides 72 too: 8 packs of 9
    ones72 = plan_packing([1] * 72, 0.0)
    assert (ones72.packs, ones72.pack_width) == (8, 9)
    # 70 rows of 1: 70, 35, 24, 18, 12, 9 packs from the capacities; of those and their neighbours 10 (= 9 + 1)
    # is the fewest that divides 70: 10 packs of 7
    ones70 = plan_packing([1] * 70, 0.0)
    assert (ones70.packs, ones70.pack_width) == (10, 7)
    # a row of 8 and 81 of 1 (89 tokens, c = 0.05): capacities 8, 10, 12, ... give 12, 9, 8, ... packs. 10 packs
    # (= 9 + 1) of width 9 cost 10 x 9 x 1.45 = 130.5, less than 12 of 8 (134.4), 9 of 10 (135), 11 of 9 (143.55)
    # and 13 of 8 (145.6)
    neighbour = plan_packing([8] + [1] * 81, 0.05)
    assert (neighbour.packs, neighbour.pack_width) == (10, 9)
    # a row a pack: 65 rows of 1 with c = 0.1 cost 65 x 1 x 1.1 = 71.5, against 33 packs of 2: 66 x 1.2 = 79.2
    alone = plan_packing([1] * 65, 0.1)
    assert (alone.packs, alone.pack_width) == (65, 1)
    # the cost's linear term: a row of 6 and 73 of 1 (79 tokens, c = 0.05): 14 packs of 6 cost 14 x 6 x 1.3 =
    # 109.2, against 10 of 8 (10 x 8 x 1.4 = 112), 12 of 7 (113.4) and 9 of 9 (117.45)
    linear = plan_packing([6] + [1] * 73, 0.05)
    assert (linear.packs, linear.pack_width) == (14, 6)


def test_sixty_four_rows_are_still_packed_best_fit():
    # 5 rows of 8 and 59 of 1 (99 tokens, c = 0.05), best fit: capacity 8 keeps each row of 8 alone and packs
    # the ones 8 a pack: 13 packs of 8, 13 x 8 x 1.4 = 145.6, against capacity 10 (10 packs of 10: 150) and 11
    # (9 of 11: 153.45). Dealing would choose 11 packs of 9, a capacity best fit does not try
    plan = plan_packing([8] * 5 + [1] * 59, 0.05)
    assert (plan.packs, plan.pack_width) == (13, 8)


def test_dealt_packs_hold_their_longest_rows_first():
    # one pack of 128 tokens: the two rows of 32 (rows 64 and 65) first, then the 64 rows of 1 in their order
    plan = plan_packing([1] * 64 + [32, 32], 0.0)
    assert plan.segments.tolist() == [[64] * 32 + [65] * 32 + list(range(64))]
    assert plan.positions.tolist() == [list(range(32)) * 2 + [0] * 64]


def test_the_index_tensors_go_to_the_device_asked_for():
    plan = plan_packing([3, 1, 2], 0.0, capacity=3, device="meta")
    assert {t.device.type for t in (plan.gather, plan.scatter, plan.segments, plan.positions)} == {"meta"}
    assert plan.segments.shape == (2, 3)
