"""`rl360 serve model`: a Hugging Face checkpoint behind the OpenAI chat and completions API.

    rl360 serve model --model outputs/quickstart/hf --port 8000 [--served-model-name NAME] [--api-key-env VAR]
                      [--dtype bfloat16] [--batch-window-ms 5] [--max-batch-rows 256] [--max-in-flight 64] ...

Routes: `POST /v1/chat/completions` (messages rendered with the tokenizer's chat template),
`POST /v1/completions` (a prompt string or a list of them), `GET /v1/models`, `GET /health`, `GET /metrics`.
Sampling keys: `temperature` (0: greedy), `top_p`, `top_k`, `max_tokens` (or `max_completion_tokens`; without
it, the rest of the model's context, as OpenAI's), `n`,
`stop` (strings; the text ends before the first one and its decoding stops there), `seed` (choice j of a prompt
is sampled with seed + j, so a reply does not depend on the requests it is batched with), `frequency_penalty` and
`presence_penalty` (in [-2, 2], on the generated text) and SGLang's and vLLM's `repetition_penalty` (in (0, 2],
on the prompt and the generated text; the `openai` client sends it with `extra_body`), as
`rl360.engine.penalties` applies them.

- `stream: true`: server-sent events as OpenAI sends them, `data: {chunk}` each and `data: [DONE]` last.
  Chat: per choice a first chunk with `delta.role` "assistant", then `delta.content` pieces as tokens are
  decoded, then a chunk with `delta: {}` and `finish_reason`; completions: `choices[].text` pieces, then
  `text: ""` with `finish_reason`. Choices of `n > 1` (and of several prompts) interleave, told apart by
  `index`. `stream_options: {"include_usage": true}` adds `usage: null` to every chunk and a last chunk with
  the usage and `choices: []`. The pieces put together are the whole reply's text. A client that hangs up
  ends its request: its choices stop decoding at the next step.
- Log-probs: chat `logprobs: true` (+ `top_logprobs: k`, at most 20) gives `choices[].logprobs.content[]`
  entries `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...]}`; completions `logprobs: k`
  gives the legacy `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}` (the k most likely
  and the sampled token; offsets within the completion text). Streamed chunks carry the log-probs of the
  tokens whose text they carry. A log-prob is that of the distribution the token was drawn from: the model's
  log-softmax of logits / temperature, before top-k/top-p (greedy: temperature 1); special tokens (the
  closing end-of-sequence token among them), which the text leaves out, are not listed, so the listed tokens
  join to the text.

Other OpenAI keys are accepted only at values that change nothing (`logit_bias: {}`, `tools: []`, ...;
`user` is ignored); any other key is an unknown field. Replies carry `choices` with `finish_reason` "stop" or
"length" and `usage` token counts. A malformed request (bad JSON, wrong types, unknown fields, values out of
range) gets HTTP 400 in OpenAI's error shape naming the key at fault (`error.param`); another model name gets
404; with `--api-key-env VAR` a request without `Authorization: Bearer $VAR` gets 401 (the key itself is
never printed). Keys, limits, deadlines, shutdown and metrics come from the service layer (`rl360.service.app`).

Concurrent requests are decoded together by the batcher of `rl360 serve rollout` (`rl360.engine.batching`):
every choice queued within `--batch-window-ms` of the first (up to `--max-batch-rows`) joins one left-padded
batch on the engine thread. Metrics add `rl360_model_generations_total` (by route),
`rl360_model_tokens_total` (prompt, completion), `rl360_model_responses_total` (by finish reason; abort: the
client left), and the batcher's `rl360_model_batches_total`, `rl360_model_batch_rows_total`,
`rl360_model_requests_running` and `rl360_model_requests_queued`.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from rl360.core import SamplingParams
from rl360.engine.generate_request import Row, penalty_fields
from rl360.model_dir import check_model_dir
from rl360.serve.openai_choices import ChoiceTracker, LogprobFormat, Piece
from rl360.service.app import (
    ServiceError,
    ServiceGuard,
    ServiceLimits,
    add_service_arguments,
    event_stream,
    json_object,
    number_field,
    run_service,
    service_app,
    service_options,
)
from rl360.service.metrics import MetricsRegistry

MAX_BODY_BYTES = 4 << 20
MAX_N = 16
MAX_TOP_LOGPROBS = 20
DEFAULT_LIMITS = ServiceLimits(max_body_bytes=MAX_BODY_BYTES, max_in_flight=64, request_timeout_s=600.0,
                               read_timeout_s=30.0, shutdown_grace_s=30.0)
# OpenAI keys accepted only at values that change nothing here (null is always fine)
NEUTRAL_VALUES: dict[str, tuple] = {
    "logit_bias": ({},), "response_format": ({"type": "text"},), "tools": ([],),
    "tool_choice": ("none", "auto"), "echo": (False,), "best_of": (1,), "suffix": ("",),
}
DEFAULT_MAX_TOKENS = 256  # without max_tokens, where the model's context length is unknown
_COMMON_FIELDS = {"model", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "n", "stop",
                  "seed", "stream", "user", "parallel_tool_calls", "frequency_penalty", "presence_penalty",
                  "repetition_penalty", "logit_bias", "stream_options"}
CHAT_FIELDS = frozenset(_COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "response_format", "tools",
                                          "tool_choice"})
COMPLETION_FIELDS = frozenset(_COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of", "suffix"})
_OPENAI_TYPES = {"unauthorized": "authentication_error", "not_found": "not_found_error",
                 "overloaded": "rate_limit_error", "internal": "server_error", "deadline": "timeout_error",
                 "draining": "server_error", "shutdown_cancelled": "server_error", "unavailable": "server_error"}


class RequestError(ServiceError):
    """A request the server answers with `status` and OpenAI's error body; `param` names the key at fault,
    `kind` is OpenAI's error `type`."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(status, message, param)
        self.openai_type = kind

    def body(self) -> dict:
        return openai_error(self)


