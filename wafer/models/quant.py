"""Compute paths: which kernels run the model's matrix products.

`auto` (the CLI's default) picks per device and file: on CUDA `bf16`; on the CPU the path that runs
the file's own weights: `q4` for a GGUF of 4-bit blocks (the default model), `q8` for 5- to 8-bit
blocks, `f32` for float checkpoints (which are not quantised unless asked).
`f32`: dense float32 everywhere (the reference; exact against transformers). CPU and CUDA.
`bf16`: dense bfloat16 (CUDA only: on this CPU bf16 matrices are no faster than float32).
`int8`: each linear layer of the blocks also keeps its weights as int8 with one scale per output channel, and
batches of fewer than `dense_from_rows` rows (decode) run PyTorch's int8-weight kernel with bfloat16
activations, reading a quarter of the bytes; larger batches (prefill) stay on float32, where this
CPU's GEMM is faster. Measured here: about 1.4x the decode speed of f32 for a perplexity cost under
1% (bench/quality.py). fbgemm's dynamic int8 (activations quantised per tensor) was tried first and
rejected: 3.6x the perplexity on the default model.
`q4`: the blocks' linear layers in 4-bit blocks (llama.cpp's Q4_1) and the output head in 6-bit blocks
(HEAD_BITS), run by wafer's own kernels (wafer/kernels/build.py: the best variant of AVX-512, AVX2, NEON or
portable C++ that the CPU runs) at every batch size, prefill included: measured on AVX-512 they beat float32
GEMM from 1 row (3.3 ms vs 20 for all the layers) to 256 (177 ms vs 307). From a Q4_1 GGUF these
are the file's own weights; from any GGUF, block_model.py reads the file's blocks into these formats
directly (4-bit types into 4-bit blocks, wider ones into 8-bit blocks, an output head into 6-bit
blocks: gguf_blocks.py), without a float32 copy of the model. With WAFER_KERNELS=off, or where they
could not be built, it falls back to `int8`, with a warning (kernel_report).
`q8`: every linear layer in 8-bit blocks (Q8_0) on the same kernels: near-lossless, half of q4's speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PATHS = ("auto", "f32", "bf16", "int8", "q8", "q4")
CPU_PATHS = ("f32", "int8", "q8", "q4")
CUDA_PATHS = ("f32", "bf16")
# On q4 an output head that is not in fewer bits already (a float checkpoint's, a file's Q8_0) is read
# each step whole, a third of a small model's bytes (SmolLM2's Q8_0 table: 32 of 98 MB). 6-bit
# records hold it in 0.875 bytes a weight against 1.125: bench/quality.py on pydoc's text gave
# SmolLM2's q4 path a perplexity 1.0061 of f32's with them (8 bits: 1.0035; 5 bits 1.0177 and 4
# bits 1.0639, too far from the 2% allowed).
HEAD_BITS = 6


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, dense_from_rows: int = 32) -> None:
        super().__init__()
        w = linear.weight.detach()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        self.weight = linear.weight  # float32, shared (e.g. with tied embeddings), for large batches
        self.bias = linear.bias
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous())
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.dense_from_rows = dense_from_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.dense_from_rows:
            return F.linear(x, self.weight, self.bias)
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales).float()
        return y if self.bias is None else y + self.bias


class BlockLinear(nn.Module):
    """A linear layer whose decode batches run wafer's block-quantised kernels: `fmt` 4, 6 or 8 (bits),
    or, from a GGUF file's blocks only, K4 or K6 (gguf_blocks.py)."""

    def __init__(self, linear: nn.Linear, bits: int) -> None:
        super().__init__()
        from wafer.models import blockquant as bq
        from wafer.kernels.build import kernels

        self.kernels = kernels()
        self.bias = linear.bias
        self.fmt = bits
        self.out_features = linear.out_features
        self.in_features = linear.in_features
        w = linear.weight.detach()
        self.register_buffer("packed", bq.pack_q8(*bq.quantize_q8(w)) if bits == 8 else bq.pack_blocks(*bq.quantize_codes(w, bits), bits))

    @classmethod
    def from_packed(cls, packed: torch.Tensor, out_features: int, in_features: int, fmt: int,
                    bias: torch.Tensor | None) -> BlockLinear:
        """From records already packed (block_model.build_block_model)."""
        from wafer.kernels.build import kernels

        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.kernels = kernels()
        self.bias = bias
        self.fmt = fmt
        self.out_features = out_features
        self.in_features = in_features
        self.register_buffer("packed", packed)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.block_linear(x.contiguous(), self.packed, self.out_features)
        return y if self.bias is None else y + self.bias


