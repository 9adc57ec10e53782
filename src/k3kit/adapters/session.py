"""A target model, an optional draft attached to it and the target's text codec, opened together.

This is what `k3kit generate` and the benchmarks run (and what the server will hold): the
target must be a CausalModel (and a Target when a draft is attached); the draft must be an
AttachableDraft, loaded with the same options, given its block size and attached before
anything runs; the codec must not know more tokens than the model has logits for. A failure
at any step closes whatever was already opened.

Paths are resolved by the caller: "the shipped mini drafter" is a k3kit.mini asset, which
the glue layer does not know about (commands/generate.py turns `--draft default` into a path).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from k3kit.adapters import Loaded, load_model
from k3kit.errors import K3Error
from k3kit.runtime.loader import LoadOptions
from k3kit.runtime.protocols import AttachableDraft, CausalModel, Target
from k3kit.tokenizer.codec import TextCodec


@dataclass
class Session:
    target: Loaded
    draft: Loaded | None = None

    @property
    def model(self) -> CausalModel:
        """The target's model object (checked to be a CausalModel when the session opened)."""
        model = self.target.model
        assert isinstance(model, CausalModel)
        return model

    @property
    def draft_model(self) -> AttachableDraft | None:
        if self.draft is None:
            return None
        model = self.draft.model
        assert isinstance(model, AttachableDraft)
        return model

    @property
    def codec(self) -> TextCodec:
        return self.target.codec

    def close(self) -> None:
        """The draft first (it borrows the target's embedding and head), then the target."""
        try:
            if self.draft is not None:
                self.draft.close()
        finally:
            self.target.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_draft(path: str | os.PathLike, options: LoadOptions | None, target: Loaded,
               block_size: int | None = None) -> Loaded:
    """Open a draft GGUF, set its block (None: as trained) and attach it to `target`."""
    draft = load_model(path, options)
    try:
        model = draft.model
        if not isinstance(model, AttachableDraft):
            raise K3Error(f"{path}: architecture {draft.architecture!r} is not a draft (expected dflash)")
        if not isinstance(target.model, Target):
            raise K3Error(f"{target.path}: architecture {target.architecture!r} cannot verify a draft's "
                          "proposals")
        model.set_block_size(block_size)
        model.attach(target.model)
    except BaseException:
        draft.close()
        raise
    return draft


def open_session(path: str | os.PathLike, options: LoadOptions | None = None, *,
                 draft: str | os.PathLike | None = None, block_size: int | None = None) -> Session:
    """Load the model at `path`, the draft at `draft` (if any) attached to it, and its codec."""
    target = load_model(path, options)
    session = Session(target)
    try:
        if not isinstance(target.model, CausalModel):
            raise K3Error(f"{path}: architecture {target.architecture!r} cannot generate on its own "
                          "(a draft? pass it with --draft)")
        if draft is not None:
            session.draft = load_draft(draft, options, target, block_size)
        codec = session.codec
        if codec.n_vocab > target.model.vocab_size:
            raise K3Error(f"{Path(path)}: tokenizer has {codec.n_vocab} tokens, the model "
                          f"{target.model.vocab_size}")
    except BaseException:
        session.close()
        raise
    return session
