"""Model architectures, loaders and the default model registry."""
