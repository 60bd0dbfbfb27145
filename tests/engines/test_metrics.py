import logging

from aiohttp import web

from ondemand.engines.metrics import MetricsSampler, parse

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0
"""
LLAMA = """# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
llamacpp:requests_deferred 0
llamacpp:tokens_predicted_total 1234
"""


def test_parse_sums_label_sets_and_ignores_lookalikes():
    assert parse(VLLM) == (3.0, 3.0)
    assert parse(LLAMA) == (1.0, 0.0)
    assert parse("# nothing\nprocess_cpu_seconds_total 1\n") is None


async def serve(make):
    async def handler(request):
        return make(request)
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def test_sample_age_and_idle():
    body = {"text": LLAMA}
    runner, url = await serve(lambda r: web.Response(text=body["text"]))
    now = [100.0]
    sampler = MetricsSampler(lambda: [(1, url)], clock=lambda: now[0])
    try:
        await sampler.sample_once()
        assert not sampler.idle(1)  # one request processing
        body["text"] = LLAMA.replace("requests_processing 1", "requests_processing 0")
        await sampler.sample_once()
        assert sampler.idle(1)
        now[0] += 61
        assert not sampler.idle(1)  # a sample older than 60 s proves nothing
    finally:
        await sampler.close()
        await runner.cleanup()


async def test_engine_without_gauges_is_never_idle_and_says_so_once(caplog):
    runner, url = await serve(lambda r: web.Response(status=501, text="metrics not enabled"))
    sampler = MetricsSampler(lambda: [(7, url)])
    try:
        with caplog.at_level(logging.WARNING, logger="ondemand.engines.metrics"):
            for _ in range(3):
                await sampler.sample_once()
        assert not sampler.idle(7)
        assert len([r for r in caplog.records if "never be put to sleep" in r.message]) == 1
    finally:
        await sampler.close()
        await runner.cleanup()
