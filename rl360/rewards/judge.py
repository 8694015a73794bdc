"""LLM-as-judge rewards through any OpenAI-compatible chat endpoint (vLLM, SGLang, OpenAI, ...).

    client = JudgeClient(url="http://judge:8000/v1", model="Qwen2.5-72B-Instruct")   # or RL360_JUDGE_* env
    results = client.score_batch([JudgeItem("correctness", question=q, reference=r, response=a), ...])

- Endpoint, model and key come from the arguments or the environment: RL360_JUDGE_URL, RL360_JUDGE_MODEL,
  RL360_JUDGE_API_KEY (else OPENAI_API_KEY). The key is sent as a bearer token and appears in no log line,
  repr, exception or metric.
- Requests run concurrently, at most `max_concurrency` at a time. A request that times out
  (`timeout_s`), loses its connection, or gets HTTP 429 / 5xx is retried up to `max_retries` times with
  exponential backoff and jitter (a Retry-After header is honoured, capped); other 4xx fail at once. Each
  item also has a total deadline (`deadline_s`), so nothing hangs: every item ends with a score or a
  failure whose kind is counted (`timeout`, `http_<status>`, `connection`, `unparseable`, `bad_response`).
- Identical queries (model, messages, sampling parameters) are sent once: concurrent duplicates wait for
  the first, later ones hit the cache (bounded, least recently used evicted).
- Templates turn fields into a prompt and the judge's text into a score. Built in: `correctness` (a
  one-word "Correct" / "Incorrect" grade of a response against a reference) and `verifier` (reasoning that
  ends with "Final Decision: Yes" or "No"). `register_template(name, prompt, parse)` adds one.

As a reward function: `reward.custom={vqa: "rl360.rewards.judge:judge_score"}` grades with the
`correctness` template, the question taken from `extra_info["question"]` and the client from the
environment.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger(__name__)

URL_ENV, MODEL_ENV, KEY_ENVS = "RL360_JUDGE_URL", "RL360_JUDGE_MODEL", ("RL360_JUDGE_API_KEY", "OPENAI_API_KEY")
MAX_RETRY_AFTER_S = 30.0


@dataclass(frozen=True)
class Template:
    prompt: str  # str.format fields, e.g. {question} {reference} {response}
    parse: Callable[[str], float | None]  # the judge's text -> score, None when it cannot be read


def _parse_correct(text: str) -> float | None:
    words = re.findall(r"[A-Za-z]+", text)
    if not words:
        return None
    first = words[0].lower()
    return 1.0 if first == "correct" else 0.0 if first == "incorrect" else None


def _parse_final_decision(text: str) -> float | None:
    decisions = re.findall(r"Final Decision:\s*\**\s*(Yes|No)\b", text, flags=re.IGNORECASE)
    return None if not decisions else 1.0 if decisions[-1].lower() == "yes" else 0.0


TEMPLATES: dict[str, Template] = {
    "correctness": Template(
        "You grade answers. Compare the response with the reference answer to the question; wording and "
        "format may differ, the meaning and any final value must agree.\n\n"
        "Question: {question}\nReference answer: {reference}\nResponse: {response}\n\n"
        "Reply with exactly one word: Correct or Incorrect.",
        _parse_correct),
    "verifier": Template(
        "Decide whether the response's final answer is equivalent to the reference answer.\n\n"
        "Question: {question}\nReference answer: {reference}\nResponse: {response}\n\n"
        "Reason briefly, then end with a line 'Final Decision: Yes' or 'Final Decision: No'.",
        _parse_final_decision),
}


def register_template(name: str, prompt: str, parse: Callable[[str], float | None]) -> None:
    """Add a template: `prompt` with str.format fields, `parse` from the judge's text to a score."""
    TEMPLATES[name] = Template(prompt, parse)


@dataclass(frozen=True)
class JudgeItem:
    template: str
    fields: dict = field(default_factory=dict)

    def __init__(self, template: str, **fields: str):
        object.__setattr__(self, "template", template)
        object.__setattr__(self, "fields", fields)


@dataclass
class JudgeResult:
    score: float | None  # None when the item failed
    text: str = ""  # the judge's reply
    error: str | None = None  # failure kind: timeout, http_<status>, connection, unparseable, bad_response
    attempts: int = 0
    cached: bool = False


class _Failure(Exception):
    def __init__(self, kind: str, retryable: bool, wait_s: float | None = None):
        super().__init__(kind)
        self.kind, self.retryable, self.wait_s = kind, retryable, wait_s


