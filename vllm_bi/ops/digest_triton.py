"""The weight digest's value sums as one Triton kernel: the CUDA path of :func:`vllm_bi.weights.weight_digest` under
``VLLM_BI_DIGEST=triton``.

Each program reads ``BLOCK`` values of a flat contiguous bf16, fp16 or fp32 tensor, widens them to float64 (exact),
takes each float64's bit pattern as an unsigned 64-bit word and, for each of the digest's two salts, mixes
``word ^ salt`` with splitmix64's finaliser (logical shifts, multiplies wrapping modulo 2^64) and adds its block's
mixed words into one partial sum. The partials are added on the device (int64 addition wraps modulo 2^64 as uint64
addition does, in the same bits), so a tensor costs one pass over its values and one read back to the host.

The result is exactly :mod:`vllm_bi.weights`' torch path's pair of sums, whatever the block size, the grid or the
order of the additions: every step is integer arithmetic modulo 2^64, and the widening of these dtypes to float64
is exact. A bf16 is widened from its bits (shifted into the upper half of an fp32 word, then widened from fp32),
which leaves no subnormal to a conversion routine (Triton's CPU interpreter rounds bf16 subnormals in its bf16 cast).
One exception: a NaN's payload may reach float64 with other bits here than through torch's widening
(each implementation keeps or canonicalises it in its own way), so a NaN weight may digest differently across the
two paths; a NaN weight is a failed load either way.

The salts and the finaliser's multipliers are arguments (the digest's own live in :mod:`vllm_bi.weights`), passed
to the kernel as compile-time constants.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "BLOCK", "mixed_sums"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the dtypes the kernel reads; others take the torch path
BLOCK = 4096  # values per program
WARPS = 8

_KERNEL = None


def _unsigned(v: int) -> int:
    return v & ((1 << 64) - 1)


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def digest_sums_kernel(x_ptr, out_ptr, n, SALT_A: tl.constexpr, SALT_B: tl.constexpr, MUL_A: tl.constexpr,
                               MUL_B: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK: tl.constexpr):
            pid = tl.program_id(0).to(tl.int64)
            offs = pid * BLOCK + tl.arange(0, BLOCK)
            live = offs < n
            if BF16_BITS:  # bf16 values read as int16 words: a bf16 is the upper half of the fp32 of its value
                raw = tl.load(x_ptr + offs, mask=live, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
                v = (raw << 16).to(tl.float32, bitcast=True).to(tl.float64)
            else:
                v = tl.load(x_ptr + offs, mask=live, other=0.0).to(tl.float64)
            word = v.to(tl.uint64, bitcast=True)
            # row k of x: the block's words under salt k; splitmix64's finaliser on uint64 words (logical shifts,
            # multiplies wrapping modulo 2^64)
            k = tl.arange(0, 2)[:, None]
            salt = tl.where(k == 0, tl.full([2, 1], SALT_A, tl.uint64), tl.full([2, 1], SALT_B, tl.uint64))
            x = word[None, :] ^ salt
            x = x ^ (x >> 30)
            x = x * MUL_A
            x = x ^ (x >> 27)
            x = x * MUL_B
            x = x ^ (x >> 31)
            x = tl.where(live[None, :], x, tl.zeros([2, BLOCK], tl.uint64))  # a masked lane adds nothing
            sums = tl.sum(x, axis=1)
            tl.store(out_ptr + 2 * pid + tl.arange(0, 2), sums.to(tl.int64, bitcast=True))

        _KERNEL = digest_sums_kernel
    return _KERNEL


def mixed_sums(t: torch.Tensor, salts: tuple[int, int], multipliers: tuple[int, int], block: int = BLOCK
               ) -> torch.Tensor:
    """For each of the two ``salts``, the sum modulo 2^64 over ``t``'s values of splitmix64's finaliser (with
    ``multipliers``) of ``word ^ salt``, ``word`` a value's float64 bit pattern: an int64 tensor of two words (two's
    complement) on ``t``'s device. ``t``: bf16, fp16 or fp32, any shape and strides (a non-contiguous tensor is
    copied flat first). ``block``: values per program (a power of two; the sums do not depend on it)."""
    if t.dtype not in DTYPES:
        raise NotImplementedError(f"vllm_bi digest kernel: dtype {t.dtype} (bf16, fp16 or fp32)")
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    if n == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    programs = -(-n // block)
    partials = torch.empty(programs, 2, dtype=torch.int64, device=t.device)
    (sa, sb), (ma, mb) = (_unsigned(v) for v in salts), (_unsigned(v) for v in multipliers)
    bf16 = flat.dtype == torch.bfloat16
    _kernel()[(programs,)](flat.view(torch.int16) if bf16 else flat, partials, n, SALT_A=sa, SALT_B=sb, MUL_A=ma,
                           MUL_B=mb, BF16_BITS=bf16, BLOCK=block, num_warps=WARPS)
    return partials.sum(0)
