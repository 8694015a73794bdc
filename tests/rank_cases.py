"""Many cases of a rank function in one launch of the ranks per world size: starting the ranks (each importing
torch and megatron) costs more than a case on a small model.

    outputs = launch_by_world("tests.bridge_worker:export_and_logits_case", cases, root)
    # cases: key -> (world size, the function's arguments but its second, the output directory)
    # outputs: key -> the case's output directory, or the `RankFailed` of the launch it ran in

On the ranks (`run`), the cases of one launch run one after another: each calls the function with its output
directory as second argument, then megatron's parallel state is torn down (the process group kept) and the ranks
wait for each other, so the next case sets up its own layout."""

from __future__ import annotations

import importlib
import json
from collections import defaultdict
from pathlib import Path

from rl360.cluster.launch import RankFailed, run_ranks


def launch_by_world(target: str, cases: dict, root: Path, timeout_s: float = 900) -> dict:
    by_world: dict[int, list] = defaultdict(list)
    outputs: dict = {}
    for number, (key, (world, args)) in enumerate(cases.items()):
        out = root / f"case{number}"
        out.mkdir(parents=True, exist_ok=True)
        outputs[key] = out
        by_world[world].append((key, [args[0], str(out), *args[1:]]))
    for world, listed in sorted(by_world.items()):
        listing = root / f"world{world}.json"
        listing.write_text(json.dumps([args for _, args in listed]))
        try:
            run_ranks("tests.rank_cases:run", world, [target, str(listing)], timeout_s=timeout_s)
        except RankFailed as failed:
            outputs.update({key: failed for key, _ in listed})
    return outputs


def output(outputs: dict, key) -> Path:
    """A case's output directory; its launch's failure raised."""
    found = outputs[key]
    if isinstance(found, RankFailed):
        raise found
    return found


def run(target: str, listing: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    module, name = target.split(":")
    function = getattr(importlib.import_module(module), name)
    for args in json.loads(Path(listing).read_text()):
        function(*args)
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.barrier()
    dist.destroy_process_group()
