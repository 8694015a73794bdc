"""Every data_source that verl's and Reasoning360's `default_compute_score` route scores here, with ground truths
in the format those projects store; reward_metric selection; the data-open checks; stem_web through a judge."""

import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl360.config import JudgeConfig
from rl360.rewards import RewardItem, RewardPool, compute_score, register_reward
from rl360.rewards.check import add_reward_parser, check_reward_data, judge_configured
from rl360.rewards.judge import judge_env
from rl360.rewards.registry import (
    JudgeNotConfigured,
    UnknownDataSource,
    UnknownRewardMetric,
    check_route,
    find_route,
    get_reward_fn,
    routes,
)

ROOT = Path(__file__).resolve().parents[1]

# ----- ground truths as the projects store them ------------------------------------------------------------

DOUBLE_STDIN = json.dumps({"inputs": ["2\n", "7\n"], "outputs": ["4\n", "14\n"]})
DOUBLE_STDIN_CODE = "```python\nprint(int(input()) * 2)\n```"
WRONG_STDIN_CODE = "```python\nprint(int(input()) + 2)\n```"  # right for the first case only
# verl's prime_code call-based form: each input a string of JSON lines (one per argument), outputs JSON text
ADD_CALL = json.dumps({"fn_name": "add", "inputs": ["1\n2", "[1]\n[2, 3]"], "outputs": ["3", "[1, 2, 3]"]})
ADD_CODE = "<think>easy</think>\n```python\ndef add(a, b):\n    return a + b\n```"
SUB_CODE = "```python\ndef add(a, b):\n    return a - b\n```"
# APPS / TACO's own call-based form: inputs are argument lists, each output wrapped in a list
TWO_SUM = {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]], "outputs": [[[0, 1]], [[1, 2]]]}
TWO_SUM_CODE = """```python
class Solution:
    def twoSum(self, nums: List[int], target: int) -> List[int]:
        seen = {}
        for index, value in enumerate(nums):
            if target - value in seen:
                return [seen[target - value], index]
            seen[value] = index
```"""
TWO_SUM_WRONG = "```python\nclass Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n```"
SEARCH_TRUTH = {"target": np.array(["Paris", "Paris, France"], dtype=object)}  # as pandas reads the list column

# (data_source, ground truth, correct response, wrong response, extra_info, the correct response's score)
CASES = [
    ("openai/gsm8k", "72", "She sold 48 + 24 = 72 clips.\n#### 72", "#### 71", None, 1.0),
    ("openai/gsm8k", "1200", "The total is \\boxed{1,200}.", "The total is \\boxed{1,300}.", None, 1.0),
    ("lighteval/MATH", "\\frac{1}{2}", "so \\boxed{\\frac12}", "so \\boxed{\\frac13}", None, 1.0),
    ("DigitalLearningGmbH/MATH-lighteval", "10", "\\boxed{10}", "\\boxed{11}", None, 1.0),
    ("HuggingFaceH4/MATH-500", "\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(3, \\frac{\\pi}{2})}",
     "\\boxed{(3, \\pi)}", None, 1.0),
    ("math", "34", "Thus\nAnswer: 34", "Thus\nAnswer: 43", None, 1.0),
    ("math_dapo", "34", "<think>a</think>The last line.\nAnswer: $34$", "Answer: $35$", None, 1.0),
    ("math_dapo_reasoning", "34", "so \\boxed{34}", "so \\boxed{3}", None, 1.0),
    ("aime2024", "204", "Answer: 204", "\\boxed{205}", None, 1.0),
    ("aime25", "70", "\\boxed{70}", "Answer: 7", None, 1.0),
    ("math__deepscaler", "2", "\\boxed{2}", "Answer: 2", None, 1.0),  # math* reads only a box
    ("codecontests", DOUBLE_STDIN, DOUBLE_STDIN_CODE, WRONG_STDIN_CODE, None, 1.0),
    ("codeforces", DOUBLE_STDIN, DOUBLE_STDIN_CODE, "no code at all", None, 1.0),
    ("apps", json.dumps(TWO_SUM), TWO_SUM_CODE, TWO_SUM_WRONG, None, 1.0),
    ("taco", ADD_CALL, ADD_CODE, SUB_CODE, None, 1.0),
    ("codegen__leetcode", DOUBLE_STDIN, DOUBLE_STDIN_CODE, WRONG_STDIN_CODE, None, 1.0),
    ("hiyouga/geometry3k", "8 \\sqrt { 3 }", "<think>30-60-90</think> The side is \\boxed{8\\sqrt{3}}.",
     "The side is \\boxed{8}.", None, 1.0),
    ("stem__gpqa_diamond", "C", "Therefore \\boxed{C}", "Therefore \\boxed{B}", None, 1.0),
    ("stem__gpqa_diamond_no_box", "C", "Reasoning...\nAnswer: C", "Reasoning...\nAnswer: D", None, 1.0),
    ("stem__supergpqa", "D", "The answer is \\boxed{D}.", "The answer is \\boxed{A}.", None, 1.0),
    ("ordering_puzzle_dataset", np.array(["hawk", "crow", "owl"], dtype=object),
     "<think>hawk first</think><answer>['Hawk', 'crow', 'owl']</answer>", "<answer>['crow', 'hawk', 'owl']</answer>",
     None, 1.0),
] + [
    (name, "\\frac{3}{4}", "The answer is $\\frac{3}{4}$.", "The answer is $\\frac{4}{3}$.", None, 1.0)
    for name in ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                 "numina_cn_k12", "numina_olympiads")
] + [
    (name, SEARCH_TRUTH, "<think>capital</think><answer> the Paris </answer>", "<answer>Lyon</answer>", None, 1.0)
    for name in ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                 "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle")
]

