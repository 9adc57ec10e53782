"""One module per CLI command; discovered by `k3kit.cli`."""
