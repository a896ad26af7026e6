/*
 * Dense (float32 or bfloat16) linear layers on the CPU: y = x @ W.T + bias, with W packed once
 * by kernels/dense_linear.py (`pack_dense`) into blocks of 16 output channels,
 *   [N/16][K/P][16][P],   P = 2 for bfloat16 (pairs of inputs), 1 for float32,
 * N padded to 16 and K to P with zeros. The activations and the output are in the weight's
 * dtype; the sums are float32. Each row's sums run over k in the same order whatever rows
 * share its call, so a row's result does not depend on its batch.
 *
 * Which instructions multiply depends on the build's level (kernels/cpu_isa.py) and, for
 * bfloat16, on the CPU at run time:
 *   AVX512 + AVX512-BF16 (checked with __builtin_cpu_supports; TEXTGATE_DENSE_BF16_DOT=0
 *     turns it off): vdpbf16ps, 16 channels x 2 inputs per instruction;
 *   AVX512: 16-lane FMA, bfloat16 pairs widened in registers (a shift, a mask);
 *   AVX2: the same on two 8-lane halves;
 *   portable C: the same sums one by one.
 *
 * Why our own kernel: at decode sizes (1-32 rows) oneDNN's bf16 GEMM read this model's
 * weights at 11-22 GB/s on an AVX512-BF16 Xeon, and the layers' PyTorch calls around each
 * multiply cost about as much again; with this kernel a float model's decoder layers run
 * as one C call per step (cpu_decoder.c), as the int8 ones do.
 */

/* Sums in the order written (the build's -ffast-math would let the plain C path reorder
 * them, and give other bits than the vector paths). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-fast-math")
#endif

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TEXTGATE_DENSE_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TEXTGATE_DENSE_ISA 1
#else
#define TEXTGATE_DENSE_ISA 0
#endif

/* Multiply-adds below which one thread is done sooner than two. */
#define DENSE_GRAIN (1 << 19)
#define DENSE_ROW_CHUNK 16 /* rows per task: a weight tile stays in cache across its chunks */

/* The layout's inputs per packed group: 2 (bfloat16 pairs) or 1 (float32). */
static inline int64_t pair_size(int bf16) { return bf16 ? 2 : 1; }

int textgate_dense_isa(void) { return TEXTGATE_DENSE_ISA; }

#if TEXTGATE_DENSE_ISA == 2

/* Lanes [0, count) of v to base[index...] as float, or as bf16 rounded to nearest even. */
static inline void dense_store16(void *base, int64_t index, __m512 v, int count, int bf16) {
    const __mmask16 mask = count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1u);
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)base + index, mask, v);
        return;
    }
    __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_mask_storeu_epi16((uint16_t *)base + index, mask,
                             _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

static inline void dense_finish(__m512 acc[4][4], const float *bias, void *out, int64_t ldo,
                                int64_t n_left, int bf16, const int MB, const int NB) {
    for (int j = 0; j < NB; j++) {
        const int64_t left = n_left - j * 16;
        const int count = left >= 16 ? 16 : (int)left;
        const __m512 add = bias ? _mm512_loadu_ps(bias + j * 16) : _mm512_setzero_ps();
        for (int i = 0; i < MB; i++)
            dense_store16(out, i * ldo + j * 16, bias ? _mm512_add_ps(acc[i][j], add) : acc[i][j],
                          count, bf16);
    }
}

/* MB rows x NB blocks of 16 channels, float32 weights [K][16] per block. */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t ldx,
                                                           const float *w, int64_t k,
                                                           const float *bias, void *out,
                                                           int64_t ldo, int64_t n_left,
                                                           const int MB, const int NB) {
    __m512 acc[4][4];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        __m512 wv[4];
        for (int j = 0; j < NB; j++) wv[j] = _mm512_loadu_ps(w + (j * k + kk) * 16);
        for (int i = 0; i < MB; i++) {
            const __m512 xv = _mm512_set1_ps(x[i * ldx + kk]);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    dense_finish(acc, bias, out, ldo, n_left, 0, MB, NB);
}

/* bfloat16 weights [K/2][16][2] per block, widened in registers: a pair's first input is
 * the low half of each 32-bit lane (shifted up), its second the high half (masked). The
 * second is added first, as vdpbf16ps does: a product of two bfloat16s is exact in float32,
 * so both paths round the same sums and give the same bits (but for denormals, which
 * vdpbf16ps flushes). */
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, int64_t ldx,
                                                            const uint16_t *w, int64_t k2,
                                                            const float *bias, void *out,
                                                            int64_t ldo, int64_t n_left,
                                                            const int MB, const int NB) {
    const __m512i high = _mm512_set1_epi32((int32_t)0xFFFF0000u);
    __m512 acc[4][4];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k2; kk++) {
        __m512 even[4], odd[4];
        for (int j = 0; j < NB; j++) {
            const __m512i v = _mm512_loadu_si512(w + (j * k2 + kk) * 32);
            even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            odd[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        }
        for (int i = 0; i < MB; i++) {
            const __m512 x0 = _mm512_set1_ps(textgate_bf16_float(x[i * ldx + 2 * kk]));
            const __m512 x1 = _mm512_set1_ps(textgate_bf16_float(x[i * ldx + 2 * kk + 1]));
            for (int j = 0; j < NB; j++)
                acc[i][j] = _mm512_fmadd_ps(x0, even[j], _mm512_fmadd_ps(x1, odd[j], acc[i][j]));
        }
    }
    dense_finish(acc, bias, out, ldo, n_left, 1, MB, NB);
}

