"""The batched decoder of `rl360 serve rollout`: queued rows decoded together as one left-padded batch, each
row with its own sampling settings and random generator, so a response does not depend on its batch mates.
Text and image rows mix in a batch: the engine's `prefill` builds the batch, its positions and its images'
features."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

from rl360.core import ImagePrompt
from rl360.engine.generate_request import Row
from rl360.engine.hf_engine import _filtered_probs, cached_forward, next_positions
from rl360.engine.penalties import PenaltyState
from rl360.engine.routes import sequence_routes
from rl360.engine.stop_strings import StopMatcher
from rl360.service.app import ServiceError
from rl360.service.metrics import MetricsRegistry


class BatchDecoder:
    """Decodes a list of rows as one left-padded batch, each row with its own settings and generator.

    `model_lock` is held for each forward step and released between steps, so weight updates (which take it
    too) land between steps; `resume` is waited on between steps while generation is paused in place.
    `unready()` (under the lock, before each step) says why the model cannot run now (None: it can): the
    batch then fails with 503 naming the reason. `tokenizer` decodes the rows that have stop strings
    (`SamplingParams.stop`: a row ends at the token completing one, finish reason `{"type": "stop", "matched": s}`)."""

    def __init__(self, engine: Any, model_lock: threading.Lock, resume: threading.Event,
                 version: Any, eos_ids: list[int], unready: Any = lambda: None, tokenizer: Any = None):
        self.engine, self.model_lock, self.resume, self.version = engine, model_lock, resume, version
        self.eos_ids, self.unready, self.tokenizer = eos_ids, unready, tokenizer
        self._routes: tuple[list[torch.Tensor], dict[int, int]] | None = None  # the batch decoding now's MoE routes

    @torch.no_grad()
    def decode(self, rows: list[Row]) -> None:
        device, pad = self.engine.device, self.engine.pad_id
        prompts = [ImagePrompt(row.prompt, row.images) if row.images else row.prompt for row in rows]
        generators = [torch.Generator(device=device).manual_seed(
            row.seed if row.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1) for row in rows]
        stops = [set(row.params.stop_token_ids) | (set() if row.ignore_eos else set(self.eos_ids)) for row in rows]
        matchers = [StopMatcher(self.tokenizer, row.params.stop) if row.params.stop else None for row in rows]
        self._routes = ([], {id(row): i for i, row in enumerate(rows)}) if self.engine.routes.has_experts and any(
            row.routed_experts for row in rows) else None  # MoE routes: each forward's, and each row's position
        running = [row.params.max_new_tokens > 0 for row in rows]
        # max_new_tokens 0 with logprob_start_len >= 0: the prompt's log-probs only (a teacher scoring given tokens)
        scoring = [not running[i] and row.logprob_start_len >= 0 for i, row in enumerate(rows)]
        for i, row in enumerate(rows):
            if not running[i] and not scoring[i]:
                self._finish(row, {"type": "length", "length": 0})
        cache, step = None, 0
        penalties: list[PenaltyState | None] = []  # per row, from the first step's logits (None: no penalty)
        while any(running) or (step == 0 and any(scoring)):
            self.resume.wait()
            with self.model_lock:
                problem = self.unready()
                if problem is not None:
                    raise ServiceError(503, problem)
                if step == 0:  # under the lock: the vision tower runs on the weights being served
                    batch = self.engine.prefill(prompts, [row.pixels for row in rows])
                    mask, positions, step_inputs = batch.mask, batch.positions, batch.first_inputs()
                output, cache = self._forward(cache, mask, positions, step_inputs)
            if step == 0:
                self._input_logprobs(rows, output.logits, batch.ids.shape[1])
                for i, row in enumerate(rows):
                    if scoring[i]:
                        self._finish(row, {"type": "length", "length": 0})
            logits = output.logits[:, -1, :].float()
            if step == 0:
                penalties = [PenaltyState.start([row.prompt], row.params, logits.shape[-1], logits.device)
                             for row in rows]
            next_tokens = torch.full((len(rows),), pad, dtype=torch.long)
            for i, row in enumerate(rows):
                if not running[i]:
                    continue
                if row.aborted is not None:
                    running[i] = False
                    self._finish(row, {"type": "abort", "message": row.aborted})
                    continue
                row_logits = logits[i:i + 1] if penalties[i] is None else penalties[i].apply(logits[i:i + 1])
                scaled = row_logits / row.params.temperature if row.params.temperature > 0 else row_logits
                if row.params.temperature > 0:
                    token = int(torch.multinomial(_filtered_probs(scaled, row.params), 1, generator=generators[i]))
                else:
                    token = int(scaled.argmax(-1))
                logp = torch.log_softmax(scaled[0], -1)
                if row.top_logprobs > 0:
                    values, ids = logp.topk(min(row.top_logprobs, logp.shape[-1]))
                    row.top.append(list(zip(ids.tolist(), values.tolist())))
                row.logprobs.append(float(logp[token]))
                row.tokens.append(token)  # last: a reader on another thread that sees the token sees its log-probs
                if penalties[i] is not None:
                    penalties[i].add(torch.tensor([token]))
                next_tokens[i] = token
                matched = matchers[i].push(token)[1] if matchers[i] is not None else None
                if token in stops[i]:
                    running[i] = False
                    self._finish(row, {"type": "stop", "matched": token})
                elif matched is not None:
                    running[i] = False
                    self._finish(row, {"type": "stop", "matched": matched.string})
                elif len(row.tokens) >= row.params.max_new_tokens:
                    running[i] = False
                    self._finish(row, {"type": "length", "length": row.params.max_new_tokens})
                elif row.on_token is not None:
                    row.on_token(row)
            step += 1
            alive = torch.tensor(running, dtype=torch.long, device=device)
            step_inputs = {"input_ids": next_tokens.to(device)[:, None]}
            mask = torch.cat([mask, alive[:, None]], dim=-1)
            positions = next_positions(positions)

    def _forward(self, cache: Any, mask: torch.Tensor, positions: torch.Tensor, inputs: dict) -> tuple[Any, Any]:
        """One forward step (its routes kept when a row asks for them)."""
        if self._routes is None:
            return cached_forward(self.engine.model, cache, attention_mask=mask, position_ids=positions, **inputs)
        shape = next(iter(inputs.values())).shape
        with self.engine.routes.forward(shape[0], shape[1]) as recorded:
            result = cached_forward(self.engine.model, cache, attention_mask=mask, position_ids=positions, **inputs)
        self._routes[0].extend(recorded)
        return result

    def _finish(self, row: Row, reason: dict) -> None:
        if row.routed_experts and self._routes is not None and self._routes[0]:
            forwards, positions = self._routes
            row.routes = sequence_routes(forwards[0], forwards[1:], positions[id(row)], len(row.prompt),
                                         len(row.tokens))
        row.finish_reason = reason
        row.weight_version = self.version()
        if row.on_token is not None:
            row.on_token(row)

    @staticmethod
    def _input_logprobs(rows: list[Row], logits: torch.Tensor, width: int) -> None:
        for i, row in enumerate(rows):
            if row.logprob_start_len < 0:
                continue
            offset = width - len(row.prompt)
            plain = torch.log_softmax(logits[i, offset:offset + len(row.prompt) - 1].float(), -1)
            values = plain.gather(-1, torch.tensor(row.prompt[1:], device=plain.device)[:, None])[:, 0].tolist()
            row.input_logprobs = ([None] + values)[row.logprob_start_len:]


class Batcher:
    """The queue of rows and the engine thread that takes them in batches."""

    def __init__(self, decoder: BatchDecoder, window_s: float, max_rows: int, registry: MetricsRegistry,
                 prefix: str = "rl360_rollout"):
        self.decoder, self.window_s, self.max_rows = decoder, window_s, max_rows
        self.batch_count = registry.counter(f"{prefix}_batches_total", "Batches the engine decoded.")
        self.batch_rows = registry.counter(f"{prefix}_batch_rows_total", "Responses decoded in those batches.")
        # SGLang's num_running_reqs / num_queue_reqs: what a load balancer, or a test killing an engine mid-request,
        # reads
        self.running_gauge = registry.gauge(f"{prefix}_requests_running", "Responses being decoded now.")
        self.queued_gauge = registry.gauge(f"{prefix}_requests_queued", "Responses waiting for the next batch.")
        self.running_gauge.set(0)
        self.queued_gauge.set(0)
        self._queue: list[tuple[Row, asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._lock = threading.Condition()
        self.running: list[Row] = []
        threading.Thread(target=self._serve, name=f"{prefix}-engine", daemon=True).start()

    async def submit(self, rows: list[Row]) -> None:
        """Decode `rows` (filling in their results); cancelled: the rows are aborted at the next step."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in rows]
        with self._lock:
            self._queue.extend((row, fut, loop) for row, fut in zip(rows, futures))
            self.queued_gauge.set(len(self._queue))
            self._lock.notify()
        try:
            await asyncio.gather(*futures)
        except asyncio.CancelledError:
            for row in rows:
                row.aborted = row.aborted or "request cancelled"
            raise

    async def steps(self, rows: list[Row]) -> AsyncIterator[bool]:
        """Decode `rows`, yielding after the engine thread has added tokens to any of them (at most one wake-up per
        decode step) and once more, True, when every row is settled (finished or aborted). A decoding failure is
        raised here; leaving early (the client hung up, the request was cancelled) aborts the rows at the next step."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        signalled = threading.Event()  # a wake-up is on its way to the event loop: one per step, not one per row

        def wake(_row: Row) -> None:  # on the engine thread
            if not signalled.is_set():
                signalled.set()
                with contextlib.suppress(RuntimeError):  # the event loop is closing
                    loop.call_soon_threadsafe(changed.set)

        for row in rows:
            row.on_token = wake
        decoding = asyncio.create_task(self.submit(rows))
        try:
            while True:
                waiter = asyncio.create_task(changed.wait())
                await asyncio.wait({decoding, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                changed.clear()
                signalled.clear()  # before the rows are read: a token added from now on wakes the loop again
                if decoding.done() and decoding.exception() is not None:
                    raise decoding.exception()
                yield decoding.done()
                if decoding.done():
                    return
        finally:
            for row in rows:
                row.aborted = row.aborted or "request ended"
            if not decoding.done():
                decoding.cancel()

    def busy(self) -> int:
        """Rows queued or decoding."""
        with self._lock:
            return len(self._queue) + len(self.running)

    def abort(self, rid: str | None, message: str) -> int:
        """Abort queued and running rows of `rid` (None: all); return how many were marked."""
        with self._lock:
            rows = [row for row, _, _ in self._queue] + list(self.running)
        marked = 0
        for row in rows:
            if (rid is None or row.rid == rid) and row.finish_reason is None and row.aborted is None:
                row.aborted = message
                marked += 1
        return marked

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
            time.sleep(self.window_s)  # let requests sent together arrive together
            with self._lock:
                taken, self._queue = self._queue[:self.max_rows], self._queue[self.max_rows:]
                self.running = [row for row, _, _ in taken]
                self.running_gauge.set(len(self.running))
                self.queued_gauge.set(len(self._queue))
            pending = [(row, fut, loop) for row, fut, loop in taken if not self._settle_aborted(row, fut, loop)]
            error: BaseException | None = None
            try:
                if pending:
                    self.decoder.decode([row for row, _, _ in pending])
                    self.batch_count.inc()
                    self.batch_rows.inc(len(pending))
            except BaseException as err:  # handed to every request of the batch
                error = err
            with self._lock:
                self.running = []
                self.running_gauge.set(0)
            for _, fut, loop in pending:
                loop.call_soon_threadsafe(_settle, fut, error)

    def _settle_aborted(self, row: Row, fut: asyncio.Future, loop: asyncio.AbstractEventLoop) -> bool:
        if row.aborted is None:
            return False
        self.decoder._finish(row, {"type": "abort", "message": row.aborted})
        loop.call_soon_threadsafe(_settle, fut, None)
        return True


def _settle(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
