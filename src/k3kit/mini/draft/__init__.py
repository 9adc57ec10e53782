"""Training the mini K3's DSpark drafter, and shipping it.

    train.py    the job: generate the target's greedy text, capture its tap features, distil
    batch.py    the draft forward and loss over many blocks at once
    target.py   the torch K3Model as a speculative Target; acceptance through the real loop
    io.py       the HF checkpoint (config.json + model.safetensors) and the shipped GGUF
    card.py     MODEL_CARD.md from the training summary
    ship.py     convert, measure the converted file, write the asset directory

The command line (`k3kit mini train-draft`, `k3kit mini ship-draft`) is k3kit.commands.mini.
"""
