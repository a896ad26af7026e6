/*
 * W8A8 linear layers on the CPU's int8 dot-product units (kernels/int8_linear.py holds the
 * PyTorch references).
 *
 * textgate_quantize_rows: per-token int8 quantization of a linear layer's input, in one pass:
 * for each row x of [rows, cols] (times the layer's per-column smoothing factors, if any),
 * m = max(max|x|, 1e-12), out = nearbyint(x * ((1 / m) * 127)) + 128 as uint8 (ties to even,
 * as torch.round), row_max = m. The same float operations as the reference, so the bytes
 * match it exactly.
 *
 * textgate_int8_linear: the whole layer in one call, y = dequant(q_x @ q_w.T) + bias: the rows
 * quantized as above, the products of unsigned q_x + 128 and signed q_w summed exactly in
 * int32, 128 * colsum(q_w) subtracted after (exact up to 66,314 inputs,
 * int8_linear.MAX_IN_FEATURES), scaled by row_max and the per-channel weight scale, the bias
 * added and the result stored in the input's dtype. Which instructions sum the products
 * depends on the build's level (kernels/cpu_isa.py), and so does the weights' layout, packed
 * once by int8_linear.pack_int8 (N padded to 16, K to 4); textgate_int8_isa() says which:
 *   2  AVX512-VNNI: vpdpbusd, four u8 x s8 products per int32 lane;  [N/16][K/4][16][4]
 *   1  AVX2: both operands widened to int16, vpmaddwd sums pairs of products into int32
 *      lanes, so nothing saturates (vpmaddubsw's int16 sums would);    [N/16][K/2][16][2]
 *   0  portable C, the same sums one by one;                           [N/16][K/4][16][4]
 */

/* Exact float semantics here: the build's -ffast-math may reassociate x * ((1 / m) * 127),
 * which moves values that sit on a rounding tie. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-fast-math")
#endif

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TEXTGATE_INT8_ISA 2
#elif defined(__AVX2__)
#include <immintrin.h>
#define TEXTGATE_INT8_ISA 1
#else
#define TEXTGATE_INT8_ISA 0
#endif

#define GRAIN_SIZE 32768 /* at::internal::GRAIN_SIZE */
/* Multiply-adds below which one thread is done sooner than two (waking the second costs
 * a few microseconds, more on a busy machine). */
#define GEMM_GRAIN (1 << 19)
#define ROW_CHUNK 16 /* rows per task: a decode batch of 32 gives two tasks per weight tile */


/* One row: its absmax m (of x * smooth when smooth is given), and q + 128 into out[0, cols);
 * out[cols, padded) = 128 (zero after the offset). */
static inline void quantize_row(const void *x, int64_t base, int64_t cols, int bf16,
                                const float *smooth, uint8_t *out, int64_t padded,
                                float *row_max) {
    float m = 0.0f;
    if (smooth) {
        for (int64_t c = 0; c < cols; c++) {
            const float v = fabsf(textgate_load(x, base + c, bf16) * smooth[c]);
            m = v > m ? v : m;
        }
    } else {
        for (int64_t c = 0; c < cols; c++) {
            const float v = fabsf(textgate_load(x, base + c, bf16));
            m = v > m ? v : m; /* vectorizes without fast-math, unlike fmaxf */
        }
    }
    m = fmaxf(m, 1e-12f);
    *row_max = m;
    const float inv = (1.0f / m) * 127.0f; /* as torch computes 127 / row_max */
    if (smooth) {
        for (int64_t c = 0; c < cols; c++) {
            const float v = textgate_load(x, base + c, bf16) * smooth[c] * inv;
            out[c] = (uint8_t)(int32_t)(nearbyintf(v) + 128.0f);
        }
    } else {
        for (int64_t c = 0; c < cols; c++) {
            const float v = textgate_load(x, base + c, bf16) * inv;
            out[c] = (uint8_t)(int32_t)(nearbyintf(v) + 128.0f);
        }
    }
    for (int64_t c = cols; c < padded; c++) out[c] = 128;
}

