"""Ray placement (a local or joined Ray cluster, groups of rank actors) and a plain multi-process launcher.

`WorkerGroup` and `start_ray` are imported on first use, so `rl360.cluster.launch` works without Ray.
"""

__all__ = ["WorkerGroup", "start_ray", "stop_ray", "stopped_by_signals"]


def __getattr__(name: str):
    if name in __all__:
        from rl360.cluster import groups

        return getattr(groups, name)
    raise AttributeError(f"module 'rl360.cluster' has no attribute {name!r}")