# Rows for the domains other modules score (instruction following, LiveBench, reasoning-gym), one per name:
# (data_source, ground truth as stored, correct response, wrong response, extra_info, max score). Add a row
# here for every further name; every test below runs over them too.
OTHER_DOMAIN_CASES: list[tuple] = [
    ("ood__ifeval", np.array([{"relation": None, "num_words": None}], dtype=object),
     "Hello world with no commas at all.", "Hello, world.", {"instruction_id_list": ["punctuation:no_comma"]}, 1.0),
    ("ood__ifbench",
     json.dumps([{"instruction_id": ["first_word:first_word_answer"], "kwargs": [{"first_word": "yes"}]}]),
     "Yes it is.", "No, it is not.", {}, 1.0),
    ("ood__livebench", "yes, no, yes", "Thinking it over...\n**yes, no, yes**", "**yes, yes, yes**",
     {"task": "web_of_lies_v2"}, 1.0),
    ("reasoning_gym", "7", "<think>3 + 4</think><answer>7</answer>", "<answer>8</answer>",
     {"task": "chain_sum", "metadata": json.dumps({})}, 1.0),
]

ALL_CASES = CASES + OTHER_DOMAIN_CASES
CODE_NAMES = {"codecontests", "apps", "codeforces", "taco", "codegen__leetcode"}
NAMES_OF_THE_ISSUE = {  # every name the issue lists that verl's / Reasoning360's routers send somewhere
    "ood__ifeval", "ood__ifbench", "ood__livebench", "reasoning_gym",
    "openai/gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math",
    "math_dapo", "math_dapo_reasoning", "codecontests", "apps", "codeforces", "taco", "hiyouga/geometry3k",
    "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
    "numina_olympiads", "searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
    "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle",
}


def _score(value) -> float:
    return float(value["score"] if isinstance(value, dict) else value)


def test_every_name_of_the_issue_has_a_case():
    assert NAMES_OF_THE_ISSUE <= {case[0] for case in ALL_CASES}
    assert any(case[0].startswith("aime") for case in ALL_CASES)
    assert any("no_box" in case[0] for case in ALL_CASES)


