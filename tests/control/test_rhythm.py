"""Adaptive warmth's decision core (control/rhythm.py): pure, so every case is a list of gaps."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ondemand.control import rhythm
from ondemand.control.rhythm import Plan, Rhythm

COSTS = {"asleep_1": 1.0, "asleep_2": 6.0, "stopped": 60.0}
BOUNDS = {"idle_timeout_s": 600, "min_idle_timeout_s": 60}


def bursts(n_bursts: int, *, every_s: float = 1800.0, jitter_s: float = 60.0, inside_s: float = 3.0,
           per_burst: int = 5, seed: int = 1) -> list[float]:
    """Gaps of a model called in bursts: a few seconds apart inside one, about every_s between."""
    rng = random.Random(seed)
    gaps: list[float] = []
    for _ in range(n_bursts):
        gaps += [rng.uniform(0.5, inside_s) for _ in range(per_burst - 1)]
        gaps.append(every_s + rng.uniform(-jitter_s, jitter_s))
    return gaps


def test_no_plan_before_the_20th_gap():
    gaps = bursts(5, per_burst=4)  # 20 gaps: five quiet half hours, after three short gaps each
    r = Rhythm(gaps[:19])
    assert r.plan(**BOUNDS, tiers=COSTS) is None
    r.add(gaps[19])
    assert r.plan(**BOUNDS, tiers=COSTS) is not None


def test_a_burst_pattern_rests_right_after_the_burst_and_is_back_before_the_next():
    gaps = bursts(8)
    r = Rhythm(gaps)
    plan = r.plan(**BOUNDS, tiers=COSTS)
    assert plan is not None
    # The burst's gaps (seconds) are behind at the minimum idle time: it rests then, and deep
    # (half an hour of quiet pays for a one-minute cold start many times over).
    assert plan.awake_for_s == 60
    assert plan.rest == "stopped"
    # Started again so that it is ready before the next burst: ready by the head of the long gaps.
    between = sorted(g for g in gaps if g > 60)
    ready = plan.prewarm_in_s + COSTS["stopped"]
    assert plan.prewarm_in_s > plan.awake_for_s + rhythm.MIN_REST_RATIO * BOUNDS["min_idle_timeout_s"]
    assert ready < between[0]
    assert plan.awake_until_s is not None and plan.awake_until_s >= between[-1]


def test_the_pattern_is_learned_as_the_gaps_come():
    """Before the pattern: fixed. After enough bursts: the plan; an arriving gap is kept, the
    oldest beyond KEEP dropped."""
    r = Rhythm()
    plans = []
    for gap in bursts(10):
        r.add(gap)
        plans.append(r.plan(**BOUNDS, tiers=COSTS))
    assert all(p is None for p in plans[:rhythm.LEARN_AFTER - 1])
    assert plans[-1] is not None and plans[-1].rest == "stopped"
    for _ in range(rhythm.KEEP + 10):
        r.add(7.0)
    assert len(r) == rhythm.KEEP and set(r.gaps) == {7.0}


def test_only_the_tiers_given_are_chosen():
    r = Rhythm(bursts(8))
    plan = r.plan(**BOUNDS, tiers={"asleep_1": 1.0})
    assert plan is not None and plan.rest == "asleep_1"
    assert plan.prewarm_in_s is not None and plan.awake_until_s is not None
    assert r.plan(**BOUNDS, tiers={}) is None  # nowhere to rest, and the tail is past the timeout


def test_a_short_quiet_time_rests_lightly():
    # Two minutes between bursts: too short for a one-minute cold start to pay, long enough for
    # a level-2 wake.
    r = Rhythm(bursts(10, every_s=150, jitter_s=5))
    plan = r.plan(idle_timeout_s=600, min_idle_timeout_s=10, tiers=COSTS)
    assert plan is not None and plan.awake_for_s == 10 and plan.rest == "asleep_2"


def test_gaps_with_no_regularity_behave_as_fixed():
    rng = random.Random(3)
    uniform = Rhythm(rng.uniform(0, 7200) for _ in range(400))
    memoryless = Rhythm(rng.expovariate(1 / 300) for _ in range(400))
    assert uniform.plan(**BOUNDS, tiers=COSTS) is None
    assert memoryless.plan(**BOUNDS, tiers=COSTS) is None


def test_few_gaps_with_no_regularity_behave_as_fixed_and_a_rhythm_shows_from_the_20th():
    """n gaps counted in 240 bins carry their sampling noise: alone it put the counts' CV above
    2 for any gaps fewer than 60, so that 20 to 59 uniform or memoryless gaps all "showed a
    pattern" and were planned on (rested early, pre-warmed at a head that means nothing). The test
    is of the distribution's CV, that noise taken out."""
    def rhythms(make):
        rngs = [random.Random(seed) for seed in range(20)]
        return [sorted(make(rng) for _ in range(n)) for rng in rngs]
    for n in (20, 40, 60):
        uniform = rhythms(lambda rng: rng.uniform(0, 7200))
        memoryless = rhythms(lambda rng: rng.expovariate(1 / 300))
        periodic = rhythms(lambda rng: 1800 + rng.uniform(-60, 60))
        assert sum(map(rhythm.has_pattern, uniform + memoryless)) <= (2 if n == 20 else 0)
        assert all(map(rhythm.has_pattern, periodic))
    rng = random.Random(5)
    assert Rhythm(rng.expovariate(1 / 300) for _ in range(40)).plan(**BOUNDS, tiers=COSTS) is None
    assert rhythm.has_pattern(sorted(bursts(4)))  # 20 gaps of bursts: a pattern


