"""`EngineClient` (and so `WeightSender`, which sends only through it) against the pinned SGLang's own source:
every route it calls exists with that method, every field it sends is a field of the route's request struct
with a value its annotation accepts (and every sampling key one of SGLang's `SamplingParams`), and it works on
replies holding only keys SGLang returns. The weight-update group is checked too: SGLang's engine joins it the
way `rl360.weight_sync.group.open_process_group` does (tcp rendezvous, store prefixed by the group name,
`_new_process_group_helper`, its own ranks) and receives one broadcast from rank 0 per name, of the dtype
`getattr(torch, name)`; the memory tags are SGLang's. An image prompt's `/generate` body is pinned exactly
(`image_data` as data URLs, one image token per image in `input_ids`, `return_prompt_token_ids`), and SGLang's
own code for each of those choices is checked.

The wheel is fetched once with `pip download --no-deps` into ~/.cache/rl360/sglang and read with `ast`
(never imported); the test skips only when that download fails for lack of network."""

import ast
import asyncio
import base64
import json
import os
import zipfile

import httpx
import numpy as np
import pytest
import torch

from rl360.core import ImagePrompt, SamplingParams
from rl360.core.client import EngineClient
from rl360.engine.server import MEMORY_TAGS
from rl360.weight_sync.formats import SHARED_MEMORY_LOAD_FORMAT, WEIGHT_DTYPES, dtype_name
from tests.helpers import sglang_wheel

SGLANG_PIN = "0.5.17"
SOURCES = {"io_struct": "sglang/srt/managers/io_struct.py", "http": "sglang/srt/entrypoints/http_server.py",
           "tokenizer": "sglang/srt/managers/tokenizer_manager.py",
           "sampling": "sglang/srt/sampling/sampling_params.py", "common": "sglang/srt/utils/common.py",
           "updater": "sglang/srt/model_executor/model_runner_components/weight_updater.py",
           "constants": "sglang/srt/constants.py", "environ": "sglang/srt/environ.py",
           "processor": "sglang/srt/multimodal/processors/base_processor.py",
           "schedule_batch": "sglang/srt/managers/schedule_batch.py", "server_args": "sglang/srt/server_args.py",
           "config_parser": "sglang/srt/server_args_config_parser.py"}


@pytest.fixture(scope="module")
def sglang():
    with zipfile.ZipFile(sglang_wheel(SGLANG_PIN)) as wheel:
        return {key: ast.parse(wheel.read(path).decode()) for key, path in SOURCES.items()}


def _class_fields(tree: ast.Module) -> dict[str, set[str]]:
    """Annotated fields of every class (dataclass or msgspec Struct), bases within the file included."""
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def fields(name: str) -> set[str]:
        node = classes[name]
        own = {item.target.id for item in node.body if isinstance(item, ast.AnnAssign)
               and isinstance(item.target, ast.Name)}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                own |= fields(base.id)
        return own

    return {name: fields(name) for name in classes}


def _class_annotations(tree: ast.Module) -> dict[str, dict[str, ast.AST]]:
    """Field -> annotation of every class, bases within the file included."""
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def annotations(name: str) -> dict[str, ast.AST]:
        node, own = classes[name], {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                own.update(annotations(base.id))
        own.update({item.target.id: item.annotation for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)})
        return own

    return {name: annotations(name) for name in classes}


def _accepts(note: ast.AST, value) -> bool:
    """Whether a JSON `value` fits the annotation `note` (bytes travel as base64 text over HTTP)."""
    if isinstance(note, ast.Constant):
        return note.value is None and value is None
    if isinstance(note, ast.BinOp) and isinstance(note.op, ast.BitOr):
        return _accepts(note.left, value) or _accepts(note.right, value)
    if isinstance(note, ast.Name):
        if note.id == "int":
            return isinstance(value, int) and not isinstance(value, bool)
        if note.id == "float":
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        kinds = {"str": str, "bytes": str, "bool": bool, "List": list, "list": list, "Dict": dict, "dict": dict}
        return note.id == "Any" or (note.id in kinds and isinstance(value, kinds[note.id]))
    if isinstance(note, ast.Subscript) and isinstance(note.value, ast.Name):
        args = note.slice.elts if isinstance(note.slice, ast.Tuple) else [note.slice]
        kind = note.value.id
        if kind == "Optional":
            return value is None or _accepts(args[0], value)
        if kind == "Union":
            return any(_accepts(arg, value) for arg in args)
        if kind == "Annotated":
            return _accepts(args[0], value)
        if kind == "Literal":
            return value in [arg.value for arg in args if isinstance(arg, ast.Constant)]
        if kind in ("List", "list"):
            return isinstance(value, list) and all(_accepts(args[0], item) for item in value)
        if kind in ("Dict", "dict"):
            return isinstance(value, dict)
    return False


