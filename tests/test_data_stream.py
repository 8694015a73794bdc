"""Streamed parquet prompts: coverage, seeded order, sharding, resume, validation errors."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl360.data import DataError, PromptRenderer, PromptStream, scan_data_sources


def _rows(start, count, source="math__t"):
    return [{
        "data_source": source,
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": {"split": "train", "index": i, "tools": {"name": "python", "max_turns": 2}},
    } for i in range(start, start + count)]


@pytest.fixture
def files(tmp_path):
    paths = []
    for k, (start, count) in enumerate([(0, 23), (23, 17)]):
        path = tmp_path / f"part{k}.parquet"
        pq.write_table(pa.Table.from_pylist(_rows(start, count)), path, row_group_size=5)
        paths.append(str(path))
    return paths


def _ids(batch):
    return [int(row["reward_model"]["ground_truth"]) for row in batch]


def _take(stream, batches):
    it = iter(stream)
    return [_ids(next(it)) for _ in range(batches)]


def test_each_row_once_per_epoch_and_orders_depend_on_seed_and_epoch(files):
    stream = PromptStream(files, batch_size=8, seed=1, shuffle_buffer=6)
    epoch0 = sum(_take(stream, 5), [])
    assert sorted(epoch0) == list(range(40))
    epoch1 = sum(_take(stream, 5), [])  # iterating again continues where it stopped
    assert sorted(epoch1) == list(range(40)) and epoch1 != epoch0
    assert stream.epoch == 1
    same = sum(_take(PromptStream(files, batch_size=8, seed=1, shuffle_buffer=6), 5), [])
    other = sum(_take(PromptStream(files, batch_size=8, seed=2, shuffle_buffer=6), 5), [])
    assert same == epoch0 and other != epoch0


def test_rows_carry_their_source(files):
    row = next(iter(PromptStream(files, batch_size=1, shuffle=False)))[0]
    assert row["_source"] == {"file": files[0], "row": 0}
    assert row["extra_info"]["tools"] == {"name": "python", "max_turns": 2}  # nested structs pass through


def test_data_parallel_ranks_are_disjoint_and_cover_the_epoch(files):
    ranks = [sum(_take(PromptStream(files, batch_size=4, seed=3, dp_rank=r, dp_size=2), 5), []) for r in (0, 1)]
    assert not set(ranks[0]) & set(ranks[1])
    assert sorted(ranks[0] + ranks[1]) == list(range(40))


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_resume_continues_exactly_across_an_epoch_boundary(files, dp_rank):
    kwargs = dict(batch_size=6, seed=5, dp_rank=dp_rank, dp_size=2, shuffle_buffer=4)
    uninterrupted = _take(PromptStream(files, **kwargs), 8)
    first = PromptStream(files, **kwargs)
    head = _take(first, 3)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PromptStream(files, **kwargs)
    resumed.load_state_dict(state)
    assert head + _take(resumed, 5) == uninterrupted  # 20 rows per rank per epoch: batch 4 crosses it


def test_missing_column_names_file_and_column(tmp_path):
    path = tmp_path / "bad.parquet"
    rows = [{k: v for k, v in r.items() if k != "prompt"} for r in _rows(0, 3)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=r"bad\.parquet: missing column 'prompt'"):
        PromptStream([str(path)], batch_size=1)


def test_bad_row_names_file_and_row_or_is_skipped_and_counted(tmp_path):
    rows = _rows(0, 4)
    table = pa.Table.from_pylist(rows)
    prompts = [[] if i == 2 else r["prompt"] for i, r in enumerate(rows)]
    empty = pa.array(prompts, type=table.schema.field("prompt").type)
    path = tmp_path / "rows.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("prompt"), "prompt", empty), path)
    with pytest.raises(DataError, match=r"rows\.parquet row 2: key 'prompt' must be a non-empty list"):
        next(iter(PromptStream([str(path)], batch_size=4, shuffle=False)))
    stream = PromptStream([str(path)], batch_size=3, shuffle=False, on_bad_row="skip")
    assert _ids(next(iter(stream))) == [0, 1, 3]
    assert stream.stats()["bad_rows_skipped"] == 1


def test_rows_with_images_are_refused_until_vision_models_exist(tmp_path):
    rows = [dict(r, images=[]) for r in _rows(0, 4)]
    rows[1]["images"] = [{"bytes": b"\x89PNG fake", "path": None}]
    path = tmp_path / "vision.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=r"vision\.parquet row 1: key 'images' holds 1 image\(s\).*text-only"):
        next(iter(PromptStream([str(path)], batch_size=4, shuffle=False)))
    stream = PromptStream([str(path)], batch_size=3, shuffle=False, on_bad_row="skip")
    assert _ids(next(iter(stream))) == [0, 2, 3]  # empty image lists are text rows
    assert stream.skipped() == {"bad_rows": 1, "filtered": 0}


def test_prompt_that_is_a_string_names_the_file(tmp_path):
    rows = [dict(r, prompt="just text") for r in _rows(0, 2)]
    path = tmp_path / "text.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=r"text\.parquet: column 'prompt' has type string"):
        PromptStream([str(path)], batch_size=1)


def test_unreadable_file_is_named(tmp_path):
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"corrupt\.parquet: cannot be read as parquet"):
        PromptStream([str(path)], batch_size=1)
    with pytest.raises(DataError, match="no such file"):
        PromptStream([str(tmp_path / "missing.parquet")], batch_size=1)


def test_filter_drops_and_counts(files):
    even = lambda r: int(r["reward_model"]["ground_truth"]) % 2 == 0
    stream = PromptStream(files, batch_size=5, shuffle=False, filter_fn=even)
    assert _ids(next(iter(stream))) == [0, 2, 4, 6, 8]
    assert stream.stats()["rows_filtered"] >= 4


def test_scan_data_sources_and_directories(tmp_path):
    pq.write_table(pa.Table.from_pylist(_rows(0, 3) + _rows(3, 2, "codegen__x")), tmp_path / "a.parquet")
    assert scan_data_sources(str(tmp_path)) == {"math__t", "codegen__x"}


def test_renderer_uses_chat_template_and_length(tmp_path):
    from rl360.quickstart.assets import build_tokenizer

    tokenizer = build_tokenizer(tmp_path / "tok")
    renderer = PromptRenderer(tokenizer, max_prompt_length=11)
    ids = renderer.render([{"role": "user", "content": "7+2"}])
    assert tokenizer.decode(ids) == "<|im_start|>user\n7+2<|im_end|>\n<|im_start|>assistant\n"
    assert renderer.fits({"prompt": [{"role": "user", "content": "7+2"}]})
    assert not renderer.fits({"prompt": [{"role": "user", "content": "7+2+3"}]})


def test_resume_in_a_fresh_process_matches_an_uninterrupted_run(files, tmp_path):
    """Stop after k batches, save the state, load it in a new Python process: same following batches,
    across an epoch boundary, for each of 2 data-parallel ranks."""
    import subprocess
    import sys

    script = (
        "import json, sys\n"
        "from rl360.data import PromptStream\n"
        "files, rank, state_path, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]\n"
        "stream = PromptStream(files, batch_size=6, seed=9, dp_rank=rank, dp_size=2, shuffle_buffer=5)\n"
        "stream.load_state_dict(json.load(open(state_path)))\n"
        "it = iter(stream)\n"
        "json.dump([[int(r['reward_model']['ground_truth']) for r in next(it)] for _ in range(5)], open(out, 'w'))\n"
    )
    for rank in (0, 1):
        kwargs = {"batch_size": 6, "seed": 9, "dp_rank": rank, "dp_size": 2, "shuffle_buffer": 5}
        uninterrupted = _take(PromptStream(files, **kwargs), 7)
        first = PromptStream(files, **kwargs)
        _take(first, 2)
        state_path = tmp_path / f"state{rank}.json"
        state_path.write_text(json.dumps(first.state_dict()))
        out = tmp_path / f"after{rank}.json"
        subprocess.run([sys.executable, "-c", script, json.dumps(files), str(rank), str(state_path), str(out)],
                       check=True, cwd=str(tmp_path))
        assert json.loads(out.read_text()) == uninterrupted[2:]  # 20 rows per rank per epoch: crosses it
