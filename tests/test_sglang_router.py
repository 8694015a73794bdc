"""The real sglang-router (PyPI's sglang-router, the Rust router SGLang and slime put in front of SGLang servers)
in front of two `rl360 serve rollout` processes, as `rl360.rollout.router.SGLangRouter` starts and feeds it:
what it forwards (SGLang's whole request body) is served and equals a direct call, the routes it passes through
answer, workers leave and rejoin it, and its process's command line holds no key. The fleet's use of it in a
training run (an engine killed mid-run, rejoining only with current weights) is in tests/test_rollout_manager.py."""

import asyncio
import os
import subprocess
import sys
import threading

import httpx
import psutil
import pytest

from rl360.core import SamplingParams
from rl360.core.client import EngineClient
from rl360.quickstart.assets import build_quickstart_model
from rl360.rollout.router import ROUTER_PIN, SGLangRouter
from tests.helpers import serving_url

pytest.importorskip("sglang_router", reason="sglang-router is installed by the dev extra")
KEY = "router-test-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}


class _Loop:
    """One event loop on a thread for the module: the router's client lives on it across tests."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=300)


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """(router, loop, [engine URLs], model directory): two engines, both registered with the router."""
    root = tmp_path_factory.mktemp("router")
    model = str(build_quickstart_model(root / "model"))
    engines = [subprocess.Popen([sys.executable, "-m", "rl360.cli", "serve", "rollout", "--model", model, "--port", "0",
                                 "--api-key-env", "RL360_TEST_ROUTER_KEY", "--batch-window-ms", "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "RL360_TEST_ROUTER_KEY": KEY, "OMP_NUM_THREADS": "1"})
               for _ in range(2)]
    urls = [serving_url(engine) for engine in engines]
    loop = _Loop()
    router = SGLangRouter("round_robin", KEY, root / "router.log", request_timeout_s=120)
    try:
        loop.run(router.start())
        for url in urls:
            loop.run(router.add(url))
        yield router, loop, urls, model
    finally:
        router.stop()
        for engine in engines:
            engine.terminate()
            engine.communicate(timeout=30)


def test_the_pinned_router_is_the_one_installed():
    from importlib.metadata import version

    assert version("sglang-router") == ROUTER_PIN


def test_generate_through_the_router_equals_a_direct_call(routed):
    router, _, urls, _ = routed
    body = {"text": "3+4=", "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 5},
            "return_logprob": True, "return_text_in_logprobs": True}
    direct = [httpx.post(f"{url}/generate", json=body, headers=AUTH, timeout=60).json() for url in urls]
    assert direct[0]["output_ids"] == direct[1]["output_ids"]  # the same weights and seed on either engine
    for _ in range(4):  # round robin: both engines answer through the router
        through = httpx.post(f"{router.url}/generate", json=body, headers=AUTH, timeout=60)
        assert through.status_code == 200, through.text
        reply = through.json()
        assert reply["text"] == direct[0]["text"] and reply["output_ids"] == direct[0]["output_ids"]
        ours = [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]]
        theirs = [entry[0] for entry in direct[0]["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= 1e-6
    served = [_responses(url) for url in urls]
    assert all(count >= 3 for count in served), served  # each engine: its direct call and two routed ones


def test_the_routers_client_gets_samples_like_the_fleets(routed):
    router, loop, urls, _ = routed
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=5)
    through = loop.run(router.generate([[5, 6, 7], [8, 9]], params, seed=11))

    async def direct():
        async with EngineClient(urls[1], api_key=KEY) as client:
            return await client.generate_samples([[5, 6, 7], [8, 9]], params, seed=11)

    straight = asyncio.run(direct())
    assert [[s.response_ids for s in group] for group in through] == [[s.response_ids for s in group]
                                                                      for group in straight]


@pytest.mark.parametrize("method, path", [("GET", "/get_server_info"), ("GET", "/get_model_info"),
                                          ("POST", "/flush_cache"), ("GET", "/health_generate"),
                                          ("GET", "/health")])
def test_routes_through_the_router_answer(routed, method, path):
    router, _, _, model = routed
    reply = httpx.request(method, f"{router.url}{path}", headers=AUTH, timeout=60)
    assert reply.status_code == 200, (path, reply.text)
    if path == "/get_model_info":  # forwarded to an engine
        assert reply.json()["model_path"] == model


def test_the_routers_control_plane_and_generate_need_the_key(routed):
    router, _, urls, _ = routed
    assert httpx.post(f"{router.url}/workers", json={"url": "http://127.0.0.1:9"}, timeout=10).status_code == 401
    assert httpx.post(f"{router.url}/generate", json={"text": "1+1="}, timeout=10).status_code == 401


def test_a_removed_engine_gets_nothing_until_it_is_added_back(routed):
    router, loop, urls, _ = routed
    body = {"text": "2+2=", "sampling_params": {"max_new_tokens": 2}}
    loop.run(router.remove(urls[0]))
    try:
        before = [_responses(url) for url in urls]
        for _ in range(4):
            assert httpx.post(f"{router.url}/generate", json=body, headers=AUTH, timeout=60).status_code == 200
        after = [_responses(url) for url in urls]
        assert after[0] == before[0] and after[1] == before[1] + 4
    finally:
        loop.run(router.add(urls[0]))
    assert router.workers == set(urls)


def test_no_key_on_the_routers_command_line(routed):
    router, _, _, _ = routed
    process = psutil.Process(router.process.pid)
    assert KEY not in " ".join(process.cmdline())
    assert KEY not in router.log_path.read_text()


def _responses(url: str) -> float:
    """Responses an engine has finished (its /metrics counter, all finish reasons)."""
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("rl360_rollout_responses_total"))
