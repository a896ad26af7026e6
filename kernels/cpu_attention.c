/*
 * Paged attention for the CPU, reading keys and values straight through the block tables.
 *
 * The same computation as kernels/attention.py's SDPA backend (its reference), without
 * gathering each sequence's keys into a padded copy first and without one tiny matmul
 * per (sequence, head): in a decode step of 32 short sequences SDPA spends most of its
 * time in that per-matrix overhead.
 *
 * Layouts (all contiguous, row-major; query/out float32 or bfloat16):
 *   query, out       [T, H_q, D]    the step's tokens
 *   key/value cache  [N, bs, H_kv, D] in the query's dtype, or quantized (kv_kind, below)
 *   key/value scales [N, bs, H_kv]  float32, quantized caches only (NULL otherwise)
 *   query_starts     [B]            sequence b owns rows query_starts[b] + [0, query_lens[b])
 *   query_lens       [B]            (other rows of query/out are not touched)
 *   seq_lens         [B]            cached prefix + this step's tokens
 *   block_tables     [B, max_blocks]
 * Row i of sequence b sits at position p = seq_len - query_len + i and sees the keys at
 * positions [max(0, p + 1 - window), p] (window 0: no window). Query head hq reads kv
 * head hq / (H_q / H_kv).
 *
 * Work items are (sequence, kv head, chunk of up to CHUNK rows), shared out over the
 * OpenMP threads of the process: this library is loaded after torch, which already holds
 * libgomp.so.1, so both use one runtime and one thread count (torch.set_num_threads).
 * Each key and value is widened to float once per work item and used by every row of the
 * chunk and every query head of the group. Arithmetic is float; bf16 is widened exactly
 * and the output rounded to nearest even.
 *
 * Quantized caches (kernels/kv_quant.py): int8 or float8 e4m3 elements, one float32 scale
 * per (slot, kv head); the value is element * scale. Elements are read in place and widened
 * like bf16 ones (fp8 by moving its bits into a float's, which vectorizes where a table
 * lookup would not); the scale is applied once per key to its dot products and once per
 * value to its softmax weight, never as a dequantized copy. textgate_store_kv_quantized
 * writes them: kv_quant.store_kv's computation, bit for bit.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#define CHUNK 16

enum { KV_AS_QUERY = 0, KV_INT8 = 1, KV_FP8_E4M3 = 2 };

/* The float8 e4m3fn value of `bits` (S.EEEE.MMM, exponent bias 7, no infinities). The
   stored values are finite (kv_quant clamps to +-448): the NaN pattern S.1111.111 reads
   as +-480 here. */
static inline float fp8_e4m3_to_float(uint8_t bits) {
    const uint32_t magnitude = bits & 0x7Fu, sign = (uint32_t)(bits & 0x80u) << 24;
    /* Normal: exponent and mantissa move into a float's fields, the bias from 7 to 127. */
    uint32_t normal = sign | ((magnitude << 20) + (120u << 23));
    /* Subnormal (exponent 0): mantissa * 2^-9. */
    float small = (float)magnitude * 0x1p-9f;
    uint32_t subnormal;
    memcpy(&subnormal, &small, sizeof subnormal);
    subnormal |= sign;
    const uint32_t out = magnitude >= 8 ? normal : subnormal;
    float value;
    memcpy(&value, &out, sizeof value);
    return value;
}

/* The float8 e4m3fn bits of a finite x in [-448, 448], rounded to nearest even (as
   torch's float -> float8_e4m3fn conversion rounds). */
static inline uint8_t float_to_fp8_e4m3(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const float a = fabsf(x);
    if (a < 0x1p-6f) /* subnormal: mantissa * 2^-9; 8 rounds up to the smallest normal */
        return sign | (uint8_t)rintf(a * 0x1p9f);
    memcpy(&u, &a, sizeof u);
    u += 0x7FFFFu + ((u >> 20) & 1u); /* round the 23-bit mantissa to 3 bits, ties to even */
    return sign | (uint8_t)((u >> 20) - (120u << 3));
}

