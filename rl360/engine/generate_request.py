"""Parsing SGLang's `/generate` request for `rl360 serve rollout`: prompts, their images, per-prompt sampling
settings and request ids into `Row`s (one per sample), each bad field a `ServiceError(400)` naming it. The
accepted fields and their meaning are listed in `rl360.engine.server`'s docstring.

Images (`image_data`) follow SGLang 0.5.17 (`GenerateReqInput.image_data` and `_normalize_image_data` in
`srt/managers/io_struct.py`; `load_image` / `get_image_bytes` in `srt/utils/common.py`): one image or a list of
them for a single prompt; for a batch, a list with one entry per prompt, each an image, a list of images, or
null / [] for a text prompt (one bare image is every prompt's). An image is a base64 string or a data URL
(`data:<type>;base64,<base64>`); URLs, file paths and SGLang's dict forms (processor output, precomputed
embeddings) are refused with 400 naming the entry: this server fetches nothing and reads no file a request
names. As in SGLang, a prompt's ids hold ONE image token per image (the collapsed `<|vision_start|><|image_pad|>
<|vision_end|>` the chat template renders) and the server expands each to its image's tokens
(`srt/multimodal/processors/base_processor.py`, `_expand_input_ids`); `return_prompt_token_ids` returns the
expanded ids.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from rl360.core import SamplingParams
from rl360.service.app import ServiceError, json_object, number_field

if TYPE_CHECKING:
    import torch

TOP_K_ALL = 1 << 30  # SGLang's "no top-k"
MAX_N = 64
MAX_TOP_LOGPROBS = 20
SGLANG_SCHEMA_VERSION = "0.5.17"  # the SGLang release whose request structs the tables below follow

# SGLang's `GenerateReqInput` (srt/managers/io_struct.py), every field in one of three tables, plus what
# sglang-router adds to the body it forwards. tests/test_sglang_contract.py checks the tables against the
# pinned release's own source: a field SGLang adds or drops fails it.
SERVED_FIELDS = frozenset({"input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len",
                           "top_logprobs_num", "return_text_in_logprobs", "rid", "stream", "image_data",
                           "return_prompt_token_ids", "return_routed_experts"})
# meaningless for one HF engine (metrics, logging, tracing, routing hints, caching salts): any value is accepted
IGNORED_FIELDS = frozenset({"log_metrics", "no_logs", "custom_labels", "external_trace_header", "received_time",
                            "routing_key", "conversation_id", "priority", "extra_key", "http_worker_ipc",
                            "routed_dp_rank", "disagg_prefill_dp_rank", "mm_hashes", "modalities",
                            "need_wait_for_mm_inputs", "num_items_assigned", "images_config",
                            "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
                            "video_max_dynamic_patch"})
# features this server does not have: accepted only at their off value (null, false, 0 or empty), else a 400
# naming the field
UNSERVED_FIELDS = frozenset({"session_id", "input_embeds", "video_data", "audio_data", "use_audio_in_video",
                             "token_ids_logprob", "return_sampling_mask", "return_flat_raw_top_logprobs",
                             "return_flat_raw_top_logprobs_b64", "return_hidden_states", "routed_experts_start_len",
                             "return_indexer_topk", "session_params", "lora_path",
                             "lora_id", "custom_logit_processor", "positional_embed_overrides", "bootstrap_host",
                             "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
                             "background", "require_reasoning", "max_thinking_tokens", "return_bytes",
                             "return_entropy", "mm_data_mooncake", "encoder_urls", "multi_item_delimiter_indices"})
ROUTER_FIELDS = frozenset({"model"})  # sglang-router 0.3.2 sends `"model": null` with every /generate it forwards
GENERATE_FIELDS = SERVED_FIELDS | IGNORED_FIELDS | UNSERVED_FIELDS | ROUTER_FIELDS

# SGLang's `SamplingParams` (srt/sampling/sampling_params.py), in the same three kinds
SAMPLING_FIELDS = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "n",
                             "sampling_seed", "skip_special_tokens", "spaces_between_special_tokens",
                             "no_stop_trim", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                             "min_new_tokens", "stop"})
IGNORED_SAMPLING = frozenset({"stream_interval"})  # every decode step is streamed
UNSERVED_SAMPLING = frozenset({"stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "logit_bias",
                               "custom_params"})
# SGLang sampling keys accepted only at values that change nothing here (null is always fine)
NEUTRAL_SAMPLING: dict[str, tuple] = {"min_p": (0,), "min_new_tokens": (0,)}
OFF_VALUES = (None, False, 0, "", [], {})

@dataclass
class Row:
    """One response to decode: its prompt, its sampling settings and, once decoded, its result."""

    prompt: list[int]  # an image prompt's with every image expanded to its tokens (once `expand_images` ran)
    params: SamplingParams  # n is 1: a row is one sample
    seed: int | None
    rid: str
    logprob_start_len: int = -1
    ignore_eos: bool = False
    index: int = 0  # the prompt's index in its request
    images: tuple[bytes, ...] | None = None  # the prompt's compressed images (shared by its rows)
    pixels: dict | None = None  # the images' pixel inputs (shared by the prompt's rows)
    aborted: str | None = None  # why it was aborted, set from any thread
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    finish_reason: dict | None = None
    weight_version: str = ""
    top_logprobs: int = 0  # alternatives to record per sampled token (`top`)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: the k most likely (id, log-prob)
    on_token: Callable[[Row], None] | None = None  # called on the engine thread after each token and at the finish
    no_stop_trim: bool = False  # the reply's text keeps the stop string that ended it (SGLang's `no_stop_trim`)
    return_logprob: bool = False  # the reply carries the sampled tokens' log-probs (and `top`'s alternatives)
    routed_experts: bool = False  # the reply carries a mixture of experts' routes (SGLang's `return_routed_experts`)
    routes: torch.Tensor | None = None  # once decoded: [prompt + tokens - 1, layers, top_k] (rl360.engine.routes)


@dataclass
class GenerateCall:
    rows: list[Row]
    single: bool  # one prompt with n = 1: answered with an object, not a list
    text_in_logprobs: bool
    prompt_fields: list[str] = field(default_factory=list)  # where each prompt came from ("input_ids[1]", "text")
    return_prompt_token_ids: bool = False
    stream: bool = False  # answered as server-sent events, one per decode step and row

    def has_images(self) -> bool:
        return any(row.images for row in self.rows)


def parse_generate(body: bytes, tokenizer: Any = None, vision: bool = False) -> GenerateCall:
    """The rows of a `/generate` body; `ServiceError(400)` naming the field at fault. `vision`: whether the model
    takes images (`image_data` is refused otherwise)."""
    data = json_object(body, GENERATE_FIELDS)
    refuse_unserved(data, UNSERVED_FIELDS, "")
    prompts, single = _prompts(data, tokenizer)
    count = len(prompts)
    images = parse_image_data(data.get("image_data"), count, single)
    if not vision and any(images):
        raise ServiceError(400, "'image_data': the served model is a text model (it takes no images)", "image_data")
    settings = data.get("sampling_params") or {}
    if isinstance(settings, list):
        if len(settings) != count:
            raise ServiceError(400, f"'sampling_params' has {len(settings)} entries for {count} prompts",
                               "sampling_params")
    elif isinstance(settings, dict):
        settings = [settings] * count
    else:
        raise ServiceError(400, "'sampling_params' must be an object or a list of them", "sampling_params")
    rids = _rids(data.get("rid"), count, single)
    return_logprob = per_prompt(data, "return_logprob", count, False, lambda v, where: _bool(v, where))
    starts = per_prompt(data, "logprob_start_len", count, -1,
                        lambda v, where: v if is_int(v) and v >= -1 else _bad(where, "an integer >= -1", v))
    routed = per_prompt(data, "return_routed_experts", count, False, lambda v, where: _bool(v, where))
    tops = per_prompt(data, "top_logprobs_num", count, 0,
                      lambda v, where: v if is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS
                      else _bad(where, f"an integer in [0, {MAX_TOP_LOGPROBS}]", v))
    rows = []
    for index, (prompt, options, rid) in enumerate(zip(prompts, settings, rids)):
        where = "sampling_params" + (f"[{index}]" if count > 1 else "")
        params, seed, ignore_eos = parse_sampling(options, where)
        no_stop_trim = bool(options.get("no_stop_trim"))
        if params.stop and tokenizer is None:
            raise ServiceError(400, f"'{where}.stop' needs a tokenizer and the checkpoint has none: use "
                                    "'stop_token_ids'", f"{where}.stop")
        logprobs = return_logprob[index]
        if logprobs and tops[index] and starts[index] >= 0:
            raise ServiceError(400, "'top_logprobs_num' with 'logprob_start_len' >= 0 asks for the prompt's top "
                                    "log-probs, which rl360 serve rollout does not compute (the sampled tokens' "
                                    "are served)", "top_logprobs_num")
        for j in range(params.n):
            one = replace(params, n=1)
            rows.append(Row(prompt, one, None if seed is None else seed + j, rid,
                            starts[index] if logprobs else -1, ignore_eos, index, images[index],
                            no_stop_trim=no_stop_trim, top_logprobs=tops[index] if logprobs else 0,
                            return_logprob=logprobs, routed_experts=routed[index]))
    field_name = "text" if data.get("text") is not None else "input_ids"
    fields = [field_name if single else f"{field_name}[{i}]" for i in range(count)]
    single = single and len(rows) == 1
    return GenerateCall(rows, single, bool_field(data, "return_text_in_logprobs"), fields,
                        bool_field(data, "return_prompt_token_ids"), bool_field(data, "stream"))


def refuse_unserved(data: dict, unserved: frozenset[str], where: str) -> None:
    """A 400 naming the first of `unserved` that `data` sets to anything but its off value."""
    for key in data:
        if key in unserved and not _is_off(data[key]):
            name = f"{where}.{key}" if where else key
            raise ServiceError(400, f"'{name}' = {str(data[key])[:60]} asks for what rl360 serve rollout does not "
                                    "serve (it accepts the field only at null, false, 0 or empty)", name)


def _is_off(value: Any) -> bool:
    if isinstance(value, list) and value:
        return all(_is_off(item) for item in value)  # per-prompt lists (`return_hidden_states: [false, false]`)
    return any(value is off or (type(value) is type(off) and value == off) for off in OFF_VALUES)


def per_prompt(data: dict, key: str, count: int, default: Any, check: Callable[[Any, str], Any]) -> list:
    """SGLang's per-request-or-per-prompt field: one value for every prompt, or a list of one per prompt."""
    value = data.get(key)
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise ServiceError(400, f"'{key}' has {len(value)} entries for {count} prompts", key)
        return [default if item is None else check(item, f"{key}[{i}]") for i, item in enumerate(value)]
    return [check(value, key)] * count


