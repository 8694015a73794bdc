"""data_preprocess/: every script on its fixture (source field names) -> a valid parquet file with the
ground truth its reward expects; code ground truths are run against the reference solution."""

import importlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_preprocess.common import RecordError
from rl360.data import MixedPromptStream, validate_file_schema, validate_row

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "preprocess"

# module -> (fixture, extra arguments, split, data_source, rows written)
SCRIPTS = {
    "math.deepscaler": ("deepscaler.json", [], "train", "math__deepscaler", 3),
    "math.or1_dapo": ("dapo_or1.jsonl", [], "train", "math__dapo_or1", 3),
    "codegen.leetcode": ("leetcode.jsonl", [], "train", "codegen__leetcode", 2),
    "codegen.taco": ("taco.jsonl", [], "train", "codegen__taco", 2),
    "codegen.primeintellect": ("primeintellect.jsonl", [], "train", "codegen__primeintellect", 3),
    "logic.zebra_puzzle": ("zebra_puzzle.json", [], "train", "logic__zebra_puzzle", 2),
    "logic.ordering_puzzle": ("ordering_puzzle.json", [], "train", "logic__ordering_puzzle", 2),
    "logic.graph_search": ("graph_search.json", [], "train", "logic__graph_search", 2),
    "simulation.codeio": ("codeio.jsonl", [], "train", "simulation__codeio", 2),
    "simulation.cruxeval": ("cruxeval.jsonl", ["--split", "test"], "test", "simulation__cruxeval_o", 2),
    "table.hitab": ("hitab.jsonl", ["--tables-dir", str(FIXTURES / "hitab_tables")], "train", "table__hitab", 2),
    "table.multihiertt": ("multihiertt.json", [], "train", "table__multihiertt", 2),
    "table.finqa": ("finqa.json", [], "train", "table__finqa", 2),
    "stem.webinstruct": ("webinstruct.jsonl", [], "train", "stem__webinstruct", 2),
    "stem.gpqa": ("gpqa.csv", ["--split", "test"], "test", "stem__gpqa", 2),
    "vision.deepvision": ("deepvision.parquet", [], "train", "math__deepvision", 3),
    "vision.geometry3k": ("geometry3k.parquet", [], "train", "math__geometry3k", 3),
    "vision.deepeyes": ("deepeyes.parquet", [], "train", "stem_web__deepeyes", 3),
}


def _run_script(module, out, *extra, fixture=None):
    name = module
    fixture = fixture or SCRIPTS[name][0]
    main = importlib.import_module(f"data_preprocess.{module}").main
    return main(["--input", str(FIXTURES / fixture), "--out", str(out), *SCRIPTS[name][1], *extra])


def _rows(path):
    return pq.read_table(path).to_pylist()


def _truths(rows):
    return [row["reward_model"]["ground_truth"] for row in rows]


def _user(row):
    return row["prompt"][-1]["content"]


@pytest.mark.parametrize("module", sorted(SCRIPTS))
def test_script_writes_the_standard_schema(module, tmp_path):
    _, _, split, data_source, count = SCRIPTS[module]
    path = _run_script(module, tmp_path)
    assert path == tmp_path / split / f"{data_source}.parquet"
    validate_file_schema(str(path), pq.ParquetFile(path).schema_arrow)
    rows = _rows(path)
    assert len(rows) == count
    for number, row in enumerate(rows):
        validate_row(row, str(path), number)
        assert row["data_source"] == data_source and row["ability"] == data_source.split("__")[0]
        assert row["reward_model"]["style"] == "rule" and row["reward_model"]["ground_truth"]
        assert row["extra_info"]["split"] == split and isinstance(row["extra_info"]["index"], int)
        assert row["prompt"][-1]["role"] == "user"
    instruction = {"math": r"\boxed{}", "table": r"\boxed{}", "stem": r"\boxed{}", "codegen": "```python",
                   "logic": "<answer>", "simulation": "<answer>" if "cruxeval" in module else '{"output"',
                   "vision": r"\boxed{}"}
    assert all(instruction[module.split(".")[0]] in _user(row) for row in rows)


def test_all_outputs_stream_together_mixed_by_domain(tmp_path):
    for module in SCRIPTS:
        _run_script(module, tmp_path)
    weights = dict.fromkeys(["math", "codegen", "logic", "simulation", "table", "stem", "stem_web"], 1.0)
    stream = MixedPromptStream.by_data_source(str(tmp_path), weights, batch_size=14, seed=0)
    batch = next(stream)
    assert sorted(row["ability"] for row in batch) == sorted(list(weights) * 2)


