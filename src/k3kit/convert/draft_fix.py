"""`k3kit draft fix`: bring a legacy `dflash-draft` GGUF to what llama.cpp's `dflash` loader reads.

Legacy drafts (the Lucebox / luce fork lineage) were written for a fork's own loader:
  * `general.architecture = dflash-draft` (also `qwen35-dflash-draft`): upstream llama.cpp has
    no such arch and refuses the file (ggml-org/llama.cpp#25116);
  * DFlash keys one level down, `dflash-draft.dflash.*`, with `target_layer_ids` holding HF ids
    (llama.cpp's `dflash.target_layers` holds id + 1), `mask_token_id` under the arch instead of
    `tokenizer.ggml.mask_token_id`, and DSpark flags under `dflash.dspark.*`;
  * tensors `dflash.fc.weight`, `dflash.hidden_norm.weight`, `dflash.dspark.markov.w1/w2`,
    `dflash.dspark.confidence.weight/bias` (or `dflash_fc.weight`, `dflash_hidden_norm.weight`);
  * no tokenizer of its own (or only bos/eos/pad ids), while llama.cpp takes n_vocab and the
    mask token from the draft's vocab.
Sources of these names: Lucebox's converter `server/scripts/convert_dspark_to_gguf.py`
(dusterbloom/lucebox-hub) and its unit test, the `dflash-draft.dflash.*` keys quoted in
Luce-Org/lucebox#138 and ggml-org/llama.cpp#25116, and the lucebox/eliza drafter loaders that
read `dflash_fc.weight` / `dflash_hidden_norm.weight`.

The fix is a k3kit.gguf.rewrite: arch rename (every `dflash-draft.*` key moves), KV sets and
deletes, exact tensor renames; tensor bytes are copied untouched. Running it on its own output
plans nothing and says so.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
from gguf import GGUFValueType, Keys

from k3kit.convert import draft_config
from k3kit.errors import K3Error
from k3kit.gguf.format import (
    ARCH_DFLASH,
    CONF_PROJ,
    KEY_BLOCK_SIZE,
    KEY_HAS_CONFIDENCE_HEAD,
    KEY_MASK_TOKEN_ID,
    KEY_SAMPLE_FROM_ANCHOR,
    KEY_TARGET_LAYERS,
    LLM,
    MARKOV_W1,
    check_kv_types,
    dflash_expected_tensors,
)
from k3kit.gguf.reader import KV
from k3kit.gguf.rewrite import Rules, apply_kv_rules, rewrite
from k3kit.gguf.shards import Model
from k3kit.gguf.writer import kv

LEGACY_ARCHES = ("dflash-draft", "qwen35-dflash-draft")
A = ARCH_DFLASH
BLOCK_SIZE = KEY_BLOCK_SIZE.format(arch=A)
TARGET_LAYERS = KEY_TARGET_LAYERS.format(arch=A)
SAMPLE_FROM_ANCHOR = KEY_SAMPLE_FROM_ANCHOR.format(arch=A)
HAS_CONFIDENCE = KEY_HAS_CONFIDENCE_HEAD.format(arch=A)

# legacy tensor name -> llama.cpp dflash name
LEGACY_TENSORS = {
    "dflash.fc.weight": "fc.weight",
    "dflash_fc.weight": "fc.weight",
    "dflash.hidden_norm.weight": "enc.output_norm.weight",
    "dflash_hidden_norm.weight": "enc.output_norm.weight",
    "dflash.dspark.markov.w1": "markov_w1.weight",
    "dflash.dspark.markov.w2": "markov_w2.weight",
    "dflash.dspark.confidence.weight": "conf_proj.weight",
    "dflash.dspark.confidence.bias": "conf_proj.bias",
}

# Legacy keys (after the arch move to `dflash.`) whose value lives on under another key.
# Both the nested spelling (`dflash.dflash.X`) and the half-fixed one (`dflash.X`) are accepted.
_BLOCK_SIZE = (f"{A}.dflash.block_size",)
_TARGET_IDS = (f"{A}.dflash.target_layer_ids", f"{A}.target_layer_ids")
_MASK = (f"{A}.dflash.mask_token_id", f"{A}.mask_token_id")
_CONFIDENCE = (f"{A}.dflash.dspark.confidence.enabled", f"{A}.dspark.confidence_head")
# Legacy-only keys llama.cpp never reads: dropped once their content has been carried over.
_DROP_PREFIXES = (f"{A}.dflash.", f"{A}.dspark.", f"{A}.source.")
_DROP_KEYS = (f"{A}.vocab_size", f"{A}.target_layer_ids", f"{A}.mask_token_id")
_UNSUPPORTED_PREFIXES = (f"{A}.dflash.dflash2.", f"{A}.dflash2.")


@dataclass
class FixResult:
    input: str
    output: str
    changed: bool
    arch: dict | None
    legacy_keys: list[list[str]] = field(default_factory=list)     # [old key, new key or "(dropped)"]
    kv_added: list[str] = field(default_factory=list)
    kv_removed: list[str] = field(default_factory=list)
    kv_changed: list[str] = field(default_factory=list)
    kv_moved: list[list[str]] = field(default_factory=list)
    tensors_renamed: list[list[str]] = field(default_factory=list)
    tokenizer_from: str = ""
    n_tensors: int = 0
    bytes_copied: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def summary(self) -> str:
        if not self.changed:
            return (f"{self.input}: already a llama.cpp dflash draft, nothing to change "
                    f"(copied to {self.output})")
        lines = [f"fixed {self.input} -> {self.output}"]
        if self.arch:
            lines.append(f"  arch {self.arch['from']} -> {self.arch['to']} ({len(self.kv_moved)} keys moved)")
        for old, new in self.legacy_keys:
            lines.append(f"  key {old} -> {new}")
        for old, new in self.tensors_renamed:
            lines.append(f"  tensor {old} -> {new}")
        if self.kv_added:
            lines.append(f"  added {len(self.kv_added)} keys: {', '.join(self.kv_added)}")
        if self.kv_removed:
            lines.append(f"  removed {len(self.kv_removed)} keys: {', '.join(self.kv_removed)}")
        if self.kv_changed:
            lines.append(f"  changed {len(self.kv_changed)} keys: {', '.join(self.kv_changed)}")
        return "\n".join(lines)


def _int_list(item: KV, where: str) -> list[int]:
    if item.vtype != GGUFValueType.ARRAY or item.item_type not in (
            GGUFValueType.INT32, GGUFValueType.UINT32, GGUFValueType.INT64, GGUFValueType.UINT64,
            GGUFValueType.INT16, GGUFValueType.UINT16, GGUFValueType.INT8, GGUFValueType.UINT8):
        raise K3Error(f"{where}: expected an integer array")
    return [int(x) for x in np.asarray(item.value).reshape(-1)]


def _scalar_int(item: KV, where: str) -> int:
    if isinstance(item.value, bool) or not isinstance(item.value, int | np.integer):
        raise K3Error(f"{where}: expected an integer, got {item.value!r}")
    return int(item.value)


def _first(kvs: dict[str, KV], keys: tuple[str, ...]) -> KV | None:
    hits = [kvs[k] for k in keys if k in kvs]
    return hits[0] if hits else None


def plan_fix(path: Path, model: Model, target: Model) -> tuple[Rules, list[list[str]]]:
    """The rewrite rules that turn `model` into a llama.cpp dflash draft, and the legacy key moves."""
    arch = model.arch
    if arch not in LEGACY_ARCHES + (A,):
        known = ", ".join(LEGACY_ARCHES + (A,))
        raise K3Error(f"{path}: architecture {arch!r} is not a DFlash draft ({known})")
    rules = Rules(arch=A)
    moved = apply_kv_rules(path, model.kv, Rules(arch=A))           # every key under `dflash.` now
    for k in moved:
        if k.startswith(_UNSUPPORTED_PREFIXES):
            raise K3Error(f"{path}: legacy DFlash2 key {k!r} has no known llama.cpp equivalent here")
    final: dict[str, KV] = dict(moved)
    notes: list[list[str]] = []

    def carry(old_keys: tuple[str, ...], new_key: str, value: KV) -> None:
        cur = final.get(new_key)
        if cur is not None and new_key in moved and not _equal(cur, value):
            raise K3Error(f"{path}: {old_keys[0]} and {new_key} disagree ({value.value} vs {cur.value})")
        final[new_key] = value
        notes.extend([o, new_key] for o in old_keys if o in moved)

    block = _first(moved, _BLOCK_SIZE)
    if block is not None:
        carry(_BLOCK_SIZE, BLOCK_SIZE, kv(BLOCK_SIZE, GGUFValueType.UINT32,
                                          _scalar_int(block, f"{path}: {_BLOCK_SIZE[0]}")))
    ids = _first(moved, _TARGET_IDS)
    if ids is not None:
        hf = _int_list(ids, f"{path}: {ids.key}")
        if not hf or min(hf) < -1:
            raise K3Error(f"{path}: {ids.key}={hf} is not a list of layer ids")
        carry(_TARGET_IDS, TARGET_LAYERS, draft_config.target_layers_kv(hf))
    conf = _first(moved, _CONFIDENCE)
    if conf is not None:
        carry(_CONFIDENCE, HAS_CONFIDENCE, kv(HAS_CONFIDENCE, GGUFValueType.BOOL, bool(conf.value)))

    # tokenizer: the target's, whole; the draft's own tokenizer.* keys go
    mask = _first(moved, _MASK)
    mask_id = _scalar_int(mask, f"{path}: {mask.key}") if mask is not None else None
    if mask_id is None and KEY_MASK_TOKEN_ID in moved:
        mask_id = _scalar_int(moved[KEY_MASK_TOKEN_ID], f"{path}: {KEY_MASK_TOKEN_ID}")
    if mask_id is None:
        raise K3Error(f"{path}: no mask token id (neither {_MASK[0]} nor {KEY_MASK_TOKEN_ID})")
    tok = {k: v for k, v in target.kv.items() if k.startswith("tokenizer.") and k != KEY_MASK_TOKEN_ID}
    if "tokenizer.ggml.tokens" not in tok:
        raise K3Error(f"{target.paths[0]}: has no tokenizer.ggml.tokens to give the draft")
    if not 0 <= mask_id < len(cast(list, tok["tokenizer.ggml.tokens"].value)):
        raise K3Error(f"{path}: mask token id {mask_id} is outside the target's vocabulary")
    for k in [k for k in final if k.startswith("tokenizer.")]:
        del final[k]
    final.update(tok)
    final[KEY_MASK_TOKEN_ID] = kv(KEY_MASK_TOKEN_ID, GGUFValueType.UINT32, mask_id)
    if mask is not None:
        notes.extend([o, KEY_MASK_TOKEN_ID] for o in _MASK if o in moved)

    # tensors
    names = list(model.tensors)
    renames = {n: LEGACY_TENSORS[n] for n in names if n in LEGACY_TENSORS}
    new_names = [renames.get(n, n) for n in names]
    if f"{MARKOV_W1}.weight" in new_names:       # DSpark: the keys llama.cpp's converter writes
        if SAMPLE_FROM_ANCHOR not in final:
            # every legacy DSpark converter samples from the anchor (Lucebox refuses anything else)
            final[SAMPLE_FROM_ANCHOR] = kv(SAMPLE_FROM_ANCHOR, GGUFValueType.BOOL, True)
        if HAS_CONFIDENCE not in final:
            final[HAS_CONFIDENCE] = kv(HAS_CONFIDENCE, GGUFValueType.BOOL, f"{CONF_PROJ}.weight" in new_names)

    for k in list(final):
        if k.startswith(_DROP_PREFIXES) or k in _DROP_KEYS:
            if not any(o == k for o, _ in notes):
                notes.append([k, "(dropped)"])
            del final[k]

    _check(path, final, new_names, {renames.get(n, n): model.tensors[n].shape for n in names})
    rules.set = [v for k, v in final.items() if k not in moved or not _equal(moved[k], v)]
    rules.delete = [k for k in moved if k not in final]
    rules.rename_tensors = [(re.compile("^" + re.escape(o) + "$"), n) for o, n in renames.items()]
    return rules, notes


def _equal(a: KV, b: KV) -> bool:
    if a.vtype != b.vtype or a.item_type != b.item_type:
        return False
    if a.vtype == GGUFValueType.ARRAY and a.item_type != GGUFValueType.STRING:
        return np.array_equal(np.asarray(a.value), np.asarray(b.value))
    return a.value == b.value


def _check(path: Path, final: dict[str, KV], names: list[str], shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse to write a file llama.cpp's dflash loader would still reject, or whose metadata the
    shared draft config reader (k3kit.convert.draft_config) does not accept."""
    problems = check_kv_types(A, final)
    block = final.get(LLM.BLOCK_COUNT.format(arch=A))
    if block is not None and not problems:
        required, optional = dflash_expected_tensors(int(cast(int, block.value)))
        missing = sorted(required - set(names))
        unknown = sorted(set(names) - required - optional)
        problems += [f"missing tensor {n}" for n in missing[:3]]
        problems += [f"tensor {n} is not one llama.cpp's dflash loader knows" for n in unknown[:3]]
    if problems:
        raise K3Error(f"{path}: cannot be fixed into a llama.cpp dflash draft: {'; '.join(problems)}")
    # Markov rank and confidence input width from the shapes (ggml order): markov_w1 {r, V},
    # conf_proj {H + r, 1} or {H, 1}
    w1, conf = shapes.get(f"{MARKOV_W1}.weight"), shapes.get(f"{CONF_PROJ}.weight")
    hidden = final.get(LLM.EMBEDDING_LENGTH.format(arch=A))
    with_markov = conf is None or hidden is None or int(conf[0]) != hidden.value
    draft_config.read_kvs({k: v.value for k, v in final.items()},
                          vocab_size=len(cast(list, final[Keys.Tokenizer.LIST].value)),
                          markov_rank=int(w1[0]) if w1 is not None else 0,
                          confidence_with_markov=with_markov, where=path)


def fix_draft(src: str | os.PathLike, target: str | os.PathLike, out: str | os.PathLike) -> FixResult:
    """Fix the draft `src` (tokenizer from `target`) into `out`; tensors are byte copies."""
    src, target, out = Path(src), Path(target), Path(out)
    with Model.open(src) as model, Model.open(target) as tmodel:
        rules, notes = plan_fix(src, model, tmodel)
        old_arch = model.arch
    r: dict[str, Any] = rewrite(src, out, rules)
    changed = bool(r["kv_moved"] or r["kv_added"] or r["kv_removed"] or r["kv_changed"]
                   or r["tensors_renamed"] or old_arch != A)
    return FixResult(
        input=str(src), output=str(out), changed=changed,
        arch={"from": old_arch, "to": A} if old_arch != A else None,
        legacy_keys=notes, kv_added=r["kv_added"], kv_removed=r["kv_removed"], kv_changed=r["kv_changed"],
        kv_moved=r["kv_moved"], tensors_renamed=r["tensors_renamed"], tokenizer_from=str(target),
        n_tensors=r["n_tensors"], bytes_copied=r["bytes_copied"],
    )
