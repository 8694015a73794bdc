"""Ray placement: a local or joined Ray cluster, placement groups, and groups of rank actors."""

from rl360.cluster.groups import WorkerGroup, start_ray

__all__ = ["WorkerGroup", "start_ray"]
