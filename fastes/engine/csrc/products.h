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

#include <math.h> /* FP_FAST_FMAF */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float vec16 __attribute__((vector_size(64)));

/* a * b + c, fused wherever the CPU fuses it: one rounding or two, by the build, not by how the compiler
   chose to contract a line (which may differ between a function's inlined copies) */
static inline float multiply_add(float a, float b, float c) {
#ifdef FP_FAST_FMAF
    return __builtin_fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

/* y[0:n] += product * v[0:n]: 16 floats at a time, the rest one by one (the low-rank term's update of a
   row's outputs, in the few-rows linear per block and in the term's own pass per row) */
static inline void scaled_added(float *y, const float *v, float product, int64_t n) {
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        vec16 y_c, v_c;
        memcpy(&y_c, y + c, sizeof y_c);
        memcpy(&v_c, v + c, sizeof v_c);
        y_c += product * v_c;
        memcpy(y + c, &y_c, sizeof y_c);
    }
    for (; c < n; c++) y[c] = multiply_add(product, v[c], y[c]);
}

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
   (few_rows_linear_cpu.c, packed_linear_cpu.c, member_matmul_cpu.c); or, for a member with many rows,
   added to its weight once, w[p, column] + sum_j inputs[(m * rank + j) * k + p] * outputs[...]
   (formed_panel: member_matmul_cpu.c, for weights small enough to be read again for every member). */
typedef struct {
    const float *products; /* [rows, rank]: the products, for the term added to the sums */
    const float *inputs;   /* [members, rank, k]: the input factors, for the term in the weights */
    const float *outputs;  /* [members, rank, n], scaled; NULL: no term */
    const int64_t *offsets; /* [members + 1]: where each member's rows start */
    const int64_t *member_of; /* [rows]: each row's member (a row block may hold several members' rows) */
    int64_t rank, members;
} term_t;

/* Member m's weight panel of 16 * vectors columns from column c, term added, formed once into
   `panel` [k, 16 * vectors] for all of the member's row blocks: row p is
   w[p, c ...] + sum_j inputs[m, j, p] * outputs[m, j, c ...] (term_t). */
static inline __attribute__((always_inline)) void formed_panel(const int vectors, const float *w,
                                                               const term_t *term, int64_t m, int64_t k,
                                                               int64_t n, int64_t c, float *panel) {
    for (int64_t p = 0; p < k; p++) {
        vec16 w_p[COLUMN_VECTORS];
        _Pragma("GCC unroll 16") for (int v = 0; v < vectors; v++)
            memcpy(&w_p[v], w + p * n + 16 * v, sizeof w_p[v]);
        for (int64_t j = 0; j < term->rank; j++) {
            const float in_jp = term->inputs[(m * term->rank + j) * k + p];
            const float *a = term->outputs + (m * term->rank + j) * n + c;
            _Pragma("GCC unroll 16") for (int v = 0; v < vectors; v++) {
                vec16 a_v;
                memcpy(&a_v, a + 16 * v, sizeof a_v);
                w_p[v] += in_jp * a_v;
            }
        }
        _Pragma("GCC unroll 16") for (int v = 0; v < vectors; v++)
            memcpy(panel + (p * vectors + v) * 16, &w_p[v], sizeof w_p[v]);
    }
}

/* y[r, 0:16 * vectors] = x[r, :] @ w[:, 0:16 * vectors] (+ bias) (+ the term) for r < rows <= ROW_BLOCK;
   x rows of length k, w rows `w_stride` apart, y rows n apart; the block's rows are rows first_row...
   of the term's rows (for their products and members), its columns start at column c of the layer (for
   the term's outputs), the term added to the sums where `term` has outputs (term_t), each row its own
   member's. Constant arguments after inlining (rows, vectors, and term where NULL), so the loops over
   rows and vectors unroll and the sums live in registers. Each sum runs over k in order, then adds the
   term's ranks in order, so a row's result does not depend on which rows share its block. */
