import os

import pytest

# the runs tests of resuming share (session fixtures: one unbroken run per algorithm for every module using them)
pytest_plugins = ["tests.resume_runs"]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")


def pytest_configure(config):
    """The suite runs on the CPU wherever it runs (gloo ranks and the CPU's kernels, the numbers CI checks; on a
    one-GPU machine the parallel layouts run too): CUDA is hidden before anything touches it, unless the mark
    expression selects the GPU tests (`pytest -m gpu`), which then see the machine's GPUs."""
    expression = config.option.markexpr or ""
    if "gpu" not in expression or "not gpu" in expression:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="session")
def megatron_single_rank():
    """torch.distributed (gloo) and megatron parallel state for one TP=1 x PP=1 rank in this process."""
    from rl360.actor.parallel import init_parallel

    init_parallel(1, 1, seed=0)
    yield
