"""The Lewis game's pieces: `rl360 serve listener` (a real server process on the quickstart's tiny listener) with
the seed README's request and reply shapes, its queue batching concurrent requests, the speaker's and listener's
rewards through the listener client (chunks, failures counted in the reward pool), the games' rows, and the order of
`rl360 alternate`'s phases."""

import asyncio
import socket
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from rl360.alternate import ListenerService, phases
from rl360.data.lewis import YES, listener_prompt, listener_question, listener_rows, speaker_rows
from rl360.errors import UserError
from rl360.quickstart.prepare import _script
from rl360.rewards import RewardItem, RewardPool
from rl360.rewards.lewis import ListenerClient, ListenerFailed, listener_reward, speaker_description, speaker_reward
from rl360.serve.listener import ListenerScorer
from rl360.serve.listener import ListenerService as InProcessService

FULL = "<thinking>it is red</thinking><coarse>red</coarse><detailed>A red shape on grey.</detailed>"


@pytest.fixture(scope="module")
def game(tmp_path_factory):
    """A tiny listener (text, reads captions) and eight synthetic games."""
    from rl360.quickstart.lewis_assets import build_listener

    shapes = _script("lewis.synthetic_shapes")
    root = tmp_path_factory.mktemp("lewis")
    model = build_listener(root / "listener", list(shapes.COLOURS), list(shapes.SHAPES), seed=1)
    games = shapes.make_games(8, root / "images", seed=3)
    return str(model), games, shapes


@pytest.fixture(scope="module")
def served(game):
    model, _, _ = game
    with ListenerService(model, ["--max-batch", "8"]) as url:
        yield url


@pytest.fixture(scope="module")
def scorer(game):
    return ListenerScorer(game[0], scoring="yes")  # as `rl360 alternate` serves rl360's own listener


def _direct(scorer, paths, question):
    prompts = [scorer.prompt(path, question, "test") for path in paths]
    return scorer.yes_probabilities(prompts)


def test_score_and_batch_score_reply_in_the_listener_services_shapes(game, served, scorer):
    _, games, _ = game
    question = listener_question("red")
    one = httpx.post(f"{served}/score", json={"candidate_paths": list(games[0].paths), "question": question,
                                             "topk": 1, "id": "extra fields are ignored"}, timeout=60).json()
    assert set(one) == {"yes_probabilities", "predicted_index", "took"} and isinstance(one["took"], float)
    result = one  # the game's /score: one result, flat
    expected = _direct(scorer, games[0].paths, question)
    assert result["yes_probabilities"] == pytest.approx(expected, abs=1e-6)
    assert result["predicted_index"] == max(range(4), key=lambda i: expected[i])
    batch = [{"candidate_paths": list(g.paths), "question": listener_question(g.description), "topk": 2}
             for g in games[:3]]
    reply = httpx.post(f"{served}/batch_score", json={"batch": batch, "request_id": 7}, timeout=60).json()
    assert len(reply["results"]) == 3 and set(reply) == {"results", "took"}
    for item, got in zip(batch, reply["results"]):
        probabilities = _direct(scorer, item["candidate_paths"], item["question"])
        assert got["yes_probabilities"] == pytest.approx(probabilities, abs=1e-6)
        order = sorted(range(4), key=lambda i: -probabilities[i])
        assert got["predicted_index"] == order[0] and got["topk_indices"] == order[:2]