/* The same with vdpbf16ps: each instruction adds both products of a pair. */
__attribute__((target("avx512bf16"))) static inline __attribute__((always_inline)) void
tile_bf16_dot(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t k2, const float *bias,
              void *out, int64_t ldo, int64_t n_left, const int MB, const int NB) {
    __m512 acc[4][4];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k2; kk++) {
        __m512bh wv[4];
        for (int j = 0; j < NB; j++)
            wv[j] = (__m512bh)_mm512_loadu_si512(w + (j * k2 + kk) * 32);
        for (int i = 0; i < MB; i++) {
            int32_t pair;
            memcpy(&pair, x + i * ldx + 2 * kk, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    dense_finish(acc, bias, out, ldo, n_left, 1, MB, NB);
}

#define DENSE_MAX_NB 4

#elif TEXTGATE_DENSE_ISA == 1

/* 16 ymm registers: 4 rows x 1 block of 16 channels is 8 accumulators, 2-4 weight and 1-2
 * activation registers. */
#define DENSE_MAX_NB 1

static inline void dense_store8(void *base, int64_t index, __m256 v, int count, int bf16) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    if (count >= 8 && !bf16) {
        _mm256_storeu_ps((float *)base + index, v);
        return;
    }
    for (int c = 0; c < count; c++) textgate_store(base, index + c, lanes[c], bf16);
}

static inline void dense_finish(__m256 acc[4][2], const float *bias, void *out, int64_t ldo,
                                int64_t n_left, int bf16, const int MB) {
    for (int h = 0; h < 2; h++) {
        const int64_t left = n_left - h * 8;
        if (left <= 0) break;
        const int count = left >= 8 ? 8 : (int)left;
        const __m256 add = bias ? _mm256_loadu_ps(bias + h * 8) : _mm256_setzero_ps();
        for (int i = 0; i < MB; i++)
            dense_store8(out, i * ldo + h * 8, bias ? _mm256_add_ps(acc[i][h], add) : acc[i][h],
                         count, bf16);
    }
}

static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t ldx,
                                                           const float *w, int64_t k,
                                                           const float *bias, void *out,
                                                           int64_t ldo, int64_t n_left,
                                                           const int MB, const int NB) {
    (void)NB;
    __m256 acc[4][2];
    for (int i = 0; i < MB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        const __m256 w0 = _mm256_loadu_ps(w + kk * 16), w1 = _mm256_loadu_ps(w + kk * 16 + 8);
        for (int i = 0; i < MB; i++) {
            const __m256 xv = _mm256_set1_ps(x[i * ldx + kk]);
            acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
        }
    }
    dense_finish(acc, bias, out, ldo, n_left, 0, MB);
}

