"""Where braid keeps its files, and the JSON files a model comes with: the bottom of the
package, imported by every layer."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """$BRAID_CACHE_DIR, else ~/.cache/braid (assembled models, converted tokenizers, the
    kernels' builds)."""
    # expanded here: a unit file or `docker -e` passes "~/..." unexpanded
    return Path(os.environ.get("BRAID_CACHE_DIR") or Path.home() / ".cache" / "braid").expanduser()


class ModelLoadError(ValueError):
    """A model that cannot be found, read or converted; the message is one line for the user."""


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object a model file holds (config.json, tokenizer_config.json, ...); a
    ModelLoadError naming the file when it cannot be read or holds something else."""
    try:
        found = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read it ({e})") from None
    if not isinstance(found, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(found).__name__}")
    return found