class JudgeClient:
    def __init__(self, url: str | None = None, model: str | None = None, api_key: str | None = None, *,
                 max_concurrency: int = 8, timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 1.0,
                 deadline_s: float = 300.0, temperature: float = 0.0, max_tokens: int = 512,
                 cache_size: int = 10_000):
        self.url = (url or os.environ.get(URL_ENV, "")).rstrip("/")
        self.model = model or os.environ.get(MODEL_ENV, "")
        if not self.url or not self.model:
            raise ValueError(f"judge needs an endpoint URL and a model: pass url= and model= or set {URL_ENV} "
                             f"and {MODEL_ENV}")
        self._api_key = api_key if api_key is not None else next(
            (os.environ[name] for name in KEY_ENVS if os.environ.get(name)), "")
        self.max_concurrency, self.timeout_s, self.max_retries = max_concurrency, timeout_s, max_retries
        self.backoff_s, self.deadline_s = backoff_s, deadline_s
        self.temperature, self.max_tokens = temperature, max_tokens
        self._cache: OrderedDict[str, JudgeResult] = OrderedDict()
        self._cache_size = cache_size
        self.counts = {"judge/requests": 0, "judge/retries": 0, "judge/failures": 0, "judge/cache_hits": 0}

    def __repr__(self) -> str:
        return (f"JudgeClient(url={self.url!r}, model={self.model!r}, api_key={'set' if self._api_key else 'unset'}, "
                f"max_concurrency={self.max_concurrency})")

    # ---- public API ------------------------------------------------------------------------------

    def score_batch(self, items: list[JudgeItem]) -> list[JudgeResult]:
        """Judge `items` (blocking); results in input order."""
        return asyncio.run(self.ascore_batch(items))

    async def ascore_batch(self, items: list[JudgeItem]) -> list[JudgeResult]:
        semaphore = asyncio.Semaphore(self.max_concurrency)
        in_flight: dict[str, asyncio.Future] = {}
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self._headers()) as http:
            return list(await asyncio.gather(*(self._judge(http, semaphore, in_flight, item) for item in items)))

    # ---- one item --------------------------------------------------------------------------------

    async def _judge(self, http: httpx.AsyncClient, semaphore: asyncio.Semaphore,
                     in_flight: dict[str, asyncio.Future], item: JudgeItem) -> JudgeResult:
        if item.template not in TEMPLATES:
            raise KeyError(f"unknown judge template {item.template!r}; registered: {sorted(TEMPLATES)}")
        template = TEMPLATES[item.template]
        payload = {"model": self.model, "temperature": self.temperature, "max_tokens": self.max_tokens,
                   "messages": [{"role": "user", "content": template.prompt.format(**item.fields)}]}
        key = json.dumps(payload, sort_keys=True)
        if key in self._cache:
            self._cache.move_to_end(key)
            self.counts["judge/cache_hits"] += 1
            return JudgeResult(**{**self._cache[key].__dict__, "cached": True})
        if key in in_flight:  # an identical query is on its way: share its answer
            self.counts["judge/cache_hits"] += 1
            result = await asyncio.shield(in_flight[key])
            return JudgeResult(**{**result.__dict__, "cached": True})
        future = asyncio.get_running_loop().create_future()
        in_flight[key] = future
        try:
            result = await asyncio.wait_for(self._request_with_retries(http, semaphore, payload, template),
                                            self.deadline_s)
        except TimeoutError:
            result = JudgeResult(None, error="timeout")
        if result.error is None:
            self._remember(key, result)
        else:
            self.counts["judge/failures"] += 1
            logger.warning("judge %s (%s): item failed: %s after %d attempts", self.url, self.model, result.error,
                           result.attempts)
        future.set_result(result)
        del in_flight[key]
        return result

    async def _request_with_retries(self, http: httpx.AsyncClient, semaphore: asyncio.Semaphore, payload: dict,
                                    template: Template) -> JudgeResult:
        attempts = 0
        while True:
            attempts += 1
            try:
                async with semaphore:
                    self.counts["judge/requests"] += 1
                    text = await self._request(http, payload)
            except _Failure as failure:
                if not failure.retryable or attempts > self.max_retries:
                    return JudgeResult(None, error=failure.kind, attempts=attempts)
                self.counts["judge/retries"] += 1
                await asyncio.sleep(self._backoff(attempts, failure.wait_s))
                continue
            score = template.parse(text)
            return JudgeResult(score, text, None if score is not None else "unparseable", attempts)

    async def _request(self, http: httpx.AsyncClient, payload: dict) -> str:
        try:
            response = await http.post(f"{self.url}/chat/completions", json=payload)
        except httpx.TimeoutException:
            raise _Failure("timeout", retryable=True) from None
        except httpx.TransportError:  # refused, reset, closed without a reply
            raise _Failure("connection", retryable=True) from None
        if response.status_code == 429 or response.status_code >= 500:
            raise _Failure(f"http_{response.status_code}", retryable=True, wait_s=_retry_after(response))
        if response.status_code >= 400:
            raise _Failure(f"http_{response.status_code}", retryable=False)
        try:
            return str(response.json()["choices"][0]["message"]["content"] or "")
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Failure("bad_response", retryable=True) from None

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, MAX_RETRY_AFTER_S)
        base = self.backoff_s * 2 ** (attempt - 1)
        return base * (0.5 + random.random() / 2)  # jitter: half to all of the exponential step

    def _remember(self, key: str, result: JudgeResult) -> None:
        self._cache[key] = result
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers["Retry-After"]))
    except (KeyError, ValueError):
        return None


_ENV_CLIENT: JudgeClient | None = None


def judge_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """Reward function: the `correctness` template's grade of the response by the environment's judge
    (RL360_JUDGE_URL / RL360_JUDGE_MODEL / RL360_JUDGE_API_KEY); a failed judgement scores 0 with its kind."""
    global _ENV_CLIENT
    if _ENV_CLIENT is None:
        _ENV_CLIENT = JudgeClient()
    question = (extra_info or {}).get("question", "")
    response = solution_str.rsplit("</think>", 1)[-1].strip()
    result = _ENV_CLIENT.score_batch([JudgeItem("correctness", question=question, reference=ground_truth,
                                                response=response)])[0]
    out = {"score": result.score if result.score is not None else 0.0, "judge_text": result.text[:200]}
    if result.error:
        out["judge_error"] = result.error
    return out
