"""`rl360 serve listener`: the Lewis game's listener, a model that picks the described image among candidates, as a
drop-in for the game's own `listener_service.py`.

    rl360 serve listener --model outputs/lewis/round1_listener/hf --port 9000 [--max-batch 8] [--concurrency 1]
                         [--scoring yes-vs-no|yes] [--acquire-timeout-s 300] [--device cuda:7] [--dtype bfloat16]
                         [--api-key-env VAR] [--host 127.0.0.1] ...

Routes (the game's service's shapes):

- `POST /score` with `{"candidate_paths": [...], "question": "...", "topk": 1}` replies
  `{"yes_probabilities": [...], "predicted_index": i, "took": seconds}`; `POST /batch_score` with
  `{"batch": [{...}, ...]}` replies `{"results": [{"yes_probabilities": [...], "predicted_index": i}, ...],
  "took": seconds}`, one result per item in order. Fields the game's requests do not define are ignored (its
  pydantic models ignore them too). `predicted_index` is the most probable candidate (the first of equals);
  `topk` > 1 adds `topk_indices`, the `topk` most probable candidates, most probable first.
- A candidate's yes-probability, by `--scoring`: `yes-vs-no` (default, the game's rule) the probability of the
  first answer token "yes" renormalised against "no" (softmax over their two log-probabilities; the tokens as
  the game's service finds them: the token named "yes", else the first token of "yes" spelled), or `yes` the
  probability of "Yes" first over the whole vocabulary (what rl360's own listener rows train: `rl360 alternate`
  serves its listener so). The question about each candidate image is prompted as
  `rl360.data.lewis.listener_prompt` writes it (as the listener's training rows do).
- Candidates are image files the service reads by path (a shared filesystem, as the speaker's rows name them).
  A vision-language model (Qwen2-VL / Qwen2.5-VL) sees the image; a text-only model reads the PNG's `caption`
  text chunk instead (the CPU quickstart's listener). A path that cannot be read, or a text listener's image
  without a caption, is a 400 naming the item and the candidate.

Every candidate of every admitted request joins one queue; up to `--concurrency` forwards run at once, each over
at most `--max-batch` candidates taken from the queue's head, so concurrent requests share forwards. A request
whose candidates have not all reached a forward within `--acquire-timeout-s` is answered 503 "Listener busy; try
again later", as the game's service answers. The game's variables set the defaults: INFERENCE_CONCURRENCY
(`--concurrency`), LISTENER_BATCH_SIZE (`--max-batch`), INFERENCE_ACQUIRE_TIMEOUT (`--acquire-timeout-s`). Keys,
limits (`--max-in-flight`, `--request-timeout`, ...), `/health` and `/metrics` come from the service layer
(`rl360.service.app`); metrics add `rl360_listener_items_total` (by route), `rl360_listener_candidates_total` and
`rl360_listener_forwards_total`. Without `--api-key-env` the service listens on loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request as HTTPRequest

from rl360.data.lewis import YES, listener_prompt
from rl360.data.schema import DataError
from rl360.errors import UserError
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
)
from rl360.service.metrics import MetricsRegistry

DEFAULT_LIMITS = ServiceLimits(max_body_bytes=4 << 20, max_in_flight=64, request_timeout_s=300.0,
                               read_timeout_s=30.0, shutdown_grace_s=30.0)
SCORINGS = ("yes-vs-no", "yes")
PEER_ENV = {"concurrency": "INFERENCE_CONCURRENCY", "max_batch": "LISTENER_BATCH_SIZE",
            "acquire_timeout_s": "INFERENCE_ACQUIRE_TIMEOUT"}  # the game's service's variables: our defaults
MAX_CANDIDATES = 64
MAX_BATCH_ITEMS = 256


@dataclass(frozen=True)
class Item:
    paths: list[str]
    question: str
    topk: int


def parse_item(data: Any, where: str) -> Item:
    """One `{candidate_paths, question, topk}` item; `ServiceError(400)` naming the field at fault."""
    prefix = f"{where}." if where else ""
    if not isinstance(data, dict):
        raise ServiceError(400, f"'{where or 'body'}' must be an object with candidate_paths, question and topk",
                           where)
    paths = data.get("candidate_paths")
    if not isinstance(paths, list) or not paths or len(paths) > MAX_CANDIDATES \
            or not all(isinstance(path, str) and path for path in paths):
        raise ServiceError(400, f"'{prefix}candidate_paths' must be a list of 1 to {MAX_CANDIDATES} file paths",
                           prefix + "candidate_paths")
    question = data.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ServiceError(400, f"'{prefix}question' must be a non-empty string", prefix + "question")
    topk = int(number_field(data, "topk", 1, 1, len(paths), integer=True, where=where))
    return Item(paths, question, topk)


class ListenerScorer:
    """The model and how it scores each (image, question) prompt (`scoring`, see the module docstring)."""

    def __init__(self, model_path: str, dtype: str = "float32", device: str | None = None,
                 scoring: str = "yes-vs-no"):
        import torch
        from transformers import AutoTokenizer

        from rl360.data import PromptRenderer
        from rl360.engine.hf_engine import HFEngine

        self.engine = HFEngine(model_path, dtype=getattr(torch, dtype), device=device or None)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.renderer = PromptRenderer.for_model(model_path, self.tokenizer, max_prompt_length=1 << 30)
        self.vision = self.renderer.vision is not None
        if scoring not in SCORINGS:
            raise ValueError(f"scoring={scoring!r}: choose one of {SCORINGS}")
        self.scoring = scoring
        if scoring == "yes":
            self.yes_id, self.no_id = self._token(model_path, YES, by_name=False), None
        else:
            self.yes_id, self.no_id = self._token(model_path, "yes"), self._token(model_path, "no")

    def _token(self, model_path: str, word: str, by_name: bool = True) -> int:
        """The id of `word`: the token of that name (the game's service's first choice), else the first token of
        its spelling; ValueError when the tokenizer has neither."""
        unknown = self.tokenizer.unk_token_id
        if by_name:
            found = self.tokenizer.convert_tokens_to_ids(word)
            if isinstance(found, int) and found != unknown:
                return found
        ids = self.tokenizer.encode(word, add_special_tokens=False)
        if not ids or unknown in ids:
            raise ValueError(f"{model_path}: the tokenizer cannot spell {word!r} (--scoring {self.scoring}); "
                             f"choose the other --scoring")
        return ids[0]

    def prompt(self, path: str, question: str, where: str):
        """What the model reads for one candidate (token ids, or an ImagePrompt)."""
        from rl360.core import ImagePrompt

        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise ServiceError(400, f"{where}: cannot read {path!r}: {err.strerror or err}", where) from None
        try:
            messages, images = listener_prompt(question, data, self.vision, where)
            if images:
                return ImagePrompt(self.renderer.vision.render(messages, images, where), tuple(images))
            return self.renderer.render(messages)
        except DataError as err:
            raise ServiceError(400, str(err), where) from None

    def yes_probabilities(self, prompts: list) -> list[float]:
        import torch

        with torch.no_grad():
            batch = self.engine.prefill(prompts)
            output = self.engine.model(attention_mask=batch.mask, position_ids=batch.positions,
                                       **batch.first_inputs())
            logp = output.logits[:, -1].float().log_softmax(-1)
            if self.no_id is None:
                return logp[:, self.yes_id].exp().tolist()
            return torch.stack([logp[:, self.yes_id], logp[:, self.no_id]], 1).softmax(1)[:, 0].tolist()


class ListenerService:
    """The scorer, its queue of candidates and the routes; `guard` is what uvicorn runs."""

    def __init__(self, scorer: ListenerScorer, limits: ServiceLimits = DEFAULT_LIMITS, api_key: str | None = None,
                 max_batch: int = 8, concurrency: int = 1, acquire_timeout_s: float = 300.0):
        if max_batch < 1 or concurrency < 1 or acquire_timeout_s <= 0:
            raise ValueError(f"max_batch={max_batch} and concurrency={concurrency} must be >= 1 and "
                             f"acquire_timeout_s={acquire_timeout_s} > 0")
        self.scorer, self.max_batch, self.concurrency = scorer, max_batch, concurrency
        self.acquire_timeout_s = acquire_timeout_s
        self._queue: collections.deque = collections.deque()  # (prompt, future) not yet in a forward
        self._running = 0
        registry = MetricsRegistry()
        self.items = registry.counter("rl360_listener_items_total", "Items scored, by route.", ["route"])
        self.candidates = registry.counter("rl360_listener_candidates_total", "Candidate images scored.")
        self.forwards = registry.counter("rl360_listener_forwards_total", "Model forwards (batches of candidates).")
        app = service_app()
        app.add_api_route("/score", self.score, methods=["POST"])
        app.add_api_route("/batch_score", self.batch_score, methods=["POST"])
        self.guard = ServiceGuard("listener", app, limits, api_key, registry=registry)

    async def score(self, request: HTTPRequest) -> dict:
        item = parse_item(json_object(await request.body(), None), "")  # extra fields ignored
        answer = await self.answer([item], "/score")
        return {**answer["results"][0], "took": answer["took"]}  # the game's /score: one result, flat

    async def batch_score(self, request: HTTPRequest) -> dict:
        data = json_object(await request.body(), None)
        batch = data.get("batch")
        if not isinstance(batch, list) or not batch or len(batch) > MAX_BATCH_ITEMS:
            raise ServiceError(400, f"'batch' must be a list of 1 to {MAX_BATCH_ITEMS} items", "batch")
        return await self.answer([parse_item(entry, f"batch[{i}]") for i, entry in enumerate(batch)], "/batch_score")

    async def answer(self, items: list[Item], route: str) -> dict:
        started = time.perf_counter()
        prompts = [[self.scorer.prompt(path, item.question, f"batch[{i}].candidate_paths[{j}]" if route ==
                                       "/batch_score" else f"candidate_paths[{j}]")
                    for j, path in enumerate(item.paths)] for i, item in enumerate(items)]
        flat = await self._scored([prompt for group in prompts for prompt in group])
        results, start = [], 0
        for item in items:
            probabilities = flat[start:start + len(item.paths)]
            start += len(item.paths)
            order = sorted(range(len(probabilities)), key=lambda k: -probabilities[k])
            result = {"yes_probabilities": probabilities, "predicted_index": order[0]}
            if item.topk > 1:
                result["topk_indices"] = order[:item.topk]
            results.append(result)
        self.items.inc(len(items), route=route)
        self.candidates.inc(len(flat))
        return {"results": results, "took": time.perf_counter() - started}

    async def _scored(self, prompts: list) -> list[float]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in prompts]
        self._queue.extend(zip(prompts, futures))
        self._start_forwards()
        busy = loop.call_later(self.acquire_timeout_s, self._expire, futures)
        try:
            return list(await asyncio.gather(*futures))
        finally:
            busy.cancel()

    def _expire(self, futures: list) -> None:
        """The request waited past --acquire-timeout-s for a forward: answered busy (its queued candidates go)."""
        waiting = {id(future) for _, future in self._queue}
        if any(id(future) in waiting for future in futures):
            for future in futures:
                if not future.done():
                    future.set_exception(ServiceError(503, "Listener busy; try again later"))

    def _start_forwards(self) -> None:
        while self._queue and self._running < self.concurrency:
            batch = []
            while self._queue and len(batch) < self.max_batch:
                prompt, future = self._queue.popleft()
                if not future.done():  # a cancelled request's candidates are dropped here
                    batch.append((prompt, future))
            if batch:
                self._running += 1
                asyncio.ensure_future(self._forward(batch))

    async def _forward(self, batch: list) -> None:
        try:
            probabilities = await asyncio.to_thread(self.scorer.yes_probabilities, [prompt for prompt, _ in batch])
            self.forwards.inc()
            for (_, future), value in zip(batch, probabilities):
                if not future.done():
                    future.set_result(value)
        except Exception as err:
            for _, future in batch:
                if not future.done():
                    future.set_exception(err)
        finally:
            self._running -= 1
            self._start_forwards()


def serve_listener(args: argparse.Namespace) -> int:
    api_key, limits = service_options(args, "listener", "anyone who reaches it can have it read image files")
    check_model_dir(args.model, "--model")
    if args.max_batch < 1 or args.concurrency < 1:
        raise SystemExit("rl360 serve listener: --max-batch and --concurrency must be >= 1")
    if args.acquire_timeout_s <= 0:
        raise SystemExit("rl360 serve listener: --acquire-timeout-s must be positive")
    try:
        scorer = ListenerScorer(args.model, args.dtype, args.device, args.scoring)
    except ValueError as err:
        raise UserError(str(err)) from None
    service = ListenerService(scorer, limits, api_key, args.max_batch, args.concurrency, args.acquire_timeout_s)
    kind = "vision-language" if service.scorer.vision else "text (captions)"
    return run_service(service.guard, args.host, args.port,
                       f"rl360 serving listener {args.model} ({kind}) on {{url}} (/score, /batch_score)",
                       access_log=args.access_log)


def _peer_default(name: str, kind: type, default: Any) -> Any:
    value = os.environ.get(PEER_ENV[name], "").strip()
    if not value:
        return default
    try:
        return kind(value)
    except ValueError:
        raise UserError(f"{PEER_ENV[name]}={value!r} is not a valid {kind.__name__}") from None


def add_listener_parser(services) -> None:
    listener = services.add_parser("listener", help="the Lewis game's listener: P(Yes) per candidate image")
    listener.add_argument("--model", required=True, help="Hugging Face checkpoint directory (with its tokenizer)")
    listener.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights' dtype")
    listener.add_argument("--device", default="", help="torch device, e.g. cuda:7 (default: cuda when there is "
                                                       "one, else cpu)")
    listener.add_argument("--max-batch", type=int, default=_peer_default("max_batch", int, 8),
                          help="candidates in one forward at most (default: LISTENER_BATCH_SIZE, else 8)")
    listener.add_argument("--concurrency", type=int, default=_peer_default("concurrency", int, 1),
                          help="forwards run at once at most (default: INFERENCE_CONCURRENCY, else 1)")
    listener.add_argument("--acquire-timeout-s", type=float, default=_peer_default("acquire_timeout_s", float, 300.0),
                          help="a request not in a forward within this long is answered 503 busy (default: "
                               "INFERENCE_ACQUIRE_TIMEOUT, else 300)")
    listener.add_argument("--scoring", choices=SCORINGS, default="yes-vs-no",
                          help="yes-vs-no: P(yes) renormalised against P(no), the game's service's rule; yes: "
                               "P(Yes) over the vocabulary, what rl360's listener rows train")
    add_service_arguments(listener, port=9000, defaults=DEFAULT_LIMITS)
    listener.set_defaults(run=serve_listener)