@pytest.mark.parametrize("case", ALL_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(ALL_CASES)])
def test_correct_scores_its_max_and_wrong_scores_zero(case):
    source, truth, right, wrong, extra, best = case
    assert _score(compute_score(source, right, truth, extra)) == pytest.approx(best)
    assert _score(compute_score(source, wrong, truth, extra)) == 0.0


@pytest.mark.timeout(120)
def test_every_case_scores_the_same_through_a_reward_pool():
    """All cases but the sandboxed code ones (those run above already, in the real sandbox), plus one of
    those, through worker processes: the route and the ground truth as the trainer passes them survive."""
    chosen = [case for case in ALL_CASES if case[0] not in CODE_NAMES] + [case for case in ALL_CASES
                                                                         if case[0] == "taco"]
    items = [RewardItem(source, response, truth, extra) for source, truth, right, wrong, extra, _ in chosen
             for response in (right, wrong)]
    with RewardPool(num_workers=2, timeout_s=60) as pool:
        results = pool.score(items)
    assert [r.error for r in results] == [None] * len(items)
    assert [r.score for r in results] == [value for *_, best in chosen for value in (best, 0.0)]


def test_geometry3k_weighs_accuracy_and_format_as_verl():
    truth = "3"
    both = compute_score("hiyouga/geometry3k", "<think>x</think>\\boxed{3}", truth)
    assert both == {"score": 1.0, "acc": 1.0, "format": 1.0, "pred": "3"}
    assert compute_score("hiyouga/geometry3k", "\\boxed{3}", truth)["score"] == pytest.approx(0.9)
    wrong_formatted = compute_score("hiyouga/geometry3k", "  <think>x</think>\\boxed{4}", truth)
    assert wrong_formatted["score"] == pytest.approx(0.1) and wrong_formatted["acc"] == 0.0


# ----- matching rules ---------------------------------------------------------------------------------------

def tie_first(solution_str, ground_truth, extra_info=None):
    return 0.25


def tie_second(solution_str, ground_truth, extra_info=None):
    return 0.75


def test_exact_names_match_only_themselves():
    assert find_route("apps").exact and find_route("openai/gsm8k").exact
    for near in ("apps_v2", "openai/gsm8k_test", "searchR1_nq2", "numina_cn_k12x"):
        with pytest.raises(UnknownDataSource, match=re.escape(repr(near))):
            find_route(near)
    assert find_route("aime2025").name == "aime"  # a prefix
    assert find_route("math__x").ref == "rl360.rewards.math:math_score"
    assert find_route("math").ref == "rl360.rewards.math:stated_math_score"  # exact `math` beats the prefix
    assert find_route("stem_web_v2").name == "stem_web" and find_route("stem__gpqa_main").name == "stem__gpqa"


def test_a_tie_between_exact_and_prefix_goes_to_the_later_registration():
    register_reward("test_routing_tie", exact=True)(tie_first)
    register_reward("test_routing_tie")(tie_second)  # e.g. reward.custom at start-up, after the built-ins
    assert compute_score("test_routing_tie", "", "") == 0.75
    register_reward("test_routing_tie", exact=True)(tie_first)  # registered again: newest again
    assert compute_score("test_routing_tie", "", "") == 0.25
    assert compute_score("test_routing_tie_more", "", "") == 0.75  # only the prefix reaches longer names


# ----- reward_metric ----------------------------------------------------------------------------------------

def test_reward_metric_selects_the_scorer_it_names():
    stated = "so the answer is 34"  # no box: the default math* scorer gives 0, prime_math reads the statement
    for source in ("math__dapo_or1", "math_dapo", "math"):
        assert _score(compute_score(source, stated, "34", {"reward_metric": "prime_math"})) == 1.0
    assert _score(compute_score("math__dapo_or1", stated, "34", {"reward_metric": "default"})) == 0.0
    assert _score(compute_score("math__dapo_or1", stated, "34", {"reward_metric": None})) == 0.0
    assert _score(compute_score("math__dapo_or1", stated, "34", {"index": 3})) == 0.0
    assert get_reward_fn("math_dapo", {"reward_metric": "math_llm_judge"}).__name__ == "math_llm_judge_score"
    assert get_reward_fn("math__x", [("reward_metric", "prime_math")]).__name__ == "stated_math_score"  # map column


