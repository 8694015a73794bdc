"""The fleet's engines, one protocol (`Engine`) for the kinds of `rollout.engine`, whose capabilities are one
table (`rl360.core.engine_kinds`, read by the config's checks too; each engine carries its kind's as
`capabilities`):

- `hf`: `HFEngine` inside a Ray actor (`ActorEngine`); weights arrive as Ray object-store buckets. One engine,
  no HTTP, nothing to pause, release or restart.
- `server`: `rl360 serve rollout` processes (the HF engine behind SGLang's native HTTP API).
- `sglang`: `python -m sglang.launch_server` processes (GPU only; needs `pip install sglang`).

Both process kinds are `ProcessEngine`s driven by the same `EngineClient`, started by the fleet with a random API
key (`rl360 serve rollout` reads it from the environment; SGLang only takes `--api-key`), their output in
`<output_dir>/rollout/engine-<i>.log`: on 127.0.0.1 in the trainer's process (`rollout.engine_hosts=local`),
or each inside an `EngineNode` Ray actor that reserves the engine's GPUs on whichever node Ray picks and serves
on that node's address (`ray`: engines on other nodes than the trainer's). A process that dies or stops
answering is restarted by `ProcessEngine.restart` (on the same node); it serves the weights it was started with
until the next weight update reaches it. An engine process dies with the process that started it (Linux's
parent-death signal, set for the thread that launched it: the fleet's event loop, or the `EngineNode` actor's),
so a trainer killed by SIGKILL, the OOM killer or Slurm leaves no engine holding a GPU.

Every difference between the kinds is behind the `Engine` protocol (generate, pause/continue, release/resume
memory, weight sync, restart), so the fleet never asks which kind an engine is.

Prompts are token ids or `ImagePrompt`s (vision-language models), mixed: the Ray actor takes them as they are,
the processes as `EngineClient.generate_samples` sends them (SGLang's `image_data`); samples carry their images.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from rl360.core import Prompt, Sample, SamplingParams
from rl360.core.client import EngineClient, EngineError, EngineTimeout
from rl360.core.engine_kinds import EngineKind, engine_kind
from rl360.network import free_port

KEY_ENV = "RL360_ROLLOUT_API_KEY"
KEY_FILE = "{rl360-engine-key-file}"  # in an engine command: the private file holding its key, written at its start
_SERVING_LINE = re.compile(r"serving .* on (http://\S+)")


class EngineDown(RuntimeError):
    """An engine that did not answer (connection refused or reset, a time-out, a 5xx): its work goes elsewhere."""


class EnginesDown(RuntimeError):
    """A weight update that failed because some of its engines died on the way: they are restarted and the
    update tried again."""

    def __init__(self, engines: list, cause: BaseException):
        super().__init__(str(cause))
        self.engines, self.cause = engines, cause


_DOWN = (EngineTimeout, httpx.TransportError, OSError)  # what says an engine is gone (not a refused request)


@dataclass(frozen=True)
class WeightSyncArgs:
    """How the policy's weights reach engine processes: `rollout.weight_sync`, the engines' API key and a scratch
    directory (disk: the checkpoint the engines load; tensor: a place beside /dev/shm)."""

    strategy: str
    api_key: str
    scratch_dir: Path


class Engine(Protocol):
    """One rollout engine as the fleet drives it. `usable`: serving the weights the fleet expects (`version`)."""

    index: int
    kind: str
    capabilities: EngineKind  # what its kind can do (`rl360.core.engine_kinds.ENGINE_KINDS[kind]`)
    url: str  # "" where the engine has no HTTP address
    log_path: Path | None
    version: int
    usable: bool
    supports_pause: bool  # `pause` aborts requests in flight (partial rollouts); False: an update waits for them

    async def start(self) -> None: ...

    async def alive(self) -> bool: ...

    async def generate(self, prompts: list[Prompt], params: SamplingParams, seed: int) -> list[list[Sample]]:
        """`params.n` samples per prompt, sample j of prompt i seeded `seed + i * n + j`; EngineDown when the
        engine is gone. Aborted samples come back with the tokens drawn before the abort."""
        ...

    async def pause(self) -> bool:
        """Abort generate requests in flight; whether the engine did (EngineDown when it is gone)."""
        ...

    async def resume_generation(self) -> None: ...

    async def release(self, tags: list[str]) -> bool:
        """Free the memory under `tags` for training (colocate); whether anything was freed."""
        ...

    async def resume(self, tags: list[str]) -> bool:
        """Take back the memory under released `tags`; whether anything was taken back."""
        ...

    async def sync_weights(self, policy: Any, version: int, peers: list[Engine],
                           args: WeightSyncArgs) -> dict[str, float]:
        """The policy's weights into this engine and its `peers` (the fleet's engines, this one included; one
        send reaches them all), as `version`; EnginesDown when some of them died on the way."""
        ...

    async def restart(self) -> None: ...

    def stop(self) -> None: ...

    def describe(self) -> dict: ...


class ActorEngine:
    """The in-process HF engine, in a Ray actor (rollout.engine=hf): nothing to pause, release or restart."""

    kind = "hf"
    capabilities = engine_kind("hf")
    url = ""
    log_path = None
    supports_pause = False

    def __init__(self, actor, index: int = 0, group: Any = None):
        self.actor, self.index, self.group = actor, index, group  # group: the WorkerGroup that started it
        self.version, self.usable = 0, True

    async def start(self) -> None:
        self.usable = True  # the actor was started with its worker group

    async def alive(self) -> bool:
        return True

    async def generate(self, prompts: list[Prompt], params: SamplingParams, seed: int) -> list[list[Sample]]:
        params = SamplingParams(**{**params.__dict__, "seed": seed})
        return await self.actor.generate.remote(prompts, params)

    async def pause(self) -> bool:
        return False

    async def resume_generation(self) -> None:
        return None

    async def release(self, tags: list[str]) -> bool:
        return False

    async def resume(self, tags: list[str]) -> bool:
        return False

    async def sync_weights(self, policy: Any, version: int, peers: list[Engine],
                           args: WeightSyncArgs) -> dict[str, float]:
        """The policy's buckets, streamed from its export ranks through Ray's object store into the actor."""
        pending = []
        async for bucket_ref in policy.export_weights():
            pending.append(self.actor.update_weights.remote(bucket_ref, version))
        await asyncio.gather(*pending)
        await self.actor.finish_weight_update.remote(version)
        return {}

    async def restart(self) -> None:
        raise RuntimeError("the in-process rollout engine (rollout.engine=hf) cannot be restarted")

    def stop(self) -> None:
        """The actor killed and its reservation freed (a Ray that an in-process `train()` joined goes on)."""
        import ray

        if self.group is not None and ray.is_initialized():
            self.group.shutdown()

    def describe(self) -> dict:
        return {"index": self.index, "kind": self.kind}


class EngineProcess:
    """The process side of an engine: launched, health-checked, killed (its whole process group: SGLang starts
    helpers). Runs in the trainer's process (`rollout.engine_hosts=local`) or inside an `EngineNode` actor on
    the node Ray placed it on (`ray`)."""

    def __init__(self, index: int, command: list[str], log_path: Path, api_key: str, startup_timeout_s: float,
                 env: dict[str, str] | None = None):
        self.index, self.command, self.log_path = index, command, Path(log_path)
        self.api_key, self.env, self.startup_timeout_s = api_key, env or {}, startup_timeout_s
        self.process: subprocess.Popen | None = None

    async def start(self) -> str:
        """Launch the process and wait until it serves; its URL. RuntimeError (with its log's tail) if not."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"\n==== start {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(self.command)}\n".encode())
        log.flush()
        env = {**os.environ, **self.env, KEY_ENV: self.api_key}
        key_file = _key_file(self.api_key) if KEY_FILE in self.command else None
        command = [key_file if part == KEY_FILE else part for part in self.command]
        try:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True, preexec_fn=_die_with_parent())
            log.close()
            return await self._wait_serving()
        finally:
            if key_file is not None:  # read by the server at its start
                Path(key_file).unlink(missing_ok=True)

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

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()


