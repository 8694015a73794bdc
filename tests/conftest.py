import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def megatron_single_rank():
    """torch.distributed (gloo) and megatron parallel state for one TP=1 x PP=1 rank in this process."""
    from rl360.actor.parallel import init_parallel

    init_parallel(1, 1, seed=0)
    yield
