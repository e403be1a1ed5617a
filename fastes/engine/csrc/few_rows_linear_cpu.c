/* A linear layer for a decoding step's rows, with the low-rank population's term:

       y[i, j] = x[i, :] . w[j, :] (+ bias[j]) (+ sum_q products[i, q] outputs[m, q, j])   i < rows, j < n

   x [rows, k], w [n, k] (nn.Linear's layout), y [rows, n]; with a term, row i is member m's for
   offsets[m] <= i < offsets[m + 1], products[i, q] = x[i, :] . inputs[m, q, :] (inputs [members, rank,
   k], outputs [members, rank, n], the scale folded in); row-major, contiguous, fp32.

   At a few rows a decoding step only streams the weights from memory (SmolLM2-135M's 540 MB per step).
   BLAS reads the weight again for each row there: torch's CPU linear took 10, 23 and 34 ms for
   SmolLM2's vocabulary at 1, 2 and 3 rows (docs/results/decoding-linears-2026-12-06.md, where this
   pass took 3.9, 3.1 and 7.3 ms). Here each weight row is read once, for every input row: a few weight
   rows at a time (as many as the registers hold sums for), one 16-float vector of each meets the same
   vector of each input row, whose sums stay in registers over the whole rows. At their end the sums are
   transposed, so that their 16 lanes are added as whole vectors, in lane order (products.h). More rows
   than FEW_ROWS take turns over blocks of the weight small enough to stay in L2: the weight is still
   read from memory once, and at 9-127 rows this beat both torch's linear and the packed linear, whose
   packing of the weight those rows do not pay for (docs/results/few-rows-linear-2026-12-07.md). The term
   is added by the same call, to each block's outputs while they lie in L1: as a call of its own after
   the product, it cost the low-rank population a second call per projection and step. Each output is
   summed in one fixed order (over k, its lanes in order, the last k % 16, the term's ranks), so a row's
   result depends neither on the rows beside it, nor on how many weight rows share its pass, nor on the
   threads.

   Multiply-adds are fused (products.h), so results agree with torch's GEMM to float tolerance, not bit
   for bit. Built into the same library as noise_cpu.c by fastes/engine/cpu_library.py. */

#include "products.h" /* first: its pragma covers the functions below */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FEW_ROWS 8 /* the input rows one pass serves */
/* The weight rows each FEW_ROWS input rows read in turn: 147-393 KiB of SmolLM2's, in a core's L2 */
#define WEIGHT_BLOCK 64
/* How far ahead of its reads a pass asks for the weight, in floats (8 KiB). At 8 rows the hardware's own
   prefetching fell behind: SmolLM2-sized weights streamed at 13-16 GB/s where one row reached 41-44;
   asked for 8 KiB ahead, 32-35 GB/s (4-16 KiB did as well: docs/results/few-rows-linear-2026-12-07.md). */
#define PREFETCH 2048

/* From this many input rows a pass reads SUMS / rows weight rows at a time, so that each load of an
   input row's vector serves several multiply-adds. Below it one weight row at a time streamed faster:
   two to sixteen weight rows read side by side took 10-44% longer at 1-6 rows (the same results file). */
#define PAIRED_ROWS 7

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
                                                                    int64_t k, int64_t n) {
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
            for (int64_t q = p; q < k; q++) total = multiply_add(x[r * k + q], w_j[q], total); /* last k % 16 */
            y[r * n + j + c] = total;
        }
}

/* Weight rows [lo, hi), every input row: one weight row at a time, or from PAIRED_ROWS input rows on as
   many as the sums allow (then the rest one by one). */
static inline __attribute__((always_inline)) void weight_rows_of(const int rows, const float *x,
                                                                 const float *w, const float *bias, float *y,
                                                                 int64_t lo, int64_t hi, int64_t k,
                                                                 int64_t n) {
    const int columns = rows >= PAIRED_ROWS ? SUMS / rows : 1;
    int64_t j = lo;
    for (; j + columns <= hi; j += columns)
        weight_rows_block(rows, columns, x, w, bias, y, j, k, n);
    for (; j < hi; j++) weight_rows_block(rows, 1, x, w, bias, y, j, k, n);
}