# ----- math --------------------------------------------------------------------------------------------

def test_math_ground_truths(tmp_path):
    assert _truths(_rows(_run_script("math.deepscaler", tmp_path))) == [r"\frac{5}{6}", "6", "2"]
    rows = _rows(_run_script("math.or1_dapo", tmp_path))
    assert _truths(rows) == ["55", "1024", "2"]  # the OR1 JSON list keeps its first answer
    assert _user(rows[0]) == r"Find the sum of all integers $k$ with $1 \le k \le 10$. " \
                             r"Please output the final answer within \boxed{}."  # DAPO's "Answer:" wrapper gone
    assert _user(rows[1]).count(r"\boxed{}") == 1
    assert [row["extra_info"]["index"] for row in rows] == [0, 1, 2]  # record 3 repeats record 1's problem
    assert rows[1]["extra_info"]["origin"] == "train-math-deepscaler"
    assert len(_rows(_run_script("math.or1_dapo", tmp_path, "--keep-duplicates"))) == 4


# ----- codegen: ground truths run against reference and wrong solutions -----------------------------

def _python(code, stdin=""):
    done = subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout


def _passes(truth, solution):
    truth = json.loads(truth)
    if "functional" in truth:
        return _python(f"{solution}\n{truth['functional']}")[0] == 0
    results = [_python(solution, stdin) for stdin in truth["inputs"]]
    return all(rc == 0 and out.split() == want.split() for (rc, out), want in zip(results, truth["outputs"]))


def test_leetcode_functional_truth_checks_the_entry_point(tmp_path):
    rows = _rows(_run_script("codegen.leetcode", tmp_path))
    for row in rows:
        prefix, reference = row["extra_info"]["prefix"], row["extra_info"]["reference"]
        assert _passes(row["reward_model"]["ground_truth"], prefix + reference)
    wrong = "class Solution:\n    def isPalindrome(self, x):\n        return True\n"
    assert not _passes(rows[1]["reward_model"]["ground_truth"], wrong)
    assert "class Solution:\n    def twoSum" in _user(rows[0])


def test_taco_stdin_and_function_truths(tmp_path):
    rows = _rows(_run_script("codegen.taco", tmp_path))
    stdin, functional = (json.loads(t) for t in _truths(rows))
    assert stdin == {"inputs": ["1 2\n", "10 -4\n", "100000 100000\n"], "outputs": ["3\n", "6\n", "200000\n"]}
    assert set(functional) == {"functional"}
    for row in rows:
        assert _passes(row["reward_model"]["ground_truth"], row["extra_info"]["reference"])
    assert not _passes(rows[0]["reward_model"]["ground_truth"], "print(0)")
    assert not _passes(rows[1]["reward_model"]["ground_truth"], "def double_all(xs):\n    return xs")
    shortest = json.loads(_truths(_rows(_run_script("codegen.taco", tmp_path, "--max-tests", "1")))[0])
    assert shortest == {"inputs": ["1 2\n"], "outputs": ["3\n"]}


def test_primeintellect_both_layouts(tmp_path):
    rows = _rows(_run_script("codegen.primeintellect", tmp_path))
    assert json.loads(rows[2]["reward_model"]["ground_truth"]) == {"inputs": ["1 5 3\n"], "outputs": ["5\n"]}
    assert rows[2]["extra_info"]["problem_id"] == "vfc_1"  # the rust problem (record 3) is left out
    solutions = ["n = int(input())\nprint(n * n)", "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)",
                 "print(max(map(int, input().split())))"]
    assert all(_passes(row["reward_model"]["ground_truth"], code) for row, code in zip(rows, solutions))
    assert not _passes(rows[1]["reward_model"]["ground_truth"], "def count_vowels(s):\n    return len(s)")


# ----- logic, simulation, table, stem -------------------------------------------------------------------

def test_logic_ground_truths(tmp_path):
    zebra = _rows(_run_script("logic.zebra_puzzle", tmp_path))
    assert json.loads(zebra[0]["reward_model"]["ground_truth"]) == {
        "header": ["House", "Name", "Pet"], "rows": [["1", "Eric", "cat"], ["2", "Arnold", "dog"]]}
    assert json.loads(zebra[1]["reward_model"]["ground_truth"])["rows"] == [["1", "tea"], ["2", "milk"]]
    assert zebra[0]["extra_info"]["grid_size"] == "2x3"
    ordering = _rows(_run_script("logic.ordering_puzzle", tmp_path))
    assert [json.loads(t) for t in _truths(ordering)] == [["pigeon", "sparrow", "quail"], ["blue", "red"]]
    assert _truths(_rows(_run_script("logic.graph_search", tmp_path))) == ["A", "B"]


