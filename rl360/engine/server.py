"""`rl360 serve rollout`: the HF engine behind SGLang's native HTTP API, so a trainer talks to it exactly as
it talks to `python -m sglang.launch_server` (the same `rl360.core.client.EngineClient`).

    rl360 serve rollout --model DIR [--port 30000] [--api-key-env VAR] [--dtype bfloat16]
                        [--batch-window-ms 5] [--max-batch-rows 256] [--weight-sync-timeout-s 600]
                        [--min-pixels N] [--max-pixels N] [--max-in-flight 256] ...

Routes (shapes from SGLang 0.5.17's `srt/entrypoints/http_server.py` and `srt/managers/io_struct.py`):

- `POST /generate`: `input_ids` (one prompt, a list of ints, or a batch, a list of lists) or `text` (when the
  checkpoint has a tokenizer); `sampling_params` (one object, or one per prompt) with `max_new_tokens`,
  `temperature` (0: greedy), `top_p`, `top_k` (-1 or >= 2^30: none), `stop_token_ids`, `stop` (a string or a
  list of non-empty strings: the row ends at the token whose text completes one, that token its last, and the
  reply's `text` is cut before the string unless `no_stop_trim`; rl360/engine/stop_strings.py), `ignore_eos`, `n`,
  `sampling_seed` (sample j of a prompt draws from a generator seeded with `sampling_seed + j`; without it
  the draws are random), `frequency_penalty`, `presence_penalty` (in [-2, 2]) and `repetition_penalty` (in
  (0, 2]) as SGLang applies them (rl360/engine/penalties.py), plus SGLang's knobs at values that change nothing
  (`min_p: 0`, ...); `return_logprob`, `logprob_start_len` (>= 0 adds `input_token_logprobs` from that prompt position,
  the first prompt token's log-prob being null as in SGLang; with `max_new_tokens: 0`, only those: a
  distillation teacher scoring given tokens), `return_text_in_logprobs`, `rid` (a string, or one per prompt).
  One prompt with n = 1 is answered with one object, anything else with a list (prompt-major:
  prompt i's sample j is entry i*n + j). Each object: `text`, `output_ids`, `meta_info` with `id`,
  `finish_reason` (`{"type": "stop", "matched": token}` for a stop token, `{"type": "stop", "matched": string}`
  for a stop string, `{"type": "length", "length": n}` or
  `{"type": "abort", "message": ...}`), `prompt_tokens`, `completion_tokens`, `cached_tokens` (0),
  `weight_version` (the version served when the response ended), `e2e_latency` and, with `return_logprob`,
  `output_token_logprobs` (`[logprob, token_id, text or null]` per token: the log-prob under the distribution
  the token was drawn from, temperature applied; greedy: temperature 1), `input_token_logprobs` and, with
  `top_logprobs_num` k (one value or one per prompt, at most 20), `output_top_logprobs` (per sampled token the k
  most likely `[logprob, id, text]`). `stream: true` answers with server-sent events: after each decode step,
  each row that grew as `data: {reply so far}` (text and ids whole so far, finish reason null until the last;
  `"index"` on each chunk when the request has several rows), then `data: [DONE]`. Every other field of SGLang's
  `GenerateReqInput` (and sglang-router's `model`) is accepted: ignored where it changes nothing here, or taken
  only at its off value (null, false, 0, empty) where it asks for what this server does not do (400 naming it);
  the lists are `rl360.engine.generate_request`'s.
  Vision-language checkpoints (Qwen2-VL / Qwen2.5-VL) take `image_data` as SGLang does: per prompt a list of
  images, each a base64 string or a data URL (URLs, paths and SGLang's dict forms are refused with 400 naming
  `image_data[i][j]`), with ONE image token per image in the prompt's ids (the chat template's collapsed
  `<|vision_start|><|image_pad|><|vision_end|>`), expanded here to the image's tokens by the checkpoint's
  processor (`--min-pixels` / `--max-pixels` bound an image's resized area); `return_prompt_token_ids: true` adds
  `prompt_token_ids`, the prompt with its images expanded, to each reply (SGLang's field).
  `return_routed_experts: true` (one value or one per prompt; a mixture-of-experts checkpoint, else 400) adds
  SGLang's `meta_info.routed_experts`: the base64 of the int32 array `[prompt + output - 1, layers, top_k]` of the
  experts each token that ran was routed to (`rl360.engine.routes`). The exact shapes:
  `rl360.engine.generate_request`.
- `GET /health` (no key), `GET /health_generate` (no key; a one-token generation through the batcher),
  `GET /model_info` and `/server_info` (and their `/get_*` forms; SGLang's fields that routers and trainers
  read), `GET|POST /flush_cache` (the HF engine keeps no prefix cache between requests: always 200),
  `POST /abort_request` (`rid` or `abort_all`), `POST /pause_generation` (`mode`: "abort" ends every
  queued and running request with finish reason abort; "in_place" and "retract" hold running requests between
  decode steps, keeping their KV cache, which here also stands in for SGLang's recomputation under "retract")
  and `POST /continue_generation`; new requests wait while paused.
- `POST /update_weights_from_tensor`: `serialized_named_tensors` (one entry: this server is one rank) in
  `load_format` "rl360_safetensors" (the base64 of a safetensors file holding the bucket's `(hf_name, tensor)`
  pairs), "rl360_shared_memory" (the base64 of a JSON descriptor of a file on this host, as
  `rl360.weight_sync.tensor` writes it: the file is mapped and its tensors copied; it must be a regular file
  named rl360-weights-*.bin owned by this server's user) or "rl360_cuda_ipc" (the base64 of a JSON descriptor of
  a CUDA buffer shared by CUDA IPC, as `rl360.weight_sync.cuda_ipc` writes it: the buffer must be on this engine's
  own GPU, named by its UUID, else 400; its tensors are copied device-to-device and the mapping closed before
  the answer). SGLang's own formats (None, "direct", "flattened_bucket") carry pickled tensor handles (CUDA
  IPC) and are refused with 400: unpickling a request body would run whatever code it names.
  `abort_all_requests: true` aborts requests in flight first.
- `POST /update_weights_from_disk`: `model_path`, a directory of `*.safetensors` files holding Hugging Face-named
  weights (a checkpoint, or the shards `WeightSender` writes; no config.json needed); a complete update by
  definition. Replies `{"success", "message", "num_paused_requests"}`.
- `POST /init_weights_update_group` (`master_address`, `master_port`, `rank_offset`, `world_size`, `group_name`,
  `backend`: "gloo", or "nccl" when the engine runs on CUDA): join the torch.distributed group rank 0 hosts, as
  rank `rank_offset`, the way SGLang's engine joins it (`rl360.weight_sync.group.open_process_group`);
  answered once the group has formed (or failed: `success: false`). `POST /update_weights_from_distributed`
  (`names`, `dtypes` such as "float32" or "bfloat16", `shapes`, `group_name`, `flush_cache`, `weight_version`,
  `abort_all_requests`): one broadcast from rank 0 per name, in order, into new tensors. The tensors are
  received before any refusal (an old version, released weights, an unknown name) is answered, so the group
  stays usable; a `group_name` that names no open group is refused at once (400). `POST
  /destroy_weights_update_group` (`group_name`).
- Weight updates, whatever the route: weights are named as in the checkpoint's files (`model.layers.0...`,
  `visual.blocks.0...`, `lm_head.weight`), renamed to the model's parameters as transformers renames them on
  loading (`HFEngine.parameter_name`; the parameters' own names are accepted too). `weight_version` must be a
  decimal integer, not older than the one served. Buckets are checked (names, shapes) and staged; a request
  with `flush_cache: true` (the default, as in SGLang) ends the update: if every parameter was staged since the
  previous update ended, the staged weights replace the model's at once between two decode steps and the new
  version is served; otherwise the answer is 400 naming the missing weights, the staged buckets are dropped, and
  the old weights and version stay. A refused bucket drops the update in progress too. (SGLang itself loads
  each bucket in place.)
- `GET|POST /get_weights_by_name` (`name`: a checkpoint name, a parameter's name or a tied alias;
  `truncate_size`, default 100): the parameter's first `truncate_size` rows as nested lists of float32 values,
  as SGLang returns them (every value of a float32 or bfloat16 parameter is exact).
- `GET|POST /release_memory_occupation` and `/resume_memory_occupation` (`tags`: a list of "weights",
  "kv_cache", "cuda_graph"; null or empty: all; other tags 400). Release needs an idle engine (nothing queued,
  decoding or held: 400 otherwise, where SGLang asserts it); resuming a tag that is not released is 400 (SGLang
  raises too), and so is releasing a released one. Releasing "weights" frees every parameter's storage (and
  drops a staged update); resuming them allocates zeros, and generating then needs a complete weight update
  first. "kv_cache" and "cuda_graph" free nothing here (no KV cache outlives a request, no graphs are
  captured) but are tracked the same way. While any tag is released, or resumed weights await their update,
  `/generate` and `/health_generate` answer 503 naming the reason (SGLang does not check: a request then
  would run on released memory), weight updates while weights are released 400, and `/get_weights_by_name` 503.

Batching: requests are queued; the engine thread takes every queued prompt (up to `--max-batch-rows` rows)
once `--batch-window-ms` has passed since the first one arrived, and decodes them as one left-padded batch with
per-row sampling settings and per-row random generators, so a response's tokens do not depend on what it was
batched with. Requests arriving while a batch decodes go into the next batch. A request cancelled by its
deadline or a client hang-up stops being decoded at the next step. Errors are `{"error": {"message", "param",
"code"}}` with the HTTP status; keys, limits, deadlines, graceful shutdown and `/metrics` come from the service
layer (`rl360.service.app`), whose `max_in_flight` bounds the queue.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

import rl360
from rl360.core import SamplingParams
from rl360.core.routes import encode_routes
from rl360.engine.batching import BatchDecoder, Batcher
from rl360.engine.generate_request import (
    SGLANG_SCHEMA_VERSION,
    GenerateCall,
    Row,
    bool_field,
    expand_images,
    is_int,
    parse_generate,
)
from rl360.errors import run_command
from rl360.model_dir import check_model_dir
from rl360.service.app import (
    ServiceError,
    ServiceGuard,
    ServiceLimits,
    add_service_arguments,
    json_object,
    number_field,
    run_service,
    service_app,
    service_options,
    sse_event,
)
from rl360.service.metrics import MetricsRegistry
from rl360.weight_sync.cuda_ipc import CUDA_IPC_LOAD_FORMAT, open_bucket
from rl360.weight_sync.formats import (
    SHARED_MEMORY_LOAD_FORMAT,
    TENSOR_LOAD_FORMAT,
    WEIGHT_DTYPES,
    decode_tensor_bucket,
    read_shared_bucket,
)
from rl360.weight_sync.group import close_process_group, open_process_group

DEFAULT_LIMITS = ServiceLimits(max_body_bytes=512 << 20, max_in_flight=256, request_timeout_s=3600.0,
                               read_timeout_s=60.0, shutdown_grace_s=30.0)
TENSOR_FIELDS = frozenset({"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                           "weight_version", "disable_draft_model", "torch_empty_cache"})
DISK_FIELDS = frozenset({"model_path", "load_format", "abort_all_requests", "weight_version", "flush_cache",
                         "torch_empty_cache", "is_async", "keep_pause", "recapture_cuda_graph", "token_step"})
INIT_GROUP_FIELDS = frozenset({"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"})
DISTRIBUTED_FIELDS = frozenset({"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                                "weight_version", "load_format", "torch_empty_cache"})
# SGLang's memory tags, with what releasing each does here
FINISHED = -2  # a streamed row whose last reply was sent
MEMORY_TAGS = {"kv_cache": "nothing is kept between requests", "weights": "parameter storage freed",
               "cuda_graph": "none captured"}


def sglang_error(error: ServiceError) -> dict:
    """The error body of this server: SGLang's `{"error": {"message": ...}}` plus the field at fault."""
    return {"error": {"message": str(error), "param": error.param, "code": error.status}}


