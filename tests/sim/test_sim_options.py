"""The simulator's options (ondemand/sim/options.py) as its command line gives them
(``engine.parse_args``): every flag, the engines' own flags as ondemand's recipes write them,
the defaults the same as ``SimOptions``' (a test in the same process), each failure and flavor
``options.py`` names taken and any other refused with exit 2. No server is started."""
from __future__ import annotations

import pytest

from ondemand.sim.engine import parse_args
from ondemand.sim.options import FAILURES, FLAVORS, SimOptions


def test_parse_args():
    o = parse_args(["--port", "9", "--model", "m", "--flavor", "llamacpp", "--fail", "exit-after", "2.5",
                    "--token-delay", "0.1", "--tokens", "4", "--startup-delay", "1"])
    assert (o.port, o.model, o.flavor, o.fail, o.fail_after, o.token_delay, o.tokens, o.startup_delay) == (
        9, "m", "llamacpp", "exit-after", 2.5, 0.1, 4, 1.0)
    assert parse_args([]).host == "127.0.0.1"
    for bad in (["--fail", "exit-after"], ["--fail", "crash-mid-stream", "1"], ["--fail", "explode"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_parse_args_sleep_flags():
    o = parse_args(["--sleep-delay", "1.5", "--wake-delay", "2", "--sleep-gpu-mib", "300", "--host-mib", "64",
                    "--flavor", "sglang", "--enable-weights-cpu-backup", "--fail", "wake-hangs"])
    assert (o.sleep_delay, o.wake_delay, o.sleep_gpu_mib, o.host_mib, o.flavor, o.weights_cpu_backup, o.fail) == (
        1.5, 2.0, 300, 64, "sglang", True, "wake-hangs")
    assert parse_args(["--fail", "wake-garbage"]).fail == "wake-garbage"
    assert not parse_args([]).weights_cpu_backup
    for bad in (["--host-mib", "-1"], ["--wake-delay", "-1"], ["--sleep-level", "2"], ["--flavor", "tgi"]):
        with pytest.raises(SystemExit) as exit_:
            parse_args(bad)
        assert exit_.value.code == 2


def test_it_takes_the_flags_the_recipes_write_and_refuses_others():
    """The simulator stands in for the engines a recipe starts: their flags as
    recipes.launch writes them are accepted, the served name is vLLM's
    (--served-model-name, else the model), and an unknown flag exits 2 as vLLM does."""
    from ondemand.engines.recipes import Box, launch
    from ondemand.model import Deployment
    for engine, model in (("vllm", "org/m"), ("sglang", "org/m"), ("llamacpp", "/srv/m.gguf")):
        dep = Deployment(id=1, name="d", served_name="served", engine=engine, model=model, memory_gib=8, gpu_count=2)
        argv = launch(dep, Box(backend="process", commands={engine: ()}), gpu_size_gib=80).args
        opts = parse_args([a.replace("{port}", "0") for a in argv])
        assert opts.model == "served" and opts.port == 0, (engine, argv)
    assert parse_args(["org/m"]).model == "org/m"
    assert parse_args(["--model", "legacy"]).model == "legacy"  # the tests' and the demo's older form
    with pytest.raises(SystemExit) as exit_:
        parse_args(["org/m", "--no-such-flag"])
    assert exit_.value.code == 2


def test_load_weights_needs_a_local_model(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--load-weights", "org/not-here"])
    assert exit_.value.code == 2
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert parse_args(["--load-weights", "-m", str(gguf)]).weights_path == str(gguf)


def test_the_command_lines_defaults_are_the_options_defaults():
    """A simulator started with no flag and one a test makes with ``SimOptions()`` are the same
    simulator: every field's default agrees."""
    assert parse_args([]) == SimOptions()


def test_each_failure_and_flavor_the_options_name_is_taken_from_the_command_line():
    for mode in FAILURES:
        given = [mode, "1.5"] if mode == "exit-after" else [mode]
        assert (parse_args(["--fail", *given]).fail, parse_args(["--fail", *given]).fail_after) == (
            mode, 1.5 if mode == "exit-after" else 0.0)
    for flavor in FLAVORS:
        assert parse_args(["--flavor", flavor]).flavor == flavor
