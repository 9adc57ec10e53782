"""Where the shipped mini K3 artifacts live inside the installed package.

Found through importlib.resources, so an installed wheel (package-data `mini/assets/**/*`)
and an editable checkout both work. A missing artifact is a K3Error naming the path.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from k3kit.errors import K3Error

MODEL_DIR = "mini-k3"
GGUF_NAME = "mini-k3.gguf"
HF_NAME = "hf"
DRAFT_DIR = "mini-k3-draft"          # added by the drafter issue (`k3kit mini train-draft`)
DRAFT_GGUF_NAME = "mini-k3-draft.gguf"


def assets_dir() -> Path:
    return Path(str(resources.files("k3kit.mini") / "assets"))


def _existing(p: Path, what: str, is_dir: bool = False) -> Path:
    ok = p.is_dir() if is_dir else p.is_file()
    if not ok:
        raise K3Error(f"{p}: the shipped {what} is not in this installation")
    return p.resolve()


def shipped_gguf() -> Path:
    """The mini K3 target as a kimi-k3 GGUF (MXFP4 experts, Q8_0 trunk)."""
    return _existing(assets_dir() / MODEL_DIR / GGUF_NAME, "mini K3 GGUF")


def shipped_hf() -> Path:
    """The mini K3 as a Hugging Face checkpoint directory (config, safetensors, tokenizer)."""
    d = _existing(assets_dir() / MODEL_DIR / HF_NAME, "mini K3 HF checkpoint", is_dir=True)
    _existing(d / "config.json", "mini K3 HF config")
    return d


def shipped_draft() -> Path:
    """The mini K3's DSpark drafter GGUF."""
    return _existing(assets_dir() / DRAFT_DIR / DRAFT_GGUF_NAME, "mini K3 drafter GGUF "
                     "(train one with `k3kit mini train-draft`)")
