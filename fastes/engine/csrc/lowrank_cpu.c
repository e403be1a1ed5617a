/* The low-rank ES update, in place on rows [lo, hi) of w [rows, cols]:

       w[i, j] = w[i, j] * decay + sum_k a[i, k] * bt[k, j]        (k < k_total, in order)

   with a [rows, k_total] (each direction's rank columns, already scaled by its coefficient) and bt
   [k_total, cols]. One pass over w, where a GEMM with beta = decay reads and writes it several times.
   Each run of 64 columns keeps its sums in four 16-float vectors (registers) across the k loop; the
   last columns of a row that do not fill a run are summed one by one, in the same order. Returns the
   largest |w| written (NaN if a result is NaN or inf), which ES keeps as its next generation's read of
   the weights. Built into the same library as noise_cpu.c by fastes/engine/cpu_library.py; callers
   split the rows [lo, hi) across threads. */

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t mask16 __attribute__((vector_size(64)));
#define RUN 4 /* vectors of sums per run of columns */

float fastes_lowrank_update_f32(float *w, const float *a, const float *bt, int64_t cols, int64_t k_total,
                                float decay, int64_t lo, int64_t hi) {
    const int64_t width = 16 * RUN;
    vec16 largest = {0}, nonfinite = {0}; /* value - value is 0 for a finite value, else NaN */
    float largest_rest = 0.0f, nonfinite_rest = 0.0f;
    for (int64_t i = lo; i < hi; i++) {
        float *row = w + i * cols;
        const float *a_i = a + i * k_total;
        int64_t start = 0;
        for (; start + width <= cols; start += width) {
            vec16 sum[RUN] = {{0}};
            for (int64_t k = 0; k < k_total; k++) {
                const float coefficient = a_i[k];
                for (int q = 0; q < RUN; q++) {
                    vec16 b_k;
                    memcpy(&b_k, bt + k * cols + start + 16 * q, sizeof b_k); /* unaligned load */
                    sum[q] += coefficient * b_k;
                }
            }
            for (int q = 0; q < RUN; q++) {
                vec16 value;
                memcpy(&value, row + start + 16 * q, sizeof value);
                value = value * decay + sum[q];
                memcpy(row + start + 16 * q, &value, sizeof value);
                const vec16 magnitude = (vec16)((mask16)value & 0x7fffffff);
                const mask16 larger = magnitude > largest;
                largest = (vec16)(((mask16)magnitude & larger) | ((mask16)largest & ~larger));
                nonfinite += value - value;
            }
        }
        for (; start < cols; start++) {
            float sum = 0.0f;
            for (int64_t k = 0; k < k_total; k++) sum += a_i[k] * bt[k * cols + start];
            const float value = row[start] * decay + sum;
            row[start] = value;
            largest_rest = fabsf(value) > largest_rest ? fabsf(value) : largest_rest;
            nonfinite_rest += value - value;
        }
    }
    for (int j = 0; j < 16; j++) {
        largest_rest = largest[j] > largest_rest ? largest[j] : largest_rest;
        nonfinite_rest += nonfinite[j];
    }
    return nonfinite_rest == 0.0f ? largest_rest : NAN;
}
