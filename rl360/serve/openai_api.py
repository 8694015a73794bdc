"""`rl360 serve model`: a Hugging Face checkpoint behind the OpenAI chat and completions API.

    rl360 serve model --model outputs/quickstart/hf --port 8000 [--served-model-name NAME] [--api-key-env VAR]
                      [--dtype bfloat16]

Routes: `POST /v1/chat/completions` (messages rendered with the tokenizer's chat template),
`POST /v1/completions` (a prompt string or a list of them), `GET /v1/models`, `GET /health`.
Sampling keys: `temperature` (0: greedy), `top_p`, `top_k`, `max_tokens` (or `max_completion_tokens`), `n`,
`stop` (strings; the text is cut before the first one), `seed`. Replies carry `choices` with
`finish_reason` "stop" or "length" and `usage` token counts. A malformed request gets HTTP 400 in OpenAI's
error shape naming the key at fault (`error.param`); another model name gets 404; with `--api-key-env VAR`
a request without `Authorization: Bearer $VAR` gets 401 (the key itself is never printed).

It samples with the rollout's HF engine (`rl360.rollout.hf_engine`), one request at a time: this is the
small local endpoint the LLM-judge client and the tests talk to, not a production server (streaming,
batching of concurrent requests and log-probs in replies are not built).
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rl360.serve.http import JSONHandler, serve

MAX_BODY_BYTES = 4 << 20
MAX_N = 16


class RequestError(ValueError):
    """A request the server answers with `status` and OpenAI's error body; `param` names the key at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


@dataclass
class Request:
    """A parsed chat or completions request: prompts (chat messages or text) and sampling settings."""

    prompts: list[Any]  # one list of messages (chat) or strings (completions)
    chat: bool
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    n: int = 1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


def parse_request(body: bytes, chat: bool, served_name: str) -> Request:
    """The request in `body`; `RequestError` naming the key at fault."""
    try:
        data = json.loads(body)
    except ValueError as err:
        raise RequestError(400, f"body is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise RequestError(400, "body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str):
        raise RequestError(400, "'model' must be a string", "model")
    if model != served_name:
        raise RequestError(404, f"model {model!r} is not served here; this server serves {served_name!r}", "model",
                           "not_found_error")
    if data.get("stream"):
        raise RequestError(400, "'stream' is not supported by rl360 serve model", "stream")
    if chat:
        prompts = [_messages(data.get("messages"))]
    else:
        prompt = data.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise RequestError(400, "'prompt' must be a string or a non-empty list of strings", "prompt")
    request = Request(prompts, chat)
    request.temperature = _number(data, "temperature", 1.0, 0.0, 2.0)
    request.top_p = _number(data, "top_p", 1.0, 0.0, 1.0, low_open=True)
    request.top_k = int(_number(data, "top_k", -1, -1, 1 << 20, integer=True))
    request.n = int(_number(data, "n", 1, 1, MAX_N, integer=True))
    key = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    request.max_tokens = int(_number(data, key, 256, 1, 1 << 20, integer=True))
    stop = data.get("stop")
    request.stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(request.stop, list) or not all(isinstance(s, str) and s for s in request.stop):
        raise RequestError(400, "'stop' must be a non-empty string or a list of them", "stop")
    if data.get("seed") is not None:
        request.seed = int(_number(data, "seed", 0, -(1 << 63), (1 << 63) - 1, integer=True))
    return request


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(400, f"messages[{i}] must be an object with a string 'role'", f"messages[{i}].role")
        if not isinstance(message.get("content"), str):
            raise RequestError(400, f"messages[{i}].content must be a string (text only)", f"messages[{i}].content")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _number(data: dict, key: str, default: float, low: float, high: float, integer: bool = False,
            low_open: bool = False) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise RequestError(400, f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}", key)
    if not (low < value if low_open else low <= value) or value > high:
        raise RequestError(400, f"'{key}' must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}", key)
    return value


