"""`rl360 sft`: conversations in verl's SFT formats, assistant-only loss masks, the SFT policy rank, and whole runs
(resume bit for bit, the HF export in transformers and as `rl360 train`'s starting model) on the tools quickstart's
tiny model and traces of its task."""

import json
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl360.actor.settings import PolicySettings
from rl360.actor.sft import SFTWorker
from rl360.config import ConfigError, load_config
from rl360.data.conversations import ConversationTokens, SftKeys
from rl360.data.schema import DataError
from rl360.data.stream import PromptStream, RowFormat
from rl360.quickstart.prepare import _script
from rl360.quickstart.tools_assets import CALL, build_tools_quickstart_model
from rl360.sft import Conversations
from tests.killing import Kill, TrainingProcess

REPO = Path(__file__).resolve().parent.parent
TOOLS = json.dumps([{"type": "function", "function": {"name": "python", "description": "run python",
                                                      "parameters": {"type": "object"}}}])
STEPS, SAVE_EVERY, EVAL_EVERY = 6, 2, 3
RUN_TIMEOUT_S = 600


def trace(prompt: str, answer: str) -> dict:
    """A multi-turn tool-call conversation of the tools task: the call, the tool's reply, the answer repeated."""
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": CALL},
                         {"role": "tool", "content": f"\\boxed{{{answer}}}"},
                         {"role": "assistant", "content": f"\\boxed{{{answer}}}"}], "tools": TOOLS}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sft")
    tools = _script("synthetic_tools")
    rows = tools.make_rows(40, "train", seed=3)
    prompts = [row["prompt"][0]["content"] for row in rows]
    answers = [row["reward_model"]["ground_truth"] for row in rows]
    build_tools_quickstart_model(root / "model", prompts, answers, call_prior=0, copy_prior=0)
    traces = [trace(p, a) for p, a in zip(prompts, answers)]
    pq.write_table(pa.Table.from_pylist(traces[:32]), root / "train.parquet", row_group_size=5)
    pq.write_table(pa.Table.from_pylist(traces[32:]), root / "val.parquet")
    tools.main(["--out", str(root / "rl_data")])  # the RL task's prompts, for `rl360 train` from the SFT model
    return root


@pytest.fixture(scope="module")
def tokenizer(assets):
    return AutoTokenizer.from_pretrained(assets / "model")


def _tokens(tokenizer, ids):
    return tokenizer.convert_ids_to_tokens(ids)


def test_only_the_assistant_turns_are_in_the_loss_as_an_engine_would_generate_them(tokenizer):
    row = trace("123456*654321%7", "3")
    got = ConversationTokens(tokenizer, SftKeys())(row, "x.parquet", 0)
    assert _tokens(tokenizer, got.prompt_ids)[-3:] == ["<|im_start|>", "assistant", "\n"]
    trained = [t for t, m in zip(_tokens(tokenizer, got.response_ids), got.loss_mask) if m]
    context = [t for t, m in zip(_tokens(tokenizer, got.response_ids), got.loss_mask) if not m]
    assert trained == [CALL, "<|im_end|>", "\\boxed{3}", "<|im_end|>"]
    # the newline after each turn's end, the tool's message and the next header are context
    assert context == ["\n", "<|im_start|>", "tool", "\n", "\\boxed{3}", "<|im_end|>", "\n", "<|im_start|>",
                       "assistant", "\n", "\n"]
    # the pieces join into the template's own rendering of the whole conversation
    whole = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    assert tokenizer.decode(got.prompt_ids + got.response_ids) == whole


def test_the_tools_tasks_traces_train_on_the_call_and_the_right_answer(tokenizer, tmp_path):
    tools = _script("synthetic_tools")
    tools.main(["--out", str(tmp_path), "--traces", "--train-rows", "12", "--test-rows", "3"])
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert len(rows) == 12 and len(pq.read_table(tmp_path / "test.parquet")) == 3
    tokens = ConversationTokens(tokenizer, SftKeys())
    for index, row in enumerate(rows):
        a, b = (int(x) for x in row["messages"][0]["content"].split("%")[0].split("*"))
        got = tokens(row, "train.parquet", index)
        trained = [t for t, m in zip(_tokens(tokenizer, got.response_ids), got.loss_mask) if m]
        assert trained == [CALL, "<|im_end|>", f"\\boxed{{{a * b % 7}}}", "<|im_end|>"]
        assert json.loads(row["tools"])[0]["function"]["name"] == "python"


