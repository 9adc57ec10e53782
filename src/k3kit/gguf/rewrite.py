"""Metadata surgery: rename the architecture or tensors, set/delete/copy KVs; tensor bytes untouched.

A rewrite of a 1.4 TB model must cost about what `cp` costs, so tensor data is never read
into Python: every tensor is a FileRange copied in-kernel. Only the headers change. The
operations run in a fixed order (arch rename, KV copies, sets, deletes, tensor renames) so a
rules file means the same thing however its flags were written.
"""

from __future__ import annotations

import fnmatch
import os
import re
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
from gguf import GGUFValueType

from k3kit.errors import K3Error
from k3kit.gguf.reader import ALIGNMENT_KEY, KV, kv_int
from k3kit.gguf.shards import SPLIT_KEYS, Model
from k3kit.gguf.writer import (
    GGML_MAX_NAME,
    FileRange,
    TensorSpec,
    kv,
    output_paths,
    plan_shards,
    write_model,
)
from k3kit.progress import ByteProgress

TYPE_NAMES: dict[str, GGUFValueType] = {
    "u8": GGUFValueType.UINT8, "i8": GGUFValueType.INT8, "u16": GGUFValueType.UINT16,
    "i16": GGUFValueType.INT16, "u32": GGUFValueType.UINT32, "i32": GGUFValueType.INT32,
    "u64": GGUFValueType.UINT64, "i64": GGUFValueType.INT64, "f32": GGUFValueType.FLOAT32,
    "f64": GGUFValueType.FLOAT64, "bool": GGUFValueType.BOOL, "str": GGUFValueType.STRING,
}
_ARRAY_TYPE_RE = re.compile(r"^arr\[(\w+)\]$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


@dataclass
class Rules:
    """Everything a rewrite may change. Built from flags and/or a rules TOML file."""

    arch: str | None = None
    rename_tensors: list[tuple[re.Pattern[str], str]] = field(default_factory=list)
    set: list[KV] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)  # exact keys or globs
    copy_kv: list[tuple[Path, list[str]]] = field(default_factory=list)  # (file, key globs)

    def extend(self, other: Rules) -> None:
        self.arch = other.arch or self.arch
        self.rename_tensors += other.rename_tensors
        self.set += other.set
        self.delete += other.delete
        self.copy_kv += other.copy_kv


def _parse_scalar(text: str, vtype: GGUFValueType, where: str) -> object:
    try:
        if vtype == GGUFValueType.STRING:
            return text
        if vtype == GGUFValueType.BOOL:
            low = text.strip().lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError(f"not a bool: {text!r}")
        if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
            return float(text)
        return int(text.strip(), 0)
    except ValueError as e:
        raise K3Error(f"{where}: {e}") from None


def parse_typed_value(key: str, spec: object, where: str) -> KV:
    """`TYPE:VALUE` (e.g. `u32:4`, `str:hello`, `arr[i32]:1,2,3`) or a TOML {type, value} table."""
    if isinstance(spec, dict):
        if set(spec) != {"type", "value"}:
            raise K3Error(f"{where}: a typed value table needs exactly 'type' and 'value'")
        tname, value = str(spec["type"]), spec["value"]
        raw = None
    elif isinstance(spec, str) and ":" in spec:
        tname, raw = spec.split(":", 1)
        value = None
    else:
        raise K3Error(f"{where}: value must be TYPE:VALUE, e.g. u32:4 or arr[str]:a,b (got {spec!r})")
    tname = tname.strip()
    m = _ARRAY_TYPE_RE.match(tname)
    try:
        if m:
            item = TYPE_NAMES.get(m[1])
            if item is None:
                raise K3Error(f"{where}: unknown array element type '{m[1]}'")
            if raw is not None:
                items = [] if raw == "" else raw.split(",")
                values = [_parse_scalar(x, item, where) for x in items]
            else:
                if not isinstance(value, list):
                    raise K3Error(f"{where}: value of an {tname} must be a list")
                values = value
            return kv(key, GGUFValueType.ARRAY, values, item)
        vtype = TYPE_NAMES.get(tname)
        if vtype is None:
            raise K3Error(f"{where}: unknown type '{tname}' (use one of {', '.join(TYPE_NAMES)}, arr[T])")
        return kv(key, vtype, _parse_scalar(raw, vtype, where) if raw is not None else value)
    except ValueError as e:
        raise K3Error(f"{where}: {e}") from None


def parse_set(spec: str) -> KV:
    """`--set KEY=TYPE:VALUE`."""
    if "=" not in spec:
        raise K3Error(f"--set {spec}: expected KEY=TYPE:VALUE")
    key, value = spec.split("=", 1)
    if not key:
        raise K3Error(f"--set {spec}: empty key")
    return parse_typed_value(key, value, f"--set {spec}")


