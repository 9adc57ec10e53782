"""k3kit.models."""
