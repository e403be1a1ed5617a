/* The materialised population's matmul: for every member m,

       y[i] = x[i] @ w[m] (+ bias)        for the rows offsets[m] <= i < offsets[m + 1]

   x [rows, k], w [members, k, n], y [rows, n], all row-major and contiguous, fp32. Members may have
   different numbers of rows (none, once all of a member's rows have finished decoding). With the
   low-rank population's factors (inputs [members, rank, k], outputs [members, rank, n], scaled), w is
   one weight [k, n] that every member shares, and member m's is w + sum_j inputs[m, j]^T outputs[m, j].
   A member with few rows (rows (k + n) <= 3 k n: every decoding step of a tiny model, 32 rows a member)
   gets that term added to its sums before they are stored, from its rows' products with the input
   factors, made first (products.h's term_t): k + n multiply-adds a row. One with more rows has its
   weight panel formed once, into a buffer of the thread's, for all its row blocks: k n multiply-adds.
   Forming every member's panels cost the tiny model's decoding layers 12-35% over the plain product,
   the term 0-7% (docs/results/population-iteration-2026-12-07.md). For a small layer, whose weight
   stays in the caches, either beats the term added after a product, which reads every output again
   (docs/results/tiny-lowrank-2026-12-07.md).

   torch's batched matmul hands each member's small GEMM to BLAS, which packs the member's weight panel
   before using it for only a few rows (32 a member while the tiny model decodes), so the population's
   matmuls ran behind the plain model's one GEMM over all rows (docs/results/member-matmul-2026-12-06.md).
   Here the weights are read where they lie: a panel of 16 * COLUMN_VECTORS columns of w[m] (a few KB,
   in L1) serves every block of ROW_BLOCK rows, whose sums stay in registers across the whole k loop
   (products.h's `row_blocks`, shared with packed_linear_cpu.c). Each output is summed over k in order,
   so a row's result depends neither on the rows beside it nor on the threads (with factors: on the
   member's row count only, which picks the term or the formed weights).

   Multiply-adds are fused (products.h), so results agree with torch's GEMM to float tolerance, not bit
   for bit. Built into the same library as noise_cpu.c by fastes/engine/cpu_library.py. */

#include "products.h" /* first: its pragma covers the functions below */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/* Whether a member's perturbed weights are formed, once into a panel, for its `rows` rows: that costs
   k n multiply-adds, stored and read again, where adding the term to the sums costs each row k + n
   multiply-adds that overlap the product's (its product with the input factors, then one per output).
   Measured at a tiny model's sizes, forming was no faster up to 3x the rows where the two counts meet,
   ~5% faster at 10x (docs/results/population-iteration-2026-12-07.md). */
static int forms_weights(int64_t rows, int64_t k, int64_t n) { return rows * (k + n) > 3 * k * n; }

/* Columns [c, end) of member m's rows: 16 * COLUMN_VECTORS-wide panels, then 16-wide ones, then the last
   columns, fewer than a vector's 16, one by one. `term` holds the rows' offsets and, where its inputs are
   set, the members' factors (w then the weight they share) and the rows' products with them. */
static void columns(const float *x, const float *w, const float *bias, float *y, const term_t *term,
                    int64_t m, int64_t c, int64_t end, int64_t k, int64_t n, float *panel) {
    const int64_t *offsets = term->offsets, rows = offsets[m + 1] - offsets[m];
    const int perturbed = term->inputs != NULL;
    const float *x_m = x + offsets[m] * k, *w_m = perturbed ? w : w + m * k * n;
    float *y_m = y + offsets[m] * n;
    const int form = perturbed && panel != NULL && forms_weights(rows, k, n);
    term_t summed = *term; /* the term added to the sums: its products from the member's first row */
    if (perturbed) summed.products = term->products + offsets[m] * term->rank;
    const term_t *sums_term = perturbed && !form ? &summed : NULL;
#define PANELS(vectors)                                                                                  \
    do {                                                                                                 \
        if (form) {                                                                                      \
            formed_panel(vectors, w_m + c, term, m, k, n, c, panel);                                     \
            row_blocks(vectors, x_m, panel, 16 * (vectors), bias ? bias + c : NULL, y_m + c, k, n,    \
                       NULL, 0, 0, rows, c);                                                             \
        } else                                                                                           \
            row_blocks(vectors, x_m, w_m + c, n, bias ? bias + c : NULL, y_m + c, k, n, sums_term, m, \
                       0, rows, c);                                                                      \
    } while (0)
    for (; c + 16 * COLUMN_VECTORS <= end; c += 16 * COLUMN_VECTORS) PANELS(COLUMN_VECTORS);
#if COLUMN_VECTORS > 1
    for (; c + 16 <= end; c += 16) PANELS(1);
#endif
#undef PANELS
    for (; c < end; c++)
        for (int64_t r = 0; r < rows; r++) {
            float sum = bias ? bias[c] : 0.0f;
            for (int64_t p = 0; p < k; p++) {
                float w_pc = w_m[p * n + c];
                for (int64_t j = 0; perturbed && j < term->rank; j++) {
                    const int64_t factor = m * term->rank + j;
                    w_pc += term->inputs[factor * k + p] * term->outputs[factor * n + c];
                }
                sum += x_m[r * k + p] * w_pc;
            }
            y_m[r * n + c] = sum;
        }
}

/* The work is split into (member, panel of columns) pieces over `threads` OpenMP threads: torch's own
   pool, where the library shares torch's OpenMP runtime (cpu_library.py). inputs and outputs NULL: each
   member's own weight w[m]; else the shared weight w and the members' factors (see the top), the rows'
   products with the input factors made first (as in packed_linear_cpu.c). Returns 0, -1 (nothing
   computed) where the products' buffer could not be allocated, or -2 (nothing computed) where the
   offsets do not split the rows into the members' groups. */
int64_t fastes_member_matmul_f32(const float *x, const float *w, const float *bias, float *y,
                                 const int64_t *offsets, int64_t rows, int64_t k, int64_t n, int64_t members,
                                 const float *inputs, const float *outputs, int64_t rank, int64_t threads) {
    if (!splits_rows(offsets, members, rows)) return -2;
    float *products = inputs != NULL ? malloc(sizeof(float) * (size_t)(rows * rank + 1)) : NULL;
    if (inputs != NULL && products == NULL) return -1;
    const term_t term = {.products = products,
                         .inputs = inputs,
                         .outputs = outputs,
                         .offsets = offsets,
                         .rank = rank,
                         .members = members};
    const int64_t width = 16 * COLUMN_VECTORS, panels = (n + width - 1) / width;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        for (int64_t m = 0; inputs != NULL && m < members; m++) {
#pragma omp for schedule(static) nowait
            for (int64_t first = offsets[m]; first < offsets[m + 1]; first += 16) /* products_of's blocks */
                products_of(x, inputs, products, m, first, first + 16 < offsets[m + 1] ? first + 16 : offsets[m + 1],
                            k, rank);
        }
#pragma omp barrier
        /* each thread's room for a member's formed weight panel (NULL, where malloc fails: the term is
           added to the sums instead, from products made here) */
        float *panel = inputs != NULL ? aligned_alloc(64, sizeof(float) * (size_t)(k * width)) : NULL;
#pragma omp for schedule(static)
        for (int64_t piece = 0; piece < members * panels; piece++) {
            const int64_t m = piece / panels, c = (piece % panels) * width;
            columns(x, w, bias, y, &term, m, c, c + width < n ? c + width : n, k, n, panel);
        }
        free(panel);
    }
    free(products);
    return 0;
}