# ---- weights ----
def _weight_version(data: dict, served: int) -> int | None:
    value = data.get("weight_version")
    if value is None:
        return None
    text = str(value) if is_int(value) else value
    if not isinstance(text, str) or not text.isdigit():
        raise ServiceError(400, f"'weight_version' must be a decimal integer (the trainer's step), got {value!r}",
                           "weight_version")
    if int(text) < served:
        raise ServiceError(400, f"'weight_version' {text} is older than the served version {served}",
                           "weight_version")
    return int(text)


# ---- the service ----
class RolloutService:
    """The engine, its batcher and the routes; `guard` is what uvicorn runs."""

    def __init__(self, model_path: str, limits: ServiceLimits = DEFAULT_LIMITS, api_key: str | None = None,
                 dtype: str = "float32", batch_window_s: float = 0.005, max_batch_rows: int = 256,
                 group_timeout_s: float = 600.0, min_pixels: int | None = None, max_pixels: int | None = None):
        from rl360.engine.hf_engine import HFEngine

        self.model_path, self.dtype, self.startup_time = model_path, dtype, time.time()
        self.engine = HFEngine(model_path, dtype=getattr(torch, dtype), min_pixels=min_pixels, max_pixels=max_pixels)
        self.tokenizer = _tokenizer(model_path)
        self._parameters = dict(self.engine.model.named_parameters())  # tied weights once, by their first name
        self._shapes = {name: tuple(param.shape) for name, param in self._parameters.items()}
        self._update_lock = threading.Lock()  # staging and swapping in weight updates
        self._staged: dict[str, torch.Tensor] = {}  # the update in progress, by parameter name
        self._staged_version: int | None = None
        self.released: set[str] = set()  # memory tags released by /release_memory_occupation
        self._weights_stale = False  # resumed weights (zeros) wait for a complete update
        self.groups: dict[str, WeightGroup] = {}  # open weight-update groups by name
        self._forming: set[str] = set()
        self.group_timeout_s = group_timeout_s
        self.model_lock = threading.Lock()
        self.resume = threading.Event()
        self.resume.set()
        self.paused = False
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._held: list[Row] = []  # rows of requests waiting for generation to continue
        eos = getattr(self.engine.model.generation_config, "eos_token_id", None)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        decoder = BatchDecoder(self.engine, self.model_lock, self.resume, lambda: str(self.engine.version), eos_ids,
                               self._unready, self.tokenizer)
        registry = MetricsRegistry()
        self.batcher = Batcher(decoder, batch_window_s, max_batch_rows, registry)
        self.tokens = registry.counter("rl360_rollout_tokens_total", "Tokens read and written, by kind.", ["kind"])
        self.finished = registry.counter("rl360_rollout_responses_total", "Responses, by finish reason.", ["reason"])
        self.updates = registry.counter("rl360_rollout_weight_updates_total", "Weight update requests, by route "
                                        "and outcome.", ["route", "outcome"])
        app = service_app(sglang_error)
        app.add_api_route("/generate", self.generate, methods=["POST", "PUT"])
        app.add_api_route("/health_generate", self.health_generate, methods=["GET"])
        for path in ("/model_info", "/get_model_info"):
            app.add_api_route(path, self.model_info, methods=["GET"])
        for path in ("/server_info", "/get_server_info"):
            app.add_api_route(path, self.server_info, methods=["GET"])
        app.add_api_route("/flush_cache", self.flush_cache, methods=["GET", "POST"])
        app.add_api_route("/abort_request", self.abort_request, methods=["POST"])
        app.add_api_route("/pause_generation", self.pause_generation, methods=["POST"])
        app.add_api_route("/continue_generation", self.continue_generation, methods=["POST"])
        app.add_api_route("/update_weights_from_tensor", self.update_weights_from_tensor, methods=["POST"])
        app.add_api_route("/update_weights_from_disk", self.update_weights_from_disk, methods=["POST"])
        app.add_api_route("/init_weights_update_group", self.init_weights_update_group, methods=["POST"])
        app.add_api_route("/update_weights_from_distributed", self.update_weights_from_distributed, methods=["POST"])
        app.add_api_route("/destroy_weights_update_group", self.destroy_weights_update_group, methods=["POST"])
        app.add_api_route("/get_weights_by_name", self.get_weights_by_name, methods=["GET", "POST"])
        app.add_api_route("/release_memory_occupation", self.release_memory_occupation, methods=["GET", "POST"])
        app.add_api_route("/resume_memory_occupation", self.resume_memory_occupation, methods=["GET", "POST"])
        self.guard = ServiceGuard("rollout", app, limits, api_key, sglang_error, registry,
                                  open_paths=("/health", "/health_generate"))

    # ---- generation ----
    async def generate(self, request: HTTPRequest) -> Response:
        vision = self.engine.vision
        call = parse_generate(await request.body(), self.tokenizer, vision is not None)
        if vision is not None:  # images decoded off the event loop; each image token expanded to its image's
            await asyncio.to_thread(expand_images, call, self.engine.pixel_inputs, self.engine.image_token_id,
                                    vision.merge_size)
        if any(row.routed_experts for row in call.rows) and not self.engine.routes.has_experts:
            raise ServiceError(400, f"'return_routed_experts': {self.model_path} is not a mixture of experts",
                               "return_routed_experts")
        problem = self._unready()
        if problem is not None:
            raise ServiceError(503, problem)
        started = time.monotonic()
        if call.stream:
            return StreamingResponse(self._stream(call, started), media_type="text/event-stream")
        await self._wait_while_paused(call.rows)
        await self.batcher.submit(call.rows)  # rows aborted while held are settled as aborted, not decoded
        replies = [self._reply(row, call, time.monotonic() - started) for row in call.rows]
        return JSONResponse(replies[0] if call.single else replies)

    async def _stream(self, call: GenerateCall, started: float):
        """SGLang's stream: after each decode step, each row that grew as `data: {reply so far}` (its text and
        ids whole so far, as SGLang streams by default; with `"index"` when the request has several rows), the
        finished reply last, then `data: [DONE]`. A client that hangs up aborts its rows."""
        await self._wait_while_paused(call.rows)
        sent = [-1] * len(call.rows)
        try:
            async for _ in self.batcher.steps(call.rows):
                for i, row in enumerate(call.rows):
                    done = row.finish_reason is not None
                    if len(row.tokens) == sent[i] and not done or sent[i] == FINISHED:
                        continue
                    sent[i] = FINISHED if done else len(row.tokens)
                    reply = self._reply(row, call, time.monotonic() - started, partial=not done)
                    yield sse_event(reply if call.single else {**reply, "index": i})
        except Exception as err:  # decoding failed after the stream began: SGLang's error chunk
            error = err if isinstance(err, ServiceError) else ServiceError(500, f"{type(err).__name__}: {err}")
            yield sse_event(sglang_error(error))
        yield sse_event("[DONE]")

    async def _wait_while_paused(self, rows: list[Row]) -> None:
        """New requests wait while generation is paused, until it continues or they are aborted."""
        self._held.extend(rows)
        try:
            while not self._unpaused.is_set() and any(row.aborted is None for row in rows):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._unpaused.wait(), 0.05)
        finally:
            for row in rows:
                self._held.remove(row)

    def _abort(self, rid: str | None, message: str) -> None:
        """Abort the rows of `rid` (None: all): held, queued or running."""
        for row in self._held:
            if (rid is None or row.rid == rid) and row.aborted is None:
                row.aborted = message
        self.batcher.abort(rid, message)

    def _reply(self, row: Row, call: GenerateCall, latency: float, partial: bool = False) -> dict:
        """SGLang's reply for `row` (`partial`: so far, while it decodes; counted once, when whole)."""
        if not partial:
            self.tokens.inc(len(row.prompt), kind="prompt")
            self.tokens.inc(len(row.tokens), kind="completion")
            self.finished.inc(reason=row.finish_reason["type"])
        tokens = list(row.tokens)
        meta = {"id": row.rid, "finish_reason": None if partial else row.finish_reason,
                "prompt_tokens": len(row.prompt), "completion_tokens": len(tokens), "cached_tokens": 0,
                "weight_version": row.weight_version or str(self.engine.version), "e2e_latency": latency}
        if row.return_logprob:
            texts = self._token_texts(tokens, call.text_in_logprobs)
            meta["output_token_logprobs"] = [[lp, tok, text] for lp, tok, text in zip(row.logprobs, tokens, texts)]
            if row.top_logprobs:
                meta["output_top_logprobs"] = [
                    [[lp, tok, text] for (tok, lp), text in zip(top, self._token_texts([t for t, _ in top],
                                                                                       call.text_in_logprobs))]
                    for top in row.top[:len(tokens)]]
            if row.logprob_start_len >= 0:
                prompt = row.prompt[row.logprob_start_len:]
                texts = self._token_texts(prompt, call.text_in_logprobs)
                meta["input_token_logprobs"] = [[lp, tok, text] for lp, tok, text in
                                                zip(row.input_logprobs, prompt, texts)]
        if row.routed_experts and row.routes is not None:  # SGLang's: [prompt + tokens - 1, layers, top_k] int32
            meta["routed_experts"] = encode_routes(row.routes)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""
        matched = None if partial else row.finish_reason.get("matched")
        if isinstance(matched, str) and not row.no_stop_trim and matched in text:  # SGLang trims the stop string
            text = text[:text.index(matched)]
        reply = {"text": text, "output_ids": tokens, "meta_info": meta}
        if call.return_prompt_token_ids:  # the prompt as decoded: an image prompt's with its images expanded
            reply["prompt_token_ids"] = list(row.prompt)
        return reply

    def _token_texts(self, tokens: list[int], wanted: bool) -> list[str | None]:
        if not wanted or self.tokenizer is None:
            return [None] * len(tokens)
        return [self.tokenizer.decode([t]) for t in tokens]

    async def health_generate(self) -> Response:
        row = Row([0], SamplingParams(n=1, temperature=0.0, max_new_tokens=1), 0, f"HEALTH_CHECK_{uuid.uuid4().hex}")
        try:
            await asyncio.wait_for(self.batcher.submit([row]), timeout=20)
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)

    async def model_info(self) -> dict:
        """SGLang's `/model_info` (and `/get_model_info`): the fields routers and trainers read."""
        config = self.engine.model.config
        return {"model_path": self.model_path, "tokenizer_path": self.model_path if self.tokenizer else None,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": str(self.engine.version),
                "has_image_understanding": self.engine.vision is not None,
                "has_audio_understanding": False, "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None)}

    async def server_info(self) -> dict:
        """SGLang's `/server_info` (and `/get_server_info`): its server arguments that describe this engine (one
        rank: tp, pp and dp sizes 1), the scheduler's limits, `internal_states` and the SGLang API version served."""
        config = self.engine.model.config
        return {"model_path": self.model_path, "tokenizer_path": self.model_path if self.tokenizer else None,
                "served_model_name": self.model_path, "dtype": self.dtype, "tp_size": 1, "pp_size": 1, "dp_size": 1,
                "ep_size": 1, "skip_tokenizer_init": self.tokenizer is None,
                "context_length": getattr(config, "max_position_embeddings", None),
                "max_running_requests": self.batcher.max_rows, "page_size": 1, "disaggregation_mode": "null",
                "weight_version": str(self.engine.version), "load_balance_method": "round_robin",
                "enable_metrics": True, "kv_events": None, "startup_time": self.startup_time,
                "internal_states": [{"dp_rank": 0, "num_running_reqs": len(self.batcher.running),
                                     "num_waiting_reqs": self.batcher.busy() - len(self.batcher.running),
                                     "weight_version": str(self.engine.version),
                                     "memory_released": sorted(self.released)}],
                "version": SGLANG_SCHEMA_VERSION, "engine": f"rl360 serve rollout {rl360.__version__}"}

    async def flush_cache(self) -> Response:
        return Response("Cache flushed.\n", status_code=200)

    async def abort_request(self, request: HTTPRequest) -> Response:
        data = json_object(await request.body(), {"rid", "abort_all", "finished_reason", "abort_message"})
        abort_all = bool_field(data, "abort_all")
        rid = data.get("rid")
        if not abort_all and not isinstance(rid, str):
            raise ServiceError(400, "'rid' must be a string (or send 'abort_all': true)", "rid")
        message = data.get("abort_message") or "Aborted"
        self._abort(None if abort_all else rid, str(message))
        return Response(status_code=200)

    async def pause_generation(self, request: HTTPRequest) -> dict:
        data = json_object(await request.body() or b"{}", {"mode", "rid"})
        mode = data.get("mode") or "abort"
        if mode not in ("abort", "in_place", "retract"):
            raise ServiceError(400, f"'mode' must be 'abort', 'in_place' or 'retract', got {mode!r}", "mode")
        self.paused = True
        self._unpaused.clear()
        if mode == "abort":
            self._abort(None, "Aborted by pause_generation")
        else:
            self.resume.clear()
        return {"message": "Generation paused successfully.", "status": "ok"}

    async def continue_generation(self, request: HTTPRequest) -> dict:
        json_object(await request.body() or b"{}", {"torch_empty_cache", "rid"})
        self.paused = False
        self.resume.set()
        self._unpaused.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    # ---- weights ----
    async def update_weights_from_tensor(self, request: HTTPRequest) -> JSONResponse:
        data = json_object(await request.body(), TENSOR_FIELDS)
        load_format = data.get("load_format")
        readers = {TENSOR_LOAD_FORMAT: decode_tensor_bucket, SHARED_MEMORY_LOAD_FORMAT: read_shared_bucket,
                   CUDA_IPC_LOAD_FORMAT: lambda entry: open_bucket(entry, self.engine.device)}
        if load_format not in readers:
            raise ServiceError(400, f"'load_format' {load_format!r} is not served here: rl360 serve rollout takes "
                                    f"'{TENSOR_LOAD_FORMAT}' (base64 safetensors), '{SHARED_MEMORY_LOAD_FORMAT}' "
                                    f"(a shared-memory file's descriptor) or '{CUDA_IPC_LOAD_FORMAT}' (a CUDA IPC "
                                    "buffer's descriptor); pickled tensor handles are refused", "load_format")
        entries = data.get("serialized_named_tensors")
        if not isinstance(entries, list) or len(entries) != 1:
            raise ServiceError(400, "'serialized_named_tensors' must be a list of one entry (this server is one rank)",
                               "serialized_named_tensors")
        version = _weight_version(data, self.engine.version)
        finish = bool_field(data, "flush_cache", default=True)
        self._refuse_if_weights_released()
        try:
            bucket = await asyncio.to_thread(readers[load_format], entries[0])
        except ValueError as err:
            raise ServiceError(400, f"'serialized_named_tensors[0]': {err}", "serialized_named_tensors") from None
        if bool_field(data, "abort_all_requests"):
            self._abort(None, "Aborted by a weight update")
        return await self._apply(bucket, version, finish, "/update_weights_from_tensor", extra={})

    async def update_weights_from_disk(self, request: HTTPRequest) -> JSONResponse:
        data = json_object(await request.body(), DISK_FIELDS)
        path = data.get("model_path")
        if not isinstance(path, str) or not Path(path).is_dir():
            raise ServiceError(400, f"'model_path' must be a checkpoint directory on the server, got {path!r}",
                               "model_path")
        if data.get("load_format") not in (None, "auto", "safetensors"):
            raise ServiceError(400, f"'load_format' {data['load_format']!r} is not served here: rl360 serve rollout "
                                    "loads safetensors files ('auto' or 'safetensors')", "load_format")
        version = _weight_version(data, self.engine.version)
        self._refuse_if_weights_released()
        try:
            bucket = await asyncio.to_thread(safetensors_weights, path)
        except ValueError as err:
            raise ServiceError(400, f"'model_path': {err}", "model_path") from None
        if bool_field(data, "abort_all_requests"):
            self._abort(None, "Aborted by a weight update")
        return await self._apply(bucket, version, True, "/update_weights_from_disk", extra={"num_paused_requests": 0})

    async def init_weights_update_group(self, request: HTTPRequest) -> JSONResponse:
        data = json_object(await request.body(), INIT_GROUP_FIELDS)
        address = data.get("master_address")
        if not isinstance(address, str) or not address:
            raise ServiceError(400, f"'master_address' must be a host name or address, got {address!r}",
                               "master_address")
        port = _required_int(data, "master_port", 1, 65535)
        world_size = _required_int(data, "world_size", 2, 1 << 20)
        rank = _required_int(data, "rank_offset", 1, world_size - 1)  # this server is one rank
        name = _group_name(data)
        backend = data.get("backend") or "nccl"  # SGLang's default
        if backend not in ("gloo", "nccl"):
            raise ServiceError(400, f"'backend' must be 'gloo' or 'nccl', got {backend!r}", "backend")
        if backend == "nccl" and self.engine.device.type != "cuda":
            raise ServiceError(400, f"'backend' 'nccl' needs CUDA and this engine runs on {self.engine.device}: "
                                    "send 'gloo'", "backend")
        device = self.engine.device if backend == "nccl" else torch.device("cpu")  # gloo receives on the CPU
        route = "/init_weights_update_group"
        if name in self.groups or name in self._forming:
            self.updates.inc(route=route, outcome="failed")
            return JSONResponse({"success": False, "message": f"weight-update group {name!r} is already open"},
                                status_code=400)
        self._forming.add(name)
        try:
            group = await in_daemon_thread(open_process_group, backend, address, port, world_size, rank, name,
                                           self.group_timeout_s)
        except (RuntimeError, ValueError, OSError) as err:  # torch's store and rendezvous errors are RuntimeErrors
            self.updates.inc(route=route, outcome="failed")
            return JSONResponse({"success": False, "message": f"Failed to initialize custom process group {name!r} "
                                                              f"at {address}:{port} as rank {rank}: {err}"},
                                status_code=400)
        finally:
            self._forming.discard(name)
        self.groups[name] = WeightGroup(name, group, device)
        self.updates.inc(route=route, outcome="finished")
        return JSONResponse({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update_weights_from_distributed(self, request: HTTPRequest) -> JSONResponse:
        data = json_object(await request.body(), DISTRIBUTED_FIELDS)
        route = "/update_weights_from_distributed"
        name = _group_name(data)
        group = self.groups.get(name)
        if group is None:
            raise ServiceError(400, f"'group_name' {name!r} is not an open weight-update group (open: "
                                    f"{sorted(self.groups)}): call /init_weights_update_group first", "group_name")
        if data.get("load_format") is not None:
            raise ServiceError(400, f"'load_format' {data['load_format']!r} is not served here: rl360 serve rollout "
                                    "receives one broadcast per tensor (load_format null)", "load_format")
        specs = _tensor_specs(data)
        finish = bool_field(data, "flush_cache", default=True)
        abort = bool_field(data, "abort_all_requests")
        bool_field(data, "torch_empty_cache")  # nothing to empty here; still a boolean
        refusal: ServiceError | None = None
        version = None
        try:  # refused only after receiving: the sender broadcasts whatever the answer, and waits for every rank
            version = _weight_version(data, self.engine.version)
            self._refuse_if_weights_released()
        except ServiceError as err:
            refusal = err
        if abort and refusal is None:
            self._abort(None, "Aborted by a weight update")
        try:
            tensors = await in_daemon_thread(group.receive, specs)
        except RuntimeError as err:
            self.updates.inc(route=route, outcome="failed")
            return JSONResponse({"success": False, "message": f"receiving the broadcast on group {name!r} failed: "
                                                              f"{err}"}, status_code=400)
        if refusal is not None:
            self.updates.inc(route=route, outcome="failed")
            raise refusal
        return await self._apply([(spec[0], tensor) for spec, tensor in zip(specs, tensors)], version, finish, route,
                                 extra={})

    async def destroy_weights_update_group(self, request: HTTPRequest) -> JSONResponse:
        name = _group_name(json_object(await request.body() or b"{}", {"group_name"}))
        group = self.groups.pop(name, None)
        if group is None:
            return JSONResponse({"success": False, "message": "The group to be destroyed does not exist."},
                                status_code=400)
        await in_daemon_thread(close_process_group, group.group)
        return JSONResponse({"success": True, "message": "Succeeded to destroy custom process group."})

    async def get_weights_by_name(self, request: HTTPRequest) -> JSONResponse:
        data = json_object(await request.body() or b"{}", {"name", "truncate_size"})
        name = data.get("name")
        try:
            canonical = self.engine.parameter_name(name) if isinstance(name, str) else None
        except KeyError:
            canonical = None
        if canonical is None:
            raise ServiceError(400, f"'name' must name a parameter of the engine's model (its checkpoint name or "
                                    f"its module name), got {name!r}", "name")
        truncate = int(number_field(data, "truncate_size", 100, 0, 1 << 62, integer=True))
        if "weights" in self.released:
            raise ServiceError(503, "weights are released (/release_memory_occupation): nothing to read")

        def read() -> list:
            with self.model_lock:
                values = self._parameters[canonical].detach()
                values = (values[:truncate] if values.dim() else values.reshape(1)).float().cpu()
            return values.tolist()

        return JSONResponse(await asyncio.to_thread(read))

    async def release_memory_occupation(self, request: HTTPRequest) -> dict:
        tags = _memory_tags(await request.body())
        busy = self.batcher.busy() + len(self._held)
        if busy:
            raise ServiceError(400, f"release_memory_occupation needs an idle engine (SGLang asserts that too): {busy} "
                                    "requests are queued, running or held; let them finish or abort them first")
        again = [tag for tag in tags if tag in self.released]
        if again:
            raise ServiceError(400, f"'tags': {again} already released", "tags")

        def release() -> None:
            with self._update_lock, self.model_lock:
                if "weights" in tags:
                    self._drop_staged()
                    for param in self._parameters.values():
                        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                self.released.update(tags)

        await asyncio.to_thread(release)
        return {"success": True, "message": "Released " + ", ".join(f"{tag} ({MEMORY_TAGS[tag]})" for tag in tags)}

    async def resume_memory_occupation(self, request: HTTPRequest) -> dict:
        tags = _memory_tags(await request.body())
        absent = [tag for tag in tags if tag not in self.released]
        if absent:
            raise ServiceError(400, f"'tags': {absent} not released", "tags")

        def resume() -> None:
            with self._update_lock, self.model_lock:
                if "weights" in tags:
                    for name, param in self._parameters.items():
                        param.data = torch.zeros(self._shapes[name], dtype=param.dtype, device=param.device)
                    self._weights_stale = True
                self.released.difference_update(tags)

        await asyncio.to_thread(resume)
        stale = " (weights are zeros until a complete weight update)" if "weights" in tags else ""
        return {"success": True, "message": f"Resumed {', '.join(tags)}{stale}"}

    def _unready(self) -> str | None:
        """Why the model cannot generate now (None: it can)."""
        if self.released:
            return (f"memory released by /release_memory_occupation ({', '.join(sorted(self.released))}): call "
                    "/resume_memory_occupation first")
        if self._weights_stale:
            return ("weights were resumed as zeros by /resume_memory_occupation: a complete weight update must load "
                    "them before generating")
        return None

    def _refuse_if_weights_released(self) -> None:
        if "weights" in self.released:
            raise ServiceError(400, "weights are released (/release_memory_occupation): resume them "
                                    "(/resume_memory_occupation) before updating them")

    async def _apply(self, bucket: list, version: int | None, finish: bool, route: str, extra: dict) -> JSONResponse:
        """Stage `bucket` for `version`; with `finish`, check the staged update is complete and swap it in."""
        target = version if version is not None else self.engine.version

        def load() -> str:
            with self._update_lock:
                try:
                    self._stage(bucket, target)
                    if finish:
                        self._swap_in(target)
                except (KeyError, ValueError, RuntimeError):
                    self._drop_staged()  # a refused bucket ends the update in progress
                    raise
            return f"Loaded {len(bucket)} tensors" + (f"; serving weight version {target}" if finish else
                                                      f" of weight version {target} (staged)")

        try:
            message = await asyncio.to_thread(load)
        except (KeyError, ValueError, RuntimeError) as err:
            self.updates.inc(route=route, outcome="failed")
            text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
            return JSONResponse({"success": False, "message": text, **extra}, status_code=400)
        self.updates.inc(route=route, outcome="finished" if finish else "bucket")
        return JSONResponse({"success": True, "message": message, **extra})

    def _stage(self, bucket: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Keep `bucket` (checked against the model) until its update finishes; a bucket of another version
        starts a new update. Caller holds `_update_lock`."""
        if self._staged_version != version:
            self._drop_staged()
            self._staged_version = version
        for name, tensor in bucket:
            canonical = self.engine.parameter_name(name)  # KeyError naming it when it is none
            if tuple(tensor.shape) != self._shapes[canonical]:
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != engine's {self._shapes[canonical]}")
            param = self._parameters[canonical]
            self._staged[canonical] = tensor.to(device=param.device, dtype=param.dtype)

    def _swap_in(self, version: int) -> None:
        """Load the staged update if every parameter is in it (else RuntimeError naming the missing ones), between
        decode steps. Caller holds `_update_lock`."""
        missing = sorted(set(self._parameters) - set(self._staged))
        if missing:
            more = f" and {len(missing) - 16} more" if len(missing) > 16 else ""
            raise RuntimeError(f"weight update {version} left parameters unset: {missing[:16]}{more}; the engine "
                               f"keeps serving weight version {self.engine.version}")
        with self.model_lock:
            self.engine.update_weights(list(self._staged.items()), version)
            self.engine.finish_weight_update(version)
            self._weights_stale = False
        self._drop_staged()

    def _drop_staged(self) -> None:
        self._staged.clear()
        self._staged_version = None


@dataclass
class WeightGroup:
    """An open weight-update group of this server (one rank); receives run one at a time."""

    name: str
    group: Any
    device: torch.device
    lock: threading.Lock = field(default_factory=threading.Lock)

    def receive(self, specs: list[tuple[str, torch.dtype, list[int]]]) -> list[torch.Tensor]:
        """One broadcast from rank 0 per spec, in order, into new tensors."""
        import torch.distributed as dist

        tensors = []
        with self.lock:
            for _, dtype, shape in specs:
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(tensor, src=0, group=self.group)
                tensors.append(tensor)
        return tensors


async def in_daemon_thread(fn: Any, *args: Any) -> Any:
    """`fn(*args)` on a new daemon thread: a torch.distributed call may block until its group's time-out (a
    sender that went away), and a daemon thread never holds up the process's exit as `asyncio.to_thread`'s
    workers do."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the waiting handler was cancelled
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            outcome = (fn(*args), None)
        except BaseException as err:  # handed to the waiting handler
            outcome = (None, err)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (the server stopped)
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="rl360-weight-group", daemon=True).start()
    return await future


def safetensors_weights(path: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the *.safetensors files in directory `path`; ValueError when there are none, a file is
    not safetensors, or a name appears twice."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path!r} holds no *.safetensors files (this server loads only safetensors)")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors = load_file(str(file))
        except Exception as err:  # safetensors raises its own error type for a malformed file
            raise ValueError(f"{file.name} is not a safetensors file: {err}") from None
        for name, tensor in tensors.items():
            if name in weights:
                raise ValueError(f"weight {name!r} is in more than one file (again in {file.name})")
            weights[name] = tensor
    return list(weights.items())


def _tensor_specs(data: dict) -> list[tuple[str, torch.dtype, list[int]]]:
    """`names`, `dtypes` and `shapes` of an /update_weights_from_distributed body, checked."""
    names, dtypes, shapes = data.get("names"), data.get("dtypes"), data.get("shapes")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise ServiceError(400, "'names' must be a non-empty list of weight names", "names")
    if len(set(names)) != len(names):
        raise ServiceError(400, f"'names' lists a weight twice: {sorted({n for n in names if names.count(n) > 1})[:8]}",
                           "names")
    for key, values in (("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(values, list) or len(values) != len(names):
            raise ServiceError(400, f"'{key}' must be a list with one entry per name ({len(names)})", key)
    for i, dtype in enumerate(dtypes):
        if dtype not in WEIGHT_DTYPES:
            raise ServiceError(400, f"'dtypes[{i}]' must be one of {sorted(WEIGHT_DTYPES)}, got {dtype!r}",
                               f"dtypes[{i}]")
    for i, shape in enumerate(shapes):
        if not isinstance(shape, list) or not all(is_int(s) and s >= 0 for s in shape):
            raise ServiceError(400, f"'shapes[{i}]' must be a list of non-negative integers, got {shape!r}",
                               f"shapes[{i}]")
    return [(name, WEIGHT_DTYPES[dtype], shape) for name, dtype, shape in zip(names, dtypes, shapes)]


def _group_name(data: dict) -> str:
    name = data.get("group_name")
    if name is None:
        return "weight_update_group"  # SGLang's default
    if not isinstance(name, str) or not name:
        raise ServiceError(400, f"'group_name' must be a non-empty string, got {name!r}", "group_name")
    return name


def _required_int(data: dict, key: str, low: int, high: int) -> int:
    if data.get(key) is None:
        raise ServiceError(400, f"'{key}' is required", key)
    return int(number_field(data, key, 0, low, high, integer=True))


def _memory_tags(body: bytes) -> list[str]:
    """The `tags` of a release/resume body (null or empty: all), checked."""
    tags = json_object(body or b"{}", {"tags"}).get("tags")
    if tags is None or tags == []:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags):
        raise ServiceError(400, f"'tags' must be a list of strings or null, got {tags!r}", "tags")
    unknown = [tag for tag in tags if tag not in MEMORY_TAGS]
    if unknown:
        raise ServiceError(400, f"'tags' has unknown {unknown} (accepted: {', '.join(MEMORY_TAGS)}; null: all)",
                           "tags")
    return list(dict.fromkeys(tags))


def _tokenizer(model_path: str) -> Any:
    """The checkpoint's tokenizer, or None when it has none (then `text` in and out is unavailable)."""
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any((Path(model_path) / name).is_file() for name in files):
        return None  # transformers would build an empty tokenizer from the model's config alone
    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError):
        return None


def serve_rollout(args: argparse.Namespace) -> int:
    api_key, limits = service_options(args, "rollout", "anyone who reaches it can generate and replace the weights")
    if args.batch_window_ms < 0 or args.max_batch_rows < 1:
        raise SystemExit("rl360 serve rollout: --batch-window-ms must be >= 0 and --max-batch-rows >= 1")
    check_model_dir(args.model, "--model", tokenizer=False)  # a server without a tokenizer takes input_ids
    if args.weight_sync_timeout_s <= 0:
        raise SystemExit("rl360 serve rollout: --weight-sync-timeout-s must be positive")
    service = RolloutService(args.model, limits, api_key, args.dtype, args.batch_window_ms / 1000.0,
                             args.max_batch_rows, args.weight_sync_timeout_s, args.min_pixels, args.max_pixels)
    return run_service(service.guard, args.host, args.port,
                       f"rl360 serving rollout engine {Path(args.model).name!r} with SGLang's native API on {{url}}",
                       access_log=args.access_log)


def add_rollout_parser(services) -> None:
    """Register `rl360 serve rollout` on the `serve` sub-command's parsers."""
    rollout = services.add_parser("rollout", help="the HF rollout engine behind SGLang's native HTTP API")
    rollout.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    rollout.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights' dtype")
    rollout.add_argument("--batch-window-ms", type=float, default=5.0,
                         help="after a request arrives, wait this long for others to batch with it")
    rollout.add_argument("--max-batch-rows", type=int, default=256, help="responses decoded together at most")
    rollout.add_argument("--weight-sync-timeout-s", type=float, default=600.0,
                         help="a weight-update group's rendezvous and each broadcast give up after this long")
    rollout.add_argument("--min-pixels", type=int, default=None,
                         help="vision models: an image's smallest resized area (default: the processor's)")
    rollout.add_argument("--max-pixels", type=int, default=None,
                         help="vision models: an image's largest resized area (default: the processor's)")
    add_service_arguments(rollout, port=30000, defaults=DEFAULT_LIMITS)
    rollout.set_defaults(run=serve_rollout)


def main(argv: list[str] | None = None) -> int:
    """`python -m rl360.engine.server --model DIR ...`: the same as `rl360 serve rollout`."""
    parser = argparse.ArgumentParser(prog="python -m rl360.engine.server")
    add_rollout_parser(parser.add_subparsers(dest="service", required=True))
    args = parser.parse_args(["rollout", *(sys.argv[1:] if argv is None else argv)])
    return run_command(args.run, args, prog="rl360.engine.server")


if __name__ == "__main__":
    raise SystemExit(main())
