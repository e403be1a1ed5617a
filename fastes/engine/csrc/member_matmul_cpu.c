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
   (products.h's `row_blocks`, shared with packed_linear_cpu.c). Neighbouring members that take the
   term share their row blocks (a segment); cut at every member's end, the blocks had cost 16 members of
   3 rows each 1.22-1.49x one member's call, 1.03-1.05x since
   (docs/results/row-blocks-across-members-2026-12-07.md). Each output is summed over k in order,
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

/* A segment of the work: the rows of members [first, end) (offsets[first] to offsets[end]). Members
   that take the term are merged into segments of up to SEGMENT_ROWS rows, so that the register blocks
   run across their boundaries; a member whose weights are formed, or a materialised member (its own
   weight), is a segment of its own. */
#define SEGMENT_ROWS (8 * ROW_BLOCK)

/* Columns [c, end) of the rows of members [first, last): 16 * COLUMN_VECTORS-wide panels, then 16-wide
   ones, then the last columns, fewer than a vector's 16, one by one. `term` holds the rows' offsets and,
   where its inputs are set, the members' factors (w then the weight they share), the rows' products
   with them and each row's member. */
static void columns(const float *x, const float *w, const float *bias, float *y, const term_t *term,
                    int64_t first, int64_t last, int64_t c, int64_t end, int64_t k, int64_t n, float *panel) {
    const int64_t *offsets = term->offsets, rows = offsets[last] - offsets[first];
    const int perturbed = term->inputs != NULL;
    const float *x_m = x + offsets[first] * k, *w_m = perturbed ? w : w + first * k * n;
    float *y_m = y + offsets[first] * n;
    const int form = perturbed && last - first == 1 && panel != NULL && forms_weights(rows, k, n);
    term_t summed = *term; /* the term added to the sums: its products and members from the first row */
    if (perturbed) {
        summed.products = term->products + offsets[first] * term->rank;
        summed.member_of = term->member_of + offsets[first];
    }
    const term_t *sums_term = perturbed && !form ? &summed : NULL;
#define PANELS(vectors)                                                                                  \
    do {                                                                                                 \
        if (form) {                                                                                      \
            formed_panel(vectors, w_m + c, term, first, k, n, c, panel);                                 \
            row_blocks(vectors, x_m, panel, 16 * (vectors), bias ? bias + c : NULL, y_m + c, k, n,    \
                       NULL, 0, rows, c);                                                                \
        } else                                                                                           \
            row_blocks(vectors, x_m, w_m + c, n, bias ? bias + c : NULL, y_m + c, k, n, sums_term,     \
                       0, rows, c);                                                                      \
    } while (0)
    for (; c + 16 * COLUMN_VECTORS <= end; c += 16 * COLUMN_VECTORS) PANELS(COLUMN_VECTORS);
#if COLUMN_VECTORS > 1
    for (; c + 16 <= end; c += 16) PANELS(1);
#endif
#undef PANELS
    for (; c < end; c++)
        for (int64_t r = 0; r < rows; r++) {
            const int64_t m = perturbed ? summed.member_of[r] : first;
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

/* The segments' first members into `starts` (and members at the end): returns their count. */
static int64_t segments_of(const int64_t *offsets, int64_t members, int perturbed, int64_t k, int64_t n,
                           int64_t *starts) {
    int64_t count = 0, open = 0; /* open: the last segment takes more term members */
    for (int64_t m = 0; m < members; m++) {
        const int64_t rows = offsets[m + 1] - offsets[m];
        const int merges = perturbed && !forms_weights(rows, k, n);
        if (!(open && merges && offsets[m + 1] - offsets[starts[count - 1]] <= SEGMENT_ROWS))
            starts[count++] = m;
        open = merges;
    }
    starts[count] = members;
    return count;
}

/* The work is split into (segment, panel of columns) pieces over `threads` OpenMP threads: torch's own
   pool, where the library shares torch's OpenMP runtime (cpu_library.py). inputs and outputs NULL: each
   member's own weight w[m]; else the shared weight w and the members' factors (see the top), the rows'
   products with the input factors made first (as in packed_linear_cpu.c). Returns 0, -1 (nothing
   computed) where a buffer (the products, the rows' members, the segments) could not be allocated, or
   -2 (nothing computed) where the offsets do not split the rows into the members' groups. */
int64_t fastes_member_matmul_f32(const float *x, const float *w, const float *bias, float *y,
                                 const int64_t *offsets, int64_t rows, int64_t k, int64_t n, int64_t members,
                                 const float *inputs, const float *outputs, int64_t rank, int64_t threads) {
    if (!splits_rows(offsets, members, rows)) return -2;
    const int perturbed = inputs != NULL;
    float *products = perturbed ? malloc(sizeof(float) * (size_t)(rows * rank + 1)) : NULL;
    int64_t *member_of = perturbed ? malloc(sizeof(int64_t) * (size_t)(rows + 1)) : NULL;
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(members + 1));
    if ((perturbed && (products == NULL || member_of == NULL)) || starts == NULL) {
        free(products);
        free(member_of);
        free(starts);
        return -1;
    }
    if (perturbed) rows_members(offsets, members, member_of);
    const term_t term = {.products = products,
                         .inputs = inputs,
                         .outputs = outputs,
                         .offsets = offsets,
                         .member_of = member_of,
                         .rank = rank,
                         .members = members};
    const int64_t segments = segments_of(offsets, members, perturbed, k, n, starts);
    const int64_t width = 16 * COLUMN_VECTORS, panels = (n + width - 1) / width;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (perturbed) members_products(x, inputs, products, offsets, members, k, rank);
#pragma omp barrier
        /* each thread's room for a member's formed weight panel (NULL, where malloc fails: the term is
           added to the sums instead, from products made here) */
        float *panel = perturbed ? aligned_alloc(64, sizeof(float) * (size_t)(k * width)) : NULL;
#pragma omp for schedule(static)
        for (int64_t piece = 0; piece < segments * panels; piece++) {
            const int64_t segment = piece / panels, c = (piece % panels) * width;
            columns(x, w, bias, y, &term, starts[segment], starts[segment + 1], c, c + width < n ? c + width : n,
                    k, n, panel);
        }
        free(panel);
    }
    free(products);
    free(member_of);
    free(starts);
    return 0;
}
