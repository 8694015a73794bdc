"""sglang-router in front of the fleet's engines (`rollout.router=sglang`): the Rust router SGLang and slime put
in front of SGLang servers, started by the fleet as a process of its own and fed its engines as they become
current.

    router = SGLangRouter(policy="cache_aware", api_key=key, log_path=..., request_timeout_s=600)
    await router.start()                 # serving on 127.0.0.1, no worker yet
    await router.add(url)                # an engine that holds the current weights
    groups = await router.generate(prompts, params, seed)   # the router picks the engine
    await router.remove(url)             # a failed engine, before it is restarted
    router.stop()

The router only dispatches `/generate`: weight updates, pause/continue, memory release and restarts go from the
fleet to each engine directly, and an engine joins the router only once it serves the weights the fleet expects
(a restarted engine after the next weight sync). The router listens on 127.0.0.1 (only the trainer's process
calls it; it reaches engines on other nodes by their URLs). Workers are registered with the engines' key, which
the router puts on what it forwards to them; its control plane (adding and removing workers) takes the same key.
The key reaches the router's process through its environment (`RL360_ROUTER_KEY`), never its command line.

`python -m rl360.rollout.router --port P --policy X --request-timeout-s S` is the process: sglang-router's Python
API (`sglang_router.Router`), as its own launcher calls it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from rl360.core import Prompt, Sample, SamplingParams
from rl360.core.client import EngineClient
from rl360.network import free_port
from rl360.rollout.engines import _die_with_parent, generate_or_down

KEY_ENV = "RL360_ROUTER_KEY"
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
ROUTER_PIN = "0.3.2"  # the sglang-router release tests/test_sglang_router.py runs against
INSTALL_HINT = f"pip install 'rl360[router]' (sglang-router=={ROUTER_PIN})"


class RouterError(RuntimeError):
    """The router did not start, or did not take or drop a worker in time."""


class SGLangRouter:
    def __init__(self, policy: str, api_key: str, log_path: Path, request_timeout_s: float,
                 startup_timeout_s: float = 60.0):
        self.policy, self.api_key, self.log_path = policy, api_key, Path(log_path)
        self.request_timeout_s, self.startup_timeout_s = request_timeout_s, startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.client: EngineClient | None = None
        self.workers: set[str] = set()  # engine URLs registered with the router

    async def start(self) -> None:
        """Start the router process and wait until it answers; RouterError with its log's tail if it does not."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "rl360.rollout.router", "--port", str(port), "--policy", self.policy,
                   "--metrics-port", str(free_port()), "--request-timeout-s", str(int(self.request_timeout_s))]
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== start {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, KEY_ENV: self.api_key}, start_new_session=True,
                                            preexec_fn=_die_with_parent())
        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RouterError(f"sglang-router exited with code {self.process.returncode} while starting; "
                                      f"the end of {self.log_path}:\n{_tail(self.log_path)}")
                try:
                    if (await http.get(f"{self.url}/workers", headers=self._auth())).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.05)
            else:
                self.stop()
                raise RouterError(f"sglang-router did not answer within {self.startup_timeout_s:g} s; the end of "
                                  f"{self.log_path}:\n{_tail(self.log_path)}")
        self.client = EngineClient(self.url, api_key=self.api_key, timeout_s=self.request_timeout_s,
                                   one_prompt_per_request=True)

    async def generate(self, prompts: list[Prompt], params: SamplingParams, seed: int) -> list[list[Sample]]:
        """Samples through the router (it picks the engine); `EngineDown` when the router or the engine it picked
        did not answer."""
        return await generate_or_down(self.client, prompts, params, seed, f"sglang-router ({self.url})")

    async def add(self, url: str, timeout_s: float = 60.0) -> None:
        """Register the engine at `url` and wait until the router counts it healthy (it then takes requests)."""
        if url in self.workers:
            return
        async with httpx.AsyncClient(timeout=10.0) as http:
            reply = await http.post(f"{self.url}/workers", json={"url": url, "api_key": self.api_key},
                                    headers=self._auth())
            if reply.status_code >= 400:
                raise RouterError(f"sglang-router refused worker {url}: {reply.status_code} {reply.text[:300]}")
            await self._wait(http, lambda workers: workers.get(url, {}).get("is_healthy") is True,
                             f"take worker {url}", timeout_s)
        self.workers.add(url)

    async def remove(self, url: str, timeout_s: float = 30.0) -> None:
        """Unregister the engine at `url` (nothing if it is not registered) and wait until it is gone."""
        self.workers.discard(url)
        async with httpx.AsyncClient(timeout=10.0) as http:
            listed = await self._listed(http)
            if url not in listed:
                return
            reply = await http.delete(f"{self.url}/workers/{listed[url]['id']}", headers=self._auth())
            if reply.status_code >= 400 and reply.status_code != 404:
                raise RouterError(f"sglang-router did not drop worker {url}: {reply.status_code} {reply.text[:300]}")
            await self._wait(http, lambda workers: url not in workers, f"drop worker {url}", timeout_s)

    async def _listed(self, http: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
        reply = await http.get(f"{self.url}/workers", headers=self._auth())
        reply.raise_for_status()
        return {worker["url"]: worker for worker in reply.json().get("workers", [])}

    async def _wait(self, http: httpx.AsyncClient, done, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done(await self._listed(http)):
            if time.monotonic() > deadline:
                raise RouterError(f"sglang-router did not {what} within {timeout_s:g} s; see {self.log_path}")
            await asyncio.sleep(0.05)

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.workers.clear()

    def describe(self) -> dict:
        return {"url": self.url, "policy": self.policy, "pid": self.process.pid if self.process else None,
                "log": str(self.log_path), "workers": sorted(self.workers)}


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def main(argv: list[str] | None = None) -> int:
    """The router process: sglang-router on 127.0.0.1:PORT with no worker yet, its key from RL360_ROUTER_KEY."""
    parser = argparse.ArgumentParser(prog="python -m rl360.rollout.router")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware")
    parser.add_argument("--metrics-port", type=int, required=True, help="its Prometheus exporter's (127.0.0.1)")
    parser.add_argument("--request-timeout-s", type=int, default=600)
    args = parser.parse_args(argv)
    key = os.environ.get(KEY_ENV, "")
    if not key:
        raise SystemExit(f"python -m rl360.rollout.router: set {KEY_ENV} to the engines' key")
    from sglang_router.router import Router
    from sglang_router.router_args import RouterArgs

    router_args = RouterArgs(worker_urls=[], host="127.0.0.1", port=args.port, policy=args.policy, api_key=key,
                             request_timeout_secs=args.request_timeout_s, log_level="warn",
                             prometheus_host="127.0.0.1", prometheus_port=args.metrics_port,
                             control_plane_api_keys=[("rl360", "rl360 fleet", key, "admin")])
    Router.from_args(router_args).start()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
