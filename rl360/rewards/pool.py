"""Score many responses in worker processes, each call under a wall-clock timeout.

A call past its timeout scores 0, counts as a timeout, and its worker is killed and replaced; an
exception scores 0 with the error kept; a worker that dies (os._exit, segfault, out of memory) scores 0
with an error and is replaced. Results come back in input order. Workers start from a "forkserver", a
clean single-threaded process: safe under Ray actors, pytest and threads, and cheaper than "spawn" to
replace a killed worker.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from rl360.rewards.registry import reward_ref

_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["rl360.rewards"])


@dataclass
class RewardItem:
    data_source: str
    solution_str: str
    ground_truth: str
    extra_info: dict | None = None


@dataclass
class RewardResult:
    score: float
    timed_out: bool = False
    error: str | None = None
    extras: dict = field(default_factory=dict)


def _domain(data_source: str) -> str:
    return data_source.split("__", 1)[0]


def score_one(ref: str, item: RewardItem) -> RewardResult:
    """Run one reward call in this process; exceptions become a 0 score with the error."""
    from rl360.rewards.registry import resolve

    try:
        value = resolve(ref)(item.solution_str, item.ground_truth, item.extra_info)
    except Exception as err:  # the reward function's failure, kept and counted
        return RewardResult(0.0, error=f"{type(err).__name__}: {err}")
    if isinstance(value, dict):
        if "score" not in value:
            return RewardResult(0.0, error=f"reward function {ref} returned a dict without 'score'")
        extras = {k: v for k, v in value.items() if k != "score"}
        return RewardResult(float(value["score"]), extras=extras)
    return RewardResult(float(value))


def _worker_main(conn: Connection, max_memory_bytes: int | None) -> None:
    if max_memory_bytes:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (max_memory_bytes, max_memory_bytes))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        ref, item = message
        try:
            result = score_one(ref, item)
        except BaseException as err:  # MemoryError and the like: report, then go on
            result = RewardResult(0.0, error=f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=3)}")
        conn.send(result)


class _Worker:
    def __init__(self, max_memory_bytes: int | None):
        self.conn, child = _CONTEXT.Pipe()
        self.process = _CONTEXT.Process(target=_worker_main, args=(child, max_memory_bytes), daemon=True)
        self.process.start()
        child.close()
        self.task: int | None = None
        self.started = 0.0

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class RewardPool:
    """`num_workers` processes; `score(items)` returns one `RewardResult` per item, in order.

    `num_workers=0` scores in this process, sequentially and without a timeout (for debugging).
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, max_memory_bytes: int | None = None):
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.max_memory_bytes = max_memory_bytes
        self._workers = [_Worker(max_memory_bytes) for _ in range(num_workers)]
        self.totals: dict[str, float] = {}
        self._last: dict[str, float] = {}

    def score(self, items: list[RewardItem]) -> list[RewardResult]:
        refs = [reward_ref(item.data_source) for item in items]
        if self.num_workers == 0:
            results = [score_one(ref, item) for ref, item in zip(refs, items)]
        else:
            results = self._score_in_workers(refs, items)
        self._count(items, results)
        return results

    def _score_in_workers(self, refs: list[str], items: list[RewardItem]) -> list[RewardResult | None]:
        results: list[RewardResult | None] = [None] * len(items)
        queue = list(range(len(items)))[::-1]
        while queue or any(w.task is not None for w in self._workers):
            for index, worker in enumerate(self._workers):
                if worker.task is None and queue:
                    task = queue.pop()
                    try:
                        worker.conn.send((refs[task], items[task]))
                    except (BrokenPipeError, OSError):
                        results[task] = RewardResult(0.0, error="reward worker died before the call")
                        self._replace(index)
                        continue
                    worker.task, worker.started = task, time.monotonic()
            busy = [w for w in self._workers if w.task is not None]
            if not busy:
                continue
            deadline = min(w.started for w in busy) + self.timeout_s
            ready = wait([w.conn for w in busy], timeout=max(0.0, deadline - time.monotonic()))
            for index, worker in enumerate(self._workers):
                if worker.task is None:
                    continue
                if worker.conn in ready:
                    try:
                        results[worker.task] = worker.conn.recv()
                        worker.task = None
                    except (EOFError, OSError):
                        code = worker.process.exitcode
                        results[worker.task] = RewardResult(0.0, error=f"reward worker died (exit code {code})")
                        self._replace(index)
                elif time.monotonic() - worker.started >= self.timeout_s:
                    results[worker.task] = RewardResult(
                        0.0, timed_out=True, error=f"timed out after {self.timeout_s:g} s")
                    self._replace(index)
        return results

    def _replace(self, index: int) -> None:
        self._workers[index].kill()
        self._workers[index] = _Worker(self.max_memory_bytes)

    def _count(self, items: list[RewardItem], results: list[RewardResult]) -> None:
        last: dict[str, float] = {"reward/calls": len(results), "reward/timeouts": 0, "reward/errors": 0}
        for item, result in zip(items, results):
            domain = _domain(item.data_source)
            kind = "timeouts" if result.timed_out else "errors" if result.error else None
            if kind:
                last[f"reward/{kind}"] += 1
                last[f"reward/{kind}/{domain}"] = last.get(f"reward/{kind}/{domain}", 0) + 1
        self._last = last
        for key, value in last.items():
            self.totals[key] = self.totals.get(key, 0) + value

    def last_metrics(self) -> dict[str, float]:
        """Counts of the last `score` call: calls, timeouts and errors, also per domain."""
        return dict(self._last)

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
            worker.process.join(timeout=1)
            if worker.process.is_alive():
                worker.kill()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
