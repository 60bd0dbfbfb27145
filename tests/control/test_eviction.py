"""Make-room's victims (ondemand/control/eviction.py), the pure rule on its own: of the idle
candidates, the lowest priority first, then awake before asleep, then the least recently used, the
shortest prefix after whose put-away some allowed set of GPUs fits the model, and of it only those
that hold memory on that set; none when all of them are not enough. The rule inside the core (who
is a candidate, what each frees, what is done with them): test_attempts.py."""
from __future__ import annotations

from ondemand.control.eviction import Candidate, pick_victims
from ondemand.model import Priority

LOW, NORMAL = Priority.LOW, Priority.NORMAL


def test_pick_victims_is_the_shortest_lru_prefix_that_covers_the_shortfall():
    def one_pool(need):  # one pool with nothing free: the victims must free ``need``
        return lambda free, victims=(): (0,) if free[0] + 1e-9 >= need else None

    cands = [Candidate(1, {0: 10}, last_used=30), Candidate(2, {0: 5}, last_used=10),
             Candidate(3, {0: 8}, last_used=20)]
    assert [v.id for v in pick_victims(cands, [0], one_pool(12))[0]] == [2, 3]
    assert [v.id for v in pick_victims(cands, [0], one_pool(5))[0]] == [2]
    assert pick_victims(cands, [0], one_pool(24)) == ([], ())  # all of them are not enough: none
    ties = [Candidate(5, {0: 1}, 0), Candidate(4, {0: 1}, 0)]
    assert [v.id for v in pick_victims(ties, [0], one_pool(1))[0]] == [4]  # ties: lower id


def test_pick_victims_per_gpu_stops_only_those_on_the_chosen_set():
    """2 GPUs of 80 GiB, both full: the LRU victim is on GPU 1, but the model
    (60 GiB on one GPU) fits on GPU 0 once the two smaller models there are gone
    too; only the victims on the chosen GPU are stopped."""
    def one_gpu(need):
        return lambda free, victims=(): next(((i,) for i in sorted(range(len(free)), key=lambda i: free[i])
                                  if free[i] + 1e-9 >= need), None)

    cands = [Candidate(1, {1: 40}, last_used=1), Candidate(2, {0: 30}, last_used=2),
             Candidate(3, {0: 30}, last_used=3), Candidate(4, {1: 40}, last_used=4)]
    victims, chosen = pick_victims(cands, [20, 0], one_gpu(60))
    assert chosen == (0,) and [v.id for v in victims] == [2, 3]  # 1 is older, but on GPU 1
    # A two-GPU victim frees memory on both: it counts on each.
    wide = [Candidate(7, {0: 30, 1: 30}, last_used=1)]
    assert pick_victims(wide, [10, 0], one_gpu(35)) == (wide, (0,))


def test_pick_victims_orders_by_rank_then_lru():
    def one_pool(need):
        return lambda free, victims=(): (0,) if free[0] + 1e-9 >= need else None

    cands = [Candidate(1, {0: 10}, last_used=1, rank=NORMAL.rank), Candidate(2, {0: 10}, last_used=9, rank=LOW.rank),
             Candidate(3, {0: 10}, last_used=5, rank=LOW.rank)]
    assert [v.id for v in pick_victims(cands, [0], one_pool(10))[0]] == [3]
    assert [v.id for v in pick_victims(cands, [0], one_pool(25))[0]] == [3, 2, 1]


def test_within_a_priority_awake_candidates_go_before_asleep_ones_whatever_their_age():
    """The tiers: putting an awake engine to sleep costs its next request a wake of seconds,
    stopping an asleep one a cold start; so within one priority the awake go first (least recently
    used among them), then the asleep, and a lower priority before both. ``choose`` is told each
    prefix put away so far (placement leaves make-room's own victims out of the sleepers it keeps
    room for)."""
    told: list[set[int]] = []

    def one_pool(need):
        def choose(free, victims=frozenset()):
            told.append(set(victims))
            return (0,) if free[0] + 1e-9 >= need else None
        return choose

    asleep_oldest = Candidate(1, {0: 2}, last_used=1, tier=1)
    awake_newest = Candidate(2, {0: 8}, last_used=50)
    awake_older = Candidate(3, {0: 8}, last_used=20)
    victims, chosen = pick_victims([asleep_oldest, awake_newest, awake_older], [0], one_pool(10))
    assert [v.id for v in victims] == [3, 2] and chosen == (0,)  # by age alone: 1 and 3
    assert told == [{3}, {3, 2}]
    low_asleep = Candidate(4, {0: 2}, last_used=90, rank=LOW.rank, tier=1)
    victims, _ = pick_victims([asleep_oldest, awake_newest, awake_older, low_asleep], [0], one_pool(10))
    assert [v.id for v in victims] == [4, 3]  # the priority class before the tier