void textgate_quantize_rows(const void *x, uint8_t *out, float *row_max, int64_t rows,
                            int64_t cols, int bf16) {
#pragma omp parallel for schedule(static) if (rows * cols >= GRAIN_SIZE)
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x, r * cols, cols, bf16, NULL, out + r * cols, cols, row_max + r);
}

int textgate_int8_isa(void) { return TEXTGATE_INT8_ISA; }

/* Lane i of the products' int32 sums acc[0, count) of one row and 16 output channels, minus
 * their offsets, scaled, biased and stored to out[0, count) (float, or bf16 rounded to
 * nearest even). */
static inline void finish16(const int32_t *acc, const int32_t *wsum, const float *wscale,
                            const float *bias, float row_max, void *out, int count, int bf16) {
    for (int c = 0; c < count; c++) {
        float v = (float)(acc[c] - wsum[c]) * wscale[c] * row_max;
        if (bias) v += bias[c];
        textgate_store(out, c, v, bf16);
    }
}

#if TEXTGATE_INT8_ISA == 2

/* Lane i of v (float) stored to base[i] for i < count, as float or as bfloat16 rounded to
 * nearest even (what torch's .to(bfloat16) does for finite values). */
static inline void store16(void *base, int64_t index, __m512 v, int count, int bf16) {
    const __mmask16 mask = count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1u);
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)base + index, mask, v);
        return;
    }
    __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
    _mm256_mask_storeu_epi16((uint16_t *)base + index, mask, half);
}

/* MB rows x NB blocks of 16 output channels: MB * NB int32 accumulators in registers. */
static inline __attribute__((always_inline)) void tile(
    const uint8_t *a, int64_t lda, const float *row_max, const int8_t *w, int64_t k4,
    const int32_t *wsum, const float *wscale, const float *bias, void *out, int64_t ldo,
    int64_t n_left, int out_bf16, const int MB, const int NB) {
    __m512i acc[4][4];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_si512();
    for (int64_t kk = 0; kk < k4; kk++) {
        __m512i wv[4];
        for (int j = 0; j < NB; j++) wv[j] = _mm512_loadu_si512(w + (j * k4 + kk) * 64);
        for (int i = 0; i < MB; i++) {
            int32_t four;
            memcpy(&four, a + i * lda + kk * 4, sizeof four);
            const __m512i av = _mm512_set1_epi32(four);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], av, wv[j]);
        }
    }
    for (int j = 0; j < NB; j++) {
        const __m512i offset = _mm512_loadu_si512(wsum + j * 16);
        const __m512 scale = _mm512_loadu_ps(wscale + j * 16);
        const __m512 add = bias ? _mm512_loadu_ps(bias + j * 16) : _mm512_setzero_ps();
        const int64_t left = n_left - j * 16;
        const int count = left >= 16 ? 16 : (int)left;
        for (int i = 0; i < MB; i++) {
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], offset));
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(dot, scale), _mm512_set1_ps(row_max[i]));
            if (bias) v = _mm512_add_ps(v, add);
            store16(out, i * ldo + j * 16, v, count, out_bf16);
        }
    }
}

#elif TEXTGATE_INT8_ISA == 1

#define MAX_NB_AVX2 1

/* MB rows x NB blocks of 16 output channels, two int32 accumulators (8 channels each) per
 * row and block. Per pair of inputs: 16 channels x 2 weights (32 bytes) widened to int16,
 * the row's two activations broadcast as one int32, vpmaddwd adds each channel's two
 * products (at most 2 * 255 * 127: exact) into its lane. */
