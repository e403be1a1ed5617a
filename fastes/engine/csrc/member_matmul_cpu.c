/* The materialised population's matmul: for every member m,

       y[i] = x[i] @ w[m] (+ bias)        for the rows offsets[m] <= i < offsets[m + 1]

   x [rows, k], w [members, k, n], y [rows, n], all row-major and contiguous, fp32. Members may have
   different numbers of rows (none, once all of a member's rows have finished decoding).

   torch's batched matmul hands each member's small GEMM to BLAS, which packs the member's weight panel
   before using it for only a few rows (32 a member while the tiny model decodes), so the population's
   matmuls ran behind the plain model's one GEMM over all rows (docs/results/member-matmul-2026-12-06.md).
   Here the weights are read where they lie: a panel of 16 * COLUMN_VECTORS columns of w[m] (a few KB,
   in L1) serves every block of ROW_BLOCK rows, whose sums stay in registers across the whole k loop
   (products.h's `row_blocks`, shared with packed_linear_cpu.c). Each output is summed over k in order,
   so a row's result depends neither on the rows beside it nor on the threads.

   Multiply-adds are fused (products.h), so results agree with torch's GEMM to float tolerance, not bit
   for bit. Built into the same library as noise_cpu.c by fastes/engine/cpu_library.py. */

#include "products.h" /* first: its pragma covers the functions below */

#include <stddef.h>
#include <stdint.h>

/* Columns [c, end) of member m's rows: 16 * COLUMN_VECTORS-wide panels, then 16-wide ones, then the last
   columns, fewer than a vector's 16, one by one. */
static void columns(const float *x, const float *w, const float *bias, float *y, const int64_t *offsets,
                    int64_t m, int64_t c, int64_t end, int64_t k, int64_t n) {
    const int64_t rows = offsets[m + 1] - offsets[m];
    const float *x_m = x + offsets[m] * k, *w_m = w + m * k * n;
    float *y_m = y + offsets[m] * n;
    for (; c + 16 * COLUMN_VECTORS <= end; c += 16 * COLUMN_VECTORS)
        row_blocks(COLUMN_VECTORS, x_m, w_m + c, n, bias ? bias + c : NULL, y_m + c, k, n, NULL, 0, 0, rows,
                   c);
#if COLUMN_VECTORS > 1
    for (; c + 16 <= end; c += 16)
        row_blocks(1, x_m, w_m + c, n, bias ? bias + c : NULL, y_m + c, k, n, NULL, 0, 0, rows, c);
#endif
    for (; c < end; c++)
        for (int64_t r = 0; r < rows; r++) {
            float sum = bias ? bias[c] : 0.0f;
            for (int64_t p = 0; p < k; p++) sum += x_m[r * k + p] * w_m[p * n + c];
            y_m[r * n + c] = sum;
        }
}

/* The work is split into (member, panel of columns) pieces over `threads` OpenMP threads: torch's own
   pool, where the library shares torch's OpenMP runtime (cpu_library.py). */
void fastes_member_matmul_f32(const float *x, const float *w, const float *bias, float *y,
                              const int64_t *offsets, int64_t k, int64_t n, int64_t members,
                              int64_t threads) {
    const int64_t width = 16 * COLUMN_VECTORS, panels = (n + width - 1) / width;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t piece = 0; piece < members * panels; piece++) {
        const int64_t m = piece / panels, c = (piece % panels) * width;
        columns(x, w, bias, y, offsets, m, c, c + width < n ? c + width : n, k, n);
    }
}
