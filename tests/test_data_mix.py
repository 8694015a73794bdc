"""MixedPromptStream: proportions by weight, determinism, exact resume, mixing by data_source prefix."""

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl360.data import DataError, MixedPromptStream

SIZES = {"math__a": 30, "codegen__b": 12, "logic__c": 50}


def _rows(source, count):
    return [{
        "data_source": source,
        "prompt": [{"role": "user", "content": f"{source} q{i}"}],
        "ability": source.split("__")[0],
        "reward_model": {"style": "rule", "ground_truth": f"{source}:{i}"},
        "extra_info": {"split": "train", "index": i},
    } for i in range(count)]


def _write(path, rows, row_group_size=7):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return str(path)


@pytest.fixture
def groups(tmp_path):
    return {source.split("__")[0]: _write(tmp_path / f"{source}.parquet", _rows(source, count))
            for source, count in SIZES.items()}


def _ids(batch):
    return [row["reward_model"]["ground_truth"] for row in batch]


def _take(stream, batches):
    return [_ids(next(stream)) for _ in range(batches)]


def _domain(row_id):
    return row_id.split("__")[0]


WEIGHTS = {"math": 0.5, "codegen": 0.3, "logic": 0.2}


def test_batches_hold_the_sources_in_proportion(groups):
    stream = MixedPromptStream(groups, WEIGHTS, batch_size=10, seed=0)
    batches = _take(stream, 200)
    for batch in batches:  # 10 rows split 5/3/2 exactly: the schedule is within one row of the shares
        assert Counter(_domain(i) for i in batch) == {"math": 5, "codegen": 3, "logic": 2}
    uneven = MixedPromptStream(groups, {"math": 1, "codegen": 1, "logic": 1}, batch_size=8, seed=0)
    totals = Counter()
    for n, batch in enumerate(_take(uneven, 300), start=1):
        counts = Counter(_domain(i) for i in batch)
        assert all(abs(counts[name] - 8 / 3) < 2 for name in WEIGHTS)
        totals.update(counts)
        assert all(abs(totals[name] - 8 * n / 3) <= 1 for name in WEIGHTS)
    assert stream.stats()["codegen/rows_taken"] == 600


def test_each_source_cycles_through_its_own_epochs(groups):
    stream = MixedPromptStream(groups, WEIGHTS, batch_size=10, seed=3)
    taken = sum(_take(stream, 12), [])  # 36 codegen rows: three epochs of its 12
    codegen = [i for i in taken if i.startswith("codegen")]
    assert len(codegen) == 36
    for epoch in range(3):
        assert sorted(codegen[12 * epoch:12 * (epoch + 1)]) == sorted(f"codegen__b:{i}" for i in range(12))
    # an epoch counter moves on when the next row is asked for: 36 rows end epoch 2 of codegen
    assert stream.epochs() == {"codegen": 2, "logic": 0, "math": 1} and stream.epoch == 0


def test_same_seed_same_batches_other_seed_other_batches(groups):
    first = _take(MixedPromptStream(groups, WEIGHTS, batch_size=6, seed=11), 20)
    assert _take(MixedPromptStream(groups, WEIGHTS, batch_size=6, seed=11), 20) == first
    assert _take(MixedPromptStream(groups, WEIGHTS, batch_size=6, seed=12), 20) != first


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_resume_in_a_fresh_stream_continues_exactly(groups, dp_rank):
    kwargs = dict(batch_size=7, seed=5, dp_rank=dp_rank, dp_size=2, shuffle_buffer=4)
    whole = MixedPromptStream(groups, WEIGHTS, **kwargs)
    uninterrupted = _take(whole, 40)  # several epochs of every source
    first = MixedPromptStream(groups, WEIGHTS, **kwargs)
    head = _take(first, 13)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = MixedPromptStream(groups, WEIGHTS, **kwargs)
    resumed.load_state_dict(state)
    assert head + _take(resumed, 27) == uninterrupted
    assert resumed.stats() == whole.stats()  # counts and epochs carry over the restart


def test_resume_refuses_other_weights_but_accepts_another_batch_size(groups):
    stream = MixedPromptStream(groups, WEIGHTS, batch_size=10)
    _take(stream, 3)
    state = stream.state_dict()
    with pytest.raises(ValueError, match="'weights'"):
        MixedPromptStream(groups, {"math": 0.4, "codegen": 0.4, "logic": 0.2}, batch_size=10).load_state_dict(state)
    rest = _take(stream, 2)
    bigger = MixedPromptStream(groups, WEIGHTS, batch_size=20)
    bigger.load_state_dict(state)
    assert _take(bigger, 1) == [rest[0] + rest[1]]  # the schedule is per row, not per batch


