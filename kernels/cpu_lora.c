/*
 * LoRA updates of one layer for a step of few rows, on the CPU, in one call
 * (shard_server/layers/lora.py, LoraLayer.add): out[t] += (x[t] @ A_s^T) @ B_s^T * scale for
 * each row t whose adapter s has an update here, every adapter of the step at once.
 *
 * PyTorch's way, gathering each adapter's rows, two batched matmuls and an index_add back,
 * is five kernels per layer around a few hundred thousand multiply-adds: at a decode step's
 * sizes the dispatch and passes over memory cost more than the products. Here:
 *
 * 1. low[t, c] = dot(x[t], A[s, c]) for each row with an adapter and each of its C low-rank
 *    columns (the parts of a fused layer side by side: q, k, v or gate, up), in float; up to
 *    four rows of one adapter and four of its columns go together, so that each load of x
 *    or A serves four products (bfloat16 on a CPU with AVX512-BF16: `vdpbf16ps`, two
 *    products per lane and no widening);
 * 2. each thread takes a range of output columns and, for each part crossing it, adds
 *    sum_k low[t, c0 + k] * B_p[s, k, j] into out[t, j]: a part multiplies only its own
 *    columns (no block-diagonal zeros), and B's rows are read contiguously. Up to four rows
 *    of one adapter go together, 16 columns at a time, their sums over k in registers:
 *    each load of B serves the four.
 *
 * The vectors are GCC's vector extension, one register of the level being built; their
 * multiply-adds are fused where the level has FMA (explicitly, `lora_fma`), the rest is plain
 * C.
 *
 * A and B are in the model's dtype (float32 or bfloat16), summed in float; out is read, the
 * update added in float and rounded once to its dtype. Rows are independent: a row's result
 * does not depend on which other rows share the step.
 */

#include <stdint.h>
#include <stdlib.h>

#include "cpu_bf16.h"

/* The vectors below pass between static inline functions only: no ABI to keep. */
#pragma GCC diagnostic ignored "-Wpsabi"
/* No implicit fused multiply-adds: GCC contracts a * b + c into one in some code paths and
 * not in others (a group of four rows, a lone row), which would make a row's sums depend on
 * the rows beside it. The vector loops fuse explicitly (`lora_fma`), the same instruction
 * for every row wherever it sits. */
#pragma GCC optimize("fp-contract=off")

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define LORA_GRAIN 65536 /* multiply-adds below which one thread does it all */
#define LORA_COLUMNS 64  /* output columns per work item of phase 2 */
#define LORA_GROUP 4     /* rows of one slot sharing each load of B in phase 2 */

/* LORA_VW floats in GCC's vector extension: one register of the level being built (16 on
 * AVX-512, 8 on AVX2, 4 on SSE2); wider ones would be split into several and spill. */
#if defined(__AVX512F__)
#define LORA_VW 16
#elif defined(__AVX2__)
#define LORA_VW 8
#else
#define LORA_VW 4
#endif
typedef float lora_v16 __attribute__((vector_size(4 * LORA_VW)));
typedef uint16_t lora_h16 __attribute__((vector_size(2 * LORA_VW)));
typedef uint32_t lora_w16 __attribute__((vector_size(4 * LORA_VW)));

/* LORA_VW elements at p (floats, or bf16s when bf16) as floats. */
static inline lora_v16 lora_load16(const void *p, int bf16) {
    lora_v16 v;
    if (bf16) {
        lora_h16 h;
        memcpy(&h, p, sizeof h);
        const lora_w16 w = __builtin_convertvector(h, lora_w16) << 16;
        memcpy(&v, &w, sizeof v);
    } else {
        memcpy(&v, p, sizeof v);
    }
    return v;
}

/* p[0:LORA_VW] = v (bf16s rounded to nearest even, as textgate_bf16_bits). */
static inline void lora_store16(void *p, lora_v16 v, int bf16) {
    if (bf16) {
        lora_w16 w;
        memcpy(&w, &v, sizeof w);
        w = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
        const lora_h16 h = __builtin_convertvector(w, lora_h16);
        memcpy(p, &h, sizeof h);
    } else {
        memcpy(p, &v, sizeof v);
    }
}

static inline float lora_sum16(lora_v16 v) {
    float sum = 0.0f;
    for (int i = 0; i < LORA_VW; ++i)
        sum += v[i];
    return sum;
}

