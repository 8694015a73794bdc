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
    assert "bad rows (failing validate_row): 0" in out
    assert f"--- sample 1: math__sums, {files[0]} row 0\n[user]\n1+2\n--- ground truth: truth of 1+2" in out
    assert f"--- sample 2: logic__order, {files[0]} row 3" in out and "sample 3" not in out


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
    assert code == 0 and "bad rows (failing validate_row): 1; the first: " in out and "rows.parquet row 1" in out
    text = tmp_path / "text.parquet"
    pq.write_table(pa.Table.from_pylist([dict(r, prompt="plain") for r in _rows("math__sums", ["1"])]), text)
    code, _, err = _inspect(capsys, str(text))
    assert code == 2 and "rl360: data error:" in err and "column 'prompt' has type string" in err


def test_percentile_is_nearest_rank():
    assert [percentile(list(range(1, 11)), q) for q in (10, 50, 90, 95, 100)] == [1, 5, 9, 10, 10]
