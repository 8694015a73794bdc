"""`rl360 data inspect`: rows, counts per data_source, prompt-length percentiles (tokens or characters), samples."""

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl360.cli import main
from rl360.data import PromptRenderer
from rl360.data.inspect import percentile


def _rows(source, prompts, ability="math"):
    return [{
        "data_source": source,
        "prompt": [{"role": "user", "content": text}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": f"truth of {text}"},
        "extra_info": {"split": "train", "index": i},
    } for i, text in enumerate(prompts)]


@pytest.fixture
def files(tmp_path):
    math_rows = _rows("math__sums", ["1+2", "3+4+5", "6+7"]) + _rows("logic__order", ["9-1"], "logic")
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist(math_rows), first, row_group_size=2)
    pq.write_table(pa.Table.from_pylist(_rows("logic__order", ["1+1", "2+2+2+2"], "logic")), second)
    return [str(first), str(second)]


def _inspect(capsys, *argv):
    code = main(["data", "inspect", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_counts_lengths_in_characters_and_samples(files, capsys):
    code, out, _ = _inspect(capsys, *files)
    assert code == 0
    assert out.startswith("2 file(s), 6 rows")
    assert re.search(r"logic__order\s+3\s+50\.0%\s+logic", out) and re.search(r"math__sums\s+3\s+50\.0%\s+math", out)
    assert "in characters of the message contents (no --tokenizer given, so not tokens)" in out
    # lengths 3, 5, 3, 3, 3, 7: nearest-rank p50 3, p90 7; mean 4.0
    assert "min 3  p50 3  p90 7  p95 7  p99 7  max 7  mean 4.0" in out
    assert "bad rows (failing validate_row or with an unreadable image): 0" in out and "images: none" in out
    assert f"--- sample 1: math__sums, {files[0]} row 0\n[user]\n1+2\n--- ground truth: truth of 1+2" in out
    assert f"--- sample 2: logic__order, {files[0]} row 3" in out and "sample 3" not in out


def test_each_data_source_names_its_reward_and_the_unserved_are_flagged(tmp_path, capsys):
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(_rows("math__sums", ["1+2"]) + _rows("my_task__v1", ["?"], "qa")), path)
    code, out, _ = _inspect(capsys, str(path))
    assert code == 0
    assert re.search(r"math__sums\s+1\s+50\.0%\s+math  \(rl360\.rewards\.math:math_score\)", out)
    assert re.search(r"my_task__v1\s+1\s+50\.0%\s+qa  \(NO REWARD FUNCTION\)", out)
    assert ("no reward function serves 1 data_source(s): my_task__v1; `rl360 train` refuses them: register one "
            "(reward.custom, docs/reward-setup.md)") in out


def test_lengths_in_tokens_of_the_chat_template(files, capsys, tmp_path):
    from rl360.quickstart.assets import build_tokenizer

    tokenizer = build_tokenizer(tmp_path / "tok")
    renderer = PromptRenderer(tokenizer, max_prompt_length=100)
    lengths = sorted(len(renderer.render([{"role": "user", "content": text}]))
                     for text in ["1+2", "3+4+5", "6+7", "9-1", "1+1", "2+2+2+2"])
    code, out, _ = _inspect(capsys, *files, "--tokenizer", str(tmp_path / "tok"), "--samples", "1",
                            "--max-prompt-length", str(lengths[-2]))
    assert code == 0
    assert f"prompt length in tokens (chat template of {tmp_path / 'tok'}, with the generation prompt)" in out
    assert f"min {lengths[0]}  p50 {percentile(lengths, 50)}  p90 {lengths[-1]}" in out and f"max {lengths[-1]}" in out
    assert f"longer than {lengths[-2]} tokens: 1 rows (16.7%)" in out
    assert "<|im_start|>user\n1+2<|im_end|>\n<|im_start|>assistant\n" in out  # rendered as the model sees it
    assert "sample 2" not in out


def test_bad_rows_are_counted_and_a_bad_file_is_an_error(tmp_path, capsys):
    rows = _rows("math__sums", ["1+2", "3+4"])
    rows[1]["reward_model"] = {"style": "rule", "ground_truth": None}
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    code, out, _ = _inspect(capsys, str(path))
    assert code == 0 and (f"bad rows (failing validate_row or with an unreadable image): 1 ({path}: 1 row (1)); "
                          "the first: ") in out
    assert "rows.parquet row 1" in out
    text = tmp_path / "text.parquet"
    pq.write_table(pa.Table.from_pylist([dict(r, prompt="plain") for r in _rows("math__sums", ["1"])]), text)
    code, _, err = _inspect(capsys, str(text))
    assert code == 2 and "rl360: data error:" in err and "column 'prompt' has type string" in err


def test_percentile_is_nearest_rank():
    assert [percentile(list(range(1, 11)), q) for q in (10, 50, 90, 95, 100)] == [1, 5, 9, 10, 10]


# ----- images -------------------------------------------------------------------------------------------------------

def _png(width, height):
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (width % 256, height % 256, 90)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def image_file(tmp_path):
    """Five rows: two with one image, one with three (one of them a path beside the file), two without."""
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "wide.png").write_bytes(_png(300, 20))
    images = [[_png(56, 56)], [], [_png(10, 5), "pics/wide.png", _png(40, 80)], [_png(112, 112)], []]
    rows = _rows("math__geo", ["<image>x?", "1+1", "<image><image><image>y?", "z?", "2+2"])
    for row, items in zip(rows, images):
        row["images"] = [{"bytes": item, "path": None} if isinstance(item, bytes) else {"bytes": None, "path": item}
                         for item in items]
    path = tmp_path / "geo.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)
    return path, [item if isinstance(item, bytes) else (tmp_path / item).read_bytes()
                  for items in images for item in items]


