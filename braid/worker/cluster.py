"""Joining the Ray cluster this machine belongs to (`--distributed-executor-backend ray`):
replicas (braid/engine/ray_engine.py) and pipeline stages (braid/worker/pipeline.py) are its
actors. Ray is imported only here, and only when asked for."""

from __future__ import annotations

from typing import Any

from braid.config import ConfigError

PLACEMENT_WAIT_S = 120.0  # how long an actor may wait for the cluster's CPUs


def join_cluster() -> Any:
    """The ray module, connected: to the cluster `ray start` made on this machine where
    there is one, else to a new local one (inside an actor: the actor's cluster)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--distributed-executor-backend ray needs Ray: pip install "
                          "'braid[ray]'") from None
    if not ray.is_initialized():
        try:
            ray.init(address="auto", log_to_driver=True)
        except ConnectionError:
            ray.init(log_to_driver=True)
    return ray


def connected() -> bool:
    """Whether this process is in a Ray cluster already (a driver that joined, an actor)."""
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def leave_cluster() -> None:
    """Disconnect (and end the local cluster where `join_cluster` started one)."""
    import ray

    ray.shutdown()


def wait_placed(ray: Any, ref: Any, what: str, num_cpus: int) -> Any:
    """`ref`'s result, where the actor behind it got its CPUs within PLACEMENT_WAIT_S; else a
    ConfigError saying what could not be placed (Ray would wait for ever)."""
    ready, _ = ray.wait([ref], timeout=PLACEMENT_WAIT_S)
    if not ready:
        free = ray.available_resources().get("CPU", 0)
        raise ConfigError(f"Ray placed no {what} in {PLACEMENT_WAIT_S:.0f} s: it asks for "
                          f"{num_cpus} CPU(s) (--num-threads), the cluster has {free:g} free; "
                          "add nodes (ray start --address ...) or ask for fewer threads")
    return ray.get(ref)
