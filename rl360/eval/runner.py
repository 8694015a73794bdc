"""Sending an evaluation's requests: every (prompt, sample) pair not yet in `<out>/results.jsonl`, over the
endpoints, appended to it as each finishes.

- Resume: the results file is read first (a line cut short by a crash is dropped and the file truncated to the
  last whole line); only missing pairs are sent. Sample j of prompt i is seeded `seed + i * n + j`, so a resumed
  run's samples are those an unbroken run draws. `<out>/eval_run.json` holds what the results depend on (files,
  sampling, seed, n, model or endpoints' protocol); a rerun with other values in the same directory is refused.
- Dispatch: at most `eval.concurrency` requests in flight per endpoint (per engine of the fleet started on
  `eval.model`, which is one target dispatching over its engines and restarting those that fail); each request
  goes to the usable endpoint with the fewest in flight. A retryable failure (connection, time-out, 429, 5xx)
  marks the endpoint down for `backoff_s * 2**failures` and sends the pair again, up to `eval.max_retries` times
  in a round; pairs still failing wait for the next of `eval.retry_rounds` rounds. A request the endpoint refuses
  (another 4xx) is recorded as that sample's error.
- Progress: a line every `progress_every_s`: done / total, requests and tokens per second, ETA, retries.

Evaluation during training (`rl360.eval.during_training`) runs this dispatcher on the training run's sampler as its
one target, into each evaluated step's directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl360.config import ConfigError
from rl360.errors import UserError
from rl360.eval.config import EvalConfig, sampling_values
from rl360.eval.inputs import EvalPrompt
from rl360.eval.targets import Endpoint, RequestFailed

RESULTS = "results.jsonl"


class EndpointRefused(UserError):
    """The endpoints cannot serve this evaluation as configured (unreachable, or the key refused)."""

    label = "endpoint error"


def key_refused(error: RequestFailed, api_key_env: str) -> str:
    where = (f"the key in ${api_key_env}" if api_key_env else "no key (set eval.api_key_env to the variable holding "
             "the server's key)")
    return f"{error} -- the endpoint refused {where}"
RUN_FILE = "eval_run.json"


def run_identity(cfg: EvalConfig) -> dict[str, Any]:
    """What the samples depend on: a rerun into the same output_dir must match it."""
    t = cfg.eval
    return {"files": [str(Path(f).resolve()) for f in cfg.data.files], "prompt_field": cfg.data.prompt_field,
            "max_prompts": cfg.data.max_prompts, "n": cfg.sampling.n, "seed": cfg.seed,
            "sampling": sampling_values(cfg.sampling),
            "target": {"model": str(Path(t.model).resolve()) if t.model else "", "protocol": t.protocol,
                       "served_model": t.served_model}}


def check_run_identity(cfg: EvalConfig, out: Path) -> None:
    path = out / RUN_FILE
    identity = run_identity(cfg)
    if path.exists():
        before = json.loads(path.read_text())
        if before != identity:
            changed = sorted(k for k in set(before) | set(identity) if before.get(k) != identity.get(k))
            raise ConfigError(f"{out} holds results of an evaluation with other {', '.join(changed)} ({path}); "
                              "set output_dir to a new directory, or remove that one to start over")
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(identity, indent=1))
    tmp.replace(path)


def read_results(path: Path, prompts: int, n: int) -> dict[tuple[int, int], dict]:
    """The finished pairs of a results file, keyed (prompt, sample); a cut last line is dropped from the file."""
    done: dict[tuple[int, int], dict] = {}
    if not path.exists():
        return done
    good_bytes = 0
    with open(path, "rb") as handle:
        for raw in handle:
            if not raw.endswith(b"\n"):
                break  # a write cut short (SIGKILL): dropped below
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                break
            key = (record["prompt"], record["sample"])
            if 0 <= key[0] < prompts and 0 <= key[1] < n:
                done[key] = record
            good_bytes += len(raw)
    if good_bytes != path.stat().st_size:
        os.truncate(path, good_bytes)
    return done


@dataclass(frozen=True)
class DispatchSettings:
    """How the dispatcher sends an evaluation's pairs: `n` samples per prompt, sample j of prompt i seeded
    `seed + i * n + j`, and its retry, backoff and progress settings."""

    n: int
    seed: int
    max_retries: int = 3  # retries of one pair within a round
    retry_rounds: int = 5  # rounds over the pairs still failing
    backoff_s: float = 1.0  # first rest after a failure, doubling per failure
    progress_every_s: float = 5.0  # seconds between progress lines
    api_key_env: str = ""  # named when an endpoint refuses the key
    final_line: bool = True  # a last progress line when all are sent (its rates and time)

    @classmethod
    def of(cls, cfg: EvalConfig) -> DispatchSettings:
        t = cfg.eval
        return cls(cfg.sampling.n, cfg.seed, t.max_retries, t.retry_rounds, t.backoff_s, cfg.progress_every_s,
                   t.api_key_env)


@dataclass
class DispatchStats:
    total: int = 0
    done_before: int = 0
    sent: int = 0  # HTTP requests, retries included
    retries: int = 0
    failed: list[tuple[int, int, str]] = field(default_factory=list)  # pairs given up on (retryable failures)
    tokens: int = 0
    seconds: float = 0.0


class Dispatcher:
    def __init__(self, settings: DispatchSettings, endpoints: list[Endpoint], prompts: list[EvalPrompt], out: Path):
        self.settings, self.endpoints, self.prompts, self.out = settings, endpoints, prompts, out
        self.n = settings.n
        self._changed = asyncio.Condition()
        self.stats = DispatchStats()
        self._finished = 0

    # ---- endpoints ----
    async def _acquire(self) -> Endpoint:
        """The usable endpoint with the fewest requests in flight (below the limit), waiting for one."""
        async with self._changed:
            while True:
                now = time.monotonic()
                free = [e for e in self.endpoints if e.usable(now) and e.in_flight < e.capacity]
                if free:
                    endpoint = min(free, key=lambda e: (e.in_flight, e.sent, e.index))
                    endpoint.in_flight += 1
                    endpoint.sent += 1
                    return endpoint
                wake = [e.down_until - now for e in self.endpoints if not e.usable(now)]
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=max(0.01, min(wake)) if wake else None)
                except TimeoutError:
                    pass

    async def _release(self, endpoint: Endpoint, failed: bool) -> None:
        async with self._changed:
            endpoint.in_flight -= 1
            if failed:
                endpoint.failures += 1
                endpoint.down_until = time.monotonic() + self.settings.backoff_s * 2 ** min(endpoint.failures - 1, 6)
            else:
                endpoint.failures = 0
            self._changed.notify_all()

    # ---- one pair ----
    async def _pair(self, i: int, j: int, sink) -> str | None:
        """Send pair (i, j) until it is recorded; the last retryable failure's text when the round gives up."""
        prompt, seed = self.prompts[i], self.settings.seed + i * self.n + j
        error = None
        for attempt in range(self.settings.max_retries + 1):
            endpoint = await self._acquire()
            self.stats.sent += 1
            self.stats.retries += int(attempt > 0)
            try:
                reply = await endpoint.sample(prompt, seed)
            except RequestFailed as err:
                await self._release(endpoint, err.retryable)
                if err.refused_key:
                    raise EndpointRefused(key_refused(err, self.settings.api_key_env)) from None
                if not err.retryable:
                    self._record(sink, {"prompt": i, "sample": j, "seed": seed, "response": "",
                                        "finish_reason": "error", "tokens": 0, "error": str(err)})
                    return None
                error = str(err)
                continue
            await self._release(endpoint, False)
            self.stats.tokens += reply.tokens
            self._record(sink, {"prompt": i, "sample": j, "seed": seed, "response": reply.text,
                                "finish_reason": reply.finish_reason, "tokens": reply.tokens, "error": None,
                                **({"trajectory": reply.trajectory} if reply.trajectory is not None else {})})
            return None
        return error

    def _record(self, sink, record: dict) -> None:
        sink.write(json.dumps(record) + "\n")
        sink.flush()
        self._finished += 1

    # ---- the run ----
    async def run(self, done: dict[tuple[int, int], dict]) -> DispatchStats:
        pending = [(i, j) for i in range(len(self.prompts)) for j in range(self.n) if (i, j) not in done]
        self.stats.total, self.stats.done_before = len(self.prompts) * self.n, len(done)
        started = time.monotonic()
        if pending:
            await self._prepare()
        progress = asyncio.get_running_loop().create_task(self._progress(started, len(pending)))
        try:
            with open(self.out / RESULTS, "a", encoding="utf-8") as sink:
                for round_ in range(self.settings.retry_rounds + 1):
                    if not pending:
                        break
                    if round_:
                        wait = self.settings.backoff_s * 2 ** (round_ - 1)
                        print(f"eval: retry round {round_}/{self.settings.retry_rounds}: {len(pending)} request(s) "
                              f"failed; again in {wait:g} s", flush=True)
                        await asyncio.sleep(wait)
                    pending, errors = await self._round(pending, sink)
                self.stats.failed = [(i, j, errors[(i, j)]) for i, j in pending]
        finally:
            progress.cancel()
        self.stats.seconds = time.monotonic() - started
        if self.settings.final_line:
            self._print_progress(started, len(pending) + self._finished, final=True)
        return self.stats

    async def _prepare(self) -> None:
        """Each endpoint's preparation; one that fails starts resting (it serves the model the others name)."""
        answers = await asyncio.gather(*(endpoint.prepare() for endpoint in self.endpoints), return_exceptions=True)
        failed = [(e, a) for e, a in zip(self.endpoints, answers) if isinstance(a, BaseException)]
        refused = [a for _, a in failed if isinstance(a, RequestFailed) and a.refused_key]
        if refused:
            raise EndpointRefused(key_refused(refused[0], self.settings.api_key_env))
        if len(failed) == len(self.endpoints):
            error = failed[0][1]
            if isinstance(error, RequestFailed):
                raise EndpointRefused(f"no endpoint answered: {error} (check eval.endpoints: each the base URL of a "
                                      "running server, e.g. http://host:8000/v1)")
            raise RuntimeError(f"no endpoint answered: {error}") from error
        ready = next(e for e, a in zip(self.endpoints, answers) if not isinstance(a, BaseException))
        for endpoint, error in failed:
            print(f"eval: endpoint {endpoint.url} failed at the start ({error}); trying it again later", flush=True)
            endpoint.served_model = getattr(ready, "served_model", "")
            endpoint.failures, endpoint.down_until = 1, time.monotonic() + self.settings.backoff_s

    async def _round(self, pairs: list[tuple[int, int]], sink) -> tuple[list[tuple[int, int]], dict]:
        slots = asyncio.Semaphore(sum(endpoint.capacity for endpoint in self.endpoints))
        errors: dict[tuple[int, int], str] = {}

        async def one(pair: tuple[int, int]) -> None:
            async with slots:
                error = await self._pair(*pair, sink)
            if error is not None:
                errors[pair] = error

        await asyncio.gather(*(one(pair) for pair in pairs))
        return [pair for pair in pairs if pair in errors], errors

    async def _progress(self, started: float, todo: int) -> None:
        while True:
            await asyncio.sleep(self.settings.progress_every_s)
            self._print_progress(started, todo)

    def _print_progress(self, started: float, todo: int, final: bool = False) -> None:
        elapsed = max(time.monotonic() - started, 1e-9)
        done = self._finished
        rate = done / elapsed
        eta = (todo - done) / rate if rate > 0 else float("inf")
        total = self.stats.total
        finished = self.stats.done_before + done
        line = (f"eval: {finished}/{total} samples ({100 * finished / max(total, 1):.0f}%), {rate:.1f} req/s, "
                f"{self.stats.tokens / elapsed:.0f} tok/s, " +
                (f"{elapsed:.1f} s" if final else f"ETA {_duration(eta)}") + f", retries {self.stats.retries}")
        print(line, file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