def test_an_unknown_reward_metric_is_an_error_naming_the_known_ones():
    with pytest.raises(UnknownRewardMetric) as err:
        compute_score("math__x", "\\boxed{1}", "1", {"reward_metric": "naive_dapo"})
    text = str(err.value)
    assert "'math__x'" in text and "'naive_dapo'" in text
    assert "['default', 'math_llm_judge', 'prime_math', 'tool_bonus']" in text
    with pytest.raises(UnknownRewardMetric, match=r"known reward_metric values for it: \['default'\]"):
        find_route("codegen__x", "prime_math")  # a metric is never ignored, not even where it means nothing
    with pytest.raises(UnknownRewardMetric, match="must be a string"):
        find_route("math__x", 3)


def test_routes_that_call_the_judge_are_declared():
    judged = {(route.pattern, route.metric) for route in routes() if route.needs_judge}
    agents = {(route.pattern, route.metric) for route in routes() if route.ref.startswith("rl360.rewards.agentic:")}
    assert ("vstar", "default") in agents and ("deepeyes", "default") in agents and ("vstar", "pyvision") in agents
    unjudged = {("math*", "tool_bonus")}  # the math reward's accuracy with DeepEyes' tool bonus: no judge
    assert unjudged <= agents
    assert judged == {("stem_web*", "default"), ("math*", "math_llm_judge")} | (agents - unjudged)
    with pytest.raises(JudgeNotConfigured, match=r"'stem_web'.*reward\.judge\.url"):
        check_route("stem_web", None, judge_configured=False)
    with pytest.raises(JudgeNotConfigured, match=r"'math__x' with extra_info.reward_metric 'math_llm_judge'"):
        check_route("math__x", "math_llm_judge", judge_configured=False)
    assert check_route("stem_web", None, judge_configured=True).name == "stem_web"


# ----- the data-open check, on real parquet files ----------------------------------------------------------

def _write(path, rows, extra_type=None, row_group_size=2):
    """rows: (data_source, extra_info dict or None)."""
    columns = {
        "prompt": [[{"role": "user", "content": "q"}] for _ in rows],
        "data_source": [source for source, _ in rows],
        "reward_model": [{"style": "rule", "ground_truth": "1"} for _ in rows],
    }
    if any(extra is not None for _, extra in rows):
        columns["extra_info"] = pa.array([extra for _, extra in rows], type=extra_type)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return str(path)


def test_data_open_accepts_known_metrics_and_names_the_first_bad_row(tmp_path):
    good = _write(tmp_path / "good.parquet", [("math__a", {"index": 0, "reward_metric": "prime_math"}),
                                               ("math__a", {"index": 1, "reward_metric": "default"}),
                                               ("openai/gsm8k", {"index": 2, "reward_metric": None})])
    check_reward_data(good, judge_configured=False)
    bad = _write(tmp_path / "bad.parquet", [("math__a", {"index": 0, "reward_metric": "prime_math"})] * 3
                 + [("math__a", {"index": 3, "reward_metric": "bogus"}),
                    ("math__a", {"index": 4, "reward_metric": "bogus"})])
    with pytest.raises(UnknownRewardMetric) as err:
        check_reward_data([good, bad], judge_configured=True)
    text = str(err.value)
    assert text.startswith(f"{bad} row 3 (the first of 2 rows with data_source 'math__a' and reward_metric "
                           "'bogus'): ") and "'bogus'" in text
    assert "['default', 'math_llm_judge', 'prime_math', 'tool_bonus']" in text


def test_data_open_names_an_unknown_data_source_and_its_row(tmp_path):
    path = _write(tmp_path / "d.parquet", [("math__a", None), ("math__a", None), ("apps_v2", None)])
    with pytest.raises(KeyError, match=rf"{re.escape(path)} row 2: no reward function for data_source 'apps_v2'"):
        check_reward_data(path, judge_configured=True)