def openai_error(error: ServiceError) -> dict:
    """OpenAI's error body for any error of the service."""
    kind = getattr(error, "openai_type", None) or _OPENAI_TYPES.get(error.kind, "invalid_request_error")
    return {"error": {"message": str(error), "type": kind, "param": error.param, "code": None}}


@dataclass
class Request:
    """A parsed chat or completions request: prompts (chat messages or text) and sampling settings."""

    prompts: list[Any]  # one list of messages (chat) or strings (completions)
    chat: bool
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = None  # None: the rest of the context, as OpenAI's default
    n: int = 1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    penalties: dict[str, float] = field(default_factory=dict)  # frequency_penalty, presence_penalty, repetition_...
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token (completions: `logprobs`, chat: `top_logprobs`)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage


def parse_request(body: bytes, chat: bool, served_name: str) -> Request:
    """The request in `body`; `RequestError` naming the key at fault."""
    try:
        data = json_object(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    except ServiceError as err:
        raise RequestError(err.status, str(err), err.param) from None
    model = data.get("model")
    if not isinstance(model, str):
        raise RequestError(400, "'model' must be a string", "model")
    if model != served_name:
        raise RequestError(404, f"model {model!r} is not served here; this server serves {served_name!r}", "model",
                           "not_found_error")
    _check_neutral(data)
    if chat:
        prompts = [_messages(data.get("messages"))]
    else:
        prompt = data.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise RequestError(400, "'prompt' must be a string or a non-empty list of strings", "prompt")
    request = Request(prompts, chat)
    request.temperature = number_field(data, "temperature", 1.0, 0.0, 2.0, error=RequestError)
    request.top_p = number_field(data, "top_p", 1.0, 0.0, 1.0, low_open=True, error=RequestError)
    request.top_k = int(number_field(data, "top_k", -1, -1, 1 << 20, integer=True, error=RequestError))
    request.n = int(number_field(data, "n", 1, 1, MAX_N, integer=True, error=RequestError))
    key = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    if data.get(key) is not None:
        request.max_tokens = int(number_field(data, key, 1, 1, 1 << 20, integer=True, error=RequestError))
    stop = data.get("stop")
    request.stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(request.stop, list) or not all(isinstance(s, str) and s for s in request.stop):
        raise RequestError(400, "'stop' must be a non-empty string or a list of them", "stop")
    if data.get("seed") is not None:
        request.seed = int(number_field(data, "seed", 0, -(1 << 63), (1 << 63) - 1, integer=True,
                                        error=RequestError))
    request.penalties = penalty_fields(data, error=RequestError)
    _logprob_fields(data, request)
    _stream_fields(data, request)
    return request


def _logprob_fields(data: dict, request: Request) -> None:
    if request.chat:
        request.logprobs = _bool_field(data, "logprobs")
        request.top_logprobs = int(number_field(data, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, integer=True,
                                                error=RequestError))
        if request.top_logprobs and not request.logprobs:
            raise RequestError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    elif data.get("logprobs") is not None:  # completions: the number of alternatives per token
        request.logprobs = True
        request.top_logprobs = int(number_field(data, "logprobs", 0, 0, MAX_TOP_LOGPROBS, integer=True,
                                                error=RequestError))


def _stream_fields(data: dict, request: Request) -> None:
    request.stream = _bool_field(data, "stream")
    options = data.get("stream_options")
    if options is None:
        return
    if not request.stream:
        raise RequestError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError(400, "'stream_options' must be an object with only 'include_usage'", "stream_options")
    request.include_usage = _bool_field(options, "include_usage", "stream_options.include_usage")


def _bool_field(data: dict, key: str, name: str | None = None) -> bool:
    value = data.get(key)
    if value is not None and not isinstance(value, bool):
        raise RequestError(400, f"'{name or key}' must be a boolean", name or key)
    return bool(value)


def _check_neutral(data: dict) -> None:
    if data.get("user") is not None and not isinstance(data["user"], str):
        raise RequestError(400, "'user' must be a string", "user")
    if data.get("parallel_tool_calls") is not None and not isinstance(data["parallel_tool_calls"], bool):
        raise RequestError(400, "'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    for key, neutral in NEUTRAL_VALUES.items():
        value = data.get(key)
        if value is not None and not any(_same(value, ok) for ok in neutral):
            allowed = " or ".join(["null", *(repr(ok) for ok in neutral)])
            raise RequestError(400, f"'{key}' is not supported by rl360 serve model (only {allowed}), got {value!r}",
                               key)


def _same(value: Any, neutral: Any) -> bool:
    numbers = (int, float)
    if isinstance(value, numbers) and isinstance(neutral, numbers) and bool not in (type(value), type(neutral)):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(400, f"messages[{i}] must be an object with a string 'role'", f"messages[{i}].role")
        if not isinstance(message.get("content"), str):
            raise RequestError(400, f"messages[{i}].content must be a string (text only)", f"messages[{i}].content")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class ModelService:
    """The model, its batcher and the routes; `guard` is what uvicorn runs."""

    def __init__(self, model_path: str, served_name: str, limits: ServiceLimits = DEFAULT_LIMITS,
                 api_key: str | None = None, dtype: str = "float32", batch_window_s: float = 0.005,
                 max_batch_rows: int = 256):
        import torch
        from transformers import AutoTokenizer

        from rl360.data import PromptRenderer
        from rl360.engine.batching import BatchDecoder, Batcher
        from rl360.engine.hf_engine import HFEngine

        self.engine = HFEngine(model_path, dtype=getattr(torch, dtype))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.renderer = PromptRenderer(self.tokenizer, max_prompt_length=1 << 30)
        self.context_length = int(getattr(self.engine.model.config, "max_position_embeddings", 0) or 0)
        self.served_name = served_name
        eos = getattr(self.engine.model.generation_config, "eos_token_id", None)
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_ids = ({self.tokenizer.eos_token_id} | set(eos)) - {None}
        registry = MetricsRegistry()
        decoder = BatchDecoder(self.engine, threading.Lock(), _ALWAYS, lambda: str(self.engine.version),
                               sorted(self.eos_ids))
        self.batcher = Batcher(decoder, batch_window_s, max_batch_rows, registry, prefix="rl360_model")
        self.logprob_format = LogprobFormat(self.tokenizer)
        self.generations = registry.counter("rl360_model_generations_total", "Requests the engine answered, by "
                                            "route.", ["route"])
        self.tokens = registry.counter("rl360_model_tokens_total", "Tokens read and written, by kind.", ["kind"])
        self.finished = registry.counter("rl360_model_responses_total", "Choices, by finish reason (abort: the "
                                         "client left or the service stopped it).", ["reason"])
        app = service_app(openai_error)
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        self.guard = ServiceGuard("model", app, limits, api_key, openai_error, registry)

    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self._answer(request, chat=True)

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._answer(request, chat=False)

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.served_name, "object": "model", "created": 0,
                                            "owned_by": "rl360"}]}

    async def _answer(self, http_request: HTTPRequest, chat: bool) -> Response:
        request = parse_request(await http_request.body(), chat, self.served_name)
        reply = Reply(self, request, self.prompt_ids(request), http_request.url.path)
        if request.stream:
            return event_stream(reply.chunks())
        return JSONResponse(await reply.whole())

    async def complete(self, request: Request, route: str = "") -> dict:
        """The whole reply body for a parsed request."""
        return await Reply(self, request, self.prompt_ids(request), route).whole()

    def prompt_ids(self, request: Request) -> list[list[int]]:
        """Each prompt's token ids (chat: rendered with the chat template); 400 when one does not fit the context
        with `max_tokens`."""
        prompts = [self.renderer.render(p) if request.chat else self.tokenizer(p)["input_ids"]
                   for p in request.prompts]
        longest = max(len(ids) for ids in prompts)
        if request.max_tokens is None:  # the rest of the context (its longest prompt's), as OpenAI's default
            request.max_tokens = self.context_length - longest if self.context_length else DEFAULT_MAX_TOKENS
            if request.max_tokens < 1:
                raise RequestError(400, f"prompt ({longest} tokens) fills the model's context length "
                                        f"{self.context_length}", "messages" if request.chat else "prompt")
        if self.context_length and longest + request.max_tokens > self.context_length:
            raise RequestError(400, f"prompt ({longest} tokens) + max_tokens ({request.max_tokens}) is over the "
                                    f"model's context length {self.context_length}", "max_tokens")
        return prompts

    def rows(self, request: Request, prompts: list[list[int]]) -> list[Row]:
        """One row per choice, in choice order (each prompt's `n` in turn); sample j of a prompt is seeded
        `seed + j`."""
        rid = uuid.uuid4().hex
        params = SamplingParams(n=1, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                                max_new_tokens=request.max_tokens, **request.penalties)
        return [Row(ids, params, None if request.seed is None else request.seed + j, rid, index=i,
                    top_logprobs=request.top_logprobs if request.logprobs else 0)
                for i, ids in enumerate(prompts) for j in range(request.n)]


