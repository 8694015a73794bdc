"""`rl360 eval` against two real `rl360 serve model` processes on the quickstart's tiny model: 200 prompts x n=8
scored as `rl360 reward check` scores the same responses, resumed after a SIGKILL without sending a request twice,
through a server killed mid-run, re-judged by an LLM judge endpoint; pass@k against a direct estimator; engine
servers started on a model directory (`--model`); config errors."""

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl360.config import ConfigError
from rl360.eval.config import PRESETS, load_eval_config, sampling_values
from rl360.eval.inputs import EvalPrompt
from rl360.eval.metrics import pass_at_k
from rl360.eval.targets import OpenAIEndpoint, fleet_settings
from rl360.quickstart.assets import build_quickstart_model
from rl360.rewards.judge import answer_for_judge
from rl360.serve.loadgen import start_service, stop_service

ROOT = Path(__file__).resolve().parents[1]
# the bar's size; RL360_EVAL_TEST_PROMPTS=24 runs the same checks on fewer prompts (a machine shared by many jobs)
N, PROMPTS = 8, int(os.environ.get("RL360_EVAL_TEST_PROMPTS", "200"))
SOURCES = ("math__synthetic_arithmetic", "math__arithmetic_b")
ROUTE = "/v1/chat/completions"


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _serve(model_dir):
    return start_service([sys.executable, "-m", "rl360.cli", "serve", "model", "--model", str(model_dir),
                          "--port", "0"], env=_env(), timeout_s=300)


