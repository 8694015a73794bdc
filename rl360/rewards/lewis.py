"""The Lewis signalling game's rewards: the speaker's (scored by the listener service) and the listener's own.

- `lewis__speaker*` (`speaker_reward`): the response's description (`speaker_description`) is sent to the
  listener service (`rl360 serve listener`) with the row's `extra_info.candidate_paths`; the reward is the sum of
  the Lewis game's three terms: accuracy (1 when the listener's `predicted_index` is the ground truth, the
  target's index), format (1 when `<thinking>`, `<coarse>` and `<detailed>` are each present and closed once,
  `rl360.rewards.format.tags_format`) and length (0.1 when the detailed description, else the whole description,
  is exactly one sentence). An empty description scores accuracy 0 without a call. The extras `acc` (logged as
  `reward/accuracy_sampled`), `format` and `length` are the three terms. A listener that cannot answer (down,
  timing out, replying garbage) raises `ListenerFailed`: the reward pool scores the response 0 and counts it in
  `reward/errors/lewis`, and the run goes on.
- `lewis__listener*` (`listener_reward`): the listener's choice for one candidate: 1 when it answers "Yes" for
  the target or anything but "Yes" for a distractor (what the service reads: the probability of "Yes").

The client (`ListenerClient`) is the judge's (`rl360.rewards.judge.JudgeClient`): at most `max_concurrency`
requests in flight, each with `timeout_s`, retried up to `max_retries` times with exponential backoff, a
deadline of `deadline_s` per request, identical requests sent once; games go out in chunks of `chunk_size` per
`POST /batch_score`. Reward workers build it from the environment:

    RL360_LISTENER_URL           http://host:9000 (a trailing /batch_score or /score is dropped)
    RL360_LISTENER_API_KEY_ENV   the variable holding the service's key (default RL360_LISTENER_API_KEY)
    RL360_LISTENER_TIMEOUT_S, RL360_LISTENER_MAX_RETRIES, RL360_LISTENER_BACKOFF_S, RL360_LISTENER_DEADLINE_S,
    RL360_LISTENER_CHUNK_SIZE, RL360_LISTENER_CHUNK_DELAY_S, RL360_LISTENER_MAX_CONCURRENCY

and, where an RL360_LISTENER_* variable is unset, from the Lewis game's own speaker variables (`PEER_ENV`):
LISTENER_URL, LISTENER_TIMEOUT, LISTENER_CHUNK_SIZE, LISTENER_CHUNK_DELAY (seconds between chunks, which are
then sent one after another as the game's client sends them), LISTENER_MAX_RETRIES, LISTENER_BACKOFF_FACTOR.

The speaker's format term follows the game's rule by default: 1 only for `<thinking>`, `<coarse>` and
`<detailed>` blocks in that order with nothing but whitespace around them; a row's `extra_info.format_rule:
"lenient"` gives 1 to each tag present and closed once in any order, text around them allowed.

Counts: `listener/requests`, `listener/retries`, `listener/cache_hits`, `listener/failures[/<kind>]`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rl360.data.lewis import QUESTION_TEMPLATE, YES, listener_question
from rl360.rewards.format import LEWIS_SPEAKER_TAGS, one_sentence, tag_content, tags_format
from rl360.rewards.judge import JudgeClient, JudgeResult, _Query
from rl360.rewards.math import strip_thinking
from rl360.rewards.registry import register_reward

KEY_ENV = "RL360_LISTENER_API_KEY"
ENV = {"url": "RL360_LISTENER_URL", "api_key_env": "RL360_LISTENER_API_KEY_ENV",
       "timeout_s": "RL360_LISTENER_TIMEOUT_S", "max_retries": "RL360_LISTENER_MAX_RETRIES",
       "backoff_s": "RL360_LISTENER_BACKOFF_S", "deadline_s": "RL360_LISTENER_DEADLINE_S",
       "chunk_size": "RL360_LISTENER_CHUNK_SIZE", "chunk_delay_s": "RL360_LISTENER_CHUNK_DELAY_S",
       "max_concurrency": "RL360_LISTENER_MAX_CONCURRENCY"}
# the Lewis game's speaker-side names for the same settings (train_speaker_dist.py), read where ours are unset
PEER_ENV = {"url": "LISTENER_URL", "timeout_s": "LISTENER_TIMEOUT", "chunk_size": "LISTENER_CHUNK_SIZE",
            "chunk_delay_s": "LISTENER_CHUNK_DELAY", "max_retries": "LISTENER_MAX_RETRIES",
            "backoff_s": "LISTENER_BACKOFF_FACTOR"}
_ENV_TYPES = {"timeout_s": float, "max_retries": int, "backoff_s": float, "deadline_s": float, "chunk_size": int,
              "chunk_delay_s": float, "max_concurrency": int}
FORMAT_RULES = ("strict", "lenient")
LENGTH_WEIGHT = 0.1


@dataclass(frozen=True)
class ListenerAnswer:
    yes_probabilities: list[float] | None  # None when the listener could not answer
    predicted_index: int | None
    error: str | None = None  # the failure kind (as the judge's: timeout, connection, http_503, ...)


class ListenerFailed(RuntimeError):
    def __init__(self, kind: str):
        super().__init__(f"listener service failed: {kind}")
        self.kind = kind


class ListenerClient(JudgeClient):
    """Games -> the listener's answers, through `POST {url}/batch_score` (the judge client's retries, concurrency
    limit, deadline and cache)."""

    path = "/batch_score"
    prefix = "listener"
    env, env_types = ENV, _ENV_TYPES

    def __init__(self, url: str | None = None, api_key: str | None = None, *, api_key_env: str = "",
                 chunk_size: int = 4, max_concurrency: int = 4, timeout_s: float = 60.0, max_retries: int = 3,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0, deadline_s: float = 300.0,
                 cache_size: int = 10_000, chunk_delay_s: float = 0.0):
        url = (url or os.environ.get(ENV["url"], "")).strip().rstrip("/")
        for route in ("/batch_score", "/score"):
            url = url.removesuffix(route)
        if not url:
            raise ValueError(f"the listener needs its service's URL: set {ENV['url']} (e.g. http://host:9000, where "
                             "`rl360 serve listener` runs)")
        if chunk_size < 1 or chunk_delay_s < 0:
            raise ValueError(f"listener chunk_size={chunk_size} must be >= 1 and chunk_delay_s={chunk_delay_s} >= 0")
        if api_key is None:
            name = api_key_env or KEY_ENV
            api_key = os.environ.get(name, "")
        super().__init__(url, "listener", api_key, max_concurrency=max_concurrency, timeout_s=timeout_s,
                         max_retries=max_retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
                         deadline_s=deadline_s, cache_size=cache_size)
        self.chunk_size, self.chunk_delay_s = chunk_size, chunk_delay_s

    @classmethod
    def from_env(cls, **overrides: Any) -> ListenerClient:
        """From the RL360_LISTENER_* variables, each unset one from the game's own name for it (`PEER_ENV`)."""
        peer = {name: os.environ[var] for name, var in PEER_ENV.items()
                if os.environ.get(var, "") and not os.environ.get(ENV[name], "")}
        for name, value in peer.items():
            try:
                peer[name] = _ENV_TYPES.get(name, str)(value)
            except ValueError:
                raise ValueError(f"{PEER_ENV[name]}={value!r} is not a valid {_ENV_TYPES[name].__name__}") from None
        return super().from_env(**{**peer, **overrides})

    def __repr__(self) -> str:
        return (f"ListenerClient(url={self.url!r}, api_key={self._api_key!r}, chunk_size={self.chunk_size}, "
                f"max_concurrency={self.max_concurrency}, timeout_s={self.timeout_s}, "
                f"max_retries={self.max_retries}, deadline_s={self.deadline_s})")

    __str__ = __repr__

    def answer(self, games: Sequence[tuple[Sequence[str], str]]) -> list[ListenerAnswer]:
        """One answer per `(candidate_paths, question)` game, in order; a failed chunk fails each of its games."""
        games = [(list(paths), question) for paths, question in games]
        chunks = [games[start:start + self.chunk_size] for start in range(0, len(games), self.chunk_size)]
        if self.chunk_delay_s > 0:  # one chunk after another, as the game's client sends them
            results = []
            for index, chunk in enumerate(chunks):
                if index:
                    time.sleep(self.chunk_delay_s)
                results += self.score_batch([chunk])
        else:
            results = self.score_batch(chunks)
        answers: list[ListenerAnswer] = []
        for chunk, result in zip(chunks, results):
            answers += _chunk_answers(chunk, result)
        return answers

    def _query(self, index: int, item: Any) -> _Query:
        payload = {"batch": [{"candidate_paths": paths, "question": question, "topk": 1} for paths, question in item]}
        key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
        return _Query(index, None, payload, key)

    def _reply_text(self, body: Any) -> Any:
        results = body["results"]
        if not isinstance(results, list):
            raise TypeError("results is not a list")
        return json.dumps(results)

    def _parsed(self, template: Any, text: str, attempts: int) -> JudgeResult:
        return JudgeResult(0.0, text, None, attempts)


