"""Where `rl360 eval` sends its requests: OpenAI-compatible endpoints (`POST {url}/chat/completions`, the
server renders the chat), SGLang-protocol endpoints (`POST {url}/generate` with token ids rendered here, through
`rl360.core.client.EngineClient`), or engine servers started on a model directory (the rollout layer's
`ProcessEngine`: `rl360 serve rollout`, or real SGLang) and stopped at the end.

Every request is one sample (n=1) of one prompt with its own seed, so a sample's text depends only on the
prompt, the seed and the endpoint's weights, never on which endpoint drew it or when. A failure is a
`RequestFailed`: `retryable` for connection errors, time-outs, 429 and 5xx (the endpoint is also marked down
for a while), not for other 4xx (the request itself is wrong: recorded as that sample's error).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rl360.core import SamplingParams
from rl360.core.client import EngineClient, EngineError, EngineTimeout, reply_sample, sampling_options
from rl360.eval.config import EvalConfig, sampling_values
from rl360.eval.inputs import EvalPrompt


@dataclass
class Reply:
    text: str
    finish_reason: str  # stop | length
    tokens: int  # response tokens


class RequestFailed(Exception):
    def __init__(self, message: str, retryable: bool, status: int = 0):
        super().__init__(message)
        self.retryable, self.status = retryable, status  # status: the HTTP status (0: none came)

    @property
    def refused_key(self) -> bool:
        """The endpoint refused the key (401, 403): no request of this evaluation can succeed."""
        return self.status in (401, 403)


class Endpoint:
    """One endpoint: its URL, requests in flight, and when it may be used again after a failure."""

    def __init__(self, index: int, url: str, timeout_s: float):
        self.index, self.url, self.timeout_s = index, url.rstrip("/"), timeout_s
        self.in_flight = 0
        self.sent = 0
        self.failures = 0  # consecutive
        self.down_until = 0.0

    def usable(self, now: float) -> bool:
        return now >= self.down_until

    async def prepare(self) -> None:
        """Anything to learn before the first request (the served model's name)."""

    async def sample(self, prompt: EvalPrompt, seed: int) -> Reply:
        raise NotImplementedError

    async def restart(self) -> None:
        """Bring a failed endpoint back where rl360 runs it (engine servers it started); others: nothing."""

    async def close(self) -> None:
        """Release the endpoint's connections."""


class OpenAIEndpoint(Endpoint):
    def __init__(self, index: int, url: str, api_key: str, served_model: str, values: dict, timeout_s: float,
                 concurrency: int):
        super().__init__(index, url, timeout_s)
        self.served_model, self.values = served_model, values
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=None,
                                       limits=httpx.Limits(max_connections=concurrency))

    async def prepare(self) -> None:
        if self.served_model:
            return
        reply = await self._post_or_get("GET", "/models", None)
        models = [m.get("id") for m in reply.get("data", []) if isinstance(m, dict)]
        if not models:
            raise RequestFailed(f"{self.url}/models lists no model; set eval.served_model", False)
        self.served_model = str(models[0])

    def body(self, prompt: EvalPrompt, seed: int) -> dict[str, Any]:
        v = self.values
        body: dict[str, Any] = {"model": self.served_model, "messages": prompt.messages, "n": 1, "seed": seed,
                                "temperature": v["temperature"], "top_p": v["top_p"], "max_tokens": v["max_tokens"]}
        if v["top_k"] != -1:
            body["top_k"] = v["top_k"]
        if v["presence_penalty"] != 0:
            body["presence_penalty"] = v["presence_penalty"]
        if v["repetition_penalty"] != 1:
            body["repetition_penalty"] = v["repetition_penalty"]
        if v.get("stop"):
            body["stop"] = list(v["stop"])
        return body

    async def sample(self, prompt: EvalPrompt, seed: int) -> Reply:
        reply = await self._post_or_get("POST", "/chat/completions", self.body(prompt, seed))
        try:
            choice = reply["choices"][0]
            text = choice["message"]["content"] or ""
            tokens = int((reply.get("usage") or {}).get("completion_tokens", 0))
        except (KeyError, IndexError, TypeError, ValueError):
            raise RequestFailed(f"{self.url}/chat/completions: not a chat completion: {str(reply)[:200]}",
                                True) from None
        return Reply(text, "length" if choice.get("finish_reason") == "length" else "stop", tokens)

    async def _post_or_get(self, method: str, route: str, body: Any) -> dict:
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self._http.request(method, route, json=body)
        except TimeoutError:
            raise RequestFailed(f"{self.url}{route}: no reply within {self.timeout_s:g} s", True) from None
        except (httpx.TransportError, OSError) as err:
            raise RequestFailed(f"{self.url}{route}: {type(err).__name__}: {err}", True) from None
        if response.status_code >= 400:
            retry = response.status_code == 429 or response.status_code >= 500
            raise RequestFailed(f"{self.url}{route}: HTTP {response.status_code}: {response.text[:300]}", retry,
                                response.status_code)
        try:
            return response.json()
        except ValueError:
            raise RequestFailed(f"{self.url}{route}: reply is not JSON: {response.text[:200]}", True) from None

    async def close(self) -> None:
        await self._http.aclose()


