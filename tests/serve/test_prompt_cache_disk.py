"""The prompt cache's disk tier: entries survive a restart and give the same tokens; a flipped byte,
a truncated or foreign file, and a writer killed mid-write are skipped, never used."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from scheduling import serve_together

from k3kit.runtime.sampling import Sampling
from k3kit.serve.batch import BatchScheduler
from k3kit.serve.prompt_cache import Entry, Point, PromptCache, default_interval
from k3kit.serve.prompt_cache_disk import SUFFIX
from k3kit.serve.scheduler import GenerationRequest

SYSTEM = "You are a terse assistant that writes Python. " * 12


def _prompt(codec, user):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return tuple(codec.encode(codec.chat.render(msgs, add_generation_prompt=True)))


def _cache(session, directory, ident="model-a"):
    m = session.model
    return PromptCache(64 << 20, default_interval(m.recurrent_bytes, m.positional_row_bytes),
                       directory=directory, identity=ident)


def _serve(session, cache, prompt, n=8):
    sched = BatchScheduler(session.model, session.codec, max_batch=64, prompt_cache=cache)
    req = GenerationRequest(prompt, n, Sampling())
    try:
        toks = serve_together(sched, [req])[0]
    finally:
        sched.close()
    return toks, cache.stats()


def test_restart_reuses_entries_and_changes_no_token(spec_session, tmp_path):
    prompt = _prompt(spec_session.codec, "import os")
    longer = prompt + tuple(spec_session.codec.encode(" and more text to run after the saved prompt"))
    cold_long, _ = _serve(spec_session, PromptCache(0, 256), longer)
    first = _cache(spec_session, tmp_path)
    _serve(spec_session, first, prompt)
    assert first.flush() == 1 and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1
    again = _cache(spec_session, tmp_path)                     # a restart: a new cache on the directory
    assert len(again.disk.index) == 1 and not again.entries
    toks, st = _serve(spec_session, again, longer)
    assert toks == cold_long
    assert st["disk_hits"] == 1 and st["cached_tokens"] >= len(prompt)


def test_flipped_byte_truncated_and_foreign_files_are_skipped(spec_session, tmp_path, caplog):
    prompt = _prompt(spec_session.codec, "def main():")
    cold, _ = _serve(spec_session, PromptCache(0, 256), prompt)
    first = _cache(spec_session, tmp_path)
    _serve(spec_session, first, prompt)
    first.flush()
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x10                                           # one bit of the payload
    path.write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING, logger="k3kit.serve")
    again = _cache(spec_session, tmp_path)
    assert len(again.disk.index) == 1                          # the header and tokens still read
    toks, st = _serve(spec_session, again, prompt)
    assert toks == cold and st["disk_hits"] == 0 and st["disk_skipped"] == 1
    assert "checksum mismatch" in caplog.text

    _serve(spec_session, again, prompt)                         # written again from RAM
    again.flush()
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    good = path.read_bytes()
    path.write_bytes(good[:len(good) - 7])                      # truncated
    caplog.clear()
    third = _cache(spec_session, tmp_path)
    assert not third.disk.index and third.counters.disk_skipped == 1 and "truncated" in caplog.text
    path.write_bytes(good)
    caplog.clear()
    foreign = _cache(spec_session, tmp_path, ident="model-b")
    assert not foreign.disk.index and "another model" in caplog.text
    toks, _ = _serve(spec_session, foreign, prompt)
    assert toks == cold


WRITER = textwrap.dedent("""
    import sys, numpy as np, torch
    from k3kit.serve.prompt_cache import Entry, Point, PromptCache
    pc = PromptCache(0, 256, directory=sys.argv[1], identity="killed")
    print("ready", flush=True)
    i = 0
    while True:
        toks = np.arange(i, i + 4096, dtype=np.int64)
        e = Entry(toks, (torch.randn(4096, 4096),), {4096: Point(4096, (torch.randn(64, 64),))})
        pc.disk.write(e)
        i += 1
""")


def _kill_mid_write(directory: Path) -> bool:
    """Start a writer spilling entries to `directory`, SIGKILL it while a temporary file is there;
    whether one was left behind (a write cut short)."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while not list(directory.glob(f".*{SUFFIX}.tmp-*")) and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return bool(list(directory.glob(f".*{SUFFIX}.tmp-*")))


def test_kill_during_spill_leaves_a_usable_directory(tmp_path):
    # a write takes tens of ms; on a loaded machine the kill can land between two (then try again)
    assert any(_kill_mid_write(tmp_path) for _ in range(5)), "the writer was not caught mid-write"
    pc = PromptCache(1 << 30, 256, directory=tmp_path, identity="killed")
    assert not list(tmp_path.glob(f".*{SUFFIX}.tmp-*"))        # the cut write is gone
    assert pc.counters.disk_skipped == 0
    for key in list(pc.disk.index):                              # every complete entry reads back whole
        e = pc.disk.load(key)
        assert e is not None and e.positional[0].shape == (4096, 4096)


def test_entry_bigger_than_the_ram_budget_goes_to_disk(tmp_path):
    import numpy as np
    pc = PromptCache(1 << 10, 256, directory=tmp_path, identity="x")
    toks = np.arange(300, dtype=np.int64)
    pc.insert(toks, (torch.zeros(300, 8),), [Point(300, (torch.ones(4),)), Point(256, (torch.ones(4),))])
    assert not pc.entries and len(pc.disk.index) == 1
    hit = pc.lookup(list(range(280)) + [7, 7])
    assert hit is not None and hit.pos == 256 and pc.stats()["disk_hits"] == 1
    assert isinstance(pc.disk.load(next(iter(pc.disk.index))), Entry)
    assert os.listdir(tmp_path)


def test_preload_reads_saved_entries_into_ram_and_skips_a_corrupt_one(spec_session, tmp_path):
    """After a restart, preload puts the directory's entries in RAM (within half the budget);
    the first restore from one counts as a disk hit and gives the cold run's tokens; a flipped
    byte is found by preload and the file is never used."""
    codec = spec_session.codec
    prompts = [_prompt(codec, "import os"), _prompt(codec, "class Stack:")]
    longer = prompts[0] + tuple(codec.encode(" and more text to run after the saved prompt"))
    cold_long, _ = _serve(spec_session, PromptCache(0, 256), longer)
    first = _cache(spec_session, tmp_path)
    for p in prompts:
        _serve(spec_session, first, p)
    assert first.flush() == 2
    again = _cache(spec_session, tmp_path)
    assert again.preload() == 2 and len(again.entries) == 2
    assert again.stats()["disk_hits"] == 0                    # read ahead, not yet used
    toks, st = _serve(spec_session, again, longer)
    assert toks == cold_long and st["disk_hits"] == 1 and st["cached_tokens"] >= len(prompts[0])

    paths = sorted(tmp_path.glob(f"*{SUFFIX}"), key=lambda q: q.stat().st_mtime)
    raw = bytearray(paths[-1].read_bytes())
    raw[-100] ^= 0x10
    paths[-1].write_bytes(bytes(raw))
    third = _cache(spec_session, tmp_path)
    assert third.preload() == 1 and third.stats()["disk_skipped"] == 1 and len(third.disk.index) == 1
    assert all(e.disk != paths[-1] for e in third.entries.values())

    small = PromptCache(1, 256, directory=tmp_path, identity="model-a")   # half of 1 byte: room for none
    assert small.preload() == 0 and not small.entries
