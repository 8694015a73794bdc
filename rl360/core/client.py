"""`EngineClient`: the trainer's side of SGLang's native HTTP API, the same for a real SGLang server and for
`rl360 serve rollout` (asyncio + httpx).

    client = EngineClient("http://127.0.0.1:30000", api_key=None, timeout_s=600)
    samples = await client.generate_samples([[1, 2, 3]], SamplingParams(n=4, max_new_tokens=64), seed=7)
    await client.update_weights_from_tensor(bucket, weight_version=3, last_bucket=False)  # ... then last=True
    await client.pause_generation("in_place"); await client.continue_generation()

Image prompts (`rl360.core.ImagePrompt`: ids with every image expanded, compressed images) go out as
SGLang 0.5.17 takes them: each prompt's ids with every image's run of image tokens collapsed to one image token
(SGLang expands `<|vision_start|><|image_pad|><|vision_end|>` itself: `_expand_input_ids` in
`srt/multimodal/processors/base_processor.py` refuses ids with more image tokens than images), `image_data` with
one list per prompt of the images as data URLs (`data:image/png;base64,...`; [] for a text prompt in the same
batch; a bare base64 JPEG, which starts with "/", would be opened as a file path by SGLang's `get_image_bytes`)
and `return_prompt_token_ids: true`. Each reply's `prompt_token_ids` (the engine's expansion) must equal the
prompt's own ids, so the samples' `prompt_ids` are the ids the trainer trains on; a difference (the engine's
processor resizes the images differently) is an `EngineError`. The image token's id is the client's
`image_token_id`, or else read once from `config.json` in the engine's `/model_info` `model_path`.

Every call is bounded as a whole by `timeout_s` (connecting, sending, waiting and reading together; a call
may pass its own shorter or longer `timeout_s`): past it, `EngineTimeout`. A reply other than 2xx, or a
weight update answered `success: false`, raises `EngineError` with the engine's URL, the route, the status
and the server's message. Transport errors (the engine is unreachable) are httpx's own. With `api_key`,
every request carries `Authorization: Bearer <key>`.

Weights: `update_weights_from_tensor` sends a bucket in the `load_format` "rl360_safetensors" (base64
safetensors, `rl360 serve rollout` only: a real SGLang server takes pickled tensor handles, which are not
sent from here); `update_weights_from_serialized` sends one already serialized entry in any `load_format`
(the shared-memory and CUDA IPC descriptors of `rl360.weight_sync`); `init_weights_update_group`,
`update_weights_from_distributed` and `destroy_weights_update_group` are SGLang's group routes (the tensors
themselves travel by broadcast: `rl360.weight_sync.sender.WeightSender` drives them);
`release_memory_occupation` / `resume_memory_occupation` take SGLang's `tags` ("weights", "kv_cache",
"cuda_graph"; None: all); `get_weights_by_name` returns a parameter's values as nested lists (float32 values,
the first `truncate_size` rows), as SGLang does.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

from rl360.core.prompt import ImagePrompt, Prompt, prompt_ids
from rl360.core.routes import decode_routes
from rl360.core.sampling import SamplingParams
from rl360.core.trajectory import Sample
from rl360.core.wire import TENSOR_LOAD_FORMAT, encode_tensor_bucket


class EngineError(RuntimeError):
    """A request the engine refused or failed: the engine's `url`, `route`, HTTP `status` (0: no reply) and
    the server's `message`."""

    def __init__(self, route: str, status: int, message: str, url: str = ""):
        super().__init__(f"{url}{route}: HTTP {status}: {message}" if status else f"{url}{route}: {message}")
        self.route, self.status, self.message, self.url = route, status, message, url

    def __reduce__(self):  # raised in Ray workers too: rebuilt from the same fields on the other side
        return type(self), (self.route, self.status, self.message, self.url)


class EngineTimeout(EngineError):
    """A request that did not complete within its time bound."""