class ModelServer(ThreadingHTTPServer):
    """The HTTP server; requests wait their turn for the engine (it serves one at a time)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], model_path: str, served_name: str, api_key: str | None = None,
                 dtype: str = "float32"):
        import torch
        from transformers import AutoTokenizer

        from rl360.data import PromptRenderer
        from rl360.rollout.hf_engine import HFEngine

        self.engine = HFEngine(model_path, dtype=getattr(torch, dtype))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.renderer = PromptRenderer(self.tokenizer, max_prompt_length=1 << 30)
        self.context_length = int(getattr(self.engine.model.config, "max_position_embeddings", 0) or 0)
        self.served_name = served_name
        self._api_key = api_key
        self._engine_lock = threading.Lock()
        super().__init__(address, _Handler)

    def authorized(self, header: str | None) -> bool:
        if not self._api_key:
            return True
        return header is not None and hmac.compare_digest(header.encode(), f"Bearer {self._api_key}".encode())

    def complete(self, request: Request) -> dict:
        """The reply body for a parsed request."""
        from rl360.rollout.base import SamplingParams

        prompt_ids = [self.renderer.render(p) if request.chat else self.tokenizer(p)["input_ids"]
                      for p in request.prompts]
        longest = max(len(ids) for ids in prompt_ids)
        if self.context_length and longest + request.max_tokens > self.context_length:
            raise RequestError(400, f"prompt ({longest} tokens) + max_tokens ({request.max_tokens}) is over the "
                                    f"model's context length {self.context_length}", "max_tokens")
        params = SamplingParams(n=request.n, temperature=request.temperature, top_p=request.top_p,
                                top_k=request.top_k, max_new_tokens=request.max_tokens,
                                stop_token_ids=sorted({self.tokenizer.eos_token_id} - {None}),
                                seed=request.seed if request.seed is not None else time.time_ns() % (1 << 62))
        with self._engine_lock:
            groups = self.engine.generate(prompt_ids, params)
        choices, completion_tokens = [], 0
        for group in groups:
            for sample in group:
                text, reason = self._text(sample.response_ids, sample.finish_reason, request.stop)
                index = len(choices)
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "finish_reason": reason} if request.chat else
                               {"index": index, "text": text, "finish_reason": reason, "logprobs": None})
                completion_tokens += len(sample.response_ids)
        prompt_tokens = sum(len(ids) for ids in prompt_ids)
        return {"id": f"{'chatcmpl' if request.chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if request.chat else "text_completion",
                "created": int(time.time()), "model": self.served_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def _text(self, response_ids: list[int], finish_reason: str, stop: list[str]) -> tuple[str, str]:
        text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in stop if s in text]
        if cuts:
            return text[:min(cuts)], "stop"
        return text, finish_reason


class _Handler(JSONHandler):
    server: ModelServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (http.server's signature)
        pass  # one line per request on stderr is noise for a judge endpoint

    def do_GET(self) -> None:  # noqa: N802  (http.server's naming)
        path = self.path.rstrip("/")
        if path == "/health":
            self.reply(200, {"status": "ok"})
        elif path == "/v1/models":
            if self._check_key():
                self.reply(200, {"object": "list", "data": [{"id": self.server.served_name, "object": "model",
                                                               "created": 0, "owned_by": "rl360"}]})
        else:
            self.reply(404, RequestError(404, f"no route {self.path}", kind="not_found_error").body())

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.rstrip("/")
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self.reply(404, RequestError(404, f"no route {self.path}", kind="not_found_error").body())
            return
        if not self._check_key():
            return
        length = int(self.headers.get("Content-Length") or 0)
        try:
            if length > MAX_BODY_BYTES:
                raise RequestError(413, f"body of {length} bytes is over {MAX_BODY_BYTES}")
            request = parse_request(self.rfile.read(length), path.endswith("chat/completions"),
                                    self.server.served_name)
            self.reply(200, self.server.complete(request))
        except RequestError as err:
            self.reply(err.status, err.body())
        except Exception as err:  # the engine failed on this request: say so, keep serving
            self.reply(500, RequestError(500, f"generation failed: {type(err).__name__}: {err}",
                                          kind="server_error").body())

    def _check_key(self) -> bool:
        if self.server.authorized(self.headers.get("Authorization")):
            return True
        self.reply(401, RequestError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                      kind="authentication_error").body())
        return False


def serve_model(args: argparse.Namespace) -> int:
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise SystemExit(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    name = args.served_model_name or Path(args.model).name
    return serve(ModelServer((args.host, args.port), args.model, name, api_key, args.dtype),
                 f"rl360 serving model {name!r} with the OpenAI API on {{url}}/v1"
                 f"{' (API key required)' if api_key else ''}")


def add_model_parser(services) -> None:
    model = services.add_parser("model", help="a Hugging Face checkpoint behind the OpenAI chat/completions API")
    model.add_argument("--model", required=True, help="Hugging Face checkpoint directory (with its tokenizer)")
    model.add_argument("--served-model-name", default="", help="the name clients send as 'model' (default: "
                                                               "the directory's name)")
    model.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights' dtype")
    model.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    model.add_argument("--port", type=int, default=8000, help="port (0: any free port, printed at start)")
    model.add_argument("--api-key-env", default="", help="require 'Authorization: Bearer $VAR' (the variable's "
                                                         "name; the key is read from the environment)")
    model.set_defaults(run=serve_model)
