"""Several prompt sources mixed by weight into one stream of batches: deterministic and exactly resumable.

A source is either a group of files (`MixedPromptStream(groups, weights, ...)`) or the rows whose
`data_source` starts with a prefix (`MixedPromptStream.by_data_source(paths, weights, ...)`). Each source
is read by a PromptStream of its own (seeded shuffling, data-parallel sharding, epochs and resume as there),
one row at a time, and cycles through its epochs independently: a small source with a large weight is
repeated more often, a large one with a small weight is not exhausted.

The sources take turns by a fixed schedule, not by random draws: the next row comes from the source that
is furthest behind its share, i.e. the one with the largest `w_i * (n + 1) - taken_i` after n rows (ties go
to the first name in sorted order). After any n rows every source has given `w_i * n` rows to within one
row, so each batch holds the sources in proportion to their weights and each data-parallel rank (which
runs the same schedule) gets the same composition. The seed still decides which rows: each source shuffles
with its own seed derived from `seed` and its name.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rl360.data.schema import DataError
from rl360.data.stream import PromptStream, expand_paths, scan_data_sources

_STATE_VERSION = 1
RowFilter = Callable[[dict[str, Any]], bool]


@dataclass(frozen=True)
class _Source:
    name: str
    files: list[str]
    weight: float
    keep: RowFilter | None  # rows of other sources sharing the files are dropped by this


class MixedPromptStream:
    """An infinite iterator of batches (lists of row dicts) mixing several sources by weight.

    `groups` maps a source name to its files (paths, directories or globs, as for PromptStream) and
    `weights` maps the same names to non-negative weights (normalized to sum to 1; a weight of 0 leaves the
    source out). The other arguments mean what they mean for PromptStream; `filter_fn` applies to every
    source. Rows are those of PromptStream (with `_source`).
    """

    def __init__(self, groups: Mapping[str, str | list[str]], weights: Mapping[str, float], batch_size: int, *,
                 seed: int = 0, shuffle: bool = True, dp_rank: int = 0, dp_size: int = 1,
                 shuffle_buffer: int = 1024, on_bad_row: str = "error", filter_fn: RowFilter | None = None):
        missing, extra = sorted(set(weights) - set(groups)), sorted(set(groups) - set(weights))
        if missing or extra:
            raise ValueError(f"groups and weights must name the same sources; only in weights: {missing}, "
                             f"only in groups: {extra}")
        _check_weights(weights)
        sources = [_Source(name, expand_paths(groups[name]), float(weights[name]), None)
                   for name in sorted(weights) if weights[name] > 0]
        self._setup(sources, batch_size, seed, filter_fn, shuffle=shuffle, dp_rank=dp_rank, dp_size=dp_size,
                    shuffle_buffer=shuffle_buffer, on_bad_row=on_bad_row)

    @classmethod
    def by_data_source(cls, paths: str | list[str], weights: Mapping[str, float], batch_size: int, *,
                       seed: int = 0, shuffle: bool = True, dp_rank: int = 0, dp_size: int = 1,
                       shuffle_buffer: int = 1024, on_bad_row: str = "error",
                       filter_fn: RowFilter | None = None) -> MixedPromptStream:
        """Mix the rows of `paths` by `data_source` prefix: `weights` maps prefixes (e.g. "math", "codegen__taco")
        to weights, and each row belongs to the longest prefix its data_source starts with.

        Every data_source in the files must match a prefix (give a weight of 0 to leave rows out). A source
        reads only the files holding its data_sources (found by reading the data_source column once); where a
        file also holds other sources' rows, those are read and passed over (counted in its
        `rows_not_selected`, not in `rows_filtered`).
        """
        _check_weights(weights)
        prefixes = list(weights)
        files = expand_paths(paths)
        owners = {path: {source: _longest_prefix(prefixes, source) for source in scan_data_sources(path)}
                  for path in files}
        unmatched = sorted(source for found in owners.values() for source, owner in found.items() if owner is None)
        if unmatched:
            raise DataError(f"data_source(s) {unmatched} in {files} match no prefix of the weights "
                            f"{sorted(prefixes)}; give them a weight (0 leaves them out)")
        sources = []
        for prefix in sorted(p for p in prefixes if weights[p] > 0):
            mine = [path for path in files if prefix in owners[path].values()]
            if not mine:
                raise DataError(f"no data_source in {files} belongs to prefix {prefix!r} "
                                f"(data_sources found: {sorted({s for found in owners.values() for s in found})})")
            shared = any(owner != prefix for path in mine for owner in owners[path].values())
            keep = _PrefixRows(prefix, prefixes) if shared else None
            sources.append(_Source(prefix, mine, float(weights[prefix]), keep))
        mixed = cls.__new__(cls)
        mixed._setup(sources, batch_size, seed, filter_fn, shuffle=shuffle, dp_rank=dp_rank, dp_size=dp_size,
                     shuffle_buffer=shuffle_buffer, on_bad_row=on_bad_row)
        return mixed

    def _setup(self, sources: list[_Source], batch_size: int, seed: int, filter_fn: RowFilter | None,
               **options: Any) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}; it must be at least 1")
        self.batch_size, self.seed = batch_size, seed
        self.names = [source.name for source in sources]
        total = sum(source.weight for source in sources)
        self.weights = {source.name: source.weight / total for source in sources}
        self._raw_weights = {source.name: source.weight for source in sources}
        self.streams = {source.name: PromptStream(source.files, 1, seed=_source_seed(seed, source.name),
                                                  drop_last=False, filter_fn=filter_fn, select_fn=source.keep,
                                                  **options)
                        for source in sources}
        self._taken = dict.fromkeys(self.names, 0)

    # ----- public surface -------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The fewest epochs any source has completed (each source cycles on its own; see `epochs`)."""
        return min(self.epochs().values())

    def epochs(self) -> dict[str, int]:
        """The epoch each source's next row is taken from."""
        return {name: stream.epoch for name, stream in self.streams.items()}

    def stats(self) -> dict[str, int]:
        """Per source: `<name>/rows_taken` (rows it gave to batches) and its PromptStream stats as
        `<name>/rows_seen`, `<name>/rows_filtered`, `<name>/bad_rows_skipped`, `<name>/rows_not_selected`,
        `<name>/epoch`."""
        counts: dict[str, int] = {}
        for name, stream in self.streams.items():
            counts[f"{name}/rows_taken"] = self._taken[name]
            counts.update({f"{name}/{key}": value for key, value in stream.stats().items()})
        return counts

    def skipped(self) -> dict[str, int]:
        """Rows left out of batches, summed over the sources (see `PromptStream.skipped`)."""
        totals = {"bad_rows": 0, "filtered": 0}
        for stream in self.streams.values():
            for key, value in stream.skipped().items():
                totals[key] += value
        return totals

    def state_dict(self) -> dict[str, Any]:
        """A small JSON-serializable position: a fresh stream built alike that loads it yields the same batches."""
        return {"version": _STATE_VERSION, "weights": dict(self._raw_weights), "taken": dict(self._taken),
                "sources": {name: stream.state_dict() for name, stream in self.streams.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (from state_dict of a stream with the same sources, weights and order settings;
        the batch size may differ)."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"mixed data state version {state.get('version')!r}; this code reads {_STATE_VERSION}")
        if sorted(state["sources"]) != self.names:
            raise ValueError(f"mixed data state has sources {sorted(state['sources'])}, this stream has {self.names}")
        if state["weights"] != self._raw_weights:
            raise ValueError(f"mixed data state key 'weights' was {state['weights']} when saved, this stream has "
                             f"{self._raw_weights}; resuming would not continue the same schedule")
        for name, stream in self.streams.items():
            stream.load_state_dict(state["sources"][name])
        self._taken = {name: int(state["taken"][name]) for name in self.names}

    def __iter__(self) -> MixedPromptStream:
        return self

    def __next__(self) -> list[dict[str, Any]]:
        start = self.state_dict()
        try:
            return [self._next_row() for _ in range(self.batch_size)]
        except BaseException:  # a bad row or a failing filter_fn: the next call rebuilds the same batch
            self.load_state_dict(start)
            raise

    def close(self) -> None:
        """Release every source's open file and held row groups (iteration may go on)."""
        for stream in self.streams.values():
            stream.close()

    # ----- the schedule -----------------------------------------------------------------------------

    def next_source(self) -> str:
        """The name of the source the next row comes from (the one furthest behind its share)."""
        after = sum(self._taken.values()) + 1
        return max(self.names, key=lambda name: self.weights[name] * after - self._taken[name])

    def _next_row(self) -> dict[str, Any]:
        name = self.next_source()
        row = next(self.streams[name])[0]
        self._taken[name] += 1
        return row


class _PrefixRows:
    """Keeps the rows whose data_source's longest matching prefix (among `prefixes`) is `prefix`."""

    def __init__(self, prefix: str, prefixes: list[str]):
        self.prefix, self.prefixes = prefix, prefixes

    def __call__(self, row: dict[str, Any]) -> bool:
        return _longest_prefix(self.prefixes, row["data_source"]) == self.prefix


def _longest_prefix(prefixes: list[str], data_source: str) -> str | None:
    matches = [prefix for prefix in prefixes if data_source.startswith(prefix)]
    return max(matches, key=len) if matches else None


def _check_weights(weights: Mapping[str, float]) -> None:
    if not weights:
        raise ValueError("weights is empty: give at least one source a positive weight")
    for name, weight in weights.items():
        if not isinstance(weight, int | float) or isinstance(weight, bool) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"weights[{name!r}] = {weight!r}; a weight must be a finite number >= 0")
    if not any(weight > 0 for weight in weights.values()):
        raise ValueError(f"weights {dict(weights)} are all 0; at least one source needs a positive weight")


def _source_seed(seed: int, name: str) -> int:
    """A seed per source, so sources with the same layout do not shuffle alike."""
    return int(hashlib.sha256(f"rl360.mix:{seed}:{name}".encode()).hexdigest()[:12], 16)