def test_single_turn_rows_and_verl_key_names(tokenizer):
    keys = SftKeys(prompt="question", response="answer")
    single = ConversationTokens(tokenizer, keys)({"question": "1*2%7", "answer": "\\boxed{2}"}, "x.jsonl", 4)
    as_messages = ConversationTokens(tokenizer, SftKeys())(
        {"messages": [{"role": "user", "content": "1*2%7"}, {"role": "assistant", "content": "\\boxed{2}"}]}, "y", 0)
    assert single == as_messages
    assert [t for t, m in zip(_tokens(tokenizer, single.response_ids), single.loss_mask) if m] == \
        ["\\boxed{2}", "<|im_end|>"]


def test_tool_calls_arguments_given_as_json_text_reach_the_template_as_objects(tokenizer):
    seen = []
    template = tokenizer.chat_template

    class Recording:
        def apply_chat_template(self, messages, tools=None, **kwargs):
            seen.append((messages, tools))
            return tokenizer.apply_chat_template(messages, chat_template=template, **kwargs)

        def encode(self, text, add_special_tokens=False):
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    call = {"type": "function", "function": {"name": "python", "arguments": '{"code": "print(1)"}'}}
    row = {"messages": [{"role": "user", "content": "1*2%7"},
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "content": "1", "name": None},
                        {"role": "assistant", "content": "\\boxed{2}", "tool_calls": None}], "tools": TOOLS}
    ConversationTokens(Recording(), SftKeys())(row, "x.parquet", 0)
    messages, tools = seen[-1]
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "python", "arguments": {"code": "print(1)"}}}]}
    assert messages[2] == {"role": "tool", "content": "1"} and tools == json.loads(TOOLS)


@pytest.mark.parametrize("row,message", [
    ({"text": "hi"}, "x.parquet row 7: no conversation: the row has neither 'messages'"),
    ({"messages": [{"role": "user", "content": "1"}]}, "x.parquet row 7: key 'messages' has no assistant message"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]},
     "x.parquet row 7: key 'messages'[0].content must be a string"),
    ({"messages": [{"content": "a"}]}, "x.parquet row 7: key 'messages'[0].role must be a non-empty string"),
    ({"prompt": "1", "response": ["a"]}, "x.parquet row 7: key 'response' must be the assistant's reply"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "python", "arguments": "{oops"}}]}]},
     "x.parquet row 7: key 'messages'[0].tool_calls[0].function.arguments is a string that is not JSON"),
    ({"messages": [{"role": "assistant", "content": "a"}], "tools": "[{"},
     "x.parquet row 7: key 'tools' is a string that is not JSON"),
])
def test_a_bad_row_is_named_by_file_row_and_key(tokenizer, row, message):
    with pytest.raises(DataError) as err:
        ConversationTokens(tokenizer, SftKeys())(row, "x.parquet", 7)
    assert str(err.value).startswith(message)