/* a * b + c, fused where the level has FMA (the same instruction for every row). */
static inline lora_v16 lora_fma(lora_v16 a, lora_v16 b, lora_v16 c) {
#if defined(__AVX512F__)
    return (lora_v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
    return (lora_v16)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* Rows of x per block of phase 1: 4 x 4 sums in registers where there are 32 of them
 * (AVX-512), 2 x 4 where there are 16. */
#if defined(__AVX512F__)
#define LORA_BLOCK_ROWS 4
#else
#define LORA_BLOCK_ROWS 2
#endif

/* out[r * stride + k] = dot(x[r], a + k * n) for r < LORA_BLOCK_ROWS, k < 4: each load of x
 * serves four columns of A, each load of A the block's rows. */
static inline void lora_dot_block(const char *const *x, const void *a, int64_t n, int bf16,
                                  float *out, int64_t stride) {
    const int64_t size = bf16 ? 2 : 4;
    const char *as = (const char *)a;
    lora_v16 s[LORA_BLOCK_ROWS][4];
    for (int r = 0; r < LORA_BLOCK_ROWS; ++r)
        for (int k = 0; k < 4; ++k)
            s[r][k] = (lora_v16){0};
    int64_t i = 0;
    for (; i + LORA_VW <= n; i += LORA_VW) {
        lora_v16 va[4];
        for (int k = 0; k < 4; ++k)
            va[k] = lora_load16(as + (k * n + i) * size, bf16);
        for (int r = 0; r < LORA_BLOCK_ROWS; ++r) {
            const lora_v16 v = lora_load16(x[r] + i * size, bf16);
            for (int k = 0; k < 4; ++k)
                s[r][k] = lora_fma(v, va[k], s[r][k]);
        }
    }
    for (int r = 0; r < LORA_BLOCK_ROWS; ++r)
        for (int k = 0; k < 4; ++k) {
            float t = lora_sum16(s[r][k]);
            for (int64_t j = i; j < n; ++j)
                t += textgate_load(x[r], j, bf16) * textgate_load(a, k * n + j, bf16);
            out[r * stride + k] = t;
        }
}

#if defined(__AVX512F__)
/* lora_dot_block for bfloat16 x and A on a CPU with AVX512-BF16: vdpbf16ps multiplies 32
 * pairs per instruction into 16 float sums, no widening; the last n % 32 elements come in
 * a masked load (zeros beyond n). */
__attribute__((target("avx512bf16"))) static void lora_dot_block_bf16(const char *const *x,
                                                                       const void *a, int64_t n,
                                                                       float *out, int64_t stride) {
    const uint16_t *as = (const uint16_t *)a;
    __m512 s[4][4];
    for (int r = 0; r < 4; ++r)
        for (int k = 0; k < 4; ++k)
            s[r][k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 32) {
        const __mmask32 mask = n - i >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (n - i)) - 1);
        __m512bh va[4];
        for (int k = 0; k < 4; ++k)
            va[k] = (__m512bh)_mm512_maskz_loadu_epi16(mask, as + k * n + i);
        for (int r = 0; r < 4; ++r) {
            const __m512bh v =
                (__m512bh)_mm512_maskz_loadu_epi16(mask, (const uint16_t *)x[r] + i);
            for (int k = 0; k < 4; ++k)
                s[r][k] = _mm512_dpbf16_ps(s[r][k], v, va[k]);
        }
    }
    for (int r = 0; r < 4; ++r)
        for (int k = 0; k < 4; ++k)
            out[r * stride + k] = _mm512_reduce_add_ps(s[r][k]);
}
#endif

/* Whether this CPU runs vdpbf16ps (lora_dot_block_bf16); TEXTGATE_LORA_BF16_DOT=0 in the
 * environment turns it off (the widening path's tests on such a CPU). */
static int lora_has_bf16_dot(void) {
#if defined(__AVX512F__)
    static int known = -1;
    if (known < 0) {
        const char *env = getenv("TEXTGATE_LORA_BF16_DOT");
        known = __builtin_cpu_supports("avx512bf16") && !(env != NULL && env[0] == '0');
    }
    return known;
#else
    return 0;
#endif
}

