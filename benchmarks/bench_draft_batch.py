"""One draft forward for N sequences vs N serial draft steps (what `k3kit serve --draft` runs per pass).

    python benchmarks/bench_draft_batch.py [--model PATH --draft PATH] [--sizes 1,2,4,8,16]
                                           [--steps 20] [--repeat 3] [--threads 1]

Default: the shipped mini K3 and its drafter. N greedy sequences with different prompts (so their
draft contexts differ in length) are prefilled; then, alternating, every sequence runs its own
draft step (`SpeculativeDecoder.propose`, one after the other: the peer) and all of them draft in
one forward (`propose_many`), `--steps` times each, `--repeat` rounds. Reported per N: the best
and median wall time of one round of N draft steps, serial and batched, and serial / batched
(best of each); the batched proposals are checked to be the serial tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

PROMPTS = ["import os\nimport sys\n\ndef main(", "def fibonacci(n):\n",
           "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "x = [1, 2, 3]\nprint(", "while True:\n", "# sort a list\ndef sort(",
           "import numpy as np\n"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from k3kit.adapters.session import open_session
    from k3kit.mini.paths import shipped_draft, shipped_gguf
    from k3kit.runtime.loader import LoadOptions
    from k3kit.runtime.speculative import Sampling, ScheduleConfig, SpeculativeDecoder
    from k3kit.runtime.speculative.decoder import propose_many

    session = open_session(args.model or shipped_gguf(), LoadOptions(), draft=args.draft or shipped_draft())
    model, draft = session.model, session.draft_model
    sizes = [int(x) for x in args.sizes.split(",")]
    decs = []
    for i in range(max(sizes)):
        dec = SpeculativeDecoder(model.sequence_target(model.open_sequence()), draft, Sampling(),
                                 torch.Generator(), schedule=ScheduleConfig(draft_cost=None))
        dec.prefill(session.codec.encode(PROMPTS[i % len(PROMPTS)] * (1 + i // len(PROMPTS))))
        decs.append(dec)
    print(f"{'N':>3} {'serial ms':>18} {'batched ms':>18} {'serial/batched':>15}")
    for n in sizes:
        group, anchors, left = decs[:n], [17 + i for i in range(n)], [32] * n
        serial = [d.propose(a, 32) for d, a in zip(group, anchors, strict=True)]
        together = propose_many(group, anchors, left)
        assert [p.tokens for p in serial] == [p.tokens for p in together if p is not None]
        t_ser: list[float] = []
        t_bat: list[float] = []
        for r in range(args.repeat):
            for which in (("ser", "bat") if r % 2 == 0 else ("bat", "ser")):
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    if which == "ser":
                        for d, a in zip(group, anchors, strict=True):
                            d.propose(a, 32)
                    else:
                        propose_many(group, anchors, left)
                (t_ser if which == "ser" else t_bat).append((time.perf_counter() - t0) / args.steps * 1e3)
        print(f"{n:>3} {min(t_ser):8.2f} ({statistics.median(t_ser):7.2f}) {min(t_bat):8.2f} "
              f"({statistics.median(t_bat):7.2f}) {min(t_ser) / min(t_bat):15.2f}", flush=True)
    session.close()


if __name__ == "__main__":
    main()