def _chunk_answers(chunk: list, result: JudgeResult) -> list[ListenerAnswer]:
    if result.error is not None:
        return [ListenerAnswer(None, None, result.error)] * len(chunk)
    try:
        results = json.loads(result.text)
        answers = []
        for (paths, _), item in zip(chunk, results, strict=True):
            probabilities = [float(p) for p in item["yes_probabilities"]]
            index = item["predicted_index"]
            if len(probabilities) != len(paths) or not isinstance(index, int) or not 0 <= index < len(paths):
                raise ValueError("a result that does not fit its game")
            answers.append(ListenerAnswer(probabilities, index))
        return answers
    except (ValueError, KeyError, TypeError):
        return [ListenerAnswer(None, None, "bad_response")] * len(chunk)


_CLIENTS: dict[tuple, ListenerClient] = {}


def env_client() -> ListenerClient:
    """This process's client for the current RL360_LISTENER_* settings (made once per distinct setting)."""
    key = tuple(os.environ.get(var, "") for var in [*ENV.values(), *PEER_ENV.values()])
    client = _CLIENTS.get(key)
    if client is None:
        client = _CLIENTS[key] = ListenerClient.from_env()
    return client


def speaker_description(response: str) -> str:
    """What the listener is told: the `<coarse>` and `<detailed>` texts (either, or both joined by a space); a
    response with neither: its text after any `</thinking>`, the game's tags removed, stripped."""
    parts = [part for part in (tag_content(response, "coarse"), tag_content(response, "detailed")) if part]
    if parts:
        return " ".join(parts)
    text = response.rsplit("</thinking>", 1)[-1]
    for tag in LEWIS_SPEAKER_TAGS:
        text = text.replace(f"<{tag}>", " ").replace(f"</{tag}>", " ")
    return " ".join(text.split())


