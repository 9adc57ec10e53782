"""k3kit.kernels.threads: torch's ops on one thread for a small pass, the native kernels' count kept."""

from __future__ import annotations

import torch

from k3kit.kernels import threads


def test_serial_torch_keeps_the_native_count_and_restores_torch():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert threads.native() == 2
        with threads.serial_torch():
            assert torch.get_num_threads() == 1 and threads.native() == 2
            with threads.serial_torch():                 # nested: the outer count stays the native one
                assert torch.get_num_threads() == 1 and threads.native() == 2
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2 and threads.native() == 2
        try:
            with threads.serial_torch():
                raise ValueError("a failing pass")
        except ValueError:
            pass
        assert torch.get_num_threads() == 2 and threads.native() == 2
    finally:
        torch.set_num_threads(before)


def test_one_thread_is_left_alone():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threads.serial_torch():
            assert torch.get_num_threads() == 1 and threads.native() == 1
    finally:
        torch.set_num_threads(before)


def test_another_threads_native_kernels_keep_the_count():
    """torch's thread count is one for the process: while a pass on one thread runs its torch ops
    on one thread, native kernels called on another (a second server's pass) still get the
    configured count, and a scope entered there meanwhile changes nothing."""
    import threading as th

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: dict[str, int] = {}
    inside, done = th.Event(), th.Event()

    def other():
        inside.wait(10)
        with threads.serial_torch():
            seen["torch"], seen["native"] = torch.get_num_threads(), threads.native()
        done.set()

    t = th.Thread(target=other)
    t.start()
    try:
        with threads.serial_torch():
            inside.set()
            assert done.wait(10)
            assert torch.get_num_threads() == 1 and threads.native() == 2
        assert seen == {"torch": 1, "native": 2}
        assert torch.get_num_threads() == 2 and threads.native() == 2
    finally:
        t.join()
        torch.set_num_threads(before)
