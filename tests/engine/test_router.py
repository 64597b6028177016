"""The routers: prefix affinity under balance, the load override, the record's bounds, and
hashes that agree with the prefix cache's."""

from __future__ import annotations

import pytest

from braid.config import ConfigError
from braid.core.block_manager import BlockManager
from braid.engine.router import (
    LeastLoadedRouter,
    PrefixAwareRouter,
    RoundRobinRouter,
    RouterConfig,
    make_router,
    prompt_hashes,
)

BLOCK = 4


def prompt(seed: int, length: int = 32) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(length)]


def test_a_prompt_goes_where_its_prefix_went_while_loads_are_balanced() -> None:
    router = PrefixAwareRouter(3, BLOCK, capacity_blocks=100)
    system = prompt(1, 24)
    first = router.route(system + prompt(2, 8), [0, 0, 0])
    assert first.reason == "least_loaded" and first.matched_blocks == 0
    # the idlest is elsewhere, but not by more than the threshold: the cache wins
    loads = [0, 0, 0]
    loads[first.replica] = 3
    again = router.route(system + prompt(3, 8), loads)
    assert again.replica == first.replica
    assert again.reason == "prefix" and again.matched_blocks == len(system) // BLOCK


def test_imbalanced_loads_send_the_request_to_the_idlest() -> None:
    config = RouterConfig(balance_abs_threshold=4, balance_rel_threshold=1.5)
    router = PrefixAwareRouter(2, BLOCK, 100, config)
    p = prompt(5)
    home = router.route(p, [0, 0]).replica
    loads = [0, 0]
    loads[home] = 4  # not more than 4 over: balanced
    assert router.route(p, loads).replica == home
    loads[home] = 5  # 5 over 0: more than 4 over and more than 1.5 times
    route = router.route(p, loads)
    assert route.replica != home and route.reason == "load"


def test_a_small_share_of_the_prompt_is_not_worth_a_busier_replica() -> None:
    router = PrefixAwareRouter(2, BLOCK, 100, RouterConfig(cache_threshold=0.5))
    shared = prompt(7, 8)  # 2 of the next prompt's 8 blocks
    home = router.route(shared, [0, 0]).replica
    loads = [1, 1]
    loads[home] = 2
    route = router.route(shared + prompt(8, 24), loads)
    assert route.replica != home and route.reason == "least_loaded"


def test_the_record_is_bounded_and_keeps_leading_blocks_longest() -> None:
    router = PrefixAwareRouter(1, BLOCK, capacity_blocks=6)
    router.route(prompt(1, 16), [0])  # 4 blocks
    router.route(prompt(2, 16), [0])  # 4 more: 2 of the first prompt's go, its last ones
    record = router.records[0]
    assert len(record) == 6
    first = prompt_hashes(prompt(1, 16), BLOCK)
    assert first[0] in record and first[1] in record and first[3] not in record


def test_a_replica_that_restarted_is_forgotten_and_a_down_one_gets_nothing() -> None:
    router = PrefixAwareRouter(2, BLOCK, 100)
    p = prompt(9)
    home = router.route(p, [0, 0]).replica
    router.forget(home)
    assert router.route(p, [0, 0]).matched_blocks == 0
    loads: list[int | None] = [0, 0]
    loads[home] = None
    assert router.route(p, loads).replica == 1 - home
    with pytest.raises(RuntimeError, match="no replica"):
        router.route(p, [None, None])


def test_round_robin_and_least_loaded() -> None:
    rr = RoundRobinRouter(3, BLOCK)
    assert [rr.route([1], [0, 0, 0]).replica for _ in range(4)] == [0, 1, 2, 0]
    assert [rr.route([1], [0, None, 0]).replica for _ in range(3)] == [2, 0, 2]
    assert LeastLoadedRouter(3, BLOCK).route([1], [3, None, 2]).replica == 2
    assert isinstance(make_router(RouterConfig("round_robin"), 2, BLOCK, 10), RoundRobinRouter)


def test_the_router_hashes_blocks_as_the_prefix_cache_publishes_them() -> None:
    blocks = BlockManager(16, BLOCK, enable_caching=True)
    tokens = prompt(4, 18)  # 4 full blocks and 2 tokens
    blocks.allocate("r", len(tokens))
    blocks.publish("r", lambda start, end: tokens[start:end], len(tokens))
    assert set(prompt_hashes(tokens, BLOCK)) == set(blocks._cached)


@pytest.mark.parametrize("fields", [{"policy": "random"}, {"cache_threshold": 1.5},
                                    {"balance_rel_threshold": 0.5}])
def test_bad_router_settings_name_their_flag(fields: dict) -> None:
    with pytest.raises(ConfigError, match="--router-"):
        RouterConfig(**fields)