/* dst[0..n) = src[offset..offset + n) as float. */
static void widen(float *dst, const void *src, int64_t offset, int64_t n, int bf16) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src + offset;
        for (int64_t i = 0; i < n; ++i) {
            uint32_t bits = (uint32_t)s[i] << 16;
            memcpy(&dst[i], &bits, sizeof bits);
        }
    } else {
        memcpy(dst, (const float *)src + offset, sizeof(float) * n);
    }
}

/* dst[offset..offset + n) = src[0..n), rounded to bf16 (nearest even) when bf16. */
static void narrow(void *dst, int64_t offset, const float *src, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *d = (uint16_t *)dst + offset;
        for (int64_t i = 0; i < n; ++i) d[i] = textgate_bf16_bits(src[i]);
    } else {
        memcpy((float *)dst + offset, src, sizeof(float) * n);
    }
}

typedef struct {
    const void *query, *key_cache, *value_cache;
    void *out;
    const int64_t *query_starts, *query_lens, *seq_lens, *block_tables;
    int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int64_t window;
    int bf16;
    const float *key_scales, *value_scales; /* NULL unless kv_kind is quantized */
    int kv_kind;
} Step;

/* dst[0..D) = the raw elements of cache entry `index` (slot * H_kv + head) as float;
   returns the entry's scale (1 for an unquantized cache). */
static inline float widen_kv(float *dst, const Step *s, const void *cache, const float *scales,
                             int64_t index, int64_t D) {
    if (s->kv_kind == KV_INT8) {
        const int8_t *c = (const int8_t *)cache + index * D;
        for (int64_t i = 0; i < D; ++i) dst[i] = (float)c[i];
        return scales[index];
    }
    if (s->kv_kind == KV_FP8_E4M3) {
        const uint8_t *c = (const uint8_t *)cache + index * D;
        for (int64_t i = 0; i < D; ++i) dst[i] = fp8_e4m3_to_float(c[i]);
        return scales[index];
    }
    widen(dst, cache, index * D, D, s->bf16);
    return 1.0f;
}

typedef struct {
    float *scores; /* [CHUNK * G, span] */
    float *q;      /* [CHUNK * G, D] */
    float *acc;    /* [CHUNK * G, D] */
    float *total;  /* [CHUNK * G] */
    float *row;    /* [D] one widened key or value */
} Scratch;

/* This thread's scratch space of at least n floats, kept between calls (every layer of
   every step asks for about the same size); NULL when memory runs out. */
static float *scratch(int64_t n) {
    static __thread float *buffer = NULL;
    static __thread int64_t capacity = 0;
    if (n > capacity) {
        free(buffer);
        buffer = malloc(sizeof(float) * n);
        capacity = buffer != NULL ? n : 0;
    }
    return buffer;
}

/* First key position row position p sees. */
static inline int64_t first_key(int64_t p, int64_t window) {
    int64_t lo = window > 0 ? p + 1 - window : 0;
    return lo > 0 ? lo : 0;
}

/* Cache entry (slot * H_kv + h: the head vector's index) of kv head h at token position pos
   of a sequence. */
static inline int64_t cache_index(const Step *s, const int64_t *table, int64_t pos, int64_t h) {
    int64_t slot = table[pos / s->block_size] * s->block_size + pos % s->block_size;
    return slot * s->num_kv_heads + h;
}

/* Rows [r0, r1) of sequence b, kv head h. Inlined once per common head size D, so the
   compiler sees its loops' trip count. */