class EngineClient:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0,
                 max_connections: int = 256, image_token_id: int | None = None, one_prompt_per_request: bool = False):
        """`one_prompt_per_request`: `generate_samples` sends each prompt as a request of its own, its fields in
        their one-prompt forms (what sglang-router takes: its `sampling_params` is one object)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.one_prompt_per_request = one_prompt_per_request
        self.image_token_id = image_token_id  # None: read from the served checkpoint's config at the first image
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=None,
                                       limits=httpx.Limits(max_connections=max_connections))

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ---- generation ----
    async def generate(self, input_ids: list[list[int]] | list[int], sampling_params: dict | list[dict],
                       return_logprob: bool = True, logprob_start_len: int | None = None,
                       rid: str | list[str] | None = None, timeout_s: float | None = None,
                       image_data: list[list[str]] | list[str] | None = None,
                       return_prompt_token_ids: bool = False, return_routed_experts: bool = False) -> list[dict]:
        """SGLang's `/generate` for a batch of prompts; its replies as a list (prompt-major when n > 1).
        `image_data`: one list of images (base64 strings or data URLs) per prompt."""
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params,
                                "return_logprob": return_logprob}
        if logprob_start_len is not None:
            body["logprob_start_len"] = logprob_start_len
        if rid is not None:
            body["rid"] = rid
        if image_data is not None:
            body["image_data"] = image_data
        if return_prompt_token_ids:
            body["return_prompt_token_ids"] = True
        if return_routed_experts:  # SGLang: the server started with --enable-return-routed-experts
            body["return_routed_experts"] = True
        reply = await self._call("POST", "/generate", body, timeout_s)
        return reply if isinstance(reply, list) else [reply]

    async def generate_samples(self, prompts: list[Prompt], params: SamplingParams, seed: int | None = None,
                               rid: str | None = None, timeout_s: float | None = None) -> list[list[Sample]]:
        """`params.n` samples for each prompt (token ids or `ImagePrompt`s, mixed), in prompt order, as the engine
        interface's `Sample`s (an image prompt's carry its expanded ids and its images). With `seed`, prompt i's
        samples draw from `seed + i * n + j` (on `rl360 serve rollout`: reproducible)."""
        if self.one_prompt_per_request and len(prompts) > 1:
            parts = await asyncio.gather(*(self.generate_samples(
                [prompt], params, None if seed is None else seed + i * params.n,
                None if rid is None else f"{rid}-{i}", timeout_s) for i, prompt in enumerate(prompts)))
            return [group for part in parts for group in part]
        input_ids: list[list[int]] = [list(prompt_ids(prompt)) for prompt in prompts]
        image_data = None
        if any(isinstance(prompt, ImagePrompt) for prompt in prompts):
            image_token = await self._image_token()
            input_ids = [collapse_image_tokens(prompt.ids, image_token, len(prompt.images), i)
                         if isinstance(prompt, ImagePrompt) else ids for i, (prompt, ids) in
                         enumerate(zip(prompts, input_ids))]
            image_data = [[image_data_url(data) for data in prompt.images] if isinstance(prompt, ImagePrompt) else []
                          for prompt in prompts]
        settings = []
        for i in range(len(prompts)):
            options = sampling_options(params)
            if seed is not None:
                options["sampling_seed"] = seed + i * params.n
            settings.append(options)
        rids = None if rid is None else [f"{rid}-{i}" for i in range(len(prompts))]
        if self.one_prompt_per_request:  # SGLang's one-prompt forms
            input_ids, settings, rids = input_ids[0], settings[0], None if rid is None else rid
            image_data = None if image_data is None else image_data[0]
        replies = await self.generate(input_ids, settings, True, rid=rids, timeout_s=timeout_s, image_data=image_data,
                                      return_prompt_token_ids=image_data is not None,
                                      return_routed_experts=params.routed_experts)
        if len(replies) != len(prompts) * params.n:
            raise EngineError("/generate", 200, f"{len(replies)} replies for {len(prompts)} prompts x n={params.n}",
                              url=self.url)
        samples = []
        for k, reply in enumerate(replies):
            prompt = prompts[k // params.n]
            if isinstance(prompt, ImagePrompt):
                self._check_expansion(prompt, reply, k // params.n)
            samples.append(reply_sample(prompt, reply))
        return [samples[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def _check_expansion(self, prompt: ImagePrompt, reply: dict, index: int) -> None:
        """The engine's expanded prompt (`prompt_token_ids`) must be the image prompt's own ids."""
        engine_ids = reply.get("prompt_token_ids")
        if engine_ids is None:
            raise EngineError("/generate", 200, f"prompt {index}: the reply has no 'prompt_token_ids' (the engine "
                                                "ignored return_prompt_token_ids)", url=self.url)
        if list(engine_ids) != list(prompt.ids):
            at = next((i for i, (a, b) in enumerate(zip(engine_ids, prompt.ids)) if a != b),
                      min(len(engine_ids), len(prompt.ids)))
            raise EngineError("/generate", 200, f"prompt {index}: the engine expanded its {len(prompt.images)} "
                                                f"image(s) to {len(engine_ids)} prompt tokens, the prompt has "
                                                f"{len(prompt.ids)} (first difference at token {at}): the engine's "
                                                "image processor (min/max pixels) differs from the trainer's",
                              url=self.url)

    async def _image_token(self) -> int:
        """The image token's id: the client's `image_token_id`, else `image_token_id` of config.json in the
        directory the engine serves (`/model_info` `model_path`), read once."""
        if self.image_token_id is None:
            path = str((await self.model_info()).get("model_path") or "")
            config = Path(path) / "config.json"
            try:
                token = json.loads(config.read_text(encoding="utf-8")).get("image_token_id")
            except (OSError, ValueError) as err:
                raise EngineError("/model_info", 200, f"image prompts need the image token's id: {config} cannot be "
                                                      f"read here ({err}); pass EngineClient(image_token_id=...)",
                                  url=self.url) from None
            if not isinstance(token, int):
                raise EngineError("/model_info", 200, f"image prompts need the image token's id, and {config} has "
                                                      f"no integer 'image_token_id' (a text model?)", url=self.url)
            self.image_token_id = token
        return self.image_token_id

    # ---- weights ----
    async def update_weights_from_tensor(self, named_tensors: Sequence[tuple[str, torch.Tensor]],
                                         weight_version: int, last_bucket: bool,
                                         abort_all_requests: bool = False, timeout_s: float | None = None) -> str:
        """Send one bucket of `(hf_name, tensor)`; `last_bucket` marks the update's end (SGLang's `flush_cache`),
        where `rl360 serve rollout` checks every weight arrived. Returns the server's message."""
        return await self.update_weights_from_serialized(encode_tensor_bucket(list(named_tensors)), TENSOR_LOAD_FORMAT,
                                                         weight_version, last_bucket, abort_all_requests, timeout_s)

    async def update_weights_from_serialized(self, entry: str, load_format: str, weight_version: int,
                                             last_bucket: bool, abort_all_requests: bool = False,
                                             timeout_s: float | None = None) -> str:
        """`/update_weights_from_tensor` with one `serialized_named_tensors` entry (this engine's one rank) in
        `load_format`. Returns the server's message."""
        body = {"serialized_named_tensors": [entry], "load_format": load_format, "flush_cache": last_bucket,
                "abort_all_requests": abort_all_requests, "weight_version": str(weight_version)}
        return _succeeded(self.url, "/update_weights_from_tensor",
                          await self._call("POST", "/update_weights_from_tensor", body, timeout_s))

    async def update_weights_from_disk(self, model_path: str, weight_version: int,
                                       abort_all_requests: bool = False, timeout_s: float | None = None) -> str:
        body = {"model_path": model_path, "weight_version": str(weight_version),
                "abort_all_requests": abort_all_requests}
        return _succeeded(self.url, "/update_weights_from_disk",
                          await self._call("POST", "/update_weights_from_disk", body, timeout_s))

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str,
                                        timeout_s: float | None = None) -> str:
        """Join the weight-update group rank 0 hosts at `master_address:master_port` (the engine's ranks start
        at `rank_offset`); answered once the whole group has formed. Returns the server's message."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        return _succeeded(self.url, "/init_weights_update_group",
                          await self._call("POST", "/init_weights_update_group", body, timeout_s))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, weight_version: int, last_bucket: bool,
                                              abort_all_requests: bool = False,
                                              timeout_s: float | None = None) -> str:
        """Announce one bucket that rank 0 broadcasts over `group_name`, one tensor per name in order; answered
        once the engine received (and, with `last_bucket`, checked and loaded) them."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": last_bucket, "abort_all_requests": abort_all_requests,
                "weight_version": str(weight_version)}
        return _succeeded(self.url, "/update_weights_from_distributed",
                          await self._call("POST", "/update_weights_from_distributed", body, timeout_s))

    async def destroy_weights_update_group(self, group_name: str, timeout_s: float | None = None) -> str:
        return _succeeded(self.url, "/destroy_weights_update_group",
                          await self._call("POST", "/destroy_weights_update_group", {"group_name": group_name},
                                           timeout_s))

    async def get_weights_by_name(self, name: str, truncate_size: int = 100, timeout_s: float | None = None) -> list:
        """The parameter `name` as nested lists of float32 values, its first `truncate_size` rows."""
        reply = await self._call("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size},
                                 timeout_s)
        if not isinstance(reply, list):
            raise EngineError("/get_weights_by_name", 200, f"expected a list of values, got {str(reply)[:200]}",
                              url=self.url)
        return reply

    async def release_memory_occupation(self, tags: list[str] | None = None, timeout_s: float | None = None) -> None:
        """Free the engine's `tags` ("weights", "kv_cache", "cuda_graph"; None: all) for training."""
        await self._call("POST", "/release_memory_occupation", {"tags": tags}, timeout_s)

    async def resume_memory_occupation(self, tags: list[str] | None = None, timeout_s: float | None = None) -> None:
        """Take back released memory; resumed weights need a complete weight update before generating."""
        await self._call("POST", "/resume_memory_occupation", {"tags": tags}, timeout_s)

    # ---- control ----
    async def flush_cache(self, timeout_s: float | None = None) -> None:
        await self._call("POST", "/flush_cache", None, timeout_s)

    async def pause_generation(self, mode: str = "abort", timeout_s: float | None = None) -> None:
        """"abort": end running requests (finish reason abort); "in_place"/"retract": hold them until continue."""
        await self._call("POST", "/pause_generation", {"mode": mode}, timeout_s)

    async def continue_generation(self, timeout_s: float | None = None) -> None:
        await self._call("POST", "/continue_generation", {}, timeout_s)

    async def abort_request(self, rid: str | None = None, abort_all: bool = False,
                            timeout_s: float | None = None) -> None:
        if (rid is None) == (not abort_all):
            raise ValueError("pass either rid or abort_all=True")
        body = {"abort_all": True} if abort_all else {"rid": rid}
        await self._call("POST", "/abort_request", body, timeout_s)

    async def health(self, timeout_s: float = 5.0) -> bool:
        """Whether the server answers `/health` with 200 (False on any error or time-out)."""
        return await self._answers("/health", timeout_s)

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        """Whether the server generates a token (`/health_generate`) in time."""
        return await self._answers("/health_generate", timeout_s)

    async def _answers(self, path: str, timeout_s: float) -> bool:
        try:
            await self._call("GET", path, None, timeout_s)
        except (EngineError, httpx.HTTPError, OSError):
            return False
        return True

    async def model_info(self, timeout_s: float | None = None) -> dict:
        """`/model_info`: `model_path`, `weight_version`, `is_generation`, ..."""
        return await self._call("GET", "/model_info", None, timeout_s)

    async def weight_version(self, timeout_s: float | None = None) -> str:
        return str((await self.model_info(timeout_s))["weight_version"])

    # ---- transport ----
    async def _call(self, method: str, route: str, body: Any, timeout_s: float | None) -> Any:
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(limit):
                response = await self._http.request(method, route, json=body)
        except TimeoutError:
            raise EngineTimeout(route, 0, f"no complete reply within {limit:g} s", url=self.url) from None
        if response.status_code >= 400:
            raise EngineError(route, response.status_code, _message(response), url=self.url)
        if "application/json" not in response.headers.get("content-type", ""):
            return response.text
        return response.json()


