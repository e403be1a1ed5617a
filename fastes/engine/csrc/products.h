/* What the library's products share (member_matmul_cpu.c, few_rows_linear_cpu.c, packed_linear_cpu.c):
   fused multiply-adds, the 16-float vector they compute in, the register block of the matmuls with
   the loop that runs it over a panel's rows, and the low-rank population's term.

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

#include <stdint.h>
#include <string.h>

typedef float vec16 __attribute__((vector_size(64)));

/* Sums in registers: ROW_BLOCK x COLUMN_VECTORS 16-float vectors. 12 x 2 fills 24 of AVX-512's 32
   registers; with 16 AVX2 registers (a vec16 is two of them) 6 x 1 leaves room for the operands. */
#if defined(__AVX512F__)
#define ROW_BLOCK 12
#define COLUMN_VECTORS 2
#else
#define ROW_BLOCK 6
#define COLUMN_VECTORS 1
#endif

/* The low-rank population's term: row i of member m gets sum_j (x[i] . inputs[m, j]) outputs[m, j].
   Either added to the sums before they are stored, from the products x[i] . inputs[m, j] computed
   first: row i gets sum_j products[i * rank + j] * outputs[(m * rank + j) * n + column]
   (few_rows_linear_cpu.c, packed_linear_cpu.c); or, in row_block's `perturbed` form, added to member
   m's weight as it is loaded, w[p, column] + sum_j inputs[(m * rank + j) * k + p] * outputs[...]
   (member_matmul_cpu.c, for weights small enough to be read again for every member). */
typedef struct {
    const float *products; /* [rows, rank]: the products, for the term added to the sums */
    const float *inputs;   /* [members, rank, k]: the input factors, for the term in the weights */
    const float *outputs;  /* [members, rank, n], scaled; NULL: no term */
    const int64_t *offsets; /* [members + 1]: where each member's rows start */
    int64_t rank, members;
} term_t;

/* w_p[0 .. vectors) += sum_j inputs[m, j, p] * outputs[m, j, c ...]: member m's term added to row p of
   the weight panel that starts at column c (term_t). A macro, not a function: as a function taking the
   vectors by pointer, the perturbed row blocks measured 5-7% slower
   (docs/results/perturb-and-member-panel-2026-12-07.md). */
#define ADD_MEMBER_TERM(w_p, vectors, term, m, p, k, n, c)                                              \
    for (int64_t j = 0; j < (term)->rank; j++) {                                                         \
        const float in_jp = (term)->inputs[((m) * (term)->rank + j) * (k) + (p)];                        \
        const float *a = (term)->outputs + ((m) * (term)->rank + j) * (n) + (c);                         \
        _Pragma("GCC unroll 16") for (int v = 0; v < (vectors); v++) {                                   \
            vec16 a_v;                                                                                   \
            memcpy(&a_v, a + 16 * v, sizeof a_v);                                                        \
            (w_p)[v] += in_jp * a_v;                                                                     \
        }                                                                                                \
    }

/* Member m's weight panel of 16 * vectors columns from column c, term added, formed once into
   `panel` [k, 16 * vectors] for all of the member's row blocks: row_block's perturbed form makes it
   again for every block of ROW_BLOCK rows. */
static inline __attribute__((always_inline)) void formed_panel(const int vectors, const float *w,
                                                               const term_t *term, int64_t m, int64_t k,
                                                               int64_t n, int64_t c, float *panel) {
    for (int64_t p = 0; p < k; p++) {
        vec16 w_p[COLUMN_VECTORS];
        _Pragma("GCC unroll 16") for (int v = 0; v < vectors; v++)
            memcpy(&w_p[v], w + p * n + 16 * v, sizeof w_p[v]);
        ADD_MEMBER_TERM(w_p, vectors, term, m, p, k, n, c)
        _Pragma("GCC unroll 16") for (int v = 0; v < vectors; v++)
            memcpy(panel + (p * vectors + v) * 16, &w_p[v], sizeof w_p[v]);
    }
}

/* y[r, 0:16 * vectors] = x[r, :] @ w[:, 0:16 * vectors] (+ bias) (+ the term) for r < rows <= ROW_BLOCK;
   x rows of length k, w rows `w_stride` apart, y rows n apart; the block's rows are rows first_row...
   of member m, its columns start at column c of the layer (for the term's outputs). `perturbed`: the
   term goes into the weights as they are loaded (term_t), else into the sums. Constant arguments after
   inlining (rows, vectors, perturbed, and term where NULL), so the loops over rows and vectors unroll
   and the sums live in registers. Each sum runs over k in order. */