def resolve(path: str, device: str = "cpu", file_weights: str = "f32") -> str:
    """The path that will really run on `device` for a file whose dominant weight type is
    `file_weights` (a GGUF type name such as 'Q4_1', or a float dtype): `auto` chosen, and q4 and
    q8 falling back to int8 where wafer's kernels cannot be built. Raises ValueError."""
    if path not in PATHS:
        raise ValueError(f"unknown compute path {path!r} (choose from {', '.join(PATHS)})")
    kind = "cuda" if device.startswith("cuda") else "cpu"
    if path == "auto":
        if kind == "cuda":
            return "bf16"
        t = file_weights.upper()
        path = "q4" if t.startswith(("Q2", "Q3", "Q4", "IQ")) else "q8" if t.startswith(("Q5", "Q6", "Q8")) else "f32"
    allowed = CUDA_PATHS if kind == "cuda" else CPU_PATHS
    if path not in allowed:
        raise ValueError(f"compute path {path!r} does not run on {kind} (choose from {', '.join(allowed)})")
    if path in ("q4", "q8"):
        from wafer.kernels.build import kernels

        return path if kernels() is not None else "int8"
    return path


def apply_compute_path(model: nn.Module, path: str) -> nn.Module:
    """Convert a float32 CPU model for a path that resolve() returned."""
    if path in ("f32", "bf16"):
        return model
    if path in ("q4", "q8"):
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and child.in_features % 32 == 0:
                    bits = 8 if path == "q8" else HEAD_BITS if name == "lm_head" else 4
                    setattr(module, name, BlockLinear(child, bits))
        from wafer.models.blockquant import onto_huge_pages

        blocks = [m for m in model.modules() if isinstance(m, BlockLinear)]
        for m, packed in zip(blocks, onto_huge_pages([m.packed for m in blocks])):
            m.packed = packed
        return model
    if path != "int8":
        raise ValueError(f"unknown compute path {path!r} (resolve() names the paths that run)")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            # The output head stays float32: the int8 kernel's bfloat16 output would round logits
            # to steps of 1/8 at their usual size, which logprobs and sampling would see.
            if isinstance(child, nn.Linear) and name != "lm_head":
                setattr(module, name, Int8Linear(child))
    return model


def describe(path: str) -> str:
    return {"f32": "float32 (dense, dequantised at load)",
            "bf16": "bfloat16 (dense), decode steps replayed from CUDA graphs",
            "q8": "a file's blocks as they are: Q4_K, Q6_K and 5-bit types in records of their own, the rest in "
                  "8-bit blocks; int8 activations, wafer's kernels",
            "int8": "int8 weights per channel with bfloat16 activations for decode; float32 for prefill",
            "q4": "a file's Q4_K, Q6_K and 5-bit types as they are, 4-bit blocks for its other 4-bit weights "
                  "(Q4_0, Q4_1), 8-bit blocks for wider ones, 6-bit for the head; int8 activations, wafer's kernels"}[path]


def kernel_report(path: str, requested: str = "auto", device: str = "cpu") -> tuple[str, str | None]:
    """(what runs a resolved path's matrix products, a warning or None). The warning says why
    wafer's kernels do not run, or not their best variant, where the path would use them."""
    if device.startswith("cuda"):
        return "PyTorch CUDA", None
    from wafer.kernels import build as kernels

    s = kernels.status()
    cpu = kernels.features_line()
    if path in ("q4", "q8"):
        return f"wafer {s.variant} ({cpu})", s.problem
    wanted_blocks = requested in ("q4", "q8") or (requested == "auto" and path == "int8")
    return f"PyTorch ({cpu})", s.problem if wanted_blocks else None
