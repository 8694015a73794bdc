"""The reward registry and the timeout-wrapped process pool."""

import ctypes
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import tests.reward_fixtures as fixtures
from rl360.rewards import (
    RewardItem,
    RewardPool,
    check_data_sources,
    compute_score,
    get_reward_fn,
    register_reward,
    register_reward_path,
)
from rl360.rewards.judge import judge_key_env
from rl360.rewards.pool import open_reward_pool, worker_environment
from rl360.rewards.registry import Route, find_route
from rl360.rewards.sandbox import ISOLATION_ENV, REQUIRE_ENV, IsolationError, isolation

# upper bounds only, far above the expected time: they prove that nothing blocks, not speed
NON_BLOCKING_S = 20


def _math(answer, truth="2"):
    return RewardItem("math__t", f"\\boxed{{{answer}}}", truth)


# --- registry -----------------------------------------------------------------------------------------


def test_unknown_data_sources_are_listed_at_once():
    check_data_sources(["math__x", "math", "test_echo"])
    with pytest.raises(KeyError, match=r"\['nope__y', 'zzz'\]") as err:
        check_data_sources(["math__x", "zzz", "nope__y", "zzz", "codegen__x"])
    assert "math" in str(err.value)  # the registered prefixes are named too


def test_get_reward_fn_names_the_data_source():
    with pytest.raises(KeyError, match="nope__x"):
        get_reward_fn("nope__x")


def test_longest_prefix_wins():
    assert get_reward_fn("test_echo__special_set") is fixtures.echo_special
    assert get_reward_fn("test_echo__other") is fixtures.echo
    assert compute_score("test_echo__special", "a", "b") == {"score": 0.5, "seen": "special"}


def test_register_by_path():
    register_reward_path("test_by_path", "tests.reward_fixtures:echo")
    assert compute_score("test_by_path__a", "x", "x", {"i": 1}) == {"score": 1.0, "seen": {"i": 1}}
    with pytest.raises(ModuleNotFoundError, match="reward reference 'no_such_module:fn'"):
        register_reward_path("test_bad", "no_such_module:fn")
    with pytest.raises(AttributeError, match="no_such_fn"):
        register_reward_path("test_bad", "tests.reward_fixtures:no_such_fn")
    with pytest.raises(ValueError, match="module:function"):
        register_reward_path("test_bad", "tests.reward_fixtures.echo")
    check_data_sources(["test_by_path__a"])
    with pytest.raises(KeyError):
        check_data_sources(["test_bad"])


def test_register_by_file_path_scores_in_the_workers_too(tmp_path, monkeypatch):
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "my_task.py").write_text(
        "def fn(solution_str, ground_truth, extra_info):\n"
        "    return {'score': float(solution_str.endswith(str(ground_truth))), 'file': __file__}\n")
    monkeypatch.chdir(tmp_path)  # relative to the directory the run starts in
    register_reward_path("test_file_route", "rewards/my_task.py:fn")
    assert compute_score("test_file_route__a", "so 4", "4")["score"] == 1.0
    with RewardPool(num_workers=1, timeout_s=30) as pool:
        results = pool.score([RewardItem("test_file_route__a", "so 4", "4"), RewardItem("test_file_route", "5", "4")])
    assert [r.score for r in results] == [1.0, 0.0] and results[0].extras["file"].endswith("my_task.py")
    with pytest.raises(ImportError, match="no such file"):
        register_reward_path("test_bad", "rewards/missing.py:fn")


