"""fp32 -> 16-bit rounding inside kernels: the same result on every backend.

Compiled kernels and torch round fp32 to bf16 to nearest even, but the Triton interpreter (3.9)
truncates in `x.to(tl.bfloat16)`; under the interpreter (the CPU tests) round-to-nearest-even is
therefore spelled out in bits, so that interpreted and compiled kernels both agree with the reference.
"""

import os

import triton
import triton.language as tl

# Compiled kernels convert with one native round-to-nearest-even instruction (F2FP, two elements at a
# time); only the interpreter, which truncates, takes the bit-level path below.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def round_to(value, DTYPE: tl.constexpr):
    """fp32 `value` rounded to nearest (ties to even) in DTYPE."""
    if DTYPE == tl.bfloat16 and INTERPRETED:
        bits = value.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # carry into the kept half when above the midpoint
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(value != value, value.to(tl.bfloat16), rounded)  # NaN stays NaN
    else:
        return value.to(DTYPE)


@triton.jit
def stochastic_round(value, u, DTYPE: tl.constexpr):
    """Same rule as fastes.engine.noise.stochastic_round: the neighbour of the nearest value when
    u*gap < dist."""
    nearest = round_to(value, DTYPE)
    magnitude_bits = nearest.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF
    magnitude = magnitude_bits.to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)
    towards_zero = magnitude > tl.abs(value)
    neighbour_bits = magnitude_bits + tl.where(towards_zero, -1, 1)
    neighbour = neighbour_bits.to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)
    gap = tl.abs(neighbour - magnitude)
    distance = tl.abs(tl.abs(value) - magnitude)
    bits = tl.where(u * gap < distance, neighbour_bits, magnitude_bits)
    bits = tl.where(value < 0, bits | 0x8000, bits)
    rounded = bits.to(tl.int16).to(DTYPE, bitcast=True)
    return tl.where(tl.abs(value) < float("inf"), rounded, nearest)
