/* A linear layer, with the low-rank population's term added as each output is stored:

       y[i, :] = x[i, :] W^T (+ bias) (+ sum_j products[i, j] * outputs[m, j, :])   offsets[m] <= i < offsets[m + 1]

   x [rows, k], W [n, k] (nn.Linear's layout), y [rows, n], products [rows, rank] (row i's products with
   its member's input factors: lowrank_products below), outputs [members, rank, n] (the scale folded in);
   row-major, contiguous, fp32. Without outputs (NULL) it is the plain layer. Members may have different
   numbers of rows.

   Why: the low-rank term added after BLAS's GEMM is one more pass over every projection's output, and
   at a prefill's thousands of rows that output lies in memory, not in the caches: ~3% of a SmolLM2
   generation at 8 members x 8 prompts (docs/results/packed-linear-2026-12-06.md). Here the term is
   added to the sums still in registers. The product itself is the member matmul's register block
   (products.h: ROW_BLOCK rows x 16 * COLUMN_VECTORS columns, summed over k in order) on a panel of W's
   rows copied to [k, columns] once per call into a buffer of the thread's own (at most a few hundred
   KB: it stays in L2 while every row block reads it). At SmolLM2's sizes this ran faster than torch's
   `linear` (the same results file). Each output is summed in one fixed order, so a row's result
   depends neither on the rows beside it nor on the threads.

   Multiply-adds are fused (products.h), so results agree with torch's GEMM to float tolerance, not bit
   for bit. Built into the same library as noise_cpu.c by fastes/engine/cpu_library.py. */

#include "products.h" /* first: its pragma covers the functions below */

#include <stdint.h>
#include <stdlib.h>

#define PANEL (16 * COLUMN_VECTORS) /* the output columns of one panel */

/* The panel of W's rows [c, c + PANEL), as `panel`[p * PANEL + column]. */
static void pack_panel(const float *w, int64_t c, int64_t k, float *panel) {
    for (int64_t column = 0; column < PANEL; column++) {
        const float *w_c = w + (c + column) * k;
        for (int64_t p = 0; p < k; p++) panel[p * PANEL + column] = w_c[p];
    }
}

/* The last n % PANEL columns, one by one: correct and slow (cpu_library.packs sends a model's layers
   here only with whole panels). */
static void last_columns(const float *x, const float *w, const float *bias, float *y, const term_t *term,
                         int64_t c, int64_t k, int64_t n) {
    for (int64_t m = 0; m < term->members; m++)
        for (int64_t i = term->offsets[m]; i < term->offsets[m + 1]; i++)
            for (int64_t j = c; j < n; j++) {
                float sum = bias ? bias[j] : 0.0f;
                for (int64_t p = 0; p < k; p++) sum += x[i * k + p] * w[j * k + p];
                for (int64_t q = 0; term->outputs && q < term->rank; q++)
                    sum += term->products[i * term->rank + q] * term->outputs[(m * term->rank + q) * n + j];
                y[i * n + j] = sum;
            }
}

/* The panels are split over OpenMP threads (torch's own pool, where the library shares torch's OpenMP
   runtime: cpu_library.py), each packing its panels into its own buffer. Returns -1 if a buffer could
   not be allocated (nothing is written then by that thread; the caller raises). */
int64_t fastes_packed_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t rows,
                                 int64_t k, int64_t n, const float *products, const float *outputs,
                                 const int64_t *offsets, int64_t rank, int64_t members, int64_t threads) {
    const int64_t one_group[2] = {0, rows};
    const term_t term = {products, outputs, outputs ? offsets : one_group, rank, outputs ? members : 1};
    const int64_t panels = n / PANEL;
    int64_t failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        float *panel = aligned_alloc(64, (size_t)((k * PANEL * sizeof(float) + 63) / 64 * 64));
        if (!panel) failed = 1;
#pragma omp for schedule(static)
        for (int64_t q = 0; q < panels; q++) {
            if (!panel) continue;
            pack_panel(w, q * PANEL, k, panel);
            const int64_t c = q * PANEL;
            for (int64_t m = 0; m < term.members; m++)
                row_blocks(COLUMN_VECTORS, x, panel, PANEL, bias ? bias + c : NULL, y + c, k, n, &term, m,
                           term.offsets[m], term.offsets[m + 1], c);
        }
        free(panel);
    }
    if (failed) return -1;
    if (panels * PANEL < n) last_columns(x, w, bias, y, &term, panels * PANEL, k, n);
    return 0;
}

/* products[i, j] = x[i, :] . inputs[m, j, :] for offsets[m] <= i < offsets[m + 1]: each row's products
   with its member's input factors [members, rank, k], the term's first half. Rows over threads. */
void fastes_lowrank_products_f32(const float *x, const float *inputs, float *products, const int64_t *offsets,
                                 int64_t k, int64_t rank, int64_t members, int64_t threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    for (int64_t m = 0; m < members; m++) {
#pragma omp for schedule(static) nowait
        for (int64_t i = offsets[m]; i < offsets[m + 1]; i++)
            for (int64_t j = 0; j < rank; j++)
                products[i * rank + j] = dot(x + i * k, inputs + (m * rank + j) * k, k);
    }
}