static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, int64_t ldx,
                                                            const uint16_t *w, int64_t k2,
                                                            const float *bias, void *out,
                                                            int64_t ldo, int64_t n_left,
                                                            const int MB, const int NB) {
    (void)NB;
    const __m256i high = _mm256_set1_epi32((int32_t)0xFFFF0000u);
    __m256 acc[4][2];
    for (int i = 0; i < MB; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k2; kk++) {
        __m256 even[2], odd[2];
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + kk * 32 + h * 16));
            even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        }
        for (int i = 0; i < MB; i++) {
            const __m256 x0 = _mm256_set1_ps(textgate_bf16_float(x[i * ldx + 2 * kk]));
            const __m256 x1 = _mm256_set1_ps(textgate_bf16_float(x[i * ldx + 2 * kk + 1]));
            for (int h = 0; h < 2; h++)
                acc[i][h] = _mm256_fmadd_ps(x0, even[h], _mm256_fmadd_ps(x1, odd[h], acc[i][h]));
        }
    }
    dense_finish(acc, bias, out, ldo, n_left, 1, MB);
}

#else

#define DENSE_MAX_NB 1

/* The same sums in plain C, one block of 16 channels: each row's channel c adds its
 * products in k order (a bfloat16 pair's second input first, as above). */
static inline void dense_block(const void *x, int64_t ldx, const void *w, int64_t k,
                               const float *bias, void *out, int64_t ldo, int64_t n_left,
                               int bf16, int MB) {
    const int64_t p = pair_size(bf16), groups = (k + p - 1) / p;
    const int count = n_left >= 16 ? 16 : (int)n_left;
    for (int i = 0; i < MB; i++) {
        float sums[16] = {0};
        for (int64_t g = 0; g < groups; g++)
            for (int q = (int)p - 1; q >= 0; q--) {
                const float xv = textgate_load(x, i * ldx + g * p + q, bf16);
                for (int c = 0; c < 16; c++)
                    sums[c] += xv * textgate_load(w, (g * 16 + c) * p + q, bf16);
            }
        for (int c = 0; c < count; c++)
            textgate_store(out, i * ldo + c, sums[c] + (bias ? bias[c] : 0.0f), bf16);
    }
}

#endif

typedef void (*dense_tile_fn)(const void *, int64_t, const void *, int64_t, const float *,
                              void *, int64_t, int64_t);

