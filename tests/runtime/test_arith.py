"""`--arith auto` (the default): llama.cpp's arithmetic where it can run, resolved once at load.

auto -> "ggml" on the CPU with the native extension built, "float" on CUDA (any device of a
layer split) or without the extension; what runs is what the model, the expert store and
`--stats/--json` see (never "auto").
"""

from __future__ import annotations

import pytest

from k3kit.adapters import load_model
from k3kit.errors import K3Error
from k3kit.kernels.qmatmul import native_amx, native_available, native_simd
from k3kit.mini.paths import shipped_gguf
from k3kit.runtime import loader
from k3kit.runtime.loader import LoadOptions, check_arith, resolve_arith


def test_auto_resolves_by_device_and_extension(monkeypatch):
    want = "ggml" if native_available() else "float"
    assert LoadOptions().arith == want
    assert LoadOptions(arith="auto", device="cpu").arith == want
    assert check_arith("auto") == want and resolve_arith("cpu") == want
    for dev in ("cuda", "cuda:1", "cpu,cuda:0", " cuda:0 , cuda:1"):
        assert LoadOptions(device=dev).arith == "float", dev
        assert check_arith("auto", dev) == "float", dev
    for explicit in ("float", "ggml"):       # an explicit choice is kept, on any device
        assert LoadOptions(arith=explicit, device="cuda").arith == explicit
        assert check_arith(explicit, "cuda") == explicit
    monkeypatch.setattr(loader, "native_available", lambda: False)
    assert LoadOptions().arith == "float" and check_arith("auto") == "float"
    with pytest.raises(K3Error, match=r"--arith 'int8': expected one of auto, float, ggml"):
        check_arith("int8")


def test_the_default_load_reports_the_arithmetic_that_ran():
    """`generate --stats/--json` kernel strings name "ggml" / "float", never "auto"."""
    if not native_available():
        pytest.skip("the native extension is not built")
    simd = native_simd()
    amx = " (AMX from 12 rows)" if native_amx() else ""     # Q8_0 and MXFP4 have the AMX path
    with load_model(shipped_gguf(), LoadOptions(expert_cache_mib=16)) as lm:
        k = lm.kernels
        assert k["trunk"]["Q8_0"] == f"native-{simd} ggml{amx}"
        assert k["experts"] == {"MXFP4": f"native-{simd} ggml{amx}"}
        assert not any("auto" in s for part in k.values() for s in part.values())
    with load_model(shipped_gguf(), LoadOptions(expert_cache_mib=16, arith="float")) as lm:
        assert lm.kernels["trunk"]["Q8_0"] == f"native-{simd} float"
        assert lm.kernels["experts"] == {"MXFP4": f"native-{simd} float"}