static inline float lora_dot(const void *x, const void *a, int64_t n, int bf16) {
    float sum = 0.0f;
    if (bf16) {
        const uint16_t *xs = (const uint16_t *)x, *as = (const uint16_t *)a;
        for (int64_t i = 0; i < n; ++i)
            sum += textgate_bf16_float(xs[i]) * textgate_bf16_float(as[i]);
    } else {
        const float *xs = (const float *)x, *as = (const float *)a;
        for (int64_t i = 0; i < n; ++i)
            sum += xs[i] * as[i];
    }
    return sum;
}

/* acc[0:n] += l * b[0:n] */
static inline void lora_axpy(float *acc, float l, const void *b, int64_t n, int bf16) {
    if (bf16) {
        const uint16_t *bs = (const uint16_t *)b;
        for (int64_t j = 0; j < n; ++j)
            acc[j] += l * textgate_bf16_float(bs[j]);
    } else {
        const float *bs = (const float *)b;
        for (int64_t j = 0; j < n; ++j)
            acc[j] += l * bs[j];
    }
}

/*
 * x [rows, in]; out [rows, width] (row stride width); row_slot [rows]: the adapter's index
 * into A and B, or -1 for a row with no update in this layer. a [slots, c_total, in];
 * b [slots, b_block]: each slot's parts packed one after the other, part p's B^T
 * [rank_p, width_p] at offset off_p. parts [num_parts, 5]: (c0, rank_p, start, width_p,
 * off_p): low columns c0 .. c0 + rank_p update out columns start .. start + width_p.
 * low: scratch of rows * c_total floats.
 */
