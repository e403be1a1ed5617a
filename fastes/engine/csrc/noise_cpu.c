/* The noise contract on a CPU: Philox4x32-10 words, Box-Muller normals and Rademacher signs.

   The same stream as fastes/noise.py (the torch reference) and docs/noise.md, compiled once per
   machine by fastes/compiled.py and called through ctypes on tiles of counter blocks.

   Every exported function works on a range of "lane blocks" [lo, hi) of a packed chunk described by a
   table of parts, one row per tensor slice: (first Philox block of the slice in its tensor, first lane
   block of the slice in the chunk, number of blocks, tensor id). A block's counter is (block index low
   and high words, tensor id, stream c3); the 20 round keys of the member come as rk (round r uses
   rk[2r], rk[2r + 1]). Output is written at out + (values per block) * lane block. Callers split
   [0, blocks) across threads.

   Numerics: integer arithmetic is exact, so words, uniforms and signs equal the reference bit for
   bit. Normals use the branch-free ln / cos / sin of the Triton kernels (kernels/philox.py) with the
   same explicit fused multiply-adds (C's fmaf is exactly rounded by definition: one instruction where
   the CPU has FMA, a slower library call where it has not, the same bits either way), and nothing
   else is contracted (-ffp-contract=off), so the normals are the same on every CPU and within 2 fp32
   ulps (~1e-6) of the reference's torch.log / cos / sin. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define M0 0xD2511F53u
#define M1 0xCD9E8D57u
#define ROUNDS 10
#define TILE 256 /* blocks per tile: the tile's words and normals stay in L1 */

/* ------------------------------------------------------------------------------------------- */
/* Philox: the words of blocks [0, n) of a tile                                                 */
/* ------------------------------------------------------------------------------------------- */

static void philox_scalar(const uint32_t *c0, const uint32_t *c1, const uint32_t *c2, uint32_t c3,
                          const uint32_t *rk, int64_t n, uint32_t *w0, uint32_t *w1, uint32_t *w2,
                          uint32_t *w3) {
    for (int64_t j = 0; j < n; j++) {
        uint32_t x0 = c0[j], x1 = c1[j], x2 = c2[j], x3 = c3;
        for (int r = 0; r < ROUNDS; r++) {
            uint64_t p0 = (uint64_t)x0 * M0, p1 = (uint64_t)x2 * M1;
            x0 = (uint32_t)(p1 >> 32) ^ x1 ^ rk[2 * r];
            x2 = (uint32_t)(p0 >> 32) ^ x3 ^ rk[2 * r + 1];
            x1 = (uint32_t)p1;
            x3 = (uint32_t)p0;
        }
        w0[j] = x0; w1[j] = x1; w2[j] = x2; w3[j] = x3;
    }
}

#if defined(__AVX2__)
/* Four blocks per 256-bit register, each word in the low half of a 64-bit lane: one vpmuludq gives
   both words of four products (compilers emulate a full 64-bit multiply instead). The high halves
   of the lanes may hold garbage between rounds: vpmuludq reads only the low halves. */
static inline void store_low_words(uint32_t *out, __m256i v) {
    const __m256i low_halves = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    _mm_storeu_si128((__m128i *)out, _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(v, low_halves)));
}

/* Eight blocks per iteration in two independent register groups: a round's multiply -> shift -> xor
   chain is ~6 cycles long, and two chains in flight keep the multiplier busy. */
#define LOAD_GROUP(g, at)                                                              \
    __m256i g##0 = _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(c0 + (at)))); \
    __m256i g##1 = _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(c1 + (at)))); \
    __m256i g##2 = _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(c2 + (at)))); \
    __m256i g##3 = _mm256_set1_epi64x(c3);
