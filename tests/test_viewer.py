"""`rl360 view PATH`: the JSON API and the page on a run directory (rollouts written by the dump writer), an eval
output (written by `rl360 eval` itself against a small OpenAI-compatible endpoint) and a parquet file of several
row groups; keys; row text escaped; the page in headless Chromium (DOM after its script ran, screenshots)."""

import io
import json
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from rl360.actor.batch import build_batch
from rl360.cli import main
from rl360.core import Sample
from rl360.core.trajectory import Turn
from rl360.eval.command import run_eval
from rl360.eval.config import load_eval_config
from rl360.serve.loadgen import start_service, stop_service
from rl360.tracking.rollout_dump import dump_rollouts

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "<script>document.title='injected'</script>"
KEY = "viewer-test-key-0123456789"
CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="the chromium binary is not installed (Debian: apt-get "
                                                             "install chromium); the page's browser checks skip")


def _env(**extra):
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def _png(colour) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (24, 16), colour).save(out, format="PNG")
    return out.getvalue()


# ---- the three kinds of PATH ----
WORDS = {1: "What", 2: " is", 3: " 2+2?", 5: " It", 6: " is", 7: " 4", 8: SCRIPT, 9: " call", 10: " [tool: 4]",
         11: " ok", 12: " done"}


def _decode(ids):
    return "".join(WORDS.get(i, f" t{i}") for i in ids)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    for step in (1, 2):
        samples = [Sample([1, 2, 3], [5, 6, 7], [-0.5, -0.25, -1.0], "stop", weight_version=step),
                   Sample([1, 2, 3], [8, 7], [-0.1, -0.2], "length", weight_version=step),
                   Sample([1, 2, 3], [9, 10, 10, 11, 12], [-0.2, 0.0, 0.0, -0.4, -0.1], "stop", weight_version=step,
                          loss_mask=[1, 0, 0, 1, 1], turns=[Turn(0, 1, step), Turn(1, 3, generated=False),
                                                            Turn(3, 5, step)])]
        rows = [{"data_source": "math__a"}, {"data_source": "math__b"}, {"data_source": "tools"}]
        batch = build_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                            [s.logprobs for s in samples], pad_id=0, loss_masks=[s.loss_mask for s in samples])
        batch.old_logprobs = batch.rollout_logprobs + torch.tensor(
            [[0.01, -0.3, 0.6, 0, 0], [0.2, 0.0, 0, 0, 0], [0.05, 9.0, 9.0, -0.02, 0.8]])
        dump_rollouts(root, step, samples, rows, torch.tensor([1.0, 0.0, 0.5]), batch, _decode)
    (root / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": s / 4,
                                                            "rollout/logprob_abs_diff": 0.01 * s}) + "\n"
                                                for s in (1, 2, 3)))
    return root


