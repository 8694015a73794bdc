"""`rl360 serve listener`: the Lewis game's listener, a model that picks the described image among candidates.

    rl360 serve listener --model outputs/lewis/round1_listener/hf --port 9000 [--max-batch 8] [--concurrency 1]
                         [--device cuda:7] [--dtype bfloat16] [--api-key-env VAR] [--host 127.0.0.1] ...

Routes (the Lewis-game listener service's shapes):

- `POST /score` with `{"candidate_paths": [...], "question": "...", "topk": 1}` and `POST /batch_score` with
  `{"batch": [{...}, ...]}` both reply `{"results": [{"yes_probabilities": [...], "predicted_index": i}, ...],
  "took": seconds}`, one result per item in order. A candidate's yes-probability is the model's probability of
  answering "Yes" first (softmax of its next-token logits over the whole vocabulary) to the question about that
  candidate image, prompted as `rl360.data.lewis.listener_prompt` writes it (as the listener's training rows do);
  `predicted_index` is the most probable candidate. `topk` > 1 adds `topk_indices`, the `topk` most probable
  candidates, most probable first.
- Candidates are image files the service reads by path (a shared filesystem, as the speaker's rows name them).
  A vision-language model (Qwen2-VL / Qwen2.5-VL) sees the image; a text-only model reads the PNG's `caption`
  text chunk instead (the CPU quickstart's listener). A path that cannot be read, or a text listener's image
  without a caption, is a 400 naming the item and the candidate.

Every candidate of every admitted request joins one queue; up to `--concurrency` forwards run at once, each over
at most `--max-batch` candidates taken from the queue's head, so concurrent requests share forwards. Keys, limits
(`--max-in-flight`, `--request-timeout`, ...), `/health` and `/metrics` come from the service layer
(`rl360.service.app`); metrics add `rl360_listener_items_total` (by route), `rl360_listener_candidates_total` and
`rl360_listener_forwards_total`. Without `--api-key-env` the service listens on loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request as HTTPRequest

from rl360.data.lewis import YES, listener_prompt
from rl360.data.schema import DataError
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
ITEM_FIELDS = frozenset({"candidate_paths", "question", "topk"})
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
        raise ServiceError(400, f"'{where}' must be an object with candidate_paths, question and topk", where)
    unknown = [key for key in data if key not in ITEM_FIELDS]
    if unknown:
        raise ServiceError(400, f"unknown field '{prefix}{unknown[0]}' (accepted: {', '.join(sorted(ITEM_FIELDS))})",
                           prefix + unknown[0])
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
    """The model and how it scores: P("Yes") for each (image, question) prompt."""

    def __init__(self, model_path: str, dtype: str = "float32", device: str | None = None):
        import torch
        from transformers import AutoTokenizer

        from rl360.data import PromptRenderer
        from rl360.engine.hf_engine import HFEngine

        self.engine = HFEngine(model_path, dtype=getattr(torch, dtype), device=device or None)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.renderer = PromptRenderer.for_model(model_path, self.tokenizer, max_prompt_length=1 << 30)
        self.vision = self.renderer.vision is not None
        ids = self.tokenizer.encode(YES, add_special_tokens=False)
        if not ids or self.tokenizer.unk_token_id in ids:
            raise ValueError(f"{model_path}: the tokenizer cannot spell {YES!r}")
        self.yes_id = ids[0]

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
            return output.logits[:, -1].float().softmax(-1)[:, self.yes_id].tolist()


class ListenerService:
    """The scorer, its queue of candidates and the routes; `guard` is what uvicorn runs."""

    def __init__(self, scorer: ListenerScorer, limits: ServiceLimits = DEFAULT_LIMITS, api_key: str | None = None,
                 max_batch: int = 8, concurrency: int = 1):
        if max_batch < 1 or concurrency < 1:
            raise ValueError(f"max_batch={max_batch} and concurrency={concurrency} must be >= 1")
        self.scorer, self.max_batch, self.concurrency = scorer, max_batch, concurrency
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
        item = parse_item(json_object(await request.body(), ITEM_FIELDS), "")
        return await self.answer([item], "/score")

    async def batch_score(self, request: HTTPRequest) -> dict:
        data = json_object(await request.body(), {"batch"})
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
        return list(await asyncio.gather(*futures))

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
    service = ListenerService(ListenerScorer(args.model, args.dtype, args.device), limits, api_key, args.max_batch,
                              args.concurrency)
    kind = "vision-language" if service.scorer.vision else "text (captions)"
    return run_service(service.guard, args.host, args.port,
                       f"rl360 serving listener {args.model} ({kind}) on {{url}} (/score, /batch_score)",
                       access_log=args.access_log)


def add_listener_parser(services) -> None:
    listener = services.add_parser("listener", help="the Lewis game's listener: P(Yes) per candidate image")
    listener.add_argument("--model", required=True, help="Hugging Face checkpoint directory (with its tokenizer)")
    listener.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights' dtype")
    listener.add_argument("--device", default="", help="torch device, e.g. cuda:7 (default: cuda when there is "
                                                       "one, else cpu)")
    listener.add_argument("--max-batch", type=int, default=8, help="candidates in one forward at most")
    listener.add_argument("--concurrency", type=int, default=1, help="forwards run at once at most")
    add_service_arguments(listener, port=9000, defaults=DEFAULT_LIMITS)
    listener.set_defaults(run=serve_listener)