def sampling_options(params: SamplingParams) -> dict:
    """SGLang `sampling_params` for our `SamplingParams` (seed left to the caller: `sampling_seed`); stop strings
    (`stop`, a list) and a penalty only when set."""
    options = {"n": params.n, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
               "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids)}
    if params.stop:
        options["stop"] = list(params.stop)
    off = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1}
    return {**options, **{key: getattr(params, key) for key, value in off.items() if getattr(params, key) != value}}


def collapse_image_tokens(ids: list[int], image_token_id: int, images: int, index: int = 0) -> list[int]:
    """An image prompt's ids as SGLang takes them: every run of image tokens (one expanded image) collapsed to one
    image token. ValueError naming the prompt when the runs are not one per image."""
    collapsed: list[int] = []
    runs = 0
    for token in ids:
        if token == image_token_id:
            if collapsed and collapsed[-1] == image_token_id:
                continue
            runs += 1
        collapsed.append(token)
    if runs != images:
        raise ValueError(f"prompt {index} has {runs} run(s) of the image token {image_token_id} for {images} "
                         "image(s): each image must be one run (the processor's expansion)")
    return collapsed


_MEDIA_TYPES = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
                (b"BM", "image/bmp"))


def image_data_url(data: bytes) -> str:
    """Compressed image bytes as a base64 data URL, its media type from the file's signature."""
    media = next((kind for magic, kind in _MEDIA_TYPES if data.startswith(magic)), None)
    if media is None:
        media = "image/webp" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else "application/octet-stream"
    return f"data:{media};base64,{base64.b64encode(data).decode('ascii')}"


