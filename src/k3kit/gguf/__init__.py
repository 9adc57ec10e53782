"""k3kit.gguf."""