def test_verls_custom_reward_function_scores_every_row_with_verls_signature(tmp_path):
    """`custom_reward_function.path` / `.name` as verl's scripts pass them: read as reward.custom["*"], the file's
    function scores every data_source (built-in routes included), called as verl calls it. In a process of its
    own: the "*" route would take every data_source of this one."""
    (tmp_path / "my_score.py").write_text(
        "def my_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 0.25, 'source': data_source, 'truth': ground_truth}\n")
    script = (
        "from rl360.config import load_config\n"
        "from rl360.rewards import RewardItem, RewardPool, register_reward_path\n"
        "cfg = load_config(None, ['model.path=m', 'data.train_files=[d.parquet]', "
        "'custom_reward_function.path=my_score.py', 'custom_reward_function.name=my_score'])\n"
        "for prefix, ref in cfg.reward.custom.items():\n"
        "    register_reward_path(prefix, ref)\n"
        "with RewardPool(num_workers=1, timeout_s=30) as pool:\n"
        "    results = pool.score([RewardItem('math__dapo', '\\\\boxed{2}', '2'), RewardItem('anything', 'x', 'y')])\n"
        "print(cfg.reward.custom, [(r.score, r.extras) for r in results])\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == ("{'*': 'my_score.py:my_score#verl'} [(0.25, {'source': 'math__dapo', 'truth': "
                                   "'2'}), (0.25, {'source': 'anything', 'truth': 'y'})]")
    assert "verl's custom_reward_function read as reward.custom" in done.stderr


def test_a_function_workers_cannot_import_is_refused():
    with pytest.raises(ValueError, match="module level"):
        @register_reward("test_local")
        def local(solution_str, ground_truth, extra_info=None):
            return 1.0


# --- pool ---------------------------------------------------------------------------------------------


def test_results_in_input_order_with_scores_and_extras():
    items = [_math(i % 3, "1") for i in range(30)]
    items.insert(7, RewardItem("test_echo", "a", "a", {"k": 1}))
    with RewardPool(num_workers=2, timeout_s=30) as pool:
        results = pool.score(items)
        metrics = pool.last_metrics()
    expected = [1.0 if i % 3 == 1 else 0.0 for i in range(30)]
    expected.insert(7, 1.0)
    assert [r.score for r in results] == expected
    assert results[7].extras == {"seen": {"k": 1}}
    assert results[5].extras == {"pred": "2"}
    assert all(not r.timed_out and r.error is None for r in results)
    assert metrics["reward/calls"] == 31
    assert metrics["reward/calls/math"] == 30 and metrics["reward/calls/test_echo"] == 1
    assert metrics["reward/timeouts"] == 0 and metrics["reward/errors"] == 0


def test_calls_run_concurrently_on_all_workers(tmp_path):
    # each call waits for the other worker's call to start: both score 1 only if they run together
    items = [RewardItem("test_rendezvous", str(tmp_path), "2") for _ in range(2)]
    with RewardPool(num_workers=2, timeout_s=30) as pool:
        assert [r.score for r in pool.score(items)] == [1.0, 1.0]


def test_hanging_reward_costs_one_timeout_each_and_the_pool_recovers():
    items = [RewardItem("test_hang", "x", "y") for _ in range(10)]
    with RewardPool(num_workers=2, timeout_s=1.0) as pool:
        results = pool.score(items)  # 5 rounds of 1 s timeouts on the 2 workers, each ending in a replaced worker
        assert all(r.score == 0.0 and r.timed_out for r in results)
        metrics = pool.last_metrics()
        assert metrics["reward/timeouts"] == 10 and metrics["reward/timeouts/test_hang"] == 10
        assert metrics["reward/errors"] == 0

        after = pool.score([_math(2), _math(1), _math(2), _math(3)])
        assert [r.score for r in after] == [1.0, 0.0, 1.0, 0.0]
        assert not any(r.timed_out for r in after)
        assert pool.last_metrics()["reward/timeouts"] == 0
        assert pool.total_metrics()["reward/timeouts"] == 10
        assert pool.total_metrics()["reward/calls"] == 14


def test_a_timeout_among_normal_calls_leaves_the_others_scored():
    items = [_math(2), RewardItem("test_hang", "", ""), _math(2), _math(1), _math(2)]
    with RewardPool(num_workers=2, timeout_s=1.0) as pool:
        results = pool.score(items)
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert [r.timed_out for r in results] == [False, True, False, False, False]


def test_the_timeout_holds_for_every_call_of_a_worker_not_only_its_first():
    """A worker that has answered takes its next calls under the same timeout: a call that would score 1 after
    8 s scores 0, timed out, as the second call of one `score` and as the first of a later `score`."""
    slow = RewardItem("test_sleep", "8", "")
    with RewardPool(num_workers=1, timeout_s=2.0) as pool:
        results = pool.score([_math(2), slow])
        assert [(r.score, r.timed_out) for r in results] == [(1.0, False), (0.0, True)]
        assert pool.score([_math(2)])[0].score == 1.0  # the worker that replaced the timed-out one answers
        later = pool.score([slow])[0]
        assert (later.score, later.timed_out) == (0.0, True)


def test_raising_reward_scores_zero_with_its_error():
    with RewardPool(num_workers=1, timeout_s=30) as pool:
        results = pool.score([RewardItem("test_raise", "oops", "y"), _math(2)])
        assert results[0].score == 0.0 and not results[0].timed_out
        assert results[0].error == "ValueError: bad response 'oops'"
        assert results[1].score == 1.0 and results[1].error is None
        assert pool.last_metrics()["reward/errors"] == 1
        assert pool.last_metrics()["reward/errors/test_raise"] == 1


@pytest.mark.parametrize("source,why", [
    ("test_exit", "exit code 3"),
    ("test_segfault", "SIGSEGV"),
    ("test_fork_exit", "exit code 4"),  # a forked child still holds the worker's pipe open
])
def test_dying_worker_scores_zero_and_is_replaced(source, why):
    items = [RewardItem(source, "x", "y"), _math(2), RewardItem(source, "x", "y"), _math(1)]
    with RewardPool(num_workers=1, timeout_s=30) as pool:
        results = pool.score(items)
        assert [r.score for r in results] == [0.0, 1.0, 0.0, 0.0]
        for dead in (results[0], results[2]):
            assert "died" in dead.error and why in dead.error and not dead.timed_out
        assert results[1].error is None and results[3].error is None
        assert pool.last_metrics()["reward/errors"] == 2
        assert [r.score for r in pool.score([_math(2)])] == [1.0]


def test_memory_limit_turns_a_huge_allocation_into_an_error():
    with RewardPool(num_workers=1, timeout_s=30, max_memory_bytes=1 << 30) as pool:
        results = pool.score([RewardItem("test_allocate", str(4 << 30), ""),
                              RewardItem("test_allocate", str(1 << 20), ""), _math(2)])
    assert results[0].score == 0.0 and results[0].error.startswith("MemoryError")
    assert [r.score for r in results[1:]] == [1.0, 1.0]


def test_a_timed_out_worker_takes_its_child_processes_with_it(tmp_path):
    pid_file = tmp_path / "child.pid"
    with RewardPool(num_workers=1, timeout_s=2.0) as pool:
        [result] = pool.score([RewardItem("test_child_hang", str(pid_file), "")])
        assert result.timed_out
        child = int(pid_file.read_text())
        deadline = time.monotonic() + NON_BLOCKING_S
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(child)


def test_bad_results_and_unknown_sources():
    with RewardPool(num_workers=1, timeout_s=30) as pool:
        [result] = pool.score([RewardItem("test_no_score", "", "")])
        assert result.score == 0.0 and "'score'" in result.error
        with pytest.raises(KeyError, match="nope__z"):
            pool.score([_math(2), RewardItem("nope__z", "", "")])


def test_in_process_mode():
    with RewardPool(num_workers=0) as pool:
        results = pool.score([_math(2), _math(3), RewardItem("test_raise", "r", "")])
        assert [r.score for r in results] == [1.0, 0.0, 0.0]
        assert results[2].error.startswith("ValueError")
        assert pool.last_metrics()["reward/errors"] == 1


def test_close_is_idempotent_and_final():
    pool = RewardPool(num_workers=2, timeout_s=30)
    workers = [w.process for w in pool._workers]
    pool.close()
    pool.close()
    assert not any(process.is_alive() for process in workers)
    with pytest.raises(RuntimeError, match="close"):
        pool.score([_math(2)])


def test_empty_batch():
    with RewardPool(num_workers=2, timeout_s=30) as pool:
        assert pool.score([]) == []
        assert pool.last_metrics() == {"reward/calls": 0, "reward/timeouts": 0, "reward/errors": 0}


def _running(pid: int) -> bool:
    """Alive and not a zombie (a container's PID 1 may never reap orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return os.path.exists(f"/proc/{pid}")


def test_workers_see_the_environment_of_the_pools_creation_and_extra_env(monkeypatch):
    """Workers fork from a long-lived forkserver; they still get the environment the pool was made in
    (not the one of the first pool; only the allow-listed and passed-through variables of it), plus `env`."""
    with RewardPool(num_workers=1, timeout_s=10) as pool:  # starts the forkserver if none runs yet
        assert pool.score([RewardItem("test_env", "RL360_TEST_ENV_A", "")])[0].score == -1.0
    monkeypatch.setenv("RL360_TEST_ENV_A", "2")
    monkeypatch.setenv("RL360_TEST_ENV_C", "5")  # neither allow-listed nor passed through: the workers lack it
    with RewardPool(num_workers=1, timeout_s=10, env={"RL360_TEST_ENV_B": "3"},
                    env_passthrough=["RL360_TEST_ENV_A"]) as pool:
        results = pool.score([RewardItem("test_env", name, "") for name in ("RL360_TEST_ENV_A", "RL360_TEST_ENV_B")])
        assert [r.score for r in results] == [2.0, 3.0]
        assert pool.score([RewardItem("test_env", "RL360_TEST_ENV_C", "")])[0].score == -1.0
        pool.score([RewardItem("test_exit", "", "")])  # the replacement worker gets the same environment
        assert pool.score([RewardItem("test_env", "RL360_TEST_ENV_B", "")])[0].score == 3.0
    assert "RL360_TEST_ENV_B" not in os.environ
    in_process = RewardPool(num_workers=0, env={"RL360_TEST_ENV_B": "4"})
    assert in_process.score([RewardItem("test_env", "RL360_TEST_ENV_B", "")])[0].score == 4.0
    assert "RL360_TEST_ENV_B" not in os.environ


# --- the workers' environment: an allow-list, the pool's env, and the judge's key only when it is used ----

PARENT = {"PATH": "/bin", "HOME": "/home/u", "LC_ALL": "C.UTF-8", "WANDB_API_KEY": "wandb", "HF_TOKEN": "hf",
          "AWS_SECRET_ACCESS_KEY": "aws", "RL360_JUDGE_API_KEY": "judge-key", "OPENAI_API_KEY": "openai-key",
          "MY_KEY": "my-key", "RL360_SANDBOX_URL": "http://sandbox:8080", "RL360_JUDGE_MODEL": "judge-model",
          "EXTRA": "extra"}
BASE = {"PATH": "/bin", "HOME": "/home/u", "LC_ALL": "C.UTF-8", "RL360_SANDBOX_URL": "http://sandbox:8080",
        "RL360_JUDGE_MODEL": "judge-model"}


def test_worker_environment_keeps_only_what_workers_need():
    assert worker_environment(PARENT) == BASE
    assert worker_environment(PARENT, passthrough=["EXTRA", "NOT_SET"]) == {**BASE, "EXTRA": "extra"}
    assert worker_environment(PARENT, {"PATH": "/opt/bin", "RL360_X": "1"}) == {**BASE, "PATH": "/opt/bin",
                                                                                 "RL360_X": "1"}
    for bad in (["A=B"], [""], [None], "EXTRA"):
        with pytest.raises(ValueError, match="env_passthrough"):
            worker_environment(PARENT, passthrough=bad)


def test_the_judges_key_reaches_workers_only_where_a_judge_is_configured():
    judge = {"RL360_JUDGE_URL": "http://judge:8000/v1"}
    assert worker_environment(PARENT, judge) == {**BASE, **judge, "RL360_JUDGE_API_KEY": "judge-key"}
    named = {**judge, "RL360_JUDGE_API_KEY_ENV": "MY_KEY"}  # reward.judge.api_key_env: only that variable
    assert worker_environment(PARENT, named) == {**BASE, **named, "MY_KEY": "my-key"}
    fallback = {name: value for name, value in PARENT.items() if name not in ("RL360_JUDGE_API_KEY", "MY_KEY")}
    assert judge_key_env(named, fallback) == {"OPENAI_API_KEY": "openai-key"}  # as JudgeClient looks it up
    assert judge_key_env({}, PARENT) == {} and judge_key_env({"RL360_JUDGE_URL": " "}, PARENT) == {}
    assert judge_key_env(judge, {"PATH": "/bin"}) == {}


def test_workers_get_the_allow_list_and_the_judges_key_and_nothing_else(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "91")
    monkeypatch.setenv("MY_JUDGE_KEY", "37")
    settings = {"RL360_JUDGE_URL": "http://judge:8000/v1", "RL360_JUDGE_API_KEY_ENV": "MY_JUDGE_KEY"}
    with RewardPool(num_workers=1, timeout_s=30, env=settings) as pool:
        results = pool.score([RewardItem("test_env", name, "") for name in ("MY_JUDGE_KEY", "WANDB_API_KEY")])
        assert [r.score for r in results] == [37.0, -1.0]
        assert pool.score([RewardItem("test_dumpable", "", "")])[0].score == 0.0  # PR_GET_DUMPABLE in the worker
    with RewardPool(num_workers=1, timeout_s=30) as pool:  # no judge endpoint: no key
        assert pool.score([RewardItem("test_env", "MY_JUDGE_KEY", "")])[0].score == -1.0


def test_a_worker_that_cannot_start_costs_an_error_per_call_not_a_hang():
    # a variable name the worker cannot set: each worker ends before it is ready to take calls
    with RewardPool(num_workers=2, timeout_s=30, env={"NOT=A NAME": "x"}) as pool:
        results = pool.score([_math(2) for _ in range(3)])
        assert all(r.score == 0.0 and not r.timed_out for r in results)
        assert all("before it was ready to take calls" in r.error or "died before the call" in r.error
                   for r in results), [r.error for r in results]
        assert pool.last_metrics()["reward/errors"] == 3


def latex_parser_built() -> bool:
    """Whether math-verify's LaTeX parser (ANTLR, built on its first use) has been built in this process."""
    return "antlr4.LL1Analyzer" in sys.modules


def test_a_fresh_worker_starts_with_the_math_parser_built():
    """The forkserver builds the parser before it forks: no worker's first reward call builds it in its timeout."""
    with RewardPool(num_workers=1, timeout_s=30) as pool:
        assert pool.run_in_worker(f"{__name__}:latex_parser_built") is True
        pool._replace(0)
        assert pool.run_in_worker(f"{__name__}:latex_parser_built") is True


# --- asking a worker: what isolation code gets there, and the start of a run --------------------------------


def test_run_in_worker_calls_a_function_there_and_reports_its_failure():
    with RewardPool(num_workers=1, timeout_s=30) as pool:
        assert pool.run_in_worker("os:getpid") == pool._workers[0].process.pid
        with pytest.raises(RuntimeError, match=r"tests.test_reward_pool:failing_call failed in a reward worker: "
                                               r"ValueError: no answer here"):
            pool.run_in_worker(f"{__name__}:failing_call")
        assert pool.score([_math(2)])[0].score == 1.0  # the worker still scores
    assert RewardPool(num_workers=0).run_in_worker("os:getpid") == os.getpid()
    with pytest.raises(RuntimeError, match="after close"):
        pool.run_in_worker("os:getpid")


def _reward_cfg(**overrides):
    """A `reward` config section, as rl360.config.RewardConfig holds it."""
    judge = SimpleNamespace(url="", model="", api_key_env="RL360_JUDGE_API_KEY", template="correctness",
                            max_concurrency=8, timeout_s=60.0, max_retries=3, backoff_s=1.0, deadline_s=300.0)
    fields = dict(num_workers=1, timeout_s=30.0, max_memory_gb=0.0, judge=judge, require_isolation=True,
                  env_passthrough=[])
    return SimpleNamespace(**{**fields, **overrides})


MARKED = {"test_marked_pool__x": Route("test_marked_pool", False, "default", f"{__name__}:marked_pool_reward",
                                       runs_code=True),
          "math__y": find_route("math__y")}


def test_a_run_announces_missing_isolation_and_refuses_untrusted_code_at_start(monkeypatch):
    monkeypatch.setenv(ISOLATION_ENV, "network")  # allow-listed: the workers see it, as a user's shell would set it
    before = set(multiprocessing.active_children())
    lines = []
    with pytest.raises(IsolationError, match=r"the data holds \['test_marked_pool__x'\], scored by running the "
                                             r"response's code: refusing to run untrusted code .*missing: uid"):
        open_reward_pool(_reward_cfg(), MARKED, announce=lines.append)
    assert len(lines) == 1 and lines[0].startswith("rl360 sandbox: WARNING: untrusted code is not fully isolated")
    assert "missing: uid (turned off by RL360_SANDBOX_ISOLATION='network')" in lines[0]
    assert not set(multiprocessing.active_children()) - before  # the refused pool's workers are gone
    open_reward_pool(_reward_cfg(), {"math__y": MARKED["math__y"]}, announce=lines.append).close()  # no such data
    pool = open_reward_pool(_reward_cfg(require_isolation=False), MARKED, announce=lines.append)
    with pool:  # accepted knowingly: it starts, says so, and the workers know it
        assert lines[-1].endswith("; code runs anyway (reward.require_isolation=false)")
        assert pool.score([RewardItem("test_env", REQUIRE_ENV, "")])[0].score == 0.0


@pytest.mark.skipif(not isolation().complete, reason="this machine cannot fully isolate sandboxed code")
def test_a_run_with_full_isolation_starts_and_says_so(capsys):
    open_reward_pool(_reward_cfg(), MARKED).close()
    assert capsys.readouterr().out.startswith("rl360 sandbox: untrusted code runs isolated: a uid of its own")


def failing_call():
    raise ValueError("no answer here")


@register_reward("test_dumpable")
def dumpable(solution_str, ground_truth, extra_info=None):
    """PR_GET_DUMPABLE of the worker: 0 once it made itself non-dumpable."""
    return float(ctypes.CDLL(None, use_errno=True).prctl(3, 0, 0, 0, 0))
