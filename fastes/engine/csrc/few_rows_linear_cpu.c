/* A linear layer for the few rows of a late decoding step, with the low-rank population's term:

       y[i, j] = x[i, :] . w[j, :] (+ bias[j]) (+ sum_q products[i, q] outputs[m, q, j])
                                                                     for i < rows <= FEW_ROWS, j < n

   x [rows, k], w [n, k] (nn.Linear's layout), y [rows, n]; with a term, row i is member m's for
   offsets[m] <= i < offsets[m + 1], products[i, q] = x[i, :] . inputs[m, q, :] (inputs [members, rank,
   k], outputs [members, rank, n], the scale folded in); row-major, contiguous, fp32.

   At a few rows a decoding step only streams the weights from memory (SmolLM2-135M's 540 MB per step).
   BLAS reads the weight again for each row there: torch's CPU linear took 10, 23 and 34 ms for
   SmolLM2's vocabulary at 1, 2 and 3 rows (docs/results/decoding-linears-2026-12-06.md, where this
   pass took 3.9, 3.1 and 7.3 ms). Here each weight row is read once, for every input row: a few weight
   rows at a time (as many as the registers hold sums for), one 16-float vector of each meets the same
   vector of each input row, whose sums stay in registers over the whole rows. At their end the sums are
   transposed, so that their 16 lanes are added as whole vectors, in lane order (products.h). The term is
   added in the same pass: as a call of its own after the product, it cost the low-rank population a
   second call per projection and step. Each output is summed in one fixed order (over k, its lanes in
   order, the last k % 16, the term's ranks), so a row's result depends neither on the rows beside it,
   nor on how many weight rows share its pass, nor on the threads.

   Multiply-adds are fused (products.h), so results agree with torch's GEMM to float tolerance, not bit
   for bit. Built into the same library as noise_cpu.c by fastes/engine/cpu_library.py. */

#include "products.h" /* first: its pragma covers the functions below */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FEW_ROWS 8 /* the most rows one pass serves */
/* How far ahead of its reads a pass asks for the weight, in floats (8 KiB). At 8 rows the hardware's own
   prefetching fell behind: SmolLM2's projections streamed at 14-23 GB/s of the ~40 GB/s that one row
   reached; 1-8 KiB ahead brought them to 35-40 GB/s (docs/results/few-rows-prefetch-2026-12-07.md). */
#define PREFETCH 2048

/* The sums a pass holds in registers: `rows` input rows x `columns` weight rows, at most SUMS. 16 of
   AVX-512's 32 registers; with 16 AVX2 registers (a vec16 is two of them) 8 leave room for the operands. */
#if defined(__AVX512F__)
#define SUMS 16
#else
#define SUMS 8
#endif

/* y[:, j ... j + columns) for weight rows j ... j + columns and `rows` input rows (row r is member
   member_of[r]'s); `rows` and `columns` are constants after inlining, so the loops unroll and the sums
   stay in registers. Each 16-float vector of an input row is loaded once for `columns` weight rows. */
static inline __attribute__((always_inline)) void weight_rows_block(const int rows, const int columns,
                                                                    const float *x, const float *w,
                                                                    const float *bias, float *y, int64_t j,
                                                                    int64_t k, int64_t n, const term_t *term,
                                                                    const int64_t *member_of) {
    vec16 sum[16] = {{0}}; /* sum[r * columns + c]: input row r against weight row j + c */
    int64_t p = 0;
    for (; p + 16 <= k; p += 16) {
        vec16 w_p[SUMS];
        _Pragma("GCC unroll 16") for (int c = 0; c < columns; c++)
            memcpy(&w_p[c], w + (j + c) * k + p, sizeof w_p[c]);
        _Pragma("GCC unroll 16") for (int c = 0; c < columns; c++)
            if ((j + c) * k + p + PREFETCH < n * k) __builtin_prefetch(w + (j + c) * k + p + PREFETCH, 0, 0);
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
            vec16 x_rp;
            memcpy(&x_rp, x + r * k + p, sizeof x_rp);
            _Pragma("GCC unroll 16") for (int c = 0; c < columns; c++) sum[r * columns + c] += x_rp * w_p[c];
        }
    }
    vec16 totals = {0}; /* the bias, then each sum's lanes in order */
    _Pragma("GCC unroll 16") for (int i = 0; i < rows * columns; i++) totals[i] = bias ? bias[j + i % columns] : 0.0f;
    lanes_added_in_order_16(sum, &totals);
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
        _Pragma("GCC unroll 16") for (int c = 0; c < columns; c++) {
            const float *w_j = w + (j + c) * k;
            float total = totals[r * columns + c];
            for (int64_t q = p; q < k; q++) total += x[r * k + q] * w_j[q]; /* the last k % 16 */
            for (int64_t q = 0; term->outputs && q < term->rank; q++)
                total += term->products[r * term->rank + q] *
                         term->outputs[(member_of[r] * term->rank + q) * n + j + c];
            y[r * n + j + c] = total;
        }
}

/* Weight rows [lo, hi), every input row: as many weight rows at a time as the sums allow, then one by
   one. */
static inline __attribute__((always_inline)) void weight_rows_of(const int rows, const float *x,
                                                                 const float *w, const float *bias, float *y,
                                                                 int64_t lo, int64_t hi, int64_t k, int64_t n,
                                                                 const term_t *term,
                                                                 const int64_t *member_of) {
    const int columns = SUMS / rows;
    int64_t j = lo;
    for (; j + columns <= hi; j += columns)
        weight_rows_block(rows, columns, x, w, bias, y, j, k, n, term, member_of);
    for (; j < hi; j++) weight_rows_block(rows, 1, x, w, bias, y, j, k, n, term, member_of);
}

/* Weight rows [lo, hi), every input row, with a constant row count in each case */
static void weight_rows(int64_t rows, const float *x, const float *w, const float *bias, float *y,
                        int64_t lo, int64_t hi, int64_t k, int64_t n, const term_t *term,
                        const int64_t *member_of) {
    switch (rows) {
        case 1: weight_rows_of(1, x, w, bias, y, lo, hi, k, n, term, member_of); break;
        case 2: weight_rows_of(2, x, w, bias, y, lo, hi, k, n, term, member_of); break;
        case 3: weight_rows_of(3, x, w, bias, y, lo, hi, k, n, term, member_of); break;
        case 4: weight_rows_of(4, x, w, bias, y, lo, hi, k, n, term, member_of); break;
        case 5: weight_rows_of(5, x, w, bias, y, lo, hi, k, n, term, member_of); break;
        case 6: weight_rows_of(6, x, w, bias, y, lo, hi, k, n, term, member_of); break;
        case 7: weight_rows_of(7, x, w, bias, y, lo, hi, k, n, term, member_of); break;
        default: weight_rows_of(FEW_ROWS, x, w, bias, y, lo, hi, k, n, term, member_of); break;
    }
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