def test_codeio_truth_is_the_reference_codes_result(tmp_path):
    for predict in ("output", "input"):
        rows = _rows(_run_script("simulation.codeio", tmp_path, "--predict", predict))
        records = [json.loads(line) for line in (FIXTURES / "codeio.jsonl").read_text().splitlines()]
        for row, record in zip(rows, records):
            namespace = {}
            exec(record["refcode"], namespace)
            truth = json.loads(row["reward_model"]["ground_truth"])
            assert list(truth) == [predict] and row["extra_info"]["predict"] == predict
            args = truth["input"] if predict == "input" else record["ios"][0]["input"]
            assert namespace["main_solution"](**args) == record["ios"][0]["output"]
    mixed = {row["extra_info"]["predict"] for row in _rows(_run_script("simulation.codeio", tmp_path, "--seed", "1"))}
    assert mixed <= {"input", "output"}


def test_cruxeval_truth_and_tasks(tmp_path):
    for task, data_source in (("output", "simulation__cruxeval_o"), ("input", "simulation__cruxeval_i")):
        path = _run_script("simulation.cruxeval", tmp_path, "--task", task)
        assert path.name == f"{data_source}.parquet"
        for row in _rows(path):
            truth = json.loads(row["reward_model"]["ground_truth"])
            namespace = {}
            exec(truth["code"], namespace)
            assert eval(f"f({truth['input']})", namespace) == eval(truth["output"])
            assert ("?? " in _user(row) or "??\n" in _user(row)) and row["extra_info"]["task"] == task


def test_table_ground_truths_and_markdown(tmp_path):
    hitab = _rows(_run_script("table.hitab", tmp_path))
    assert _truths(hitab) == ["1520", "2019|2020"]
    assert "| 2019 | east | 1520 |" in _user(hitab[0]) and "separate them with |" in _user(hitab[0])
    multi = _rows(_run_script("table.multihiertt", tmp_path))
    assert _truths(multi) == ["220", "70"]
    assert "|  | Revenue |  |" in _user(multi[0]) and "| Cloud | 120 | 150 |" in _user(multi[0])
    assert "Figures are in millions" in _user(multi[0])
    only_tables = _rows(_run_script("table.multihiertt", tmp_path, "--table-only"))
    assert len(only_tables) == 1 and "Figures are in millions" not in _user(only_tables[0])
    finqa = _rows(_run_script("table.finqa", tmp_path))
    assert _truths(finqa) == ["33.3%", "90"]  # an empty answer falls back to exe_ans
    assert "| fair value of swaps | $ 2000 | $ 1500 |" in _user(finqa[0])


def test_stem_ground_truths(tmp_path):
    web = _rows(_run_script("stem.webinstruct", tmp_path))
    assert _truths(web) == ["9", "18.0"] and web[0]["prompt"][0]["role"] == "system"  # Boolean left out
    assert len(_rows(_run_script("stem.webinstruct", tmp_path, "--skip-answer-types", ""))) == 3
    gpqa = _rows(_run_script("stem.gpqa", tmp_path))
    for row, correct in zip(gpqa, ["photon", "-1"]):
        letter = row["reward_model"]["ground_truth"]
        assert re.search(rf"^\({letter}\) (.*)$", _user(row), re.M).group(1) == correct
    again = _rows(_run_script("stem.gpqa", tmp_path))
    other = _rows(_run_script("stem.gpqa", tmp_path, "--seed", "5"))
    prompts = [_user(r) for r in gpqa]
    assert [_user(r) for r in again] == prompts and [_user(r) for r in other] != prompts


# ----- vision: images travel with their rows ------------------------------------------------------------------

def _source_images(fixture):
    return [[item["bytes"] for item in record["images"]] for record in pq.read_table(FIXTURES / fixture).to_pylist()]


@pytest.mark.parametrize("module", ["vision.deepvision", "vision.geometry3k", "vision.deepeyes"])
def test_vision_rows_carry_the_source_images_one_placeholder_each(module, tmp_path):
    rows = _rows(_run_script(module, tmp_path))
    assert [[item["bytes"] for item in row["images"]] for row in rows] == _source_images(SCRIPTS[module][0])
    assert all(_user(row).count("<image>") == len(row["images"]) and not row["images"][0]["path"] for row in rows)


