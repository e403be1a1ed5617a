/* A linear layer for the few rows of a late decoding step:

       y[i, j] = x[i, :] . w[j, :] (+ bias[j])        for i < rows <= FEW_ROWS, j < n

   x [rows, k], w [n, k] (nn.Linear's layout), y [rows, n]; row-major, contiguous, fp32.

   At a few rows a decoding step only streams the weights from memory (SmolLM2-135M's 540 MB per step).
   BLAS reads the weight again for each row there: torch's CPU linear took 10, 23 and 34 ms for
   SmolLM2's vocabulary at 1, 2 and 3 rows (docs/results/decoding-linears-2026-12-06.md, where this
   pass took 3.9, 3.1 and 7.3 ms). Here each weight row is read once, for every input row: one 16-float
   vector of it meets the same vector of each input row, whose sums stay in registers over the whole
   row, and are added across their 16 lanes at its end. Each output is summed in one fixed order, so a
   row's result depends neither on the rows beside it nor on the threads.

   Multiply-adds are fused (products.h), so results agree with torch's GEMM to float tolerance, not bit
   for bit. Built into the same library as noise_cpu.c by fastes/engine/cpu_library.py. */

#include "products.h" /* first: its pragma covers the functions below */

#include <stdint.h>
#include <string.h>

#define FEW_ROWS 8 /* the most rows one pass serves: 8 sums in registers, with room for the operands */

/* y[:, j] for one weight row j and `rows` input rows; `rows` is a constant after inlining, so the loop
   over rows unrolls and its sums stay in registers. */
static inline __attribute__((always_inline)) void weight_row(const int rows, const float *x,
                                                             const float *w_j, float bias_j, float *y,
                                                             int64_t j, int64_t k, int64_t n) {
    vec16 sum[FEW_ROWS];
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) sum[r] = (vec16){0};
    int64_t p = 0;
    for (; p + 16 <= k; p += 16) {
        vec16 w_p, x_rp;
        memcpy(&w_p, w_j + p, sizeof w_p);
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
            memcpy(&x_rp, x + r * k + p, sizeof x_rp);
            sum[r] += x_rp * w_p;
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
        float total = bias_j;
        for (int lane = 0; lane < 16; lane++) total += sum[r][lane];
        for (int64_t q = p; q < k; q++) total += x[r * k + q] * w_j[q]; /* the last k % 16 */
        y[r * n + j] = total;
    }
}

/* Weight rows [lo, hi), every input row. */
static void weight_rows(int64_t rows, const float *x, const float *w, const float *bias, float *y,
                        int64_t lo, int64_t hi, int64_t k, int64_t n) {
    for (int64_t j = lo; j < hi; j++) {
        const float *w_j = w + j * k;
        const float bias_j = bias ? bias[j] : 0.0f;
        switch (rows) { /* a constant row count in each case */
            case 1: weight_row(1, x, w_j, bias_j, y, j, k, n); break;
            case 2: weight_row(2, x, w_j, bias_j, y, j, k, n); break;
            case 3: weight_row(3, x, w_j, bias_j, y, j, k, n); break;
            case 4: weight_row(4, x, w_j, bias_j, y, j, k, n); break;
            case 5: weight_row(5, x, w_j, bias_j, y, j, k, n); break;
            case 6: weight_row(6, x, w_j, bias_j, y, j, k, n); break;
            case 7: weight_row(7, x, w_j, bias_j, y, j, k, n); break;
            default: weight_row(FEW_ROWS, x, w_j, bias_j, y, j, k, n); break;
        }
    }
}

/* The weight rows are split into `threads` equal runs over OpenMP threads: torch's own pool, where the
   library shares torch's OpenMP runtime (cpu_library.py). Returns -1 (and writes nothing) for more than
   FEW_ROWS rows. */
int64_t fastes_few_rows_linear_f32(const float *x, const float *w, const float *bias, float *y,
                                   int64_t rows, int64_t k, int64_t n, int64_t threads) {
    if (rows < 1 || rows > FEW_ROWS) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < threads; t++)
        weight_rows(rows, x, w, bias, y, n * t / threads, n * (t + 1) / threads, k, n);
    return 0;
}
