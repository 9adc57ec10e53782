"""Route-batched MoE: read each routed expert once per batch, run its tokens together.

A batch of T tokens with top-k routing touches up to T*k experts but usually far fewer
distinct ones; for streamed experts the bytes of the distinct set are the cost. So the
assignments are grouped by expert, each unique expert is fetched once from the store, its
tokens go through the expert function as one matrix, and the weighted outputs are scattered
back to their tokens.

Summation order: by default each (token, slot) output lands in its own row of a [T, k, H]
buffer and the k slots are added left to right, starting from zero -- the same order as a
plain per-token loop `out[t] = sum_j w[t,j] * f(x[t], W[ids[t,j]])`. The result is then
bitwise equal to that loop whenever the expert function gives the same rows for a batch as
for single tokens (e.g. elementwise); with matmul-based experts the BLAS blocking of n rows
vs 1 row differs at rounding level, so the agreement is within float tolerance (float32:
rtol 1e-5, atol 1e-6 relative to output scale in our tests). `exact_order=False` uses
index_add_ into [T, H] instead (T*k times less scratch memory; slots are summed in expert-id
order, so it differs from the loop by a few ulp per addition; deterministic on CPU).

The runtime does not know the activation: the adapter passes `expert_fn(x_rows, weights)`,
where weights are the store's tensors for that expert (e.g. gate, up, down).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from k3kit.runtime.experts import ExpertStore

ExpertFn = Callable[[torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor]


def unique_experts(ids: torch.Tensor | Sequence[int]) -> list[int]:
    """Distinct expert ids of a routing tensor, ascending."""
    return torch.unique(torch.as_tensor(ids)).tolist()


def route_batch(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    store: ExpertStore,
    layer: int,
    expert_fn: ExpertFn,
    *,
    exact_order: bool = True,
) -> torch.Tensor:
    """Mixture output [T, H_out] for tokens x [T, H] routed to ids [T, k] with weights [T, k]."""
    if ids.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        shapes = f"ids {tuple(ids.shape)}, weights {tuple(weights.shape)}, x {tuple(x.shape)}"
        raise ValueError(f"route_batch: {shapes} disagree")
    n_tok, k = ids.shape
    flat = ids.reshape(-1).to(torch.int64)
    w_flat = weights.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order within
    uniq, counts = torch.unique_consecutive(flat[order], return_counts=True)
    experts = store.get(layer, uniq.tolist())

    out: torch.Tensor | None = None
    start = 0
    for e, c in zip(uniq.tolist(), counts.tolist(), strict=True):
        a = order[start : start + c]
        start += c
        tok = torch.div(a, k, rounding_mode="floor")
        y = expert_fn(x.index_select(0, tok), experts[e])
        y = y * w_flat.index_select(0, a).to(y.dtype).unsqueeze(1)
        if out is None:
            out = y.new_zeros((n_tok * k if exact_order else n_tok, y.shape[1]))
        if exact_order:
            out.index_copy_(0, a, y)  # every assignment owns one row: no accumulation here
        else:
            out.index_add_(0, tok, y)
    if out is None:  # no tokens
        return x.new_zeros((0, x.shape[1]))
    if not exact_order:
        return out
    slots = out.view(n_tok, k, -1)
    acc = torch.zeros_like(slots[:, 0])
    for j in range(k):
        acc += slots[:, j]
    return acc


def expected_unique(n_tokens: int, top_k: int, n_experts: int) -> float:
    """Expected distinct experts hit by n tokens under uniform top-k routing: E(1-(1-k/E)^n)."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** n_tokens)


def expected_new_bytes(
    store: ExpertStore,
    layer: int,
    ids_or_count: torch.Tensor | Sequence[int] | int,
    *,
    top_k: int | None = None,
) -> float:
    """Storage bytes a batch would fetch for `layer` (experts not in the store's cache).

    Given routing ids this is exact (what `get` would read now). Given a token count it is
    the uniform-routing estimate, scaled by the fraction of the layer's experts not cached,
    which is what a scheduler can use before routing is known.
    """
    if isinstance(ids_or_count, int):
        if top_k is None:
            raise ValueError("a token count needs top_k")
        n = store.n_experts(layer)
        uncached = 1.0 - store.cached_count(layer) / n
        return expected_unique(ids_or_count, top_k, n) * uncached * store.expert_nbytes(layer)
    return float(store.missing_bytes(layer, unique_experts(ids_or_count)))