def test_geometry3k_and_deepvision_ground_truths(tmp_path):
    geometry = _rows(_run_script("vision.geometry3k", tmp_path))
    assert _truths(geometry) == ["3", "8 \\sqrt { 3 }", "34"]
    assert _user(geometry[0]) == "<image>Find x. Please output the final answer within \\boxed{}."
    vision = _rows(_run_script("vision.deepvision", tmp_path))
    assert _truths(vision) == ["4\\sqrt{3}", "50", "C"]
    assert [row["extra_info"]["subset"] for row in vision] == ["math-77k", "math-77k", "visual_logic-26k"]
    assert _user(vision[1]).startswith("<image>The bar chart shows sales.")  # no placeholder: one in front
    assert _user(vision[2]).startswith("<image>Which shape comes next? <image>Choose")


def test_deepvision_question_answer_layout_reads_image_paths(tmp_path):
    rows = _rows(_run_script("vision.deepvision", tmp_path, fixture="deepvision_eval.jsonl"))
    assert _truths(rows) == ["60", "2"]
    assert [row["images"][0]["bytes"] for row in rows] == [
        (FIXTURES / "deepvision_images" / name).read_bytes() for name in ("q1.png", "q2.png")]
    assert _user(rows[1]) == ("<image>Which bar is the tallest? Answer with its position. "
                              "Please output the final answer within \\boxed{}.")


def test_deepeyes_questions_without_tool_instructions_for_the_judge(tmp_path):
    rows = _rows(_run_script("vision.deepeyes", tmp_path))
    assert _truths(rows) == ["A", "2019", "1"]
    assert [row["extra_info"]["question"] for row in rows] == [
        "What is the color of the umbrella?\n(A) red\n(B) blue\nAnswer with the option's letter from the given "
        "choices directly.", "In which year were sales highest?", "How many triangles are in the figure?"]
    assert _user(rows[2]) == ("<image>How many triangles are in the figure?\n"
                              "Please output the final answer within \\boxed{}.")
    assert all("image_zoom_in_tool" not in _user(row) and "<answer>" not in _user(row) for row in rows)
    assert {row["extra_info"]["judge_template"] for row in rows} == {"verifier"}
    kept = _rows(_run_script("vision.deepeyes", tmp_path, "--skip-sources", "chart"))
    assert [row["extra_info"]["subset"] for row in kept] == ["vstar", "thinklite_eureka"]


def test_vision_data_sources_route_to_existing_rewards(tmp_path, monkeypatch):
    from rl360.rewards import get_reward_fn, judged
    from rl360.rewards.registry import reward_ref

    assert reward_ref("math__deepvision") == reward_ref("math__geometry3k") == "rl360.rewards.math:math_score"
    assert get_reward_fn("math__geometry3k")("so \\boxed{8\\sqrt{3}}", "8 \\sqrt { 3 }")["score"] == 1.0
    row = _rows(_run_script("vision.deepeyes", tmp_path))[0]
    assert reward_ref(row["data_source"], row["extra_info"]) == "rl360.rewards.judged:stem_web_score"
    asked = []
    monkeypatch.setattr(judged, "judge_score", lambda response, truth, info: asked.append((truth, info)) or
                        {"score": 1.0})
    score = get_reward_fn(row["data_source"])("<think>red</think> \\boxed{A}", "A", row["extra_info"])
    assert score == {"score": 1.0} and asked[0][0] == "A"
    assert asked[0][1]["judge_template"] == "verifier" and asked[0][1]["question"].startswith("What is the color")


def test_bad_vision_records_are_named(tmp_path):
    from PIL import Image

    image = io.BytesIO()
    Image.new("RGB", (30, 30)).save(image, format="PNG")
    records = [{"problem": "<image>Compare <image>.", "answer": "1", "images": [{"bytes": image.getvalue()}]},
               {"problem": "<image>Find x.", "answer": "2", "images": [{"bytes": b"not an image"}]}]
    for number, record in enumerate(records):
        source = tmp_path / f"bad{number}.parquet"
        pq.write_table(pa.Table.from_pylist([record]), source)
        message = [r"bad0\.parquet record 0: RecordError: the text holds 2 <image> placeholder\(s\) for 1 image",
                   r"bad1\.parquet record 0: DataError: field 'images'\[0\]: not a readable image"][number]
        with pytest.raises(RecordError, match=message):
            importlib.import_module("data_preprocess.vision.geometry3k").main(
                ["--input", str(source), "--out", str(tmp_path / "out")])


