"""Speculative decoding with a block draft (DFlash / DSpark): model-neutral machinery.

feature_ring  committed tap features, compact storage, window
(the Target and Draft protocols are k3kit.runtime.protocols)
proposal      one draft step + the Markov chain across the block
schedule      confidence / cost-aware verify width
accept        greedy and lossless rejection-sampling acceptance
decoder       SpeculativeDecoder: one draft + verify pass per call, its statistics
loop          speculative_generate and the autoregressive reference
"""

from k3kit.runtime.protocols import Draft, DraftBlock, Target, VerifyOutput
from k3kit.runtime.speculative.accept import accept_greedy, accept_sampled
from k3kit.runtime.speculative.decoder import DecodeStats, SpeculativeDecoder
from k3kit.runtime.speculative.feature_ring import FeatureRing
from k3kit.runtime.speculative.loop import DecodeResult, ar_generate, speculative_generate
from k3kit.runtime.speculative.proposal import Proposal, propose
from k3kit.runtime.speculative.sampling import Sampling, probs
from k3kit.runtime.speculative.schedule import DepthAcceptance, ScheduleConfig, choose_width, parse_budget

__all__ = [
    "DecodeResult", "DecodeStats", "DepthAcceptance", "Draft", "DraftBlock", "FeatureRing", "Proposal",
    "Sampling", "ScheduleConfig", "SpeculativeDecoder", "Target", "VerifyOutput", "accept_greedy",
    "accept_sampled", "ar_generate", "choose_width", "parse_budget", "probs", "propose",
    "speculative_generate",
]