def _die_with_parent():
    """A `preexec_fn` that has the child SIGKILLed when the thread that started it ends (prctl's
    PR_SET_PDEATHSIG; Linux only, else None). libc's prctl is looked up here, in the parent, so the child only
    makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    set_death_signal = 1  # PR_SET_PDEATHSIG

    def die_with_parent() -> None:
        prctl(set_death_signal, signal.SIGKILL, 0, 0, 0)

    return die_with_parent


class EngineNode:
    """A Ray actor holding one `EngineProcess` on the node Ray placed it on (with the GPUs it reserved); the
    process serves on that node's address. Made by `ProcessEngine` with `rollout.engine_hosts=ray`."""

    def __init__(self, *args, **kwargs):
        import ray

        self.node_ip = ray.util.get_node_ip_address()
        self.process = EngineProcess(*args, **kwargs)
        command = self.process.command  # serve on this node's address, where the trainer can reach it
        command[command.index("--host") + 1] = self.node_ip
        if command[command.index("--port") + 1] != "0":  # a port picked on the trainer's node: pick one here
            command[command.index("--port") + 1] = str(free_port())

    async def start(self) -> str:
        return await self.process.start()

    def alive(self) -> bool:
        return self.process.alive()

    def where(self) -> dict:
        return {"node": self.node_ip, "pid": self.process.pid()}

    def stop(self) -> None:
        self.process.stop()


