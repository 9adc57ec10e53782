"""The `dflash` GGUF architecture (DFlash / DSpark drafts) as a pure torch network.

    config.py    DraftConfig (parsed by k3kit.convert.draft_config, shared with the converter)
    names.py     parameter <-> dflash GGUF / HF tensor names
    network.py   DSparkDraft: attention with injected context K/V, MLP, Markov and confidence heads

The stateful drafter over the runtime's feature ring, and the loader entry point, are
k3kit.adapters.dflash.
"""