def test_bad_requests_name_the_field_at_fault(game, served, tmp_path):
    _, games, _ = game
    missing = httpx.post(f"{served}/batch_score", json={"batch": [
        {"candidate_paths": list(games[0].paths), "question": "q"},
        {"candidate_paths": [games[0].paths[0], str(tmp_path / "gone.png")], "question": "q"}]}, timeout=60)
    assert missing.status_code == 400 and "batch[1].candidate_paths[1]" in missing.json()["detail"]
    plain = tmp_path / "plain.png"
    from PIL import Image

    Image.new("RGB", (8, 8)).save(plain)
    uncaptioned = httpx.post(f"{served}/score", json={"candidate_paths": [str(plain)], "question": "q"}, timeout=60)
    assert uncaptioned.status_code == 400 and "caption" in uncaptioned.json()["detail"]
    for body, field in (({"candidate_paths": [], "question": "q"}, "candidate_paths"),
                        ({"candidate_paths": ["a"], "question": ""}, "question"),
                        ({"candidate_paths": ["a"], "question": "q", "topk": 2}, "topk")):
        reply = httpx.post(f"{served}/score", json=body, timeout=60)
        assert reply.status_code == 400 and field in reply.json()["detail"], reply.text
    assert httpx.get(f"{served}/health", timeout=10).json() == {"status": "ok"}
    metrics = httpx.get(f"{served}/metrics", timeout=10).text
    assert "rl360_listener_candidates_total" in metrics and "rl360_listener_forwards_total" in metrics


def test_concurrent_requests_share_forwards(game, scorer):
    """Six one-candidate requests at once, one forward at a time of up to 8 candidates: the first request's
    forward starts alone, the five queued behind it go together."""
    _, games, _ = game
    service = InProcessService(scorer, max_batch=8, concurrency=1)
    items = [_item(g) for g in games[:6]]

    async def all_at_once():
        return await asyncio.gather(*(service.answer([item], "/score") for item in items))

    replies = asyncio.run(all_at_once())
    assert service.forwards.value() == 2 and service.candidates.value() == 6
    for item, reply in zip(items, replies):
        assert reply["results"][0]["yes_probabilities"] == pytest.approx(
            _direct(scorer, item.paths, item.question), abs=1e-6)


def _item(g):
    from rl360.serve.listener import Item

    return Item([g.paths[0]], listener_question(g.description), 1)


def test_the_client_sends_games_in_chunks_and_the_speaker_reward_adds_format_and_length(game, served, scorer,
                                                                                       monkeypatch):
    _, games, _ = game
    client = ListenerClient(served + "/batch_score", chunk_size=2, max_retries=0)
    asked = [(g.paths, listener_question(g.description)) for g in games[:5]]
    answers = client.answer(asked)
    assert client.counts["listener/requests"] == 3 and client.counts["listener/failures"] == 0
    for (paths, question), answer in zip(asked, answers):
        assert answer.yes_probabilities == pytest.approx(_direct(scorer, paths, question), abs=1e-6)
    monkeypatch.setenv("RL360_LISTENER_URL", served)
    g = games[0]
    for response in (FULL, "red"):
        got = speaker_reward(response, str(g.target), {"candidate_paths": list(g.paths)})
        [answer] = client.answer([(g.paths, listener_question(speaker_description(response)))])
        assert got["acc"] == float(answer.predicted_index == g.target)
        assert (got["format"], got["length"]) == ((1.0, 0.1) if response == FULL else (0.0, 0.0))
        assert got["score"] == pytest.approx(got["acc"] + got["format"] + got["length"])
    assert speaker_reward("", str(g.target), {"candidate_paths": list(g.paths)})["acc"] == 0.0


def test_a_listener_that_is_down_costs_counted_reward_errors(game, monkeypatch):
    _, games, _ = game
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("RL360_LISTENER_URL", dead)
    monkeypatch.setenv("RL360_LISTENER_MAX_RETRIES", "1")
    monkeypatch.setenv("RL360_LISTENER_BACKOFF_S", "0.01")
    with pytest.raises(ListenerFailed, match="connection"):
        speaker_reward(FULL, "0", {"candidate_paths": list(games[0].paths)})
    g = games[1]
    items = [RewardItem("lewis__speaker", FULL, str(g.target), {"candidate_paths": list(g.paths)}),
             RewardItem("lewis__listener", "Yes", "Yes")]
    env = {"RL360_LISTENER_URL": dead, "RL360_LISTENER_MAX_RETRIES": "0"}
    with RewardPool(num_workers=1, timeout_s=30, env=env) as pool:
        results = pool.score(items)
        metrics = pool.last_metrics()
    assert [r.score for r in results] == [0.0, 1.0]
    assert "listener service failed: connection" in results[0].error
    assert metrics["reward/errors/lewis"] == 1 and metrics["reward/calls/lewis"] == 2