static inline __attribute__((always_inline)) void tile(
    const uint8_t *a, int64_t lda, const float *row_max, const int8_t *w, int64_t k4,
    const int32_t *wsum, const float *wscale, const float *bias, void *out, int64_t ldo,
    int64_t n_left, int out_bf16, const int MB, const int NB) {
    const int64_t k2 = k4 * 2;
    __m256i acc[4][MAX_NB_AVX2][2];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_si256();
    for (int64_t kk = 0; kk < k2; kk++) {
        __m256i wv[MAX_NB_AVX2][2];
        for (int j = 0; j < NB; j++) {
            const int8_t *block = w + (j * k2 + kk) * 32;
            wv[j][0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)block));
            wv[j][1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 16)));
        }
        for (int i = 0; i < MB; i++) {
            const uint8_t *pair = a + i * lda + kk * 2;
            const __m256i av = _mm256_set1_epi32((int32_t)pair[0] | ((int32_t)pair[1] << 16));
            for (int j = 0; j < NB; j++) {
                acc[i][j][0] = _mm256_add_epi32(acc[i][j][0], _mm256_madd_epi16(av, wv[j][0]));
                acc[i][j][1] = _mm256_add_epi32(acc[i][j][1], _mm256_madd_epi16(av, wv[j][1]));
            }
        }
    }
    for (int j = 0; j < NB; j++) {
        const int64_t left = n_left - j * 16;
        const int count = left >= 16 ? 16 : (int)left;
        for (int i = 0; i < MB; i++) {
            int32_t sums[16];
            _mm256_storeu_si256((__m256i *)sums, acc[i][j][0]);
            _mm256_storeu_si256((__m256i *)(sums + 8), acc[i][j][1]);
            void *o = out_bf16 ? (void *)((uint16_t *)out + i * ldo + j * 16)
                               : (void *)((float *)out + i * ldo + j * 16);
            finish16(sums, wsum + j * 16, wscale + j * 16, bias ? bias + j * 16 : NULL,
                     row_max[i], o, count, out_bf16);
        }
    }
}

#else

/* The same sums in plain C, one block of 16 channels at a time. */
static inline void tile(const uint8_t *a, int64_t lda, const float *row_max, const int8_t *w,
                        int64_t k4, const int32_t *wsum, const float *wscale, const float *bias,
                        void *out, int64_t ldo, int64_t n_left, int out_bf16, const int MB,
                        const int NB) {
    for (int j = 0; j < NB; j++) {
        const int8_t *block = w + j * k4 * 64;
        const int64_t left = n_left - j * 16;
        const int count = left >= 16 ? 16 : (int)left;
        for (int i = 0; i < MB; i++) {
            int32_t sums[16] = {0};
            const uint8_t *row = a + i * lda;
            for (int64_t kk = 0; kk < k4; kk++)
                for (int c = 0; c < 16; c++)
                    for (int q = 0; q < 4; q++)
                        sums[c] += (int32_t)row[kk * 4 + q] * (int32_t)block[kk * 64 + c * 4 + q];
            void *o = out_bf16 ? (void *)((uint16_t *)out + i * ldo + j * 16)
                               : (void *)((float *)out + i * ldo + j * 16);
            finish16(sums, wsum + j * 16, wscale + j * 16, bias ? bias + j * 16 : NULL,
                     row_max[i], o, count, out_bf16);
        }
    }
}

#endif

typedef void (*tile_fn)(const uint8_t *, int64_t, const float *, const int8_t *, int64_t,
                        const int32_t *, const float *, const float *, void *, int64_t, int64_t,
                        int);

#define TILE(MB, NB)                                                                            \
    static void tile_##MB##_##NB(const uint8_t *a, int64_t lda, const float *rm,               \
                                 const int8_t *w, int64_t k4, const int32_t *ws,               \
                                 const float *sc, const float *b, void *o, int64_t ldo,        \
                                 int64_t nl, int bf) {                                         \
        tile(a, lda, rm, w, k4, ws, sc, b, o, ldo, nl, bf, MB, NB);                            \
    }
#if TEXTGATE_INT8_ISA == 1
/* 16 ymm registers: 4 rows x 1 block is 8 accumulators, 2 weight and 1 activation
 * registers (2 blocks would spill). */
