"""Routed experts read from model files on demand: file I/O (`io`), the LRU cache and its byte
ledger (`cache`), slice reads (`reads`), views of the mapping (`mapped`), background reads
(`ahead`), and the store that ties them together (`store`). Model-neutral."""

from .cache import ExpertStats
from .store import ExpertStore, ExpertTensor

__all__ = ["ExpertStats", "ExpertStore", "ExpertTensor"]