def test_listener_reward_pays_yes_on_the_target_and_anything_else_on_a_distractor():
    assert listener_reward("Yes", "Yes") == 1.0 and listener_reward("No", "Yes") == 0.0
    assert listener_reward("No", "No") == 1.0 and listener_reward("blue", "No") == 1.0
    assert listener_reward("Yes", "No") == 0.0
    assert speaker_description(FULL) == "red A red shape on grey."
    assert speaker_description("<thinking>hm</thinking> a red one ") == "a red one"


def test_games_make_balanced_listener_rows_and_speaker_rows_with_their_candidates(game):
    _, games, shapes = game
    rows = listener_rows(games, vision=False, seed=0)
    assert len(rows) == 2 * len(games) and sorted(r["reward_model"]["ground_truth"] for r in rows).count(YES) == 8
    for row in rows:
        g = games[row["extra_info"]["game"]]
        data = open(g.paths[row["extra_info"]["candidate"]], "rb").read()
        messages, images = listener_prompt(listener_question(g.description), data, vision=False)
        assert row["prompt"] == messages and not images and "images" not in row
        assert (row["reward_model"]["ground_truth"] == YES) == (row["extra_info"]["candidate"] == g.target)
    speakers = speaker_rows(games, shapes.INSTRUCTION)
    for row, g in zip(speakers, games):
        assert row["images"][0]["bytes"] == open(g.paths[g.target], "rb").read()
        assert row["extra_info"]["candidate_paths"] == list(g.paths) and row["reward_model"]["ground_truth"] == str(
            g.target)
    vision_row = listener_rows(games[:1], vision=True)[0]
    assert vision_row["prompt"][0]["content"].startswith("<image>") and len(vision_row["images"]) == 1


def test_the_synthetic_script_writes_valid_parquet(tmp_path):
    shapes = _script("lewis.synthetic_shapes")
    shapes.main(["--out", str(tmp_path), "--games", "4", "--seed", "2"])
    assert pq.read_table(tmp_path / "speaker.parquet").num_rows == 4
    assert pq.read_table(tmp_path / "listener.parquet").num_rows == 8
    assert len(list((tmp_path / "images").glob("*.png"))) == 16


def test_alternate_runs_the_first_agent_first_in_every_round():
    assert phases(2, "listener") == [(1, "listener"), (1, "speaker"), (2, "listener"), (2, "speaker")]
    assert phases(1, "speaker") == [(1, "speaker"), (1, "listener")]


def test_worker_environment_hands_on_the_listener_settings_and_its_key():
    from rl360.rewards.pool import worker_environment

    environ = {"RL360_LISTENER_URL": "http://h:9000", "RL360_LISTENER_API_KEY": "k" * 20, "WANDB_API_KEY": "w"}
    chosen = worker_environment(environ)
    assert chosen["RL360_LISTENER_URL"] == "http://h:9000" and chosen["RL360_LISTENER_API_KEY"] == "k" * 20
    assert "WANDB_API_KEY" not in chosen
    assert "RL360_LISTENER_API_KEY" not in worker_environment({"RL360_LISTENER_API_KEY": "k" * 20})



