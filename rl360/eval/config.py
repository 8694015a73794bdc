"""`rl360 eval`'s typed configuration: YAML and `key=value` overrides read by the same machinery as the run
config (`rl360.config.load_structured`: unknown keys named with close matches, YAML errors with file:line).

    cfg = load_eval_config("configs/eval/deepvision.yaml", ["eval.endpoints=[http://127.0.0.1:8000/v1]"])

Sampling presets (`sampling.preset`) are DeepVision-103k's evaluation profiles; a sampling key set in the
config or on the command line overrides its preset's value (a key left at null takes the preset's, or the
plain default below).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rl360.config import ConfigError, JudgeConfig, RewardConfig, load_structured, schema_keys
from rl360.core.engine_kinds import engine_names
from rl360.installed import check_sglang

# preset -> sampling values (DeepVision-103k's eval_scripts: qwen_ins, qwen_think, mimo, greedy)
PRESETS: dict[str, dict[str, float | int]] = {
    "qwen_ins": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.0, "presence_penalty": 1.5},
    "qwen_think": {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.0},
    "mimo": {"temperature": 0.3, "top_p": 0.95},
    "greedy": {"temperature": 0.01},
}
# values a sampling key has when neither the preset nor the config sets it
SAMPLING_DEFAULTS: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 16384,
                                             "repetition_penalty": 1.0, "presence_penalty": 0.0}
# DeepVision's prompt-field search order (its --prompt-field auto-detection)
PROMPT_FIELDS = ("messages", "prompt", "question", "text", "problem", "query", "input")
PROTOCOLS = ("openai", "sglang")
ENGINES = engine_names("processes")  # the engine kinds eval.model starts: engine processes


@dataclass
class EvalDataConfig:
    files: list[str] = field(default_factory=list)  # parquet (verl / Reasoning360 schema) or jsonl files, in order
    # field holding the prompt ("": the first present of messages, prompt, question, text, problem, query, input)
    prompt_field: str = ""
    max_prompts: int = 0  # evaluate only the first this many prompts (0: all)
    data_source: str = ""  # routes rows that have no data_source field to a reward (e.g. math__deepvision)


@dataclass
class EvalSamplingConfig:
    preset: str = ""  # qwen_ins | qwen_think | mimo | greedy | "" (the keys below, else their defaults)
    n: int = 1  # samples per prompt, averaged into pass@1 (mean accuracy)
    temperature: float | None = None  # null: the preset's, else 1.0
    top_p: float | None = None  # null: the preset's, else 1.0
    top_k: int | None = None  # null: the preset's, else -1 (off)
    max_tokens: int | None = None  # tokens generated per sample at most (null: 16384)
    repetition_penalty: float | None = None  # null: the preset's, else 1.0 (off; sent only when not 1)
    presence_penalty: float | None = None  # null: the preset's, else 0.0 (off; sent only when not 0)
    # strings that end a sample at the first one written (OpenAI's and SGLang's `stop`); the text scored ends before it
    stop: list[str] = field(default_factory=list)


@dataclass
class EvalTargetConfig:
    # OpenAI-compatible base URLs (http://host:8000/v1) or SGLang servers (http://host:30000), one per endpoint
    endpoints: list[str] = field(default_factory=list)
    protocol: str = "openai"  # openai: POST {url}/chat/completions; sglang: POST {url}/generate (token ids)
    served_model: str = ""  # the "model" of OpenAI requests ("": the first of the endpoint's /v1/models)
    api_key_env: str = ""  # environment variable holding the endpoints' key ("": none)
    # a Hugging Face directory: start eval.num_engines engine servers on it (then protocol sglang), stop them at
    # the end; the tokenizer of sglang-protocol endpoints too
    model: str = ""
    tokenizer: str = ""  # tokenizer directory for sglang-protocol endpoints ("": eval.model)
    engine: str = "server"  # engines eval.model starts: server (`rl360 serve rollout`) or sglang (real SGLang)
    num_engines: int = 1  # engines started on eval.model (the rollout layer's fleet: least-loaded dispatch)
    engine_dtype: str = "bfloat16"  # their weights' dtype
    engine_tensor_parallel: int = 1  # GPUs per engine (engine i gets GPUs [i * tp, (i + 1) * tp) of those visible)
    engine_mem_fraction: float = 0.8  # SGLang's --mem-fraction-static
    engine_args: list[str] = field(default_factory=list)  # extra command-line arguments of each engine server
    startup_timeout_s: float = 600.0  # an engine not serving in this long fails the run (its log's tail shown)
    concurrency: int = 16  # requests in flight per endpoint at most
    request_timeout_s: float = 600.0  # limit on one request; past it the request is retried
    # retries of one request within a round (connection errors, time-outs, 429, 5xx; eval.model: refusals only,
    # the fleet sends a failed request again itself)
    max_retries: int = 3
    # eval.model: restarts of failed engines (gone, no reply in request_timeout_s, a 5xx) before the evaluation
    # ends; a failed request goes to another engine, or to the restarted one
    max_engine_restarts: int = 8
    retry_rounds: int = 5  # rounds over the requests still failing, each after a backoff
    backoff_s: float = 1.0  # first wait after a failure, doubling per failure (an endpoint that fails rests)


@dataclass
class EvalConfig:
    output_dir: str = "outputs/eval"  # results.jsonl, report.json and errors.jsonl go here
    seed: int = 0  # sample j of prompt i is drawn with seed + i * n + j
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    sampling: EvalSamplingConfig = field(default_factory=EvalSamplingConfig)
    eval: EvalTargetConfig = field(default_factory=EvalTargetConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)  # the reward pool, as in training
    rejudge: bool = False  # send rule-based failures to the LLM judge below; its "Correct"s are added back
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # the re-judge endpoint (template correctness)
    pass_k: list[int] = field(default_factory=list)  # k of pass@k ([]: 1, 2, 4, ... up to n, and n)
    progress_every_s: float = 5.0  # seconds between progress lines


EVAL_KEYS = schema_keys(EvalConfig)


def load_eval_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> EvalConfig:
    """A YAML file (or nothing) and overrides into a validated `EvalConfig`."""
    cfg: EvalConfig = load_structured(EvalConfig, path, overrides, EVAL_KEYS)
    validate_eval(cfg)
    return cfg


def sampling_values(sampling: EvalSamplingConfig) -> dict[str, float | int]:
    """The sampling settings in force: the preset's values under those set explicitly, defaults for the rest;
    `stop` only when some are set."""
    values: dict = {**SAMPLING_DEFAULTS, **PRESETS.get(sampling.preset, {})}
    for name in SAMPLING_DEFAULTS:
        if getattr(sampling, name) is not None:
            values[name] = getattr(sampling, name)
    if sampling.stop:
        values["stop"] = list(sampling.stop)
    return values


def pass_ks(cfg: EvalConfig) -> list[int]:
    """The k of pass@k: `pass_k`, or the powers of two up to n, and n."""
    return ks_for(cfg.sampling.n, cfg.pass_k)


def ks_for(n: int, given: list[int]) -> list[int]:
    """The k of pass@k for n samples: those `given`, or (none given) the powers of two below n, and n."""
    if given:
        return sorted(set(given))
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def validate_eval(cfg: EvalConfig) -> None:
    """Value ranges, closed choices and the relations between keys, each error naming its key."""
    s, t = cfg.sampling, cfg.eval
    if "" in s.stop:
        raise ConfigError(f"sampling.stop={list(s.stop)!r} has an empty string, which every text holds: list "
                          "non-empty stop strings")
    if s.preset and s.preset not in PRESETS:
        raise ConfigError(f"sampling.preset={s.preset!r}: choose one of {', '.join(PRESETS)} or '' (none)")
    if t.protocol not in PROTOCOLS:
        raise ConfigError(f"eval.protocol={t.protocol!r}: choose one of {', '.join(PROTOCOLS)}")
    if t.engine not in ENGINES:
        raise ConfigError(f"eval.engine={t.engine!r}: choose one of {', '.join(ENGINES)}")
    if t.model and t.engine == "sglang":
        check_sglang("eval.engine")
    if t.engine_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"eval.engine_dtype={t.engine_dtype!r}: choose float32 or bfloat16")
    if cfg.data.prompt_field and not isinstance(cfg.data.prompt_field, str):
        raise ConfigError("data.prompt_field must be a field name")
    if not cfg.data.files:
        raise ConfigError("data.files is empty: name the parquet or jsonl files to evaluate "
                          "(data.files=[eval.parquet])")
    for path in cfg.data.files:
        if not str(path).endswith((".parquet", ".jsonl")):
            raise ConfigError(f"data.files: {path!r} is neither .parquet nor .jsonl")
    if bool(t.model) == bool(t.endpoints):
        raise ConfigError("give either eval.endpoints (servers already running) or eval.model (a model directory "
                          "to start engine servers on, also --model DIR), not " + ("both" if t.model else "neither"))
    if t.protocol == "sglang" and t.endpoints and not (t.tokenizer or t.model):
        raise ConfigError("eval.protocol=sglang sends token ids: set eval.tokenizer to the served model's "
                          "tokenizer directory")
    values = sampling_values(s)
    positive = {"sampling.n": s.n, "sampling.max_tokens": values["max_tokens"], "eval.concurrency": t.concurrency,
                "eval.num_engines": t.num_engines, "eval.engine_tensor_parallel": t.engine_tensor_parallel,
                "eval.engine_mem_fraction": t.engine_mem_fraction, "eval.request_timeout_s": t.request_timeout_s,
                "eval.startup_timeout_s": t.startup_timeout_s, "reward.timeout_s": cfg.reward.timeout_s,
                "progress_every_s": cfg.progress_every_s, "sampling.repetition_penalty": values["repetition_penalty"]}
    for key, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{key}={value} must be > 0")
    non_negative = {"sampling.temperature": values["temperature"], "eval.max_retries": t.max_retries,
                    "eval.max_engine_restarts": t.max_engine_restarts,
                    "eval.retry_rounds": t.retry_rounds, "eval.backoff_s": t.backoff_s,
                    "data.max_prompts": cfg.data.max_prompts, "reward.num_workers": cfg.reward.num_workers}
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must be >= 0")
    if not 0 < values["top_p"] <= 1:
        raise ConfigError(f"sampling.top_p={values['top_p']} must be in (0, 1]")
    if values["top_k"] == 0 or values["top_k"] < -1:
        raise ConfigError(f"sampling.top_k={values['top_k']} must be -1 (off) or >= 1")
    for k in cfg.pass_k:
        if not 1 <= k <= s.n:
            raise ConfigError(f"pass_k has {k}: each k must be in [1, sampling.n={s.n}]")