#if TEXTGATE_DENSE_ISA == 0
#define DENSE_TILE(NAME, MB, NB)                                                                 \
    static void NAME##_##MB##_##NB(const void *x, int64_t ldx, const void *w, int64_t kp,      \
                                   const float *b, void *o, int64_t ldo, int64_t nl) {         \
        dense_block(x, ldx, w, kp * pair_size(NAME##_bf16), b, o, ldo, nl, NAME##_bf16, MB);   \
    }
static const int f32_bf16 = 0, bf16_bf16 = 1;
#else
#define DENSE_TILE(NAME, MB, NB)                                                                 \
    static void NAME##_##MB##_##NB(const void *x, int64_t ldx, const void *w, int64_t kp,      \
                                   const float *b, void *o, int64_t ldo, int64_t nl) {         \
        tile_##NAME(x, ldx, w, kp, b, o, ldo, nl, MB, NB);                                     \
    }
#endif

#if DENSE_MAX_NB == 1
#define DENSE_TILES(NAME)                                                                        \
    DENSE_TILE(NAME, 1, 1) DENSE_TILE(NAME, 2, 1) DENSE_TILE(NAME, 3, 1) DENSE_TILE(NAME, 4, 1) \
    static const dense_tile_fn NAME##_tiles[4][1] = {                                          \
        {NAME##_1_1}, {NAME##_2_1}, {NAME##_3_1}, {NAME##_4_1}};
#else
#define DENSE_TILE_ROW(NAME, MB)                                                                 \
    DENSE_TILE(NAME, MB, 1) DENSE_TILE(NAME, MB, 2) DENSE_TILE(NAME, MB, 3) DENSE_TILE(NAME, MB, 4)
#define DENSE_TILES(NAME)                                                                        \
    DENSE_TILE_ROW(NAME, 1) DENSE_TILE_ROW(NAME, 2) DENSE_TILE_ROW(NAME, 3)                     \
    DENSE_TILE_ROW(NAME, 4) static const dense_tile_fn NAME##_tiles[4][4] = {                  \
        {NAME##_1_1, NAME##_1_2, NAME##_1_3, NAME##_1_4},                                      \
        {NAME##_2_1, NAME##_2_2, NAME##_2_3, NAME##_2_4},                                      \
        {NAME##_3_1, NAME##_3_2, NAME##_3_3, NAME##_3_4},                                      \
        {NAME##_4_1, NAME##_4_2, NAME##_4_3, NAME##_4_4}};
#endif

DENSE_TILES(f32)
DENSE_TILES(bf16)

#if TEXTGATE_DENSE_ISA == 2
#pragma GCC push_options
#pragma GCC target("avx512bf16")
DENSE_TILES(bf16_dot)
#pragma GCC pop_options
#endif

/* Whether bfloat16 layers multiply with vdpbf16ps here (1), or widen (0). */
int textgate_dense_bf16_dot(void) {
#if TEXTGATE_DENSE_ISA == 2
    static int known = -1;
    if (known < 0) {
        const char *env = getenv("TEXTGATE_DENSE_BF16_DOT");
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512bf16") && !(env != NULL && env[0] == '0');
    }
    return known;
#else
    return 0;
#endif
}

/* Blocks of 16 channels per task: DENSE_MAX_NB, halved while that would leave the threads
 * an uneven share of few tasks. The grouping changes no sum. */
static int64_t dense_blocks_per_task(int64_t n16, int64_t row_chunks, int64_t threads) {
    int64_t nb = DENSE_MAX_NB;
    while (nb > 1) {
        const int64_t tasks = (n16 + nb - 1) / nb * row_chunks;
        if (tasks % threads == 0 || tasks >= 8 * threads) break;
        nb /= 2;
    }
    return nb;
}

/* x [rows, ldx >= k] -> out [rows, n] (both in the weight's dtype: bfloat16 when bf16, else
 * float32), packed as pack_dense made it for k inputs and n outputs, bias [n16 * 16] float32
 * or NULL. k is even for bfloat16. */
void textgate_dense_linear(const void *x, int64_t rows, int64_t k, int64_t ldx,
                           const void *packed, const float *bias, void *out, int64_t n,
                           int bf16) {
    const int64_t p = pair_size(bf16), kp = (k + p - 1) / p, size = bf16 ? 2 : 4;
    const int64_t n16 = (n + 15) / 16;
    const int64_t row_chunks = (rows + DENSE_ROW_CHUNK - 1) / DENSE_ROW_CHUNK;
    const int parallel = rows * n * k >= DENSE_GRAIN;
    const int64_t task_nb =
        dense_blocks_per_task(n16, row_chunks, parallel ? omp_get_max_threads() : 1);
    const int64_t num_tiles = (n16 + task_nb - 1) / task_nb;
    const dense_tile_fn(*tiles)[DENSE_MAX_NB] = bf16 ? bf16_tiles : f32_tiles;
#if TEXTGATE_DENSE_ISA == 2
    if (bf16 && textgate_dense_bf16_dot()) tiles = bf16_dot_tiles;
#endif
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t task = 0; task < num_tiles * row_chunks; task++) {
        const int64_t t = task / row_chunks, chunk = task % row_chunks;
        const int64_t first_block = t * task_nb;
        const int nb = (int)(n16 - first_block < task_nb ? n16 - first_block : task_nb);
        const char *w = (const char *)packed + first_block * kp * p * 16 * size;
        const int64_t n0 = first_block * 16;
        const int64_t end =
            (chunk + 1) * DENSE_ROW_CHUNK < rows ? (chunk + 1) * DENSE_ROW_CHUNK : rows;
        for (int64_t r = chunk * DENSE_ROW_CHUNK; r < end; r += 4) {
            const int mb = (int)(end - r < 4 ? end - r : 4);
            tiles[mb - 1][nb - 1]((const char *)x + r * ldx * size, ldx, w, kp,
                                  bias ? bias + n0 : NULL, (char *)out + (r * n + n0) * size, n,
                                  n - n0);
        }
    }
}
