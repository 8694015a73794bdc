"""Wait until a Ray cluster has every node it should, or say which are missing.

    python -m rl360.cluster.ready --address HEAD:6379 --nodes node-01,node-02 --gpus-per-node 8 --timeout 600

Used by `launchers/slurm/ray_cluster.sh` on the head node after the workers were started. Exits 0 once the
cluster has the nodes (each with the GPUs) it expects; exits 1 at the deadline, printing which nodes have not
joined (by the names given, matched against each Ray node's hostname and address) and the GPUs seen, so a
job never waits on a node that will not come.
"""

from __future__ import annotations

import argparse
import sys
import time


def missing_nodes(expected: list[str], alive: list[dict], gpus_per_node: float) -> list[str]:
    """The expected node names with no live Ray node of that hostname or address holding the GPUs."""
    found = []
    for node in alive:
        gpus = node.get("Resources", {}).get("GPU", 0)
        if gpus >= gpus_per_node:
            found += [str(node.get("NodeManagerHostname", "")).split(".")[0], str(node.get("NodeManagerAddress", ""))]
    return [name for name in expected if name.split(".")[0] not in found and name not in found]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True, help="the head's Ray address, host:port")
    parser.add_argument("--nodes", required=True, help="comma-separated names (or addresses) of every node")
    parser.add_argument("--gpus-per-node", type=float, default=0)
    parser.add_argument("--timeout", type=float, default=600, help="seconds before giving up")
    args = parser.parse_args(argv)
    import ray

    expected = [name for name in args.nodes.split(",") if name]
    deadline = time.monotonic() + args.timeout
    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    try:
        while True:
            alive = [node for node in ray.nodes() if node.get("Alive")]
            missing = missing_nodes(expected, alive, args.gpus_per_node)
            if not missing:
                gpus = sum(node.get("Resources", {}).get("GPU", 0) for node in alive)
                print(f"ray cluster ready: {len(alive)} node(s), {gpus:g} GPU(s)", flush=True)
                return 0
            if time.monotonic() > deadline:
                seen = ", ".join(f"{n.get('NodeManagerHostname')} ({n.get('NodeManagerAddress')}, "
                                 f"{n.get('Resources', {}).get('GPU', 0):g} GPU)" for n in alive) or "none"
                print(f"ray cluster not ready after {args.timeout:g} s: node(s) {', '.join(missing)} did not join "
                      f"with {args.gpus_per_node:g} GPU(s) each; joined: {seen}", file=sys.stderr, flush=True)
                return 1
            time.sleep(2)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