def test_image_counts_and_sizes(image_file, capsys):
    path, images = image_file
    code, out, _ = _inspect(capsys, str(path))
    assert code == 0
    assert "images: 3 of 5 valid rows have images (60.0%), 5 images; per such row min 1  mean 1.67  max 3" in out
    sizes = sorted(len(data) for data in images)
    assert f"  bytes: min {sizes[0]} B  median {sizes[2]} B  max {sizes[-1]} B" in out
    assert "  width (px): min 10  median 56  max 300" in out and "  height (px): min 5  median 56  max 112" in out


def test_vision_model_lengths_count_image_tokens(image_file, capsys, tmp_path):
    from rl360.quickstart.vision_assets import build_vision_quickstart_model

    path, _ = image_file
    model = build_vision_quickstart_model(tmp_path / "vl", texts=["x? y? z?"])
    code, out, _ = _inspect(capsys, str(path), "--tokenizer", str(model), "--samples", "1")
    assert code == 0 and "(prompt lengths above count each image's tokens)" in out
    from transformers import AutoTokenizer

    renderer = PromptRenderer.for_model(model, AutoTokenizer.from_pretrained(model), max_prompt_length=10_000)
    rows = pq.read_table(path).to_pylist()
    lengths = sorted(len(renderer.prompt(dict(row, _source={"file": str(path), "row": i})))
                     for i, row in enumerate(rows))
    assert f"min {lengths[0]}  p50 {percentile(lengths, 50)}" in out and f"max {lengths[-1]}" in out
    assert lengths[-1] > len(renderer.render(rows[2]["prompt"])) + 10  # the three images' tokens count
    assert "<|vision_start|><|image_pad|>x4<|vision_end|>x?" in out  # the sample shows each image's run once


def test_unreadable_image_is_a_bad_row(tmp_path, capsys):
    rows = _rows("math__geo", ["<image>a", "<image>b"])
    rows[0]["images"] = [{"bytes": _png(30, 30), "path": None}]
    rows[1]["images"] = [{"bytes": b"not an image", "path": None}]
    path = tmp_path / "broken.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    code, out, _ = _inspect(capsys, str(path))
    assert code == 0 and "images: 1 of 1 valid rows have images" in out
    assert f"unreadable image): 1 ({path}: 1 row (1)); the first: " in out
    assert "broken.parquet row 1: key 'images'[0]: not a readable" in out


def test_the_columnar_row_check_finds_what_the_row_check_finds(tmp_path):
    """`scan_bad_rows` hands only suspect rows to validate_row; every kind of bad row is still found, at its
    index, with validate_row's message, across row groups."""
    from rl360.data.inspect import scan_bad_rows

    def row(i, **change):
        base = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i}+1"}],
                "reward_model": {"style": "rule", "ground_truth": str(i + 1)}}
        return {**base, **change}

    bad = {3: dict(prompt=[]), 8: dict(prompt=None), 11: dict(prompt=[{"role": "user", "content": None}]),
           12: dict(prompt=[{"role": "user", "content": "a"}, {"role": None, "content": "b"}]),
           17: dict(data_source=""), 18: dict(data_source=None), 25: dict(reward_model=None),
           29: dict(reward_model={"style": "rule", "ground_truth": None})}
    rows = [row(i, **bad.get(i, {})) for i in range(30)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    found, total = scan_bad_rows(str(path), keep=10)
    assert total == 30 and found.count == len(bad) and found.rows[str(path)] == sorted(bad)
    assert found.first == f"{path} row 3: key 'prompt' must be a non-empty list of {{role, content}} messages, got []"
    clean = tmp_path / "clean.parquet"
    pq.write_table(pa.Table.from_pylist([row(i) for i in range(30)]), clean, row_group_size=7)
    assert scan_bad_rows(str(clean))[0].count == 0
