"""`rl360 alternate SPEAKER_CONFIG LISTENER_CONFIG --rounds N`: the Lewis game's two agents trained in turn.

    rl360 alternate configs/recipes/lewis_speaker.yaml configs/recipes/lewis_listener.yaml --rounds 3 \\
        --out outputs/lewis [--first speaker|listener] [--speaker key=value ...] [--listener key=value ...]

Phases alternate, `--first` one first, two per round. Each phase is a normal `rl360 train` of its agent's config
into its own directory `OUT/round<r>_<agent>`, starting from that agent's previous phase's `hf/` export (the
config's `model.path` for its first phase), for the config's `trainer.total_steps`:

- a speaker phase trains against a frozen listener: `rl360 serve listener` runs on the listener's latest model
  (its last phase's `hf/`, else the listener config's `model.path`) on a free loopback port for the phase, and
  the speaker's `lewis__speaker` reward reaches it through RL360_LISTENER_URL (other RL360_LISTENER_* settings
  pass through from the environment);
- a listener phase trains by RL on its own choice reward (`lewis__listener`): on the listener config's data
  until a speaker has trained, then on the latest speaker's descriptions of the speaker config's games (its
  `hf/` export samples one description per game, `--describe-games` of them, written to
  `OUT/round<r>_listener_data/listener.parquet`).

A phase that ended writes `OUT/round<r>_<agent>/phase.json`; running the same command again skips ended phases
and resumes an interrupted one from its latest checkpoint (the usual resume: give the configs
`trainer.save_every`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from rl360.errors import UserError

PHASE_MARK = "phase.json"
BANNER = re.compile(r"rl360 serving listener .* on (http://\S+)")


class PhaseFailed(UserError):
    label = "phase failed"


def phases(rounds: int, first: str) -> list[tuple[int, str]]:
    """(round, agent) in order: `first`'s phase, then the other's, in each round."""
    second = "listener" if first == "speaker" else "speaker"
    return [(r, agent) for r in range(1, rounds + 1) for agent in (first, second)]


def alternate(speaker_config: str, listener_config: str, rounds: int, out: str | Path, first: str = "speaker",
              speaker_overrides: list[str] = (), listener_overrides: list[str] = (), describe_games: int = 512,
              listener_options: list[str] = ()) -> list[Path]:
    """Run the phases (see the module docstring); the phase directories in order."""
    from rl360.config import load_config

    if rounds < 1 or first not in ("speaker", "listener"):
        raise UserError(f"alternate: --rounds must be >= 1 (got {rounds}) and --first speaker or listener")
    out = Path(out)
    configs = {"speaker": (speaker_config, list(speaker_overrides)),
               "listener": (listener_config, list(listener_overrides))}
    base = {agent: load_config(path, overrides).model.path for agent, (path, overrides) in configs.items()}
    latest = dict(base)  # agent -> the model its next phase starts from
    done: list[Path] = []
    for round_number, agent in phases(rounds, first):
        phase_dir = out / f"round{round_number}_{agent}"
        path, overrides = configs[agent]
        overrides = [*overrides, f"output_dir={phase_dir}", f"model.path={latest[agent]}"]
        if (phase_dir / PHASE_MARK).exists():
            print(f"alternate: {phase_dir.name} ended before; skipping it", flush=True)
        elif agent == "speaker":
            with ListenerService(latest["listener"], listener_options) as url:
                run_phase(path, overrides, {"RL360_LISTENER_URL": url}, phase_dir)
        else:
            if latest["speaker"] != base["speaker"]:  # a speaker has trained: its descriptions
                data = describe(latest["speaker"], configs["speaker"], latest["listener"],
                                out / f"round{round_number}_listener_data", describe_games, seed=round_number)
                overrides.append(f"data.train_files=[{data}]")
            run_phase(path, overrides, {}, phase_dir)
        latest[agent] = str(phase_dir / "hf")
        done.append(phase_dir)
    return done


def run_phase(config: str, overrides: list[str], env: dict[str, str], phase_dir: Path) -> None:
    """`rl360 train CONFIG OVERRIDES` in a subprocess (its output passed through); the phase mark on success."""
    command = [sys.executable, "-m", "rl360.cli", "train", config, *overrides]
    print(f"alternate: {phase_dir.name}: {' '.join(command[2:])}", flush=True)
    started = time.time()
    ended = subprocess.run(command, env={**os.environ, **env})
    if ended.returncode != 0:
        raise PhaseFailed(f"{phase_dir.name} ended with exit status {ended.returncode}; run the same command again "
                          "to resume it from its latest checkpoint")
    (phase_dir / PHASE_MARK).write_text(json.dumps({"config": config, "overrides": overrides,
                                                    "seconds": round(time.time() - started, 1)}) + "\n")


class ListenerService:
    """`rl360 serve listener --model DIR --port 0` in a subprocess for a `with` block, which gets its URL."""

    def __init__(self, model: str, options: list[str] = (), start_timeout_s: float = 600.0):
        # scored as rl360's listener rows train it (P("Yes")); `options` may choose otherwise
        self.command = [sys.executable, "-m", "rl360.cli", "serve", "listener", "--model", str(model), "--port", "0",
                        "--scoring", "yes", *options]
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> str:
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, text=True)
        found: list[str] = []
        reader = threading.Thread(target=self._read, args=(found,), daemon=True)
        reader.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not found and self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if not found:
            self.__exit__()
            raise PhaseFailed(f"the listener service ({' '.join(self.command[2:])}) did not start")
        print(f"alternate: listener {self.command[6]} served at {found[0]} (pid {self.process.pid})", flush=True)
        return found[0]

    def _read(self, found: list[str]) -> None:
        for line in self.process.stdout:
            sys.stdout.write(line)
            match = BANNER.search(line)
            if match and not found:
                found.append(match.group(1))

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def describe(speaker_model: str, speaker_config: tuple[str, list[str]], listener_model: str, out: Path,
             games: int, seed: int = 0) -> Path:
    """Listener rows asked about the speaker's descriptions: its `hf/` export samples one description (at the
    speaker config's temperature and response length) for each of the first `games` games of the speaker
    config's data. Returns the parquet file."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from rl360.config import load_config
    from rl360.core import SamplingParams
    from rl360.data import PromptRenderer, expand_paths
    from rl360.data.images import is_vision_model
    from rl360.data.lewis import games_of, listener_rows, write_rows
    from rl360.engine.hf_engine import HFEngine
    from rl360.rewards.lewis import speaker_description

    cfg = load_config(speaker_config[0], speaker_config[1])
    rows: list[dict] = []
    for path in expand_paths(cfg.data.train_files):
        rows += pq.read_table(path).to_pylist()[:games - len(rows)]
        if len(rows) >= games:
            break
    tokenizer = AutoTokenizer.from_pretrained(speaker_model)
    renderer = PromptRenderer.for_model(speaker_model, tokenizer, cfg.data.max_prompt_length)
    engine = HFEngine(speaker_model)
    params = SamplingParams(n=1, temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_response_length,
                            stop_token_ids=sorted({tokenizer.eos_token_id} - {None}), stop=list(cfg.rollout.stop),
                            seed=seed)
    texts = []
    for start in range(0, len(rows), 64):
        batch = rows[start:start + 64]
        samples = engine.generate([renderer.prompt(row) for row in batch], params)
        texts += [speaker_description(tokenizer.decode(group[0].response_ids, skip_special_tokens=True))
                  for group in samples]
    listener = listener_rows(games_of(rows, texts), is_vision_model(listener_model), seed=seed)
    written = write_rows(listener, out / "listener.parquet")
    print(f"alternate: {len(rows)} speaker descriptions -> {written}", flush=True)
    return written


