"""The batching scheduler's use of the prompt cache (k3kit.serve.prompt_cache): restoring a newly
admitted sequence from the deepest saved point its prompt shares, taking recurrent copies while a
prompt is prefilled, and keeping what a finished request ran.

* Admission (`_restore`): after the sequence state is opened (and its decoder, if it drafts,
  made), the cache is asked for the prompt; a hit loads the saved state, the decoder's ring rows,
  and marks those prompt tokens as fed. A hit at the prompt's very end samples the first token
  from the saved logits: no row runs.
* Prefill (`_prefill_point`): a prompt is cut at every `interval`-th position (the chunks end
  there) while two intervals or more of it are left to run, and at its end; after each such
  chunk the recurrent state is copied with the last row's logits. A shorter tail (a
  conversation's new turn after a hit) is not cut for points (_Seq.next_rows). A request with
  `share_prompt` (the first of `n` siblings) puts its prompt's state in the cache at the
  prompt's end: the siblings, submitted when its first token comes, restore it whole.
  Where a prompt is cut changes no token in the tests (tests/serve/test_prompt_cache.py: cached
  against cold runs, greedy and seeded, AR and DSpark); a row's attention runs over the
  positions its pass holds, so its last float bits may depend on the cut (float near-ties).
* Retirement (`_store`): the tokens the sequence ran (prompt + completion, less the last
  sampled token, which never ran), its positional rows, its points plus one at its end, and its
  ring rows go into the cache. A drafting sequence that stopped in the middle of an accepted
  block has committed tokens past the ones it reported; its end point is then not kept (its
  recurrent state is past them), the points inside the prompt are.
A prefill ahead (k3kit.serve.batch) is one more such sequence: it ends when its prompt is in, and
its lookups are not counted among the requests' hits and misses.
Requests with `cache_prompt: false` neither read nor add to it.
"""

from __future__ import annotations

import logging

from torch import Tensor

from k3kit.runtime.protocols import BatchedModel, SnapshotModel
from k3kit.serve.batch_sequence import _Seq
from k3kit.serve.prompt_cache import Point, PromptCache, RingRows

log = logging.getLogger("k3kit.serve")


class PromptCaching:
    """The prompt-cache half of a BatchScheduler's worker."""

    model: BatchedModel
    prompt_cache: PromptCache | None

    @property
    def _snapshots(self) -> SnapshotModel | None:
        m = self.model
        return m if self.prompt_cache is not None and isinstance(m, SnapshotModel) else None

    def _restore(self, seq: _Seq) -> None:
        """Restore `seq` (just opened) from the cache's deepest point for its prompt, if any."""
        model, pc = self._snapshots, self.prompt_cache
        if model is None or pc is None or not seq.request.cache_prompt:
            return
        seq.interval = pc.interval
        ring = seq.dec.ring if seq.dec is not None else None
        hit = pc.lookup(seq.prompt, None if ring is None else ring.capacity,
                        None if ring is None else ring.storage, count=not seq.request.ahead)
        if hit is None:
            return
        try:
            model.load_sequence_state(seq.opened, hit.recurrent, hit.positional, hit.pos)
            if ring is not None:
                if hit.ring is None:
                    raise ValueError("no feature rows for the draft")
                ring.restore(hit.ring.start, hit.ring.data, hit.ring.scale)
        except ValueError as e:          # a saved state this model cannot take: run the prompt
            log.warning("prompt cache: cannot restore a saved state: %s", e)
            self._reopen(seq)
            return
        seq.fed = hit.pos
        seq.base = hit.key
        seq.out.cached_tokens = hit.pos
        if hit.pos == len(seq.prompt) and seq.request.ahead:    # held already: nothing to run
            seq.out.cancel("length")
        elif hit.pos == len(seq.prompt):   # the whole prompt: its last row's logits were kept
            assert hit.logits is not None
            seq.out.push(seq.sampler(hit.logits), hit.logits)

    def _reopen(self, seq: _Seq) -> None:
        """A fresh state for `seq` after a restore failed half-way."""
        self.model.close_sequence(seq.opened)
        seq.handle = self.model.open_sequence()
        if seq.dec is not None:
            seq.dec.ring.truncate(0)

    def _prefill_point(self, seq: _Seq, logits_row: Tensor) -> None:
        """After a prefill chunk: copy the recurrent state where the chunk ended on a point."""
        model = self._snapshots
        if model is None or seq.interval is None:
            return
        if seq.fed % seq.interval and seq.fed != len(seq.prompt):
            return
        share = seq.fed == len(seq.prompt) and seq.request.share_prompt and seq.request.cache_prompt
        st = model.sequence_state(seq.opened, positional=share)
        seq.points.append(Point(seq.fed, st.recurrent, logits_row.detach().to("cpu", copy=True)))
        if share and self.prompt_cache is not None:      # siblings wait for it (n > 1)
            self.prompt_cache.insert(seq.prompt, st.positional, seq.points, self._ring_rows(seq, seq.fed),
                                     base=seq.base)

    @staticmethod
    def _ring_rows(seq: _Seq, n: int) -> RingRows | None:
        """The drafter's feature rows of `seq` up to position `n`, if it drafts."""
        if seq.dec is None:
            return None
        r = seq.dec.ring
        end = min(r.length, n)
        if r.start >= end:
            return None
        data, scale = r.export(r.start, end)
        return RingRows(r.start, data, scale, r.storage)

    def _store(self, seq: _Seq) -> None:
        """Keep what the finished `seq` ran (before its state is closed)."""
        model, pc = self._snapshots, self.prompt_cache
        if model is None or pc is None or seq.interval is None or seq.handle is None:
            return
        if seq.out.finish_reason == "error":
            return
        st = model.sequence_state(seq.handle)
        known = seq.prompt + seq.out.tokens
        points = list(seq.points)
        n = st.pos
        if n <= len(known):
            if not points or points[-1].pos != n:    # (a prefill ahead took it, with its logits)
                points.append(Point(n, st.recurrent))
        else:                            # committed past the reported tokens (a draft block's tail)
            n = len(known)
        pc.insert(known[:n], st.positional, points, self._ring_rows(seq, n), base=seq.base)