def _bool(value: Any, where: str) -> bool:
    return value if isinstance(value, bool) else _bad(where, "a boolean", value)


def _bad(where: str, wanted: str, value: Any) -> Any:
    raise ServiceError(400, f"'{where}' must be {wanted}, got {str(value)[:60]}", where)


def parse_image_data(value: Any, count: int, single: bool) -> list[tuple[bytes, ...] | None]:
    """Each prompt's images (None: a text prompt) from SGLang's `image_data` shapes (see the module docstring)."""
    if value is None or value == []:
        return [None] * count
    if single:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
            value = value[0]  # the batch-of-one form SGLang makes of a single prompt with n > 1
        return [_image_list(value, "image_data")]
    if isinstance(value, list):
        if len(value) != count:
            raise ServiceError(400, f"'image_data' has {len(value)} entries for {count} prompts (one per prompt: "
                                    "an image, a list of images, or null / [] for none)", "image_data")
        return [_image_list(entry, f"image_data[{i}]") for i, entry in enumerate(value)]
    return [_image_list(value, "image_data")] * count  # one image for every prompt, as SGLang takes it


def _image_list(value: Any, where: str) -> tuple[bytes, ...] | None:
    if value is None or value == [] or value == [None]:
        return None
    if isinstance(value, list):
        return tuple(decode_image(item, f"{where}[{j}]") for j, item in enumerate(value))
    return (decode_image(value, where),)


