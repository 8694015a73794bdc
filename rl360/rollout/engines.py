"""The rollout manager's engines, one interface for three kinds (`rollout.engine`):

- `hf`: `HFEngine` inside a Ray actor; weights arrive as Ray object-store buckets. One engine, no HTTP.
- `server`: `rl360 serve rollout` processes (the HF engine behind SGLang's native HTTP API).
- `sglang`: `python -m sglang.launch_server` processes (GPU only; needs `pip install sglang`).

Both process kinds are driven by the same `EngineClient`, started by the manager on 127.0.0.1 with a random
API key (`rl360 serve rollout` reads it from the environment; SGLang only takes `--api-key`), their output in
`<output_dir>/rollout/engine-<i>.log`. A process that dies or stops answering is restarted by
`ProcessEngine.restart`; it serves the weights it was started with until the next weight update reaches it.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from rl360.network import free_port
from rl360.rollout.base import Sample, SamplingParams
from rl360.rollout.client import EngineClient, EngineError, EngineTimeout

KEY_ENV = "RL360_ROLLOUT_API_KEY"
_SERVING_LINE = re.compile(r"serving .* on (http://\S+)")


class EngineDown(RuntimeError):
    """An engine that did not answer (connection refused or reset, a time-out, a 5xx): its work goes elsewhere."""


class ActorEngine:
    """The in-process HF engine, in a Ray actor (rollout.engine=hf)."""

    kind = "hf"

    def __init__(self, actor, index: int = 0):
        self.actor, self.index = actor, index
        self.version, self.usable = 0, True

    async def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[list[Sample]]:
        params = SamplingParams(**{**params.__dict__, "seed": seed})
        return await self.actor.generate.remote(prompts, params)

    def describe(self) -> dict:
        return {"index": self.index, "kind": self.kind}


class ProcessEngine:
    """One engine process speaking SGLang's HTTP API: started, health-checked, restarted, stopped."""

    def __init__(self, index: int, command: list[str], log_dir: Path, api_key: str, startup_timeout_s: float,
                 request_timeout_s: float, env: dict[str, str] | None = None, kind: str = "server"):
        self.index, self.command, self.kind = index, command, kind
        self.log_path = log_dir / f"engine-{index}.log"
        self.api_key, self.env = api_key, env or {}
        self.startup_timeout_s, self.request_timeout_s = startup_timeout_s, request_timeout_s
        self.process: subprocess.Popen | None = None
        self.client: EngineClient | None = None
        self.url = ""
        self.version = 0  # the weights it serves (0: the checkpoint it was started from)
        self.usable = False  # serving, with the weights the manager expects
        self.restarts = 0
        self.released: set[str] = set()  # memory tags released for training (rollout.colocate)

    async def start(self) -> None:
        """Launch the process and wait until it serves; RuntimeError (with its log's tail) if it does not."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"\n==== start {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(self.command)}\n".encode())
        log.flush()
        env = {**os.environ, **self.env, KEY_ENV: self.api_key}
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        log.close()
        self.url = await self._wait_serving()
        self.client = EngineClient(self.url, api_key=self.api_key, timeout_s=self.request_timeout_s)
        self.version, self.released = 0, set()

    async def _wait_serving(self) -> str:
        deadline = time.monotonic() + self.startup_timeout_s
        fixed_url = _url_from_command(self.command)
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"rollout engine {self.index} exited with code {self.process.returncode} while "
                                   f"starting; the end of {self.log_path}:\n{_tail(self.log_path)}")
            url = fixed_url or _served_url(self.log_path)
            if url and await _answers_health(url):
                return url
            await asyncio.sleep(0.05)
        self.stop()
        raise RuntimeError(f"rollout engine {self.index} did not serve within {self.startup_timeout_s:g} s "
                           f"(rollout.startup_timeout_s); the end of {self.log_path}:\n{_tail(self.log_path)}")

    async def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[list[Sample]]:
        try:
            groups = await self.client.generate_samples(prompts, params, seed=seed)
        except (EngineTimeout, httpx.TransportError, OSError) as err:
            raise EngineDown(f"engine {self.index} ({self.url}): {err}") from err
        except EngineError as err:
            if err.status >= 500:
                raise EngineDown(f"engine {self.index} ({self.url}): {err}") from err
            raise
        return groups  # aborted samples included (with the tokens drawn before the abort): the manager decides

    async def restart(self) -> None:
        self.stop()
        self.restarts += 1
        await self.start()

    def stop(self) -> None:
        """Kill the process group (SGLang starts helper processes) and forget the client."""
        self.usable = False
        if self.client is not None:
            client, self.client = self.client, None
            try:
                asyncio.get_running_loop().create_task(client.close())
            except RuntimeError:
                pass
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()

    def describe(self) -> dict:
        return {"index": self.index, "kind": self.kind, "url": self.url,
                "pid": self.process.pid if self.process else None, "log": str(self.log_path),
                "restarts": self.restarts}


def engine_command(kind: str, model_path: str, dtype: str, api_key: str, tensor_parallel: int = 1,
                   mem_fraction: float = 0.8, extra_args: list[str] | None = None) -> list[str]:
    """The command line of one engine process: `rl360 serve rollout` or SGLang's launcher."""
    extra = list(extra_args or [])
    if kind == "server":
        return [sys.executable, "-m", "rl360.rollout.server", "--model", model_path, "--port", "0", "--host",
                "127.0.0.1", "--dtype", dtype, "--api-key-env", KEY_ENV, *extra]
    if kind == "sglang":  # SGLang takes its key on the command line only; the port is fixed before the start
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", "127.0.0.1",
                "--port", str(free_port()), "--dtype", dtype, "--tp-size", str(tensor_parallel),
                "--mem-fraction-static", str(mem_fraction), "--api-key", api_key, "--skip-server-warmup", *extra]
    raise ValueError(f"no engine process for rollout.engine={kind!r}")


def new_api_key() -> str:
    return secrets.token_urlsafe(24)


def _url_from_command(command: list[str]) -> str | None:
    if "--port" in command and command[command.index("--port") + 1] != "0":
        host = command[command.index("--host") + 1] if "--host" in command else "127.0.0.1"
        return f"http://{host}:{command[command.index('--port') + 1]}"
    return None


def _served_url(log_path: Path) -> str | None:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    start = text.rfind("==== start")
    found = _SERVING_LINE.search(text, max(start, 0))
    return found.group(1) if found else None


async def _answers_health(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=2.0) as http:
            return (await http.get(f"{url}/health")).status_code == 200
    except httpx.HTTPError:
        return False


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
