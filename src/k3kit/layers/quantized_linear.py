"""Linear and embedding layers whose weights stay as the file stores them: ggml bytes, used in place.

A K3 trunk matrix is Q8_0 in the published files (Q4_K after `k3kit requant`). Dequantizing it
to bf16 doubles (Q8_0) or quadruples (Q4_K) what memory holds and what every decode step reads
(issue 12: 59.6 GB of Q8_0 trunk become ~112 GB of bf16). These layers keep the bytes of the
ggml tensor (a mapped file range or a buffer the loader filled) and compute from them:

* QuantizedLinear: `x @ W.T`. On the CPU through `k3kit.kernels.qmatmul.QuantizedMatrix.matmul`,
  which picks the native kernel for few rows (decode, verify; float32 sums) where the extension
  has the type, else dequantizes W for this call, a chunk of rows at a time, and runs torch's
  GEMM (prefill). On CUDA, for the types k3kit.kernels.gpu has Triton kernels for, those
  kernels work from the bytes (a GEMV for few rows; for prefill W dequantized by a Triton
  kernel in bounded chunks, each multiplied by torch's GEMM). Elsewhere
  (CUDA without triton or for other types), or with `mode="dequant"`, the bytes stay on the
  layer's device and each product dequantizes W there into a scratch of at most `chunk_bytes`
  of output rows, each chunk multiplied as it is made.
  F32/F16/BF16 weights are held as a typed view of their bytes (no copy, no widening):
  multiplied as they are when x has their dtype, else in float32. The output is in x's dtype,
  so `--dtype` sets activations only.
* QuantizedEmbedding: a row gather that dequantizes only the rows asked for (ggml rows are
  whole blocks), so K3's 163840 x 7168 token_embd stays 1.25 GB of Q8_0, not 2.3 GB of bf16.

Row invariance (batched serving relies on it): up to `QuantizedLinear.invariant_rows` rows,
each output row is bitwise the same whatever the other rows of the call are. The native kernel
guarantees it for its types, the Triton GEMV (CUDA) up to its row limit; F32/F16/BF16 weights get
it from one matrix-vector product per row (torch's GEMM is not row-invariant: M=1 and M=8 differ
in the last bits).

Corrupt files: a loader can give a layer a `check` (run once, before the first product: it
scans the scale bytes, which the first product reads anyway) and an embedding a `corrupt_row`
callback (called with the first looked-up row that dequantized to inf/NaN); both are expected
to raise a one-line error that names the file and tensor. This package never opens a file.

Inference only: the weights are not Parameters and get no gradient. `module.to(device)` moves
the bytes (no dtype change: they stay uint8); `use_quantized_weights` swaps the nn.Linear /
nn.Embedding modules of a built model (meta or not) given a module name -> bytes getter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import Tensor, nn

from k3kit.kernels import gpu
from k3kit.kernels import threads as kthreads
from k3kit.kernels.dequant import dequantize, nbytes_for
from k3kit.kernels.qmatmul import QuantizedMatrix, _qmatmul, experts_fusable
from k3kit.kernels.qmatmul import buf as qbuf

T = GGMLQuantizationType

# file types held as a typed view of their bytes instead of being dequantized per call
FLOAT_TYPES: dict[GGMLQuantizationType, torch.dtype] = {
    T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
# Rows up to which F32/F16/BF16 weights multiply one row at a time (torch.mv): row-invariant,
# and reading W once per row costs little for the small matrices a quantized file keeps float.
# Beyond, torch's GEMM (faster, not row-invariant).
DENSE_MAX_ROWS = 16
# The most bytes of dequantized weight a `mode="dequant"` product holds at once: a chunk of W's
# output rows in the compute dtype (bounded scratch on a GPU; 64 MiB is a few % of a 24 GB card).
DEQUANT_CHUNK_BYTES = 64 << 20
# "triton": the Triton kernels on any device they run on (the CPU under TRITON_INTERPRET=1: tests)
MODES = ("auto", "dequant", "triton")
# Looked-up rows up to which an embedding dequantizes row by row natively (a verify block, a few
# decoding sequences); beyond (prefill chunks), one torch dequantization of all of them.
NATIVE_LOOKUP_ROWS = 64


@dataclass(frozen=True)
class GGMLWeight:
    """One ggml tensor as its bytes: what a loader hands these layers."""

    raw: Tensor                     # uint8, contiguous, exactly the tensor's bytes (any device)
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]          # ggml order: (n_in, n_out) for a matrix

    @property
    def nbytes(self) -> int:
        return self.raw.numel()


def _float_view(raw: Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> Tensor | None:
    """[n_out, n_in] view of an F32/F16/BF16 tensor's bytes in its own dtype (no copy), else None."""
    dt = FLOAT_TYPES.get(T(qtype))
    if dt is None:
        return None
    raw = raw if raw.data_ptr() % dt.itemsize == 0 else raw.clone()   # typed views need alignment
    return raw.view(dt).view(shape[1], shape[0])