def parse_rename(spec: str) -> tuple[re.Pattern[str], str]:
    """`--rename-tensor REGEX=REPL` (split at the first '=')."""
    if "=" not in spec:
        raise K3Error(f"--rename-tensor {spec}: expected REGEX=REPLACEMENT")
    pattern, repl = spec.split("=", 1)
    try:
        return re.compile(pattern), repl
    except re.error as e:
        raise K3Error(f"--rename-tensor {spec}: bad regex: {e}") from None


def parse_size(text: str) -> int:
    """`2G`, `500M`, `1.5T`, `2GiB`: decimal units like gguf-split, binary with `i`."""
    m = _SIZE_RE.match(text)
    if not m:
        raise K3Error(f"--split-max-size {text}: expected a size like 2G, 500M or 4GiB")
    base = 1024 if m[3] else 1000
    n = int(float(m[1]) * base ** " kmgt".index((m[2] or " ").lower()))
    if n <= 0:
        raise K3Error(f"--split-max-size {text}: must be positive")
    return n


def load_rules(path: str | os.PathLike[str]) -> Rules:
    """A rules TOML: arch, delete, [set], [[rename_tensor]] {pattern, replace}, [[copy_kv]] {from, keys}."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise K3Error(f"{path}: not valid TOML: {e}") from None
    known = {"arch", "delete", "set", "rename_tensor", "copy_kv"}
    unknown = set(data) - known
    if unknown:
        raise K3Error(f"{path}: unknown rules key(s) {sorted(unknown)} (known: {sorted(known)})")
    rules = Rules()
    if "arch" in data:
        if not isinstance(data["arch"], str) or not data["arch"]:
            raise K3Error(f"{path}: arch must be a non-empty string")
        rules.arch = data["arch"]
    delete = data.get("delete", [])
    if not isinstance(delete, list) or not all(isinstance(d, str) for d in delete):
        raise K3Error(f"{path}: delete must be a list of keys")
    rules.delete = list(delete)
    sets = data.get("set", {})
    if not isinstance(sets, dict):
        raise K3Error(f"{path}: [set] must be a table of KEY = \"TYPE:VALUE\"")
    rules.set = [parse_typed_value(k, v, f"{path}: set {k}") for k, v in sets.items()]
    for i, r in enumerate(data.get("rename_tensor", [])):
        if not isinstance(r, dict) or set(r) != {"pattern", "replace"}:
            raise K3Error(f"{path}: rename_tensor[{i}] needs exactly 'pattern' and 'replace'")
        try:
            rules.rename_tensors.append((re.compile(r["pattern"]), str(r["replace"])))
        except re.error as e:
            raise K3Error(f"{path}: rename_tensor[{i}]: bad regex: {e}") from None
    for i, c in enumerate(data.get("copy_kv", [])):
        if not isinstance(c, dict) or set(c) != {"from", "keys"}:
            raise K3Error(f"{path}: copy_kv[{i}] needs exactly 'from' and 'keys'")
        keys = [c["keys"]] if isinstance(c["keys"], str) else c["keys"]
        src = Path(c["from"])
        rules.copy_kv.append((src if src.is_absolute() else path.parent / src, list(keys)))
    return rules


def _same(a: KV, b: KV) -> bool:
    if a.vtype != b.vtype or a.item_type != b.item_type:
        return False
    if a.vtype == GGUFValueType.ARRAY and a.item_type != GGUFValueType.STRING:
        return np.array_equal(np.asarray(a.value), np.asarray(b.value))
    return a.value == b.value


def apply_kv_rules(path: Path, kvs: dict[str, KV], rules: Rules) -> dict[str, KV]:
    """New KVs (in order) after arch rename, copies, sets and deletes. `path` names the input."""
    out = dict(kvs)
    if rules.arch:
        arch_kv = out.get("general.architecture")
        old = arch_kv.value if arch_kv is not None else None
        if old and old != rules.arch:
            renamed: dict[str, KV] = {}
            for key, item in out.items():
                if key.startswith(f"{old}."):
                    new_key = rules.arch + key[len(cast(str, old)):]  # general.architecture: a STRING KV
                    if new_key in out:
                        raise K3Error(f"{path}: cannot rename '{key}': '{new_key}' already exists")
                    renamed[new_key] = KV(new_key, item.vtype, item.value, item.item_type)
                else:
                    renamed[key] = item
            out = renamed
        out["general.architecture"] = KV("general.architecture", GGUFValueType.STRING, rules.arch)
    for src, globs in rules.copy_kv:
        with Model.open(src) as other:
            for g in globs:
                hits = [k for k in other.kv if fnmatch.fnmatchcase(k, g)]
                if not hits:
                    raise K3Error(f"{src}: no key matches '{g}'")
                for k in hits:
                    out[k] = other.kv[k]
    for item in rules.set:
        if item.key in SPLIT_KEYS:
            raise K3Error(f"--set {item.key}: split.* keys are managed by the writer")
        out[item.key] = item
    for pattern in rules.delete:
        hits = [k for k in out if fnmatch.fnmatchcase(k, pattern)]
        if not hits:
            raise K3Error(f"{path}: --delete {pattern}: no such key")
        for k in hits:
            del out[k]
    return out


def rename_tensors(path: Path, names: list[str], rules: Rules) -> dict[str, str]:
    """old name -> new name for every tensor; refuses collisions and names llama.cpp can't hold."""
    mapping = {}
    for name in names:
        new = name
        for pattern, repl in rules.rename_tensors:
            try:
                new = pattern.sub(repl, new)
            except (re.error, IndexError) as e:
                raise K3Error(f"--rename-tensor {pattern.pattern}: {e}") from None
        mapping[name] = new
    seen: dict[str, str] = {}
    for old, new in mapping.items():
        if not new:
            raise K3Error(f"{path}: renaming '{old}' gives an empty name")
        if len(new.encode("utf-8")) >= GGML_MAX_NAME:
            raise K3Error(f"{path}: renamed tensor '{new}' is {GGML_MAX_NAME} bytes or longer")
        if new in seen:
            raise K3Error(f"{path}: tensors '{seen[new]}' and '{old}' would both be named '{new}'")
        seen[new] = old
    return mapping