#define ROUND_GROUP(g)                                                                  \
    {                                                                                  \
        __m256i p0 = _mm256_mul_epu32(g##0, m0), p1 = _mm256_mul_epu32(g##2, m1);      \
        g##0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), g##1), k0); \
        g##2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p0, 32), g##3), k1); \
        g##1 = p1;                                                                     \
        g##3 = p0;                                                                     \
    }
#define STORE_GROUP(g, at)                                                              \
    store_low_words(w0 + (at), g##0); store_low_words(w1 + (at), g##1);                 \
    store_low_words(w2 + (at), g##2); store_low_words(w3 + (at), g##3);

static void philox(const uint32_t *c0, const uint32_t *c1, const uint32_t *c2, uint32_t c3,
                   const uint32_t *rk, int64_t n, uint32_t *w0, uint32_t *w1, uint32_t *w2, uint32_t *w3) {
    const __m256i m0 = _mm256_set1_epi64x(M0), m1 = _mm256_set1_epi64x(M1);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        LOAD_GROUP(a, j)
        LOAD_GROUP(b, j + 4)
        for (int r = 0; r < ROUNDS; r++) {
            const __m256i k0 = _mm256_set1_epi64x(rk[2 * r]), k1 = _mm256_set1_epi64x(rk[2 * r + 1]);
            ROUND_GROUP(a)
            ROUND_GROUP(b)
        }
        STORE_GROUP(a, j)
        STORE_GROUP(b, j + 4)
    }
    philox_scalar(c0 + j, c1 + j, c2 + j, c3, rk, n - j, w0 + j, w1 + j, w2 + j, w3 + j);
}
#else
#define philox philox_scalar
#endif

/* ------------------------------------------------------------------------------------------- */
/* Words -> uniforms -> normals (docs/noise.md sections 5, 6 and 10)                            */
/* ------------------------------------------------------------------------------------------- */

static inline float bits_to_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* (2 (x >> 9) + 1) 2^-24, exactly: the top 23 bits as the mantissa of a float in [1, 2), minus 1 - 2^-24. */
static inline float uniform(uint32_t word) { return bits_to_float((word >> 9) | 0x3F800000u) - (1.0f - 0x1p-24f); }

/* ln(u) for u in [2^-24, 1): u = 2^e (1 + f) with 1 + f in [2/3, 4/3) (exact), ln(1 + f) by the
   kernels' degree-10 polynomial, plus e ln 2. */
static inline float log_unit(float u) {
    int32_t bits = (int32_t)float_to_bits(u);
    int32_t e = (bits - 0x3F2AAAAB) >> 23;
    float f = bits_to_float((uint32_t)(bits - (e << 23))) - 1.0f;
    /* P(f) = C0 + C1 f + ... + C7 f^7 by Estrin's scheme: pairs, then f^2 and f^4 (a short
       dependency chain; Horner's would leave the vector units waiting on each step). */
    float f2 = f * f, f4 = f2 * f2;
    float p01 = fmaf(-0.24999888241291046f, f, 0.3333320617675781f);
    float p23 = fmaf(-0.16676408052444458f, f, 0.20010776817798615f);
    float p45 = fmaf(-0.12240584194660187f, f, 0.1400090754032135f);
    float p67 = fmaf(-0.12648257613182068f, f, 0.14005349576473236f);
    float p = fmaf(f4, fmaf(f2, p67, p45), fmaf(f2, p23, p01));
    float log1p_f = fmaf(f2, fmaf(f, p, -0.5f), f);
    return fmaf((float)e, 0.6931471805599453f, log1p_f);
}

/* cos and sin of an angle in [0, 2 pi]: a = n pi/2 + r with n = round(a 2/pi) (by adding 1.5 2^23),
   r = a - n pi/2 exactly (two fused multiply-adds with pi/2 split in two), then the kernels' minimax
   polynomials on [-pi/4, pi/4] and the quadrant's swap and signs. */
static inline void cos_sin(float a, float *cos_a, float *sin_a) {
    float shifted = fmaf(a, 0.63661975f, 12582912.0f);
    uint32_t q = float_to_bits(shifted); /* n in the low bits */
    float n = shifted - 12582912.0f;
    float r = fmaf(-n, 1.5707963705062866f, a);
    r = fmaf(-n, -4.371139000186243e-08f, r);
    float z = r * r;
    float sin_r = fmaf(r * z, fmaf(fmaf(-1.9515295891e-4f, z, 8.3321608736e-3f), z, -1.6666654611e-1f), r);
    float cos_r = fmaf(z * z, fmaf(fmaf(2.443315711809948e-5f, z, -1.388731625493765e-3f), z, 4.166664568298827e-2f),
                       fmaf(z, -0.5f, 1.0f));
    float c = (q & 1) ? sin_r : cos_r, s = (q & 1) ? cos_r : sin_r;
    *cos_a = ((q + 1) & 2) ? -c : c;
    *sin_a = (q & 2) ? -s : s;
}

static inline void box_muller(uint32_t radius_word, uint32_t angle_word, float *e_cos, float *e_sin) {
    float radius = sqrtf(-2.0f * log_unit(uniform(radius_word)));
    float c, s;
    cos_sin(6.2831855f * uniform(angle_word), &c, &s);
    *e_cos = radius * c;
    *e_sin = radius * s;
}

/* The normals of a tile of n blocks, in element order: block j's four normals at out[4j .. 4j + 3]. */
static void normals_tile(const uint32_t *c0, const uint32_t *c1, const uint32_t *c2, uint32_t c3,
                         const uint32_t *rk, int64_t n, float *out) {
    uint32_t w[4][TILE];
    philox(c0, c1, c2, c3, rk, n, w[0], w[1], w[2], w[3]);
    for (int64_t j = 0; j < n; j++) {
        box_muller(w[0][j], w[1][j], &out[4 * j], &out[4 * j + 1]);
        box_muller(w[2][j], w[3][j], &out[4 * j + 2], &out[4 * j + 3]);
    }
}

/* The signs of a tile of n sign blocks: element 128 j + 32 v + i is bit i of word v of block j. */
static void signs_tile(const uint32_t *c0, const uint32_t *c1, const uint32_t *c2, uint32_t c3,
                       const uint32_t *rk, int64_t n, float *out) {
    uint32_t w[4][TILE];
    philox(c0, c1, c2, c3, rk, n, w[0], w[1], w[2], w[3]);
    for (int64_t j = 0; j < n; j++)
        for (int v = 0; v < 4; v++)
            for (int i = 0; i < 32; i++)
                out[128 * j + 32 * v + i] = bits_to_float(0x3F800000u | (((w[v][j] >> i) & 1u) << 31));
}

/* ------------------------------------------------------------------------------------------- */
/* Tiles of a packed chunk: counters made from the part table                                   */
/* ------------------------------------------------------------------------------------------- */

/* A part's row of the io table: source address, destination address, elements, the antithetic twin's
   destination address (0: none), and the destination's layout: 0 when it is the source's, or the
   source's column count c when the destination holds the [c, rows] transpose of a [rows, c] source. */
#define IO_COLUMNS 5

typedef struct {
    uint32_t c3;                /* the stream word */
    const uint32_t *round_keys; /* 20 per direction */
    const float *weights;       /* per direction (sums and updates) */
    int64_t n_directions;
    int per_block;  /* elements per Philox block: 4 (normals, words) or 128 (signs) */
    void *out;      /* chunk output (fills and sums), indexed by lane */
    const int64_t *table, *io; /* in-place work: per part, IO_COLUMNS numbers (see IO_COLUMNS) */
    float scale, coef, decay;
} job_t;

/* Work on one tile of m blocks (counters c0, c1, c2) of part `row` whose first lane block is `lane_block`. */
typedef void (*tile_fn)(const job_t *job, const int64_t *row, const uint32_t *c0, const uint32_t *c1,
                        const uint32_t *c2, int64_t m, int64_t lane_block);

/* The counters of blocks t .. t + m - 1 (lane blocks) of part `row`. */
static void tile_counters(const int64_t *row, int64_t t, int64_t m, uint32_t *c0, uint32_t *c1,
                          uint32_t *c2) {
    uint64_t first = (uint64_t)row[0] + (uint64_t)(t - row[1]); /* block indices are 64-bit */
    for (int64_t j = 0; j < m; j++) {
        c0[j] = (uint32_t)(first + (uint64_t)j);
        c1[j] = (uint32_t)((first + (uint64_t)j) >> 32);
        c2[j] = (uint32_t)row[3];
    }
}

/* Lane blocks [lo, hi) of a part's range, clipped to the part: whether any are left. */
static int clip_to_part(const int64_t *row, int64_t lo, int64_t hi, int64_t *start, int64_t *end) {
    *start = lo > row[1] ? lo : row[1];
    *end = hi < row[1] + row[2] ? hi : row[1] + row[2];
    return *start < *end;
}

static void part_tiles(const int64_t *row, int64_t lo, int64_t hi, int64_t tile, tile_fn work,
                       const job_t *job) {
    uint32_t c0[TILE], c1[TILE], c2[TILE];
    int64_t start, end;
    if (!clip_to_part(row, lo, hi, &start, &end)) return;
    for (int64_t t = start; t < end; t += tile) {
        int64_t m = end - t < tile ? end - t : tile;
        tile_counters(row, t, m, c0, c1, c2);
        work(job, row, c0, c1, c2, m, t);
    }
}

static void for_each_tile(const int64_t *table, int64_t n_parts, int64_t lo, int64_t hi, int64_t tile,
                          tile_fn work, const job_t *job) {
    for (int64_t p = 0; p < n_parts; p++) part_tiles(table + 4 * p, lo, hi, tile, work, job);
}

/* Tiles of TILE blocks for normals and words, TILE / 32 sign blocks for signs: 4 * TILE values each. */
static int64_t tile_blocks(int per_block) { return 4 * TILE / per_block; }

static void eps_tile(const job_t *job, const uint32_t *rk, const uint32_t *c0, const uint32_t *c1,
                     const uint32_t *c2, int64_t m, float *eps) {
    if (job->per_block == 4)
        normals_tile(c0, c1, c2, job->c3, rk, m, eps);
    else
        signs_tile(c0, c1, c2, job->c3, rk, m, eps);
}

/* sum = sum_d weights[d] * eps_d over the tile, in direction order (fp32, one rounding per product and
   per sum, from 0). Normals: each direction's Box-Muller output is added into four lane-major sums
   (lane k of block j at lanes[k][j]: contiguous, no interleaving per direction), interleaved once.
   Signs: each direction's tile of signs, then its weighted add. The tile's sum stays in L1. */
static void tile_sum(const job_t *job, const uint32_t *c0, const uint32_t *c1, const uint32_t *c2, int64_t m,
                     float *sum) {
    if (job->per_block == 4) {
        uint32_t x[4][TILE];
        float lanes[4][TILE];
        for (int64_t j = 0; j < m; j++)
            for (int k = 0; k < 4; k++) lanes[k][j] = 0.0f;
        for (int64_t d = 0; d < job->n_directions; d++) {
            philox(c0, c1, c2, job->c3, job->round_keys + 2 * ROUNDS * d, m, x[0], x[1], x[2], x[3]);
            const float w = job->weights[d];
            for (int64_t j = 0; j < m; j++) {
                float e0, e1, e2, e3;
                box_muller(x[0][j], x[1][j], &e0, &e1);
                box_muller(x[2][j], x[3][j], &e2, &e3);
                lanes[0][j] = lanes[0][j] + w * e0;
                lanes[1][j] = lanes[1][j] + w * e1;
                lanes[2][j] = lanes[2][j] + w * e2;
                lanes[3][j] = lanes[3][j] + w * e3;
            }
        }
        for (int64_t j = 0; j < m; j++)
            for (int k = 0; k < 4; k++) sum[4 * j + k] = lanes[k][j];
        return;
    }
    float eps[4 * TILE];
    for (int64_t i = 0; i < 128 * m; i++) sum[i] = 0.0f;
    for (int64_t d = 0; d < job->n_directions; d++) {
        signs_tile(c0, c1, c2, job->c3, job->round_keys + 2 * ROUNDS * d, m, eps);
        const float w = job->weights[d];
        for (int64_t i = 0; i < 128 * m; i++) sum[i] = sum[i] + w * eps[i];
    }
}

/* A part's row of the io table. */
static const int64_t *io_row(const job_t *job, const int64_t *row) {
    return job->io + IO_COLUMNS * ((row - job->table) / 4);
}

/* The tile's elements inside its part (the part's last block may reach past the tensor's end): the
   first element's offset in the part, and how many. */
static int64_t part_elements(const job_t *job, const int64_t *row, int64_t m, int64_t lane_block,
                             const int64_t **io, int64_t *first) {
    *io = io_row(job, row);
    *first = job->per_block * (lane_block - row[1]);
    int64_t count = job->per_block * m;
    return *first + count > (*io)[2] ? (*io)[2] - *first : count;
}

static void words_work(const job_t *job, const int64_t *row, const uint32_t *c0, const uint32_t *c1,
                       const uint32_t *c2, int64_t m, int64_t lane_block) {
    (void)row; /* chunk outputs are indexed by lane */
    uint32_t w[4][TILE], *out = (uint32_t *)job->out + 4 * lane_block;
    philox(c0, c1, c2, job->c3, job->round_keys, m, w[0], w[1], w[2], w[3]);
    for (int64_t j = 0; j < m; j++)
        for (int v = 0; v < 4; v++) out[4 * j + v] = w[v][j];
}

static void eps_work(const job_t *job, const int64_t *row, const uint32_t *c0, const uint32_t *c1,
                     const uint32_t *c2, int64_t m, int64_t lane_block) {
    (void)row;
    eps_tile(job, job->round_keys, c0, c1, c2, m, (float *)job->out + job->per_block * lane_block);
}

static void sum_work(const job_t *job, const int64_t *row, const uint32_t *c0, const uint32_t *c1,
                     const uint32_t *c2, int64_t m, int64_t lane_block) {
    (void)row;
    tile_sum(job, c0, c1, c2, m, (float *)job->out + job->per_block * lane_block);
}

/* The transpose of a [rows, columns] source, written from the values of its elements first .. first +
   count - 1 (a run of rows, the first and last maybe partial): element e goes to
   (e % columns) * rows + e / columns. Whole rows go through a block of BLOCK_ROWS rows and BLOCK_COLUMNS
   columns, so that each column's values are stored side by side (16 fp32: a 64-byte line), not one
   line per value; a partial row's values one by one. */
#define BLOCK_ROWS 16
#define BLOCK_COLUMNS 8

#if defined(__AVX2__)
/* 8 rows of 8 values at v (row stride `columns`) stored as 8 columns of 8 at dst (column stride `rows`):
   the usual unpack, shuffle and lane-permute transpose in registers. */
static inline void transpose_8x8(float *dst, int64_t rows, int64_t columns, const float *v) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(v + i * columns);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * rows, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * rows, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}
#endif

static void transpose_block(float *dst, int64_t rows, int64_t columns, const float *v, int64_t h, int64_t w) {
    float block[BLOCK_COLUMNS][BLOCK_ROWS];
#if defined(__AVX2__)
    if (h == BLOCK_ROWS && w == BLOCK_COLUMNS) {
        transpose_8x8(dst, rows, columns, v);
        transpose_8x8(dst + 8, rows, columns, v + 8 * columns);
        return;
    }
#endif
    for (int64_t i = 0; i < h; i++)
        for (int64_t j = 0; j < w; j++) block[j][i] = v[i * columns + j];
    for (int64_t j = 0; j < w; j++) memcpy(dst + j * rows, block[j], sizeof(float) * (size_t)h);
}

static void write_transposed(float *dst, int64_t columns, int64_t elements, int64_t first, const float *values,
                             int64_t count) {
    const int64_t rows = elements / columns, end = first + count;
    int64_t whole = (first + columns - 1) / columns * columns; /* the first whole row's first element */
    whole = whole < end ? whole : end;
    int64_t whole_end = end / columns * columns;
    whole_end = whole_end > whole ? whole_end : whole;
    for (int64_t e = first; e < whole; e++) dst[(e % columns) * rows + e / columns] = values[e - first];
    const float *v = values + (whole - first);
    const int64_t r0 = whole / columns, n_rows = (whole_end - whole) / columns;
    for (int64_t c = 0; c < columns; c += BLOCK_COLUMNS)
        for (int64_t i = 0; i < n_rows; i += BLOCK_ROWS)
            transpose_block(dst + c * rows + r0 + i, rows, columns, v + i * columns + c,
                            n_rows - i < BLOCK_ROWS ? n_rows - i : BLOCK_ROWS,
                            columns - c < BLOCK_COLUMNS ? columns - c : BLOCK_COLUMNS);
    for (int64_t e = whole_end; e < end; e++) dst[(e % columns) * rows + e / columns] = values[e - first];
}

/* fp32: the perturbed values of a tile's elements, src + scale * eps into `plus` and, where `minus` is
   given, src - scale * eps (an antithetic twin's, the bits a call with -scale writes). Returns how many
   (the tile's first element in its part is per_block * (lane_block - row[1])). */
static int64_t perturbed_values(const job_t *job, const int64_t *row, const uint32_t *c0, const uint32_t *c1,
                                const uint32_t *c2, int64_t m, int64_t lane_block, float *plus, float *minus) {
    float eps[4 * TILE];
    eps_tile(job, job->round_keys, c0, c1, c2, m, eps);
    const int64_t *io;
    int64_t first, count = part_elements(job, row, m, lane_block, &io, &first);
    const float *src = (const float *)(intptr_t)io[0] + first;
    for (int64_t i = 0; i < count; i++) plus[i] = src[i] + job->scale * eps[i];
    if (minus != NULL)
        for (int64_t i = 0; i < count; i++) minus[i] = src[i] + (-job->scale) * eps[i];
    return count;
}

/* A contiguous destination (and twin): written straight from the tile. */
static void perturb_work(const job_t *job, const int64_t *row, const uint32_t *c0, const uint32_t *c1,
                         const uint32_t *c2, int64_t m, int64_t lane_block) {
    const int64_t *io = io_row(job, row), first = job->per_block * (lane_block - row[1]);
    float *dst = (float *)(intptr_t)io[1], *twin = (float *)(intptr_t)io[3];
    perturbed_values(job, row, c0, c1, c2, m, lane_block, dst + first, twin ? twin + first : NULL);
}

/* A transposed destination (and twin), in panels of whole tiles that hold at least BLOCK_ROWS of the
   source's rows: the panel's values are gathered, then written as whole lines of the transpose. A wide
   source's tile holds less than a row (SmolLM2: 576-1536 columns), and written tile by tile each value of
   the transpose went to a line of its own, the writes several times the cost of the noise. */
static void perturb_transposed_part(const job_t *job, const int64_t *row, int64_t lo, int64_t hi) {
    const int64_t *io = io_row(job, row), columns = io[4], tile = tile_blocks(job->per_block);
    float *dst = (float *)(intptr_t)io[1], *twin = (float *)(intptr_t)io[3];
    int64_t start, end;
    if (!clip_to_part(row, lo, hi, &start, &end)) return;
    int64_t panel = tile * ((BLOCK_ROWS * columns + 4 * TILE - 1) / (4 * TILE)); /* lane blocks */
    float on_stack[2 * 4 * TILE], *heap = NULL;
    if (panel > tile) heap = malloc(sizeof(float) * (size_t)(2 * 4 * TILE * (panel / tile)));
    if (heap == NULL) panel = tile; /* a narrow source, or no memory: a tile at a time */
    float *plus = heap ? heap : on_stack, *minus = twin ? plus + 4 * TILE * (panel / tile) : NULL;
    uint32_t c0[TILE], c1[TILE], c2[TILE];
    for (int64_t p = start; p < end; p += panel) {
        const int64_t p_end = end - p < panel ? end : p + panel, first = job->per_block * (p - row[1]);
        int64_t count = 0;
        for (int64_t t = p; t < p_end; t += tile) {
            const int64_t m = p_end - t < tile ? p_end - t : tile, at = job->per_block * (t - p);
            tile_counters(row, t, m, c0, c1, c2);
            count = at + perturbed_values(job, row, c0, c1, c2, m, t, plus + at, minus ? minus + at : NULL);
        }
        write_transposed(dst, columns, io[2], first, plus, count);
        if (minus != NULL) write_transposed(twin, columns, io[2], first, minus, count);
    }
    free(heap);
}

/* fp32 in place: theta = theta * decay + coef * sum_d w_d eps_d (the update's apply, rounded as the
   torch consumer rounds it: each product, then the sum). */
static void update_work(const job_t *job, const int64_t *row, const uint32_t *c0, const uint32_t *c1,
                        const uint32_t *c2, int64_t m, int64_t lane_block) {
    float sum[4 * TILE];
    tile_sum(job, c0, c1, c2, m, sum);
    const int64_t *io;
    int64_t first, count = part_elements(job, row, m, lane_block, &io, &first);
    float *theta = (float *)(intptr_t)io[1] + first;
    for (int64_t i = 0; i < count; i++) theta[i] = theta[i] * job->decay + sum[i] * job->coef;
}

/* ------------------------------------------------------------------------------------------- */
/* Exported. The table has one row per part; lo and hi are lane blocks; per_block is 4 or 128.  */
/* ------------------------------------------------------------------------------------------- */

void fastes_words(const int64_t *table, int64_t n_parts, int64_t lo, int64_t hi, uint32_t c3, const uint32_t *rk,
                  uint32_t *out) {
    job_t job = {.c3 = c3, .round_keys = rk, .per_block = 4, .out = out};
    for_each_tile(table, n_parts, lo, hi, TILE, words_work, &job);
}

/* out[lanes] = eps (normals, or signs with per_block 128). */
void fastes_eps(const int64_t *table, int64_t n_parts, int64_t lo, int64_t hi, uint32_t c3, const uint32_t *rk,
                int64_t per_block, float *out) {
    job_t job = {.c3 = c3, .round_keys = rk, .per_block = (int)per_block, .out = out};
    for_each_tile(table, n_parts, lo, hi, tile_blocks(job.per_block), eps_work, &job);
}

/* fastes_eps under each of n_keys keys (round keys rk + 20 d) into out + d * row_stride: the low-rank
   factors of every direction in one call. */
void fastes_eps_keys(const int64_t *table, int64_t n_parts, int64_t lo, int64_t hi, uint32_t c3,
                     const uint32_t *rk, int64_t n_keys, int64_t per_block, float *out, int64_t row_stride) {
    for (int64_t d = 0; d < n_keys; d++)
        fastes_eps(table, n_parts, lo, hi, c3, rk + 2 * ROUNDS * d, per_block, out + d * row_stride);
}

/* out[lanes] = sum_d weights[d] * eps_d. */
void fastes_eps_sum(const int64_t *table, int64_t n_parts, int64_t lo, int64_t hi, uint32_t c3,
                    const uint32_t *round_keys, const float *weights, int64_t n_directions, int64_t per_block,
                    float *out) {
    job_t job = {.c3 = c3, .round_keys = round_keys, .weights = weights, .n_directions = n_directions,
                 .per_block = (int)per_block, .out = out};
    for_each_tile(table, n_parts, lo, hi, tile_blocks(job.per_block), sum_work, &job);
}

/* fp32 tensors, io = per part (see IO_COLUMNS): dst = src + scale * eps, and twin = src - scale * eps
   where a twin is given (an antithetic member's weights, from the same noise). */
void fastes_perturb_f32(const int64_t *table, const int64_t *io, int64_t n_parts, int64_t lo, int64_t hi,
                        uint32_t c3, const uint32_t *rk, int64_t per_block, float scale) {
    job_t job = {.c3 = c3, .round_keys = rk, .per_block = (int)per_block, .table = table, .io = io,
                 .scale = scale};
    for (int64_t p = 0; p < n_parts; p++) {
        if (io[IO_COLUMNS * p + 4])
            perturb_transposed_part(&job, table + 4 * p, lo, hi);
        else
            part_tiles(table + 4 * p, lo, hi, tile_blocks(job.per_block), perturb_work, &job);
    }
}

/* fp32 tensors in place (the destination addresses of io): theta = theta * decay + coef * sum. */
void fastes_update_f32(const int64_t *table, const int64_t *io, int64_t n_parts, int64_t lo, int64_t hi,
                       uint32_t c3, const uint32_t *round_keys, const float *weights, int64_t n_directions,
                       int64_t per_block, float coef, float decay) {
    job_t job = {.c3 = c3, .round_keys = round_keys, .weights = weights, .n_directions = n_directions,
                 .per_block = (int)per_block, .table = table, .io = io, .coef = coef, .decay = decay};
    for_each_tile(table, n_parts, lo, hi, tile_blocks(job.per_block), update_work, &job);
}
