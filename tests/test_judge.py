"""The LLM-judge client against a real local HTTP server that is slow, fails, drops connections."""

import asyncio
import base64
import json
import logging
import pickle
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rl360.config import ConfigError, load_config
from rl360.rewards.judge import (
    JudgeClient,
    JudgeFailed,
    JudgeItem,
    answer_for_judge,
    judge_env,
    judge_score,
    register_template,
)
from rl360.rewards.judge_templates import parse_correct_word, parse_final_decision

KEY = "sk-sentinel-0123456789"


class JudgeServer(ThreadingHTTPServer):
    """POST /v1/chat/completions whose behaviour is chosen by a TAG=... in the prompt; it records what it sees."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.release = threading.Event()  # set at teardown: ends hanging and dripping handlers
        self.seen: dict[str, int] = {}  # tag -> requests
        self.times: dict[str, list[float]] = {}  # tag -> arrival times
        self.bodies: list[dict] = []
        self.paths: set[str] = set()
        self.auth: set[str] = set()
        self.in_flight = self.max_in_flight = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    server: JudgeServer

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]
        tag = prompt.split("TAG=", 1)[1].split()[0] if "TAG=" in prompt else ""
        server = self.server
        with server.lock:
            count = server.seen[tag] = server.seen.get(tag, 0) + 1
            server.times.setdefault(tag, []).append(time.monotonic())
            server.bodies.append(body)
            server.paths.add(self.path)
            server.auth.add(self.headers.get("Authorization", ""))
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
        self._in_flight = True
        try:
            self._answer(tag, count, prompt)
        finally:
            self._leave()

    def _leave(self):
        """No longer in flight: before the reply goes out (the client may send its next request as soon as it has
        the reply, before this thread would get back to a `finally`), or when the handler ends without one."""
        if self._in_flight:
            self._in_flight = False
            with self.server.lock:
                self.server.in_flight -= 1

    def _answer(self, tag: str, count: int, prompt: str):
        if tag.startswith("slow"):
            time.sleep(1.0 if tag.startswith("slower") else 0.2)
        if tag == "hang":
            self.server.release.wait(10)
            return
        if tag == "drip":  # headers at once, then one byte every 0.1 s: no single read waits long
            self.send_response(200)
            self.send_header("Content-Length", "40")
            self.end_headers()
            for _ in range(40):
                if self.server.release.wait(0.1):
                    return
                self.wfile.write(b" ")
                self.wfile.flush()
            return
        if tag == "drop" or (tag == "drop_once" and count == 1):
            self.connection.shutdown(socket.SHUT_RDWR)  # close without any reply
            return
        if tag == "error" or (tag == "error_once" and count == 1):
            return self._send(500, {"error": "boom"})
        if tag == "limited_once" and count == 1:
            return self._send(429, {"error": "slow down"}, {"Retry-After": "0.05"})
        if tag == "retry_after" and count == 1:
            return self._send(503, {"error": "busy"}, {"Retry-After": "0.4"})
        if tag == "bad_request":
            return self._send(400, {"error": "bad"})
        if tag == "bad_json":
            return self._send_raw(200, b"{not json")
        if tag == "no_choices":
            return self._send(200, {"choices": []})
        wrong = "WRONG" in prompt
        if "exactly one word" in prompt:
            text = "Incorrect" if wrong else "Correct"
        elif prompt.rstrip().endswith("Judgement:"):  # the few-shot "Judgement: 1 / 0" form
            text = "Judgement: " + ("0" if wrong else "1")
        else:
            text = "The values agree.\nFinal Decision: " + ("No" if wrong else "Yes")
        if tag == "babble":
            text = "Hmm, hard to say."
        if tag == "think":
            text = "<think>Incorrect at first sight? No: 2 is 2.</think>\n**Correct**"
        self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})

    def _send(self, status, body, headers=None):
        self._send_raw(status, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _send_raw(self, status, data, headers=None):
        self._leave()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    srv = JudgeServer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()


def _client(server, **kw):
    options = dict(api_key=KEY, timeout_s=0.5, max_retries=2, backoff_s=0.01, deadline_s=5.0, max_concurrency=4)
    options.update(kw)
    return JudgeClient(url=server.base_url, model="judge-model", **options)


def _item(tag, wrong=False, template="correctness"):
    return JudgeItem(template, question=f"TAG={tag} 1+1?", reference="2", response="3 WRONG" if wrong else "2")


@pytest.mark.timeout(30)
def test_scores_in_order_with_both_templates_in_the_openai_schema(server):
    client = _client(server)
    results = client.score_batch([_item("a"), _item("b", wrong=True), _item("c", template="verifier"),
                                  _item("d", wrong=True, template="verifier"), _item("think")])
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert all(r.ok and r.attempts == 1 and not r.cached for r in results)
    assert results[2].text.endswith("Final Decision: Yes")
    assert server.paths == {"/v1/chat/completions"} and server.auth == {f"Bearer {KEY}"}
    body = server.bodies[0]
    assert set(body) == {"model", "messages", "temperature", "max_tokens"}
    assert body["model"] == "judge-model" and body["messages"][0]["role"] == "user"
    assert client.counts == {"judge/requests": 5, "judge/retries": 0, "judge/failures": 0, "judge/cache_hits": 0}


@pytest.mark.timeout(30)
def test_transient_failures_are_retried_until_success(server):
    client = _client(server)
    results = client.score_batch([_item("error_once"), _item("limited_once"), _item("drop_once")])
    assert [(r.score, r.error, r.attempts) for r in results] == [(1.0, None, 2)] * 3
    assert client.counts["judge/retries"] == 3 and client.counts["judge/failures"] == 0


@pytest.mark.timeout(30)
def test_retry_after_is_honoured(server):
    client = _client(server, backoff_s=0.001)
    assert client.score_batch([_item("retry_after")])[0].score == 1.0
    first, second = server.times["retry_after"]
    assert second - first >= 0.35  # the server asked for 0.4 s; the backoff alone would be ~1 ms


@pytest.mark.timeout(30)
def test_permanent_failures_are_counted_by_kind(server):
    client = _client(server)
    results = client.score_batch([_item("error"), _item("drop"), _item("bad_request"), _item("bad_json"),
                                  _item("no_choices"), _item("babble"), _item("ok")])
    assert [(r.score, r.error) for r in results] == [
        (None, "http_500"), (None, "connection"), (None, "http_400"), (None, "bad_response"),
        (None, "bad_response"), (None, "unparseable"), (1.0, None)]
    assert [r.attempts for r in results] == [3, 3, 1, 3, 3, 1, 1]  # 1 + max_retries; other 4xx not retried
    assert server.seen["error"] == 3 and server.seen["bad_request"] == 1
    counts = client.metrics(reset=True)
    assert counts["judge/failures"] == 6 and counts["judge/retries"] == 8 and counts["judge/requests"] == 15
    assert counts["judge/failures/bad_response"] == 2 and counts["judge/failures/http_400"] == 1
    assert client.counts["judge/failures"] == 0


@pytest.mark.timeout(30)
def test_slow_and_dripping_servers_time_out_and_are_retried(server):
    client = _client(server, timeout_s=0.3, max_retries=1)
    results = client.score_batch([_item("hang"), _item("drip"), _item("slow")])
    assert [(r.error, r.attempts) for r in results[:2]] == [("timeout", 2), ("timeout", 2)]
    assert results[2].score == 1.0  # 0.2 s is within the per-request limit
    assert server.seen["hang"] == 2 and server.seen["drip"] == 2


@pytest.mark.timeout(30)
def test_the_item_deadline_ends_a_request_with_a_long_timeout(server):
    client = _client(server, timeout_s=60.0, max_retries=5, deadline_s=0.5)
    result = client.score_batch([_item("hang")])[0]
    assert (result.score, result.error, result.attempts) == (None, "deadline", 1)
    assert client.counts["judge/failures/deadline"] == 1


@pytest.mark.timeout(30)
def test_the_deadline_runs_from_the_first_request_not_from_the_queue(server):
    client = _client(server, max_concurrency=1, deadline_s=1.2)
    results = client.score_batch([_item(f"slow{k}") for k in range(12)])  # 12 x 0.2 s one at a time
    assert [r.score for r in results] == [1.0] * 12
    assert server.max_in_flight == 1


@pytest.mark.timeout(30)
def test_identical_queries_are_sent_once(server):
    client = _client(server)
    results = client.score_batch([_item("dup")] * 5 + [_item("slow")])
    assert all(r.score == 1.0 for r in results)
    assert server.seen["dup"] == 1 and sum(r.cached for r in results[:5]) == 4
    again = client.score_batch([_item("dup")])[0]
    assert again.cached and again.attempts == 0 and server.seen["dup"] == 1
    assert client.counts["judge/cache_hits"] == 5 and client.counts["judge/requests"] == 2
    other = JudgeClient(url=server.base_url, model="judge-model", api_key=KEY, temperature=0.7)
    other.score_batch([_item("dup")])  # other sampling parameters: another query
    assert server.seen["dup"] == 2


@pytest.mark.timeout(30)
def test_failures_are_shared_by_duplicates_but_not_cached(server):
    client = _client(server, max_retries=0)
    results = client.score_batch([_item("error_once")] * 3)
    assert [r.error for r in results] == ["http_500"] * 3 and server.seen["error_once"] == 1
    assert client.counts["judge/failures"] == 3 and client.counts["judge/cache_hits"] == 2
    assert client.score_batch([_item("error_once")])[0].score == 1.0  # asked again, not served the failure
    assert server.seen["error_once"] == 2


@pytest.mark.timeout(30)
def test_concurrency_is_bounded_also_across_concurrent_batches(server):
    client = _client(server, max_concurrency=3)
    assert all(r.score == 1.0 for r in client.score_batch([_item(f"slow{k}") for k in range(9)]))
    assert server.max_in_flight == 3

    server.max_in_flight = 0

    async def many_small_batches():
        batches = await asyncio.gather(*(client.ascore_batch([_item(f"slow_async{k}")]) for k in range(8)))
        return [batch[0] for batch in batches]

    assert all(r.score == 1.0 for r in asyncio.run(many_small_batches()))
    assert 1 <= server.max_in_flight <= 3


@pytest.mark.timeout(30)
def test_a_duplicate_asks_itself_when_the_first_asker_is_cancelled(server):
    client = _client(server, timeout_s=5.0)

    async def scenario():
        first = asyncio.create_task(client.ascore_batch([_item("slower_shared")]))
        while not server.seen.get("slower_shared"):  # the first request reached the server (1 s to answer)
            await asyncio.sleep(0.01)
        second = asyncio.create_task(client.ascore_batch([_item("slower_shared")]))
        await asyncio.sleep(0.05)  # the second now waits on the first's reply
        first.cancel()
        return await second, first.cancelled()

    (result,), cancelled = asyncio.run(scenario())
    assert cancelled and result.score == 1.0 and server.seen["slower_shared"] == 2


@pytest.mark.timeout(30)
def test_sync_api_works_inside_a_running_event_loop(server):
    client = _client(server)

    async def caller():
        return client.score_batch([_item("in_loop")])

    assert asyncio.run(caller())[0].score == 1.0


@pytest.mark.timeout(30)
def test_bad_items_are_refused_before_any_request(server):
    client = _client(server)
    with pytest.raises(KeyError, match=r"item 1: unknown judge template 'nope'.*'correctness'"):
        client.score_batch([_item("x"), JudgeItem("nope", question="q")])
    with pytest.raises(ValueError, match=r"item 0: template 'verifier' needs fields \['reference', 'response'\]"):
        client.score_batch([JudgeItem("verifier", question="TAG=y q")])
    assert server.seen == {}


@pytest.mark.timeout(30)
def test_the_key_never_shows(server, caplog):
    client = _client(server, max_retries=1)
    with caplog.at_level(logging.DEBUG):
        results = client.score_batch([_item("error"), _item("drop"), _item("hang"), _item("bad_request"),
                                      _item("ok")])
        late = _client(server, timeout_s=10.0, deadline_s=0.3).score_batch([_item("hang")])
    assert "4 of 5 items failed" in caplog.text
    shown = [caplog.text, repr(client), str(client), repr(vars(client)), repr(results), repr(late),
             json.dumps(client.metrics())]
    for make in (lambda: JudgeClient(url="", model="m", api_key=KEY),
                 lambda: JudgeClient(url="ftp://host", model="m", api_key=KEY),
                 lambda: JudgeClient(url=f"http://user:{KEY}@127.0.0.1:1/v1", model="m", timeout_s=0),
                 lambda: client.score_batch([JudgeItem("nope")])):
        with pytest.raises(Exception) as raised:
            make()
        shown += [str(raised.value), repr(raised.value)]
    with_userinfo = JudgeClient(url=f"http://user:{KEY}@127.0.0.1:1/v1", model="m")
    shown += [repr(with_userinfo), with_userinfo.url]
    assert not [text for text in shown if KEY in text]
    assert "api_key=<hidden>" in repr(client)
    assert pickle.loads(pickle.dumps(client)).score_batch([_item("pickled")])[0].score == 1.0


@pytest.mark.timeout(30)
def test_credentials_in_the_url_are_sent_as_basic_auth_and_logged_nowhere(server, caplog, monkeypatch):
    for name in ("RL360_JUDGE_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("", "httpx", "httpcore"):  # everything, httpx's own "HTTP Request: POST <url>" line included
        caplog.set_level(logging.DEBUG, logger=name)
    host = server.base_url.removeprefix("http://")
    client = JudgeClient(url=f"http://us%40er:{KEY}@{host}", model="judge-model", timeout_s=5.0, max_retries=1,
                         backoff_s=0.01)
    results = client.score_batch([_item("userinfo"), _item("error")])
    assert [r.score for r in results] == [1.0, None]
    token = base64.b64encode(f"us@er:{KEY}".encode()).decode()
    assert server.auth == {f"Basic {token}"}  # percent-decoded, as HTTP basic auth: the server still gets it
    assert f"HTTP Request: POST {server.base_url}/chat/completions" in caplog.text
    assert "1 of 2 items failed" in caplog.text
    shown = [caplog.text, repr(client), client.url, repr(results)]
    assert not [text for text in shown if KEY in text or token in text]
    assert client.url == server.base_url


@pytest.mark.timeout(30)
def test_key_and_endpoint_from_config_and_environment(server, monkeypatch):
    monkeypatch.delenv("RL360_JUDGE_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-fallback")
    cfg = load_config(None, ["model.path=m", "data.train_files=[d.parquet]", f"reward.judge.url={server.base_url}",
                             "reward.judge.model=judge-model", "reward.judge.api_key_env=MY_JUDGE_KEY",
                             "reward.judge.template=verifier", "reward.judge.timeout_s=0.5"])
    monkeypatch.setenv("MY_JUDGE_KEY", KEY)
    client = JudgeClient.from_config(cfg.reward.judge)
    assert (client.template, client.timeout_s, client.max_retries) == ("verifier", 0.5, 3)
    assert client.score_batch([_item("cfg")])[0].score == 1.0 and server.auth == {f"Bearer {KEY}"}
    monkeypatch.delenv("MY_JUDGE_KEY")
    JudgeClient.from_config(cfg.reward.judge).score_batch([_item("fallback")])
    assert server.auth == {f"Bearer {KEY}", "Bearer sk-openai-fallback"}
    env = judge_env(cfg.reward.judge)
    assert env["RL360_JUDGE_URL"] == server.base_url and KEY not in json.dumps(env)
    for key in env:
        monkeypatch.setenv(key, env[key])
    assert JudgeClient.from_env().template == "verifier"
    with pytest.raises(ConfigError, match=r"reward\.judge\.max_concurrency=0 must be > 0"):
        load_config(None, ["model.path=m", "data.train_files=[d.parquet]", "reward.judge.max_concurrency=0"])


@pytest.mark.timeout(30)
def test_custom_template_and_reward_function(server, monkeypatch):
    register_template("yesno", "TAG={tag} Is {response} right? Say Final Decision: Yes or No",
                      lambda text: 1.0 if text.strip().endswith("Yes") else 0.0)
    assert _client(server).score_batch([JudgeItem("yesno", tag="y", response="2")])[0].score == 1.0
    with pytest.raises(ValueError, match="plain names"):
        register_template("positional", "{0} and {1}", parse_correct_word)
    monkeypatch.setenv("RL360_JUDGE_URL", server.base_url)
    monkeypatch.setenv("RL360_JUDGE_MODEL", "judge-model")
    monkeypatch.setenv("RL360_JUDGE_API_KEY", KEY)
    monkeypatch.setenv("RL360_JUDGE_TIMEOUT_S", "0.5")
    monkeypatch.setenv("RL360_JUDGE_BACKOFF_S", "0.01")
    assert judge_score("<think>hmm</think> so \\boxed{2}", "2", {"question": "TAG=r 1+1?"})["score"] == 1.0
    assert server.bodies[-1]["messages"][0]["content"].count("Model answer: 2\n") == 1
    assert judge_score("3 WRONG", "2", {"question": "TAG=r2 1+1?"})["score"] == 0.0
    assert judge_score("2", "2", {"question": "TAG=r3", "judge_template": "verifier"})["score"] == 1.0
    assert judge_score("2", "2", {"judge_template": "yesno", "tag": "r4"})["score"] == 1.0
    with pytest.raises(JudgeFailed, match="http_400"):  # the reward pool scores it 0 and counts the error
        judge_score("2", "2", {"question": "TAG=bad_request 1+1?"})


def test_parsers_and_answer_extraction():
    assert parse_correct_word("**Correct**") == 1.0 and parse_correct_word("Incorrect.") == 0.0
    assert parse_correct_word("<think>maybe Correct</think>Incorrect") == 0.0
    assert parse_correct_word("I think so") is None and parse_correct_word("") is None
    assert parse_final_decision("Final Decision: No ... on reflection\n**Final Decision:** Yes") == 1.0
    assert parse_final_decision("final decision: no") == 0.0 and parse_final_decision("Yes") is None
    assert answer_for_judge("<think>\\boxed{1}</think> it is \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert answer_for_judge("<answer> a cat </answer>") == "a cat"
    assert answer_for_judge("<think>x</think> plain ") == "plain"


@pytest.mark.timeout(60)
def test_judge_reward_in_the_pool_takes_its_settings_from_the_config_and_counts_failures(server, monkeypatch):
    """What the trainer does: `reward.judge` -> judge_env -> RewardPool(env=...); workers (forked from a
    forkserver made before these settings existed) reach the judge; a failed judgement is a counted error."""
    from rl360.config import JudgeConfig
    from rl360.rewards import RewardItem, RewardPool, register_reward_path

    register_reward_path("judged", "rl360.rewards.judge:judge_score")
    with RewardPool(num_workers=1, timeout_s=20):  # make sure a forkserver runs before the settings exist
        pass
    monkeypatch.setenv("RL360_JUDGE_API_KEY", KEY)  # the key stays in the environment, not in the config
    env = judge_env(JudgeConfig(url=server.base_url, model="judge-model", timeout_s=0.5, backoff_s=0.01))
    with RewardPool(num_workers=2, timeout_s=20, env=env) as pool:
        results = pool.score([RewardItem("judged", response, "2", {"question": f"TAG={tag} 1+1?"})
                              for tag, response in (("p1", "\\boxed{2}"), ("p2", "3 WRONG"), ("bad_request", "2"))])
        assert [r.score for r in results] == [1.0, 0.0, 0.0]
        assert results[0].error is None and results[1].error is None and "http_400" in results[2].error
        assert KEY not in results[2].error
        assert pool.last_metrics()["reward/errors/judged"] == 1