static inline __attribute__((always_inline)) void row_block(const int rows, const int vectors, const float *x,
                                                            const float *w, int64_t w_stride,
                                                            const float *bias, float *y, int64_t k, int64_t n,
                                                            const term_t *term, int64_t first_row,
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
        _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++) {
            const float x_rp = x[r * k + p];
            _Pragma("GCC unroll 16") for (int v = 0; v < vectors; v++) sum[r][v] += x_rp * w_p[v];
        }
    }
    if (term && term->outputs) /* each row its own member's outputs */
        for (int64_t j = 0; j < term->rank; j++)
            _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++) {
                const float *a = term->outputs + (term->member_of[first_row + r] * term->rank + j) * n + c;
                _Pragma("GCC unroll 16") for (int v = 0; v < vectors; v++) {
                    vec16 a_v;
                    memcpy(&a_v, a + 16 * v, sizeof a_v);
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
    row_block(rows_, vectors, x + r * k, w, w_stride, bias, y + r * n, k, n, term, r, c)
static inline __attribute__((always_inline)) void row_blocks(const int vectors,
                                                             const float *x, const float *w,
                                                             int64_t w_stride, const float *bias, float *y,
                                                             int64_t k, int64_t n, const term_t *term,
                                                             int64_t lo, int64_t hi, int64_t c) {
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

/* The vector part of x[0:k] . v[0:k]: four independent 16-float sums (so the multiply-adds overlap
   instead of waiting on each other) over whole 64-float chunks, then 16-float chunks into the first,
   added as (0 + 1) + (2 + 3), into *lanes (through a pointer: a 64-byte vector returned by value
   changes the ABI where AVX-512 is off). `dot` adds its lanes, then the last k % 16 one by one. */
static inline void dot_lanes(const float *x, const float *v, int64_t k, vec16 *lanes) {
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
    *lanes = (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

/* total + x[p] v[p] for the last k % 16 elements, one by one */
static inline float dot_tail(const float *x, const float *v, int64_t k, float total) {
    for (int64_t p = k - k % 16; p < k; p++) total += x[p] * v[p];
    return total;
}

/* x[0:k] . v[0:k] */
static inline float dot(const float *x, const float *v, int64_t k) {
    vec16 lanes;
    dot_lanes(x, v, k, &lanes);
    return dot_tail(x, v, k, lanes_added(lanes));
}

/* lanes_added of each of v[0 .. 16): lane r of *totals is v[r]'s, added in lanes_added's order (lanes
   8 apart, then 4, 2 and 1) by shuffles of whole vectors, ~3 vector operations a row where lanes_added
   takes ~15 scalar ones (the low-rank term's products of a tiny model's 64-wide rows took ~15% of its
   packed linear that way). Every slot is added in the same order, so a row's total does not depend on
   the rows beside it. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUFFLED(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
static inline void lanes_added_16(const vec16 v[16], vec16 *totals) {
    vec16 eight[8], four[4], two[2];
    for (int i = 0; i < 8; i++) /* rows 2i, 2i + 1: lane j + lane j + 8, in half a vector each */
        eight[i] = SHUFFLED(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   SHUFFLED(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* rows 4i ... 4i + 3: half[q] + half[q + 4], four lanes each */
        four[i] = SHUFFLED(eight[2 * i], eight[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                  SHUFFLED(eight[2 * i], eight[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* rows 8i ... 8i + 7: (half[0] + half[2]), (half[1] + half[3]) */
        two[i] = SHUFFLED(four[2 * i], four[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                 SHUFFLED(four[2 * i], four[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    *totals = SHUFFLED(two[0], two[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLED(two[0], two[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Lane r of *totals = lane r of *totals + v[r][0] + v[r][1] + ... + v[r][15], added in lane order, as a
   loop over the lanes adds them: v is transposed by shuffles of whole vectors (four rounds of 16, each
   swapping one bit of the row with the same bit of the lane), then its 16 columns are added as vectors.
   ~5 vector operations a row where the loop takes 15 lane extractions and 16 dependent adds. */
static inline void lanes_added_in_order_16(const vec16 v[16], vec16 *totals) {
    vec16 t[16];
    for (int r = 0; r < 16; r++) t[r] = v[r];
    for (int r = 0; r < 16; r++) /* bit 3: row r (bit clear) and row r + 8 */
        if (!(r & 8)) {
            const vec16 a = t[r], b = t[r + 8];
            t[r] = SHUFFLED(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
            t[r + 8] = SHUFFLED(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
        }
    for (int r = 0; r < 16; r++) /* bit 2 */
        if (!(r & 4)) {
            const vec16 a = t[r], b = t[r + 4];
            t[r] = SHUFFLED(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
            t[r + 4] = SHUFFLED(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
        }
    for (int r = 0; r < 16; r++) /* bit 1 */
        if (!(r & 2)) {
            const vec16 a = t[r], b = t[r + 2];
            t[r] = SHUFFLED(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
            t[r + 2] = SHUFFLED(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
        }
    for (int r = 0; r < 16; r += 2) { /* bit 0 */
        const vec16 a = t[r], b = t[r + 1];
        t[r] = SHUFFLED(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
        t[r + 1] = SHUFFLED(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
    for (int lane = 0; lane < 16; lane++) *totals += t[lane]; /* t[lane][r] = v[r][lane] */
}
#undef SHUFFLED
#else
static inline void lanes_added_16(const vec16 v[16], vec16 *totals) {
    for (int r = 0; r < 16; r++) (*totals)[r] = lanes_added(v[r]);
}
static inline void lanes_added_in_order_16(const vec16 v[16], vec16 *totals) {
    for (int r = 0; r < 16; r++)
        for (int lane = 0; lane < 16; lane++) (*totals)[r] += v[r][lane];
}
#endif

/* Whether offsets [members + 1] split `rows` rows into the members' groups: from 0 to rows, never
   going back (a group may be empty) */
static inline int splits_rows(const int64_t *offsets, int64_t members, int64_t rows) {
    if (offsets[0] != 0 || offsets[members] != rows) return 0;
    for (int64_t m = 0; m < members; m++)
        if (offsets[m + 1] < offsets[m]) return 0;
    return 1;
}

/* products[i, j] = dot(x[i, :], inputs[m, j, :]) for the rows [lo, hi) of member m: the low-rank term's
   first half (inputs [members, rank, k]). Sixteen rows at a time, their lanes added together
   (lanes_added_16): the same totals as `dot`, row by row. */
static inline void products_of(const float *x, const float *inputs, float *products, int64_t m, int64_t lo,
                               int64_t hi, int64_t k, int64_t rank) {
    for (int64_t j = 0; j < rank; j++) {
        const float *v = inputs + (m * rank + j) * k;
        for (int64_t first = lo; first < hi; first += 16) {
            const int count = hi - first < 16 ? (int)(hi - first) : 16;
            vec16 lanes[16] = {{0}};
            for (int r = 0; r < count; r++) dot_lanes(x + (first + r) * k, v, k, &lanes[r]);
            vec16 totals;
            lanes_added_16(lanes, &totals);
            for (int r = 0; r < count; r++)
                products[(first + r) * rank + j] = dot_tail(x + (first + r) * k, v, k, totals[r]);
        }
    }
}

/* products_of for every member's rows, sixteen rows a piece, the pieces shared by the threads of the
   enclosing OpenMP parallel region (every thread calls it; no barrier at the end). */
static inline void members_products(const float *x, const float *inputs, float *products,
                                    const int64_t *offsets, int64_t members, int64_t k, int64_t rank) {
    for (int64_t m = 0; m < members; m++) {
#pragma omp for schedule(static) nowait
        for (int64_t first = offsets[m]; first < offsets[m + 1]; first += 16)
            products_of(x, inputs, products, m, first, first + 16 < offsets[m + 1] ? first + 16 : offsets[m + 1],
                        k, rank);
    }
}
/* member_of[i]: the member whose rows (offsets[m] <= i < offsets[m + 1]) hold row i (term_t's member_of) */
static inline void rows_members(const int64_t *offsets, int64_t members, int64_t *member_of) {
    for (int64_t m = 0; m < members; m++)
        for (int64_t i = offsets[m]; i < offsets[m + 1]; i++) member_of[i] = m;
}

/* A call's buffers for the term of `rows` rows: *products [rows, rank], to be filled (members_products),
   and *member_of [rows], filled here (rows_members). Returns 0, or -1 with nothing allocated (both NULL)
   where either could not be; the caller frees both. */
static inline int term_buffers(const int64_t *offsets, int64_t members, int64_t rows, int64_t rank,
                               float **products, int64_t **member_of) {
    *products = malloc((size_t)(rows * rank) * sizeof(float));
    *member_of = malloc((size_t)rows * sizeof(int64_t));
    if (!*products || !*member_of) {
        free(*products);
        free(*member_of);
        *products = NULL;
        *member_of = NULL;
        return -1;
    }
    rows_members(offsets, members, *member_of);
    return 0;
}
#endif /* FASTES_PRODUCTS_H */