def reply_sample(prompt: Prompt, reply: dict) -> Sample:
    """A `Sample` from one `/generate` reply (with `return_logprob`); an image prompt's carries its images."""
    meta = reply["meta_info"]
    logprobs = [entry[0] for entry in meta["output_token_logprobs"]]
    tokens = list(reply["output_ids"])
    if len(logprobs) != len(tokens):
        raise EngineError("/generate", 200, f"{len(tokens)} output ids but {len(logprobs)} log-probs")
    finish = meta.get("finish_reason") or {"type": "abort"}
    matched = finish.get("matched")  # a stop token's id, or the stop string that ended it
    version = str(meta.get("weight_version", ""))  # SGLang's is "default" until a trainer sets one
    routes = meta.get("routed_experts")
    if routes is not None:  # an image prompt's ran with its images expanded: its tokens are the expanded ones
        ran = len(reply.get("prompt_token_ids") or prompt_ids(prompt)) + len(tokens) - 1
        try:
            routes = decode_routes(routes, ran)
        except ValueError as err:
            raise EngineError("/generate", 200, str(err)) from None
    return Sample(prompt_ids=list(prompt_ids(prompt)), response_ids=tokens, logprobs=logprobs,
                  finish_reason=finish["type"], weight_version=int(version) if version.isdigit() else 0,
                  images=prompt.images if isinstance(prompt, ImagePrompt) else None,
                  stop_matched=matched if isinstance(matched, str) else None, routed_experts=routes)


def _succeeded(url: str, route: str, reply: Any) -> str:
    if not isinstance(reply, dict) or not reply.get("success"):
        raise EngineError(route, 200, str(reply.get("message") if isinstance(reply, dict) else reply), url=url)
    return str(reply.get("message", ""))


def _message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in data:
            return str(data["message"])
        if "detail" in data:
            return str(data["detail"])
    return str(data)[:500]