_ALWAYS = threading.Event()  # generation is never paused here
_ALWAYS.set()


class Reply:
    """One request's choices decoded by the batcher, answered whole or as OpenAI's stream of chunks."""

    def __init__(self, service: ModelService, request: Request, prompts: list[list[int]], route: str):
        self.service, self.request, self.prompts, self.route = service, request, prompts, route
        self.rows = service.rows(request, prompts)
        self.choices = [ChoiceTracker(row, i, service.tokenizer, request.stop, service.eos_ids)
                        for i, row in enumerate(self.rows)]
        self.id = f"{'chatcmpl' if request.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    async def pieces(self):
        """(choice, piece) as the engine decodes, until every choice is finished; leaving early (the client
        hung up, the request was cancelled) stops the decoding of its rows."""
        try:
            async for settled in self.service.batcher.steps(self.rows):
                for choice in self.choices:
                    piece = choice.advance()
                    if piece is not None:
                        yield choice, piece
                if settled:  # every row is finished (or aborted) once the batcher settles them
                    break
        except Exception as err:  # raised by the decoding
            raise _generation_failed(err) from err
        finally:
            self._count()

    async def whole(self) -> dict:
        """The reply body once every choice is finished."""
        async for _ in self.pieces():
            pass
        fmt = self.service.logprob_format
        choices = []
        for choice in self.choices:
            positions = range(choice.end)
            if self.request.chat:
                logprobs = {"content": fmt.chat(choice.row, positions), "refusal": None} if self.request.logprobs \
                    else None
                choices.append({"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                                "logprobs": logprobs, "finish_reason": choice.finish_reason})
            else:
                logprobs = fmt.legacy(choice.row, positions, choice.offsets) if self.request.logprobs else None
                choices.append({"index": choice.index, "text": choice.text, "finish_reason": choice.finish_reason,
                                "logprobs": logprobs})
        return {"id": self.id, "object": "chat.completion" if self.request.chat else "text_completion",
                "created": self.created, "model": self.service.served_name, "choices": choices,
                "usage": self._usage()}

    async def chunks(self):
        """OpenAI's stream: per choice a first chunk (chat: the role), then its text as it is decoded, then a
        chunk with its finish reason; with `include_usage`, a last chunk with the usage and no choices."""
        if self.request.chat:
            for choice in self.choices:
                yield self._chunk(choice.index, {"role": "assistant", "content": ""}, None, None)
        async for choice, piece in self.pieces():
            if piece.text or (self.request.logprobs and piece.tokens):
                yield self._chunk(choice.index, piece.text, self._chunk_logprobs(choice, piece), None)
            if piece.finish_reason is not None:
                yield self._chunk(choice.index, {} if self.request.chat else "", None, piece.finish_reason)
        if self.request.include_usage:
            yield {**self._chunk(0, "", None, None), "choices": [], "usage": self._usage()}

    def _chunk(self, index: int, content: Any, logprobs: Any, finish_reason: str | None) -> dict:
        if self.request.chat:
            delta = content if isinstance(content, dict) else {"content": content}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": content, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.request.chat else "text_completion",
                 "created": self.created, "model": self.service.served_name, "choices": [choice]}
        if self.request.include_usage:
            chunk["usage"] = None
        return chunk

    def _chunk_logprobs(self, choice: ChoiceTracker, piece: Piece) -> dict | None:
        if not self.request.logprobs:
            return None
        fmt = self.service.logprob_format
        if self.request.chat:
            return {"content": fmt.chat(choice.row, piece.tokens), "refusal": None}
        return fmt.legacy(choice.row, piece.tokens, choice.offsets)

    def _usage(self) -> dict:
        prompt_tokens = sum(len(self.prompts[row.index]) for row in self.rows[::self.request.n])
        completion_tokens = sum(choice.completion_tokens for choice in self.choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _count(self) -> None:
        service = self.service
        if all(choice.done and choice.finish_reason != "abort" for choice in self.choices):
            service.generations.inc(route=self.route)
        for choice in self.choices:
            service.finished.inc(reason=choice.finish_reason if choice.done else "abort")
        usage = self._usage()
        service.tokens.inc(usage["prompt_tokens"], kind="prompt")
        service.tokens.inc(usage["completion_tokens"], kind="completion")


def _generation_failed(error: BaseException) -> ServiceError:
    if isinstance(error, ServiceError):
        return error
    return RequestError(500, f"generation failed: {type(error).__name__}: {error}", kind="server_error")


def serve_model(args: argparse.Namespace) -> int:
    api_key, limits = service_options(args, "model", "anyone who reaches it can use the model")
    check_model_dir(args.model, "--model")
    name = args.served_model_name or Path(args.model).name
    if args.batch_window_ms < 0 or args.max_batch_rows < 1:
        raise SystemExit("rl360 serve model: --batch-window-ms must be >= 0 and --max-batch-rows >= 1")
    service = ModelService(args.model, name, limits, api_key, args.dtype, args.batch_window_ms / 1000.0,
                           args.max_batch_rows)
    return run_service(service.guard, args.host, args.port,
                       f"rl360 serving model {name!r} with the OpenAI API on {{url}}/v1", access_log=args.access_log)


def add_model_parser(services) -> None:
    model = services.add_parser("model", help="a Hugging Face checkpoint behind the OpenAI chat/completions API")
    model.add_argument("--model", required=True, help="Hugging Face checkpoint directory (with its tokenizer)")
    model.add_argument("--served-model-name", default="", help="the name clients send as 'model' (default: "
                                                               "the directory's name)")
    model.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights' dtype")
    model.add_argument("--batch-window-ms", type=float, default=5.0,
                       help="after a request arrives, wait this long for others to batch with it")
    model.add_argument("--max-batch-rows", type=int, default=256, help="choices decoded together at most")
    add_service_arguments(model, port=8000, defaults=DEFAULT_LIMITS)
    model.set_defaults(run=serve_model)
