"""Linear and embedding layers whose weights stay as the file stores them: ggml bytes, used in place.

A K3 trunk matrix is Q8_0 in the published files (Q4_K after `k3kit requant`). Dequantizing it
to bf16 doubles (Q8_0) or quadruples (Q4_K) what memory holds and what every decode step reads
(issue 12: 59.6 GB of Q8_0 trunk become ~112 GB of bf16). These layers keep the bytes of the
ggml tensor (a mapped file range or a buffer the loader filled) and compute from them:

* QuantizedLinear: `x @ W.T` through `k3kit.kernels.qmatmul.QuantizedMatrix.matmul`, which
  picks the native kernel for few rows (decode, verify; float32 sums) where the extension has
  the type, else dequantizes W for this call and runs torch's GEMM (prefill). F32/F16/BF16
  weights are held as a typed view of their bytes (no copy, no widening): multiplied as they
  are when x has their dtype, else in float32. The output is in x's dtype, so `--dtype` sets
  activations only.
* QuantizedEmbedding: a row gather that dequantizes only the rows asked for (ggml rows are
  whole blocks), so K3's 163840 x 7168 token_embd stays 1.25 GB of Q8_0, not 2.3 GB of bf16.

Inference only: the weights are not Parameters and get no gradient. The bytes are plain
attributes, not buffers: `module.to(...)` leaves them where the loader put them (CPU); the
loaders build these layers for the CPU only. `use_quantized_weights` swaps the nn.Linear /
nn.Embedding modules of a built model (meta or not) given a module name -> bytes getter; this
package never opens a file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import Tensor, nn

from k3kit.kernels.dequant import dequantize, nbytes_for
from k3kit.kernels.qmatmul import QuantizedMatrix

T = GGMLQuantizationType

# file types held as a typed view of their bytes instead of being dequantized per call
FLOAT_TYPES: dict[GGMLQuantizationType, torch.dtype] = {
    T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
_ROW_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GGMLWeight:
    """One ggml tensor as its bytes: what a loader hands these layers."""

    raw: Tensor                     # uint8, contiguous, exactly the tensor's bytes (CPU)
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]          # ggml order: (n_in, n_out) for a matrix

    @property
    def nbytes(self) -> int:
        return self.raw.numel()


def _float_view(w: GGMLWeight) -> Tensor | None:
    """[n_out, n_in] view of an F32/F16/BF16 tensor's bytes in its own dtype (no copy), else None."""
    dt = FLOAT_TYPES.get(T(w.qtype))
    if dt is None:
        return None
    raw = w.raw if w.raw.data_ptr() % dt.itemsize == 0 else w.raw.clone()   # typed views need alignment
    return raw.view(dt).view(w.shape[1], w.shape[0])


class QuantizedLinear(nn.Module):
    """`y = x @ W.T (+ bias)` with W kept as its ggml bytes; y in x's dtype.

    `dtype` is the dtype a quantized W is dequantized to when many rows make a GEMM cheaper
    than the native kernel (or the type has no native kernel): the compute dtype, so a prefill
    pass computes what a float trunk in that dtype would.
    """

    def __init__(self, weight: GGMLWeight, dtype: torch.dtype = torch.float32, bias: Tensor | None = None):
        super().__init__()
        if len(weight.shape) != 2:
            raise ValueError(f"QuantizedLinear needs a 2-D ggml tensor, got shape {weight.shape}")
        self.in_features, self.out_features = int(weight.shape[0]), int(weight.shape[1])
        self.matrix = QuantizedMatrix(weight.raw, T(weight.qtype), (self.in_features, self.out_features),
                                      dtype)
        self.dense = _float_view(weight)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @property
    def qtype(self) -> GGMLQuantizationType:
        return self.matrix.qtype

    @property
    def nbytes(self) -> int:
        """Bytes held for the weight (the file's bytes; the bias is a Parameter, counted there)."""
        return self.matrix.nbytes

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype.name}, bias={self.bias is not None}")

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y = self.matrix.matmul(x2) if self.dense is None else self._dense_matmul(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*lead, self.out_features)

    def _dense_matmul(self, x: Tensor) -> Tensor:
        w = self.dense
        assert w is not None
        if x.dtype == w.dtype:
            if x.shape[0] == 1 and w.dtype in _ROW_DTYPES and not torch.is_grad_enabled():
                return torch.mv(w, x[0]).unsqueeze(0)        # as RowLinear: mv reads W faster
            return F.linear(x, w)
        # mixed dtypes: float32 (widening W is a transient copy unless W is F32 already)
        return F.linear(x.float(), w.float()).to(x.dtype)


class QuantizedEmbedding(nn.Module):
    """Token embedding over a ggml [n_embd, n_vocab] tensor's bytes: only the looked-up rows
    are dequantized (to `dtype`), each bitwise as a whole-tensor dequantization gives it."""

    def __init__(self, weight: GGMLWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        if len(weight.shape) != 2:
            raise ValueError(f"QuantizedEmbedding needs a 2-D ggml tensor, got shape {weight.shape}")
        self.embedding_dim, self.num_embeddings = int(weight.shape[0]), int(weight.shape[1])
        self.qtype = T(weight.qtype)
        self.dtype = dtype
        row = nbytes_for(self.qtype, self.embedding_dim)
        if weight.raw.dtype != torch.uint8 or weight.raw.numel() != row * self.num_embeddings:
            raise ValueError(f"{self.qtype.name} embedding {weight.shape} needs "
                             f"{row * self.num_embeddings} uint8 bytes, got {weight.raw.numel()}")
        self.rows = weight.raw.view(self.num_embeddings, row)

    @property
    def nbytes(self) -> int:
        return self.rows.numel()

    @property
    def numel(self) -> int:
        return self.embedding_dim * self.num_embeddings

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}"

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1).to("cpu", torch.long)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings})")
        out = dequantize(self.rows[flat], self.qtype, (self.embedding_dim, flat.numel()), self.dtype)
        return out.view(*ids.shape, self.embedding_dim).to(ids.device)


def use_quantized_weights(model: nn.Module, weight: Callable[[str], GGMLWeight | None],
                          dtype: torch.dtype = torch.float32) -> list[str]:
    """Replace every nn.Linear / nn.Embedding of `model` for which `weight(module name)` returns
    bytes by a QuantizedLinear / QuantizedEmbedding over them; returns the replaced names.

    Works on a model built on the meta device (nothing is allocated for the replaced weights).
    A Linear's bias, if any, stays a Parameter under the same name (`<name>.bias`): a loader
    fills it like any other parameter. Shapes must match the module's."""
    done: list[str] = []
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, (nn.Linear, nn.Embedding)):
            continue
        w = weight(name)
        if w is None:
            continue
        new: nn.Module
        if isinstance(mod, nn.Linear):
            bias = mod.bias.detach() if mod.bias is not None else None
            ql = QuantizedLinear(w, dtype, bias)
            got, want = (ql.in_features, ql.out_features), (mod.in_features, mod.out_features)
            new = ql
        else:
            if mod.padding_idx is not None or mod.max_norm is not None:
                raise ValueError(f"{name}: an embedding with padding_idx / max_norm cannot be quantized")
            qe = QuantizedEmbedding(w, dtype)
            got, want = (qe.num_embeddings, qe.embedding_dim), (mod.num_embeddings, mod.embedding_dim)
            new = qe
        if got != want:
            raise ValueError(f"{name}: ggml tensor {w.shape} does not fit {type(mod).__name__} {want}")
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)
        done.append(name)
    return done


def quantized_modules(model: nn.Module) -> list[QuantizedLinear | QuantizedEmbedding]:
    return [m for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))]