class _Endpoint(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint answering `a+b` right when a is even, with a `<script>` when a is 3; as the
    re-judge, "Correct" only when the reference answer is 1."""

    def do_GET(self):
        self._reply({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = body["messages"][-1]["content"]
        if "Reference answer:" in content:
            text = "Correct" if "Reference answer: 1\n" in content else "Incorrect"
        else:
            a, b = (int(x) for x in content.split("+"))
            text = f"\\boxed{{{a + b if a % 2 == 0 else a + b + 1}}}" + (SCRIPT if a == 3 else "")
        self._reply({"id": "x", "object": "chat.completion", "model": "tiny", "usage": {"completion_tokens": 3},
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": "stop"}]})

    def _reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    rows = [{"data_source": "math__even" if a % 2 == 0 else "math__odd", "ability": "math",
             "prompt": [{"role": "user", "content": f"{a}+{b}"}],
             "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"index": a * 10 + b}}
            for a in range(6) for b in range(2)]
    pq.write_table(pa.Table.from_pylist(rows), root / "prompts.parquet")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        run_eval(load_eval_config(None, [f"data.files=[{root / 'prompts.parquet'}]", "sampling.n=2",
                                         f"eval.endpoints=[http://127.0.0.1:{server.server_port}/v1]",
                                         f"output_dir={root / 'out'}", "reward.num_workers=1", "rejudge=true",
                                         f"judge.url=http://127.0.0.1:{server.server_port}/v1", "judge.model=judge"]))
    finally:
        server.shutdown()
    return root / "out"


ROWS, GROUP = 230, 50


@pytest.fixture(scope="module")
def parquet_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("parquet") / "rows.parquet"
    rows = [{"data_source": ["math__a", "code__b", "logic__c"][i % 3], "ability": "math",
             "prompt": [{"role": "user", "content": SCRIPT if i == 7 else f"question {i}"}],
             "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i},
             "images": [{"bytes": _png((200, 30, 30)), "path": None}] if i % 10 == 0 else []} for i in range(ROWS)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=GROUP)
    assert pq.ParquetFile(path).num_row_groups == 5
    return path


def _view(path, *extra, env=None):
    return start_service([sys.executable, "-m", "rl360.cli", "view", str(path), "--port", "0", *extra],
                         env=env or _env(), timeout_s=120)


@pytest.fixture(scope="module")
def servers(run_dir, eval_dir, parquet_file):
    """A viewer on each kind of PATH, and one with a key: started at once (their imports take seconds)."""
    paths = {"rollouts": (run_dir,), "eval": (eval_dir,), "parquet": (parquet_file,),
             "keyed": (parquet_file, "--api-key-env", "VIEW_KEY")}
    with ThreadPoolExecutor(len(paths)) as pool:
        started = dict(zip(paths, pool.map(lambda args: _view(*args, env=_env(VIEW_KEY=KEY)), paths.values())))
    yield {name: url for name, (_, url) in started.items()}
    for proc, _ in started.values():
        stop_service(proc)


def _get(url, path, **params):
    reply = httpx.get(url + path, params=params, timeout=60)
    return reply.status_code, reply.json()


# ---- the API ----
def test_rollouts_api_lists_every_trajectory_with_filters_detail_and_curve(servers):
    url = servers["rollouts"]
    assert _get(url, "/api/info")[1]["kind"] == "rollouts"
    status, page = _get(url, "/api/rows", offset=0, limit=50)
    assert status == 200 and page["total"] == 6
    assert [(r["step"], r["data_source"]) for r in page["rows"]] == [(s, d) for s in (1, 2)
                                                                       for d in ("math__a", "math__b", "tools")]
    assert _get(url, "/api/rows", step="2", outcome="wrong")[1]["total"] == 2
    assert [r["index"] for r in _get(url, "/api/rows", data_source="tools")[1]["rows"]] == [2, 5]
    filters = {f["name"]: f["options"] for f in _get(url, "/api/filters")[1]["filters"]}
    assert filters == {"step": ["1", "2"], "data_source": ["math__a", "math__b", "tools"],
                       "outcome": ["right", "wrong"]}
    detail = _get(url, "/api/row", index=5)[1]
    assert detail["step"] == 2 and detail["fields"]["response_tokens"] == [" call", " [tool: 4]", " [tool: 4]", " ok",
                                                                           " done"]
    assert detail["fields"]["logprob_diff"] == [pytest.approx(0.05), None, None, pytest.approx(0.02),
                                                pytest.approx(0.8)]
    assert [t["generated"] for t in detail["fields"]["turns"]] == [True, False, True]
    curve = _get(url, "/api/curve")[1]
    assert curve["steps"] == [1, 2, 3] and curve["series"]["reward/mean"] == [0.25, 0.5, 0.75]
    assert _get(url, "/api/rows", step="9")[0] == 400 and _get(url, "/api/rows", colour="red")[0] == 400
    assert _get(url, "/api/row", index=6)[0] == 400


def test_eval_api_marks_each_sample_right_or_wrong_by_data_source(servers, eval_dir):
    url = servers["eval"]
    report = json.loads((eval_dir / "report.json").read_text())
    info = _get(url, "/api/info")[1]
    assert info["total"] == 24 and info["summary"]["report"] == report
    rows = _get(url, "/api/rows", limit=100)[1]["rows"]
    assert [(r["prompt"], r["sample"]) for r in rows] == [(p, s) for p in range(12) for s in range(2)]
    rescued = [(r["prompt"], r["sample"]) for r in rows if r["outcome"] == "rescued"]
    assert rescued == [(2, 0), (2, 1)]  # 1+0, the one the judge takes back
    assert all(r["outcome"] == ("right" if r["data_source"] == "math__even" else "wrong") for r in rows
               if r["prompt"] != 2)
    assert _get(url, "/api/rows", outcome="wrong")[1]["total"] == 10
    judged = _get(url, "/api/rows", outcome="judged", limit=100)[1]
    assert judged["total"] == 12 == sum(1 for _ in (eval_dir / "errors.jsonl").open())
    assert [(r["prompt"], r["sample"]) for r in _get(url, "/api/rows", outcome="rescued")[1]["rows"]] == rescued
    assert report["judge"]["all"]["rescued"] == 2
    odd = _get(url, "/api/rows", data_source="math__odd", outcome="right")[1]
    assert odd["total"] == 0 and report["rule"]["by_data_source"]["math__odd"]["accuracy"] == 0.0
    detail = _get(url, "/api/row", index=rows[0]["index"])[1]["fields"]
    assert detail["question"] == "0+0" and detail["ground_truth"] == "0" and detail["answer"] == "0"
    assert _get(url, "/api/rows", outcome="maybe")[0] == 400


def test_parquet_pages_cross_row_groups_and_stop_at_the_end(servers):
    url = servers["parquet"]
    info = _get(url, "/api/info")[1]
    assert info["total"] == ROWS and info["summary"]["row_groups"] == 5
    page = _get(url, "/api/rows", offset=40, limit=70)[1]  # rows 40..109: groups 0, 1 and 2
    assert [r["index"] for r in page["rows"]] == list(range(40, 110))
    assert [json.loads(r["extra_info"])["index"] for r in page["rows"]] == list(range(40, 110))
    tail = _get(url, "/api/rows", offset=220, limit=50)[1]
    assert [r["index"] for r in tail["rows"]] == list(range(220, 230)) and tail["total"] == ROWS
    assert _get(url, "/api/rows", offset=ROWS + 5)[1]["rows"] == []
    filtered = _get(url, "/api/rows", data_source="code__b", offset=10, limit=30)[1]
    assert filtered["total"] == len(range(1, ROWS, 3))
    assert [r["index"] for r in filtered["rows"]] == list(range(1, ROWS, 3))[10:40]
    assert _get(url, "/api/rows", data_source="none__such")[1] == {"total": 0, "offset": 0, "limit": 50, "rows": []}
    assert {f["name"]: f["options"] for f in _get(url, "/api/filters")[1]["filters"]} == {
        "data_source": ["code__b", "logic__c", "math__a"]}
    image = _get(url, "/api/row", index=120)[1]["fields"]["images"][0]
    assert image["bytes"]["$image"].startswith("data:image/png;base64,")
    assert "image/png" in page["rows"][20]["images"]  # row 60's image named in the list, not sent
    assert _get(url, "/api/rows", limit=0)[0] == 400 and _get(url, "/api/row", index=ROWS)[0] == 400


def test_a_parquet_directory_pages_across_its_files(parquet_file, tmp_path):
    from rl360.view import open_source

    table = pq.read_table(parquet_file)
    (tmp_path / "b").mkdir()
    pq.write_table(table.slice(0, 30), tmp_path / "a.parquet", row_group_size=20)
    pq.write_table(table.slice(30, 25), tmp_path / "b" / "c.parquet", row_group_size=20)
    source = open_source(tmp_path)
    assert source.kind == "parquet" and source.info()["total"] == 55
    page = source.page(15, 30, {})
    assert [r["index"] for r in page["rows"]] == list(range(15, 45))
    assert [json.loads(r["extra_info"])["index"] for r in page["rows"]] == list(range(15, 45))
    assert source.row(50)["file"] == str(tmp_path / "b" / "c.parquet") and source.row(50)["row_group"] == 1
    assert [r["index"] for r in source.page(0, 50, {"data_source": "logic__c"})["rows"]] == list(range(2, 55, 3))


def test_a_run_directory_without_rollouts_names_its_evaluations(tmp_path):
    """A training run's directory with held-out evaluations but no dumped rollouts: the error gives the command
    that opens the newest step's and lists them all; a step's directory opens as an evaluation."""
    from rl360.errors import UserError
    from rl360.view import open_source

    for step in (5, 10):
        (tmp_path / "eval" / f"step_{step:06d}").mkdir(parents=True)
        (tmp_path / "eval" / f"step_{step:06d}" / "results.jsonl").write_text("")
    for path in (tmp_path, tmp_path / "eval"):
        with pytest.raises(UserError, match=r"no \*\.parquet files; its held-out evaluations are rl360 eval outputs: "
                                            rf"rl360 view {tmp_path}/eval/step_000010 \(of step_000005, step_000010\)"):
            open_source(path)
    assert open_source(tmp_path / "eval" / "step_000005").kind == "eval"


def test_row_text_is_served_as_data_never_as_markup(servers):
    url = servers["parquet"]
    html = httpx.get(url + "/", timeout=30)
    assert "script-src 'self'" in html.headers["content-security-policy"] and "question" not in html.text
    row = _get(url, "/api/row", index=7)[1]
    assert row["fields"]["prompt"][0]["content"] == SCRIPT  # JSON; the page sets it as text
    script = httpx.get(url + "/static/viewer.js", timeout=30).text
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "document.write" not in script


# ---- keys ----
def test_non_loopback_without_a_key_is_refused(parquet_file, capsys):
    assert main(["view", str(parquet_file), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "rl360: error: view: refusing to listen on 0.0.0.0 without a key" in capsys.readouterr().err


def test_missing_path_is_one_line(tmp_path, capsys):
    assert main(["view", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("rl360: error: rl360 view: ")


@pytest.fixture(scope="module")
def keyed(servers):
    return servers["keyed"]


def test_a_key_is_required_by_header_or_browser_cookie(keyed):
    assert httpx.get(keyed + "/api/info", timeout=30).status_code == 401
    assert httpx.get(keyed + "/", timeout=30).status_code == 401
    assert httpx.get(keyed + "/api/info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
    assert httpx.get(keyed + "/?key=wrong-key-wrong-key", timeout=30).status_code == 401
    with httpx.Client(timeout=30) as browser:
        login = browser.get(keyed + "/", params={"key": KEY, "x": "1"})
        assert login.status_code == 303 and login.headers["location"] == "/?x=1"
        assert KEY not in login.headers["set-cookie"]
        assert browser.get(keyed + "/api/rows", params={"limit": 3}).json()["total"] == ROWS  # the cookie stands in
    assert httpx.get(keyed + "/health", timeout=30).status_code == 200


# ---- the page in headless Chromium ----
def _chromium(url, tmp_path, *args):
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,800",
                           "--virtual-time-budget=10000", *args, url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@needs_chromium
@pytest.mark.parametrize("kind, expected", [("rollouts", ["math__b", "tools", " done"]),
                                            ("eval", ["math__odd", "wrong", "accuracy"]),
                                            ("parquet", ["question 49", "question 50", "code__b"])])
def test_the_page_shows_rows_in_chromium(servers, tmp_path, kind, expected):
    url = servers[kind] + "/#offset=0&limit=100&row=" + ("5" if kind == "rollouts" else "0")
    shot = tmp_path / f"{kind}.png"
    dom = _chromium(url, tmp_path, "--dump-dom", f"--screenshot={shot}")
    assert "<tbody><tr" in dom and all(text in dom for text in expected), dom[-3000:]
    # the row's <script> (it would set the title) shown as text, never run
    assert "&lt;script&gt;document.title" in dom and "<title>rl360 view</title>" in dom
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 800) and len(image.getcolors(1 << 20) or range(2)) > 10


@needs_chromium
def test_a_keyed_page_opens_with_the_key_once(keyed, tmp_path):
    dom = _chromium(f"{keyed}/?key={KEY}", tmp_path, "--dump-dom")
    assert "question 0" in dom and "rows 1–50 of 230" in dom


def test_the_view_command_starts_without_importing_the_training_stack():
    """`rl360 view` adds only its own parser: torch, megatron and the engines stay unimported, so it starts at once."""
    code = ("import sys\nfrom rl360.cli import main\ntry:\n    main(['view', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'megatron', 'rl360.engine', 'rl360.convert') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out