def add_alternate_parser(commands) -> None:
    parser = commands.add_parser("alternate", help="train the Lewis game's speaker and listener in turn")
    parser.add_argument("speaker_config", help="the speaker's config, e.g. configs/recipes/lewis_speaker.yaml")
    parser.add_argument("listener_config", help="the listener's config, e.g. configs/recipes/lewis_listener.yaml")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of one speaker and one listener phase")
    parser.add_argument("--out", default="outputs/lewis", help="directory of the phases' output directories")
    parser.add_argument("--first", choices=("speaker", "listener"), default="speaker", help="which agent trains first")
    parser.add_argument("--speaker", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides of the speaker's config")
    parser.add_argument("--listener", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides of the listener's config")
    parser.add_argument("--describe-games", type=int, default=512,
                        help="games the speaker describes for each listener phase after it")
    parser.add_argument("--listener-max-batch", type=int, default=8, help="serve listener --max-batch")
    parser.add_argument("--listener-concurrency", type=int, default=1, help="serve listener --concurrency")
    parser.add_argument("--listener-device", default="", help="serve listener --device (e.g. cuda:7, a GPU the "
                                                               "speaker's run leaves free)")
    parser.add_argument("--listener-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="serve listener --dtype")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    done = alternate(args.speaker_config, args.listener_config, args.rounds, args.out, args.first, args.speaker,
                     args.listener, args.describe_games,
                     ["--max-batch", str(args.listener_max_batch), "--concurrency", str(args.listener_concurrency),
                      "--dtype", args.listener_dtype] + (["--device", args.listener_device] if args.listener_device
                                                         else []))
    print(f"done: {len(done)} phases in {args.out}; latest models: " +
          ", ".join(str(path / "hf") for path in done[-2:]))
    return 0