/* Weight rows [lo, hi), every input row, with a constant row count in each case */
static void weight_rows(int64_t rows, const float *x, const float *w, const float *bias, float *y,
                        int64_t lo, int64_t hi, int64_t k, int64_t n) {
    switch (rows) {
        case 1: weight_rows_of(1, x, w, bias, y, lo, hi, k, n); break;
        case 2: weight_rows_of(2, x, w, bias, y, lo, hi, k, n); break;
        case 3: weight_rows_of(3, x, w, bias, y, lo, hi, k, n); break;
        case 4: weight_rows_of(4, x, w, bias, y, lo, hi, k, n); break;
        case 5: weight_rows_of(5, x, w, bias, y, lo, hi, k, n); break;
        case 6: weight_rows_of(6, x, w, bias, y, lo, hi, k, n); break;
        case 7: weight_rows_of(7, x, w, bias, y, lo, hi, k, n); break;
        default: weight_rows_of(FEW_ROWS, x, w, bias, y, lo, hi, k, n); break;
    }
}

/* y[r, lo:hi] += sum_q products[r, q] outputs[member_of[r], q, lo:hi] for `rows` rows (term_t), the
   ranks in order: the term, added to a block's outputs while they are in L1, 16 of them at a time (one
   by one, at each output, it cost 11% of the pass at 64 rows) */
static void term_added(const term_t *term, float *y, int64_t rows, int64_t lo, int64_t hi, int64_t n) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t q = 0; q < term->rank; q++) {
            const float product = term->products[r * term->rank + q];
            const float *outputs = term->outputs + (term->member_of[r] * term->rank + q) * n;
            scaled_added(y + r * n + lo, outputs + lo, product, hi - lo);
        }
}

/* The weight rows are split into `threads` equal runs over OpenMP threads (torch's own pool, where the
   library shares torch's OpenMP runtime: cpu_library.py), each run into blocks of WEIGHT_BLOCK weight
   rows, and each block is read by every FEW_ROWS input rows in turn: from memory by the first, from the
   thread's L2 by the others. With a term (outputs not NULL), every row's products come first, the rows
   split over the threads. Returns (writing nothing) -1 if a buffer could not be allocated, -2 for
   offsets that do not split the rows into the members' groups. */
int64_t fastes_few_rows_linear_f32(const float *x, const float *w, const float *bias, float *y,
                                   int64_t rows, int64_t k, int64_t n, const float *inputs,
                                   const float *outputs, const int64_t *offsets, int64_t rank,
                                   int64_t members, int64_t threads) {
    if (outputs && !splits_rows(offsets, members, rows)) return -2;
    float *products = NULL;
    int64_t *member_of = NULL;
    if (outputs && term_buffers(offsets, members, rows, rank, &products, &member_of)) return -1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (outputs) members_products(x, inputs, products, offsets, members, k, rank);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t t = 0; t < threads; t++) {
            const int64_t end = n * (t + 1) / threads;
            for (int64_t lo = n * t / threads; lo < end; lo += WEIGHT_BLOCK) {
                const int64_t hi = lo + WEIGHT_BLOCK < end ? lo + WEIGHT_BLOCK : end;
                for (int64_t first = 0; first < rows; first += FEW_ROWS) {
                    const int64_t count = rows - first < FEW_ROWS ? rows - first : FEW_ROWS;
                    weight_rows(count, x + first * k, w, bias, y + first * n, lo, hi, k, n);
                    if (outputs) {
                        const term_t group = {.products = products + first * rank,
                                              .outputs = outputs,
                                              .member_of = member_of + first,
                                              .rank = rank};
                        term_added(&group, y + first * n, count, lo, hi, n);
                    }
                }
            }
        }
    }
    free(products);
    free(member_of);
    return 0;
}