def test_image_sets_make_games_of_distinct_concepts_with_the_target_among_them(tmp_path):
    from PIL import Image

    sets = _script("lewis.image_sets")
    for concept in ("golden_retriever", "mam", "cat"):
        (tmp_path / "in" / concept).mkdir(parents=True)
        for number in range(2):
            Image.new("RGB", (16, 16), (10 * number, 0, 0)).save(tmp_path / "in" / concept / f"{number}.png")
    sets.main(["--input", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--candidates", "3"])
    speakers = pq.read_table(tmp_path / "out" / "speaker.parquet").to_pylist()
    listeners = pq.read_table(tmp_path / "out" / "listener.parquet").to_pylist()
    assert len(speakers) == 6 and len(listeners) == 12
    for row in speakers:
        paths = row["extra_info"]["candidate_paths"]
        target = paths[int(row["reward_model"]["ground_truth"])]
        assert len({Path(p).parent.name for p in paths}) == 3 and open(target, "rb").read() == row["images"][0]["bytes"]
    assert any("a photo of golden retriever" in row["prompt"][0]["content"] for row in listeners)
    assert all(row["prompt"][0]["content"].startswith("<image>") for row in listeners)
    with pytest.raises(UserError, match="--candidates 4"):
        sets.main(["--input", str(tmp_path / "in"), "--out", str(tmp_path / "x"), "--candidates", "4"])


def test_a_listener_phase_after_a_speaker_asks_about_the_speakers_descriptions(game, tmp_path):
    """`rl360 alternate`'s listener data after a speaker phase: the speaker's export describes each game once, and
    each game's two rows (its target, one distractor) ask about that description."""
    import random as _random

    from rl360.alternate import describe
    from rl360.data.lewis import write_rows
    from rl360.quickstart.lewis_assets import build_speaker

    listener, games, shapes = game
    colours, kinds = list(shapes.COLOURS), list(shapes.SHAPES)
    speaker = build_speaker(tmp_path / "speaker", shapes.INSTRUCTION, colours, kinds,
                            shapes.draw_shape("red", "circle", _random.Random(0)), seed=2)
    data = write_rows(speaker_rows(games, shapes.INSTRUCTION), tmp_path / "speaker.parquet")
    config = ("configs/quickstart_lewis_speaker.yaml", [f"model.path={speaker}", f"data.train_files=[{data}]"])
    written = describe(str(speaker), config, listener, tmp_path / "round2", games=6, seed=1)
    rows = pq.read_table(written).to_pylist()
    assert len(rows) == 12
    by_game: dict[int, list[dict]] = {}
    for row in rows:
        by_game.setdefault(row["extra_info"]["game"], []).append(row)
    assert sorted(by_game) == list(range(6))
    for number, pair in by_game.items():
        questions = {row["prompt"][0]["content"].split("\n", 1)[1] for row in pair}
        assert len(questions) == 1  # one description per game
        target = [row for row in pair if row["reward_model"]["ground_truth"] == YES]
        assert len(target) == 1 and target[0]["extra_info"]["candidate"] == games[number].target


def test_the_games_scoring_is_yes_renormalised_against_no(tmp_path, game):
    """`--scoring yes-vs-no` (the default, the game's service's rule): softmax over the first answer token's
    log-probabilities of "yes" and "no"; a tokenizer that has neither is refused when the service starts."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl360.quickstart.assets import build_model, build_tokenizer

    _, games, shapes = game
    words = ["user", "assistant", "system", "\n", " ", "yes", "no", "Yes", "No", "Description:", "Does", "the",
             "description", "match", "image?", "Answer", "or", *shapes.COLOURS, *shapes.SHAPES]
    tokenizer = build_tokenizer(tmp_path / "peer", max_answer=0, words=list(dict.fromkeys(words)))
    build_model(tmp_path / "peer", len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed=2)
    peer = ListenerScorer(str(tmp_path / "peer"))
    assert peer.scoring == "yes-vs-no" and (peer.yes_id, peer.no_id) == tuple(
        tokenizer.convert_tokens_to_ids(word) for word in ("yes", "no"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "peer")).eval()
    for g in games[:3]:
        question = listener_question(g.description)
        prompts = [peer.prompt(path, question, "test") for path in g.paths]
        expected = []
        for ids in prompts:
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            expected.append(float(torch.softmax(torch.stack([logp[peer.yes_id], logp[peer.no_id]]), 0)[0]))
        assert peer.yes_probabilities(prompts) == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="cannot spell 'yes'.*choose the other --scoring"):
        ListenerScorer(game[0])  # the quickstart's listener says Yes and No only


def test_the_games_service_variables_set_the_listener_defaults(monkeypatch):
    import argparse

    from rl360.serve.listener import add_listener_parser

    monkeypatch.setenv("INFERENCE_CONCURRENCY", "2")
    monkeypatch.setenv("LISTENER_BATCH_SIZE", "5")
    monkeypatch.setenv("INFERENCE_ACQUIRE_TIMEOUT", "12.5")
    parser = argparse.ArgumentParser()
    add_listener_parser(parser.add_subparsers())
    args = parser.parse_args(["listener", "--model", "m"])
    assert (args.concurrency, args.max_batch, args.acquire_timeout_s, args.scoring) == (2, 5, 12.5, "yes-vs-no")


def test_a_request_that_waits_past_the_acquire_timeout_is_answered_busy(game, scorer):
    """As the game's service: a request that cannot get a forward in time is a 503 "Listener busy"."""
    import threading

    from rl360.serve.listener import Item
    from rl360.service.app import ServiceError

    _, games, _ = game
    release = threading.Event()

    class SlowScorer:
        def prompt(self, path, question, where):
            return scorer.prompt(path, question, where)

        def yes_probabilities(self, prompts):
            release.wait(30)
            return scorer.yes_probabilities(prompts)

    service = InProcessService(SlowScorer(), max_batch=4, concurrency=1, acquire_timeout_s=0.2)
    item = Item(list(games[0].paths), listener_question(games[0].description), 1)

    async def scenario():
        first = asyncio.ensure_future(service.answer([item], "/score"))  # holds the only forward
        await asyncio.sleep(0)
        with pytest.raises(ServiceError, match="Listener busy"):
            await service.answer([item], "/score")
        release.set()
        return await first

    assert len(asyncio.run(scenario())["results"][0]["yes_probabilities"]) == 4


def test_the_speaker_client_reads_the_games_own_variables(monkeypatch):
    monkeypatch.delenv("RL360_LISTENER_URL", raising=False)
    monkeypatch.setenv("LISTENER_URL", "http://listener.invalid:9000/batch_score")
    monkeypatch.setenv("LISTENER_TIMEOUT", "7")
    monkeypatch.setenv("LISTENER_CHUNK_SIZE", "3")
    monkeypatch.setenv("LISTENER_CHUNK_DELAY", "0.05")
    monkeypatch.setenv("LISTENER_MAX_RETRIES", "5")
    monkeypatch.setenv("LISTENER_BACKOFF_FACTOR", "2.0")
    client = ListenerClient.from_env()
    assert client.url == "http://listener.invalid:9000" and client.timeout_s == 7.0
    assert (client.chunk_size, client.chunk_delay_s, client.max_retries, client.backoff_s) == (3, 0.05, 5, 2.0)
    monkeypatch.setenv("RL360_LISTENER_CHUNK_SIZE", "6")  # rl360's own name wins
    assert ListenerClient.from_env().chunk_size == 6


@pytest.mark.parametrize("response, strict, lenient", [
    (FULL, 1.0, 1.0),
    ("<thinking>t</thinking>\n<coarse>red</coarse>\n<detailed>A red shape.</detailed>\n", 1.0, 1.0),
    ("<coarse>red</coarse><thinking>t</thinking><detailed>A red shape.</detailed>", 0.0, 1.0),  # out of order
    ("Sure! " + FULL, 0.0, 1.0),  # text around the blocks
    (FULL + " Done.", 0.0, 1.0),
    ("<thinking>t</thinking><coarse>red</coarse>", 0.0, 0.0),  # a block missing
    ("<thinking>t<coarse>red</coarse></thinking><detailed>d</detailed>", 0.0, 0.0),  # nested
])
def test_the_speakers_format_term_is_the_games_strict_rule_by_default(response, strict, lenient, monkeypatch):
    from rl360.rewards import lewis

    class Picks:  # no listener in this test: the format term alone
        def answer(self, games):
            return [lewis.ListenerAnswer([1.0], 0)]

    monkeypatch.setattr(lewis, "env_client", lambda: Picks())
    info = {"candidate_paths": ["a.png"]}
    assert speaker_reward(response, "0", info)["format"] == strict
    assert speaker_reward(response, "0", {**info, "format_rule": "lenient"})["format"] == lenient
