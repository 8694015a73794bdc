"""LLM-as-judge rewards through any OpenAI-compatible chat endpoint (vLLM, SGLang, OpenAI, ...).

    judge = JudgeClient(url="http://judge:8000/v1", model="Qwen2.5-72B-Instruct")  # or RL360_JUDGE_* env
    results = judge.score_batch([JudgeItem("correctness", question=q, reference=r, response=a), ...])
    results = await judge.ascore_batch(items)                                      # the same, async

- Each item is one `POST {url}/chat/completions` with {"model", "messages", "temperature", "max_tokens"};
  the reply is `choices[0].message.content`, turned into a score by the item's template
  (`rl360.rewards.judge_templates`: `correctness`, `verifier`, or one from `register_template`).
- Endpoint, model and key come from the arguments, a `reward.judge` config (`JudgeClient.from_config`) or
  the environment: RL360_JUDGE_URL, RL360_JUDGE_MODEL, and the key from the variable named by
  `api_key_env`, else RL360_JUDGE_API_KEY, else OPENAI_API_KEY. The key is sent as a bearer token and
  appears in no log line, repr, exception or metric. Credentials in the URL (`http://user:password@host/v1`)
  are taken out of it when the client is made and sent as HTTP basic auth instead of the bearer token, so
  the URL that httpx sees (and logs) holds none.
- At most `max_concurrency` requests are in flight per event loop (shared by concurrent batches). A
  request has `timeout_s` in all; one that times out, loses its connection, gets HTTP 429 or 5xx, or a
  body that is not a chat completion is retried up to `max_retries` times after an exponential backoff
  with jitter (at least the server's Retry-After, capped at `max_backoff_s`); other 4xx fail at once.
  Each item has a total deadline of `deadline_s` from its first request, so nothing hangs.
- Every item ends with a score or a failure whose kind is counted: `timeout`, `deadline`, `connection`,
  `http_<status>`, `bad_response`, `unparseable` (the judge gave no verdict), `client_error`.
- Identical queries (model, messages, sampling parameters) are sent once: duplicates in flight wait for
  the first, later ones hit an LRU cache of successful judgements.
- `counts` / `metrics()`: `judge/requests` (HTTP attempts), `judge/retries`, `judge/cache_hits`,
  `judge/failures` (items) and `judge/failures/<kind>`.

As a reward function: `reward.custom={vqa: "rl360.rewards.judge:judge_score"}`.

Other HTTP scorers reuse this machinery by subclassing: `path` (the route posted to), `prefix` (of the counts'
names), `_query` (an item -> its payload), `_reply_text` (a reply's body -> text) and `_parsed` (text -> result);
`rl360.rewards.lewis.ListenerClient` does so for the Lewis game's listener service.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import email.utils
import hashlib
import json
import logging
import math
import os
import random
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx

from rl360.rewards.extract import last_answer_tag
from rl360.rewards.judge_templates import TEMPLATES, Template, get_template, register_template
from rl360.rewards.math import last_boxed, strip_thinking

__all__ = ["JudgeClient", "JudgeFailed", "JudgeItem", "JudgeResult", "TEMPLATES", "Template", "judge_env",
           "judge_answer", "judge_key_env", "judge_score", "register_template"]

logger = logging.getLogger(__name__)

KEY_ENVS = ("RL360_JUDGE_API_KEY", "OPENAI_API_KEY")  # where the key is looked for, after `api_key_env`
# Settings a worker process reads from the environment (`JudgeClient.from_env`, `judge_env`).
ENV = {"url": "RL360_JUDGE_URL", "model": "RL360_JUDGE_MODEL", "api_key_env": "RL360_JUDGE_API_KEY_ENV",
       "template": "RL360_JUDGE_TEMPLATE", "max_concurrency": "RL360_JUDGE_MAX_CONCURRENCY",
       "timeout_s": "RL360_JUDGE_TIMEOUT_S", "max_retries": "RL360_JUDGE_MAX_RETRIES",
       "backoff_s": "RL360_JUDGE_BACKOFF_S", "deadline_s": "RL360_JUDGE_DEADLINE_S",
       "max_tokens": "RL360_JUDGE_MAX_TOKENS"}
_ENV_TYPES = {"max_concurrency": int, "max_retries": int, "timeout_s": float, "backoff_s": float,
              "deadline_s": float, "max_tokens": int}


class JudgeItem:
    """One judgement: a template name and the fields its prompt needs (`question`, `reference`, `response`
    for the built-in ones)."""

    __slots__ = ("template", "fields")

    def __init__(self, template: str, /, **fields: Any):
        self.template = template
        self.fields = fields

    def __repr__(self) -> str:
        return f"JudgeItem({self.template!r}, fields={sorted(self.fields)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JudgeItem) and (self.template, self.fields) == (other.template, other.fields)


@dataclass(frozen=True)
class JudgeResult:
    score: float | None  # None when the item failed
    text: str = ""  # the judge's reply
    error: str | None = None  # failure kind (see the module docstring); None on success
    attempts: int = 0  # HTTP requests made for it (0 when served by the cache or a duplicate)
    cached: bool = False  # answered by the cache or by an identical query in flight

    @property
    def ok(self) -> bool:
        return self.error is None


class _Secret:
    """Holds the API key; prints as a placeholder."""

    __slots__ = ("value",)

    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return "<hidden>" if self.value else "<unset>"

    __str__ = __repr__


class _Failure(Exception):
    def __init__(self, kind: str, retryable: bool, retry_after: float | None = None):
        super().__init__(kind)
        self.kind, self.retryable, self.retry_after = kind, retryable, retry_after


@dataclass
class _LoopState:
    semaphore: asyncio.Semaphore
    in_flight: dict  # query key -> future of its JudgeResult


@dataclass(frozen=True)
class _Query:
    index: int
    template: Template
    payload: dict
    key: str


class JudgeClient:
    path = "/chat/completions"  # what each request posts to, after the URL
    prefix = "judge"  # of the counts' names
    env, env_types = ENV, _ENV_TYPES  # the variables `from_env` reads (option -> name) and their types

    def __init__(self, url: str | None = None, model: str | None = None, api_key: str | None = None, *,
                 api_key_env: str = "", template: str = "correctness", max_concurrency: int = 8,
                 timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 deadline_s: float = 300.0, temperature: float = 0.0, max_tokens: int = 512,
                 extra_body: dict | None = None, cache_size: int = 10_000):
        """`url` is the base URL, e.g. http://host:8000/v1 ("/chat/completions" is added); `extra_body` is
        merged into every request (e.g. {"chat_template_kwargs": {"enable_thinking": False}})."""
        url = (url or os.environ.get(ENV["url"], "")).strip().rstrip("/")
        self.model = model or os.environ.get(ENV["model"], "")
        if not url or not self.model:
            raise ValueError(f"the judge needs an endpoint URL and a model: pass url= and model= (config "
                             f"reward.judge.url / reward.judge.model) or set {ENV['url']} and {ENV['model']}")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"judge url must be http(s)://host[:port]/path, got {_display_url(url)!r}")
        self._url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))  # what httpx is given
        self.url = _display_url(url)  # without any user:password@ part, for logs and reprs
        userinfo = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
        self._basic_auth = _Secret(userinfo if parts.username or parts.password else "")
        if api_key is None:
            names = ((api_key_env,) if api_key_env else ()) + KEY_ENVS
            api_key = next((os.environ[name] for name in names if os.environ.get(name)), "")
        self._api_key = _Secret(api_key)
        checks = {"max_concurrency": (max_concurrency, 1), "timeout_s": (timeout_s, 1e-9),
                  "max_tokens": (max_tokens, 1), "deadline_s": (deadline_s, 1e-9), "max_retries": (max_retries, 0),
                  "backoff_s": (backoff_s, 0), "max_backoff_s": (max_backoff_s, 0), "cache_size": (cache_size, 0)}
        for name, (value, low) in checks.items():
            if not value >= low:
                raise ValueError(f"judge {name}={value!r} must be >= {low:g}")
        get_template(template)
        self.template = template  # the default template of `judge_score`
        self.max_concurrency, self.timeout_s, self.max_retries = max_concurrency, timeout_s, max_retries
        self.backoff_s, self.max_backoff_s, self.deadline_s = backoff_s, max_backoff_s, deadline_s
        self.temperature, self.max_tokens, self.extra_body = temperature, max_tokens, dict(extra_body or {})
        self.cache_size = cache_size
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, JudgeResult] = OrderedDict()
        self._states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = weakref.WeakKeyDictionary()
        self._counts: dict[str, int] = self._zero_counts()

    @classmethod
    def from_config(cls, cfg: Any, **overrides: Any) -> JudgeClient:
        """From a `reward.judge` config (rl360.config.JudgeConfig or anything with its attributes); empty
        url / model fall back to the environment."""
        options = {name: getattr(cfg, name) for name in ENV if hasattr(cfg, name)}
        options["url"] = options.get("url") or None
        options["model"] = options.get("model") or None
        return cls(**{**options, **overrides})

    @classmethod
    def from_env(cls, **overrides: Any) -> JudgeClient:
        """From the RL360_JUDGE_* variables (`judge_env` writes them from a config)."""
        options: dict[str, Any] = {}
        for name, var in cls.env.items():
            value = os.environ.get(var, "")
            if value:
                try:
                    options[name] = cls.env_types.get(name, str)(value)
                except ValueError:
                    raise ValueError(f"{var}={value!r} is not a valid {cls.env_types[name].__name__}") from None
        return cls(**{**options, **overrides})

    def __repr__(self) -> str:
        return (f"JudgeClient(url={self.url!r}, model={self.model!r}, api_key={self._api_key!r}, "
                f"template={self.template!r}, max_concurrency={self.max_concurrency}, timeout_s={self.timeout_s}, "
                f"max_retries={self.max_retries}, deadline_s={self.deadline_s})")

    __str__ = __repr__

    def __getstate__(self) -> dict:  # picklable (e.g. to a Ray actor): locks, loops and the cache stay behind
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_cache", "_states", "_counts")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # ---- public API ------------------------------------------------------------------------------

    def score_batch(self, items: Iterable[JudgeItem]) -> list[JudgeResult]:
        """Judge `items`, blocking; results in input order. Works with or without a running event loop in
        the calling thread (with one, the batch runs on a helper thread)."""
        items = list(items)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.ascore_batch(items))
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rl360-judge") as pool:
            return pool.submit(asyncio.run, self.ascore_batch(items)).result()

    async def ascore_batch(self, items: Iterable[JudgeItem]) -> list[JudgeResult]:
        """Judge `items` concurrently; results in input order. An unknown template or a missing prompt field
        raises (naming the item) before any request is sent."""
        queries = [self._query(index, item) for index, item in enumerate(items)]
        if not queries:
            return []
        state = self._loop_state()
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits, headers=self._headers()) as http:
            results = list(await asyncio.gather(*(self._judge(http, state, query) for query in queries)))
        failed: dict[str, int] = {}
        for result in results:
            if result.error is not None:
                failed[result.error] = failed.get(result.error, 0) + 1
        if failed:
            logger.warning("%s %s (%s): %d of %d items failed: %s", self.prefix, self.url, self.model,
                           sum(failed.values()), len(results), failed)
        return results

    async def ascore(self, item: JudgeItem) -> JudgeResult:
        return (await self.ascore_batch([item]))[0]

    @property
    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def metrics(self, reset: bool = False) -> dict[str, int]:
        """The counts (requests, retries, cache hits, failures and failures per kind); `reset` zeroes them."""
        with self._lock:
            out = dict(self._counts)
            if reset:
                self._counts = self._zero_counts()
        return out

    # ---- one item --------------------------------------------------------------------------------

    def _query(self, index: int, item: JudgeItem) -> _Query:
        if not isinstance(item, JudgeItem):
            raise TypeError(f"judge item {index}: expected a JudgeItem, got {type(item).__name__}")
        try:
            template = get_template(item.template)
        except KeyError as err:
            raise KeyError(f"judge item {index}: {err.args[0]}") from None
        missing = sorted(template.fields - item.fields.keys())
        if missing:
            raise ValueError(f"judge item {index}: template {template.name!r} needs fields {missing}; "
                             f"given {sorted(item.fields)}")
        payload = {**self.extra_body, "model": self.model, "temperature": self.temperature,
                   "max_tokens": self.max_tokens,
                   "messages": [{"role": "user", "content": template.render(item.fields)}]}
        key = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
        return _Query(index, template, payload, key)

    async def _judge(self, http: httpx.AsyncClient, state: _LoopState, query: _Query) -> JudgeResult:
        while True:
            cached = self._cache_get(query.key)
            if cached is not None:
                self._count("cache_hits")
                return replace(cached, attempts=0, cached=True)
            pending = state.in_flight.get(query.key)
            if pending is None:
                break
            try:  # an identical query is on its way: share its answer
                result = await asyncio.shield(pending)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if pending.cancelled() and task is not None and not task.cancelling():
                    continue  # its owner was cancelled, not us: ask again
                raise
            self._count("cache_hits")
            if result.error is not None:
                self._count_failure(result.error)
            return replace(result, attempts=0, cached=True)

        future = asyncio.get_running_loop().create_future()
        state.in_flight[query.key] = future
        try:
            result = await self._attempts(http, state, query)
            if result.error is None:
                self._cache_put(query.key, result)
            else:
                self._count_failure(result.error)
            future.set_result(result)
            return result
        finally:
            if not future.done():
                future.cancel()
            state.in_flight.pop(query.key, None)

    async def _attempts(self, http: httpx.AsyncClient, state: _LoopState, query: _Query) -> JudgeResult:
        loop = asyncio.get_running_loop()
        attempts = 0
        try:
            async with asyncio.timeout(None) as deadline:
                while True:
                    async with state.semaphore:
                        if attempts == 0:  # the deadline runs from the first request, not from the queue
                            deadline.reschedule(loop.time() + self.deadline_s)
                        attempts += 1
                        self._count("requests")
                        try:
                            text, failure = await self._post(http, query.payload), None
                        except _Failure as err:
                            text, failure = "", err
                    if failure is None:
                        return self._parsed(query.template, text, attempts)
                    if not failure.retryable or attempts > self.max_retries:
                        return JudgeResult(None, error=failure.kind, attempts=attempts)
                    self._count("retries")
                    delay = self._backoff(attempts, failure.retry_after)
                    logger.debug("judge item %d: %s on attempt %d, retrying in %.2f s", query.index, failure.kind,
                                 attempts, delay)
                    await asyncio.sleep(delay)
        except TimeoutError:
            return JudgeResult(None, error="deadline", attempts=attempts)

    async def _post(self, http: httpx.AsyncClient, payload: dict) -> str:
        try:
            async with asyncio.timeout(self.timeout_s):  # the whole request, however slowly bytes trickle in
                response = await http.post(f"{self._url}{self.path}", json=payload)
        except (TimeoutError, httpx.TimeoutException):
            raise _Failure("timeout", retryable=True) from None
        except httpx.TransportError:  # refused, reset, closed without a reply
            raise _Failure("connection", retryable=True) from None
        except httpx.RequestError:  # e.g. a body that cannot be decoded
            raise _Failure("bad_response", retryable=True) from None
        except Exception as err:  # anything else the client raises: one kind, no message (it could hold anything)
            logger.debug("judge request raised %s", type(err).__name__)
            raise _Failure("client_error", retryable=False) from None
        status = response.status_code
        if status == 429 or status >= 500:
            raise _Failure(f"http_{status}", retryable=True, retry_after=_retry_after(response))
        if not 200 <= status < 300:
            raise _Failure(f"http_{status}", retryable=False)
        try:
            content = self._reply_text(response.json())
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Failure("bad_response", retryable=True) from None
        if content is not None and not isinstance(content, str):
            raise _Failure("bad_response", retryable=True)
        return content or ""

    def _reply_text(self, body: Any) -> Any:
        """The text of a reply's JSON body (a chat completion's message content)."""
        return body["choices"][0]["message"]["content"]

    def _parsed(self, template: Template, text: str, attempts: int) -> JudgeResult:
        try:
            score = template.parse(text)
            score = None if score is None else float(score)
        except Exception as err:  # a user parser's bug: the item is unparseable, the batch goes on
            logger.warning("judge template %r: parser raised %s", template.name, type(err).__name__)
            score = None
        if score is None or not math.isfinite(score):
            return JudgeResult(None, text, "unparseable", attempts)
        return JudgeResult(score, text, None, attempts)

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        step = self.backoff_s * 2 ** (attempt - 1)
        delay = step * (0.5 + random.random() / 2)  # jitter: half to all of the exponential step
        if retry_after is not None:
            delay = max(delay, retry_after)
        return min(delay, self.max_backoff_s)

    # ---- shared state ----------------------------------------------------------------------------

    def _loop_state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        with self._lock:
            state = self._states.get(loop)
            if state is None:
                state = self._states[loop] = _LoopState(asyncio.Semaphore(self.max_concurrency), {})
            return state

    def _cache_get(self, key: str) -> JudgeResult | None:
        with self._lock:
            result = self._cache.get(key)
            if result is not None:
                self._cache.move_to_end(key)
            return result

    def _cache_put(self, key: str, result: JudgeResult) -> None:
        if not self.cache_size:
            return
        with self._lock:
            self._cache[key] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _count(self, name: str) -> None:
        with self._lock:
            name = f"{self.prefix}/{name}"
            self._counts[name] = self._counts.get(name, 0) + 1

    def _zero_counts(self) -> dict[str, int]:
        return {f"{self.prefix}/{name}": 0 for name in ("requests", "retries", "failures", "cache_hits")}

    def _count_failure(self, kind: str) -> None:
        with self._lock:
            self._counts[f"{self.prefix}/failures"] += 1
            name = f"{self.prefix}/failures/{kind}"
            self._counts[name] = self._counts.get(name, 0) + 1

    def _headers(self) -> dict[str, str]:
        if self._basic_auth.value:  # user:password from the URL, sent as httpx would have sent them
            return {"Authorization": f"Basic {base64.b64encode(self._basic_auth.value.encode()).decode()}"}
        return {"Authorization": f"Bearer {self._api_key.value}"} if self._api_key.value else {}


def _display_url(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    return urlunsplit((parts.scheme, host + (f":{port}" if port else ""), parts.path, "", ""))


def _retry_after(response: httpx.Response) -> float | None:
    """Seconds from a Retry-After header (a number, or an HTTP date), or None."""
    value = response.headers.get("Retry-After", "").strip()
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def judge_env(cfg: Any) -> dict[str, str]:
    """The RL360_JUDGE_* variables for a `reward.judge` config, for the reward workers
    (`RewardPool(env=judge_env(cfg))`); the key itself stays in the variable `cfg.api_key_env` names, which
    the pool hands on to its workers when the settings name an endpoint (`judge_key_env`)."""
    return {var: str(getattr(cfg, name)) for name, var in ENV.items() if getattr(cfg, name, "") not in ("", None)}


def judge_key_env(settings: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variable holding the judge's API key, as a client made from `settings` (RL360_JUDGE_* variables)
    looks it up in `environ` (default: this process's environment): `{name: key}` for the first set one of
    the variable named by RL360_JUDGE_API_KEY_ENV, RL360_JUDGE_API_KEY and OPENAI_API_KEY; `{}` when
    `settings` name no endpoint (RL360_JUDGE_URL) or no key is set. Reward workers, which get only the
    variables they need, receive this one (`rl360.rewards.pool.worker_environment`)."""
    environ = os.environ if environ is None else environ
    if not settings.get(ENV["url"], "").strip():
        return {}
    named = settings.get(ENV["api_key_env"], "")
    for name in ((named,) if named else ()) + KEY_ENVS:
        if environ.get(name):
            return {name: environ[name]}
    return {}