def test_by_data_source_splits_shared_files_by_longest_prefix(tmp_path):
    mixed = _rows("math__a", 20) + _rows("math__b", 20) + _rows("codegen__b", 10)
    paths = [_write(tmp_path / "mixed.parquet", mixed), _write(tmp_path / "logic.parquet", _rows("logic__c", 9))]
    weights = {"math": 1.0, "math__b": 1.0, "codegen": 1.0, "logic": 1.0}
    stream = MixedPromptStream.by_data_source(paths, weights, batch_size=8, seed=2)
    assert stream.names == ["codegen", "logic", "math", "math__b"]
    assert stream.streams["logic"].files == [paths[1]] and stream.streams["math"].files == [paths[0]]
    for batch in _take(stream, 30):
        assert Counter(i.split(":")[0] for i in batch) == {"math__a": 2, "math__b": 2, "codegen__b": 2, "logic__c": 2}
    stats = stream.stats()
    assert stats["math/rows_not_selected"] > 0  # other sources' rows of the shared file are passed over,
    assert stats["math/rows_filtered"] == 0 and stream.skipped() == {"bad_rows": 0, "filtered": 0}  # not "skipped"


def test_mixed_stream_counts_each_skipped_row_once(tmp_path):
    """A bad row of a file shared by two sources is skipped by its own source only; the length filter's drops
    add up over the sources."""
    rows = _rows("math__a", 10) + _rows("codegen__b", 10)
    rows[3]["prompt"] = []  # a bad math row
    rows[15]["reward_model"] = {"ground_truth": None}  # a bad codegen row
    path = _write(tmp_path / "mixed.parquet", rows)
    not_seven = lambda row: not row["data_source"].startswith("math") or row["extra_info"]["index"] != 7
    stream = MixedPromptStream.by_data_source(path, {"math": 1, "codegen": 1}, batch_size=4, on_bad_row="skip",
                                              shuffle=False, filter_fn=not_seven)
    taken = [i for batch in _take(stream, 4) for i in batch]  # 8 rows of each source, none twice
    assert len(set(taken)) == 16 and "math__a:3" not in taken and "math__a:7" not in taken
    assert stream.skipped() == {"bad_rows": 2, "filtered": 1}
    stats = stream.stats()
    assert stats["math/bad_rows_skipped"] == 1 and stats["codegen/bad_rows_skipped"] == 1


def test_by_data_source_weight_zero_leaves_rows_out_and_unknown_sources_fail(tmp_path):
    path = _write(tmp_path / "mixed.parquet", _rows("math__a", 10) + _rows("codegen__b", 10))
    only_math = MixedPromptStream.by_data_source(path, {"math": 1, "codegen": 0}, batch_size=5)
    assert all(i.startswith("math") for batch in _take(only_math, 6) for i in batch)
    with pytest.raises(DataError, match=r"\['codegen__b'\].*match no prefix"):
        MixedPromptStream.by_data_source(path, {"math": 1}, batch_size=5)
    with pytest.raises(DataError, match="no data_source .* belongs to prefix 'logic'"):
        MixedPromptStream.by_data_source(path, {"math": 1, "codegen": 1, "logic": 1}, batch_size=5)


def test_bad_arguments_are_named(groups):
    with pytest.raises(ValueError, match=r"only in weights: \['stem'\]"):
        MixedPromptStream(groups, {**WEIGHTS, "stem": 1}, batch_size=4)
    with pytest.raises(ValueError, match=r"weights\['math'\] = -1"):
        MixedPromptStream(groups, {**WEIGHTS, "math": -1}, batch_size=4)
    with pytest.raises(ValueError, match="all 0"):
        MixedPromptStream(groups, dict.fromkeys(WEIGHTS, 0), batch_size=4)


def test_a_bad_row_leaves_the_stream_at_the_start_of_its_batch(tmp_path):
    good = _write(tmp_path / "good.parquet", _rows("math__a", 10))
    rows = _rows("logic__c", 4)
    table = pa.Table.from_pylist(rows)
    prompts = pa.array([[] if i == 3 else r["prompt"] for i, r in enumerate(rows)],
                       type=table.schema.field("prompt").type)
    bad = tmp_path / "bad.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("prompt"), "prompt", prompts), bad)
    stream = MixedPromptStream({"math": good, "logic": str(bad)}, {"math": 1, "logic": 1}, batch_size=4,
                               shuffle=False)
    assert _take(stream, 1) == [["logic__c:0", "math__a:0", "logic__c:1", "math__a:1"]]
    before = stream.state_dict()
    for _ in range(2):
        with pytest.raises(DataError, match=r"bad\.parquet row 3"):
            next(stream)
        assert stream.state_dict() == before
