"""scripts/boxes_sim.py, small: seeded, both policies on one trace, warm first never worse on cold starts."""
import json

from helpers import load_script


def load_sim():
    return load_script("boxes_sim")


def test_simulation_small_is_seeded_and_warm_first_starts_less(capsys):
    sim = load_sim()
    p = sim.Params(hours=0.5, seed=3)
    shuffle, warm = sim.simulate(p)
    assert (shuffle["policy"], warm["policy"]) == ("shuffle", "warm")
    assert shuffle["requests"] == warm["requests"] > 300  # one trace for both
    assert warm["cold_starts"] < shuffle["cold_starts"] and warm["p99_wait_s"] <= shuffle["p99_wait_s"]
    assert sim.simulate(p) == [shuffle, warm]  # seeded: the same figures every run
    # Saturation: a hot model over one engine's capacity is cooled down after 429s and
    # started on a second box; everything else stays warm first.
    hot = sim.Params(hours=0.25, models=2, zipf=3, rate=3, seed=1)
    _, warm_hot = sim.simulate(hot)
    assert warm_hot["rejected_429"] > 0 and 2 < warm_hot["cold_starts"] <= 2 * hot.boxes
    assert sim.main(["--hours", "0.1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"]["hours"] == 0.1 and [r["policy"] for r in out["results"]] == ["shuffle", "warm"]
