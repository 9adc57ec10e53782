"""A target model, an optional draft attached to it and the target's text codec, opened together.

This is what `k3kit generate` and the benchmarks run (and what the server will hold): the
target must be a CausalModel (and a Target when a draft is attached); the draft must be an
AttachableDraft, loaded with the same options, given its block size and attached before
anything runs; the codec must not know more tokens than the model has logits for. A failure
at any step closes whatever was already opened.

The draft may sit on its own device (`draft_device`, `--draft-device`): it is loaded on the CPU,
then moved there; the rows that cross between the two devices are the draft adapter's business
(k3kit.adapters.dflash).

Paths are resolved by the caller: "the shipped mini drafter" is a k3kit.mini asset, which
the glue layer does not know about (commands/generate.py turns `--draft default` into a path).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from k3kit.adapters import Loaded, load_model
from k3kit.errors import K3Error
from k3kit.runtime.loader import LoadOptions, parse_device
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


@runtime_checkable
class Placeable(Protocol):
    """A draft that can run on a device of its own (k3kit.adapters.dflash.DraftAdapter)."""

    def place(self, device: torch.device) -> None: ...


def parse_draft_device(spec: str | torch.device | None) -> torch.device | None:
    """`--draft-device`: cpu, cuda or cuda:N (checked like --device); None = with the target."""
    if spec is None or isinstance(spec, torch.device):
        return spec
    try:
        return parse_device(spec)
    except K3Error as e:
        raise K3Error(str(e).replace("--device", "--draft-device", 1)) from None


def load_draft(path: str | os.PathLike, options: LoadOptions | None, target: Loaded,
               block_size: int | None = None, device: str | torch.device | None = None) -> Loaded:
    """Open a draft GGUF, set its block (None: as trained), place it (None: on the target's first
    device) and attach it to `target`."""
    dev = parse_draft_device(device)
    options = options or LoadOptions()
    if dev is not None:     # loaded on the CPU, then moved: never a copy on the target's device
        options = dataclasses.replace(options, device="cpu")
    draft = load_model(path, options)
    try:
        model = draft.model
        if not isinstance(model, AttachableDraft):
            raise K3Error(f"{path}: architecture {draft.architecture!r} is not a draft (expected dflash)")
        if not isinstance(target.model, Target):
            raise K3Error(f"{target.path}: architecture {target.architecture!r} cannot verify a draft's "
                          "proposals")
        if dev is not None:
            if not isinstance(model, Placeable):
                raise K3Error(f"{path}: this draft cannot be placed on a device of its own")
            model.place(dev)
        model.set_block_size(block_size)
        model.attach(target.model)
    except BaseException:
        draft.close()
        raise
    return draft


def open_session(path: str | os.PathLike, options: LoadOptions | None = None, *,
                 draft: str | os.PathLike | None = None, block_size: int | None = None,
                 draft_device: str | torch.device | None = None) -> Session:
    """Load the model at `path`, the draft at `draft` (if any) attached to it, and its codec."""
    if draft_device is not None and draft is None:
        raise K3Error("--draft-device needs --draft")
    parse_draft_device(draft_device)        # a bad device fails before the target is loaded
    target = load_model(path, options)
    session = Session(target)
    try:
        if not isinstance(target.model, CausalModel):
            raise K3Error(f"{path}: architecture {target.architecture!r} cannot generate on its own "
                          "(a draft? pass it with --draft)")
        if draft is not None:
            session.draft = load_draft(draft, options, target, block_size, draft_device)
        codec = session.codec
        if codec.n_vocab > target.model.vocab_size:
            raise K3Error(f"{Path(path)}: tokenizer has {codec.n_vocab} tokens, the model "
                          f"{target.model.vocab_size}")
    except BaseException:
        session.close()
        raise
    return session
