"""PyVision's format in the agent loop: the `pyvision` parser (`<code>```python ...```</code>` blocks, the last one
run, `<answer>` ending the trajectory), its `<interpreter>` replies in the `observation` role as Qwen2.5-VL's chat
template renders them, and a trajectory with the real sandboxed python tool whose inserted tokens are exactly
PyVision's observation text, image clues numbered on from the prompt's image, out of the loss.

The tokenizer is byte-level (every byte one token, so `</code>` is several tokens, as it is three of Qwen's) with
Qwen2.5-VL's special tokens and its chat template (from Qwen/Qwen2.5-VL-7B-Instruct's tokenizer_config.json), built
here: nothing is downloaded."""

import asyncio
import io
import sys

import pytest
from PIL import Image

from rl360.agents import AgentSettings, get_parser, run_agent
from rl360.agents.loop import call_end_ids, tool_tokens
from rl360.agents.parsers import NO_CODE, parse_hermes, parse_pyvision
from rl360.agents.replies import ShownReply, interpreter_messages, tool_messages
from rl360.agents.tools import ToolReply, ToolSettings, get_tool
from rl360.agents.tools.images import image_tokens
from rl360.core.prompt import ImagePrompt
from rl360.core.sampling import SamplingParams
from rl360.core.trajectory import Sample
from rl360.engine.stop_strings import first_stop
from tests.test_agents import QWEN25_TEMPLATE, byte_level_tokenizer, encode, png

# Qwen2.5-VL's chat template: every role rendered as <|im_start|>role\n...<|im_end|>\n, images as placeholders
QWEN25_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in "
    "content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
PAD = "<|image_pad|>"


def _tokenizer(path, template):
    return byte_level_tokenizer(path, template, SPECIAL)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return _tokenizer(tmp_path_factory.mktemp("qwen_vl_tok"), QWEN25_VL_TEMPLATE)



def block(code, tags=True):
    fenced = f"```python\n{code}\n```"
    return f"<code>\n{fenced}\n</code>" if tags else fenced


# ---------------------------------------------------------------- the parser

def test_the_last_code_block_is_one_python_call():
    one = parse_pyvision("Let me look.\n" + block("print(image_clue_0.size)"))
    assert [(c.name, c.arguments, c.error) for c in one.calls] == [("python", {"code": "print(image_clue_0.size)"},
                                                                    "")]
    assert one.content == "Let me look." and one.calls[0].raw == block("print(image_clue_0.size)")
    two = parse_pyvision(block("a = 1") + "\nor rather\n" + block("a = 2\nprint(a)"))
    assert [c.arguments for c in two.calls] == [{"code": "a = 2\nprint(a)"}]
    bare = parse_pyvision("First:\n" + block("x = 1") + "\nthen\n" + block("print(3)", tags=False) + "\n")
    assert [c.arguments for c in bare.calls] == [{"code": "print(3)"}]
    untagged_end = parse_pyvision("<code>\n```python\nprint(4)\n```")  # the model stopped before </code>
    assert [c.arguments for c in untagged_end.calls] == [{"code": "print(4)"}]
    assert get_parser("pyvision") is parse_pyvision and parse_pyvision.call_end == "</code>"
    assert parse_pyvision.reply_format is interpreter_messages


@pytest.mark.parametrize("text, error", [
    ("<code>\n```python\nprint(1)\n", "not closed"),  # cut inside the block
    ("<code>\nprint(1)\n</code>", "holds no ```python"),
    (block("print(1)") + "\n<code>oops</code>", "holds no ```python"),  # the last <code> block is the one read
    ("<code>\n```python\n\n```\n</code>", "empty"),
])
def test_a_malformed_block_is_an_error_call_not_an_exception(text, error):
    result = parse_pyvision(text)
    assert len(result.calls) == 1 and error in result.calls[0].error and result.calls[0].arguments == {}


def test_an_answer_ends_the_trajectory_and_neither_code_nor_answer_is_an_error():
    assert parse_pyvision("So it is red.\n<answer>red</answer>").calls == ()
    # an answer wins over a block in the same turn, as in PyVision
    assert parse_pyvision(block("print(1)") + "\n<answer>red</answer>").calls == ()
    for text in ("I am not sure what to do.", "<answer>not closed", "```\nprint(1)\n```"):
        calls = parse_pyvision(text).calls
        assert [(c.name, c.error) for c in calls] == [("", NO_CODE)]
    assert NO_CODE == "No Python code or final answer found. There is something wrong with the format."


