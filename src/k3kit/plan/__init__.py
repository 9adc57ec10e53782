"""`k3kit plan`: what fits where on a given machine, and how fast it can possibly decode, from headers alone.

The seed's owners counted bytes per quant type by hand to learn that K3's trunk is Q8_0
(59.6 GB: too big for 2x24 GB) and that a Q4_K trunk (34.2 GB) fits with room for the DSpark
drafter. This package turns that into a plan for any box: facts (bytes per layer, expert sizes,
KV/state geometry; the same bytes `inspect` prints), hardware (flags, presets, TOML, or measured),
placement (llama.cpp's layer split, the drafter's GPU, experts in VRAM / page cache / storage),
speed (bandwidth-bound decode tok/s, AR and speculative, term by term), requant fixes (from the
requant planner itself) and the command lines that realize it. No torch: plan reads headers only.
"""

from k3kit.plan.hardware import PRESETS, Hardware
from k3kit.plan.planner import PlanOptions, make_plan

__all__ = ["PRESETS", "Hardware", "PlanOptions", "make_plan"]