def test_vision_outputs_render_as_image_prompts(tmp_path):
    """The written rows stream and render for a Qwen2.5-VL model: each image expanded to its tokens."""
    from transformers import AutoTokenizer

    from rl360.core import ImagePrompt
    from rl360.data import PromptRenderer, PromptStream
    from rl360.quickstart.vision_assets import build_vision_quickstart_model

    for module in ("vision.deepvision", "vision.geometry3k", "vision.deepeyes"):
        _run_script(module, tmp_path / "data")
    model = build_vision_quickstart_model(tmp_path / "model")
    renderer = PromptRenderer.for_model(model, AutoTokenizer.from_pretrained(model), max_prompt_length=4096)
    rows = next(PromptStream(str(tmp_path / "data"), batch_size=9, shuffle=False, filter_fn=renderer.fits))
    prompts = [renderer.prompt(row) for row in rows]
    assert all(isinstance(prompt, ImagePrompt) for prompt in prompts) and len(prompts) == 9
    pad = renderer.vision.image_token_id
    for prompt in prompts:
        assert prompt.ids.count(pad) == sum(renderer.vision.image_tokens(image) for image in prompt.images)
    thinklite = next(p for p, row in zip(prompts, rows) if row["extra_info"].get("subset") == "thinklite_eureka")
    assert thinklite.ids.count(pad) == 2  # its 20x12 image is scaled up to 47x28: 2x4 patches, 2 tokens


# ----- shared behaviour ---------------------------------------------------------------------------------

def test_parquet_input_sample_and_original_index(tmp_path):
    records = json.loads((FIXTURES / "deepscaler.json").read_text())
    records = [dict(r, answer=r["answer"][0] if isinstance(r["answer"], list) else r["answer"]) for r in records]
    source = tmp_path / "deepscaler.parquet"
    pq.write_table(pa.Table.from_pylist(records), source)
    main = importlib.import_module("data_preprocess.math.deepscaler").main
    rows = _rows(main(["--input", str(source), "--out", str(tmp_path / "out"), "--sample-size", "2", "--seed", "3"]))
    assert len(rows) == 2
    for row in rows:  # extra_info.index is the record's position in the input, not in the sample
        assert row["reward_model"]["ground_truth"] == records[row["extra_info"]["index"]]["answer"]


def test_a_bad_record_is_named_or_skipped(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n" + json.dumps({"problem": "no answer"}) + "\n")
    main = importlib.import_module("data_preprocess.math.deepscaler").main
    with pytest.raises(RecordError, match=r"bad\.jsonl record 1: RecordError: missing field\(s\) \['answer'\]"):
        main(["--input", str(bad), "--out", str(tmp_path / "out")])
    assert len(_rows(main(["--input", str(bad), "--out", str(tmp_path / "out"), "--skip-bad"]))) == 1
    with pytest.raises(FileNotFoundError, match="`datasets` package"):
        main(["--input", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "out")])


def test_scripts_run_as_modules_from_the_repository_root(tmp_path):
    done = subprocess.run([sys.executable, "-m", "data_preprocess.logic.graph_search", "--input",
                           str(FIXTURES / "graph_search.json"), "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote 2 rows" in done.stdout and (tmp_path / "train" / "logic__graph_search.parquet").exists()


def test_quickstart_task_script_still_writes_its_files(tmp_path):
    from rl360.quickstart.prepare import _script

    _script("synthetic_arithmetic").main(["--out", str(tmp_path), "--max-a", "2", "--max-b", "2", "--copies", "1"])
    rows = _rows(tmp_path / "train.parquet")
    assert len(rows) == 9 and rows[0]["data_source"] == "math__synthetic_arithmetic"


@pytest.mark.parametrize("blank", [False, True], ids=["images", "blanked"])
def test_vision_quickstart_task_needs_the_image(tmp_path, blank):
    """Every row asks the same question, so only the image tells the answer; the control blanks every image."""
    from PIL import Image

    from rl360.quickstart.prepare import _script

    colours = _script("synthetic_colours")
    colours.main(["--out", str(tmp_path), "--train-rows", "16", "--test-rows", "4"] + (["--blank"] if blank else []))
    rows = _rows(tmp_path / "train.parquet")
    assert {row["data_source"] for row in rows} == {"math__synthetic_colours"}
    assert len({row["prompt"][0]["content"] for row in rows}) == 1
    assert sorted(row["reward_model"]["ground_truth"] for row in rows) == sorted("1234" * 4)
    for row in rows:
        image = Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")
        counts = sorted(image.getcolors(), reverse=True)
        if blank:
            assert counts == [(image.width * image.height, colours.GREY)]
        else:
            answer = int(row["reward_model"]["ground_truth"])
            assert counts[0][1] == colours.COLOURS[answer][1] and counts[0][0] > image.width * image.height / 2
