"""llama.cpp's weight repacking as the benchmarks choose it (k3kit.bench.llama_cpp.repack_choice).

On a CPU with AMX-INT8, llama.cpp 0.3.36 aborts on kimi-k3 files with repacking on, so the
benchmarks whose default is llama.cpp's (repacking on) turn it off there, and say so; an explicit
choice is kept. The CPU is given as /proc/cpuinfo text, so both kinds of machine are tested on any.
test_a_model_loads_through_the_amx_choice loads a real file through llama.cpp with the choice made
for this machine (skipped without llama-cpp-python).
"""

from __future__ import annotations

from typing import Any

import pytest
from benchmark_scripts import load

from k3kit.bench.llama_cpp import (
    AMX_REPACK_NOTE,
    cpu_has_amx_int8,
    model_params,
    repack_choice,
    server_repack_args,
)

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme avx512f avx512_vnni avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8
"""
ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu vme avx512f avx512_vnni avx512_bf16 avx512_vbmi
"""
# a flag that only contains the name is not the flag
AMX_TILE_ONLY = "flags\t\t: fpu amx_tile amx_bf16 xamx_int8x\n"


def test_amx_int8_is_read_from_the_flags_line():
    assert cpu_has_amx_int8(SAPPHIRE_RAPIDS)
    assert not cpu_has_amx_int8(ZEN4)
    assert not cpu_has_amx_int8(AMX_TILE_ONLY)
    assert not cpu_has_amx_int8("")
    # the model name line mentioning it does not count
    assert not cpu_has_amx_int8("model name\t: amx_int8 box\nflags\t\t: fpu\n")


def test_default_is_off_on_amx_and_on_elsewhere_and_says_why():
    assert repack_choice(None, SAPPHIRE_RAPIDS) == (False, AMX_REPACK_NOTE)
    assert "AMX" in AMX_REPACK_NOTE and "off" in AMX_REPACK_NOTE
    on, note = repack_choice(None, ZEN4)
    assert on and "on" in note and "AMX" not in note


@pytest.mark.parametrize("cpu", [SAPPHIRE_RAPIDS, ZEN4])
def test_an_explicit_choice_is_kept_on_any_cpu(cpu):
    assert repack_choice(True, cpu) == (True, "llama.cpp repack on (asked for)")
    assert repack_choice(False, cpu) == (False, "llama.cpp repack off (asked for)")


def test_server_words():
    assert server_repack_args(False) == ["--no-repack"]
    assert server_repack_args(True) == []


class _Params:
    use_extra_bufts = True


class _FakeLlamaCpp:
    """The attribute path model_params patches: llama_cpp.llama_cpp.llama_model_default_params."""

    def __init__(self) -> None:
        self.llama_cpp: Any = type("Low", (), {})()
        self.llama_cpp.llama_model_default_params = _Params


@pytest.mark.parametrize("repack", [False, True])
def test_model_params_sets_the_choice_for_the_block_only(repack):
    fake = _FakeLlamaCpp()
    with model_params(fake, repack):
        assert fake.llama_cpp.llama_model_default_params().use_extra_bufts is repack
    assert fake.llama_cpp.llama_model_default_params is _Params
    with pytest.raises(RuntimeError), model_params(fake, repack):
        raise RuntimeError
    assert fake.llama_cpp.llama_model_default_params is _Params


def test_bench_slice_flags():
    """No flag leaves the choice to repack_choice (None); either flag is an explicit choice."""
    parser = load("bench_slice").parser()
    for argv, asked in [([], None), (["--llama-no-repack"], False), (["--llama-repack"], True)]:
        assert parser.parse_args(argv).llama_repack is asked
    with pytest.raises(SystemExit):
        parser.parse_args(["--llama-repack", "--llama-no-repack"])


def test_bench_out_of_core_leaves_the_repacking_variant_out_on_amx(monkeypatch):
    ooc = load("bench_out_of_core")
    monkeypatch.setattr(ooc, "repack_choice", lambda asked: repack_choice(asked, SAPPHIRE_RAPIDS))
    assert ooc.llama_variants_for(None) == (["norepack"], AMX_REPACK_NOTE)
    monkeypatch.setattr(ooc, "repack_choice", lambda asked: repack_choice(asked, ZEN4))
    assert ooc.llama_variants_for(None)[0] == ["default", "norepack"]
    variants, note = ooc.llama_variants_for("default")      # asked for: run as asked
    assert variants == ["default"] and "asked" in note
    assert ooc.llama_variants_for("")[0] == []


def test_a_model_loads_through_the_amx_choice(tmp_path):
    """The choice made for this machine loads a kimi-k3 file in llama.cpp and evaluates a token
    (on an AMX-INT8 CPU, repacking on would abort the process here)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from k3kit.mini.paths import shipped_gguf
    path = shipped_gguf()
    repack, _ = repack_choice(None)
    with model_params(llama_cpp, repack):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=32, n_threads=1, verbose=False)
    try:
        llm.eval([1, 2, 3])
        assert llm.n_tokens == 3
    finally:
        llm.close()


def test_bench_slice_both_peers():
    """--llama-both runs repacking on, then off, whatever the CPU; it excludes the single choices."""
    bench = load("bench_slice")
    args = bench.parser().parse_args(["--llama-both"])
    peers, note = bench.llama_peers(args.llama_repack, args.llama_both)
    assert peers == [("llama.cpp repack on", True), ("llama.cpp repack off", False)]
    assert "on and off" in note
    peers, _ = bench.llama_peers(False, False)
    assert peers == [("llama.cpp", False)]
    with pytest.raises(SystemExit):
        bench.parser().parse_args(["--llama-both", "--llama-repack"])


def test_bench_slice_library_note():
    bench = load("bench_slice")
    assert bench.library_note({}) == ""
    assert bench.library_note({"LLAMA_CPP_LIB_PATH": "/tmp/x/bin"}).endswith("LLAMA_CPP_LIB_PATH=/tmp/x/bin")


def _run(prefill: float, decode: float, tokens: list[int], rss: float = 100.0) -> dict:
    return {"prefill": prefill, "decode": decode, "tokens": tokens, "rss_mib": rss}


def test_bench_slice_rows_give_a_ratio_to_each_peer():
    bench = load("bench_slice")
    res = {"llama.cpp repack on": [_run(20, 4, [1, 2]), _run(20, 6, [1, 2])],
           "llama.cpp repack off": [_run(10, 2, [1, 3]), _run(10, 2, [1, 3])],
           "k3kit ggml f32 4096 MiB": [_run(40, 5, [1, 2]), _run(40, 5, [9, 9], rss=300)]}
    rows = bench.table_rows("q4k", "2", res, ["llama.cpp repack on", "llama.cpp repack off"])
    assert rows[0] == "| q4k | 2 | llama.cpp repack on | 20.00 (20.00-20.00) | 5.00 (4.00-6.00) | " \
                      "1.00 / 2.00 | 1.00 / 2.50 | 100 |  |"
    assert rows[1].endswith("| 0.50 / 1.00 | 0.40 / 1.00 | 100 | 0/2 |")
    assert rows[2].endswith("| 2.00 / 4.00 | 1.00 / 2.50 | 300 | 1/2 |")
    single = bench.table_rows("iq", "1", {"llama.cpp": res["llama.cpp repack on"],
                                          "k3": res["k3kit ggml f32 4096 MiB"]}, ["llama.cpp"])
    assert single[1].endswith("| 2.00 | 1.00 | 300 | 1/2 |")