def stated_answer(solution_str: str) -> str | None:
    """The answer a response states: the last \\boxed{} after any </think>, else the last <answer>...</answer>;
    None when it states none (maj@n's vote: such a response does not vote)."""
    text = strip_thinking(solution_str)
    boxed = last_boxed(text)
    return boxed.strip() if boxed is not None else last_answer_tag(text)


def answer_for_judge(solution_str: str) -> str:
    """What the judge compares: the response's stated answer (`stated_answer`), else the whole text after
    </think>."""
    stated = stated_answer(solution_str)
    return stated if stated is not None else strip_thinking(solution_str).strip()


_ENV_CLIENTS: dict[tuple, JudgeClient] = {}


def _env_client() -> JudgeClient:
    """This process's client for the current RL360_JUDGE_* settings (made once per distinct setting)."""
    key = tuple(os.environ.get(var, "") for var in ENV.values())
    client = _ENV_CLIENTS.get(key)
    if client is None:
        client = _ENV_CLIENTS[key] = JudgeClient.from_env()
    return client


def judge_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """Reward function: the judge (configured by RL360_JUDGE_* in the environment) grades
    `answer_for_judge(solution_str)` against the ground truth with RL360_JUDGE_TEMPLATE (default
    `correctness`), or `extra_info["judge_template"]`. The question is `extra_info["question"]`; a custom
    template's other fields come from `extra_info` too. A failed judgement raises `JudgeFailed`, so the
    reward pool scores it 0 and counts it in `reward/errors/<domain>` with the failure kind in its text."""
    info = extra_info or {}
    result = judge_answer(info.get("judge_template") or _env_client().template, info.get("question", ""),
                          ground_truth, answer_for_judge(solution_str), info)
    return {"score": result.score, "judge_text": result.text[:200]}


def judge_answer(template: str, question: str, reference: str, response: str,
                 fields: Mapping[str, Any] | None = None) -> JudgeResult:
    """One judgement by this process's judge (RL360_JUDGE_* settings) with `template`; a custom template's other
    fields come from `fields`. `JudgeFailed` when it ends without a grade."""
    chosen = get_template(template)
    values = {name: fields[name] for name in chosen.fields if fields and name in fields}
    values.update(question=question, reference=reference, response=response)
    result = _env_client().score_batch([JudgeItem(chosen.name, **values)])[0]
    if result.error or result.score is None:
        raise JudgeFailed(result.error or "unparseable")
    return result


class JudgeFailed(RuntimeError):
    """A judgement that ended without a grade; `kind` is the failure kind (`timeout`, `http_400`, ...)."""

    def __init__(self, kind: str):
        super().__init__(f"LLM judge failed: {kind}")
        self.kind = kind