#define MAX_NB 1
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1)
static const tile_fn TILES[4][MAX_NB] = {{tile_1_1}, {tile_2_1}, {tile_3_1}, {tile_4_1}};
#else
#define MAX_NB 4
#define TILE_ROW(MB) TILE(MB, 1) TILE(MB, 2) TILE(MB, 3) TILE(MB, 4)
TILE_ROW(1) TILE_ROW(2) TILE_ROW(3) TILE_ROW(4)
static const tile_fn TILES[4][MAX_NB] = {
    {tile_1_1, tile_1_2, tile_1_3, tile_1_4},
    {tile_2_1, tile_2_2, tile_2_3, tile_2_4},
    {tile_3_1, tile_3_2, tile_3_3, tile_3_4},
    {tile_4_1, tile_4_2, tile_4_3, tile_4_4},
};
#endif

/* Output blocks of 16 per task: MAX_NB, halved while that would leave the threads an uneven
 * share of few tasks (a decode row's 36-block o and down projections of SmolLM2: 9 tasks of
 * 4 blocks on 2 threads leave one idle a ninth of the time, 18 tasks of 2 split evenly).
 * Every output sums the same products in the same order whatever the grouping. */
static int64_t blocks_per_task(int64_t n16, int64_t row_chunks, int64_t threads) {
    int64_t nb = MAX_NB;
    while (nb > 1) {
        const int64_t tasks = (n16 + nb - 1) / nb * row_chunks;
        if (tasks % threads == 0 || tasks >= 8 * threads) break;
        nb /= 2;
    }
    return nb;
}

/* x [rows, k] (float32 or bf16) -> out [rows, n] in out's dtype; smooth [k] and bias [n16]
 * may be NULL; packed/wsum/wscale as pack_int8 made them (wsum = 128 * colsum, wscale =
 * s_w / 127, both padded to n16). Returns 0, or -1 when the scratch could not be allocated. */
int textgate_int8_linear(const void *x, int64_t rows, int64_t k, int x_bf16, const float *smooth,
                         const int8_t *packed, const int32_t *wsum, const float *wscale,
                         const float *bias, void *out, int64_t n, int out_bf16) {
    const int64_t k4 = (k + 3) / 4, lda = k4 * 4;
    const int64_t n16 = (n + 15) / 16;
    const int64_t row_chunks = (rows + ROW_CHUNK - 1) / ROW_CHUNK;
    const int parallel = rows * n * k >= GEMM_GRAIN;
    const int64_t task_nb = blocks_per_task(n16, row_chunks, parallel ? omp_get_max_threads() : 1);
    const int64_t num_tiles = (n16 + task_nb - 1) / task_nb;
    uint8_t *a = malloc((size_t)(rows * lda) + 64);
    float *row_max = malloc((size_t)rows * sizeof(float) + 64);
    if (!a || !row_max) {
        free(a);
        free(row_max);
        return -1;
    }
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            quantize_row(x, r * k, k, x_bf16, smooth, a + r * lda, lda, row_max + r);
        /* Consecutive tasks share a weight tile, which stays in cache across its row chunks. */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < num_tiles * row_chunks; task++) {
            const int64_t t = task / row_chunks, chunk = task % row_chunks;
            const int64_t first_block = t * task_nb;
            const int nb = (int)(n16 - first_block < task_nb ? n16 - first_block : task_nb);
            const int8_t *w = packed + first_block * k4 * 64;
            const int64_t n0 = first_block * 16;
            const int64_t end = (chunk + 1) * ROW_CHUNK < rows ? (chunk + 1) * ROW_CHUNK : rows;
            for (int64_t r = chunk * ROW_CHUNK; r < end; r += 4) {
                const int mb = (int)(end - r < 4 ? end - r : 4);
                void *o = out_bf16 ? (void *)((uint16_t *)out + r * n + n0)
                                   : (void *)((float *)out + r * n + n0);
                TILES[mb - 1][nb - 1](a + r * lda, lda, row_max + r, w, k4, wsum + n0,
                                      wscale + n0, bias ? bias + n0 : NULL, o, n, n - n0,
                                      out_bf16);
            }
        }
    }
    free(a);
    free(row_max);
    return 0;
}
