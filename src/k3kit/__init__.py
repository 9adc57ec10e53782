"""k3kit: run Kimi-K3-class giant MoE models on machines smaller than the model."""

__version__ = "0.1.0"
