import os
from collections import Counter

import pytest

# the runs tests of resuming share (session fixtures: one unbroken run per algorithm for every module using them)
pytest_plugins = ["tests.resume_runs"]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")


# Modules that must share one pytest-xdist worker (`pytest -n 2 --dist loadfile`, as the README runs the suite):
# the unbroken runs of tests/resume_runs.py are session fixtures, made once per worker that uses them. Every other
# module is a unit of its own (its module fixtures made once).
SHARED_WORKER = {"test_resume.py": "resume_runs", "test_stopping.py": "resume_runs", "test_slurm.py": "resume_runs"}


def _unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return SHARED_WORKER.get(module.rsplit("/", 1)[-1], module)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the SHARED_WORKER modules one unit, handed out in the order the workers collected
    them (pytest_collection_modifyitems), not by their number of tests."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False
    return ByModule(config, log)


def pytest_collection_modifyitems(config, items):
    """In a pytest-xdist worker: the units with the most whole training runs (`slow` tests) first, so that the
    longest do not start last; the rest in their order."""
    if hasattr(config, "workerinput"):
        slow = Counter(_unit(item.nodeid) for item in items if item.get_closest_marker("slow"))
        items.sort(key=lambda item: -slow[_unit(item.nodeid)])


def pytest_configure(config):
    """The suite runs on the CPU wherever it runs (gloo ranks and the CPU's kernels, the numbers CI checks; on a
    one-GPU machine the parallel layouts run too): CUDA is hidden before anything touches it, unless the mark
    expression selects the GPU tests (`pytest -m gpu`), which then see the machine's GPUs."""
    expression = config.option.markexpr or ""
    if "gpu" not in expression or "not gpu" in expression:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="module")
def shared_ray():
    """One local Ray for a module's in-process `train()` runs (each joins it and frees what it reserved when it
    ends), with CPUs for an 8-rank layout beside its engines: one Ray start per module instead of one per run."""
    import ray

    ray.init(address="local", num_cpus=16, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def megatron_single_rank():
    """torch.distributed (gloo) and megatron parallel state for one TP=1 x PP=1 rank in this process."""
    from rl360.actor.parallel import init_parallel

    init_parallel(1, 1, seed=0)
    yield
