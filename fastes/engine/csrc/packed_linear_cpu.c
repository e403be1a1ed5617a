/* A linear layer, with the low-rank population's term added as each output is stored:

       y[i, :] = x[i, :] W^T (+ bias) (+ sum_j products[i, j] * outputs[m, j, :])   offsets[m] <= i < offsets[m + 1]

   x [rows, k], W [n, k] (nn.Linear's layout), y [rows, n], products[i, j] = x[i, :] . inputs[m, j, :]
   (row i's products with its member's input factors [members, rank, k]), outputs [members, rank, n]
   (the scale folded in); row-major, contiguous, fp32. Without outputs (NULL) it is the plain layer.
   Members may have different numbers of rows. At the end, fastes_lowrank_term_f32: the term alone,
   added to a product computed elsewhere.

   Why: the low-rank term added after BLAS's GEMM is one more pass over every projection's output, and
   at a prefill's thousands of rows that output lies in memory, not in the caches: ~3% of a SmolLM2
   generation at 8 members x 8 prompts (docs/results/packed-linear-2026-12-06.md). Here the term is
   added to the sums still in registers. The product itself is the member matmul's register block
   (products.h: ROW_BLOCK rows x 16 * COLUMN_VECTORS columns, summed over k in order) on a panel of W's
   rows copied to [k, columns] once per call into a buffer of the thread's own (at most a few hundred
   KB: it stays in L2 while every row block reads it). At SmolLM2's sizes this ran faster than torch's
   `linear` (the same results file). The row blocks run over all rows, across the members' boundaries,
   each row adding its own member's term (term_t's member_of): blocks cut at every member's end left a
   part-filled block per member, which at 16 members x 16 rows cost 10-18% of the product, 0-5% since
   (docs/results/row-blocks-across-members-2026-12-07.md). Each output is summed in one fixed order, so
   a row's result depends neither on the rows beside it nor on the threads.

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
   runtime: cpu_library.py), each packing its panels into its own buffer. With a term, every row's
   products come first, the rows split over the threads, into one array all threads then read. (Each
   thread summing them itself on its first panel, the rows of x then in its caches when its row blocks
   read them, was no faster: docs/results/lowrank-decoding-2026-12-06.md, sections 4 and 5.)
   Returns -1 if a buffer could not be allocated (nothing is written then by that thread; the caller
   raises), -2 (and writes nothing) for offsets that do not split the rows into the members' groups. */
int64_t fastes_packed_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t rows,
                                 int64_t k, int64_t n, const float *inputs, const float *outputs,
                                 const int64_t *offsets, int64_t rank, int64_t members, int64_t threads) {
    if (outputs && !splits_rows(offsets, members, rows)) return -2;
    float *products = NULL;
    int64_t *member_of = NULL;
    if (outputs && term_buffers(offsets, members, rows, rank, &products, &member_of)) return -1;
    const int64_t one_group[2] = {0, rows};
    const term_t term = {.products = products,
                         .outputs = outputs,
                         .offsets = outputs ? offsets : one_group,
                         .member_of = member_of,
                         .rank = rank,
                         .members = outputs ? members : 1};
    const int64_t panels = n / PANEL;
    int64_t failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        if (outputs) members_products(x, inputs, products, offsets, members, k, rank);
#pragma omp barrier
        float *panel = aligned_alloc(64, (size_t)((k * PANEL * sizeof(float) + 63) / 64 * 64));
        if (!panel) failed = 1;
#pragma omp for schedule(static)
        for (int64_t q = 0; q < panels; q++) {
            if (!panel) continue;
            const int64_t c = q * PANEL;
            pack_panel(w, c, k, panel);
            row_blocks(COLUMN_VECTORS, x, panel, PANEL, bias ? bias + c : NULL, y + c, k, n, &term, 0, rows,
                       c);
        }
        free(panel);
    }
    if (!failed && panels * PANEL < n) last_columns(x, w, bias, y, &term, panels * PANEL, k, n);
    free(products);
    free(member_of);
    return failed ? -1 : 0;
}

/* y[i, :] += sum_j (x[i, :] . inputs[m, j, :]) outputs[m, j, :] for offsets[m] <= i < offsets[m + 1], in
   place: the whole term after a base product computed elsewhere (torch's `linear` between the few-rows
   pass and the packed linear, or a base the library does not compute). One pass per row, its products
   over x's row then its updates of y's row, where torch takes a batched matmul and a multiply-add per
   rank (and equal row groups only). Rows over threads. Returns -2 (and writes nothing) for offsets
   that do not split the rows. */
int64_t fastes_lowrank_term_f32(const float *x, const float *inputs, const float *outputs, float *y,
                                const int64_t *offsets, int64_t rows, int64_t k, int64_t n, int64_t rank,
                                int64_t members, int64_t threads) {
    if (!splits_rows(offsets, members, rows)) return -2;
#pragma omp parallel num_threads(threads) if (threads > 1)
    for (int64_t m = 0; m < members; m++) {
        const float *in_m = inputs + m * rank * k, *out_m = outputs + m * rank * n;
#pragma omp for schedule(static) nowait
        for (int64_t i = offsets[m]; i < offsets[m + 1]; i++)
            for (int64_t j = 0; j < rank; j++)
                scaled_added(y + i * n, out_m + j * n, dot(x + i * k, in_m + j * k, k), n);
    }
    return 0;
}
