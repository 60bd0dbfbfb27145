"""The rest tiers (ondemand/engines/tiers.py): one object each, shallow to deep, named as the views,
the state file and a replay's deployments file name them. Pure, so each is asked directly; the
sleeper's calls reach real engines in test_tiered_warmth.py and test_sim_engine.py."""
from __future__ import annotations

import dataclasses

import pytest

from ondemand.engines import tiers
from ondemand.model import Deployment, IdleAction
from ondemand.replay.deployments import COSTS
from ondemand.replay.types import Costs


def dep(engine: str) -> Deployment:
    return Deployment(id=1, name="a", served_name="A", engine=engine, model="org/m", memory_gib=10.0)


def test_the_tiers_go_shallow_to_deep_each_holding_less_and_costing_more_to_leave():
    assert tiers.NAMES == ("asleep_1", "asleep_2", "stopped")  # the views', plans' and metrics' words
    assert [t.level for t in tiers.TIERS] == [1, 2, None] and tiers.LEVELS == (1, 2)
    assert [t.idle_action for t in tiers.TIERS] == [IdleAction.SLEEP, IdleAction.SLEEP2, IdleAction.STOP]
    assert [(t.host, t.gpus) for t in tiers.TIERS] == [(True, True), (False, True), (False, False)]
    assert [(t.start, t.default_s) for t in tiers.TIERS] == [("wake", 3.0), ("wake", 10.0), ("cold", 60.0)]
    for tier in tiers.TIERS:
        assert tiers.BY_NAME[tier.name] is tier
        if tier.level is not None:
            assert tiers.asleep(tier.level) is tier
    with pytest.raises(ValueError, match="no sleep level 3"):
        tiers.asleep(3)


def test_a_replay_prices_each_tier_by_its_own_cost_field_with_the_tiers_defaults():
    assert [t.cost_key for t in tiers.TIERS] == ["wake_s", "wake2_s", "cold_start_s"]
    assert all(t.cost_key in COSTS for t in tiers.TIERS)  # a deployments file's keys, unchanged
    assert [Costs().back_s(t) for t in tiers.TIERS] == [3.0, 10.0, 60.0]
    measured = Costs(cold_start_s=42.0, wake_s=0.7, wake2_s=6.5)
    assert [measured.back_s(t) for t in tiers.TIERS] == [0.7, 6.5, 42.0]
    assert {f.name for f in dataclasses.fields(Costs)} >= {t.cost_key for t in tiers.TIERS}


@pytest.mark.parametrize(("engine", "level", "enter", "leave"), [
    ("vllm", 1, [("/sleep", {"level": "1"}, None)], [("/wake_up", None, None)]),
    ("vllm", 2, [("/sleep", {"level": "2"}, None)],
     [("/wake_up", {"tags": "weights"}, None), ("/collective_rpc", None, {"method": "reload_weights"}),
      ("/wake_up", {"tags": "kv_cache"}, None), ("/reset_prefix_cache", None, None)]),
    ("sglang", 1, [("/release_memory_occupation", None, {})], [("/resume_memory_occupation", None, {})]),
    ("sglang", 2, [("/release_memory_occupation", None, {})],
     [("/resume_memory_occupation", None, {}), ("/update_weights_from_disk", None, {"model_path": "org/m"})]),
])
def test_a_sleeper_enters_and_leaves_a_tier_by_its_engine_calls_in_the_engines_order(engine, level, enter, leave):
    tier = tiers.asleep(level)
    assert tier.enter(dep(engine)) == enter and tier.leave(dep(engine)) == leave


def test_stopped_has_no_engine_call_its_ways_are_the_backends_stop_and_a_cold_start():
    assert tiers.STOPPED.enter(dep("vllm")) == [] and tiers.STOPPED.leave(dep("vllm")) == []
