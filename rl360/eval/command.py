"""`rl360 eval`'s whole run: prompts read and their rewards checked, the missing samples sent, every sample
scored (and re-judged), `report.json`, `errors.jsonl` and a table written."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from rl360.config import ConfigError
from rl360.eval.config import EvalConfig, pass_ks
from rl360.eval.inputs import EvalPrompt, read_prompts
from rl360.eval.runner import RESULTS, Dispatcher, DispatchSettings, DispatchStats, check_run_identity, read_results
from rl360.eval.scoring import ERRORS, REPORT, build_report, rejudge, report_table, score_samples, write_report
from rl360.eval.targets import open_endpoints
from rl360.rewards.check import judge_configured
from rl360.rewards.judge import JudgeClient
from rl360.rewards.pool import open_reward_pool
from rl360.rewards.registry import Route, check_route


def check_routes(prompts: list[EvalPrompt], cfg: EvalConfig) -> dict[str, Route]:
    """Each distinct data_source (and reward_metric) routed to a reward before any request is sent."""
    routes: dict[str, Route] = {}
    seen: set[tuple[str, Any]] = set()
    for prompt in prompts:
        metric = prompt.extra_info.get("reward_metric")
        if (prompt.data_source, metric) in seen:
            continue
        seen.add((prompt.data_source, metric))
        try:
            route = check_route(prompt.data_source, metric, judge_configured(cfg.reward.judge),
                                "reward.judge.url and reward.judge.model")
        except KeyError as err:
            raise type(err)(f"{cfg.data.files} prompt {prompt.index}: {err}") from None
        routes[prompt.data_source if metric is None else f"{prompt.data_source} (reward_metric {metric})"] = route
    return routes


async def _send(cfg: EvalConfig, prompts: list[EvalPrompt], out: Path, done: dict) -> DispatchStats:
    endpoints = await open_endpoints(cfg)
    try:
        return await Dispatcher(DispatchSettings.of(cfg), endpoints, prompts, out).run(done)
    finally:
        for endpoint in endpoints:
            await endpoint.close()


def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    """Evaluate as `cfg` says; the report (also in <output_dir>/report.json)."""
    out = Path(cfg.output_dir)
    n = cfg.sampling.n
    prompts = read_prompts(cfg.data)
    routes = check_routes(prompts, cfg)
    client = None
    if cfg.rejudge:
        try:
            client = JudgeClient.from_config(cfg.judge)
        except ValueError as err:
            raise ConfigError(f"rejudge=true: {err}") from None
    check_run_identity(cfg, out)
    with open_reward_pool(cfg.reward, routes) as pool:
        done = read_results(out / RESULTS, len(prompts), n)
        missing = len(prompts) * n - len(done)
        print(f"eval: {len(prompts)} prompts x n={n}: {len(done)} samples in {out / RESULTS}, {missing} to send",
              flush=True)
        stats = asyncio.run(_send(cfg, prompts, out, done)) if missing else None
        results = read_results(out / RESULTS, len(prompts), n)
        groups = score_samples(prompts, results, n, pool.score)
    if client is not None:
        rejudge(groups, client)
    report = build_report(n, pass_ks(cfg), groups, client is not None)
    errors = write_report(out, report, groups)
    print(report_table(report), flush=True)
    if stats is not None:
        print(f"eval: {stats.sent} requests ({stats.retries} retries), {stats.tokens} tokens in {stats.seconds:.1f} s",
              flush=True)
    print(f"eval: report in {out / REPORT}, {errors} rule failures in {out / ERRORS}", flush=True)
    if report["unanswered"]:
        first = stats.failed[0][2] if stats and stats.failed else ""
        print(f"eval: {report['unanswered']} samples got no answer after every retry round (last error: {first}); "
              "run the same command again to send only those", file=sys.stderr, flush=True)
    return report