class ProcessEngine:
    """One engine process speaking SGLang's HTTP API, as the fleet sees it: its client, the weights it
    serves, restarts. The process runs here (`hosts="local"`) or on a node Ray picks (`hosts="ray"`: an
    `EngineNode` actor reserving `num_gpus`)."""

    supports_pause = True

    def __init__(self, index: int, command: list[str], log_dir: Path, api_key: str, startup_timeout_s: float,
                 request_timeout_s: float, env: dict[str, str] | None = None, kind: str = "server",
                 hosts: str = "local", num_gpus: float = 0):
        self.index, self.kind, self.hosts = index, kind, hosts
        self.capabilities = engine_kind(kind)
        self.log_path = log_dir / f"engine-{index}.log"
        self.api_key, self.request_timeout_s = api_key, request_timeout_s
        self._process_args = (index, command, self.log_path, api_key, startup_timeout_s, env)
        self._num_gpus = num_gpus
        self.process: EngineProcess | None = None
        self.node = None  # the EngineNode actor (hosts="ray")
        self.where: dict = {}  # node address and pid of the running process
        self.client: EngineClient | None = None
        self.url = ""
        self.version = 0  # the weights it serves (0: the checkpoint it was started from)
        self.usable = False  # serving, with the weights the fleet expects
        self.restarts = 0
        self.released: set[str] = set()  # memory tags released for training (rollout.colocate)

    async def start(self) -> None:
        """Launch the process and wait until it serves; RuntimeError (with its log's tail) if it does not."""
        if self.hosts == "ray":
            import ray

            for attempt in range(2):  # a node that is gone: once more with a new actor, wherever Ray places it
                if self.node is None:
                    self.node = ray.remote(EngineNode).options(num_cpus=0, num_gpus=self._num_gpus).remote(
                        *self._process_args)
                try:
                    self.url = await self.node.start.remote()
                    break
                except ray.exceptions.RayActorError:
                    self.node = None
                    if attempt:
                        raise
            self.where = await self.node.where.remote()
        else:
            self.process = EngineProcess(*self._process_args)
            self.url = await self.process.start()
            self.where = {"node": "local", "pid": self.process.pid()}
        self.client = EngineClient(self.url, api_key=self.api_key, timeout_s=self.request_timeout_s)
        self.version, self.released = 0, set()

    async def alive(self) -> bool:
        """Whether the process still runs (False as well when its node cannot be reached)."""
        if self.node is not None:
            import ray

            try:
                return await self.node.alive.remote()
            except ray.exceptions.RayError:
                return False
        return self.process is not None and self.process.alive()

    async def generate(self, prompts: list[Prompt], params: SamplingParams, seed: int) -> list[list[Sample]]:
        return await generate_or_down(self.client, prompts, params, seed, f"engine {self.index} ({self.url})")

    async def pause(self) -> bool:
        if self.client is None or not self.usable:
            return False
        await self._down_on_failure(self.client.pause_generation("abort"))
        return True

    async def resume_generation(self) -> None:
        if self.client is not None and self.usable:
            await self._down_on_failure(self.client.continue_generation())

    async def release(self, tags: list[str]) -> bool:
        if self.client is None or set(tags) & self.released:  # a restarted engine holds what it has
            return False
        await self._down_on_failure(self.client.release_memory_occupation(tags))
        self.released = self.released | set(tags)
        return True

    async def resume(self, tags: list[str]) -> bool:
        if self.client is None or not set(tags) & self.released:
            return False
        await self._down_on_failure(self.client.resume_memory_occupation(tags))
        self.released = self.released - set(tags)
        return True

    async def _down_on_failure(self, call) -> None:
        try:
            await call
        except _DOWN as err:
            raise EngineDown(f"engine {self.index} ({self.url}): {str(err) or type(err).__name__}") from err

    async def sync_weights(self, policy: Any, version: int, peers: list[Engine],
                           args: WeightSyncArgs) -> dict[str, float]:
        """The policy group's export ranks send straight to every peer's URL (one distributed group, one shared
        memory file or one checkpoint for all of them)."""
        import ray

        args.scratch_dir.mkdir(parents=True, exist_ok=True)
        try:
            return await policy.send_weights([peer.url for peer in peers], args.strategy, version, args.api_key,
                                             str(args.scratch_dir))
        except ray.exceptions.RayTaskError as err:
            alive = await asyncio.gather(*(peer.alive() for peer in peers))
            dead = [peer for peer, running in zip(peers, alive) if not running]
            if not dead:
                raise
            raise EnginesDown(dead, err) from err

    async def restart(self) -> None:
        """Kill the process and start it again (on the same node, with the same GPUs, when Ray placed it)."""
        self.usable = False
        self._forget_client()
        if self.node is not None:
            import ray

            try:
                await self.node.stop.remote()
            except ray.exceptions.RayActorError:
                self.node = None
        elif self.process is not None:
            self.process.stop()
        self.restarts += 1
        await self.start()

    def stop(self) -> None:
        """Kill the process group (SGLang starts helper processes), end its node actor, forget the client."""
        self.usable = False
        self._forget_client()
        if self.node is not None:
            import ray

            try:
                ray.get(self.node.stop.remote(), timeout=30)
            except ray.exceptions.RayError:
                pass
            ray.kill(self.node)
            self.node = None
        elif self.process is not None:
            self.process.stop()

    def _forget_client(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            try:
                asyncio.get_running_loop().create_task(client.close())
            except RuntimeError:
                pass

    def describe(self) -> dict:
        devices = (self._process_args[5] or {}).get("CUDA_VISIBLE_DEVICES")  # engine_hosts=local on GPUs
        return {"index": self.index, "kind": self.kind, "url": self.url, "node": self.where.get("node"),
                "pid": self.where.get("pid"), "log": str(self.log_path), "restarts": self.restarts,
                **({"gpus": devices} if devices is not None else {})}


async def generate_or_down(client: EngineClient, prompts: list[Prompt], params: SamplingParams, seed: int,
                           who: str) -> list[list[Sample]]:
    """`client.generate_samples`, a failure that says the server is gone (no connection, no answer in time, a
    5xx) raised as `EngineDown` naming `who`. Aborted samples are returned (with the tokens drawn before the
    abort): the fleet decides."""
    try:
        return await client.generate_samples(prompts, params, seed=seed)
    except _DOWN as err:
        raise EngineDown(f"{who}: {err}") from err
    except EngineError as err:
        if err.status >= 500:
            raise EngineDown(f"{who}: {err}") from err
        raise


def engine_command(kind: str, model_path: str, dtype: str, tensor_parallel: int = 1, mem_fraction: float = 0.8,
                   extra_args: list[str] | None = None) -> list[str]:
    """The command line of one engine process: `rl360 serve rollout` or SGLang's launcher. It holds no key: the
    process reads it from its environment (`KEY_ENV`) or from a private file made at its start (`KEY_FILE`)."""
    extra = list(extra_args or [])
    if kind == "server":
        return [sys.executable, "-m", "rl360.engine.server", "--model", model_path, "--port", "0", "--host",
                "127.0.0.1", "--dtype", dtype, "--api-key-env", KEY_ENV, *extra]
    if kind == "sglang":  # the key in SGLang's --config file (never on a command line); the port fixed before
        return [sys.executable, "-m", "sglang.launch_server", "--config", KEY_FILE, "--model-path", model_path,
                "--host", "127.0.0.1", "--port", str(free_port()), "--dtype", dtype, "--tp-size", str(tensor_parallel),
                "--mem-fraction-static", str(mem_fraction), "--skip-server-warmup", *extra]
    raise ValueError(f"no engine process for rollout.engine={kind!r}")


def _key_file(api_key: str) -> str:
    """A new file only this user can read, holding SGLang's `api-key` option as YAML (SGLang's `--config`)."""
    handle, path = tempfile.mkstemp(prefix="rl360-engine-key-", suffix=".yaml")
    with os.fdopen(handle, "w") as file:  # mkstemp makes it mode 0600
        file.write(f"api-key: {json.dumps(api_key)}\n")
    return path


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