def _target_device(fn: Callable[[Tensor], Tensor], current: torch.device) -> torch.device:
    """Where `Module._apply(fn)` would send a uint8 tensor now on `current` (fn is `.to(...)`,
    `.cuda()`, `.half()`, ...; only the device is taken from it: the bytes stay uint8)."""
    return fn(torch.empty(0, dtype=torch.uint8, device=current)).device


class QuantizedLinear(nn.Module):
    """`y = x @ W.T (+ bias)` with W kept as its ggml bytes; y in x's dtype.

    `dtype` is the dtype a quantized W is dequantized to when many rows make a GEMM cheaper
    than the native kernel, when the type has no native kernel, or on a GPU: the compute dtype,
    so a prefill pass computes what a float trunk in that dtype would.
    `mode`: "auto" = native kernel / QuantizedMatrix on the CPU, the Triton kernels on CUDA
    (per-product dequantization where they cannot run); "dequant" = per-product dequantization
    into at most `chunk_bytes` of W at a time on any device (selectable on the CPU to test it);
    "triton" = the Triton kernels (on the CPU only under TRITON_INTERPRET=1).
    """

    check: Callable[[], None] | None
    matrix: QuantizedMatrix | None

    def __init__(self, weight: GGMLWeight, dtype: torch.dtype = torch.float32, bias: Tensor | None = None,
                 *, mode: str = "auto", chunk_bytes: int = DEQUANT_CHUNK_BYTES, arith: str = ""):
        super().__init__()
        if len(weight.shape) != 2:
            raise ValueError(f"QuantizedLinear needs a 2-D ggml tensor, got shape {weight.shape}")
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be >= 1")
        self.in_features, self.out_features = int(weight.shape[0]), int(weight.shape[1])
        self.qtype = T(weight.qtype)
        self.dtype = dtype
        self.mode = mode
        self.arith = arith          # QuantizedMatrix's arithmetic ("float" / "ggml"; "" = its default)
        self.chunk_bytes = int(chunk_bytes)
        if weight.raw.dtype != torch.uint8 or not weight.raw.is_contiguous():
            raise ValueError("QuantizedLinear bytes must be a contiguous uint8 tensor")
        need = nbytes_for(self.qtype, self.in_features * self.out_features)
        if weight.raw.numel() != need:
            raise ValueError(f"{self.qtype.name} matrix {weight.shape} needs {need} bytes, "
                             f"got {weight.raw.numel()}")
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.check = None
        self._place(weight.raw.reshape(-1))

    def _place(self, raw: Tensor) -> None:
        """Hold `raw` (on its device) and the views the products use."""
        self.raw = raw
        shape = (self.in_features, self.out_features)
        self.dense = _float_view(raw, self.qtype, shape)
        # the CPU product (native kernel or chunked GEMM) reads the bytes through numpy
        cpu = raw.device.type == "cpu" and self.dense is None and self.mode == "auto"
        self.matrix = QuantizedMatrix(raw, self.qtype, shape, self.dtype, arith=self.arith) if cpu else None
        # the matrix when its products are the native kernel's in ggml arithmetic (forward's short way)
        m = self.matrix
        self._q8 = m if m is not None and m.arith == "ggml" and m.native else None
        self.triton = self.dense is None and _use_triton(self.mode, self.qtype, raw.device)

    def _apply(self, fn, recurse=True):
        """`.to(device)` / `.cuda()` move the bytes too (a dtype argument leaves them uint8)."""
        super()._apply(fn, recurse)
        dev = _target_device(fn, self.raw.device)
        if dev != self.raw.device:
            self._place(self.raw.to(dev))
        return self

    @property
    def nbytes(self) -> int:
        """Bytes held for the weight (the file's bytes; the bias is a Parameter, counted there)."""
        return self.raw.numel()

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features

    @property
    def invariant_rows(self) -> int:
        """Rows per call up to which each output row is bitwise independent of the other rows
        (0: no guarantee beyond one row): QuantizedMatrix's for a quantized W on the CPU (the
        native kernel's row limit; any count in ggml arithmetic), DENSE_MAX_ROWS for F32/F16/BF16,
        the Triton GEMV's row limit, 0 for the per-product dequantization (torch's GEMM)."""
        if self.dense is not None:
            return DENSE_MAX_ROWS
        if self.triton:
            return gpu.GEMV_MAX_ROWS
        if self.matrix is not None:
            return int(self.matrix.invariant_rows)
        return 0

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype.name}, bias={self.bias is not None}, device={self.raw.device.type}")

    def forward(self, x: Tensor) -> Tensor:
        q8 = self._q8
        if q8 is not None and self.check is None and self.bias is None and x.dim() >= 2 \
                and x.shape[-1] == self.in_features and x.device.type == "cpu":
            return q8._matmul_q8(x)   # a decode step's products: what the general way below reaches
        if self.check is not None:
            self.check()          # raises on a corrupt tensor; kept until it has passed once
            self.check = None
        lead = x.shape[:-1]
        m = self.matrix
        if m is not None and m.arith == "ggml" and m.native and x.dim() > 2:   # any leading shape
            y = m.matmul(x)
            return y + self.bias.to(y.dtype) if self.bias is not None else y
        # a 2-D x is used as it is, and a 2-D y returned as it is: no view ops for nothing
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.dense is not None:
            y = self._dense_matmul(x2)
        elif self.matrix is not None:
            y = self.matrix.matmul(x2)
        elif self.triton:
            xd = x2.to(self.raw.device)
            y = gpu.matmul(xd, self.raw, self.qtype, self.in_features, self.out_features, self.dtype)
            y = y.to(x.device, x.dtype)
        else:
            y = self._dequant_matmul(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y if x.dim() == 2 else y.view(*lead, self.out_features)

    def _dense_matmul(self, x: Tensor) -> Tensor:
        w = self.dense
        assert w is not None
        if x.dtype != w.dtype:           # mixed dtypes: float32 (a transient copy unless W is F32)
            return self._rows(x.float(), w.float()).to(x.dtype)
        return self._rows(x, w)

    @staticmethod
    def _rows(x: Tensor, w: Tensor) -> Tensor:
        """x @ w.T: one matrix-vector product per row up to DENSE_MAX_ROWS rows (row-invariant;
        each row copied to its own buffer so its alignment is the same in every call), else GEMM."""
        m = x.shape[0]
        if m > DENSE_MAX_ROWS or torch.is_grad_enabled():
            return F.linear(x, w)
        y = torch.empty(m, w.shape[0], dtype=w.dtype, device=w.device)
        for i in range(m):
            torch.mv(w, x[i].clone(), out=y[i])
        return y

    def _dequant_rows(self, r0: int, r1: int) -> Tensor:
        """Rows r0 .. r1 - 1 of W in the compute dtype, on the bytes' device ([r1 - r0, n_in])."""
        row_bytes = self.raw.numel() // self.out_features
        return dequantize(self.raw[r0 * row_bytes:r1 * row_bytes], self.qtype,
                          (self.in_features, r1 - r0), self.dtype)

    def chunk_rows(self) -> int:
        """Output rows of W dequantized at once by the per-product path (<= chunk_bytes of them)."""
        per_row = self.in_features * self.dtype.itemsize
        return max(1, min(self.out_features, self.chunk_bytes // per_row))

    def _dequant_matmul(self, x: Tensor) -> Tensor:
        """x @ W.T with W dequantized on its device chunk_rows() output rows at a time; each
        output column is the product of the same dequantized row whatever the chunking."""
        n_out = self.out_features
        rows = self.chunk_rows()
        xc = x.to(self.raw.device, self.dtype)
        if rows == n_out:
            return (xc @ self._dequant_rows(0, n_out).t()).to(x.device, x.dtype)
        y = torch.empty(x.shape[0], n_out, dtype=self.dtype, device=self.raw.device)
        for r0 in range(0, n_out, rows):
            r1 = min(n_out, r0 + rows)
            w = self._dequant_rows(r0, r1)
            y[:, r0:r1] = xc @ w.t()
            del w                        # freed before the next chunk is made
        return y.to(x.device, x.dtype)


def fusable_matrices(linears: Sequence[nn.Module]) -> list[QuantizedMatrix] | None:
    """The QuantizedMatrix of each of `linears` where one native call can multiply them all
    (`fused_products`: QuantizedLinear without a bias, one type and shape, native ggml arithmetic),
    else None."""
    mats = []
    for m in linears:
        if not isinstance(m, QuantizedLinear) or m.bias is not None or m.matrix is None:
            return None
        mats.append(m.matrix)
    return mats if experts_fusable(mats) and mats[0].native else None


def fused_products(linears: Sequence[nn.Module], x: Tensor) -> Tensor | None:
    """x [..., n_in] through several QuantizedLinear of one ggml type and shape that share it as
    input, in one native call (qmatmul's experts_q8 with one segment): float32 [len(linears),
    rows, n_out] with y[j] = linears[j](x) (the same bits: each product is matmul_q8 on the same
    rows), or None where the call does not apply (a gradient, a device, a bias, float
    arithmetic, a non-contiguous x, or a layer whose first product has not run its corruption
    check yet). The call quantizes x once instead of once per matrix and forks
    the threads once; a KDA layer's q, k, v and output-gate projections are one call a token."""
    if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    mats = fusable_matrices(linears)
    if mats is None or not x.is_contiguous() or any(getattr(m, "check", None) is not None for m in linears):
        return None
    first = mats[0]
    if x.shape[-1] != first.in_features:
        return None
    rows = x.numel() // first.in_features
    y = torch.empty(len(mats), rows, first.out_features)
    _qmatmul.experts_q8(first._qtype_id, [m._raw_np for m in mats], qbuf(x), qbuf(y), [rows],
                        first.out_features, first.in_features, len(mats), kthreads.native())
    return y


def _use_triton(mode: str, qtype: GGMLQuantizationType, device: torch.device) -> bool:
    """Do products on `device` run the Triton kernels? mode "triton" insists (an error if they
    cannot run); "auto" takes them on CUDA where they can run and says once when they cannot."""
    if mode == "triton":
        if not gpu.supports(qtype) or not gpu.available(device):
            raise ValueError(f"mode 'triton': no Triton kernel for {qtype.name} on {device} "
                             "(needs triton, and CUDA or TRITON_INTERPRET=1)")
        return True
    if mode != "auto" or device.type != "cuda":
        return False
    if gpu.supports(qtype) and gpu.available(device):
        return True
    gpu.notify_fallback(qtype, device)
    return False


class QuantizedEmbedding(nn.Module):
    """Token embedding over a ggml [n_embd, n_vocab] tensor's bytes: only the looked-up rows
    are dequantized (to `dtype`, on the bytes' device), each bitwise as a whole-tensor
    dequantization gives it. On CUDA (`mode` as QuantizedLinear's) the Triton dequantizer
    decodes them, bitwise the CPU one's values for finite scales."""

    corrupt_row: Callable[[int], None] | None

    def __init__(self, weight: GGMLWeight, dtype: torch.dtype = torch.float32, *, mode: str = "auto"):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        self.mode = mode
        if len(weight.shape) != 2:
            raise ValueError(f"QuantizedEmbedding needs a 2-D ggml tensor, got shape {weight.shape}")
        self.embedding_dim, self.num_embeddings = int(weight.shape[0]), int(weight.shape[1])
        self.qtype = T(weight.qtype)
        self.dtype = dtype
        row = nbytes_for(self.qtype, self.embedding_dim)
        if weight.raw.dtype != torch.uint8 or weight.raw.numel() != row * self.num_embeddings:
            raise ValueError(f"{self.qtype.name} embedding {weight.shape} needs "
                             f"{row * self.num_embeddings} uint8 bytes, got {weight.raw.numel()}")
        self.rows = weight.raw.reshape(self.num_embeddings, row)
        self.triton = _use_triton(mode, self.qtype, self.rows.device)
        self.corrupt_row = None
        self._matrix: QuantizedMatrix | None | bool = False     # _native_matrix's, made at first use

    def _apply(self, fn, recurse=True):
        """`.to(device)` moves the bytes too (they stay uint8)."""
        super()._apply(fn, recurse)
        dev = _target_device(fn, self.rows.device)
        if dev != self.rows.device:
            self.rows = self.rows.to(dev)
            self.triton = _use_triton(self.mode, self.qtype, dev)
            self._matrix = False
        return self

    def _native_matrix(self) -> QuantizedMatrix | None:
        """The table as a QuantizedMatrix whose rows the native extension dequantizes (CPU bytes, a
        type it has, float32 / bfloat16): one call per looked-up row and no torch ops, where the
        torch dequantizers run a dozen ops and read a value on the host (the f16 NaN check)."""
        if self._matrix is False:
            m = None
            if self.rows.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16):
                shape = (self.embedding_dim, self.num_embeddings)
                q = QuantizedMatrix(self.rows.reshape(-1), self.qtype, shape, self.dtype)
                m = q if q.native else None
            self._matrix = m
        return self._matrix if isinstance(self._matrix, QuantizedMatrix) else None

    @property
    def nbytes(self) -> int:
        return self.rows.numel()

    @property
    def numel(self) -> int:
        return self.embedding_dim * self.num_embeddings

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}"

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1).to(self.rows.device, torch.long)
        # On the CPU the checks read the ids and rows through numpy: no aten op, and no host read
        # that would be a sync on a device (where the one combined read below runs instead).
        host = flat.numpy() if flat.device.type == "cpu" else None
        if flat.numel():
            lo, hi = ((int(host.min()), int(host.max())) if host is not None
                      else torch.stack(torch.aminmax(flat)).tolist())
            if lo < 0 or hi >= self.num_embeddings:
                raise IndexError(f"token ids must be in [0, {self.num_embeddings})")
        native = self._native_matrix() if host is not None else None
        if native is not None and host is not None and host.size == 1:
            r = int(host[0])
            out = native._dequantize_rows(r, r + 1)
        elif native is not None and host is not None and host.size <= NATIVE_LOOKUP_ROWS:
            out = torch.empty(host.size, self.embedding_dim, dtype=self.dtype)
            for i, r in enumerate(host.tolist()):
                native._dequantize_rows(r, r + 1, out=out[i:i + 1])
        elif self.triton:
            out = gpu.dequantize(self.rows[flat].reshape(-1), self.qtype, (self.embedding_dim, flat.numel()),
                                 self.dtype)
        else:
            out = dequantize(self.rows[flat], self.qtype, (self.embedding_dim, flat.numel()), self.dtype)
        if self.corrupt_row is not None and flat.numel():
            if host is not None and out.dtype == torch.float32:
                bad_np = ~np.isfinite(out.numpy()).all(axis=1)
                if bad_np.any():
                    self.corrupt_row(int(host[int(bad_np.argmax())]))
            else:
                bad = (~torch.isfinite(out)).any(dim=1)
                if bool(bad.any()):
                    self.corrupt_row(int(flat[int(bad.nonzero()[0, 0])]))
        return out.view(*ids.shape, self.embedding_dim).to(ids.device)


def use_quantized_weights(model: nn.Module, weight: Callable[[str], GGMLWeight | None],
                          dtype: torch.dtype = torch.float32, arith: str = "") -> list[str]:
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
            ql = QuantizedLinear(w, dtype, bias, arith=arith)
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