static inline __attribute__((always_inline)) void attend_chunk(const Step *s, Scratch *w,
                                                               int64_t b, int64_t h, int64_t r0,
                                                               int64_t r1, const int64_t D) {
    const int64_t G = s->num_heads / s->num_kv_heads, R = r1 - r0;
    const int64_t row0 = s->query_starts[b];
    const int64_t first = s->seq_lens[b] - s->query_lens[b];
    const int64_t *table = s->block_tables + b * s->max_blocks;
    const int64_t p0 = first + (r0 - row0);  /* position of the chunk's first row */
    const int64_t lo_start = first_key(p0, s->window), hi_end = p0 + R;
    const int64_t span = hi_end - lo_start;

    for (int64_t r = 0; r < R; ++r)
        for (int64_t g = 0; g < G; ++g) {
            float *q = w->q + (r * G + g) * D;
            widen(q, s->query, ((r0 + r) * s->num_heads + h * G + g) * D, D, s->bf16);
            for (int64_t d = 0; d < D; ++d) q[d] *= s->scale;
        }

    for (int64_t pos = lo_start; pos < hi_end; ++pos) {
        const float key_scale =
            widen_kv(w->row, s, s->key_cache, s->key_scales, cache_index(s, table, pos, h), D);
        for (int64_t r = 0; r < R; ++r) {
            if (pos > p0 + r || pos < first_key(p0 + r, s->window)) continue;
            for (int64_t g = 0; g < G; ++g) {
                const float *q = w->q + (r * G + g) * D;
                float dot = 0.0f;
                for (int64_t d = 0; d < D; ++d) dot += q[d] * w->row[d];
                w->scores[(r * G + g) * span + (pos - lo_start)] = dot * key_scale;
            }
        }
    }

    for (int64_t r = 0; r < R; ++r) {
        const int64_t lo = first_key(p0 + r, s->window), n = p0 + r + 1 - lo;
        for (int64_t g = 0; g < G; ++g) {
            float *sc = w->scores + (r * G + g) * span + (lo - lo_start);
            float m = sc[0];
            for (int64_t j = 1; j < n; ++j) m = sc[j] > m ? sc[j] : m;
            float sum = 0.0f;
            for (int64_t j = 0; j < n; ++j) {
                sc[j] = expf(sc[j] - m);
                sum += sc[j];
            }
            w->total[r * G + g] = sum;
        }
    }

    memset(w->acc, 0, sizeof(float) * R * G * D);
    for (int64_t pos = lo_start; pos < hi_end; ++pos) {
        const float value_scale =
            widen_kv(w->row, s, s->value_cache, s->value_scales, cache_index(s, table, pos, h), D);
        for (int64_t r = 0; r < R; ++r) {
            if (pos > p0 + r || pos < first_key(p0 + r, s->window)) continue;
            for (int64_t g = 0; g < G; ++g) {
                const float p = w->scores[(r * G + g) * span + (pos - lo_start)] * value_scale;
                float *acc = w->acc + (r * G + g) * D;
                for (int64_t d = 0; d < D; ++d) acc[d] += p * w->row[d];
            }
        }
    }

    for (int64_t r = 0; r < R; ++r)
        for (int64_t g = 0; g < G; ++g) {
            float *acc = w->acc + (r * G + g) * D;
            const float inv = 1.0f / w->total[r * G + g];
            for (int64_t d = 0; d < D; ++d) acc[d] *= inv;
            narrow(s->out, ((r0 + r) * s->num_heads + h * G + g) * D, acc, D, s->bf16);
        }
}

/* Returns 0, or 1 when scratch memory ran out (out is then incomplete). kv_kind: KV_AS_QUERY
   (caches in the query's dtype, scales NULL), KV_INT8 or KV_FP8_E4M3 (with their scales). */
