"""`rl360 eval CONFIG [key=value ...] [--model DIR]`: batch evaluation against inference endpoints.

Prompts from parquet or jsonl (`rl360.eval.inputs`), n samples each from OpenAI-compatible or SGLang-protocol
endpoints, or from the rollout layer's engine fleet started on a model directory (`rl360.eval.targets`), sent
with bounded concurrency, least-loaded dispatch, retries and resume (`rl360.eval.runner`), scored through the
reward pool and optionally an LLM re-judge (`rl360.eval.scoring`), summarised as accuracy, pass@k and maj@k
(`rl360.eval.metrics`). The config: `rl360.eval.config.EvalConfig`; the guide: docs/eval.md. A training run's
held-out evaluation is the same runner and report on the run's own sampler (`rl360.eval.during_training`).
"""


import argparse


def add_eval_parser(commands) -> None:
    parser = commands.add_parser("eval", help="evaluate a model or endpoints on parquet / jsonl prompts")
    parser.add_argument("config", help="YAML eval config, e.g. configs/eval/quickstart.yaml")
    parser.add_argument("overrides", nargs=argparse.REMAINDER,
                        help="key=value overrides, e.g. sampling.n=8 eval.concurrency=32 (--model DIR may come "
                             "among them)")
    parser.add_argument("--model", default="", help="start engine servers on this model directory (eval.model)")
    parser.set_defaults(run=_run)


def _run(args) -> int:
    from rl360.eval.command import run_eval
    from rl360.eval.config import load_eval_config

    overrides, model, rest = [], args.model, list(args.overrides)
    while rest:  # --model DIR after the config, among the overrides
        item = rest.pop(0)
        if item == "--model" or item.startswith("--model="):
            if item == "--model" and not rest:
                raise SystemExit("rl360 eval: --model needs a model directory")
            model = rest.pop(0) if item == "--model" else item.split("=", 1)[1]
        else:
            overrides.append(item)
    overrides += [f"eval.model={model}"] if model else []
    config = args.config
    if "=" in config:  # no config file: the first argument is an override
        config, overrides = None, [config, *overrides]
    report = run_eval(load_eval_config(config, overrides))
    return 1 if report["unanswered"] else 0