def test_jsonl_streams_like_parquet_and_names_a_bad_line(assets, tmp_path):
    rows = pq.read_table(assets / "train.parquet").to_pylist()
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" + ("\n" if i == 3 else "") for i, row in enumerate(rows)))
    tokens = ConversationTokens(AutoTokenizer.from_pretrained(assets / "model"), SftKeys())
    row_format = RowFormat(tokens.check_row, tokens.check_columns, jsonl=True)

    def order(path, **kwargs):
        stream = PromptStream([str(path)], 4, seed=5, shuffle_buffer=7, row_format=row_format, **kwargs)
        return [[row["messages"][0]["content"] for row in next(stream)] for _ in range(8)]

    from_parquet, from_jsonl = order(assets / "train.parquet"), order(jsonl)
    # 8 batches of 4: one epoch of the 32 rows, each once, whichever the file
    assert sorted(sum(from_jsonl, [])) == sorted(sum(from_parquet, [])) == sorted(row["messages"][0]["content"]
                                                                                  for row in rows)
    resumed = PromptStream([str(jsonl)], 4, seed=5, shuffle_buffer=7, row_format=row_format)
    state = PromptStream([str(jsonl)], 4, seed=5, shuffle_buffer=7, row_format=row_format)
    for _ in range(3):
        next(state)
    resumed.load_state_dict(state.state_dict())
    assert next(resumed) == next(state)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(rows[0]) + "\n" + "{not json\n")
    with pytest.raises(DataError, match=r"broken.jsonl row 1: not a JSON line"):
        stream = PromptStream([str(broken)], 2, shuffle=False, row_format=row_format)
        next(stream)
    with pytest.raises(DataError, match=r"no conversation columns: neither 'messages'"):
        PromptStream([str(assets / "rl_data" / "train.parquet")], 2, row_format=row_format)


def test_conversations_with_images_are_refused_naming_the_file_or_row(tokenizer, tmp_path):
    tokens = ConversationTokens(tokenizer, SftKeys())
    with pytest.raises(DataError, match=r"x.parquet row 2: key 'images': rl360 sft trains on text conversations"):
        tokens.check_row({**trace("1*2%7", "2"), "images": [{"bytes": b"png"}]}, "x.parquet", 2)
    path = tmp_path / "vl.parquet"
    pq.write_table(pa.Table.from_pylist([{**trace("1*2%7", "2"), "images": [{"bytes": b"png"}]}]), path)
    with pytest.raises(DataError, match=r"vl.parquet: an 'images' column"):
        PromptStream([str(path)], 1, row_format=RowFormat(tokens.check_row, tokens.check_columns, jsonl=True))


def _worker_config(assets, *overrides):
    return load_config(None, [f"model.path={assets / 'model'}", f"data.train_files=[{assets / 'train.parquet'}]",
                              "data.batch_size=8", "actor.lr=1e-2", "actor.micro_batch_size=3", *overrides],
                       command="sft")


@pytest.mark.parametrize("packing", [[], ["actor.pack_sequences=true", "actor.max_tokens_per_micro_batch=64"]])
def test_the_labels_of_tool_and_user_tokens_do_not_change_the_loss_or_the_gradient(megatron_single_rank, assets,
                                                                                   packing):
    cfg = _worker_config(assets, *packing)
    conversations = Conversations(cfg, AutoTokenizer.from_pretrained(assets / "model"), cfg.data.train_files,
                                  shuffle=False)
    batch = conversations.next_batch()
    worker = SFTWorker(PolicySettings.of(cfg))

    def loss_and_gradient(labels):
        changed = batch.select(slice(0, len(batch)))
        changed.response_ids = labels
        reports = worker.accumulate_gradients(changed)
        gradient = torch.cat([p.main_grad.flatten().clone() for p in worker.models[0].parameters()])
        return sum(r["sft/loss"] for r in reports), gradient

    loss, gradient = loss_and_gradient(batch.response_ids)
    assert loss > 0 and gradient.abs().sum() > 0
    context = (batch.response_mask == 0) & (torch.arange(batch.response_ids.shape[1]) <
                                            (batch.sequence_lengths() - batch.response_start)[:, None])
    assert context.sum() > 3 * len(batch)  # the tool message and the headers of every row
    other = torch.randint(3, 20, batch.response_ids.shape, generator=torch.Generator().manual_seed(0))
    perturbed_loss, perturbed = loss_and_gradient(torch.where(context, other, batch.response_ids))
    assert perturbed_loss == loss and torch.equal(perturbed, gradient)
    # an assistant token's label does count
    assistant = batch.response_mask > 0
    changed_loss, changed = loss_and_gradient(torch.where(assistant, other, batch.response_ids))
    assert changed_loss != loss and not torch.equal(changed, gradient)


