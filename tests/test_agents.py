"""The agent room: tool-call parsing, the python and image_zoom_in tools, the multi-turn loop, its metrics and
its config.

The loop tests use a Qwen2-style tokenizer (byte-level BPE, the ChatML special tokens and Qwen2.5's chat
template with its tool handling, built here: nothing is downloaded) and a `generate_turn` that replays a
recorded conversation: each call returns the next recorded assistant message's token ids, as an engine
would have produced them, after checking that the context it is handed is exactly the chat template's
rendering of the conversation so far. What is tested is the loop's logic, parsing, token bookkeeping and
masking, not a model."""

import asyncio
import io
import sys

import pytest
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rl360.agents import AgentSettings, agent_metrics, get_parser, run_agent
from rl360.agents.build import agent_from_config
from rl360.agents.group import agent_group
from rl360.agents.parsers import parse_hermes
from rl360.agents.tools import ToolReply, ToolSettings, TrajectoryState, get_tool, tool_schemas
from rl360.agents.tools.images import image_tokens
from rl360.agents.tools.zoom import check_bbox
from rl360.config import ConfigError, load_config
from rl360.core.prompt import ImagePrompt
from rl360.core.sampling import SamplingParams
from rl360.core.trajectory import Sample

# Qwen2.5's chat template (tools in the system prompt, tool messages grouped into one user turn).
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.' }}{%- endif %}{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A chat template that renders as Qwen3's does where it matters here: tools as Qwen2.5's; the last user message
# that is not a wrapped tool response is the query; assistant turns after it keep their reasoning when they have
# one, and the conversation's last assistant turn gets an empty one when it has none; turns before it lose theirs.
QWEN3_LIKE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}{%- endif %}{{- '# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(query=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' and not (message.content.startswith("
    "'<tool_response>') and message.content.endswith('</tool_response>')) %}{%- set ns.query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set thought = '' %}"
    "{%- if '</think>' in content %}{%- set thought = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.query and (loop.last or thought) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def byte_level_tokenizer(path, template: str, special: list[str], added: list[str] = ()):
    """A byte-level BPE tokenizer with no merges (every byte one token), Qwen's special tokens and chat
    `template`, saved in `path` and loaded back as transformers loads it."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=special[1:], chat_template=template)
    tok.add_tokens(list(added))
    tok.save_pretrained(str(path))
    return PreTrainedTokenizerFast.from_pretrained(str(path))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return byte_level_tokenizer(tmp_path_factory.mktemp("qwen_tok"), QWEN25_TEMPLATE, SPECIAL, ADDED)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def png(width, height, colour=(200, 30, 30)):
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def call(name, arguments):
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# ---------------------------------------------------------------- parsers

def test_hermes_reads_several_calls_and_the_text_around_them():
    text = ("Let me look.\n" + call("image_zoom_in", {"bbox_2d": [1, 2, 30, 40], "label": "cat"}) + "\n"
            + call("python", {"code": "print(1)"}))
    result = parse_hermes(text)
    assert [(c.name, c.arguments, c.error) for c in result.calls] == [
        ("image_zoom_in", {"bbox_2d": [1, 2, 30, 40], "label": "cat"}, ""), ("python", {"code": "print(1)"}, "")]
    assert result.content == "Let me look."
    assert parse_hermes("The answer is 4.").calls == ()


@pytest.mark.parametrize("body, error", [
    ('{"name": "python", "arguments": {"code": "x"', "not valid JSON"),
    ('["python"]', "JSON object"),
    ('{"arguments": {}}', "no 'name'"),
    ('{"name": "python", "arguments": [1]}', "must be a JSON object"),
    ('{"name": "python", "arguments": "{bad"}', "arguments of 'python' are not valid JSON"),
])
def test_hermes_turns_a_malformed_call_into_an_error_not_an_exception(body, error):
    result = parse_hermes(f"<tool_call>{body}</tool_call> then " + call("python", {"code": "1"}))
    assert error in result.calls[0].error
    assert result.calls[1].name == "python" and not result.calls[1].error  # the next call is still read
    assert result.errors == 1


def test_hermes_accepts_string_arguments_and_reads_an_unclosed_last_call():
    result = parse_hermes('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}</tool_call>')
    assert result.calls[0].arguments == {"code": "1"}
    cut = parse_hermes('<tool_call>{"name": "python", "arguments": {"code": "1"')
    assert "not closed" in cut.calls[0].error


def test_hermes_reads_a_close_tag_inside_a_string_as_text_and_keeps_only_text_before_the_calls():
    """As vLLM's and SGLang's Hermes parsers: the JSON object is read whole, so a `</tool_call>` in a string
    argument does not end the call, and the turn's content is what precedes its first call."""
    code = 'print("</tool_call> is a tag")'
    result = parse_hermes("Run it.\n" + call("python", {"code": code}) + "\nDone, waiting.")
    assert [(c.name, c.arguments, c.error) for c in result.calls] == [("python", {"code": code}, "")]
    assert result.content == "Run it."
    cut = parse_hermes('<tool_call>{"name": "python", "arguments": {"code": "1"}}')  # complete JSON, cut close
    assert cut.calls[0].arguments == {"code": "1"} and not cut.calls[0].error


def test_parsers_by_name_and_by_reference():
    assert get_parser("hermes") is parse_hermes
    assert get_parser("rl360.agents.parsers:parse_hermes") is parse_hermes
    with pytest.raises(KeyError, match="hermes"):
        get_parser("nope")


# ---------------------------------------------------------------- python tool

def run(coro):
    return asyncio.run(coro)


def test_python_keeps_state_per_trajectory_and_survives_crash_hang_and_flood():
    # a time limit with room for a loaded machine's interpreter start-up (a cell that loops forever takes all of it)
    tool = get_tool("python", ToolSettings(timeout_s=8, memory_mb=512, max_output_chars=300))
    one, two = TrajectoryState(), TrajectoryState()
    assert run(tool.call({"code": "x = 41\nprint('set')"}, one)).text == "set\n"
    assert run(tool.call({"code": "x = 1000"}, two)).error == ""
    assert run(tool.call({"code": "x += 1\nprint(x)"}, one)).text == "42\n"
    assert run(tool.call({"code": "print(x)"}, two)).text == "1000\n"  # trajectories do not share state
    failures = 0
    for bad, why in [("raise ValueError('boom')", "ValueError: boom"), ("while True:\n    pass", "time limit"),
                     ("print('y' * 100_000_000)", "cut"), ("import os\nos.write(1, b'z' * 100_000_000)", "output"),
                     ("import os\nos.abort()", "stopped"), ("b = bytearray(900 << 20)", "MemoryError")]:
        reply = run(tool.call({"code": bad}, one))
        assert reply.failed and why in reply.error + reply.text, (bad, reply)
        assert len(reply.text) < 400
        failures += reply.failed
        after = run(tool.call({"code": "print(x)"}, one))  # the failed cell left the state as it was
        assert after.text == "42\n" and not after.failed, (bad, after)
    assert failures == 6
    cut = run(tool.call({"code": "y = 5\nprint('y' * 10_000)"}, one))  # cut output: an error, but the cell ran
    assert "cut" in cut.error and run(tool.call({"code": "print(x + y)"}, one)).text == "47\n"
    assert run(tool.call({"code": ""}, one)).error  # bad arguments: an error reply


def test_python_binds_the_rows_variables_and_runs_calls_side_by_side_each_in_its_own_sandbox():
    tool = get_tool("python", ToolSettings(timeout_s=30, memory_mb=320, workers=3))
    states = [TrajectoryState(kwargs={"python": {"variables": {"a": 123456, "b": 654321 + i}}}) for i in range(3)]
    # each cell holds 200 MB for a while: within its own cap, over it were the three counted together (as they
    # were when concurrent calls shared one process's sandbox uid, whose sweep also killed the others' cells)
    code = "import time\nblock = b'x' * (200 << 20)\ntime.sleep(1.5)\nprint(a * b % 7)"

    async def side_by_side():
        return await asyncio.gather(*(tool.call({"code": code}, state) for state in states))

    replies = run(side_by_side())
    expected = [(f"{123456 * (654321 + i) % 7}\n", "") for i in range(3)]
    assert [(reply.text, reply.error) for reply in replies] == expected
    bad = TrajectoryState(kwargs={"python": {"variables": {"not a name": 1}}})
    assert "variables" in run(tool.call({"code": "print(1)"}, bad)).error
    tool.close()


def test_a_turn_ends_at_a_finished_call_and_the_tools_quickstart_call_is_one_token(tmp_path):
    from rl360.agents.group import tool_kwargs
    from rl360.agents.loop import call_end_ids, tool_tokens
    from rl360.quickstart.assets import build_tokenizer
    from rl360.quickstart.tools_assets import CALL, CHAT_TEMPLATE, CODE, WORDS

    tokenizer = build_tokenizer(tmp_path, max_answer=6, words=WORDS, chat_template=CHAT_TEMPLATE)
    assert call_end_ids(tokenizer, parse_hermes) == [tokenizer.convert_tokens_to_ids(CALL)]
    with pytest.raises(ValueError, match="names no call_end"):  # a parser without `call_end`
        call_end_ids(tokenizer, lambda text: parse_hermes(text))
    assert [call.arguments for call in parse_hermes(CALL).calls] == [{"code": CODE}]
    assert "\\boxed" not in CALL  # the call's own text holds no answer for the reward to read
    pending = tool_tokens(tokenizer, CALL, [{"role": "tool", "name": "python", "content": "\\boxed{5}\n"}])
    assert tokenizer.convert_ids_to_tokens(pending) == [  # the turn's closing added; the reply one token
        "<|im_end|>", "\n", "<|im_start|>", "tool", "\n", "\\boxed{5}", "<|im_end|>", "\n", "<|im_start|>", "assistant",
        "\n"]
    row = {"extra_info": {"tools_kwargs": {"python": {"create_kwargs": {"variables": {"a": 1}}}, "zoom": None}}}
    assert tool_kwargs(row) == {"python": {"variables": {"a": 1}}}
    assert tool_kwargs({"extra_info": None}) == {} and tool_kwargs({}) == {}


def test_python_sees_the_images_and_returns_the_ones_it_shows(monkeypatch):
    # the sandbox's /usr/bin/python3 may lack PIL: run this interpreter, with the isolation it can have
    monkeypatch.setenv("RL360_SANDBOX_ISOLATION", "network,filesystem")
    monkeypatch.setenv("RL360_SANDBOX_REQUIRE_ISOLATION", "0")
    tool = get_tool("python", ToolSettings(timeout_s=20, python=sys.executable, max_image_tokens=10_000))
    state = TrajectoryState(images=[png(100, 60)])
    code = ("print(image_clue_0.size, image_clue_0.getpixel((0, 0)))\n"
            "image_clue_0.crop((0, 0, 56, 56)).resize((112, 112)).show()\n"
            "from PIL import Image\nImage.new('RGB', (40, 30), (0, 0, 255)).save('blue.png')")
    reply = run(tool.call({"code": code}, state))
    assert not reply.failed, reply
    assert reply.text == "(100, 60) (200, 30, 30)\n"
    assert len(reply.images) == 2
    shown, saved = (Image.open(io.BytesIO(data)) for data in reply.images)
    assert shown.size == (112, 112) and shown.getpixel((5, 5)) == (200, 30, 30)
    assert saved.getpixel((1, 1)) == (0, 0, 255) and saved.size[0] % 28 == 0  # resized by Qwen-VL's rule
    assert state.image_tokens == 16 + image_tokens(30, 40, 3136, 1003520)
    # images beyond the trajectory's budget are dropped, with an error
    state.image_tokens = 9_995  # the 100 x 60 image takes 8 tokens
    reply = run(tool.call({"code": "image_clue_0.show()"}, state))
    assert reply.images == () and "budget" in reply.error


# ---------------------------------------------------------------- image_zoom_in

def test_check_bbox_follows_deepeyes_clamp_check_and_scale():
    assert check_bbox([10, 20, 110, 220], 640, 480) == (10, 20, 110, 220)
    assert check_bbox([-50, 400, 300, 900], 640, 480) == (0, 400, 300, 480)  # clamped
    assert check_bbox([-5000, 0, 50, 40], 640, 480) == (0, 0, 50, 40)  # clamped before the aspect check
    assert check_bbox([300, 200, 310, 220], 640, 480) == (291, 182, 319, 238)  # 10 x 20 -> 28 x 56, same centre
    assert check_bbox([100, 100, 110, 104], 640, 480) == (70, 88, 140, 116)  # shorter side to 28, aspect kept
    assert check_bbox([0, 470, 5, 480], 640, 480) == (0, 424, 28, 480)  # scaled, pushed back inside
    for bad, why in [([1, 2, 3], "4 numbers"), ("0,0,5,5", "4 numbers"), ([0, "a", 5, 5], "finite"),
                     ([50, 10, 20, 40], "x1 < x2"), ([700, 10, 800, 90], "x1 < x2"), ([0, 0, 1000, 2], "thin"),
                     ([0, 0, float("nan"), 5], "finite")]:
        with pytest.raises(ValueError, match=why):
            check_bbox(bad, 640, 480)
    for box, size in [([0, 0, 9, 9], 20), ([0, 0, 5, 30], 30)]:  # scaled up, then down to fit: under 28 again
        with pytest.raises(ValueError, match="under the minimum 28 x 28"):
            check_bbox(box, size, size)


def test_zoom_crops_resizes_and_charges_the_budget():
    image = Image.new("RGB", (640, 480), (0, 0, 0))
    image.paste((255, 0, 0), (100, 100, 300, 200))
    out = io.BytesIO()
    image.save(out, format="PNG")
    settings = ToolSettings(max_image_tokens=60, max_pixels=200 * 200, min_pixels=56 * 56)
    tool = get_tool("image_zoom_in", settings)
    state = TrajectoryState(images=[out.getvalue()])
    reply = run(tool.call({"bbox_2d": [100, 100, 300, 200], "label": "red box"}, state))
    assert reply.text == "Zoomed in on the image to the region [100, 100, 300, 200] with label red box."
    crop = Image.open(io.BytesIO(reply.images[0]))
    assert crop.width * crop.height <= 200 * 200 and crop.width % 28 == 0 and crop.height % 28 == 0
    assert crop.getpixel((crop.width // 2, crop.height // 2)) == (255, 0, 0)
    assert state.image_tokens == (crop.width // 28) * (crop.height // 28)
    small = run(tool.call({"bbox_2d": [100, 100, 105, 103]}, state))
    assert Image.open(io.BytesIO(small.images[0])).size == (84, 56)  # under 28 px: 47 x 29 cropped, then resized
    assert run(tool.call({"bbox_2d": [5, 5, 1, 1]}, state)).error.startswith("bbox_2d")
    assert "no image" in run(tool.call({"bbox_2d": [0, 0, 9, 9]}, TrajectoryState())).error
    spent = run(tool.call({"bbox_2d": [0, 0, 640, 480]}, state))
    assert "budget" in spent.error and spent.images == ()


# ---------------------------------------------------------------- the loop

class Replay:
    """Replays recorded engine output: turn k returns the token ids of `turns[k]`, and checks the context it is
    handed is the chat template's rendering of `conversation[:k]`."""

    def __init__(self, tok, turns, expected_contexts=None):
        self.tok, self.turns, self.calls, self.expected = tok, turns, [], expected_contexts

    async def __call__(self, prompt, params, seed):
        ids = prompt.ids if isinstance(prompt, ImagePrompt) else prompt
        k = len(self.calls)
        self.calls.append((prompt, params, seed))
        if self.expected is not None:
            assert ids == self.expected[k], f"turn {k}: the context differs from the template's rendering"
        out = encode(self.tok, self.turns[k] + "<|im_end|>")
        finish = "stop"
        if len(out) > params.max_new_tokens:
            out, finish = out[: params.max_new_tokens], "length"
        return Sample(list(ids), out, [-0.25] * len(out), finish, weight_version=7)


class Echo:
    name = "echo"
    schema = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object", "properties": {}}}}

    async def call(self, arguments, state):
        await asyncio.sleep(0.01)
        return ToolReply(f"echo {arguments['say']}")


class Broken:
    name = "broken"
    schema = {"type": "function", "function": {"name": "broken", "parameters": {"type": "object", "properties": {}}}}

    async def call(self, arguments, state):
        raise RuntimeError("kaput")


class Slow:
    name = "slow"
    schema = {"type": "function", "function": {"name": "slow", "parameters": {"type": "object", "properties": {}}}}

    async def call(self, arguments, state):
        await asyncio.sleep(30)
        return ToolReply("late")


TOOLS = {"echo": Echo(), "broken": Broken(), "slow": Slow()}
QUESTION = [{"role": "system", "content": "You are a careful agent."}, {"role": "user", "content": "What is 6*7?"}]


def render(tok, messages, generation):
    return tok.apply_chat_template(messages, tools=tool_schemas(TOOLS), tokenize=False,
                                   add_generation_prompt=generation)


def test_the_trajectory_is_the_template_rendering_of_the_conversation(tokenizer):
    turns = [
        "I will ask twice.\n" + call("echo", {"say": "a"}) + "\n" + call("broken", {}),
        "Bad JSON next.\n<tool_call>{oops</tool_call>",
        "Then unknown.\n" + call("nosuch", {}) + call("echo", {"say": "b"}),
        "The answer is 42.",
    ]
    replies = [["echo a", "Error: the tool failed: RuntimeError: kaput"],
               ["Error: the tool call is not valid JSON: Expecting property name enclosed in double quotes at char 1"],
               ["Error: there is no tool 'nosuch'; the tools are ['broken', 'echo', 'slow']", "echo b"]]
    conversation, contexts = list(QUESTION), []
    for k, text in enumerate(turns):
        contexts.append(encode(tokenizer, render(tokenizer, conversation, True)))
        conversation.append({"role": "assistant", "content": text})
        conversation += [{"role": "tool", "content": content} for content in (replies[k] if k < 3 else [])]
    prompt = contexts[0]
    replay = Replay(tokenizer, turns, contexts)
    settings = AgentSettings(max_turns=6, max_response_length=4000, tool_timeout_s=1)
    sample = run(run_agent(replay, prompt, tokenizer, TOOLS, parse_hermes, settings, SamplingParams(), seed=3))
    whole = render(tokenizer, conversation, False)
    assert whole.endswith("<|im_end|>\n")
    assert sample.prompt_ids + sample.response_ids == encode(tokenizer, whole[:-1])
    assert sample.prompt_ids == prompt and sample.finish_reason == "stop" and len(replay.calls) == 4
    # loss mask: 1 exactly on the generated tokens (each turn's text and its <|im_end|>), 0 on the rest
    expected_mask, position = [], len(prompt)
    for k, text in enumerate(turns):
        generated = encode(tokenizer, text + "<|im_end|>")
        start = len(contexts[k]) - len(prompt)
        expected_mask += [0] * (start - len(expected_mask)) + [1] * len(generated)
        assert sample.response_ids[start:start + len(generated)] == generated
        position = start + len(generated)
    assert position == len(sample.response_ids)
    assert sample.mask() == expected_mask
    assert [lp for lp, m in zip(sample.logprobs, expected_mask, strict=True) if not m] == [0.0] * expected_mask.count(0)
    assert set(lp for lp, m in zip(sample.logprobs, expected_mask, strict=True) if m) == {-0.25}
    assert [turn.generated for turn in sample.turn_list()] == [True, False, True, False, True, False, True]
    # what the trace says
    trace = sample.trace
    assert trace.ended_by == "done" and len(trace.turns) == 4
    assert [(c.name, bool(c.error)) for c in trace.calls] == [("echo", False), ("broken", True), ("?", True),
                                                             ("nosuch", True), ("echo", False)]
    assert [t.tool_tokens for t in trace.turns[:3]] == [len(contexts[k + 1]) - len(contexts[k]) - t.generated_tokens
                                                       for k, t in enumerate(trace.turns[:3])]
    assert len({seed for _, _, seed in replay.calls}) == 4
    assert [params.max_new_tokens for _, params, _ in replay.calls][0] == 4000


def test_a_qwen3_template_trajectory_keeps_its_thinking_and_is_the_templates_rendering(tmp_path):
    """Qwen3's template drops the reasoning of turns before the last query and adds an empty one to a last turn
    without any: the loop's tool tokens still fit it, and the whole trajectory, thinking included, is the template's
    rendering of the conversation."""
    qwen3 = byte_level_tokenizer(tmp_path, QWEN3_LIKE_TEMPLATE, SPECIAL, ADDED)
    history = [*QUESTION, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nsure"},
               {"role": "user", "content": "What is 6*7?"}]
    dropped = render(qwen3, history, False)
    assert "hm" not in dropped and dropped.endswith("<|im_start|>user\nWhat is 6*7?<|im_end|>\n")  # as Qwen3 does
    turns = ["<think>\nI should ask the tool.\n</think>\n\n" + call("echo", {"say": "a"}),
             "<think>\nIt said a; once more.\n</think>\n\n" + call("echo", {"say": "b"}),
             "<think>\nDone.\n</think>\n\nThe answer is 42."]
    replies = [["echo a"], ["echo b"], []]
    conversation, contexts = list(QUESTION), []
    for text, said in zip(turns, replies):
        contexts.append(encode(qwen3, render(qwen3, conversation, True)))
        conversation.append({"role": "assistant", "content": text})
        conversation += [{"role": "tool", "content": content} for content in said]
    replay = Replay(qwen3, turns, contexts)  # each turn's context checked against the template's rendering
    settings = AgentSettings(max_turns=6, max_response_length=4000, tool_timeout_s=1)
    sample = run(run_agent(replay, contexts[0], qwen3, TOOLS, parse_hermes, settings, SamplingParams(), seed=3))
    whole = render(qwen3, conversation, False)
    assert whole.count("<think>") == 3 and "I should ask the tool." in whole
    assert sample.prompt_ids + sample.response_ids == encode(qwen3, whole[:-1])
    assert sample.trace.ended_by == "done" and len(replay.calls) == 3


def test_max_turns_and_the_token_budget_end_the_trajectory(tokenizer):
    looping = [f"Again {k}.\n" + call("echo", {"say": str(k)}) for k in range(10)]
    prompt = encode(tokenizer, render(tokenizer, QUESTION, True))
    replay = Replay(tokenizer, looping)
    sample = run(run_agent(replay, prompt, tokenizer, TOOLS, parse_hermes, AgentSettings(max_turns=3,
                                                                                        max_response_length=5000)))
    assert sample.trace.ended_by == "max_turns" and len(replay.calls) == 3
    assert [len(t.calls) for t in sample.trace.turns] == [1, 1, 0]  # the last turn's call is not run
    assert sum(sample.mask()) == sum(t.generated_tokens for t in sample.trace.turns)

    first = len(encode(tokenizer, looping[0] + "<|im_end|>"))
    budget = first + 60  # room for the first turn and its reply, not for much of the second turn
    replay = Replay(tokenizer, looping)
    sample = run(run_agent(replay, prompt, tokenizer, TOOLS, parse_hermes, AgentSettings(max_turns=5,
                                                                                        max_response_length=budget)))
    assert len(sample.response_ids) == budget and sample.finish_reason == "length"
    assert sample.trace.ended_by == "length"
    assert replay.calls[1][1].max_new_tokens == budget - first - sample.trace.turns[0].tool_tokens

    tight = first + 5  # the first reply alone does not fit: the trajectory ends before it
    replay = Replay(tokenizer, looping)
    sample = run(run_agent(replay, prompt, tokenizer, TOOLS, parse_hermes, AgentSettings(max_turns=5,
                                                                                        max_response_length=tight)))
    assert sample.trace.ended_by == "budget" and len(sample.response_ids) == first and len(replay.calls) == 1


def test_a_hanging_tool_times_out_and_the_loop_goes_on(tokenizer):
    turns = [call("slow", {}) + call("echo", {"say": "x"}), "Done."]
    prompt = encode(tokenizer, render(tokenizer, QUESTION, True))
    sample = run(run_agent(Replay(tokenizer, turns), prompt, tokenizer, TOOLS, parse_hermes,
                           AgentSettings(tool_timeout_s=0.2)))
    slow, echo = sample.trace.calls
    assert slow.timed_out and slow.seconds < 5 and not echo.error
    text = tokenizer.decode(sample.response_ids)
    assert "Error: the tool ran past 0.2 s" in text and "echo x" in text and text.endswith("Done.<|im_end|>")
    metrics = agent_metrics([sample])
    assert metrics["agent/tool_timeouts"] == 1 and metrics["agent/tool_errors"] == 1
    assert metrics["agent/calls/slow"] == 1 and metrics["agent/errors/echo"] == 0


class Holding:
    """A tool that holds something per trajectory: it records the states it was called with and released."""

    name = "hold"
    schema = {"type": "function", "function": {"name": "hold", "parameters": {"type": "object", "properties": {}}}}

    def __init__(self):
        self.called, self.released = [], []

    async def call(self, arguments, state):
        self.called.append(state)
        return ToolReply("held")

    def release(self, state):
        self.released.append(state)


def test_the_loop_releases_each_tool_once_per_trajectory_however_it_ends(tokenizer):
    hold = Holding()
    tools = {**TOOLS, "hold": hold, "hold_alias": hold}
    prompt = encode(tokenizer, render(tokenizer, QUESTION, True))
    run(run_agent(Replay(tokenizer, [call("hold", {}), "Done."]), prompt, tokenizer, tools, parse_hermes,
                  AgentSettings()))
    assert len(hold.called) == 1 and hold.released == hold.called  # once, though it has two names

    replay = Replay(tokenizer, [call("hold", {})])

    async def failing(prompt, params, seed):  # the engine fails at the second turn
        if replay.calls:
            raise RuntimeError("engine gone")
        return await replay(prompt, params, seed)

    hold.called.clear(), hold.released.clear()
    with pytest.raises(RuntimeError, match="engine gone"):
        run(run_agent(failing, prompt, tokenizer, tools, parse_hermes, AgentSettings()))
    assert len(hold.called) == 1 and hold.released == hold.called


def test_the_python_interpreter_is_gone_once_its_trajectory_ends(tokenizer):
    import os
    import time

    python = get_tool("python", ToolSettings(timeout_s=20))
    tools = {**TOOLS, "python": python}
    turns = [call("python", {"code": "import os\nprint(os.getpid())"}), "Done."]
    prompt = encode(tokenizer, render(tokenizer, QUESTION, True))
    try:
        sample = run(run_agent(Replay(tokenizer, turns), prompt, tokenizer, tools, parse_hermes, AgentSettings()))
        assert not sample.trace.calls[0].error, sample.trace.calls
        pid = int(tokenizer.decode(sample.response_ids).split("<tool_response>\n")[1].split()[0])
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid}")
    finally:
        python.close()


def test_tool_images_join_an_image_prompt_and_are_dropped_from_a_text_prompt(tokenizer):
    picture = png(280, 140)
    zoom = {"image_zoom_in": get_tool("image_zoom_in", ToolSettings())}
    turns = [call("image_zoom_in", {"bbox_2d": [0, 0, 56, 56]}), "Red."]
    head = encode(tokenizer, render(tokenizer, QUESTION, True))
    sample = run(run_agent(Replay(tokenizer, turns), ImagePrompt(head, (picture,)), tokenizer, zoom,
                           parse_hermes, AgentSettings()))
    assert len(sample.images) == 2 and sample.images[0] == picture
    crop = Image.open(io.BytesIO(sample.images[1]))
    pads = image_tokens(crop.height, crop.width, 3136, 1003520)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert sample.response_ids.count(pad) == pads > 0 and sample.trace.calls[0].images == 1
    text = sample.continuation()
    assert isinstance(text, ImagePrompt) and text.images == sample.images

    plain = run(run_agent(Replay(tokenizer, turns), head, tokenizer, zoom, parse_hermes, AgentSettings()))
    assert plain.images is None and pad not in plain.response_ids and plain.trace.images_dropped == 0  # no image
    assert "no image" in plain.trace.calls[0].error

    class Plot:  # a tool that draws, on a text prompt: its image cannot be shown
        name, schema = "plot", {"type": "function", "function": {"name": "plot"}}

        async def call(self, arguments, state):
            return ToolReply("drawn", (picture,))

    plotted = run(run_agent(Replay(tokenizer, [call("plot", {}), "Ok."]), head, tokenizer, {"plot": Plot()},
                            parse_hermes, AgentSettings()))
    assert plotted.images is None and plotted.trace.images_dropped == 1 and pad not in plotted.response_ids
    assert "drawn\n[1 image(s) not shown: this conversation has no images]" in tokenizer.decode(plotted.response_ids)


def test_a_turn_that_sampled_the_image_token_ends_the_trajectory(tokenizer):
    """An engine handed a sampled image token back as context would take it for an image's place: the trajectory
    ends after that turn, its call not run."""
    picture = png(112, 112)
    zoom = {"image_zoom_in": get_tool("image_zoom_in", ToolSettings())}
    head = encode(tokenizer, render(tokenizer, QUESTION, True))
    turns = ["<|image_pad|>" + call("image_zoom_in", {"bbox_2d": [0, 0, 56, 56]}), "Red."]
    replay = Replay(tokenizer, turns)
    sample = run(run_agent(replay, ImagePrompt(head, (picture,)), tokenizer, zoom, parse_hermes, AgentSettings()))
    assert sample.trace.ended_by == "image_token" and len(replay.calls) == 1 and not sample.trace.calls
    assert sample.images == (picture,) and sample.mask() == [1] * len(sample.response_ids)


def test_stop_after_call_ends_a_turn_at_the_token_that_closes_a_call(tokenizer):
    prompt = encode(tokenizer, render(tokenizer, QUESTION, True))
    replay = Replay(tokenizer, [call("echo", {"say": "a"}), "Done."])
    closing = tokenizer.convert_tokens_to_ids("</tool_call>")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    settings = AgentSettings(max_response_length=500, stop_after_call=True)
    run(run_agent(replay, prompt, tokenizer, TOOLS, parse_hermes, settings, SamplingParams(stop_token_ids=[eos])))
    assert [params.stop_token_ids for _, params, _ in replay.calls] == [sorted([eos, closing])] * 2
    replay = Replay(tokenizer, [call("echo", {"say": "a"}), "Done."])
    run(run_agent(replay, prompt, tokenizer, TOOLS, parse_hermes, AgentSettings(),
                  SamplingParams(stop_token_ids=[eos])))
    assert replay.calls[0][1].stop_token_ids == [eos]


def test_max_turn_tokens_caps_each_turn_and_a_cut_turn_ends_the_trajectory(tokenizer):
    prompt = encode(tokenizer, render(tokenizer, QUESTION, True))
    first = call("echo", {"say": "a"})
    capped = len(encode(tokenizer, first + "<|im_end|>"))  # room for the whole first turn, not for the second
    long = "The answer is, as the tool said, a. " * 20
    replay = Replay(tokenizer, [first, long])
    settings = AgentSettings(max_response_length=500, max_turn_tokens=capped)
    sample = run(run_agent(replay, prompt, tokenizer, TOOLS, parse_hermes, settings))
    assert [params.max_new_tokens for _, params, _ in replay.calls] == [capped, capped]
    assert [t.finish_reason for t in sample.trace.turns] == ["stop", "length"] and sample.trace.ended_by == "length"
    assert sample.trace.turns[1].generated_tokens == capped
    tight = AgentSettings(max_response_length=capped + sample.trace.turns[0].tool_tokens + 2, max_turn_tokens=capped)
    replay = Replay(tokenizer, [first, long])
    run(run_agent(replay, prompt, tokenizer, TOOLS, parse_hermes, tight))
    assert replay.calls[1][1].max_new_tokens == 2  # the budget left, below the cap


def test_rollout_stop_tokens_end_responses_and_must_be_single_tokens(tokenizer):
    from rl360.rollout.sampler import stop_token_ids

    eos, closing = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("</tool_call>")
    assert stop_token_ids(tokenizer, []) == [eos]
    assert stop_token_ids(tokenizer, ["</tool_call>", "<|im_end|>"]) == sorted([eos, closing])
    with pytest.raises(ConfigError, match=r"rollout.stop_tokens: 'Done' is 4 tokens"):
        stop_token_ids(tokenizer, ["Done"])


def test_batched_turns_go_in_step_one_request_a_round(tokenizer):
    """`agent.batch_turns`: each round of turns is one fleet request, in trajectory order; a turn past its own
    budget (the round's is the largest) is cut there, finish "length"."""
    from rl360.agents.build import Agent
    from rl360.agents.group import agent_group

    asks = {"Ask briefly.": call("echo", {"say": "a"}), "Ask at length, please.": "Let me see, let me see, let me "
            "see, let me see.\n" + call("echo", {"say": "b"}), "Answer.": "42."}
    answer = "The answer, after a long and careful look at what the tool said, is 42."

    class Fleet:
        requests = []

        async def generate(self, prompts, params, seed, metrics, budgets=None):
            self.requests.append((len(prompts), params.max_new_tokens, seed))
            assert budgets is None or max(budgets) == params.max_new_tokens
            out = []
            for prompt in prompts:
                text = tokenizer.decode(prompt)
                reply = answer if "echo" in text.split("<|im_start|>user")[-1] else \
                    next(turn for question, turn in asks.items() if question in text)
                ids = encode(tokenizer, reply + "<|im_end|>")[:params.max_new_tokens]
                out.append([Sample(list(prompt), ids, [-0.5] * len(ids), "stop", weight_version=1)])
            return out

    prompts = [encode(tokenizer, render(tokenizer, [{"role": "user", "content": question}], True))
               for question in asks]
    budget = 160
    settings = AgentSettings(max_turns=3, max_response_length=budget, batch_turns=True)
    generate_group = agent_group(Agent({"echo": Echo()}, parse_hermes, settings), tokenizer)
    fleet = Fleet()
    groups = run(generate_group(fleet, prompts, SamplingParams(n=2), 100, {}))
    # the first trajectory's turn seeds (see rl360.agents.loop._turn_seed)
    assert [(count, seed) for count, _, seed in fleet.requests] == [(6, 100 * 1_000_003), (4, 100 * 1_000_003 + 1)]
    brief, long, plain = (group[0] for group in groups)
    assert plain.trace.ended_by == "done" and len(plain.trace.turns) == 1
    assert fleet.requests[1][1] == budget - (len(brief.response_ids) - brief.trace.turns[1].generated_tokens)
    assert brief.finish_reason == "stop" and brief.trace.turns[1].generated_tokens == len(encode(tokenizer, answer)) + 1
    assert long.finish_reason == "length" and len(long.response_ids) == budget
    assert groups[0][1].response_ids == brief.response_ids


class ScriptedEngine:
    """An engine (the fleet's `Engine` protocol, in memory) that draws the scripted turns of one trajectory token
    by token: the turn and the tokens already drawn of it are read off the context it is handed, which must hold
    the turn's tokens so far exactly. It draws under its weight `version`, each token's log-prob -(version + 1).
    Turn `cut_turn` stops halfway (`halfway` set) until a pause aborts it."""

    kind, url, log_path, supports_pause = "scripted", "", None, True

    def __init__(self, tok, turns, cut_turn):
        self.tok, self.turns, self.cut_turn = tok, turns, cut_turn
        self.index, self.version, self.usable = 0, 0, False
        self.requests, self.halfway, self.aborting = [], asyncio.Event(), asyncio.Event()

    async def generate(self, prompts, params, seed):
        [prompt] = prompts
        ids = prompt.ids if isinstance(prompt, ImagePrompt) else prompt
        self.requests.append(prompt)
        header = encode(self.tok, "<|im_start|>assistant\n")
        starts = [i + len(header) for i in range(len(ids)) if ids[i:i + len(header)] == header]
        turn, drawn = len(starts) - 1, ids[starts[-1]:]
        script = encode(self.tok, self.turns[turn] + "<|im_end|>")
        assert script[:len(drawn)] == drawn, "the context lost or repeated tokens of the turn"
        out, version = [], self.version
        for token in script[len(drawn):len(drawn) + params.max_new_tokens]:
            if turn == self.cut_turn and not drawn and len(out) == len(script) // 2:
                self.halfway.set()
                await self.aborting.wait()
                return [[Sample(list(ids), out, [-(version + 1.0)] * len(out), "abort", weight_version=version,
                                images=getattr(prompt, "images", None))]]
            out.append(token)
            await asyncio.sleep(0)
        finish = "stop" if out[-1:] == script[-1:] else "length"
        return [[Sample(list(ids), out, [-(version + 1.0)] * len(out), finish, weight_version=version,
                        images=getattr(prompt, "images", None))]]

    async def pause(self):
        self.aborting.set()
        return True

    async def sync_weights(self, policy, version, peers, args):
        return {}

    async def start(self): ...
    async def resume_generation(self): ...
    async def resume(self, tags): return False
    async def release(self, tags): return False
    def stop(self): ...


def test_a_turn_a_weight_update_cuts_goes_on_under_the_new_weights_and_the_trajectory_goes_on(tokenizer, tmp_path):
    """`rollout.partial` with the agent loop: a weight update aborts a turn halfway; the fleet continues it from
    the trajectory's context (its images included) and the turn's tokens so far, under the new weights; the loop
    parses the whole turn (its call lies after the cut), keeps the trajectory's images and records one turn."""
    from rl360.agents.build import Agent
    from rl360.agents.group import agent_group
    from rl360.cluster.placement import make_placement
    from rl360.config import RolloutConfig
    from rl360.rollout.fleet import EngineFleet

    picture, drawn = png(280, 140), png(56, 56, (30, 200, 30))

    class Plot:
        name, schema = "plot", {"type": "function", "function": {"name": "plot"}}

        async def call(self, arguments, state):
            return ToolReply("drawn", (drawn,))

    turns = [call("plot", {}), "Let me look closely at what was drawn, then ask.\n" + call("echo", {"say": "green"}),
             "Green."]
    engine = ScriptedEngine(tokenizer, turns, cut_turn=1)
    rollout = RolloutConfig(engine="server", mode="async", partial=True)
    fleet = EngineFleet(rollout, None, make_placement(1, False, rollout, gpus=0), None, tmp_path, engines=[engine])
    agent = Agent({"plot": Plot(), "echo": Echo()}, parse_hermes, AgentSettings(max_turns=4, max_response_length=4000))
    prompt = ImagePrompt(encode(tokenizer, render(tokenizer, QUESTION, True)), (picture,))
    metrics = {}

    async def update_mid_turn():
        await fleet.start()
        try:
            trajectories = asyncio.ensure_future(agent_group(agent, tokenizer)(
                fleet, [prompt], SamplingParams(n=1, max_new_tokens=4000), 5, metrics))
            await engine.halfway.wait()
            await fleet.sync_weights(1)
            return (await trajectories)[0][0]
        finally:
            fleet.close()

    sample = run(update_mid_turn())
    trace = sample.trace
    assert trace.ended_by == "done" and [turn.resumed for turn in trace.turns] == [0, 1, 0]
    assert [call.name for call in trace.calls] == ["plot", "echo"] and not any(call.error for call in trace.calls)
    assert metrics["agent/cut_turns"] == 1 and sample.resumed == 1 and sample.images == (picture, drawn)
    # four requests: turn 0, turn 1 until the cut, the rest of turn 1 from where it was, turn 2
    first, cut, rest, last = engine.requests
    assert isinstance(rest, ImagePrompt) and rest.images == (picture, drawn) == last.images
    generated = [span for span in sample.turn_list() if span.generated]
    spans = [sample.response_ids[span.start:span.end] for span in generated]
    assert spans == [encode(tokenizer, text + "<|im_end|>") for text in turns]
    assert rest.ids == cut.ids + spans[1][:len(spans[1]) // 2]
    assert sample.prompt_ids + sample.response_ids == last.ids + spans[2]
    versions, mask = sample.versions(), sample.mask()
    half = generated[1].start + len(spans[1]) // 2  # old weights drew every generated token before it, new ones after
    assert all(version == (i >= half) for i, (version, m) in enumerate(zip(versions, mask)) if m)
    assert mask == [int(any(span.start <= i < span.end for span in generated)) for i in range(len(mask))]
    assert all(lp == (-(v + 1.0) if m else 0.0) for lp, v, m in zip(sample.logprobs, versions, mask, strict=True))


def test_agent_metrics_summarise_a_batch(tokenizer):
    prompt = encode(tokenizer, render(tokenizer, QUESTION, True))
    done = run(run_agent(Replay(tokenizer, ["42."]), prompt, tokenizer, TOOLS, parse_hermes, AgentSettings()))
    looped = run(run_agent(Replay(tokenizer, [call("echo", {"say": "1"}), call("broken", {}), "x"]),
                           prompt, tokenizer, TOOLS, parse_hermes, AgentSettings(max_turns=2)))
    metrics = agent_metrics([done, looped])
    assert metrics["agent/turns/mean"] == 1.5 and metrics["agent/turns/max"] == 2
    assert metrics["agent/tool_calls/mean"] == 0.5 and metrics["agent/tool_calls/max"] == 1
    assert metrics["agent/hit_max_turns"] == 0.5 and metrics["agent/tool_errors"] == 0
    tool = len(looped.mask()) - sum(looped.mask())
    assert metrics["agent/tool_tokens/mean"] == tool / 2 > 0
    assert metrics["agent/generated_tokens/mean"] == (sum(done.mask()) + sum(looped.mask())) / 2
    assert agent_metrics([]) == {}


# ---------------------------------------------------------------- config

BASE = ["model.path=m", "data.train_files=[x.parquet]"]


def test_agent_config_is_validated_and_built():
    assert agent_from_config(load_config(None, BASE)) is None
    with pytest.raises(ConfigError, match="agent.tools"):
        load_config(None, BASE + ["agent.loop=tools"])
    with pytest.raises(ConfigError, match="agent.loop"):
        load_config(None, BASE + ["agent.loop=chat", "agent.tools=[python]"])
    with pytest.raises(ConfigError, match="agent.max_turns"):
        load_config(None, BASE + ["agent.loop=tools", "agent.tools=[python]", "agent.max_turns=0"])
    cfg = load_config(None, BASE + ["agent.loop=tools", "agent.tools=[python,image_zoom_in]", "agent.max_turns=4",
                                    "rollout.max_response_length=2048"])
    agent = agent_from_config(cfg)
    assert sorted(agent.tools) == ["image_zoom_in", "image_zoom_in_tool", "python"] and agent.parser is parse_hermes
    assert agent.tools["image_zoom_in_tool"] is agent.tools["image_zoom_in"]  # DeepEyes' name reaches the tool
    assert agent.settings.max_turns == 4 and agent.settings.max_response_length == 2048
    with pytest.raises(ConfigError, match="agent.tools.*unknown tool 'calculator'"):
        agent_from_config(load_config(None, BASE + ["agent.loop=tools", "agent.tools=[calculator]"]))
    with pytest.raises(ConfigError, match="agent.parser"):
        agent_from_config(load_config(None, BASE + ["agent.loop=tools", "agent.tools=[python]", "agent.parser=xml"]))
    with pytest.raises(ConfigError, match="agent.stop_after_call=true: the parser 'json:loads' names no call_end"):
        agent_from_config(load_config(None, BASE + ["agent.loop=tools", "agent.tools=[python]",
                                                    "agent.parser=json:loads", "agent.stop_after_call=true"]))
    stopping = agent_from_config(load_config(None, BASE + ["agent.loop=tools", "agent.tools=[python]",
                                                           "agent.stop_after_call=true", "agent.batch_turns=true"]))
    assert stopping.settings.stop_after_call and stopping.settings.batch_turns
    # partial rollouts continue an agent's cut turns (tests/test_partial_rollouts.py)
    partial = load_config(None, BASE + ["agent.loop=tools", "agent.tools=[python]", "rollout.engine=server",
                                        "rollout.mode=async", "rollout.partial=true"])
    assert partial.rollout.partial and agent_from_config(partial) is not None


def test_a_chat_template_that_cannot_carry_the_replies_is_refused_when_the_agent_starts(tokenizer):
    pyvision = agent_from_config(load_config(None, BASE + ["agent.loop=tools", "agent.tools=[python]",
                                                           "agent.parser=pyvision"]))
    # Qwen2.5's text template renders no `observation` turn, PyVision's reply
    with pytest.raises(ConfigError, match=r"agent.parser: the model's chat template does not fit the agent loop: "
                                          r"the chat template renders no message of role \['observation'\]"):
        agent_group(pyvision, tokenizer)
    hermes = agent_from_config(load_config(None, BASE + ["agent.loop=tools", "agent.tools=[python]"]))
    assert callable(agent_group(hermes, tokenizer))


@pytest.mark.slow
def test_a_training_run_with_the_agent_loop_logs_its_metrics(tmp_path):
    """`agent.loop=tools` in `rl360 train`: every sample is an agent trajectory (the random quickstart model calls no
    tool, so each is one turn) and the step's metrics carry the agent's; two steps train. The held-out evaluation at
    step 2 samples through the agent loop too: each held-out reward call gets its trajectory's summary, read back
    from the step's results file."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from rl360.quickstart.assets import build_quickstart_model

    root = Path(__file__).resolve().parents[1]
    model = build_quickstart_model(tmp_path / "model")
    subprocess.run([sys.executable, "-m", "data_preprocess.synthetic_arithmetic", "--out", str(tmp_path / "data")],
                   cwd=root, check=True, capture_output=True)
    result = subprocess.run(
        [sys.executable, "-m", "rl360.cli", "train", "configs/quickstart.yaml", f"output_dir={tmp_path / 'out'}",
         f"model.path={model}", f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]", "data.batch_size=4",
         "rollout.n=4", "actor.ppo_mini_batch_size=4", "trainer.total_steps=2", "trainer.save_hf=false",
         "cluster.num_cpus=2", "agent.loop=tools", "agent.tools=[python]",
             "agent.tool_pool=0",  # the random model calls no tool: no interpreters started ahead
         "reward.custom={math__synthetic: 'tests.test_rewards_agents:one_turn_trajectory_seen'}",
         f"data.val_files=[{tmp_path / 'data' / 'test.parquet'}]", "validation.every=2"],
        cwd=root, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["agent/turns/mean"] == 1.0 and record["agent/tool_calls/mean"] == 0.0
        assert record["agent/generated_tokens/mean"] == record["response_length/mean"]
        assert record["rollout/logprob_abs_diff"] <= 1e-6
        assert record["reward/mean"] == 1.0  # every reward call was handed its trajectory's summary
    assert "eval/all/accuracy" not in records[0]
    assert records[1]["eval/all/samples"] == 100 and records[1]["eval/all/accuracy"] == 1.0
    results = [json.loads(line) for line in
               (tmp_path / "out" / "eval" / "step_000002" / "results.jsonl").read_text().splitlines()]
    assert len(results) == 100
    for result in results:
        assert result["trajectory"]["turns"] == 1 and result["trajectory"]["tool_calls"] == {}
        assert result["trajectory"]["turn_texts"] == [result["response"]]
        assert result["trajectory"]["ended_by"] == {"stop": "done", "length": "length"}[result["finish_reason"]]


def test_agent_and_tool_settings_default_to_the_agent_section():
    """One definition of each agent limit: the settings a loop and its tools get without a config are the agent
    (and rollout) sections' defaults, the tool timeout among them."""
    from rl360.config import AgentConfig, RolloutConfig

    section, rollout, tools, loop = AgentConfig(), RolloutConfig(), ToolSettings(), AgentSettings()
    assert (tools.timeout_s, tools.memory_mb, tools.max_output_chars, tools.max_pixels, tools.min_pixels,
            tools.max_image_tokens, tools.python, tools.workers) == (
        section.tool_timeout_s, section.tool_memory_mb, section.max_tool_output_chars, section.max_pixels,
        section.min_pixels, section.max_image_tokens, section.python, section.tool_workers)
    assert (loop.max_turns, loop.max_response_length, loop.tool_timeout_s, loop.min_pixels, loop.max_pixels,
            loop.stop_after_call, loop.batch_turns, loop.max_turn_tokens) == (
        section.max_turns, rollout.max_response_length, section.tool_timeout_s, section.min_pixels,
        section.max_pixels, section.stop_after_call, section.batch_turns, section.max_turn_tokens)