static inline __attribute__((always_inline)) void row_block(const int rows, const int vectors,
                                                            const int perturbed, const float *x,
                                                            const float *w, int64_t w_stride,
                                                            const float *bias, float *y, int64_t k, int64_t n,
                                                            const term_t *term, int64_t m, int64_t first_row,
                                                            int64_t c) {
    vec16 sum[ROW_BLOCK][COLUMN_VECTORS];
    _Pragma("GCC unroll 16") for (int v = 0; v < vectors; v++) {
        vec16 start = {0};
        if (bias) memcpy(&start, bias + 16 * v, sizeof start);
        _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++) sum[r][v] = start;
    }
    for (int64_t p = 0; p < k; p++) {
        vec16 w_p[COLUMN_VECTORS];
        _Pragma("GCC unroll 16") for (int v = 0; v < vectors; v++)
            memcpy(&w_p[v], w + p * w_stride + 16 * v, sizeof w_p[v]);
        if (perturbed) ADD_MEMBER_TERM(w_p, vectors, term, m, p, k, n, c)
        _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++) {
            const float x_rp = x[r * k + p];
            _Pragma("GCC unroll 16") for (int v = 0; v < vectors; v++) sum[r][v] += x_rp * w_p[v];
        }
    }
    if (!perturbed && term && term->outputs)
        for (int64_t j = 0; j < term->rank; j++) {
            const float *a = term->outputs + (m * term->rank + j) * n + c;
            _Pragma("GCC unroll 16") for (int v = 0; v < vectors; v++) {
                vec16 a_v;
                memcpy(&a_v, a + 16 * v, sizeof a_v);
                _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++)
                    sum[r][v] += term->products[(first_row + r) * term->rank + j] * a_v;
            }
        }
    _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++)
        _Pragma("GCC unroll 16") for (int v = 0; v < vectors; v++)
            memcpy(y + r * n + 16 * v, &sum[r][v], sizeof sum[r][v]);
}

/* Rows [lo, hi) against one panel of 16 * vectors columns: full row blocks, then the rows left over,
   each case with a constant row count so that its loops unroll as in the full blocks. x and y point at
   row 0 (y and bias at the panel's first column, c); the arguments are row_block's. */
#define ROWS_BLOCK(rows_) \
    row_block(rows_, vectors, perturbed, x + r * k, w, w_stride, bias, y + r * n, k, n, term, m, r, c)
static inline __attribute__((always_inline)) void row_blocks(const int vectors, const int perturbed,
                                                             const float *x, const float *w,
                                                             int64_t w_stride, const float *bias, float *y,
                                                             int64_t k, int64_t n, const term_t *term,
                                                             int64_t m, int64_t lo, int64_t hi, int64_t c) {
    int64_t r = lo;
    for (; r + ROW_BLOCK <= hi; r += ROW_BLOCK) ROWS_BLOCK(ROW_BLOCK);
    switch (hi - r) {
        case 1: ROWS_BLOCK(1); break;
        case 2: ROWS_BLOCK(2); break;
        case 3: ROWS_BLOCK(3); break;
        case 4: ROWS_BLOCK(4); break;
        case 5: ROWS_BLOCK(5); break;
#if ROW_BLOCK > 6
        case 6: ROWS_BLOCK(6); break;
        case 7: ROWS_BLOCK(7); break;
        case 8: ROWS_BLOCK(8); break;
        case 9: ROWS_BLOCK(9); break;
        case 10: ROWS_BLOCK(10); break;
        case 11: ROWS_BLOCK(11); break;
#endif
        default: break;
    }
}
#undef ROWS_BLOCK

/* The 16 lanes of a sum added as a tree, in one fixed order */
static inline float lanes_added(vec16 sum) {
    float half[8];
    for (int lane = 0; lane < 8; lane++) half[lane] = sum[lane] + sum[lane + 8];
    for (int lane = 0; lane < 4; lane++) half[lane] += half[lane + 4];
    return (half[0] + half[2]) + (half[1] + half[3]);
}

/* x[0:k] . v[0:k]: four independent 16-float sums (so the multiply-adds overlap instead of waiting on
   each other), added as (0 + 1) + (2 + 3), then across their lanes, then the last k % 16 one by one. */
static inline float dot(const float *x, const float *v, int64_t k) {
    vec16 sum[4] = {{0}, {0}, {0}, {0}};
    int64_t p = 0;
    for (; p + 64 <= k; p += 64)
        for (int s = 0; s < 4; s++) {
            vec16 x_p, v_p;
            memcpy(&x_p, x + p + 16 * s, sizeof x_p);
            memcpy(&v_p, v + p + 16 * s, sizeof v_p);
            sum[s] += x_p * v_p;
        }
    for (; p + 16 <= k; p += 16) {
        vec16 x_p, v_p;
        memcpy(&x_p, x + p, sizeof x_p);
        memcpy(&v_p, v + p, sizeof v_p);
        sum[0] += x_p * v_p;
    }
    float total = lanes_added((sum[0] + sum[1]) + (sum[2] + sum[3]));
    for (; p < k; p++) total += x[p] * v[p];
    return total;
}

/* Whether offsets [members + 1] split `rows` rows into the members' groups: from 0 to rows, never
   going back (a group may be empty) */
static inline int splits_rows(const int64_t *offsets, int64_t members, int64_t rows) {
    if (offsets[0] != 0 || offsets[members] != rows) return 0;
    for (int64_t m = 0; m < members; m++)
        if (offsets[m + 1] < offsets[m]) return 0;
    return 1;
}

/* products[i, j] = x[i, :] . inputs[m, j, :] for the rows [lo, hi) of member m: the low-rank term's
   first half (inputs [members, rank, k]) */
static inline void products_of(const float *x, const float *inputs, float *products, int64_t m, int64_t lo,
                               int64_t hi, int64_t k, int64_t rank) {
    for (int64_t i = lo; i < hi; i++)
        for (int64_t j = 0; j < rank; j++)
            products[i * rank + j] = dot(x + i * k, inputs + (m * rank + j) * k, k);
}

#endif