# ---------------------------------------------------------------- the replies

def test_interpreter_replies_are_pyvisions_observations():
    text = ShownReply("python", ToolReply("(96, 64)\n"))
    images = ShownReply("python", ToolReply("", (b"a", b"b")), ("<A>", "<B>"))
    failed = ShownReply("python", ToolReply("Traceback ...\nZeroDivisionError: division by zero\n",
                                            error="ZeroDivisionError: division by zero"))
    late = ShownReply("python", ToolReply("", (b"c",), error="1 image(s) were not returned"), ("<C>",))
    unread = ShownReply("", ToolReply(error=NO_CODE))
    contents = [m["content"] for m in interpreter_messages([text, images, failed, late, unread], 3)]
    assert contents == [  # PyVision-RL's: each ends "</interpreter>\n"; errors as it words them
        "<interpreter>Text Result:\n(96, 64)</interpreter>\n",
        "<interpreter>Text Result:\n\nImage Result:\n<image_clue_3><A></image_clue_3><image_clue_4><B></image_clue_4>"
        "</interpreter>\n",
        "<interpreter>Execution error: ZeroDivisionError: division by zero</interpreter>\n",
        "<interpreter>Execution error: 1 image(s) were not returned\nImage Result:\n<image_clue_5><C></image_clue_5>"
        "</interpreter>\n",
        f"<interpreter>Error: {NO_CODE}</interpreter>\n",
    ]
    assert {m["role"] for m in interpreter_messages([text], 1)} == {"observation"}
    # the default stays one tool message per call, as Hermes' replies always were
    assert tool_messages([text, ShownReply("", ToolReply(error="bad"), ("<A>",), 1)], 0) == [
        {"role": "tool", "name": "python", "content": "(96, 64)\n"},
        {"role": "tool", "name": "unknown",
         "content": "<A>\n[1 image(s) not shown: this conversation has no images]\nError: bad"}]


def test_qwen25_vl_renders_the_observation_role_and_a_template_that_drops_it_is_refused(tokenizer, tmp_path):
    message = interpreter_messages([ShownReply("python", ToolReply("7"))], 1)
    after = tokenizer.decode(tool_tokens(tokenizer, "```\n</code><|im_end|>", message), skip_special_tokens=False)
    # exactly PyVision's text observation (it follows the turn's <|im_end|>, which the engine generated)
    assert after == "\n<|im_start|>observation\n<interpreter>Text Result:\n7</interpreter>\n<|im_end|>\n" \
                    "<|im_start|>assistant\n"
    cut = tokenizer.decode(tool_tokens(tokenizer, "```\n</code>", message), skip_special_tokens=False)
    assert cut == "<|im_end|>" + after  # a turn cut at </code>: the template closes it
    qwen25_text = _tokenizer(tmp_path, QWEN25_TEMPLATE)  # renders system, user, assistant and tool only
    with pytest.raises(ValueError, match=r"renders no message of role \['observation'\]"):
        tool_tokens(qwen25_text, "</code>", message)
    assert tool_tokens(qwen25_text, "</tool_call>", tool_messages([ShownReply("python", ToolReply("7"))], 0))


def test_no_single_token_closes_a_code_block(tokenizer):
    assert call_end_ids(tokenizer, parse_pyvision) == []  # </code> is a stop string of the engine's (below)
    assert call_end_ids(tokenizer, parse_hermes) == []


# ---------------------------------------------------------------- a trajectory with the real python tool