def _routes(tree: ast.Module) -> dict[tuple[str, str], ast.AsyncFunctionDef]:
    """(method, path) -> handler for every `@app.get/post/api_route(...)` of the HTTP server."""
    routes = {}
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                    and isinstance(deco.func.value, ast.Name) and deco.func.value.id == "app"):
                continue
            path = next((a.value for a in deco.args if isinstance(a, ast.Constant)), None)
            path = path or next((k.value.value for k in deco.keywords if k.arg == "path"), None)
            if deco.func.attr in ("get", "post", "put", "delete"):
                methods = [deco.func.attr.upper()]
            elif deco.func.attr == "api_route":
                methods = next((ast.literal_eval(k.value) for k in deco.keywords if k.arg == "methods"), ["GET"])
            else:
                continue
            for method in methods:
                routes[(method, path)] = node
    return routes


def _request_class(handler: ast.AST) -> str | None:
    """The struct a handler's `obj` parameter is parsed into (`obj: X` or `obj: Annotated[X, Body()]`)."""
    for arg in handler.args.args:
        if arg.arg != "obj" or arg.annotation is None:
            continue
        note = arg.annotation
        if isinstance(note, ast.Subscript) and isinstance(note.value, ast.Name) and note.value.id == "Annotated":
            note = note.slice.elts[0]
        if isinstance(note, ast.Subscript) and isinstance(note.value, ast.Name) and note.value.id == "Optional":
            note = note.slice
        return note.id if isinstance(note, ast.Name) else None
    return None


def _dict_keys(node: ast.AST) -> set[str]:
    """String keys of every dict literal and `x["key"] = ...` assignment under `node`."""
    keys = set()
    for item in ast.walk(node):
        if isinstance(item, ast.Dict):
            keys |= {k.value for k in item.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        if isinstance(item, ast.Assign):
            for target in item.targets:
                if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
                    keys.add(target.slice.value)
    return keys


def _meta_info_keys(tree: ast.Module) -> set[str]:
    keys = set()
    for item in ast.walk(tree):
        if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "meta_info" for t in item.targets):
            keys |= _dict_keys(item.value)
        if isinstance(item, ast.Assign):
            for target in item.targets:
                if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                        and target.value.id == "meta_info" and isinstance(target.slice, ast.Constant)):
                    keys.add(target.slice.value)
    return keys


