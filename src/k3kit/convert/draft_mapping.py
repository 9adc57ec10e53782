"""Draft mapping files: which HF tensor becomes which `dflash` GGUF tensor, per draft family.

A family (dflash, dspark, k3_dspark) is a small TOML file in `mappings/`: name patterns
(`layers.{L}.mlp.up_proj.weight` -> `blk.{L}.ffn_up.weight`), how to recognise the family from
config.json and the tensor names, and type exceptions. Families may `extends` another, so the
DSpark file only adds the Markov and confidence heads. Keeping this data outside the code
means a new draft lineage with different names is a file, not a patch.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from k3kit.errors import ConvertError

MAPPINGS_DIR = Path(__file__).with_name("mappings")
MAX_MAPPING_BYTES = 1 << 20
_MAX_EXTENDS = 8
_KNOWN_KEYS = {"family", "extends", "description", "detect", "tensors", "drop", "keep_f32"}
_DETECT_KEYS = {"architectures", "tensors", "absent_tensors", "config", "priority"}


@dataclass
class Mapping:
    family: str
    path: Path
    description: str = ""
    tensors: dict[str, str] = field(default_factory=dict)   # source pattern -> gguf pattern
    drop: list[str] = field(default_factory=list)           # source names deliberately not written
    keep_f32: list[str] = field(default_factory=list)       # gguf names kept F32 whatever --type
    architectures: list[str] = field(default_factory=list)
    need_tensors: list[str] = field(default_factory=list)
    absent_tensors: list[str] = field(default_factory=list)
    config: dict[str, object] = field(default_factory=dict)
    priority: int = 0

    def __post_init__(self) -> None:
        self._compiled: list[tuple[re.Pattern, str, str]] = []

    def compile(self) -> None:
        self._compiled = []
        for src, dst in self.tensors.items():
            if src.count("{L}") > 1 or ("{L}" in src) != ("{L}" in dst):
                raise ConvertError(f"{self.path}: pattern {src!r} -> {dst!r}: {{L}} must appear once "
                                   "on both sides or on neither")
            rx = re.compile("^" + re.escape(src).replace(re.escape("{L}"), r"(\d+)") + "$")
            self._compiled.append((rx, dst, src))

    def map_name(self, name: str) -> list[tuple[str, int | None]]:
        """Every (gguf name, layer) this source name maps to; a leading "model." is ignored."""
        bare = name[len("model."):] if name.startswith("model.") else name
        hits = []
        for rx, dst, _ in self._compiled:
            m = rx.match(bare)
            if m:
                layer = int(m.group(1)) if m.groups() else None
                hits.append((dst.replace("{L}", str(layer)) if layer is not None else dst, layer))
        return hits

    def is_dropped(self, name: str) -> bool:
        bare = name[len("model."):] if name.startswith("model.") else name
        return bare in self.drop

    def matches(self, config: dict, names: set[str]) -> bool:
        """True if config.json and the tensor names look like this family."""
        bare = {n[len("model."):] if n.startswith("model.") else n for n in names}
        archs = config.get("architectures") or []
        known = set(map(str, archs)) if isinstance(archs, list) else set()
        if self.architectures and not known & set(self.architectures):
            return False
        if not set(self.need_tensors) <= bare or set(self.absent_tensors) & bare:
            return False
        return all(config.get(k) == v for k, v in self.config.items())


def _str_list(data: dict, key: str, where: Path) -> list[str]:
    v = data.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConvertError(f"{where}: {key} must be a list of strings")
    return list(v)


def load_mapping(spec: str | Path, _depth: int = 0) -> Mapping:
    """A mapping by family name (a file in mappings/) or by path to a TOML file."""
    path = Path(spec)
    if not path.suffix and not path.exists():
        if not re.fullmatch(r"[A-Za-z0-9_]+", str(spec)):
            raise ConvertError(f"--mapping {spec}: not a family name or a file")
        path = MAPPINGS_DIR / f"{spec}.toml"
        if not path.is_file():
            raise ConvertError(f"--mapping {spec}: unknown family (known: {', '.join(families())})")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ConvertError(f"{path}: no such mapping file") from None
    if size > MAX_MAPPING_BYTES:
        raise ConvertError(f"{path}: {size} bytes is too large for a mapping file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path}: not valid TOML ({e})") from None
    unknown = set(data) - _KNOWN_KEYS
    if unknown:
        raise ConvertError(f"{path}: unknown key(s) {sorted(unknown)}")
    family = data.get("family")
    if not isinstance(family, str) or not family:
        raise ConvertError(f"{path}: needs a 'family' name")
    m = Mapping(family=family, path=path)
    if "extends" in data:
        if _depth >= _MAX_EXTENDS or not isinstance(data["extends"], str):
            raise ConvertError(f"{path}: bad or too deep 'extends'")
        base = load_mapping(data["extends"], _depth + 1)
        m.tensors, m.drop, m.keep_f32 = dict(base.tensors), list(base.drop), list(base.keep_f32)
    m.description = str(data.get("description", ""))
    tensors = data.get("tensors", {})
    if not isinstance(tensors, dict) or not all(isinstance(v, str) for v in tensors.values()):
        raise ConvertError(f"{path}: [tensors] must map source names to GGUF names")
    m.tensors.update(tensors)
    m.drop += _str_list(data, "drop", path)
    m.keep_f32 += _str_list(data, "keep_f32", path)
    det = data.get("detect", {})
    if not isinstance(det, dict) or set(det) - _DETECT_KEYS:
        raise ConvertError(f"{path}: [detect] may only hold {sorted(_DETECT_KEYS)}")
    m.architectures = _str_list(det, "architectures", path)
    m.need_tensors = _str_list(det, "tensors", path)
    m.absent_tensors = _str_list(det, "absent_tensors", path)
    cfg = det.get("config", {})
    if not isinstance(cfg, dict):
        raise ConvertError(f"{path}: detect.config must be a table")
    m.config = dict(cfg)
    prio = det.get("priority", 0)
    if not isinstance(prio, int):
        raise ConvertError(f"{path}: detect.priority must be an integer")
    m.priority = prio
    m.compile()
    return m


def families() -> list[str]:
    return sorted(p.stem for p in MAPPINGS_DIR.glob("*.toml"))


def detect_family(config: dict, names: set[str], source: Path) -> Mapping:
    """The most specific family (highest priority) whose detect rules match; ConvertError if none."""
    found = [m for m in (load_mapping(f) for f in families()) if m.matches(config, names)]
    if not found:
        archs = config.get("architectures")
        raise ConvertError(f"{source}: no draft family matches architectures={archs!r} and these tensors; "
                           f"pass --mapping ({', '.join(families())}) or a mapping file")
    found.sort(key=lambda m: -m.priority)
    return found[0]
