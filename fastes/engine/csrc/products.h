/* What the library's products share (member_matmul_cpu.c, few_rows_linear_cpu.c): fused multiply-adds,
   and the 16-float vector they compute in.

   The library is built with -ffp-contract=off for the noise's sake (noise_cpu.c: the normals must be
   the same bits on every CPU); a file that includes this header first opts back in for its own
   functions, so its results agree with torch's GEMM to float tolerance, not bit for bit. */

#ifndef FASTES_PRODUCTS_H
#define FASTES_PRODUCTS_H

#if defined(__clang__)
#pragma clang fp contract(fast)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=fast")
#endif

typedef float vec16 __attribute__((vector_size(64)));

#endif