def _metric(url: str, name: str, route: str | None = None) -> float:
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.split("{")[0].split(" ")[0] == name and (route is None or f'route="{route}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _requests(urls) -> float:
    return sum(_metric(url, "rl360_http_requests_total", ROUTE) for url in urls)


def _settle(urls) -> None:
    """Wait until no request is in flight at the servers (one a killed client left is finished or dropped)."""
    while any(_metric(url, "rl360_http_requests_in_flight") for url in urls):
        time.sleep(0.2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model = build_quickstart_model(root / "model")
    rows = [{"data_source": source, "prompt": [{"role": "user", "content": f"{a}+{b}"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"index": a * 10 + b}}
            for a in range(10) for b in range(10) for source in SOURCES][:PROMPTS]
    pq.write_table(pa.Table.from_pylist(rows), root / "data.parquet", row_group_size=64)
    servers = [_serve(model), _serve(model)]
    yield root, model, [url for _, url in servers]
    for proc, _ in servers:
        stop_service(proc)


def _argv(root, urls, out, *extra):
    return [sys.executable, "-m", "rl360.cli", "eval", str(ROOT / "configs/eval/quickstart.yaml"),
            f"data.files=[{root / 'data.parquet'}]", f"eval.endpoints=[{','.join(urls)}]", f"output_dir={out}",
            "reward.num_workers=1", *extra]


def _eval(root, urls, out, *extra):
    done = subprocess.run(_argv(root, urls, out, *extra), capture_output=True, text=True, env=_env(), timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads((Path(out) / "report.json").read_text())


def _results(out) -> dict:
    records = [json.loads(line) for line in (Path(out) / "results.jsonl").read_text().splitlines()]
    keyed = {(r["prompt"], r["sample"]): r for r in records}
    assert len(keyed) == len(records)  # no pair twice
    return keyed


@pytest.fixture(scope="module")
def unbroken(setup):
    root, _, urls = setup
    before = _requests(urls)
    done, report = _eval(root, urls, root / "unbroken")
    return done, report, _requests(urls) - before


def test_accuracy_equals_reward_check_of_the_saved_responses(setup, unbroken, tmp_path):
    root, _, urls = setup
    done, report, sent = unbroken
    results = _results(root / "unbroken")
    assert len(results) == PROMPTS * N and sent == PROMPTS * N  # one request per sample, none retried
    assert re.search(rf"eval: {PROMPTS * N}/{PROMPTS * N} samples \(100%\), [\d.]+ req/s, \d+ tok/s", done.stderr)
    assert "math__arithmetic_b" in done.stdout and "pass@8" in done.stdout  # the table
    # one parquet row per (prompt, sample), each with its saved response, scored by `rl360 reward check`
    rows = pq.read_table(root / "data.parquet").to_pylist()
    pq.write_table(pa.Table.from_pylist([row for row in rows for _ in range(N)]), tmp_path / "expanded.parquet")
    with open(tmp_path / "responses.jsonl", "w") as handle:
        for i in range(PROMPTS):
            for j in range(N):
                handle.write(json.dumps({"response": results[i, j]["response"]}) + "\n")
    subprocess.run([sys.executable, "-m", "rl360.cli", "reward", "check", str(tmp_path / "expanded.parquet"),
                    "--responses", str(tmp_path / "responses.jsonl"), "--out", str(tmp_path / "scores.jsonl"),
                    "--workers", "1"], check=True, capture_output=True, env=_env(), timeout=600)
    scores = [json.loads(line)["score"] for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    for source in SOURCES:
        mine = [scores[k] for k in range(len(scores)) if rows[k // N]["data_source"] == source]
        got = report["rule"]["by_data_source"][source]
        assert got["accuracy"] == pytest.approx(sum(mine) / len(mine), abs=1e-12)
        # pass@k from the same scores with the estimator written out with math.comb
        correct = [sum(s >= 1 for s in mine[p * N:(p + 1) * N]) for p in range(len(mine) // N)]
        for k in (1, 2, 4, 8):
            direct = sum(1 - math.comb(N - c, k) / math.comb(N, k) for c in correct) / len(correct)
            assert got[f"pass@{k}"] == pytest.approx(direct, abs=1e-12)
    assert 0 < report["rule"]["all"]["accuracy"] < 1  # the random model gets some right: a test that can fail
    assert report["rule"]["all"]["truncated_rate"] == pytest.approx(
        sum(r["finish_reason"] == "length" for r in results.values()) / len(results))
    errors = [json.loads(line) for line in (root / "unbroken" / "errors.jsonl").read_text().splitlines()]
    assert len(errors) == sum(s < 1 for s in scores)


def test_sigkilled_half_way_and_rerun_sends_each_request_once_and_reports_the_same(setup, unbroken):
    root, _, urls = setup
    out = root / "resumed"
    before = _requests(urls)
    proc = subprocess.Popen(_argv(root, urls, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=_env(), start_new_session=True)
    results = out / "results.jsonl"
    while not results.exists() or results.read_bytes().count(b"\n") < PROMPTS * N // 2:
        assert proc.poll() is None, "the eval ended before it was killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _settle(urls)
    first = _requests(urls) - before
    kept = results.read_bytes().count(b"\n")  # whole lines: a cut last one is dropped by the rerun
    assert PROMPTS * N // 2 <= kept < PROMPTS * N and first >= kept
    before = _requests(urls)
    _, report = _eval(root, urls, out)
    assert _requests(urls) - before == PROMPTS * N - kept  # only the missing pairs were sent
    assert report == unbroken[1]
    assert _results(out) .keys() == _results(root / "unbroken").keys()


def test_a_server_killed_mid_run_costs_retries_not_results(setup, unbroken, tmp_path):
    root, model, _ = setup
    servers = [_serve(model), _serve(model)]
    urls = [url for _, url in servers]
    out = tmp_path / "out"
    few = min(PROMPTS, 40)
    proc = subprocess.Popen(_argv(root, urls, out, f"data.max_prompts={few}", "eval.backoff_s=0.2"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        results = out / "results.jsonl"
        while not results.exists() or results.read_bytes().count(b"\n") < few * N // 3:
            assert proc.poll() is None
            time.sleep(0.05)
        servers[0][0].kill()
        output = proc.communicate(timeout=1800)[0]
    finally:
        for server, _ in servers:
            stop_service(server)
    assert proc.returncode == 0, output[-3000:]
    retries = int(re.search(r"requests \((\d+) retries\)", output).group(1))
    assert retries >= 1
    mine, whole = _results(out), _results(root / "unbroken")
    assert len(mine) == few * N
    assert {key: r["response"] for key, r in mine.items()} == {key: whole[key]["response"] for key in mine}


class _Judge(BaseHTTPRequestHandler):
    """An OpenAI chat endpoint that grades like a lenient judge: "Correct" when the model's answer is the
    reference plus one."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = body["messages"][-1]["content"]
        reference = re.search(r"Reference answer: (.*)\nModel answer: ", text, re.S).group(1).strip()
        answer = re.search(r"Model answer: (.*)\n\nReply with exactly", text, re.S).group(1).strip()
        verdict = "Correct" if answer == str(int(reference) + 1) else "Incorrect"
        reply = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": verdict},
                                         "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def test_rule_failures_rejudged_are_added_back(setup, unbroken, tmp_path):
    root, _, _ = setup
    out = tmp_path / "judged"
    out.mkdir()
    for name in ("results.jsonl", "eval_run.json"):  # all samples there: nothing is sent, only scored
        (out / name).write_bytes((root / "unbroken" / name).read_bytes())
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _, report = _eval(root, ["http://127.0.0.1:9/v1"], out, "rejudge=true",
                          f"judge.url=http://127.0.0.1:{server.server_port}/v1", "judge.model=judge")
    finally:
        server.shutdown()
    assert report["rule"] == unbroken[1]["rule"]
    rows = pq.read_table(root / "data.parquet").to_pylist()
    results = _results(out)
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    plus_one = {(e["prompt"], e["sample"]) for e in errors
                if answer_for_judge(results[e["prompt"], e["sample"]]["response"])
                == str(int(rows[e["prompt"]]["reward_model"]["ground_truth"]) + 1)}
    assert report["judge"]["all"] == {"judged": len(errors), "rescued": len(plus_one), "failures": 0}
    assert {(e["prompt"], e["sample"]) for e in errors if e["correct_after_judge"]} == plus_one
    total = PROMPTS * N
    assert report["combined"]["all"]["accuracy"] == pytest.approx(
        report["rule"]["all"]["accuracy"] + len(plus_one) / total, abs=1e-12)


def test_the_qwen_ins_preset_is_served(setup, tmp_path):
    """DeepVision's qwen_ins profile (presence_penalty 1.5, top_k 20, top_p 0.8) against `rl360 serve model`:
    every sample answered, none refused."""
    root, _, urls = setup
    _, report = _eval(root, urls, tmp_path / "qwen_ins", "sampling.preset=qwen_ins", "sampling.n=2",
                      "data.max_prompts=8", "sampling.max_tokens=4")
    assert report["unanswered"] == 0 and report["rule"]["all"]["samples"] == 16
    assert report["rule"]["all"]["errors"] == 0
    records = _results(tmp_path / "qwen_ins").values()
    assert len(records) == 16 and not any(r["error"] for r in records)


def _engines_argv(root, model, out, *extra):
    return [sys.executable, "-m", "rl360.cli", "eval", f"data.files=[{root / 'data.parquet'}]", "--model", str(model),
            "eval.num_engines=2", "eval.engine_dtype=float32", "sampling.n=2", "sampling.max_tokens=8",
            "data.max_prompts=24", f"output_dir={out}", "reward.num_workers=0", *extra]


@pytest.fixture(scope="module")
def engines_run(setup):
    root, model, _ = setup
    out = root / "engines"
    done = subprocess.run(_engines_argv(root, model, out), capture_output=True, text=True, env=_env(), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, out


def test_model_dir_starts_engine_servers_and_stops_them(setup, engines_run):
    _, model, _ = setup
    done, out = engines_run
    assert "2 server engine(s) serving" in done.stdout
    assert len(_results(out)) == 48
    logs = sorted((out / "engines").glob("engine-*.log"))
    assert len(logs) == 2
    ps = subprocess.run(["pgrep", "-f", f"rl360.engine.server --model {model}"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", "engine servers left running"


def test_an_engine_killed_mid_run_is_restarted_and_the_results_are_an_unbroken_runs(setup, engines_run, tmp_path):
    root, model, _ = setup
    out = tmp_path / "killed"
    proc = subprocess.Popen(_engines_argv(root, model, out, "eval.concurrency=2"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env())
    results, listing = out / "results.jsonl", out / "engines" / "engines.json"
    while not results.exists() or results.read_bytes().count(b"\n") < 4:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    os.kill(json.loads(listing.read_text())[0]["pid"], signal.SIGKILL)
    output = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, output[-3000:]
    assert re.search(r"eval engine 0 failed .*; restarting it", output)
    assert json.loads(listing.read_text())[0]["restarts"] == 1
    mine, whole = _results(out), _results(engines_run[1])
    assert len(mine) == 48
    assert {key: (r["response"], r["tokens"]) for key, r in mine.items()} == {
        key: (r["response"], r["tokens"]) for key, r in whole.items()}


def test_the_fleet_on_a_model_dir_takes_the_eval_keys_and_its_gpus_in_runs(monkeypatch):
    base = ["data.files=[x.parquet]", "eval.model=m", "eval.num_engines=2", "eval.engine_tensor_parallel=2",
            "eval.request_timeout_s=30", "eval.startup_timeout_s=40", "eval.max_engine_restarts=3",
            "eval.engine_args=[--x]"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    rollout, model, placement = fleet_settings(load_eval_config(None, base).eval)
    assert (rollout.engine, rollout.num_engines, rollout.engine_tensor_parallel, rollout.request_timeout_s,
            rollout.startup_timeout_s, rollout.max_engine_restarts, rollout.engine_args) == (
        "server", 2, 2, 30, 40, 3, ["--x"])
    assert (model.path, model.dtype) == ("m", "bfloat16")
    assert [placement.engine_devices(i, ["4", "5", "6", "7"]) for i in range(2)] == [["4", "5"], ["6", "7"]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    with pytest.raises(ConfigError, match=r"eval\.num_engines x eval\.engine_tensor_parallel = 4 GPUs, more than "
                                          r"the 3 visible"):
        fleet_settings(load_eval_config(None, base).eval)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not fleet_settings(load_eval_config(None, base).eval)[2].use_gpu  # no GPU: engines on the CPU
    with pytest.raises(ConfigError, match=r"eval\.max_engine_restarts=-1 must be >= 0"):
        load_eval_config(None, [*base, "eval.max_engine_restarts=-1"])


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 17):
        for c in range(n + 1):
            for k in range(1, n + 1):
                direct = 1.0 if n - c < k else 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(direct, abs=1e-12)


def test_presets_and_config_errors(tmp_path):
    base = ["data.files=[x.parquet]", "eval.endpoints=[http://h/v1]"]
    assert sampling_values(load_eval_config(None, [*base, "sampling.preset=qwen_ins"]).sampling) == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.0, "presence_penalty": 1.5,
        "max_tokens": 16384}
    assert sampling_values(load_eval_config(None, [*base, "sampling.preset=greedy", "sampling.top_p=0.5"]).sampling
                           ) == {"temperature": 0.01, "top_p": 0.5, "top_k": -1, "repetition_penalty": 1.0,
                                 "presence_penalty": 0.0, "max_tokens": 16384}
    assert sampling_values(load_eval_config(None, [*base, "sampling.stop=[</answer>]"]).sampling) == {
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "presence_penalty": 0.0,
        "max_tokens": 16384, "stop": ["</answer>"]}
    with pytest.raises(ConfigError, match=r"sampling.stop=\[''\] has an empty string"):
        load_eval_config(None, [*base, "sampling.stop=['']"])
    values = sampling_values(load_eval_config(None, [*base, "sampling.stop=[</answer>]"]).sampling)
    endpoint = OpenAIEndpoint(0, "http://h/v1", "", "tiny", values, 10.0, 1)
    assert endpoint.body(EvalPrompt(0, [{"role": "user", "content": "1+1"}], "math", "2"), 7)["stop"] == ["</answer>"]
    assert "stop" not in OpenAIEndpoint(0, "http://h/v1", "", "tiny", {**values, "stop": []}, 10.0, 1).body(
        EvalPrompt(0, [{"role": "user", "content": "1+1"}], "math", "2"), 7)
    assert set(PRESETS) == {"qwen_ins", "qwen_think", "mimo", "greedy"}
    for path in sorted((ROOT / "configs" / "eval").glob("*.yaml")):  # the examples load (given their files)
        load_eval_config(path, ["data.files=[x.parquet]", "eval.model=''", "eval.endpoints=[http://h/v1]"])
    with pytest.raises(ConfigError, match="close matches: sampling.temperature"):
        load_eval_config(None, [*base, "sampling.temprature=1"])
    with pytest.raises(ConfigError, match="sampling.preset='hot'"):
        load_eval_config(None, [*base, "sampling.preset=hot"])
    with pytest.raises(ConfigError, match="either eval.endpoints .* or eval.model"):
        load_eval_config(None, ["data.files=[x.parquet]"])
    done = subprocess.run([sys.executable, "-m", "rl360.cli", "eval", *base, "data.files=[x.csv]"],
                          capture_output=True, text=True, env=_env())
    assert done.returncode == 2 and done.stderr.strip() == \
        "rl360: config error: data.files: 'x.csv' is neither .parquet nor .jsonl"


def test_an_unreachable_endpoint_or_a_refused_key_ends_in_one_line_and_exit_2(setup, tmp_path):
    root, model, _ = setup
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    keyed, url = start_service([sys.executable, "-m", "rl360.cli", "serve", "model", "--model", str(model), "--port",
                                "0", "--api-key-env", "RL360_TEST_EVAL_KEY"],
                               env={**_env(), "RL360_TEST_EVAL_KEY": "the-right-key-0123456789"}, timeout_s=300)
    try:
        cases = {"unreachable": ([nobody], {}, f"no endpoint answered: {nobody}/models"),
                 "wrong key": ([url], {"RL360_TEST_EVAL_KEY": "a-wrong-key-0123456789"},
                               "the endpoint refused the key in $RL360_TEST_EVAL_KEY"),
                 "no key": ([url], {}, "the endpoint refused no key (set eval.api_key_env")}
        for name, (urls, env, says) in cases.items():
            extra = ["eval.api_key_env=RL360_TEST_EVAL_KEY"] if env else []
            done = subprocess.run(_argv(root, urls, tmp_path / name.replace(" ", "_"), *extra), capture_output=True,
                                  text=True, env={**_env(), **env}, timeout=300)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and "Traceback" not in done.stderr, (name, done.stderr[-2000:])
            assert len(lines) == 1 and lines[0].startswith("rl360: endpoint error: ") and says in lines[0], (name,
                                                                                                          lines)
    finally:
        stop_service(keyed)


def test_maj_at_n_counts_only_stated_answers():
    from rl360.eval.metrics import SampleOutcome, summarize
    from rl360.rewards.judge import stated_answer

    texts = ["I am not sure.", "I am not sure.", "The sum is \\boxed{5}."]  # two unstated, one stated and right
    group = [SampleOutcome(1.0 if "boxed" in text else 0.0, stated_answer(text), 4, False, False, False)
             for text in texts]
    assert [outcome.answer for outcome in group] == [None, None, "5"]
    assert summarize([group], [1])["maj@3"] == 1.0  # the unstated ones do not outvote the stated answer
    assert stated_answer("<answer>7</answer>") == "7" and stated_answer("<think>\\boxed{1}</think>no") is None


def test_the_judge_writes_up_to_its_max_tokens():
    from rl360.config import JudgeConfig
    from rl360.rewards.judge import JudgeClient, judge_env

    config = JudgeConfig(url="http://judge.invalid/v1", model="m", max_tokens=48)
    assert JudgeClient.from_config(config).max_tokens == 48
    assert judge_env(config)["RL360_JUDGE_MAX_TOKENS"] == "48"  # and so to the reward workers
    with pytest.raises(ValueError, match="max_tokens=0 must be >= 1"):
        JudgeClient.from_config(JudgeConfig(url="http://judge.invalid/v1", model="m", max_tokens=0))


def test_a_results_line_cut_short_is_dropped_from_the_file_on_resume(tmp_path):
    """A SIGKILL mid-write leaves a partial last line: resuming reads the whole lines and cuts the file back to
    them, so the pair is sent again and its new line starts on a line of its own."""
    from rl360.eval.runner import read_results

    path = tmp_path / "results.jsonl"
    whole = [json.dumps({"prompt": i, "sample": 0, "response": "r"}) + "\n" for i in range(2)]
    path.write_text("".join(whole) + '{"prompt": 2, "sample": 0, "resp')
    done = read_results(path, prompts=3, n=1)
    assert sorted(done) == [(0, 0), (1, 0)]
    assert path.read_text() == "".join(whole)  # the cut line is gone from the file, not only skipped