def test_data_open_refuses_judge_rows_without_a_judge(tmp_path):
    web = _write(tmp_path / "web.parquet", [("stem__gpqa", {"question": "q"}), ("stem_web", {"question": "q"})])
    with pytest.raises(JudgeNotConfigured) as err:
        check_reward_data(web, judge_configured=False)
    assert str(err.value).startswith(f"{web} row 1: data_source 'stem_web'") and "reward.judge.url" in str(err.value)
    check_reward_data(web, judge_configured=True)
    judged = _write(tmp_path / "judged.parquet", [("math__a", {"reward_metric": "math_llm_judge"})])
    with pytest.raises(JudgeNotConfigured, match=r"row 0: .*'math_llm_judge'.*reward\.judge\.url"):
        check_reward_data(judged, judge_configured=False)


def test_data_open_reads_a_map_extra_info(tmp_path):
    kind = pa.map_(pa.string(), pa.string())
    path = _write(tmp_path / "m.parquet", [("math__a", [("reward_metric", "prime_math")]),
                                           ("math__a", [("index", "1")]),
                                           ("math__a", [("reward_metric", "nope")])], extra_type=kind)
    with pytest.raises(UnknownRewardMetric, match=r"row 2: .*'nope'"):
        check_reward_data(path, judge_configured=True)


def test_judge_configured_reads_the_config_then_the_environment():
    assert judge_configured(JudgeConfig(url="http://h/v1", model="m"), environ={})
    assert not judge_configured(JudgeConfig(url="http://h/v1"), environ={})
    assert judge_configured(JudgeConfig(url="http://h/v1"), environ={"RL360_JUDGE_MODEL": "m"})
    assert judge_configured(JudgeConfig(), environ={"RL360_JUDGE_URL": "http://h/v1", "RL360_JUDGE_MODEL": "m"})
    assert not judge_configured(JudgeConfig(), environ={})


def _cli(argv):
    import argparse
    import io

    parser = argparse.ArgumentParser(prog="rl360")
    add_reward_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args, stdout=io.StringIO())


def test_reward_check_applies_the_same_checks(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RL360_JUDGE_URL", raising=False)
    monkeypatch.delenv("RL360_JUDGE_MODEL", raising=False)
    path = _write(tmp_path / "d.parquet", [("math__a", {"reward_metric": "prime_math"}),
                                           ("math__a", {"reward_metric": "bogus"})])
    (tmp_path / "r.jsonl").write_text('{"response": "x"}\n' * 2)
    argv = ["reward", "check", path, "--responses", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "s.jsonl"),
            "--workers", "0"]
    assert _cli(argv) == 2
    assert f"{path} row 1: " in capsys.readouterr().err and not (tmp_path / "s.jsonl").exists()
    web = _write(tmp_path / "w.parquet", [("stem_web", {"question": "q"})])
    (tmp_path / "w.jsonl").write_text('{"response": "x"}\n')
    argv = ["reward", "check", web, "--responses", str(tmp_path / "w.jsonl"), "--out", str(tmp_path / "s.jsonl"),
            "--workers", "0"]
    assert _cli(argv) == 2
    assert "--judge-url" in capsys.readouterr().err


# ----- stem_web and math_llm_judge through a real (local) OpenAI-compatible judge ------------------------------

EQUIVALENT = {("2 m/s", "2 meters per second"), ("0.5", "one half")}  # what this judge accepts beyond equality


