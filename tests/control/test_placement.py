"""The GPU placement rule on its own: best fit per GPU, pins, counts, and never a GPU
over its free memory (hypothesis checks the last against every set by brute force)."""
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from ondemand.control.placement import can_ever_fit, choose, share

EIGHT = [80.0] * 8


def test_two_60_gib_single_gpu_models_land_on_different_gpus():
    free = list(EIGHT)
    first = choose(free, 60, 1)
    assert first == (0,)
    free[0] -= 60
    assert choose(free, 60, 1) == (1,)  # GPU 0 has 20 left: no longer a fit
    assert choose([80.0], 60, 1) == (0,) and choose([20.0], 60, 1) is None


def test_a_two_gpu_model_needs_its_half_on_each():
    assert choose([30.0, 50.0, 40.0], 80, 2) == (1, 2)
    assert choose([30.0, 50.0, 39.0], 80, 2) is None  # 90 free in all, but not 40 on two GPUs
    assert share(80, 2) == 40 and share(10, 0) == 0


def test_best_fit_beside_a_foreign_process():
    """A process that is not ours holds 50 GiB of GPU 3: a 30 GiB model goes there, where
    it leaves the least free, and GPUs with 80 free stay whole for a big one."""
    free = [80.0, 80.0, 80.0, 30.0, 80.0]
    assert choose(free, 30, 1) == (3,)
    assert choose(free, 31, 1) == (0,)  # ties go to the lowest index


def test_a_pin_allows_only_those_gpus():
    assert choose(EIGHT, 10, 1, gpu_ids=[6]) == (6,)
    assert choose([80, 80, 80, 80, 80, 80, 5, 80], 10, 1, gpu_ids=[6]) is None
    assert choose(EIGHT, 10, 2, gpu_ids=[7, 2]) == (2, 7)
    assert choose(EIGHT, 10, 2, gpu_ids=[9, 2]) is None  # no GPU 9 here


def test_counts_none_and_zero():
    assert choose([40.0, 40.0], 60, None) == (0, 1)  # every GPU, 30 on each (before placement)
    assert choose([40.0, 20.0], 60, None) is None
    assert choose([0.0, 0.0], 60, 0) == ()  # no GPU, no GPU memory
    assert choose([80.0], 10, 2) is None  # more GPUs than the box has


def test_can_ever_fit_is_the_does_not_fit_rule():
    assert not can_ever_fit(EIGHT, 100, 1)  # no single 80 GiB GPU holds 100
    assert can_ever_fit(EIGHT, 100, 2)
    assert not can_ever_fit(EIGHT, 700, None)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=80, allow_nan=False), min_size=1, max_size=8),
       st.floats(min_value=0, max_value=400, allow_nan=False), st.integers(min_value=0, max_value=8))
def test_the_choice_fits_and_is_the_best_fit(free, memory_gib, count):
    chosen = choose(free, memory_gib, count)
    need = share(memory_gib, count)
    fitting = [c for c in itertools.combinations(range(len(free)), count)
               if all(free[i] + 1e-9 >= need for i in c)]
    if chosen is None:
        assert not fitting
        return
    assert len(chosen) == count and len(set(chosen)) == count
    assert all(free[i] + 1e-9 >= need for i in chosen)  # never over a GPU's free memory
    best = min(sum(free[i] - need for i in c) for c in fitting)
    assert sum(free[i] - need for i in chosen) <= best + 1e-6


def test_several_gpus_are_of_one_size():
    """A deployment on several GPUs gets GPUs of one size (interfaces.md, "Engine recipes"): its
    engine's memory share is one fraction of each GPU, and tensor parallelism splits it evenly."""
    free, sizes = [35.0, 30.0, 31.0], [80.0, 40.0, 80.0]
    assert choose(free, 60, 2) == (1, 2)  # without sizes: the best fit, of mixed sizes
    assert choose(free, 60, 2, sizes=sizes) == (0, 2)  # the two 80 GiB GPUs
    assert choose(free, 30, 1, sizes=sizes) == (1,)  # one GPU: any size
    assert choose([35.0, 30.0], 60, 2, sizes=[80.0, 40.0]) is None
    assert not can_ever_fit([80.0, 40.0], 60, 2, sizes=[80.0, 40.0])
    assert choose([40.0, 40.0], 60, 2, sizes=[79.6, 79.65]) == (0, 1)  # nvidia-smi's rounding: one size


# --- issue 43: placement keeps sleepers' room to wake ------------------------------------------

def test_a_newcomer_goes_where_it_leaves_every_sleeper_its_room_to_wake():
    """GPU 0 holds a sleeper (40 GiB, 2 kept: its wake needs 38); a 50 GiB newcomer fits on
    either GPU. Best fit alone picks GPU 0 (28 left, less than GPU 1's 30), which leaves the
    sleeper nowhere to wake; the rule picks GPU 1."""
    from ondemand.control.placement import Sleeper
    sleeper = Sleeper(7, {0: 38.0})
    assert choose([78.0, 80.0], 50, 1) == (0,)
    assert choose([78.0, 80.0], 50, 1, sleepers=[sleeper]) == (1,)
    # A sleeper that could not wake alone before the start is no reason to go elsewhere.
    assert choose([30.0, 80.0], 25, 1, sleepers=[Sleeper(7, {0: 38.0})]) == (0,)
    # Nowhere keeps every sleeper's room: best fit among all the sets.
    both = [Sleeper(7, {0: 38.0}), Sleeper(8, {1: 38.0})]
    assert choose([78.0, 80.0], 50, 1, sleepers=both) == (0,)
    # Several GPUs: a set is preferred only if it blocks no sleeper on any of its GPUs.
    assert choose([80.0, 78.0, 80.0, 80.0], 100, 2, sleepers=[Sleeper(7, {1: 38.0})]) == (0, 2)


def test_the_make_rooms_own_victims_are_no_sleepers_for_the_rule():
    from ondemand.control.placement import Fit, Sleeper
    fit = Fit(50, free=(78.0, 30.0), ondemand=(80.0, 80.0), count=1, allowed=None, per_gpu=True,
              sleepers=(Sleeper(7, {0: 38.0}),))
    assert fit.choose([78.0, 30.0]) == (0,)  # only GPU 0 fits, whatever the rule prefers
    assert fit.choose([78.0, 80.0]) == (1,)  # freed elsewhere: keep 7's room
    assert fit.choose([78.0, 80.0], victims={7}) == (0,)  # 7 is put away for it: best fit again