class Engine:
    """Replays recorded engine output: turn k returns the tokens of `turns[k]`, ended as the engines end a response
    at its sampling params' stop strings (their shared `first_stop`: the token completing the first one is the
    last), and keeps the contexts and params it is handed."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.contexts, self.params = tok, turns, [], []

    async def __call__(self, prompt, params, seed):
        self.contexts.append(prompt)
        self.params.append(params)
        out = encode(self.tok, self.turns[len(self.contexts) - 1])
        match = first_stop(out, self.tok, params.stop)
        out = out[:match.tokens] if match else out
        return Sample(list(prompt.ids), out, [-0.25] * len(out), "stop", weight_version=7,
                      stop_matched=match.string if match else None)


@pytest.fixture()
def python_tool(monkeypatch):
    # the sandbox's /usr/bin/python3 may lack PIL: run this interpreter, with the isolation it can have
    monkeypatch.setenv("RL360_SANDBOX_ISOLATION", "network,filesystem")
    monkeypatch.setenv("RL360_SANDBOX_REQUIRE_ISOLATION", "0")
    tool = get_tool("python", ToolSettings(timeout_s=30, python=sys.executable, max_image_tokens=10_000, workers=1))
    yield {"python": tool}
    tool.close()


def test_a_pyvision_trajectory_with_the_python_tool(tokenizer, python_tool):
    picture = png(112, 84)
    messages = [{"role": "system", "content": "Solve it with code."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pads = image_tokens(84, 112, 3136, 1003520)
    prompt = ImagePrompt(encode(tokenizer, head.replace(PAD, PAD * pads)), (picture,))
    turns = [  # as the model would write them: the first runs on past </code>, where the engine stops
        "Crop the corner.\n" + block("print(image_clue_0.size)\nimage_clue_0.crop((0, 0, 56, 56)).show()")
        + "\n<|im_start|>observation\nmade up<|im_end|>",
        "Check the crop.\n" + block("print('unused')", tags=False) + "\n" + block("print(image_clue_1.size)"),
        block("1 / 0"),
        "Hmm.<|im_end|>",
        "<answer>red</answer><|im_end|>",
    ]
    engine = Engine(tokenizer, turns)
    settings = AgentSettings(max_turns=6, max_response_length=4000, stop_after_call=True)
    sample = asyncio.run(run_agent(engine, prompt, tokenizer, python_tool, parse_pyvision, settings,
                                   SamplingParams(stop_token_ids=[tokenizer.eos_token_id]), seed=1))
    trace = sample.trace
    assert trace.ended_by == "done" and len(trace.turns) == 5 and len(engine.contexts) == 5
    assert [(call.name, bool(call.error)) for call in trace.calls] == [("python", False), ("python", False),
                                                                      ("python", True), ("?", True)]
    crop = Image.open(io.BytesIO(sample.images[1]))
    assert sample.images[0] == picture and crop.size == (56, 56) and crop.getpixel((3, 3)) == (200, 30, 30)
    crop_pads = image_tokens(56, 56, 3136, 1003520)
    # every inserted stretch, decoded: PyVision's observations after the turn's closing
    inserted = [tokenizer.decode(sample.response_ids[t.start:t.end], skip_special_tokens=False)
                for t in sample.turn_list() if not t.generated]
    generated = [tokenizer.decode(sample.response_ids[t.start:t.end], skip_special_tokens=False)
                 for t in sample.turn_list() if t.generated]
    end = "<|im_end|>\n<|im_start|>assistant\n"
    assert inserted[0] == ("<|im_end|>\n<|im_start|>observation\n<interpreter>Text Result:\n(112, 84)\nImage Result:\n"
                           "<image_clue_1><|vision_start|>" + PAD * crop_pads + "<|vision_end|></image_clue_1>"
                           "</interpreter>\n" + end)
    assert inserted[1] == ("<|im_end|>\n<|im_start|>observation\n<interpreter>Text Result:\n(56, 56)</interpreter>\n"
                           + end)
    assert inserted[2] == ("<|im_end|>\n<|im_start|>observation\n<interpreter>Execution error: ZeroDivisionError: "
                           "division by zero</interpreter>\n" + end)
    assert inserted[3] == f"\n<|im_start|>observation\n<interpreter>Error: {NO_CODE}</interpreter>\n" + end
    assert generated[0] == turns[0][:turns[0].index("</code>") + len("</code>")]  # the engine stopped at </code>
    assert all(params.stop == ["</code>"] for params in engine.params)  # stop_after_call: </code> a stop string
    assert generated[1:] == turns[1:]
    # the trainer sees what the engine was fed, and trains only on what it generated
    contexts = [list(context.ids) for context in engine.contexts]
    for k, t in enumerate([t for t in sample.turn_list() if t.generated][1:], start=1):
        assert contexts[k] == sample.prompt_ids + sample.response_ids[:t.start]
    assert [len(context.images) for context in engine.contexts] == [1, 2, 2, 2, 2]
    mask = sample.mask()
    for t in sample.turn_list():
        assert set(mask[t.start:t.end]) == {int(t.generated)}
        assert set(sample.logprobs[t.start:t.end]) == ({-0.25} if t.generated else {0.0})
    assert sample.response_ids.count(tokenizer.convert_tokens_to_ids(PAD)) == crop_pads
