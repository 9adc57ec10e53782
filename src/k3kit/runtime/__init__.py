"""k3kit.runtime."""