def _resolved(p: Path) -> Path:
    return p.resolve() if p.exists() or p.parent.exists() else p.absolute()


def rewrite(src: str | os.PathLike[str], out: str | os.PathLike[str] | None, rules: Rules, *,
            max_shard_bytes: int | None = None, in_place: bool = False,
            progress: ByteProgress | None = None) -> dict[str, object]:
    """Apply `rules` to the model at `src` and write it to `out`; returns what changed."""
    t0 = time.perf_counter()
    with Model.open(src) as model:
        src_path = model.paths[0]
        replacing = in_place and out is None  # only then do old shards of another count go away
        if out is None:
            if not in_place:
                raise K3Error(f"{src}: give -o OUT or --in-place")
            out = src_path if len(model.paths) > 1 else Path(src)  # output_paths maps it per shard count
        out = Path(out)
        new_kv = apply_kv_rules(src_path, model.kv, rules)
        mapping = rename_tensors(src_path, list(model.tensors), rules)
        specs = [TensorSpec(mapping[t.name], t.shape, t.ggml_type, t.nbytes,
                            FileRange(model.paths[t.shard], t.offset, t.nbytes))
                 for t in model.tensors.values()]
        layout = None
        if max_shard_bytes is None and len(model.files) > 1:
            layout = [[mapping[t.name] for t in f.tensors] for f in model.files]
        if max_shard_bytes is not None:
            alignment = kv_int(new_kv[ALIGNMENT_KEY]) if ALIGNMENT_KEY in new_kv else 32
            n_out = len(plan_shards(specs, max_shard_bytes, alignment))
        else:
            n_out = len(layout) if layout else 1
        targets = output_paths(out, n_out)
        inputs = {_resolved(p) for p in model.paths}
        clash = [p for p in targets if _resolved(p) in inputs
                 or (p.exists() and any(os.path.samefile(p, q) for q in model.paths))]
        if clash and not in_place:
            raise K3Error(f"{clash[0]}: output would overwrite the input (use --in-place)")
        written = write_model(out, new_kv.values(), specs, max_shard_bytes=max_shard_bytes,
                              layout=layout, progress=progress)
        stale = []
        if replacing:
            keep = {_resolved(p) for p in written}
            stale = [p for p in model.paths if _resolved(p) not in keep]
            for p in stale:
                p.unlink()
        old_kv = model.kv
        input_paths = [str(p) for p in model.paths]
        total = sum(t.nbytes for t in model.tensors.values())

    old_arch_kv = old_kv.get("general.architecture")
    old_arch = old_arch_kv.value if old_arch_kv is not None else None
    moved = []
    if rules.arch and old_arch and old_arch != rules.arch:
        # general.architecture is a STRING KV
        moved = [[k, rules.arch + k[len(cast(str, old_arch)):]]
                 for k in old_kv if k.startswith(f"{old_arch}.")]
    moved_old = {a for a, _ in moved}
    moved_new = {b: a for a, b in moved}
    added = [k for k in new_kv if k not in old_kv and k not in moved_new]
    removed = [k for k in old_kv if k not in new_kv and k not in moved_old]
    changed = [k for k in new_kv if k in old_kv and not _same(old_kv[k], new_kv[k])]
    changed += [k for k, a in moved_new.items() if k in new_kv and not _same(old_kv[a], new_kv[k])]
    seconds = time.perf_counter() - t0
    return {
        "input": input_paths,
        "output": [str(p) for p in written],
        "arch": {"from": old_arch, "to": rules.arch} if rules.arch and rules.arch != old_arch else None,
        "kv_moved": moved,
        "kv_added": added,
        "kv_removed": removed,
        "kv_changed": changed,
        "tensors_renamed": [[a, b] for a, b in mapping.items() if a != b],
        "stale_shards_removed": [str(p) for p in stale],
        "n_tensors": len(mapping),
        "bytes_copied": total,
        "seconds": seconds,
    }