@register_reward("lewis__speaker", truth="the target's index among extra_info.candidate_paths, e.g. \"2\"",
                 answer="<coarse> + <detailed> (else the text after </thinking>), sent to the listener service "
                        "(RL360_LISTENER_URL); 1 if it picks the target, +1 format (<thinking><coarse><detailed> "
                        "in order, nothing around), +0.1 one sentence")
def speaker_reward(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """The Lewis game's speaker: the listener service's accuracy on the description + format + length (see the
    module docstring); a listener that cannot answer raises `ListenerFailed` (scored 0, counted as an error)."""
    info = extra_info or {}
    paths = info.get("candidate_paths")
    if paths is None or len(paths) == 0:
        raise ValueError("lewis__speaker rows need extra_info.candidate_paths (the listener's candidate images)")
    description = speaker_description(solution_str)
    accuracy = 0.0
    if description:
        question = listener_question(description, info.get("question_template") or QUESTION_TEMPLATE)
        [answer] = env_client().answer([(list(paths), question)])
        if answer.error is not None:
            raise ListenerFailed(answer.error)
        accuracy = float(answer.predicted_index == int(ground_truth))
    rule = info.get("format_rule") or "strict"
    if rule not in FORMAT_RULES:
        raise ValueError(f"extra_info.format_rule={rule!r}: choose one of {FORMAT_RULES}")
    form = tags_format(solution_str, LEWIS_SPEAKER_TAGS, strict=rule == "strict")
    length = LENGTH_WEIGHT * one_sentence(tag_content(solution_str, "detailed") or description)
    return {"score": accuracy + form + length, "acc": accuracy, "format": form, "length": length}


@register_reward("lewis__listener", truth="\"Yes\" for the target candidate, \"No\" for a distractor",
                 answer="the first word after any </think>: \"Yes\" is a pick; 1 for Yes on the target or anything "
                        "else on a distractor")
def listener_reward(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """The Lewis game's listener, one candidate: 1 for "Yes" on the target or anything else on a distractor."""
    said_yes = strip_thinking(solution_str).strip().startswith(YES)
    return float(said_yes == (str(ground_truth).strip() == YES))