def _record_client_calls(replies: dict) -> list[tuple[str, str, dict | None]]:
    """Run every `EngineClient` method against a transport answering `replies[path]`; return what it sent."""
    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        sent.append((request.method, request.url.path, body))
        reply = replies[request.url.path]
        if isinstance(reply, str):
            return httpx.Response(200, text=reply)
        if reply is None:  # SGLang's release/resume handlers return nothing: JSON null
            return httpx.Response(200, content=b"null", headers={"content-type": "application/json"})
        return httpx.Response(200, json=reply)

    async def scenario():
        client = EngineClient("http://sglang.invalid", api_key="k" * 20)
        client._http = httpx.AsyncClient(base_url=client.url, headers=client._http.headers,
                                         transport=httpx.MockTransport(answer))
        params = SamplingParams(n=1, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=2, stop_token_ids=[3],
                                stop=["</code>"])
        samples = await client.generate_samples([[1, 2]], params, seed=3, rid="r")
        await client.generate([[1, 2]], {"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0, rid=["r"])
        await client.update_weights_from_tensor([("w", torch.zeros(2))], 1, last_bucket=True, abort_all_requests=True)
        await client.update_weights_from_disk("/ckpt", 2, abort_all_requests=False)
        await client.update_weights_from_serialized("e30=", SHARED_MEMORY_LOAD_FORMAT, 3, last_bucket=False)
        await client.init_weights_update_group("10.0.0.1", 29500, 1, 3, "rl360-weights-x", "gloo")
        dtypes = [dtype_name(torch.float32), dtype_name(torch.bfloat16)]
        await client.update_weights_from_distributed(["w", "v"], dtypes, [[2, 3], []], "rl360-weights-x", 4,
                                                     last_bucket=True)
        await client.destroy_weights_update_group("rl360-weights-x")
        assert await client.get_weights_by_name("w", truncate_size=2) == [[0.5, 1.0, 2.0], [0.0, 0.0, 0.0]]
        await client.release_memory_occupation(["weights", "kv_cache"])
        await client.resume_memory_occupation(None)
        await client.flush_cache()
        await client.pause_generation("in_place")
        await client.continue_generation()
        await client.abort_request(rid="r")
        await client.abort_request(abort_all=True)
        assert await client.health() and await client.health_generate()
        assert await client.weight_version() == "1"
        await client.close()
        return samples

    samples = asyncio.run(scenario())
    assert samples[0][0].response_ids == [4] and samples[0][0].logprobs == [-0.5]
    assert samples[0][0].finish_reason == "length"
    return sent


def test_client_requests_and_replies_match_sglang(sglang):
    structs = _class_fields(sglang["io_struct"])
    sampling_fields = _class_fields(sglang["sampling"])["SamplingParams"]
    routes = _routes(sglang["http"])
    meta_keys = _meta_info_keys(sglang["tokenizer"])
    meta = {"id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 2, "completion_tokens": 1,
            "weight_version": "1", "output_token_logprobs": [[-0.5, 4, None]]}
    assert set(meta) <= meta_keys, sorted(set(meta) - meta_keys)
    generate_reply = {"text": "", "output_ids": [4], "meta_info": meta}
    assert set(generate_reply) <= _dict_keys(sglang["tokenizer"])
    model_info = {"model_path": "/m", "weight_version": "1", "is_generation": True}
    assert set(model_info) <= _dict_keys(routes[("GET", "/model_info")])
    update_reply = {"success": True, "message": "ok"}
    update_routes = ("/update_weights_from_tensor", "/update_weights_from_disk", "/init_weights_update_group",
                     "/update_weights_from_distributed", "/destroy_weights_update_group")
    for route in update_routes:
        assert set(update_reply) <= _dict_keys(routes[("POST", route)]), route
    # /get_weights_by_name answers the parameter's values themselves (a list), as the client reads them
    assert "ORJSONResponse(ret" in ast.unparse(routes[("POST", "/get_weights_by_name")])
    assert "parameter" in _class_fields(sglang["io_struct"])["GetWeightsByNameReqOutput"]
    replies = {"/generate": generate_reply, **dict.fromkeys(update_routes, update_reply),
               "/flush_cache": "Cache flushed.\n", "/pause_generation": {"message": "ok", "status": "ok"},
               "/continue_generation": {"message": "ok"}, "/abort_request": "", "/health": "", "/health_generate": "",
               "/model_info": model_info, "/get_weights_by_name": [[0.5, 1.0, 2.0], [0.0, 0.0, 0.0]],
               "/release_memory_occupation": None, "/resume_memory_occupation": None}
    sent = _record_client_calls(replies)
    assert {path for _, path, _ in sent} == set(replies)  # every route the client has was exercised
    annotations = _class_annotations(sglang["io_struct"])
    for method, path, body in sent:
        assert (method, path) in routes, f"SGLang {SGLANG_PIN} has no {method} {path}"
        if body is None:
            continue
        struct = _request_class(routes[(method, path)])
        if path == "/generate":
            struct = "GenerateReqInput"
            settings = body["sampling_params"]
            for options in settings if isinstance(settings, list) else [settings]:
                assert set(options) <= sampling_fields, sorted(set(options) - sampling_fields)
        assert struct in structs, f"{path}: request struct {struct!r} not found in io_struct.py"
        assert set(body) <= structs[struct], f"{path}: {sorted(set(body) - structs[struct])} not in {struct}"
        for key, value in body.items():
            note = annotations[struct][key]
            assert _accepts(note, value), f"{path}: {key}={value!r} does not fit {struct}.{key}: {ast.unparse(note)}"


def test_generate_struct_is_a_dataclass_whose_fields_were_found(sglang):
    """Guards the parser itself: a struct with no fields found would let every check pass."""
    structs = _class_fields(sglang["io_struct"])
    assert {"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "rid"} <= structs["GenerateReqInput"]
    assert {"serialized_named_tensors", "load_format", "weight_version", "flush_cache"} <= structs[
        "UpdateWeightsFromTensorReqInput"]
    assert "unknown_field_x" not in structs["AbortReq"] and "abort_all" in structs["AbortReq"]
    assert {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"} <= structs[
        "InitWeightsUpdateGroupReqInput"]
    notes = _class_annotations(sglang["io_struct"])
    wrong = [("InitWeightsUpdateGroupReqInput", "master_port", "29500"), ("UpdateWeightsFromDistributedReqInput",
             "weight_version", 4), ("UpdateWeightsFromDistributedReqInput", "shapes", [[2, "3"]]),
             ("ReleaseMemoryOccupationReqInput", "tags", "weights"), ("PauseGenerationReqInput", "mode", "later"),
             ("UpdateWeightsFromTensorReqInput", "flush_cache", 1)]
    for struct, key, value in wrong:  # the type check can fail
        assert not _accepts(notes[struct][key], value), (struct, key, value)


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == name)


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    """Calls of `name` (a plain name or an attribute) under `node`."""
    return [call for call in ast.walk(node) if isinstance(call, ast.Call) and (
        (isinstance(call.func, ast.Name) and call.func.id == name)
        or (isinstance(call.func, ast.Attribute) and call.func.attr == name))]


def _keywords(call: ast.Call) -> dict[str, str]:
    return {keyword.arg: ast.unparse(keyword.value) for keyword in call.keywords}


def test_the_weight_update_group_is_joined_and_fed_as_the_sender_expects(sglang):
    """SGLang's engine side of /init_weights_update_group and /update_weights_from_distributed, which
    `WeightSender` (rank 0, through `open_process_group`) must meet."""
    make = _function(sglang["common"], "init_custom_process_group")
    (rendezvous,) = _calls(make, "rendezvous")
    assert [ast.unparse(arg) for arg in rendezvous.args[:3]] == ["init_method", "rank", "world_size"]
    (prefix,) = _calls(make, "PrefixStore")
    assert [ast.unparse(arg) for arg in prefix.args] == ["group_name", "store"]
    (helper,) = _calls(make, "_new_process_group_helper")
    assert [ast.unparse(arg) for arg in helper.args] == ["world_size", "rank", "[]", "backend", "store"]
    assert _keywords(helper)["group_name"] == "group_name"
    ranks = [node for node in ast.walk(make) if isinstance(node, ast.Assign)
             and ast.unparse(node.targets[0]) == "_world.pg_group_ranks[pg]"]
    assert [ast.unparse(node.value) for node in ranks] == ["{i: i for i in range(world_size)}"]

    join = _function(sglang["updater"], "init_weights_update_group")
    assert "rank = rank_offset + self.tp_rank" in ast.unparse(join)  # an engine's ranks start at rank_offset
    (call,) = _calls(join, "init_custom_process_group")
    assert _keywords(call) == {"backend": "backend", "init_method": "na.to_tcp()", "world_size": "world_size",
                               "rank": "rank", "group_name": "group_name"}

    receive = _function(sglang["updater"], "update_weights_from_distributed")
    (loop,) = [node for node in ast.walk(receive) if isinstance(node, ast.For)
               and ast.unparse(node.iter) == "zip(names, dtypes, shapes)"]
    (broadcast,) = _calls(loop, "broadcast")  # one broadcast per name, in order, from rank 0 of the group
    assert ast.unparse(broadcast.args[0]) == "weight" and _keywords(broadcast)["src"] == "0"
    assert "getattr(torch, dtype)" in ast.unparse(loop)
    for name, dtype in WEIGHT_DTYPES.items():  # the dtype names the sender writes are read back the same
        assert getattr(torch, name) is dtype and dtype_name(dtype) == name


def test_memory_tags_are_sglangs(sglang):
    names = {target.id: node.value for node in sglang["constants"].body if isinstance(node, ast.Assign)
             for target in node.targets if isinstance(target, ast.Name)}
    every = {names[item.id].value for item in names["GPU_MEMORY_ALL_TYPES"].elts}
    assert set(MEMORY_TAGS) == every == {"weights", "kv_cache", "cuda_graph"}


def _aliases(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level type aliases (`Name = Union[...]`) of a source file."""
    return {node.targets[0].id: node.value for node in tree.body if isinstance(node, ast.Assign)
            and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Subscript)}


def _resolve(note: ast.AST, aliases: dict[str, ast.AST]) -> ast.AST:
    """`note` with every alias name replaced by its definition (recursively), so `_accepts` can read it."""

    class Inline(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            return self.visit(_copy(aliases[node.id])) if node.id in aliases else node

    def _copy(node: ast.AST) -> ast.AST:
        return ast.parse(ast.unparse(node), mode="eval").body

    return Inline().visit(_copy(note))


def test_image_prompts_go_out_as_sglangs_image_data(sglang):
    """The exact `/generate` body for a batch of an image prompt (two images, expanded ids) and a text prompt:
    SGLang's `image_data`, one list per prompt of data URLs ([] for the text prompt), the prompt's ids with each
    image's run of image tokens collapsed to one (SGLang expands a pre-tokenized prompt's placeholder itself,
    one per image: `_expand_input_ids`), and `return_prompt_token_ids`, whose reply field is checked against the
    prompt's own expanded ids."""
    png, jpeg = b"\x89PNG\r\n\x1a\n" + b"\x00" * 8, b"\xff\xd8\xff\xe0" + b"\x01" * 8
    pad, start, end = 9, 7, 8
    prompt = ImagePrompt([1, start, pad, pad, pad, pad, end, 2, start, pad, end, 3], (png, jpeg))
    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        meta = {"id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 0,
                "completion_tokens": 1, "weight_version": "2", "output_token_logprobs": [[-0.25, 4, None]]}
        return httpx.Response(200, json=[{"text": "", "output_ids": [4], "meta_info": meta,
                                          "prompt_token_ids": ids} for ids in (prompt.ids, [5, 6])])

    async def scenario():
        client = EngineClient("http://sglang.invalid", image_token_id=pad)
        client._http = httpx.AsyncClient(base_url=client.url, transport=httpx.MockTransport(answer))
        params = SamplingParams(n=1, temperature=0.7, top_p=1.0, top_k=-1, max_new_tokens=1, stop_token_ids=[])
        samples = await client.generate_samples([prompt, [5, 6]], params, seed=3, rid="r")
        await client.close()
        return samples

    groups = asyncio.run(scenario())
    png_url = "data:image/png;base64," + base64.b64encode(png).decode()
    jpeg_url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    settings = {"n": 1, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_new_tokens": 1, "stop_token_ids": []}
    assert sent == [{
        "input_ids": [[1, start, pad, end, 2, start, pad, end, 3], [5, 6]],
        "sampling_params": [{**settings, "sampling_seed": 3}, {**settings, "sampling_seed": 4}],
        "return_logprob": True,
        "rid": ["r-0", "r-1"],
        "image_data": [[png_url, jpeg_url], []],
        "return_prompt_token_ids": True,
    }]
    assert groups[0][0].prompt_ids == prompt.ids and groups[0][0].images == (png, jpeg)
    assert groups[1][0].prompt_ids == [5, 6] and groups[1][0].images is None

    fields, notes = _class_fields(sglang["io_struct"]), _class_annotations(sglang["io_struct"])
    aliases = _aliases(sglang["io_struct"])
    assert set(sent[0]) <= fields["GenerateReqInput"]
    for key, value in sent[0].items():
        note = _resolve(notes["GenerateReqInput"][key], aliases)
        assert _accepts(note, value), f"{key}={value!r} does not fit GenerateReqInput.{key}: {ast.unparse(note)}"
    assert not _accepts(_resolve(notes["GenerateReqInput"]["image_data"], aliases), [[3]])  # the check can fail
    # SGLang reads a data URL's base64 and would open a bare base64 JPEG ("/9j/...") as a file path
    image_bytes = ast.unparse(_function(sglang["common"], "get_image_bytes"))
    assert "startswith('data:')" in image_bytes and "startswith(('file://', '/'))" in image_bytes
    # a pre-tokenized prompt keeps its tokens, one placeholder per image expanded to the image's tokens
    expand = ast.unparse(_function(sglang["processor"], "_expand_input_ids"))
    assert "num_placeholders != len(counts)" in expand and "[placeholder_token_id] * counts" in expand
    combine = ast.unparse(_function(sglang["processor"], "process_and_combine_mm_data"))
    assert "SGLANG_MM_AVOID_RETOKENIZE.get()" in combine and "base_output.input_ids" in combine
    avoid = [node for node in ast.walk(sglang["environ"]) if isinstance(node, ast.Assign)
             and ast.unparse(node.targets[0]) == "SGLANG_MM_AVOID_RETOKENIZE"]
    assert [ast.unparse(node.value) for node in avoid] == ["EnvBool(True)"]  # on unless the engine turns it off
    # the reply carries the expanded prompt when asked for
    assert "out_dict['prompt_token_ids'] = state.prompt_token_ids" in ast.unparse(sglang["tokenizer"])


def test_serve_rollout_sorts_every_generate_field_of_sglang(sglang):
    """`rl360 serve rollout` accepts SGLang's whole `GenerateReqInput` (what sglang-router forwards): each field is
    served, ignored, or accepted only at its off value; likewise every key of SGLang's `SamplingParams`. A field
    the pinned release adds or drops fails here, so the server's tables follow SGLang."""
    from rl360.engine import generate_request as schema

    assert schema.SGLANG_SCHEMA_VERSION == SGLANG_PIN
    sglang_fields = _class_fields(sglang["io_struct"])["GenerateReqInput"]
    tables = [schema.SERVED_FIELDS, schema.IGNORED_FIELDS, schema.UNSERVED_FIELDS]
    assert sum(len(table) for table in tables) == len(set().union(*tables))  # each field in one table
    assert set().union(*tables) == sglang_fields, (sorted(set().union(*tables) - sglang_fields),
                                                   sorted(sglang_fields - set().union(*tables)))
    assert not schema.ROUTER_FIELDS & sglang_fields
    sampling = {name for name in _class_fields(sglang["sampling"])["SamplingParams"]
                if name not in ("stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len",
                                "is_normalized")}  # set by SGLang's normalize(), never sent
    ours = schema.SAMPLING_FIELDS | schema.IGNORED_SAMPLING | schema.UNSERVED_SAMPLING
    assert ours == sampling, (sorted(ours - sampling), sorted(sampling - ours))


def test_one_prompt_per_request_bodies_fit_sglang_and_its_router(sglang):
    """Through sglang-router (whose `sampling_params` is one object) the client sends each prompt alone, in
    SGLang's one-prompt forms, each seeded as its place in the batch would seed it."""
    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        n = body["sampling_params"]["n"]
        return httpx.Response(200, json=[{"text": "", "output_ids": [4], "meta_info": {
            "id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 2, "completion_tokens": 1,
            "weight_version": "1", "output_token_logprobs": [[-0.5, 4, None]]}}] * n)

    async def scenario():
        client = EngineClient("http://router.invalid", api_key="k" * 20, one_prompt_per_request=True)
        client._http = httpx.AsyncClient(base_url=client.url, transport=httpx.MockTransport(answer))
        groups = await client.generate_samples([[1, 2], [3], [4, 5, 6]], SamplingParams(n=2, max_new_tokens=1),
                                               seed=10, rid="r")
        await client.close()
        return groups

    groups = asyncio.run(scenario())
    assert [len(group) for group in groups] == [2, 2, 2]
    annotations = _class_annotations(sglang["io_struct"])["GenerateReqInput"]
    by_prompt = {tuple(body["input_ids"]): body for body in sent}
    assert sorted(by_prompt) == [(1, 2), (3,), (4, 5, 6)]
    for i, prompt in enumerate([(1, 2), (3,), (4, 5, 6)]):
        body = by_prompt[prompt]
        assert isinstance(body["sampling_params"], dict) and body["sampling_params"]["sampling_seed"] == 10 + 2 * i
        assert body["rid"] == f"r-{i}"
        for key, value in body.items():
            assert _accepts(annotations[key], value), (key, value)


def _finish_reasons(tree: ast.Module) -> dict[str, dict]:
    """SGLang's finish reasons as its `to_json` writes them: class name -> {key: the value's expression}."""
    reasons = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.startswith("FINISH"):
            method = next(item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "to_json")
            returned = next(item.value for item in ast.walk(method) if isinstance(item, ast.Return))
            reasons[node.name] = {key.value: value for key, value in zip(returned.keys, returned.values)}
    return reasons


def test_client_reads_sglangs_own_replies(sglang):
    """`/generate` replies as the pinned SGLang writes them, every meta_info key its tokenizer manager sets present
    and every finish reason its scheduler can give: the client reads text-independent tokens, log-probs (SGLang's
    `[logprob, id, text]` triples), the finish type, a stop string, and SGLang's `weight_version` "default" (no
    trainer update yet) as version 0."""
    from rl360.core.client import reply_sample

    reasons = _finish_reasons(sglang["schedule_batch"])
    assert {"FINISH_MATCHED_TOKEN", "FINISH_MATCHED_STR", "FINISH_LENGTH", "FINISH_ABORT"} <= set(reasons)
    values = {"self.matched": None, "self.length": 3, "self.message": "Aborted", "self.status_code": 503,
              "self.err_type": "AbortError"}
    meta_keys = _meta_info_keys(sglang["tokenizer"])
    for name, fields in reasons.items():
        finish = {key: (value.value if isinstance(value, ast.Constant) else values.get(ast.unparse(value)))
                  for key, value in fields.items()}
        if name == "FINISH_MATCHED_TOKEN":
            finish["matched"] = 2
        elif "matched" in finish:
            finish["matched"] = "</answer>"
        meta = dict.fromkeys(meta_keys, 0)  # every key SGLang may set, as numbers where the client reads none
        meta.update({"id": "r", "finish_reason": finish, "prompt_tokens": 2, "completion_tokens": 3,
                     "weight_version": "default", "output_token_logprobs": [[-0.5, 7, "a"], [-1.5, 8, None],
                                                                            [-0.25, 2, "</s>"]],
                     "input_token_logprobs": [[None, 1, None], [-2.0, 5, None]], "output_top_logprobs": [],
                     "cached_tokens_details": None, "dp_rank": 0,
                     # prompt + output - 1 = 4 tokens x (2 layers x top-2), int32, as the detokenizer encodes them
                     "routed_experts": base64.b64encode(np.arange(16, dtype=np.int32).tobytes()).decode()})
        sample = reply_sample([1, 5], {"text": "ab", "output_ids": [7, 8, 2], "meta_info": meta})
        assert sample.response_ids == [7, 8, 2] and sample.logprobs == [-0.5, -1.5, -0.25], name
        assert sample.routed_experts.tolist() == np.arange(16).reshape(4, 4).tolist(), name
        assert sample.finish_reason == finish["type"] and sample.weight_version == 0, name
        assert sample.stop_matched == (finish.get("matched") if isinstance(finish.get("matched"), str) else None)


def test_sglang_engines_read_their_key_from_the_config_file_the_fleet_writes(sglang, tmp_path):
    """The fleet gives an SGLang engine its key in a YAML file named by `--config` (never on the command line):
    SGLang's `prepare_server_args` merges `--config` files, turning each `key: value` into `--key value`, and
    `api_key` is one of its server arguments."""
    from rl360.rollout.engines import KEY_FILE, _key_file, engine_command

    command = engine_command("sglang", "/m", "bfloat16")
    assert command[command.index("--config") + 1] == KEY_FILE and "--api-key" not in command
    prepare = _function(sglang["server_args"], "prepare_server_args")
    assert "'--config' in argv" in ast.unparse(prepare) and "merge_config_with_args" in ast.unparse(prepare)
    assert "api_key" in _class_fields(sglang["server_args"])["ServerArgs"]
    scalar = _function(sglang["config_parser"], "_add_scalar_arg")
    assert "f'--{key}'" in ast.unparse(scalar)  # `api-key: K` becomes `--api-key K`
    import yaml

    path = _key_file("k-ey_123")
    try:
        assert yaml.safe_load(open(path).read()) == {"api-key": "k-ey_123"}
        assert os.stat(path).st_mode & 0o777 == 0o600
    finally:
        os.unlink(path)
