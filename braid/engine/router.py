"""Which engine replica a request goes to.

`PrefixAwareRouter` sends a prompt to the replica most likely to hold its leading KV blocks,
unless the replicas' loads are too far apart, as SGLang's cache-aware router and Ray Serve's
PrefixCacheAffinityRouter do. Its view of each replica's cache is a record of the block
hashes of the prompts it sent there (the prefix cache's own `block_hash` chain, so the router
and the caches agree on what a prefix is), least recently used first out once it holds as
many blocks as the replica's KV cache. `LeastLoadedRouter` and `RoundRobinRouter` are there to
compare against. Every router is plain Python: the server and the scale-out simulator
(benchmarks/simulate_replicas.py) run the same code.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from braid.config import ConfigError
from braid.core.block_manager import block_hash

ROUTER_POLICIES = ("prefix_aware", "least_loaded", "round_robin")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: str = "prefix_aware"
    # a replica that holds this share of a prompt's full blocks or more is preferred
    cache_threshold: float = 0.3
    # the replicas count as imbalanced (the least loaded one gets the request, whatever its
    # cache) when the busiest has more than `balance_abs_threshold` requests over the
    # idlest and more than `balance_rel_threshold` times as many (SGLang's rule)
    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ConfigError(f"--router-policy: one of {', '.join(ROUTER_POLICIES)}, "
                             f"got {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ConfigError("--router-cache-threshold: a share between 0 and 1, "
                             f"got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ConfigError("--router-balance-abs-threshold must be >= 0 and "
                             "--router-balance-rel-threshold >= 1")


@dataclass(frozen=True, slots=True)
class Route:
    replica: int
    reason: str  # "prefix", "load" (imbalance overrode the cache), "least_loaded", "round_robin"
    matched_blocks: int = 0  # of the prompt's leading blocks, held by that replica (its record)


def prompt_hashes(prompt: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as the prefix cache computes them."""
    hashes: list[bytes] = []
    for start in range(0, len(prompt) - block_size + 1, block_size):
        hashes.append(block_hash(hashes[-1] if hashes else None,
                                 prompt[start:start + block_size]))
    return hashes


class BlockRecord:
    """Block hashes, least recently used first out past `capacity`: what the router believes
    a replica caches (and the simulator's replica caches)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.hashes)

    def __contains__(self, h: bytes) -> bool:
        return h in self.hashes

    def matched(self, hashes: list[bytes], touch: bool = False) -> int:
        """How many of `hashes`' leading blocks it holds (`touch`: they become recent)."""
        for n, h in enumerate(hashes):
            if h not in self.hashes:
                return n
            if touch:
                self.hashes.move_to_end(h)
        return len(hashes)

    def remember(self, hashes: list[bytes]) -> None:
        for h in reversed(hashes):  # a prompt's leading blocks go out last: the others need them
            self.hashes[h] = None
            self.hashes.move_to_end(h)
        while len(self.hashes) > self.capacity:
            self.hashes.popitem(last=False)

    def clear(self) -> None:
        self.hashes.clear()


class Router:
    """Routes among `num_replicas`; `loads[i]` is replica i's requests in flight (running and
    waiting), None while it is down (it gets nothing)."""

    def __init__(self, num_replicas: int, block_size: int) -> None:
        self.num_replicas, self.block_size = num_replicas, block_size

    def route(self, prompt: Sequence[int], loads: Sequence[int | None]) -> Route:
        raise NotImplementedError

    def forget(self, replica: int) -> None:
        """The replica restarted: its cache is empty."""

    @staticmethod
    def least_loaded(loads: Sequence[int | None]) -> int:
        live = [(load, i) for i, load in enumerate(loads) if load is not None]
        if not live:
            raise RuntimeError("no replica is running")
        return min(live)[1]


class LeastLoadedRouter(Router):
    def route(self, prompt: Sequence[int], loads: Sequence[int | None]) -> Route:
        return Route(self.least_loaded(loads), "least_loaded")


class RoundRobinRouter(Router):
    def __init__(self, num_replicas: int, block_size: int) -> None:
        super().__init__(num_replicas, block_size)
        self._next = 0

    def route(self, prompt: Sequence[int], loads: Sequence[int | None]) -> Route:
        if all(load is None for load in loads):
            raise RuntimeError("no replica is running")
        while loads[self._next % self.num_replicas] is None:
            self._next += 1
        replica = self._next % self.num_replicas
        self._next += 1
        return Route(replica, "round_robin")


class PrefixAwareRouter(Router):
    def __init__(self, num_replicas: int, block_size: int, capacity_blocks: int,
                 config: RouterConfig = RouterConfig()) -> None:
        super().__init__(num_replicas, block_size)
        self.config = config
        # per replica: the block hashes sent there
        self.records = [BlockRecord(capacity_blocks) for _ in range(num_replicas)]

    def route(self, prompt: Sequence[int], loads: Sequence[int | None]) -> Route:
        hashes = prompt_hashes(prompt, self.block_size)
        route = self._choose(hashes, loads)
        self.records[route.replica].remember(hashes)
        return route

    def forget(self, replica: int) -> None:
        self.records[replica].clear()

    def _choose(self, hashes: list[bytes], loads: Sequence[int | None]) -> Route:
        idlest = self.least_loaded(loads)
        if self._imbalanced(loads):
            return Route(idlest, "load", self.records[idlest].matched(hashes))
        matched = {i: self.records[i].matched(hashes) for i, load in enumerate(loads)
                   if load is not None}
        best = max(matched, key=lambda i: (matched[i], -(loads[i] or 0), -i))
        if hashes and matched[best] / len(hashes) >= self.config.cache_threshold:
            return Route(best, "prefix", matched[best])
        return Route(idlest, "least_loaded", matched[idlest])

    def _imbalanced(self, loads: Sequence[int | None]) -> bool:
        live = [load for load in loads if load is not None]
        high, low = max(live), min(live)
        c = self.config
        return high - low > c.balance_abs_threshold and high > c.balance_rel_threshold * low


def make_router(config: RouterConfig, num_replicas: int, block_size: int,
                capacity_blocks: int) -> Router:
    if config.policy == "round_robin":
        return RoundRobinRouter(num_replicas, block_size)
    if config.policy == "least_loaded":
        return LeastLoadedRouter(num_replicas, block_size)
    return PrefixAwareRouter(num_replicas, block_size, capacity_blocks, config)
