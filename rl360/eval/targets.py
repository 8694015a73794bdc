"""Where `rl360 eval` sends its requests: OpenAI-compatible endpoints (`POST {url}/chat/completions`, the
server renders the chat), SGLang-protocol endpoints (`POST {url}/generate` with token ids rendered here, through
`rl360.core.client.EngineClient`), or engines started on a model directory (`eval.model`) as the rollout
layer's `EngineFleet` (`rl360 serve rollout`, or real SGLang; no policy, no weight sync) and stopped at the end;
during training, the run's own sampler (`SamplerTarget`: its engines, agent loop and renderer).

The fleet is one target (`FleetTarget`): it sends each request to its least-loaded usable engine, with its GPU
assignment (engine i on GPUs [i * tp, (i + 1) * tp) of those visible) and its restart policy: an engine that fails
a request (gone, no reply within `eval.request_timeout_s`, a 5xx, aborted samples) is restarted and the request
sent to another or, with none left, to it once it serves again; more than `eval.max_engine_restarts` restarts end
the evaluation. Endpoints rl360 did not start are never restarted: one that fails rests (the runner's backoff).

Every request is one sample (n=1) of one prompt with its own seed, so a sample's text depends only on the
prompt, the seed and the endpoint's weights, never on which endpoint drew it or when. A failure is a
`RequestFailed`: `retryable` for connection errors, time-outs, 429 and 5xx (the endpoint is also marked down
for a while), not for other 4xx (the request itself is wrong: recorded as that sample's error).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from rl360.config import ConfigError, ModelConfig, RolloutConfig
from rl360.core import Sample, SamplingParams
from rl360.core.client import EngineClient, EngineError, EngineTimeout, reply_sample, sampling_options
from rl360.eval.config import EvalConfig, EvalTargetConfig, sampling_values
from rl360.eval.inputs import EvalPrompt

if TYPE_CHECKING:
    from rl360.cluster.placement import Placement


@dataclass
class Reply:
    text: str
    finish_reason: str  # stop | length
    tokens: int  # response tokens
    trajectory: dict | None = None  # a multi-turn trajectory's summary (`TrajectorySummary.as_dict`) for the reward


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

    def __init__(self, index: int, url: str, timeout_s: float, capacity: int = 1):
        self.index, self.url, self.timeout_s = index, url.rstrip("/"), timeout_s
        self.capacity = capacity  # requests in flight at most
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

    async def close(self) -> None:
        """Release the endpoint's connections."""


class OpenAIEndpoint(Endpoint):
    def __init__(self, index: int, url: str, api_key: str, served_model: str, values: dict, timeout_s: float,
                 concurrency: int):
        super().__init__(index, url, timeout_s, concurrency)
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


class TokenTarget(Endpoint):
    """A target fed token ids: the prompt rendered with the chat template here (once per prompt), the reply's
    tokens decoded here and cut before the stop string that ended it, as OpenAI's text is."""

    def __init__(self, index: int, url: str, tokenizer: Any, values: dict, timeout_s: float, capacity: int = 1):
        super().__init__(index, url, timeout_s, capacity)
        from rl360.data import PromptRenderer

        self.tokenizer, self.values = tokenizer, values
        self.renderer = PromptRenderer(tokenizer, max_prompt_length=1 << 30)
        self._ids: dict[int, list[int]] = {}

    def prompt_ids(self, prompt: EvalPrompt) -> list[int]:
        ids = self._ids.get(prompt.index)
        if ids is None:
            ids = self._ids[prompt.index] = self.renderer.render(prompt.messages)
        return ids

    def params(self) -> SamplingParams:
        v = self.values
        stops = sorted({self.tokenizer.eos_token_id} - {None})
        return SamplingParams(n=1, temperature=v["temperature"], top_p=v["top_p"], top_k=v["top_k"],
                              max_new_tokens=v["max_tokens"], stop_token_ids=stops,
                              presence_penalty=v["presence_penalty"], repetition_penalty=v["repetition_penalty"],
                              stop=list(v.get("stop", [])))

    def reply(self, sample: Sample) -> Reply:
        text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        if sample.stop_matched and sample.stop_matched in text:  # the text before the stop string, as OpenAI's
            text = text[:text.index(sample.stop_matched)]
        return Reply(text, sample.finish_reason, len(sample.response_ids))


class SGLangEndpoint(TokenTarget):
    """SGLang's `/generate` at a running server, through `EngineClient`."""

    def __init__(self, index: int, url: str, api_key: str, tokenizer: Any, values: dict, timeout_s: float,
                 concurrency: int = 1):
        super().__init__(index, url, tokenizer, values, timeout_s, concurrency)
        self.client = EngineClient(self.url, api_key=api_key or None, timeout_s=timeout_s)

    async def sample(self, prompt: EvalPrompt, seed: int) -> Reply:
        ids = self.prompt_ids(prompt)
        options = sampling_options(self.params())
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
        return self.reply(sample)

    async def close(self) -> None:
        await self.client.close()


