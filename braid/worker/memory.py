"""How much memory the engine may take: the KV cache's size, and the limits it is checked
against (the machine's or the container's memory, what is available now)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from braid.config import ConfigError, EngineConfig
from braid.core.kv_groups import window_reach
from braid.models.config import ModelConfig
from braid.models.kv_layout import KVLayout, kv_layout
from braid.worker.runner import kv_bytes_per_token

logger = logging.getLogger("braid")


def kv_cache_blocks(cfg: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> int:
    """The KV cache's size in blocks (--num-kv-blocks, else as many as --kv-cache-gib holds);
    a ConfigError where it cannot hold one --max-model-len sequence or exceeds the memory."""
    layout = kv_layout(model_config, cfg)
    per_block = kv_bytes_per_token(model_config, dtype, layout) * cfg.block_size
    if cfg.num_kv_blocks is not None:
        num, flag = cfg.num_kv_blocks, "--num-kv-blocks"
    else:
        num = int(cfg.kv_cache_gib * 2**30 // max(per_block, 1))  # 0: a model without layers
        flag = "--kv-cache-gib"
    assert cfg.max_model_len is not None
    if num < blocks_for_one(cfg, layout):
        raise ConfigError(
            f"KV cache of {num} blocks of {cfg.block_size} tokens (--block-size) cannot hold "
            f"one sequence of --max-model-len ({cfg.max_model_len}) tokens: raise "
            "--kv-cache-gib or --num-kv-blocks, or lower --block-size or --max-model-len")
    if torch.device(cfg.device).type == "cpu":
        refuse_beyond_memory(num * per_block, f"{flag}: a KV cache of {{:.1f}} GiB does not")
    return num


def blocks_for_one(cfg: EngineConfig, layout: KVLayout) -> int:
    """Blocks one sequence of --max-model-len tokens holds at most: every position in a
    global layer group, a window and a step's tokens in a windowed one (GroupedBlocks)."""
    assert cfg.max_model_len is not None and cfg.max_num_batched_tokens is not None
    bs, length = cfg.block_size, cfg.max_model_len
    reach = [length if w is None
             else min(length, window_reach(w, bs, cfg.max_num_batched_tokens))
             for w in (layout.windows if layout.hybrid else (None,))]
    return sum(-(-n // bs) + (n < length) for n in reach)


CGROUP_ROOT = Path("/sys/fs/cgroup")


def memory_limit(cgroup_root: Path = CGROUP_ROOT) -> tuple[int, str]:
    """(bytes, what they are) this process may use: the machine's physical memory, or the
    container's memory limit where a cgroup (v2 memory.max, v1 memory.limit_in_bytes) sets
    a lower one, as in a container whose limit is below the host's memory."""
    best = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's")
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            text = (cgroup_root / name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < best[0]:
            best = (int(text), "this container's (cgroup limit)")
    return best


def refuse_beyond_memory(nbytes: int, what: str) -> None:
    """A ConfigError where `nbytes` exceed the memory this process may use (`memory_limit`);
    its message is `what` (formatted with the GiB) and "fit this machine's ... of memory"."""
    memory, whose = memory_limit()
    if nbytes > memory:
        raise ConfigError(f"{what.format(nbytes / 2**30)} fit {whose} "
                          f"{memory / 2**30:.1f} GiB of memory")


def warn_beyond_available(kv_bytes: int, flag: str, available: int | None) -> bool:
    """Log a warning (and return True) where KV caches not yet touched exceed the memory
    available now: the machine has room for them, but other processes hold it."""
    if available is None or kv_bytes <= available:
        return False
    logger.warning("%s: the KV caches take %.1f GiB, and only %.1f GiB of memory is available "
                   "now (other processes hold the rest): a full cache would swap or be killed",
                   flag, kv_bytes / 2**30, available / 2**30)
    return True


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
