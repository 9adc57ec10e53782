"""k3kit.mini."""
