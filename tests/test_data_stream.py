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


def test_rows_with_images_stream_their_bytes_and_bad_items_are_named(tmp_path):
    png = _png(30, 20)
    rows = [dict(r, images=[]) for r in _rows(0, 4)]
    rows[1]["images"] = [{"bytes": png, "path": None}, {"bytes": None, "path": "pics/a.png"}]
    rows[2]["images"] = [{"bytes": None, "path": None}]
    path = tmp_path / "vision.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=r"vision\.parquet row 2: key 'images'\[0\] has neither bytes nor a path"):
        next(iter(PromptStream([str(path)], batch_size=4, shuffle=False)))
    stream = PromptStream([str(path)], batch_size=3, shuffle=False, on_bad_row="skip")
    batch = next(iter(stream))
    assert _ids(batch) == [0, 1, 3] and stream.skipped() == {"bad_rows": 1, "filtered": 0}
    assert batch[1]["images"] == [{"bytes": png, "path": None}, {"bytes": None, "path": "pics/a.png"}]
    assert batch[0]["images"] == []  # empty image lists are text rows


def _png(width, height):
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


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


# ----- memory: a 1 GB file of image rows ---------------------------------------------------------------------

STREAM_GB_BYTES = 1 << 30
MEMORY_GROWTH_LIMIT = 300 << 20
_STREAM_AND_MEASURE = """\
import json, sys
from rl360.data import PromptStream

def status(key):
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(key + ":"))

path, shuffle = sys.argv[1], sys.argv[2] == "1"
stream = PromptStream([path], batch_size=32, seed=0, shuffle=shuffle, drop_last=False)  # default shuffle buffer
base = status("VmRSS")
seen, tagged, total = set(), 0, 0
while len(seen) < stream.num_rows and stream.epoch == 0:
    for row in next(stream):
        index = int(row["reward_model"]["ground_truth"])
        data = row["images"][0]["bytes"]
        tagged += data.rfind(b"rl360\\0%d:" % index) > 0  # the row's own image came with it
        seen.add(index)
        total += len(data)
print(json.dumps({"rows": len(seen), "num_rows": stream.num_rows, "tagged": tagged, "bytes": total,
                  "growth": status("VmHWM") - base}))
"""


def _noise_png(rng, side):
    import io

    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(out, format="PNG", compress_level=0)
    return out.getvalue()


def _tagged_png(png, text):
    """`png` with a tEXt chunk holding `text` before its IEND chunk: still a valid image, and unique per row."""
    import struct
    import zlib

    chunk = b"tEXt" + b"rl360\0" + text
    return png[:-12] + struct.pack(">I", len(chunk) - 4) + chunk + struct.pack(">I", zlib.crc32(chunk)) + png[-12:]


def _write_image_rows(path, total_bytes, rows_per_group=64):
    """Rows of one ~95 KB random-noise PNG each (8 distinct noise images, each row's copy tagged with its own
    index and random bytes) until the images hold `total_bytes`; no compression or dictionary, so the file is
    as large as its images. Returns the number of rows."""
    import os

    import numpy as np

    rng = np.random.default_rng(0)
    noise = [_noise_png(rng, 180) for _ in range(8)]
    schema = pa.schema([("data_source", pa.string()),
                        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
                        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())])))])
    written = rows = 0
    with pq.ParquetWriter(path, schema, compression="none", use_dictionary=False) as writer:
        while written < total_bytes:
            indices = range(rows, rows + rows_per_group)
            images = [_tagged_png(noise[i % 8], f"{i}:{os.urandom(8).hex()}".encode()) for i in indices]
            writer.write_table(pa.table({
                "data_source": ["math__noise"] * rows_per_group,
                "prompt": [[{"role": "user", "content": f"<image>What is shown in picture {i}?"}] for i in indices],
                "reward_model": [{"style": "rule", "ground_truth": str(i)} for i in indices],
                "images": [[{"bytes": data, "path": None}] for data in images]}, schema=schema))
            written += sum(map(len, images))
            rows += rows_per_group
    return rows


@pytest.mark.parametrize("shuffle", [True, False])
def test_streaming_a_1gb_file_of_image_rows_keeps_memory_bounded(tmp_path, shuffle):
    """MEMORY (about 10 s): a 1 GB parquet file of image rows streams whole, every row with its own image, while
    the streaming process grows by less than 300 MB (held: the shuffle buffer's rows and a row group, of
    compressed images). Skipped only where the disk has no room for the file."""
    import shutil
    import subprocess
    import sys

    if shutil.disk_usage(tmp_path).free < 2 * STREAM_GB_BYTES:
        pytest.skip(f"needs 2 GB free under {tmp_path} for the 1 GB file")
    path = tmp_path / "images.parquet"
    try:
        rows = _write_image_rows(path, STREAM_GB_BYTES)
        assert path.stat().st_size > STREAM_GB_BYTES
        done = subprocess.run([sys.executable, "-c", _STREAM_AND_MEASURE, str(path), "1" if shuffle else "0"],
                              capture_output=True, text=True, timeout=300, check=True)
    finally:
        path.unlink(missing_ok=True)
    found = json.loads(done.stdout)
    assert found["rows"] == found["num_rows"] == found["tagged"] == rows and found["bytes"] > STREAM_GB_BYTES
    assert found["growth"] < MEMORY_GROWTH_LIMIT, f"grew {found['growth'] / 2**20:.0f} MB streaming 1 GB"
