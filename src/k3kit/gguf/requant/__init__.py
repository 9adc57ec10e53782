"""Surgical requantization: the trunk to a new type, the QAT experts untouched, shard by shard.

K3's trunk ships as Q8_0 (59.6 GB) and fits a 2x24 GB box as Q4_K; its routed experts are
MXFP4 from quantization-aware training and must keep their exact bytes. The operation has to
run on a 1.4 TB, 32-shard model on a box that cannot hold two copies, so it is built as:

    plan -> disk preflight -> per-shard jobs -> verify -> rename -> journal -> delete source

* plan.py decides per tensor: requantize (dequantize the source to float32 in row chunks,
  quantize with the bit-exact codec) or copy byte for byte (FileRange, in-kernel), and orders
  the shards so the outputs fit on disk.
* Each output shard keeps its source's name, tensors and KVs (general.file_type updated).
  worker.py writes it under a hidden `.NAME.partial` name, fsynced, verified (verify.py) and
  only then renamed to NAME; the journal (journal.py) records it as verified after the
  rename, and only a shard the journal (fsynced) calls verified may have its source deleted.
* The journal (OUT_DIR/k3kit-requant.json, atomically rewritten) lets --resume (resume.py)
  skip verified shards and redo the rest, also after their sources were deleted: every
  shard's job needs only its own source file, and shard 1's KVs live on in its verified output.
* SIGKILL at any point leaves: sources present or replaced by a verified output, no
  unverified file under a final name (partials are hidden and removed on resume).

run.py ties them together (`requantize`); verify.py also serves `k3kit verify` (`verify_model`).
"""

from k3kit.gguf.requant.journal import Journal
from k3kit.gguf.requant.plan import (
    JOURNAL_NAME,
    TARGETS,
    Options,
    ShardPlan,
    TensorPlan,
    parse_target,
    plan_tensors,
    preflight,
)
from k3kit.gguf.requant.run import RequantResult, requantize
from k3kit.gguf.requant.verify import ERROR_BOUNDS, ShardCheck, VerifyResult, verify_model, verify_shard
from k3kit.gguf.requant.worker import ShardResult, run_shard

__all__ = [
    "ERROR_BOUNDS", "JOURNAL_NAME", "TARGETS", "Journal", "Options", "RequantResult", "ShardCheck",
    "ShardPlan", "ShardResult", "TensorPlan", "VerifyResult", "parse_target", "plan_tensors", "preflight",
    "requantize", "run_shard", "verify_model", "verify_shard",
]