class OpenAIChatServer(ThreadingHTTPServer):
    """POST /v1/chat/completions: decides by the answers quoted in our judge prompts; records the prompts."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _ChatHandler)
        self.prompts: list[str] = []
        self.lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _ChatHandler(BaseHTTPRequestHandler):
    server: OpenAIChatServer

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]
        with self.server.lock:
            self.server.prompts.append(prompt)
        if "### Ground Truth Answer:" in prompt:  # stem_verifier
            reference = _between(prompt, "### Ground Truth Answer: ", "\n")
            student = _between(prompt, "### Student Answer: ", "\n")
            verdict = "Final Decision: " + ("Yes" if _same(reference, student) else "No")
        else:  # math_grade
            reference = _between(prompt, "Reference Answer: ", "\n")
            student = _between(prompt, "Student's Answer: ", "\n")
            verdict = "Final Grade: " + ("CORRECT" if _same(reference, student) else "INCORRECT")
        data = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant",
                                                                "content": f"Compared.\n{verdict}"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _between(text, start, end):
    return text.split(start, 1)[1].split(end, 1)[0].strip()


def _same(reference, student):
    return reference == student or (reference, student) in EQUIVALENT


@pytest.fixture
def judge_server():
    server = OpenAIChatServer()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.timeout(60)
def test_stem_web_is_judged_through_reward_judge_in_a_pool(judge_server):
    env = judge_env(JudgeConfig(url=judge_server.base_url, model="general-verifier", max_retries=0))
    info = {"question": "How fast does it move?"}
    items = [RewardItem("stem_web", "<think>v = d/t</think> \\boxed{2 meters per second}", "2 m/s", info),
             RewardItem("stem_web", "\\boxed{3 meters per second}", "2 m/s", info),
             RewardItem("stem_web", "about 2 meters per second, no box", "2 m/s", info)]
    with RewardPool(num_workers=2, timeout_s=30, env=env) as pool:
        results = pool.score(items)
    assert [(r.score, r.error) for r in results] == [(1.0, None), (0.0, None), (0.0, None)]
    assert len(judge_server.prompts) == 2  # no box: 0 without asking the judge
    assert all("### Question: How fast does it move?" in p and "### Ground Truth Answer: 2 m/s" in p
               for p in judge_server.prompts)


@pytest.mark.timeout(60)
def test_math_llm_judge_asks_the_judge_only_where_math_verify_finds_no_match(judge_server, monkeypatch):
    for name, value in judge_env(JudgeConfig(url=judge_server.base_url, model="judge", max_retries=0)).items():
        monkeypatch.setenv(name, value)
    info = {"reward_metric": "math_llm_judge", "original_question": "Solve 2x = 1."}
    assert compute_score("math__or1", "\\boxed{\\frac{1}{2}}", "0.5", info) == {
        "score": 1.0, "pred": "\\frac{1}{2}", "judged": False}
    assert judge_server.prompts == []
    judged = compute_score("math__or1", "\\boxed{one half}", "0.5", info)
    assert judged["score"] == 1.0 and judged["judged"] is True  # math-verify missed it; the judge agrees
    assert compute_score("math__or1", "\\boxed{7}", "0.5", info)["score"] == 0.0
    assert len(judge_server.prompts) == 2 and "Question: Solve 2x = 1." in judge_server.prompts[0]
    with pytest.raises(ValueError, match="needs 'question'"):
        compute_score("math__or1", "\\boxed{7}", "0.5", {"reward_metric": "math_llm_judge"})


@pytest.mark.timeout(60)
def test_reward_metric_selects_the_scorer_in_a_reward_pool():
    stated = "so the answer is 34"
    items = [RewardItem("math__dapo_or1", stated, "34", {"reward_metric": "prime_math"}),
             RewardItem("math__dapo_or1", stated, "34", {"reward_metric": "default"})]
    with RewardPool(num_workers=1, timeout_s=30) as pool:
        assert [r.score for r in pool.score(items)] == [1.0, 0.0]


# ----- docs/rewards.md ------------------------------------------------------------------------------------

def test_docs_rewards_md_is_generated_from_the_registry():
    generated = subprocess.run([sys.executable, "-m", "rl360.rewards.docs"], capture_output=True, text=True,
                               check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    committed = (ROOT / "docs" / "rewards.md").read_text()
    assert committed == generated, "docs/rewards.md is stale: run `python -m rl360.rewards.docs > docs/rewards.md`"
    for name in NAMES_OF_THE_ISSUE | {"aime24", "stem_web", "stem__gpqa_diamond", "stem__supergpqa"}:
        assert f"| `{find_route(name).pattern}` |" in generated
