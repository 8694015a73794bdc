"""`rl360 view PATH`: a local web page to browse a training run's dumped rollouts (`rl360.view.rollouts`), an
`rl360 eval` output (`rl360.view.evals`) or parquet files of any size (`rl360.view.parquet_rows`), paginated,
filtered, one row whole at a time; served on the service layer (`rl360.view.app`). The guide: docs/viewer.md."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rl360.errors import UserError

DEFAULT_PORT = 8360


def open_source(path: str | Path) -> Any:
    """The source PATH names: a parquet file or a directory of them, an eval output directory (results.jsonl),
    or a run directory (rollouts/); UserError when it is none of these."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"rl360 view: {path} does not exist")
    if path.is_file():
        if path.suffix != ".parquet":
            raise UserError(f"rl360 view: {path} is not a .parquet file; give a parquet file or a directory of them, "
                            "a run directory (with rollouts/) or an rl360 eval output directory (with results.jsonl)")
        from rl360.view.parquet_rows import ParquetSource

        return ParquetSource(path)
    from rl360.eval.runner import RESULTS
    from rl360.tracking.rollout_dump import ROLLOUT_DIR

    if (path / RESULTS).is_file():
        from rl360.view.evals import EvalSource

        return EvalSource(path)
    if (path / ROLLOUT_DIR).is_dir():
        from rl360.view.rollouts import RolloutSource

        return RolloutSource(path)
    if next(path.rglob("*.parquet"), None) is not None:
        from rl360.view.parquet_rows import ParquetSource

        return ParquetSource(path)
    evaluated = sorted(step.parent for where in (path, path / "eval") for step in where.glob(f"step_*/{RESULTS}"))
    hint = (f"; its held-out evaluations are rl360 eval outputs: rl360 view {evaluated[-1]} (of "
            f"{', '.join(p.name for p in evaluated)})" if evaluated else "")
    raise UserError(f"rl360 view: {path} holds no rollouts/ (train with trainer.dump_rollouts_every=N), no "
                    f"{RESULTS} (an rl360 eval output) and no *.parquet files{hint}")


def _view(args: argparse.Namespace) -> int:
    from rl360.service.app import ServiceGuard, run_service, service_options
    from rl360.view.app import viewer_app

    api_key, limits = service_options(args, "view", "anyone who reaches it can read the files it shows",
                                      command="view")
    source = open_source(args.path)
    guard = ServiceGuard("view", viewer_app(source), limits, api_key, browser_login=True)
    return run_service(guard, args.host, args.port,
                       f"rl360 view: {source.kind} {args.path} ({source.info()['total']} rows) on {{url}}",
                       access_log=args.access_log)


def add_view_parser(commands) -> None:
    from rl360.service.app import ServiceLimits, add_service_arguments

    parser = commands.add_parser("view", help="browse rollouts, eval results or parquet files in a web page")
    parser.add_argument("path", help="a run directory (rollouts/), an rl360 eval output directory, or parquet "
                                     "file(s)")
    add_service_arguments(parser, port=DEFAULT_PORT, defaults=ServiceLimits(request_timeout_s=120.0))
    parser.set_defaults(run=_view)