class FleetTarget(TokenTarget):
    """The engines started on `eval.model`, as one target: every request is `fleet.generate([prompt], n=1, seed)`,
    which picks the engine, restarts one that fails and sends the request again. A request an engine refuses
    (a 4xx) is that sample's error."""

    def __init__(self, fleet: Any, tokenizer: Any, values: dict, timeout_s: float, capacity: int):
        super().__init__(0, "fleet", tokenizer, values, timeout_s, capacity)
        self.fleet = fleet

    async def sample(self, prompt: EvalPrompt, seed: int) -> Reply:
        try:
            [[sample]] = await self.fleet.generate([self.prompt_ids(prompt)], self.params(), seed)
        except EngineError as err:
            raise RequestFailed(str(err), False, err.status) from None
        return self.reply(sample)

    async def close(self) -> None:
        self.fleet.close()


class SamplerTarget(Endpoint):
    """A training run's sampler as one target (evaluation during training): every request is one sample of the
    prompt's row (`EvalPrompt.row`, rendered by the run's renderer, images included) through the sampler's
    `generate_group` (the agent loop with its tools where one is set) on the run's engines, with the run's stop
    tokens; the reply's text is the whole response decoded, as training scores it, with the trajectory's summary.
    Its requests run on the sampler's thread (`RolloutSampler.run`)."""

    def __init__(self, sampler: Any, rollout: RolloutConfig, capacity: int):
        super().__init__(0, "the run's engines", rollout.request_timeout_s, capacity)
        self.sampler, self.rollout = sampler, replace(rollout, n=1)

    async def sample(self, prompt: EvalPrompt, seed: int) -> Reply:
        try:
            [sample] = await self.sampler.sample([prompt.row], self.rollout, seed)
        except EngineError as err:
            raise RequestFailed(str(err), False, err.status) from None
        summary = self.sampler.summary(sample)
        text = self.sampler.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        return Reply(text, sample.finish_reason, len(sample.response_ids),
                     None if summary is None else summary.as_dict())


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _visible_gpus() -> int:
    """GPUs this process may use: those CUDA_VISIBLE_DEVICES lists, else all that CUDA sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    import torch

    return torch.cuda.device_count()


def fleet_settings(t: EvalTargetConfig) -> tuple[RolloutConfig, ModelConfig, Placement]:
    """The rollout and model settings and the placement of the engines `eval.model` starts: `eval.num_engines`
    engines of `eval.engine_tensor_parallel` GPUs each, engine i on the i-th run of them (none on a machine
    without GPUs)."""
    from rl360.cluster.placement import make_placement

    rollout = RolloutConfig(engine=t.engine, num_engines=t.num_engines, colocate=False,
                            engine_tensor_parallel=t.engine_tensor_parallel, mem_fraction=t.engine_mem_fraction,
                            engine_args=list(t.engine_args), request_timeout_s=t.request_timeout_s,
                            startup_timeout_s=t.startup_timeout_s, max_engine_restarts=t.max_engine_restarts)
    gpus = _visible_gpus()
    if gpus and t.num_engines * t.engine_tensor_parallel > gpus:
        raise ConfigError(f"eval.num_engines x eval.engine_tensor_parallel = "
                          f"{t.num_engines * t.engine_tensor_parallel} GPUs, more than the {gpus} visible; lower "
                          "eval.num_engines")
    return rollout, ModelConfig(path=t.model, dtype=t.engine_dtype), make_placement(0, False, rollout, gpus)


async def start_fleet(cfg: EvalConfig) -> Any:
    """The engine fleet on `eval.model`, serving (its engines' logs in `<output_dir>/engines`)."""
    from rl360.rollout.fleet import EngineFleet

    t = cfg.eval
    rollout, model, placement = fleet_settings(t)
    fleet = EngineFleet(rollout, model, placement, None, Path(cfg.output_dir) / "engines", config_section="eval")
    started = time.perf_counter()
    try:
        await fleet.start()
    except BaseException:
        fleet.close()
        raise
    print(f"eval: {len(fleet.engines)} {t.engine} engine(s) serving {t.model} after "
          f"{time.perf_counter() - started:.1f} s: {', '.join(e.url for e in fleet.engines)}", flush=True)
    return fleet


async def open_endpoints(cfg: EvalConfig) -> list[Endpoint]:
    """The targets to send to: the fleet started on `eval.model` (closing it stops its engines), or the
    endpoints named."""
    t, values = cfg.eval, sampling_values(cfg.sampling)
    if t.model:
        from rl360.model_dir import check_model_dir

        check_model_dir(t.model, "eval.model")
        tokenizer = _tokenizer(t.tokenizer or t.model)  # before the engines start: a bad one starts none
        return [FleetTarget(await start_fleet(cfg), tokenizer, values, t.request_timeout_s,
                            t.concurrency * t.num_engines)]
    api_key = os.environ.get(t.api_key_env, "") if t.api_key_env else ""
    if t.protocol == "sglang":
        tokenizer = _tokenizer(t.tokenizer)
        return [SGLangEndpoint(i, url, api_key, tokenizer, values, t.request_timeout_s, t.concurrency)
                for i, url in enumerate(t.endpoints)]
    return [OpenAIEndpoint(i, url, api_key, t.served_model, values, t.request_timeout_s, t.concurrency)
            for i, url in enumerate(t.endpoints)]
