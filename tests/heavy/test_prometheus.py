"""A real Prometheus (Debian's, `make test-prometheus`) scrapes ondemand's /metrics with
the admin token from a file, using the shipped scrape job (packaging/prometheus.yml), and
answers a PromQL query for the requests ondemand counted."""
import asyncio
import os
import re
import shutil
import signal

import aiohttp
import pytest
from helpers import ROOT, free_port, run_app, two_pools, wait_for

pytestmark = pytest.mark.prometheus

PROMETHEUS = os.environ.get("PROMETHEUS_BIN", "/usr/bin/prometheus")


def scrape_config(token_file, target: str, base_path: str) -> str:
    """packaging/prometheus.yml, pointed at this test's ondemand and token, every second."""
    text = (ROOT / "packaging" / "prometheus.yml").read_text()
    for old, new in [(r"credentials_file: \S+", f"credentials_file: {token_file}"),
                     (r'targets: \["[^"]+"\]', f'targets: ["{target}"]'),
                     (r"metrics_path: \S+", f"metrics_path: {base_path}/metrics"),
                     (r"scrape_interval: \S+", "scrape_interval: 1s")]:
        text, n = re.subn(old, new, text)
        assert n == 1, old
    return text


async def query(http, url: str, promql: str) -> list:
    async with http.get(f"{url}/api/v1/query", params={"query": promql}) as r:
        body = await r.json()
        assert body["status"] == "success", body
        return body["data"]["result"]


async def test_prometheus_scrapes_with_the_token_file_and_counts_the_requests(tmp_path):
    if not shutil.which(PROMETHEUS):
        pytest.skip(f"{PROMETHEUS} not installed (make test-prometheus installs it)")
    async with run_app(tmp_path) as server, two_pools() as http:
        token_file = tmp_path / "ondemand.token"
        token_file.write_text(server.token + "\n")
        token_file.chmod(0o600)
        target = server.url.split("/")[2]
        (tmp_path / "prometheus.yml").write_text(scrape_config(token_file, target, server.cfg.base_path))
        port = free_port()
        prom = await asyncio.create_subprocess_exec(
            PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
            stdout=asyncio.subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
        url = f"http://127.0.0.1:{port}"
        try:
            a = await server.add("a")
            n = 4
            for _ in range(n):
                async with http.post(server.gw(a, "chat/completions"), headers=server.auth(),
                                     json={"model": "A", "messages": [{"role": "user", "content": "hi"}]}) as r:
                    assert r.status == 200

            async def counted():
                assert prom.returncode is None, (tmp_path / "prometheus.log").read_text()
                try:
                    result = await query(http, url, 'sum(ondemand_requests_total{deployment="a",code="200"})')
                except aiohttp.ClientError:
                    return None  # not listening yet
                return result and float(result[0]["value"][1]) == n
            await wait_for(counted, timeout=60, interval=0.5, what=f"Prometheus to count {n} requests")
            up = await query(http, url, 'up{job="ondemand"}')
            assert [float(s["value"][1]) for s in up] == [1.0]
            ready = await query(http, url, 'ondemand_deployment_state{deployment="a"} == 1')
            assert [s["metric"]["state"] for s in ready] == ["ready"]
        finally:
            if prom.returncode is None:
                prom.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(prom.wait(), 20)
            except asyncio.TimeoutError:
                prom.kill()
                await prom.wait()