def test_sft_config_keys_and_their_checks():
    cfg = load_config(None, ["model.path=m", "data.train_files=[a.jsonl]", "data.batch_size=6", "sft.max_length=80",
                             "sft.prompt_key=question", "sft.response_key=answer"], command="sft")
    assert (cfg.sft.max_length, cfg.sft.prompt_key, cfg.sft.response_key) == (80, "question", "answer")
    with pytest.raises(ConfigError, match="data.batch_size=6 conversations a step must be a multiple of "
                                          "actor.parallel.data=4"):
        load_config(None, ["model.path=m", "data.train_files=[a]", "data.batch_size=6", "actor.parallel.data=4"],
                    command="sft")
    with pytest.raises(ConfigError, match="sft.max_length=0 must be > 0"):
        load_config(None, ["model.path=m", "data.train_files=[a]", "sft.max_length=0"], command="sft")


# ---- whole runs ---------------------------------------------------------------------------------------------------

def _command(assets: Path, out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "rl360.cli", "sft", "configs/sft_tools.yaml", f"output_dir={out}",
            f"model.path={assets / 'model'}", f"data.train_files=[{assets / 'train.parquet'}]",
            f"data.val_files=[{assets / 'val.parquet'}]", "data.batch_size=8", "data.shuffle_buffer=6",
            "actor.micro_batch_size=3", f"trainer.total_steps={STEPS}", f"trainer.save_every={SAVE_EVERY}",
            f"validation.every={EVAL_EVERY}", "trainer.keep_checkpoints=5", "cluster.num_cpus=2", *overrides]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def unbroken(assets, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("unbroken") / "run"
    _run(_command(assets, out))
    return out


@pytest.mark.slow
def test_a_run_logs_loss_tokens_per_second_and_the_held_out_loss(unbroken):
    metrics = _metrics(unbroken)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for record in metrics:
        assert record["sft/loss"] > 0 and record["sft/tokens_per_s"] > 0 and record["sft/grad_norm"] > 0
        assert record["sft/trained_tokens"] == 8 * 4  # two assistant turns of two tokens in each conversation
    held_out = [m["val/loss"] for m in metrics if "val/loss" in m]
    assert [m["step"] for m in metrics if "val/loss" in m] == [3, 6]
    assert held_out[1] < held_out[0]  # lr 5e-3 on the task's traces: the held-out loss falls
    assert metrics[-1]["sft/loss"] < metrics[0]["sft/loss"]


@pytest.mark.slow
def test_the_held_out_loss_is_the_exported_models_loss_on_the_assistant_tokens(assets, unbroken):
    """The last step's val/loss, recomputed by transformers from hf/: the NLL per assistant token of val.parquet."""
    model = AutoModelForCausalLM.from_pretrained(unbroken / "hf")
    tokens = ConversationTokens(AutoTokenizer.from_pretrained(unbroken / "hf"), SftKeys())
    total = count = 0.0
    for index, row in enumerate(pq.read_table(assets / "val.parquet").to_pylist()):
        got = tokens(row, "val.parquet", index)
        ids = torch.tensor([got.prompt_ids + got.response_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
        picked = logprobs[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(got.prompt_ids) - 1:]
        mask = torch.tensor(got.loss_mask, dtype=torch.float64)
        total -= float((picked * mask).sum())
        count += float(mask.sum())
    assert count == 8 * 4
    assert _metrics(unbroken)[-1]["val/loss"] == pytest.approx(total / count, rel=1e-5)


@dataclass
class Interrupted:
    out: Path
    stopped: str  # the SIGTERM-stopped run's output
    stopped_code: int
    kill: Kill  # the kill of the run started after it
    logged_at_kill: list[int]  # the steps metrics.jsonl held right after the kill
    hf_at_kill: bool  # whether an export existed then
    resumed: str  # the output of the run that finished


@pytest.fixture(scope="module")
def interrupted(assets, tmp_path_factory) -> Interrupted:
    """One run stopped by SIGTERM after step 2 (asked for many steps: the runs after it take the unbroken run's
    6), started again and SIGKILLed, its whole process tree, in step 5's optimizer step (the last checkpoint:
    step 4), then started again to its end."""
    out = tmp_path_factory.mktemp("interrupted") / "run"
    run = TrainingProcess(_command(assets, out, "trainer.total_steps=1000"), cwd=str(REPO))
    try:
        run.wait_for_step(2)
        run.proc.send_signal(signal.SIGTERM)
        stopped_code = run.wait(timeout_s=RUN_TIMEOUT_S)
    finally:
        run.kill_everything()
    again = TrainingProcess(_command(assets, out), cwd=str(REPO))
    try:
        kill = again.kill_in("sft_update", step=5, delay_s=0.005)
    finally:
        again.kill_everything()
    logged, exported = [m["step"] for m in _metrics(out)], (out / "hf").exists()
    return Interrupted(out, run.output, stopped_code, kill, logged, exported, _run(_command(assets, out)).stdout)


@pytest.mark.slow
def test_sigterm_stops_with_a_checkpoint_and_the_next_start_resumes_from_it(interrupted):
    assert interrupted.stopped_code == 75, interrupted.stopped[-3000:]
    stopped = re.search(r"rl360: stopped by SIGTERM at step (\d+); checkpoint (\S+); run the same command to resume",
                        interrupted.stopped)
    assert stopped, interrupted.stopped[-3000:]
    step = int(stopped.group(1))
    assert 2 <= step <= 4 and stopped.group(2) == str(interrupted.out / "checkpoints" / f"step_{step:06d}")


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_unbroken_runs_weights_and_metrics_bit_for_bit(interrupted, unbroken):
    out = interrupted.out
    assert interrupted.kill.landed_in_phase, interrupted.kill.titles
    assert interrupted.logged_at_kill == [1, 2, 3, 4] and not interrupted.hf_at_kill
    assert f"resumed from {out / 'checkpoints' / 'step_000004'} at step 5" in interrupted.resumed
    mine, theirs = load_file(out / "hf" / "model.safetensors"), load_file(unbroken / "hf" / "model.safetensors")
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name
    drop = ("sft/tokens_per_s", "timing/step_s")
    assert [{k: v for k, v in m.items() if k not in drop} for m in _metrics(out)] == \
        [{k: v for k, v in m.items() if k not in drop} for m in _metrics(unbroken)]


@pytest.mark.slow
def test_the_export_loads_in_transformers_and_rl360_train_starts_from_it(assets, unbroken, tmp_path):
    hf = unbroken / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    row = trace("111111*222222%7", "1")
    ids = tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert torch.isfinite(logits).all()
    # the weights are the trained ones: the export differs from the starting model
    start = load_file(assets / "model" / "model.safetensors")
    assert any(not torch.equal(start[name], value) for name, value in load_file(hf / "model.safetensors").items())
    out = tmp_path / "rl"
    _run([sys.executable, "-m", "rl360.cli", "train", "configs/quickstart_tools.yaml", f"output_dir={out}",
          f"model.path={hf}", f"data.train_files=[{assets / 'rl_data' / 'train.parquet'}]", "trainer.total_steps=2",
          "data.batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4", "reward.num_workers=1"])
    assert [m["step"] for m in _metrics(out)] == [1, 2]
    assert (out / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_rl360_convert_turns_the_last_checkpoint_into_the_runs_own_export(unbroken, tmp_path):
    _run([sys.executable, "-m", "rl360.cli", "convert", "megatron-to-hf",
          "--ckpt", str(unbroken / "checkpoints" / f"step_{STEPS:06d}"), "--out", str(tmp_path / "hf")])
    mine, theirs = load_file(tmp_path / "hf" / "model.safetensors"), load_file(unbroken / "hf" / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[name], theirs[name]) for name in theirs)


@pytest.mark.slow
def test_two_data_parallel_ranks_train_as_one(assets, unbroken, tmp_path):
    """Each rank a half of every step's conversations, the loss normalised over both: the unbroken run's losses and
    held-out losses (within fp32's summation order)."""
    out = tmp_path / "dp2"
    _run(_command(assets, out, "actor.parallel.data=2", "trainer.save_every=0"))
    for mine, theirs in zip(_metrics(out), _metrics(unbroken), strict=True):
        for key in ("sft/loss", "sft/trained_tokens", "val/loss"):
            assert (key in mine) == (key in theirs)
            if key in theirs:
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5), (mine["step"], key)
