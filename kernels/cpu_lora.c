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
 *    columns (the parts of a fused layer side by side: q, k, v or gate, up), in float;
 * 2. each thread takes a range of output columns and, for each part crossing it, adds
 *    sum_k low[t, c0 + k] * B_p[s, k, j] into out[t, j]: a part multiplies only its own
 *    columns (no block-diagonal zeros), and B's rows are read contiguously. Up to four rows
 *    of one adapter go together, 16 columns at a time, their sums over k in registers:
 *    each load of B serves the four.
 *
 * The 16-wide vectors are GCC's vector extension, lowered to the level being built (one
 * AVX-512 register, two AVX2 ones, four SSE2 ones); the rest is plain C.
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
/* No fused multiply-adds: GCC contracts a * b + c into one in some code paths and not in
 * others (a group of four rows, a lone row), which would make a row's sums depend on the rows
 * beside it. Without them every row is summed the same way wherever it sits. */
#pragma GCC optimize("fp-contract=off")

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

/* out[0:4] = dot(x, a + k * n) for k = 0..3: x's loads shared by four rows of A. */
static inline void lora_dot4(const void *x, const void *a, int64_t n, int bf16, float *out) {
    const int64_t size = bf16 ? 2 : 4;
    const char *xs = (const char *)x, *as = (const char *)a;
    lora_v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int64_t i = 0;
    for (; i + LORA_VW <= n; i += LORA_VW) {
        const lora_v16 v = lora_load16(xs + i * size, bf16);
        s0 += v * lora_load16(as + i * size, bf16);
        s1 += v * lora_load16(as + (n + i) * size, bf16);
        s2 += v * lora_load16(as + (2 * n + i) * size, bf16);
        s3 += v * lora_load16(as + (3 * n + i) * size, bf16);
    }
    float t0 = lora_sum16(s0), t1 = lora_sum16(s1), t2 = lora_sum16(s2), t3 = lora_sum16(s3);
    for (; i < n; ++i) {
        const float v = textgate_load(x, i, bf16);
        t0 += v * textgate_load(a, i, bf16);
        t1 += v * textgate_load(a, n + i, bf16);
        t2 += v * textgate_load(a, 2 * n + i, bf16);
        t3 += v * textgate_load(a, 3 * n + i, bf16);
    }
    out[0] = t0, out[1] = t1, out[2] = t2, out[3] = t3;
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
    /* the rows with an update, by slot (stable): phase 2 takes each slot's rows together */
    int64_t max_slot = -1, num_ordered = 0;
    for (int64_t t = 0; t < rows; ++t)
        max_slot = row_slot[t] > max_slot ? row_slot[t] : max_slot;
    int64_t *order = malloc((size_t)(rows > 0 ? rows : 1) * sizeof *order);
    if (order == NULL)
        return;
    for (int64_t slot = 0; slot <= max_slot; ++slot)
        for (int64_t t = 0; t < rows; ++t)
            if (row_slot[t] == slot)
                order[num_ordered++] = t;
#pragma omp parallel if (work >= LORA_GRAIN)
    {
        /* four low columns at a time (c_total is a multiple of 4 in practice: ranks are) */
        const int64_t quads = (c_total + 3) / 4;
#pragma omp for schedule(static)
        for (int64_t tq = 0; tq < rows * quads; ++tq) {
            const int64_t t = tq / quads, c = (tq % quads) * 4, s = row_slot[t];
            if (s < 0)
                continue;
            const char *x_row = (const char *)x + t * in * size;
            const char *a_row = (const char *)a + ((s * c_total + c) * in) * size;
            if (c + 4 <= c_total) {
                lora_dot4(x_row, a_row, in, bf16, low + t * c_total + c);
            } else {
                for (int64_t k = c; k < c_total; ++k, a_row += in * size)
                    low[t * c_total + k] = lora_dot(x_row, a_row, in, bf16);
            }
        }
        /* the implicit barrier of the loop above: every low column is done */
#pragma omp for schedule(static)
        for (int64_t chunk = 0; chunk < chunks; ++chunk) {
            const int64_t j0 = chunk * LORA_COLUMNS;
            const int64_t j1 = j0 + LORA_COLUMNS < width ? j0 + LORA_COLUMNS : width;
            float acc[LORA_GROUP][LORA_COLUMNS];
            /* rows of one slot in groups of LORA_GROUP: each load of B serves them all */
            for (int64_t first = 0; first < num_ordered;) {
                const int64_t s = row_slot[order[first]];
                int64_t count = 1;
                while (count < LORA_GROUP && first + count < num_ordered &&
                       row_slot[order[first + count]] == s)
                    ++count;
                const int64_t *group = order + first;
                first += count;
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
                            t0 += v * l0;
                            t1 += v * l1;
                            t2 += v * l2;
                            t3 += v * l3;
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