int textgate_paged_attention(const void *query, const void *key_cache, const void *value_cache,
                             void *out, const int64_t *query_starts, const int64_t *query_lens,
                             const int64_t *seq_lens, const int64_t *block_tables,
                             int64_t num_seqs, int64_t max_blocks,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t block_size, int64_t max_seq_len, float scale, int64_t window,
                             int bf16, const float *key_scales, const float *value_scales,
                             int kv_kind) {
    const Step s = {query,        key_cache,  value_cache,  out,        query_starts,
                    query_lens,   seq_lens,   block_tables, max_blocks, num_heads,
                    num_kv_heads, head_dim,   block_size,   scale,      window,
                    bf16,         key_scales, value_scales, kv_kind};
    const int64_t G = num_heads / num_kv_heads;

    /* The chunks of every sequence, as (sequence, first row, end row). */
    int64_t num_chunks = 0;
    for (int64_t b = 0; b < num_seqs; ++b) num_chunks += (query_lens[b] + CHUNK - 1) / CHUNK;
    int64_t *chunks = malloc(sizeof(int64_t) * 3 * (num_chunks > 0 ? num_chunks : 1));
    if (chunks == NULL) return 1;
    int64_t k = 0;
    for (int64_t b = 0; b < num_seqs; ++b) {
        const int64_t end = query_starts[b] + query_lens[b];
        for (int64_t r = query_starts[b]; r < end; r += CHUNK, ++k) {
            chunks[3 * k] = b;
            chunks[3 * k + 1] = r;
            chunks[3 * k + 2] = r + CHUNK < end ? r + CHUNK : end;
        }
    }

    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        const int64_t rows = CHUNK * G;
        float *buffer = scratch(rows * (max_seq_len > 0 ? max_seq_len : 1) + 2 * rows * head_dim +
                                rows + head_dim);
        failed |= buffer == NULL;
        Scratch w = {buffer, 0, 0, 0, 0};
        if (buffer != NULL) {
            w.q = w.scores + rows * (max_seq_len > 0 ? max_seq_len : 1);
            w.acc = w.q + rows * head_dim;
            w.total = w.acc + rows * head_dim;
            w.row = w.total + rows;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_chunks * num_kv_heads; ++item) {
            const int64_t *c = chunks + 3 * (item / num_kv_heads);
            if (buffer == NULL) continue;
            const int64_t h = item % num_kv_heads;
            if (head_dim == 64)
                attend_chunk(&s, &w, c[0], h, c[1], c[2], 64);
            else if (head_dim == 128)
                attend_chunk(&s, &w, c[0], h, c[1], c[2], 128);
            else
                attend_chunk(&s, &w, c[0], h, c[1], c[2], head_dim);
        }
    }
    free(chunks);
    return failed;
}

/* Quantize src [T, H, D] (float32, or bfloat16 when bf16) per (token, head) and write it to
   slots slot_mapping [T] of cache [N, bs, H, D] (int8 or fp8 e4m3 by kv_kind) and scales
   [N, bs, H] float32: kv_quant.quantize_kv's arithmetic in the same order, so the same bits
   (scale = absmax * (1 / QMAX), inverse = 1 / scale, q = round(clamp(x * inverse))). */
void textgate_store_kv_quantized(const void *src, const int64_t *slot_mapping, void *cache,
                                 float *scales, int64_t num_tokens, int64_t num_heads,
                                 int64_t head_dim, int bf16, int kv_kind) {
    const float qmax = kv_kind == KV_INT8 ? 127.0f : 448.0f;
    const float step = kv_kind == KV_INT8 ? 1.0f / 127.0f : 1.0f / 448.0f;
#pragma omp parallel for schedule(static) if (num_tokens * num_heads > 64)
    for (int64_t item = 0; item < num_tokens * num_heads; ++item) {
        const int64_t t = item / num_heads, h = item % num_heads, D = head_dim;
        float row[D];
        widen(row, src, item * D, D, bf16);
        float absmax = 0.0f;
        for (int64_t d = 0; d < D; ++d) absmax = fabsf(row[d]) > absmax ? fabsf(row[d]) : absmax;
        const float scale = absmax * step;
        const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        const int64_t entry = slot_mapping[t] * num_heads + h;
        scales[entry] = scale;
        for (int64_t d = 0; d < D; ++d) {
            float v = row[d] * inverse;
            v = v < -qmax ? -qmax : (v > qmax ? qmax : v);
            if (kv_kind == KV_INT8)
                ((int8_t *)cache)[entry * D + d] = (int8_t)rintf(v);
            else
                ((uint8_t *)cache)[entry * D + d] = float_to_fp8_e4m3(v);
        }
    }
}
