/* A linear layer for the few rows of a late decoding step, with the low-rank population's term:

       y[i, j] = x[i, :] . w[j, :] (+ bias[j]) (+ sum_q products[i, q] outputs[m, q, j])
                                                                     for i < rows <= FEW_ROWS, j < n

   x [rows, k], w [n, k] (nn.Linear's layout), y [rows, n]; with a term, row i is member m's for
   offsets[m] <= i < offsets[m + 1], products[i, q] = x[i, :] . inputs[m, q, :] (inputs [members, rank,
   k], outputs [members, rank, n], the scale folded in); row-major, contiguous, fp32.

   At a few rows a decoding step only streams the weights from memory (SmolLM2-135M's 540 MB per step).
   BLAS reads the weight again for each row there: torch's CPU linear took 10, 23 and 34 ms for
   SmolLM2's vocabulary at 1, 2 and 3 rows (docs/results/decoding-linears-2026-12-06.md, where this
   pass took 3.9, 3.1 and 7.3 ms). Here each weight row is read once, for every input row: one 16-float
   vector of it meets the same vector of each input row, whose sums stay in registers over the whole
   row, and are added across their 16 lanes at its end. The term is added in the same pass: as a call
   of its own after the product, it cost the low-rank population a second call per projection and step.
   Each output is summed in one fixed order, so a row's result depends neither on the rows beside it
   nor on the threads.

   Multiply-adds are fused (products.h), so results agree with torch's GEMM to float tolerance, not bit
   for bit. Built into the same library as noise_cpu.c by fastes/engine/cpu_library.py. */

#include "products.h" /* first: its pragma covers the functions below */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FEW_ROWS 8 /* the most rows one pass serves: 8 sums in registers, with room for the operands */

/* y[:, j] for one weight row j and `rows` input rows (row r is member member_of[r]'s); `rows` is a
   constant after inlining, so the loop over rows unrolls and its sums stay in registers. */
static inline __attribute__((always_inline)) void weight_row(const int rows, const float *x,
                                                             const float *w_j, float bias_j, float *y,
                                                             int64_t j, int64_t k, int64_t n,
                                                             const term_t *term, const int64_t *member_of) {
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
        for (int64_t q = 0; term->outputs && q < term->rank; q++)
            total += term->products[r * term->rank + q] *
                     term->outputs[(member_of[r] * term->rank + q) * n + j];
        y[r * n + j] = total;
    }
}

/* Weight rows [lo, hi), every input row. */
static void weight_rows(int64_t rows, const float *x, const float *w, const float *bias, float *y,
                        int64_t lo, int64_t hi, int64_t k, int64_t n, const term_t *term,
                        const int64_t *member_of) {
#define WEIGHT_ROW(rows_) weight_row(rows_, x, w_j, bias_j, y, j, k, n, term, member_of)
    for (int64_t j = lo; j < hi; j++) {
        const float *w_j = w + j * k;
        const float bias_j = bias ? bias[j] : 0.0f;
        switch (rows) { /* a constant row count in each case */
            case 1: WEIGHT_ROW(1); break;
            case 2: WEIGHT_ROW(2); break;
            case 3: WEIGHT_ROW(3); break;
            case 4: WEIGHT_ROW(4); break;
            case 5: WEIGHT_ROW(5); break;
            case 6: WEIGHT_ROW(6); break;
            case 7: WEIGHT_ROW(7); break;
            default: WEIGHT_ROW(FEW_ROWS); break;
        }
    }
#undef WEIGHT_ROW
}

/* The weight rows are split into `threads` equal runs over OpenMP threads: torch's own pool, where the
   library shares torch's OpenMP runtime (cpu_library.py). With a term (outputs not NULL), the rows'
   products come first, on the calling thread (at most FEW_ROWS x rank dot products). Returns (writing
   nothing) -1 if the products' buffer could not be allocated, -2 for offsets that do not split the rows
   into the members' groups, -3 for more than FEW_ROWS rows. */
int64_t fastes_few_rows_linear_f32(const float *x, const float *w, const float *bias, float *y,
                                   int64_t rows, int64_t k, int64_t n, const float *inputs,
                                   const float *outputs, const int64_t *offsets, int64_t rank,
                                   int64_t members, int64_t threads) {
    if (rows < 1 || rows > FEW_ROWS) return -3;
    if (outputs && !splits_rows(offsets, members, rows)) return -2;
    int64_t member_of[FEW_ROWS] = {0};
    float *products = outputs ? malloc((size_t)(rows * rank) * sizeof(float)) : NULL;
    if (outputs && !products) return -1;
    for (int64_t m = 0; outputs && m < members; m++) {
        for (int64_t i = offsets[m]; i < offsets[m + 1]; i++) member_of[i] = m;
        products_of(x, inputs, products, m, offsets[m], offsets[m + 1], k, rank);
    }
    const term_t term = {
        .products = products, .outputs = outputs, .offsets = offsets, .rank = rank, .members = members};
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < threads; t++)
        weight_rows(rows, x, w, bias, y, n * t / threads, n * (t + 1) / threads, k, n, &term, member_of);
    free(products);
    return 0;
}
