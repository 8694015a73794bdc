"""`rl360` command line: `rl360 train CONFIG [key=value ...]`, `rl360 sft CONFIG [key=value ...]`,
`rl360 quickstart [key=value ...]`,
`rl360 data inspect FILE...`, `rl360 reward check FILE.parquet --responses R.jsonl --out S.jsonl`,
`rl360 convert hf-to-megatron|megatron-to-hf ...`, `rl360 serve sandbox [--port N] [--api-key-env VAR]`,
`rl360 serve model --model DIR [--port N] [--api-key-env VAR]`,
`rl360 serve rollout --model DIR [--port N] [--api-key-env VAR]` (the serve options: `rl360 serve SERVICE -h`),
`rl360 eval CONFIG [key=value ...] [--model DIR]`, `rl360 view PATH [--port N] [--host H] [--api-key-env VAR]`,
`rl360 serve listener --model DIR`, `rl360 alternate SPEAKER_CONFIG LISTENER_CONFIG --rounds N` (the Lewis
game's two agents in turn).

A mistake the user can fix (a config key, a data row, a model directory, a flag: `rl360.errors.UserError`) ends
in one `rl360: error: ...` line and exit status 2; `rl360 --debug ...` or RL360_DEBUG=1 adds its traceback."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
QUICKSTART_CONFIG = CONFIGS / "quickstart.yaml"
# quickstart task -> its config and the overrides that set it apart
QUICKSTART_TASKS = {
    "arithmetic": (QUICKSTART_CONFIG, []),
    "vision": (CONFIGS / "quickstart_vision.yaml", []),
    "vision-control": (CONFIGS / "quickstart_vision.yaml",
                       ["data.train_files=[outputs/quickstart_assets/vision_control_data/train.parquet]",
                        "output_dir=outputs/quickstart_vision_control"]),
    "zoom": (CONFIGS / "quickstart_zoom.yaml", []),
    "zoom-control": (CONFIGS / "quickstart_zoom.yaml", ["agent.loop=''", "output_dir=outputs/quickstart_zoom_control"]),
    "tools": (CONFIGS / "quickstart_tools.yaml", []),
    "tools-control": (CONFIGS / "quickstart_tools.yaml",
                      ["agent.loop=''", "output_dir=outputs/quickstart_tools_control"]),
    "lewis": (CONFIGS / "quickstart_lewis_speaker.yaml", []),  # and quickstart_lewis_listener.yaml: two agents
    "sft": (CONFIGS / "sft_tools.yaml", []),  # `rl360 sft` on traces of the tools task
}
LEWIS_LISTENER_CONFIG = CONFIGS / "quickstart_lewis_listener.yaml"
LEWIS_OUT = "outputs/quickstart_lewis"


def _train(args: argparse.Namespace) -> int:
    from rl360.config import load_config
    from rl360.run_checks import check_run

    cfg = load_config(args.config, args.overrides)
    checked = check_run(cfg)  # a mistake is answered before the trainer's modules (seconds) are imported

    from rl360.trainer import train

    out = train(cfg, checked)
    print(f"done: metrics in {out / 'metrics.jsonl'}" + (f", model in {out / 'hf'}" if cfg.trainer.save_hf else ""))
    return 0


def _sft(args: argparse.Namespace) -> int:
    from rl360.config import load_config

    cfg = load_config(args.config, args.overrides, command="sft")

    from rl360.sft import check_sft, sft

    check_sft(cfg)  # a mistake (a path, a data row, a resume's change) is answered before Ray starts
    out = sft(cfg, latest_checked=True)
    print(f"done: metrics in {out / 'metrics.jsonl'}" + (f", model in {out / 'hf'}" if cfg.trainer.save_hf else ""))
    return 0


def _quickstart(args: argparse.Namespace) -> int:
    """Make the tiny model, tokenizer and task locally, then train on them with the task's config."""
    from rl360.config import load_config

    config, task_overrides = QUICKSTART_TASKS[args.task]
    if args.task == "lewis":
        return _quickstart_lewis(str(args.config or config), args.overrides)
    if args.task == "sft":
        return _quickstart_sft(str(args.config or config), args.overrides)
    cfg = load_config(args.config or config, [*task_overrides, *args.overrides])

    from rl360.quickstart.prepare import prepare_quickstart
    from rl360.trainer import train

    prepare_quickstart(cfg, args.task)
    out = train(cfg)
    print(f"done: metrics in {out / 'metrics.jsonl'}, model in {out / 'hf'}")
    return 0


def _quickstart_sft(config: str, overrides: list[str]) -> int:
    """The tools quickstart's model fine-tuned on traces of its task (the call, the tool's reply, the answer)."""
    from rl360.config import load_config
    from rl360.quickstart.prepare import prepare_sft_quickstart
    from rl360.sft import sft

    cfg = load_config(config, overrides, command="sft")
    prepare_sft_quickstart(cfg)
    out = sft(cfg)
    print(f"done: metrics in {out / 'metrics.jsonl'}, model in {out / 'hf'}; RL from it: rl360 train "
          f"configs/quickstart_tools.yaml model.path={out / 'hf'} output_dir=outputs/quickstart_tools_from_sft")
    return 0