def decode_image(item: Any, where: str) -> bytes:
    """The compressed bytes of one `image_data` entry: a data URL or a base64 string; `ServiceError(400)` naming
    `where` for anything else (URLs, paths and dicts are refused, not fetched or read)."""
    if not isinstance(item, str):
        raise ServiceError(400, f"'{where}' must be a base64 string or a data URL, got {type(item).__name__} "
                                "(SGLang's processor-output and precomputed-embedding forms are not served)", where)
    if item.startswith("data:"):
        if "," not in item:
            raise ServiceError(400, f"'{where}' is a data URL without data (no ',')", where)
        encoded = item.split(",", 1)[1]
    elif item.startswith(("http://", "https://", "file://")):
        raise ServiceError(400, f"'{where}' is a URL ({item[:60]}): rl360 serve rollout fetches and reads nothing "
                                "a request names; send the image's bytes as base64 or a data URL", where)
    else:
        encoded = item
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        kind = "a data URL whose data is not base64" if item.startswith("data:") else (
            "neither base64 nor a data URL (file paths are not read)")
        raise ServiceError(400, f"'{where}' is {kind}: {item[:60]!r}", where) from None
    if not data:
        raise ServiceError(400, f"'{where}' is an empty image", where)
    return data


def expand_images(call: GenerateCall, pixel_inputs: Callable[[tuple[bytes, ...], str], dict], image_token_id: int,
                  merge_size: int) -> None:
    """Expand each image prompt's one image token per image into that image's tokens (its merged patches, from
    `pixel_inputs(images, where)`), in place on its rows, which also get the pixel inputs. A prompt whose image
    tokens do not pair one to one with its images, or whose images cannot be decoded, is a ServiceError(400)."""
    done: dict[int, tuple[list[int], dict]] = {}
    for row in call.rows:
        where = call.prompt_fields[row.index]
        pads = sum(1 for token in row.prompt if token == image_token_id)
        if row.images is None:
            if pads:
                raise ServiceError(400, f"'{where}' holds {pads} image token(s) ({image_token_id}) but the prompt has "
                                        "no images in 'image_data'", where)
            continue
        if row.index not in done:
            if pads != len(row.images):
                raise ServiceError(400, f"'{where}' holds {pads} image token(s) ({image_token_id}) for "
                                        f"{len(row.images)} image(s): send one image token per image (the collapsed "
                                        "<|vision_start|><|image_pad|><|vision_end|>), which the server expands, as "
                                        "SGLang does", where)
            image_field = "image_data" if len(call.prompt_fields) == 1 else f"image_data[{row.index}]"
            try:
                pixels = pixel_inputs(row.images, image_field)
            except ValueError as err:  # DataError: an image that does not decode
                raise ServiceError(400, f"'{image_field}': {err}", image_field) from None
            counts = iter(int(t * h * w) // merge_size ** 2 for t, h, w in pixels["image_grid_thw"].tolist())
            expanded: list[int] = []
            for token in row.prompt:
                expanded += [token] * next(counts) if token == image_token_id else [token]
            done[row.index] = (expanded, pixels)
        row.prompt, row.pixels = done[row.index]


def _prompts(data: dict, tokenizer: Any) -> tuple[list[list[int]], bool]:
    if data.get("input_ids") is not None and data.get("text") is not None:
        raise ServiceError(400, "send either 'input_ids' or 'text', not both", "text")
    if data.get("text") is not None:
        if tokenizer is None:
            raise ServiceError(400, "'text' needs a tokenizer and the checkpoint has none: send 'input_ids'", "text")
        text = data["text"]
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ServiceError(400, "'text' must be a string or a non-empty list of strings", "text")
        return [tokenizer(t)["input_ids"] for t in texts], isinstance(text, str)
    ids = data.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise ServiceError(400, "'input_ids' must be a non-empty list of token ids or of such lists", "input_ids")
    single = not isinstance(ids[0], list)
    prompts = [ids] if single else ids
    for i, prompt in enumerate(prompts):
        where = "input_ids" if single else f"input_ids[{i}]"
        if not isinstance(prompt, list) or not prompt or not all(is_int(t) and t >= 0 for t in prompt):
            raise ServiceError(400, f"'{where}' must be a non-empty list of non-negative integers", where)
    return prompts, single


def _rids(value: Any, count: int, single: bool) -> list[str]:
    if value is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(value, str):
        return [value] if count == 1 else [f"{value}_{i}" for i in range(count)]
    if isinstance(value, list) and len(value) == count and all(isinstance(r, str) for r in value) and not single:
        return value
    raise ServiceError(400, f"'rid' must be a string or a list of {count} strings (one per prompt)", "rid")


def penalty_fields(options: dict, where: str = "", error: type[ServiceError] = ServiceError) -> dict[str, float]:
    """`frequency_penalty` and `presence_penalty` (in [-2, 2], 0: off) and `repetition_penalty` (in (0, 2], 1: off)
    of a request, as SGLang and OpenAI bound them (rl360/engine/penalties.py says what each does)."""
    return {"frequency_penalty": number_field(options, "frequency_penalty", 0.0, -2.0, 2.0, where=where, error=error),
            "presence_penalty": number_field(options, "presence_penalty", 0.0, -2.0, 2.0, where=where, error=error),
            "repetition_penalty": number_field(options, "repetition_penalty", 1.0, 0.0, 2.0, low_open=True,
                                               where=where, error=error)}


def parse_sampling(options: Any, where: str = "sampling_params") -> tuple[SamplingParams, int | None, bool]:
    """SGLang sampling settings as our `SamplingParams`, the seed (None: random draws) and `ignore_eos`."""
    if not isinstance(options, dict):
        raise ServiceError(400, f"'{where}' must be an object", where)
    unknown = [key for key in options if key not in SAMPLING_FIELDS | IGNORED_SAMPLING | UNSERVED_SAMPLING]
    if unknown:
        accepted = ", ".join(sorted(SAMPLING_FIELDS | IGNORED_SAMPLING | UNSERVED_SAMPLING))
        raise ServiceError(400, f"unknown field '{where}.{unknown[0]}' (accepted: {accepted})", f"{where}.{unknown[0]}")
    refuse_unserved(options, UNSERVED_SAMPLING, where)
    for key, neutral in NEUTRAL_SAMPLING.items():
        value = options.get(key)
        if value is not None and value not in neutral:
            raise ServiceError(400, f"'{where}.{key}' is not supported by rl360 serve rollout (only "
                                    f"{' or '.join(map(repr, neutral))}), got {value!r}", f"{where}.{key}")
    temperature = number_field(options, "temperature", 1.0, 0.0, 100.0, where=where)
    top_p = number_field(options, "top_p", 1.0, 0.0, 1.0, where=where)
    if top_p <= 0:
        raise ServiceError(400, f"'{where}.top_p' must be in (0, 1], got {top_p!r}", f"{where}.top_p")
    top_k = int(number_field(options, "top_k", -1, -1, 1 << 62, integer=True, where=where))
    if top_k == 0 or top_k >= TOP_K_ALL:
        top_k = -1
    stops = options.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(is_int(t) and t >= 0 for t in stops):
        raise ServiceError(400, f"'{where}.stop_token_ids' must be a list of non-negative integers",
                           f"{where}.stop_token_ids")
    stop = stop_strings(options.get("stop"), f"{where}.stop")
    n = int(number_field(options, "n", 1, 1, MAX_N, integer=True, where=where))
    max_new_tokens = int(number_field(options, "max_new_tokens", 128, 0, 1 << 20, integer=True, where=where))
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                            stop_token_ids=sorted(set(stops)), stop=stop, **penalty_fields(options, where))
    seed = options.get("sampling_seed")
    if seed is not None and not is_int(seed):
        raise ServiceError(400, f"'{where}.sampling_seed' must be an integer, got {seed!r}", f"{where}.sampling_seed")
    for key in ("ignore_eos", "no_stop_trim"):
        if options.get(key) is not None and not isinstance(options[key], bool):
            raise ServiceError(400, f"'{where}.{key}' must be a boolean", f"{where}.{key}")
    return params, seed, bool(options.get("ignore_eos"))


def stop_strings(value: Any, where: str) -> list[str]:
    """SGLang's `stop`: a string or a list of non-empty strings (null or []: none), as a list without repeats."""
    if value is None:
        return []
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        raise ServiceError(400, f"'{where}' must be a non-empty string or a list of non-empty strings, got "
                                f"{str(value)[:80]!r}", where)
    return list(dict.fromkeys(strings))


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def bool_field(data: dict, key: str, default: bool = False) -> bool:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ServiceError(400, f"'{key}' must be a boolean, got {value!r}", key)
    return value
