"""Run llama.cpp's own convert_hf_to_gguf.py on a checkpoint, minus its tokenizer step.

Usage: python llama_convert_runner.py LLAMA_CPP_DIR CONVERT_ARGS...
(with LLAMA_CPP_DIR/gguf-py on PYTHONPATH, so `gguf` is the vendored one with kimi-k3).

Two things are patched, both outside the tensor and hparam path that is being compared:
* `transformers` is replaced by a stub whose AutoConfig always fails. The converter imports it
  only to try `AutoConfig.from_pretrained(..., trust_remote_code=False)` and falls back to
  reading config.json when that fails, which is what happens for a real K3 too (its model
  type needs remote code). This saves installing transformers (hundreds of MB) for nothing.
* `KimiK3Model.set_vocab` is a no-op. llama.cpp identifies tokenizers by a hash of how they
  split a probe text and refuses unknown ones (the mini tokenizer is one), and it loads them
  through transformers' AutoTokenizer. The comparison therefore skips tokenizer.* KVs.
"""

from __future__ import annotations

import runpy
import sys
import types
from pathlib import Path


def main() -> None:
    llama_dir = Path(sys.argv[1])
    sys.path.insert(0, str(llama_dir))

    stub = types.ModuleType("transformers")

    class AutoConfig:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise OSError("transformers stub: no AutoConfig (k3kit interop test)")

    stub.AutoConfig = AutoConfig
    sys.modules["transformers"] = stub

    from conversion.kimi_k3 import KimiK3Model

    KimiK3Model.set_vocab = lambda self: None
    script = llama_dir / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *sys.argv[2:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