void textgate_lora_add(const void *x, void *out, int64_t rows, int64_t in, int64_t width,
                       const int64_t *row_slot, const void *a, int64_t c_total, const void *b,
                       int64_t b_block, const int64_t *parts, int64_t num_parts, float *low,
                       int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    int64_t work = 0;
    for (int64_t p = 0; p < num_parts; ++p)
        work += parts[5 * p + 1] * parts[5 * p + 3];
    work = rows * (c_total * in + work);
    const int64_t chunks = (width + LORA_COLUMNS - 1) / LORA_COLUMNS;
    /* the rows with an update, by slot (stable), in groups of up to LORA_GROUP rows of one
     * slot: both phases take a group's rows together */
    int64_t max_slot = -1, num_ordered = 0, num_groups = 0;
    for (int64_t t = 0; t < rows; ++t)
        max_slot = row_slot[t] > max_slot ? row_slot[t] : max_slot;
    int64_t *order = malloc((size_t)(rows > 0 ? rows : 1) * 3 * sizeof *order);
    if (order == NULL)
        return;
    int64_t *group_first = order + rows, *group_count = order + 2 * rows;
    for (int64_t slot = 0; slot <= max_slot; ++slot)
        for (int64_t t = 0; t < rows; ++t)
            if (row_slot[t] == slot) {
                if (num_groups == 0 || row_slot[order[group_first[num_groups - 1]]] != slot ||
                    group_count[num_groups - 1] == LORA_GROUP) {
                    group_first[num_groups] = num_ordered;
                    group_count[num_groups++] = 0;
                }
                ++group_count[num_groups - 1];
                order[num_ordered++] = t;
            }
    const int bf16_dot = bf16 && lora_has_bf16_dot();
    const int64_t block_rows = bf16_dot ? 4 : LORA_BLOCK_ROWS;
    const int64_t blocks = (LORA_GROUP + block_rows - 1) / block_rows; /* per group */
#pragma omp parallel if (work >= LORA_GRAIN)
    {
        /* four low columns at a time (c_total is a multiple of 4 in practice: ranks are) */
        const int64_t quads = (c_total + 3) / 4;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_groups * blocks * quads; ++item) {
            const int64_t g = item / (blocks * quads), block = item / quads % blocks;
            const int64_t c = item % quads * 4, first = block * block_rows;
            if (first >= group_count[g])
                continue;
            const int64_t *group = order + group_first[g];
            const int64_t s = row_slot[group[0]];
            const char *a_row = (const char *)a + ((s * c_total + c) * in) * size;
            /* a block of fewer rows repeats its first one (its sums are dropped): every row
             * runs the same instructions wherever it sits */
            const char *x_rows[4];
            float sums[4][4];
            for (int64_t r = 0; r < block_rows; ++r) {
                const int64_t t = group[first + r < group_count[g] ? first + r : first];
                x_rows[r] = (const char *)x + t * in * size;
            }
            if (c + 4 <= c_total) {
#if defined(__AVX512F__)
                if (bf16_dot)
                    lora_dot_block_bf16(x_rows, a_row, in, &sums[0][0], 4);
                else
#endif
                    lora_dot_block(x_rows, a_row, in, bf16, &sums[0][0], 4);
            } else {
                for (int64_t r = 0; r < block_rows; ++r)
                    for (int64_t k = c; k < c_total; ++k)
                        sums[r][k - c] = lora_dot(x_rows[r], a_row + (k - c) * in * size, in, bf16);
            }
            for (int64_t r = 0; r < block_rows && first + r < group_count[g]; ++r)
                for (int64_t k = c; k < c + 4 && k < c_total; ++k)
                    low[group[first + r] * c_total + k] = sums[r][k - c];
        }
        /* the implicit barrier of the loop above: every low column is done */
#pragma omp for schedule(static)
        for (int64_t chunk = 0; chunk < chunks; ++chunk) {
            const int64_t j0 = chunk * LORA_COLUMNS;
            const int64_t j1 = j0 + LORA_COLUMNS < width ? j0 + LORA_COLUMNS : width;
            float acc[LORA_GROUP][LORA_COLUMNS];
            /* each group's rows together: each load of B serves them all */
            for (int64_t gi = 0; gi < num_groups; ++gi) {
                const int64_t *group = order + group_first[gi], count = group_count[gi];
                const int64_t s = row_slot[group[0]];
                for (int64_t p = 0; p < num_parts; ++p) {
                    const int64_t *part = parts + 5 * p;
                    const int64_t c0 = part[0], rank = part[1], start = part[2];
                    const int64_t part_width = part[3], offset = part[4];
                    const int64_t lo = start > j0 ? start : j0;
                    const int64_t hi = start + part_width < j1 ? start + part_width : j1;
                    if (lo >= hi)
                        continue;
                    const char *b_part = (const char *)b + (s * b_block + offset) * size;
                    int64_t j = lo;
                    /* LORA_VW columns at a time, the rows' sums in registers over the rank */
                    for (; j + LORA_VW <= hi; j += LORA_VW) {
                        lora_v16 t0 = {0}, t1 = {0}, t2 = {0}, t3 = {0};
                        const char *b_col = b_part + (j - start) * size;
                        for (int64_t k = 0; k < rank; ++k) {
                            const lora_v16 v = lora_load16(b_col + k * part_width * size, bf16);
                            /* a group of fewer rows runs the same instructions with zeros
                             * for the missing ones, so a row's sums never depend on its
                             * company (-ffast-math may contract each code path its own way) */
                            const float *l = low + c0 + k;
                            const float l0 = l[group[0] * c_total];
                            const float l1 = count > 1 ? l[group[1] * c_total] : 0.0f;
                            const float l2 = count > 2 ? l[group[2] * c_total] : 0.0f;
                            const float l3 = count > 3 ? l[group[3] * c_total] : 0.0f;
                            t0 = lora_fma(v, (lora_v16){0} + l0, t0);
                            t1 = lora_fma(v, (lora_v16){0} + l1, t1);
                            t2 = lora_fma(v, (lora_v16){0} + l2, t2);
                            t3 = lora_fma(v, (lora_v16){0} + l3, t3);
                        }
                        const lora_v16 tiles[4] = {t0, t1, t2, t3};
                        for (int64_t g = 0; g < count; ++g) {
                            char *o = (char *)out + (group[g] * width + j) * size;
                            lora_store16(o, lora_load16(o, bf16) + tiles[g], bf16);
                        }
                    }
                    if (j < hi) { /* the last columns, one at a time */
                        const int64_t n = hi - j;
                        for (int64_t g = 0; g < count; ++g)
                            for (int64_t jj = 0; jj < n; ++jj)
                                acc[g][jj] = 0.0f;
                        for (int64_t k = 0; k < rank; ++k) {
                            const char *b_row = b_part + (k * part_width + j - start) * size;
                            for (int64_t g = 0; g < count; ++g)
                                lora_axpy(acc[g], low[group[g] * c_total + c0 + k], b_row, n, bf16);
                        }
                        for (int64_t g = 0; g < count; ++g) {
                            const int64_t o = group[g] * width + j;
                            for (int64_t jj = 0; jj < n; ++jj)
                                textgate_store(out, o + jj,
                                               textgate_load(out, o + jj, bf16) + acc[g][jj], bf16);
                        }
                    }
                }
            }
        }
    }
    free(order);
}
