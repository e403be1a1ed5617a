/* The rank-r term of a population of low-rank perturbed projections, on a CPU (fp32).

   Rows are grouped by member: row `row` belongs to member m = row / rows_per_member. For each row,

       y[row] += sum_i (x[row] . b[m, i]) * a[m, i]        (i < rank)

   with x [rows, in], y [rows, out] (the base projection's output, updated in place), b [members, rank,
   in] (the input factors) and a [members, rank, out] (the output factors, already scaled by the
   member's sign * sigma / sqrt(rank)). One pass over x and y, no temporaries: in decoding the whole term
   costs about as much as one elementwise pass over y, where torch needs a reduction, an outer product and
   the dispatch of each. Built into the same library as noise_cpu.c by fastes/compiled.py; callers split
   the rows [lo, hi) across threads.

   Numerics: the dot product keeps 16 partial sums (lane j takes elements j, j + 16, ...) added in a
   fixed order, so the result does not depend on the CPU's vector width or on the thread split. */

#include <stdint.h>

#define LANES 16

static float dot(const float *x, const float *w, int64_t n) {
    float lanes[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int j = 0; j < LANES; j++) lanes[j] += x[k + j] * w[k + j];
    for (int j = 0; k + j < n; j++) lanes[j] += x[k + j] * w[k + j];
    float total = 0.0f;
    for (int j = 0; j < LANES; j++) total += lanes[j];
    return total;
}

void fastes_lowrank_add_f32(const float *x, float *y, const float *b, const float *a,
                            int64_t rows_per_member, int64_t in, int64_t out, int64_t rank,
                            int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; row++) {
        const int64_t member = row / rows_per_member;
        const float *x_row = x + row * in;
        float *y_row = y + row * out;
        for (int64_t i = 0; i < rank; i++) {
            const float coefficient = dot(x_row, b + (member * rank + i) * in, in);
            const float *a_i = a + (member * rank + i) * out;
            for (int64_t j = 0; j < out; j++) y_row[j] += coefficient * a_i[j];
        }
    }
}

/* The low-rank ES update, in place on rows [lo, hi) of w [rows, cols]:

       w[i, j] = w[i, j] * decay + sum_k a[i, k] * bt[k, j]        (k < k_total, in order)

   with a [rows, k_total] (each direction's rank columns, already scaled by its coefficient) and bt
   [k_total, cols]. One pass over w, where a GEMM with beta = decay reads and writes it several times. */
#define COLUMNS 512 /* columns per tile: the tile's sums stay in L1 */

void fastes_lowrank_update_f32(float *w, const float *a, const float *bt, int64_t cols, int64_t k_total,
                               float decay, int64_t lo, int64_t hi) {
    float sum[COLUMNS];
    for (int64_t i = lo; i < hi; i++) {
        float *row = w + i * cols;
        const float *a_i = a + i * k_total;
        for (int64_t start = 0; start < cols; start += COLUMNS) {
            const int64_t n = cols - start < COLUMNS ? cols - start : COLUMNS;
            for (int64_t j = 0; j < n; j++) sum[j] = 0.0f;
            for (int64_t k = 0; k < k_total; k++) {
                const float coefficient = a_i[k];
                const float *b_k = bt + k * cols + start;
                for (int64_t j = 0; j < n; j++) sum[j] += coefficient * b_k[j];
            }
            for (int64_t j = 0; j < n; j++) row[start + j] = row[start + j] * decay + sum[j];
        }
    }
}
