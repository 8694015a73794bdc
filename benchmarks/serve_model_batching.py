"""Concurrent chat requests on `rl360 serve model`: choices decoded in shared batches beside one at a time.

    python benchmarks/serve_model_batching.py [--model DIR] [--clients 16] [--requests 64] [--max-tokens 32]

Two servers on the same checkpoint (default: the quickstart's tiny model, built into a temporary directory) run
one after the other as processes on 127.0.0.1: `batched` with the default batching (`--batch-window-ms 5
--max-batch-rows 256`) and the BASELINE `serial` with `--max-batch-rows 1` (each choice decoded alone, as a
server that answers one request at a time does). `--clients` threads send `--requests` seeded chat requests in
all (`n` 1, `--max-tokens`, temperature 1); printed for each: requests and completion tokens per second,
p50/p99 latency, the batches the engine ran, and the ratio of the two throughputs. The clients share the
machine with the server, so figures compare with each other, not across machines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from rl360.serve.loadgen import metric_total, service_command, start_service, stop_service


def run(model_dir: str, options: list[str], clients: int, requests: int, max_tokens: int) -> dict:
    proc, url = start_service(service_command("model", "--model", model_dir, "--port", "0", "--served-model-name",
                                              "bench", *options), env=dict(os.environ), timeout_s=300)
    base = url.removesuffix("/v1")
    try:
        with httpx.Client(timeout=600) as client:
            def send(i: int) -> tuple[float, int]:
                started = time.monotonic()
                reply = client.post(f"{url}/chat/completions", json={
                    "model": "bench", "messages": [{"role": "user", "content": f"{i % 10}+{i % 7}"}],
                    "max_tokens": max_tokens, "seed": i, "temperature": 1.0})
                reply.raise_for_status()
                return time.monotonic() - started, reply.json()["usage"]["completion_tokens"]

            send(0)  # warm-up
            batches = metric_total(base, "rl360_model_batches_total")
            started = time.monotonic()
            with ThreadPoolExecutor(clients) as threads:
                results = list(threads.map(send, range(requests)))
            elapsed = time.monotonic() - started
            batches = metric_total(base, "rl360_model_batches_total") - batches
    finally:
        stop_service(proc)
    latencies = sorted(r[0] for r in results)
    return {"req_s": requests / elapsed, "tok_s": sum(r[1] for r in results) / elapsed,
            "p50": statistics.median(latencies), "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "batches": int(batches)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="checkpoint directory (default: the quickstart's tiny model)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if not model_dir:
            from rl360.quickstart.assets import build_quickstart_model

            model_dir = str(build_quickstart_model(f"{tmp}/model"))
        figures = {name: run(model_dir, options, args.clients, args.requests, args.max_tokens)
                   for name, options in (("batched", []), ("serial", ["--max-batch-rows", "1"]))}
    for name, f in figures.items():
        print(f"{name:8s} {f['req_s']:7.1f} req/s {f['tok_s']:8.1f} tok/s  p50 {f['p50'] * 1000:7.0f} ms  "
              f"p99 {f['p99'] * 1000:7.0f} ms  {f['batches']} batches")
    print(f"batched / serial throughput: {figures['batched']['tok_s'] / figures['serial']['tok_s']:.2f}x "
          f"({args.clients} clients, {args.requests} requests, max_tokens {args.max_tokens}, 1-min load "
          f"{os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