class SGLangEndpoint(Endpoint):
    """SGLang's `/generate` through `EngineClient`: the prompt rendered with the chat template here, the reply's
    tokens decoded here."""

    def __init__(self, index: int, url: str, api_key: str, tokenizer: Any, values: dict, timeout_s: float,
                 engine: Any = None):
        super().__init__(index, url, timeout_s)
        from rl360.data import PromptRenderer

        self.api_key, self.tokenizer, self.values, self.engine = api_key, tokenizer, values, engine
        self.renderer = PromptRenderer(tokenizer, max_prompt_length=1 << 30)
        self.client = EngineClient(self.url, api_key=api_key or None, timeout_s=timeout_s)
        self._ids: dict[int, list[int]] = {}

    async def sample(self, prompt: EvalPrompt, seed: int) -> Reply:
        ids = self._ids.get(prompt.index)
        if ids is None:
            ids = self._ids[prompt.index] = self.renderer.render(prompt.messages)
        v = self.values
        stops = sorted({self.tokenizer.eos_token_id} - {None})
        options = sampling_options(SamplingParams(n=1, temperature=v["temperature"], top_p=v["top_p"],
                                                  top_k=v["top_k"], max_new_tokens=v["max_tokens"],
                                                  stop_token_ids=stops, presence_penalty=v["presence_penalty"],
                                                  repetition_penalty=v["repetition_penalty"],
                                                  stop=list(v.get("stop", []))))
        options["sampling_seed"] = seed
        try:
            replies = await self.client.generate([ids], [options], True)
            sample = reply_sample(ids, replies[0])
        except EngineTimeout as err:
            raise RequestFailed(str(err), True) from None
        except EngineError as err:
            raise RequestFailed(str(err), err.status == 429 or err.status >= 500 or err.status == 200,
                                err.status) from None
        except (httpx.TransportError, OSError) as err:
            raise RequestFailed(f"{self.url}/generate: {type(err).__name__}: {err}", True) from None
        if sample.finish_reason not in ("stop", "length"):
            raise RequestFailed(f"{self.url}/generate: sample ended with {sample.finish_reason!r}", True)
        text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        if sample.stop_matched and sample.stop_matched in text:  # the text before the stop string, as OpenAI's
            text = text[:text.index(sample.stop_matched)]
        return Reply(text, sample.finish_reason, len(sample.response_ids))

    async def restart(self) -> None:
        if self.engine is None:
            return
        print(f"eval: engine {self.engine.index} failed; restarting it", flush=True)
        await self.client.close()
        await self.engine.restart()
        self.url = self.engine.url
        self.client = EngineClient(self.url, api_key=self.api_key, timeout_s=self.timeout_s)

    async def close(self) -> None:
        await self.client.close()


def _engine_gpus(index: int, tensor_parallel: int) -> dict[str, str]:
    """Engine `index`'s GPUs: its `tensor_parallel` of those visible (CUDA_VISIBLE_DEVICES, else all); none
    on a machine without GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        import torch

        visible = ",".join(str(d) for d in range(torch.cuda.device_count()))
    devices = [d for d in visible.split(",") if d.strip()]
    if not devices:
        return {}
    mine = devices[index * tensor_parallel:(index + 1) * tensor_parallel]
    if len(mine) < tensor_parallel:
        from rl360.config import ConfigError

        raise ConfigError(f"eval.num_engines x eval.engine_tensor_parallel needs more GPUs than the {len(devices)} "
                          f"visible ({visible}); lower eval.num_engines")
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


async def open_endpoints(cfg: EvalConfig) -> tuple[list[Endpoint], list[Any]]:
    """The endpoints to send to, and the engine servers started for them (to stop at the end)."""
    t, values = cfg.eval, sampling_values(cfg.sampling)
    api_key = os.environ.get(t.api_key_env, "") if t.api_key_env else ""
    if t.model:
        from rl360.model_dir import check_model_dir
        from rl360.rollout.engines import ProcessEngine, engine_command, new_api_key

        check_model_dir(t.model, "eval.model")
        key = new_api_key()
        engines = [ProcessEngine(i, engine_command(t.engine, t.model, t.engine_dtype, t.engine_tensor_parallel,
                                                   t.engine_mem_fraction, list(t.engine_args)),
                                 Path(cfg.output_dir) / "engines", key, t.startup_timeout_s, t.request_timeout_s,
                                 env=_engine_gpus(i, t.engine_tensor_parallel), kind=t.engine)
                   for i in range(t.num_engines)]
        started = time.perf_counter()
        try:
            await asyncio.gather(*(engine.start() for engine in engines))
        except BaseException:
            for engine in engines:
                engine.stop()
            raise
        print(f"eval: {len(engines)} {t.engine} engine(s) serving {t.model} after "
              f"{time.perf_counter() - started:.1f} s: {', '.join(e.url for e in engines)}", flush=True)
        tokenizer = _tokenizer(t.tokenizer or t.model)
        return [SGLangEndpoint(i, e.url, key, tokenizer, values, t.request_timeout_s, engine=e)
                for i, e in enumerate(engines)], engines
    if t.protocol == "sglang":
        tokenizer = _tokenizer(t.tokenizer)
        return [SGLangEndpoint(i, url, api_key, tokenizer, values, t.request_timeout_s)
                for i, url in enumerate(t.endpoints)], []
    return [OpenAIEndpoint(i, url, api_key, t.served_model, values, t.request_timeout_s, t.concurrency)
            for i, url in enumerate(t.endpoints)], []
