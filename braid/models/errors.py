"""Errors a user can cause while loading a model (bad path, missing package, bad file)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model that cannot be found, read or converted; the message is one line for the user."""