def test_requests_that_always_come_soon_rest_after_the_tail_not_the_timeout():
    rng = random.Random(4)
    r = Rhythm(rng.uniform(7, 8) for _ in range(120))  # every 7 to 8 s: too soon to rest between
    plan = r.plan(idle_timeout_s=600, min_idle_timeout_s=1, tiers=COSTS)
    assert plan == Plan(awake_for_s=plan.awake_for_s, rest=None, prewarm_in_s=None, awake_until_s=None)
    assert 8 <= plan.awake_for_s <= 8 * rhythm.TAIL_MARGIN
    # ...and never shorter than the minimum idle time.
    assert r.plan(idle_timeout_s=600, min_idle_timeout_s=60, tiers=COSTS).awake_for_s == 60


def test_the_tail_is_not_taken_from_fewer_than_99_gaps():
    """The next of n + 1 gaps falls in any of the n + 1 places among them alike: it is longer
    than the k-th smallest of n with probability 1 - k / (n + 1). Rest after the tail (a 1 % bet)
    once the gap of rank ceil(0.99 (n + 1)) exists: 99 gaps. From 33, the sample's 99th percentile
    (about their longest) was exceeded by the next gap 1 time in 34 (the replay: a giant rested
    after 13 minutes of traffic and waited for its GPUs for the rest of the hour)."""
    assert rhythm.upper_quantile([float(i) for i in range(1, 99)], 0.99) is None
    assert rhythm.upper_quantile([float(i) for i in range(1, 100)], 0.99) == 99.0
    assert rhythm.upper_quantile([float(i) for i in range(1, 201)], 0.99) == 199.0
    assert rhythm.upper_quantile([1.0, 2.0, 3.0], 0.5) == 2.0
    rng = random.Random(6)
    gaps = [rng.uniform(7, 8) for _ in range(98)]
    assert Rhythm(gaps).plan(idle_timeout_s=600, min_idle_timeout_s=1, tiers=COSTS) is None  # as fixed
    gaps.append(7.5)
    plan = Rhythm(gaps).plan(idle_timeout_s=600, min_idle_timeout_s=1, tiers=COSTS)
    assert plan is not None and plan.awake_for_s == rhythm.TAIL_MARGIN * max(gaps)  # rank 99 of 99


def test_nil_gaps_are_a_pattern_and_negative_ones_count_as_nil():
    r = Rhythm([-3.0] * 100)
    assert r.gaps == [0.0] * 100
    plan = r.plan(**BOUNDS, tiers=COSTS)
    assert plan is not None and plan.awake_for_s == 60 and plan.rest is None


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.floats(min_value=0, max_value=86400, allow_nan=False), min_size=20, max_size=120),
       floor=st.integers(1, 600), extra=st.integers(0, 3600),
       costs=st.dictionaries(st.sampled_from(rhythm.TIERS), st.floats(0.1, 300), max_size=3))
def test_every_plan_keeps_the_bounds(gaps, floor, extra, costs):
    plan = Rhythm(gaps).plan(idle_timeout_s=floor + extra, min_idle_timeout_s=floor, tiers=costs)
    if plan is None:
        return
    assert floor <= plan.awake_for_s <= floor + extra
    if plan.rest is None:
        assert plan.prewarm_in_s is None and plan.awake_until_s is None
        return
    cost = costs[plan.rest]
    assert plan.prewarm_in_s is not None and plan.awake_until_s is not None
    rest = plan.prewarm_in_s - plan.awake_for_s
    assert rest >= max(rhythm.MIN_REST_RATIO * floor, rhythm.WORTH * cost) - 1e-6
    ready = plan.prewarm_in_s + cost
    assert ready + floor - 1e-6 <= plan.awake_until_s <= ready + floor + extra + 1e-6
