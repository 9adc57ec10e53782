"""k3kit.convert."""