def _quickstart_lewis(speaker_config: str, overrides: list[str]) -> int:
    """The Lewis game: build both tiny agents and the games, then one round of `rl360 alternate`, the listener
    first (it learns to match descriptions to captions), then the speaker against it; `overrides` go to both."""
    from rl360.alternate import alternate
    from rl360.config import load_config
    from rl360.quickstart.prepare import prepare_lewis_quickstart

    listener_config = str(LEWIS_LISTENER_CONFIG)
    prepare_lewis_quickstart(load_config(speaker_config, overrides), load_config(listener_config, overrides))
    # the speaker's rewards wait on the listener: 8 reward workers keep 8 games in flight, which the service
    # scores together (32 candidates a forward)
    done = alternate(speaker_config, listener_config, 1, LEWIS_OUT, "listener", overrides, overrides,
                     listener_options=["--max-batch", "32"])
    print(f"done: metrics in {done[-1] / 'metrics.jsonl'} (reward/accuracy_sampled: the listener's accuracy on the "
          f"speaker's messages), models in {done[0] / 'hf'} and {done[-1] / 'hf'}")
    return 0


def _version() -> str:
    """The installed package's version (its metadata), else the source tree's `rl360.__version__`."""
    from importlib.metadata import PackageNotFoundError, version

    import rl360

    try:
        return version("rl360")
    except PackageNotFoundError:
        return rl360.__version__


def _add_data_parser(commands) -> None:
    from rl360.data.inspect import add_inspect_parser

    data = commands.add_parser("data", help="look at prompt parquet files")
    add_inspect_parser(data.add_subparsers(dest="data_command", required=True), reward_of=_reward_of)


def _reward_of(data_source: str) -> str | None:
    """The reward function that scores `data_source` ("module:function"), or None when none does."""
    from rl360.rewards.registry import UnknownDataSource, find_route

    try:
        return find_route(data_source).ref
    except UnknownDataSource:
        return None


# the commands whose parsers live in their own modules, each module imported only when its command runs (or for
# `rl360 --help` and a command not among these)
COMMAND_PARSERS = {
    "data": "rl360.cli:_add_data_parser",
    "reward": "rl360.rewards.check:add_reward_parser",
    "convert": "rl360.convert:add_convert_parser",
    "serve": "rl360.serve:add_serve_parser",
    "plan": "rl360.plan:add_plan_parser",
    "launch": "rl360.launch:add_launch_parser",
    "alternate": "rl360.alternate:add_alternate_parser",
    "eval": "rl360.eval:add_eval_parser",
    "view": "rl360.view:add_view_parser",
}


def _command_named(argv: list[str]) -> str | None:
    """The command of `argv` (its first word not an option): a name of COMMAND_PARSERS, "" for `train`, `sft` and
    `quickstart` (which need none of them), None otherwise (every parser is added: help, or a misspelt command
    answered with the whole list)."""
    word = next((arg for arg in argv if not arg.startswith("-")), None)
    return word if word in COMMAND_PARSERS else "" if word in ("train", "sft", "quickstart") else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if next((arg for arg in argv if not arg.startswith("-")), None) in ("train", "quickstart", "sft"):
        from rl360.stopping import hold_early_signals

        hold_early_signals()  # a stop signal while starting stops the run before its first step, not mid-import
    from rl360.tracking.console import plain_when_piped, quiet_known_warnings

    quiet_known_warnings()  # before megatron is imported, here and in every process started from here
    plain_when_piped()
    wanted = _command_named(argv)
    parser = argparse.ArgumentParser(prog="rl360", description="RL post-training for language models")
    parser.add_argument("--version", action="version", version=f"rl360 {_version()}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a user error too (also: RL360_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="run RL training from a YAML config")
    train.add_argument("config", help="YAML config, e.g. configs/quickstart.yaml")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=10")
    train.set_defaults(run=_train)

    tune = commands.add_parser("sft", help="supervised fine-tuning on conversations (parquet or jsonl) from a YAML "
                                           "config")
    tune.add_argument("config", help="YAML config, e.g. configs/sft_tools.yaml")
    tune.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=10")
    tune.set_defaults(run=_sft)

    quick = commands.add_parser("quickstart", help="build the tiny CPU model and task, then train on them")
    quick.add_argument("overrides", nargs="*", help="key=value overrides of the task's config")
    quick.add_argument("--task", choices=sorted(QUICKSTART_TASKS), default="arithmetic",
                       help="arithmetic (configs/quickstart.yaml); vision (configs/quickstart_vision.yaml: a tiny "
                            "Qwen2.5-VL names an image's main colour); vision-control (the same, images blanked); "
                            "tools (configs/quickstart_tools.yaml: a tiny Qwen2 learns to call python for a*b%%7 "
                            "and repeat its answer); tools-control (the same, tools off); zoom "
                            "(configs/quickstart_zoom.yaml: a tiny Qwen2.5-VL learns to zoom in to read a mark only "
                            "a crop shows); "
                            "zoom-control (the same, no tool); lewis (configs/quickstart_lewis_*.yaml: a tiny listener "
                            "learns to match colour words to captions, then a tiny Qwen2.5-VL speaker learns to name "
                            "the target's colour for it); sft (configs/sft_tools.yaml: the tools task's tiny Qwen2 "
                            "fine-tuned on traces of the task, ready for RL)")
    quick.add_argument("--config", default=None, help="config to use instead of the task's")
    quick.set_defaults(run=_quickstart)

    for name, reference in COMMAND_PARSERS.items():
        if wanted in (None, name):  # only the command run: importing another's module can take seconds
            module, function = reference.split(":")
            getattr(importlib.import_module(module), function)(commands)

    args = parser.parse_args(argv)
    from rl360.errors import run_command

    return run_command(args.run, args, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
