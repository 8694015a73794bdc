"""The LLM-judge client against a real local HTTP server that is slow, fails, drops connections."""

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rl360.rewards.judge import JudgeClient, JudgeItem, judge_score, register_template

KEY = "sk-sentinel-0123456789"


class JudgeServer(ThreadingHTTPServer):
    """/v1/chat/completions whose behaviour is chosen by a tag in the prompt; it counts what it sees."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.seen: dict[str, int] = {}  # tag -> requests
        self.in_flight = self.max_in_flight = 0
        self.auth: set[str] = set()


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
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
            server.auth.add(self.headers.get("Authorization", ""))
        try:
            self._answer(tag, count, body)
        finally:
            with server.lock:
                server.in_flight -= 1

    def _answer(self, tag: str, count: int, body: dict):
        if tag.startswith("slow"):
            time.sleep(0.15)
        if tag == "hang":
            time.sleep(3)
        if tag == "drop" or (tag == "drop_once" and count == 1):
            self.connection.shutdown(socket.SHUT_RDWR)  # close without any reply
            return
        if tag == "error" or (tag == "error_once" and count == 1):
            return self._send(500, {"error": "boom"})
        if tag == "limited_once" and count == 1:
            return self._send(429, {"error": "slow down"}, {"Retry-After": "0.05"})
        if tag == "bad_request":
            return self._send(400, {"error": "bad"})
        if tag == "bad_json":
            data = b"{not json"
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        prompt = body["messages"][0]["content"]
        text = ("Incorrect" if "WRONG" in prompt else "Correct") if "one word" in prompt else \
            ("The values agree.\nFinal Decision: " + ("No" if "WRONG" in prompt else "Yes"))
        if tag == "babble":
            text = "Hmm, hard to say."
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": text}}]})

    def _send(self, status, body, headers=None):
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    srv = JudgeServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _client(server, **kw):
    options = dict(api_key=KEY, timeout_s=0.5, max_retries=2, backoff_s=0.01, deadline_s=5.0, max_concurrency=4)
    options.update(kw)
    return JudgeClient(url=f"http://127.0.0.1:{server.server_address[1]}/v1", model="judge-model", **options)


def _item(tag, wrong=False, template="correctness"):
    return JudgeItem(template, question=f"TAG={tag} 1+1?", reference="2", response="3 WRONG" if wrong else "2")


@pytest.mark.timeout(60)
def test_scores_in_order_with_both_templates(server):
    client = _client(server)
    results = client.score_batch([_item("a"), _item("b", wrong=True), _item("c", template="verifier"),
                                  _item("d", wrong=True, template="verifier")])
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0]
    assert all(r.error is None and r.attempts == 1 for r in results)
    assert server.auth == {f"Bearer {KEY}"}


@pytest.mark.timeout(60)
def test_transient_failures_are_retried_and_permanent_ones_counted(server):
    client = _client(server)
    results = client.score_batch([_item("error_once"), _item("limited_once"), _item("drop_once"), _item("error"),
                                  _item("drop"), _item("bad_request"), _item("bad_json"), _item("babble")])
    assert [r.score for r in results[:3]] == [1.0, 1.0, 1.0]
    assert [r.attempts for r in results[:3]] == [2, 2, 2]
    assert [(r.score, r.error) for r in results[3:]] == [
        (None, "http_500"), (None, "connection"), (None, "http_400"), (None, "bad_response"), (None, "unparseable")]
    assert server.seen["error"] == 3 and server.seen["bad_request"] == 1  # 1 + max_retries; 4xx not retried
    assert client.counts["judge/failures"] == 5 and client.counts["judge/retries"] >= 3 + 2 + 2 + 2


@pytest.mark.timeout(60)
def test_slow_and_hanging_server_end_in_counted_timeouts_not_hangs(server):
    client = _client(server, timeout_s=0.3, max_retries=1, deadline_s=2.0)
    results = client.score_batch([_item("hang"), _item("slow")])
    assert results[0].score is None and results[0].error == "timeout" and results[0].attempts == 2
    assert results[1].score == 1.0  # 0.15 s is within the per-request timeout
    deadline = _client(server, timeout_s=10.0, max_retries=5, deadline_s=0.5)
    started = time.monotonic()
    result = deadline.score_batch([_item("hang")])[0]
    assert result.error == "timeout" and time.monotonic() - started < 2.5  # the item deadline, not 6 x 10 s


@pytest.mark.timeout(60)
def test_identical_queries_are_sent_once_and_concurrency_is_bounded(server):
    client = _client(server, max_concurrency=3)
    items = [_item("dup")] * 5 + [_item(f"slow{k}") for k in range(9)]
    results = client.score_batch(items)
    assert all(r.score == 1.0 for r in results)
    assert server.seen["dup"] == 1 and sum(r.cached for r in results[:5]) == 4
    assert server.max_in_flight <= 3
    again = client.score_batch([_item("dup")])[0]
    assert again.cached and server.seen["dup"] == 1 and client.counts["judge/cache_hits"] == 5


@pytest.mark.timeout(60)
def test_the_key_never_shows(server, caplog):
    client = _client(server, max_retries=0)
    with caplog.at_level(logging.DEBUG):
        results = client.score_batch([_item("error"), _item("drop"), _item("ok")])
    text = caplog.text + repr(client) + str(client) + repr(results) + json.dumps(client.counts)
    assert KEY not in text
    assert "api_key=set" in repr(client)
    with pytest.raises(ValueError) as missing:
        JudgeClient(url="", model="", api_key=KEY)
    assert KEY not in str(missing.value)


@pytest.mark.timeout(60)
def test_custom_template_and_reward_function(server, monkeypatch):
    register_template("yesno", "TAG={tag} Is {response} right? Final Decision: Yes or No",
                      lambda text: 1.0 if text.strip().endswith("Yes") else 0.0)
    assert _client(server).score_batch([JudgeItem("yesno", tag="y", response="2")])[0].score == 1.0
    monkeypatch.setenv("RL360_JUDGE_URL", f"http://127.0.0.1:{server.server_address[1]}/v1")
    monkeypatch.setenv("RL360_JUDGE_MODEL", "judge-model")
    monkeypatch.setenv("RL360_JUDGE_API_KEY", KEY)
    monkeypatch.setattr("rl360.rewards.judge._ENV_CLIENT", None)
    assert judge_score("<think>hmm</think> 2", "2", {"question": "TAG=r 1+1?"})["score"] == 1.0
    assert judge_score("3 WRONG", "2", {"question": "TAG=r2 1+1?"})["score"] == 0.0
    failed = judge_score("2", "2", {"question": "TAG=bad_request 1+1?"})
    assert failed["score"] == 0.0 and failed["judge_error"] == "http_400"
