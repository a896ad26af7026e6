/*
 * Linear layers over 4-bit codebook weights, as bitsandbytes stores NF4 and FP4
 * (quantization/bitsandbytes.py holds the PyTorch reference and says when this runs).
 *
 * textgate_lut4_linear: out[m][j] = sum_i x[m][i] * w[j][i] (+ bias[j]), where weight j, i is
 * lut[code] * absmax[(j * k + i) / block]: the codes are the [n, k] weight's, flattened and
 * packed two per byte, the first in the high nibble; absmax holds one float per `block`
 * consecutive codes. Sixteen codes at a time become floats with one in-register table lookup
 * (vpermps over the 16-entry codebook), are scaled by their block's absmax and multiplied
 * with up to ROW_TILE rows of x held in registers. x is float32 or bfloat16, out likewise.
 * Needs k % block == 0 and block % 32 == 0 (the caller checks).
 */

#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TEXTGATE_LUT4 1
#else
#define TEXTGATE_LUT4 0
#endif

#define ROW_TILE 4
#define GEMV_GRAIN (1 << 17) /* multiply-adds below which one thread is done sooner */

int textgate_lut4_available(void) { return TEXTGATE_LUT4; }

#if TEXTGATE_LUT4

static inline __m512 load_x(const void *x, int64_t index, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + index);
    const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + index));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}


/* Sixteen weights of output j from 8 bytes of codes: high nibble first, then low. */
static inline __m512 decode16(const uint8_t *codes, __m512 table, float scale) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)codes);
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    const __m128i low = _mm_and_si128(bytes, nibble);
    const __m512i index = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(high, low));
    return _mm512_mul_ps(_mm512_permutexvar_ps(index, table), _mm512_set1_ps(scale));
}

/* Output j for MR rows of x starting at row r. Two accumulators per row, for even and odd
 * groups of 16 inputs: a lone row's chain of dependent multiply-adds is halved. */
static inline __attribute__((always_inline)) void output_tile(
    const void *x, int64_t r, int64_t k, int x_bf16, const uint8_t *codes, const float *absmax,
    int64_t block, __m512 table, float bias, void *out, int64_t n, int64_t j, int out_bf16,
    const int MR) {
    __m512 even[ROW_TILE], odd[ROW_TILE];
    for (int m = 0; m < MR; m++) even[m] = odd[m] = _mm512_setzero_ps();
    for (int64_t start = 0, b = 0; start < k; start += block, b++) {
        const float scale = absmax[b];
        for (int64_t i = start; i < start + block; i += 32) {
            const __m512 w0 = decode16(codes + i / 2, table, scale);
            const __m512 w1 = decode16(codes + i / 2 + 8, table, scale);
            for (int m = 0; m < MR; m++) {
                even[m] = _mm512_fmadd_ps(w0, load_x(x, (r + m) * k + i, x_bf16), even[m]);
                odd[m] = _mm512_fmadd_ps(w1, load_x(x, (r + m) * k + i + 16, x_bf16), odd[m]);
            }
        }
    }
    for (int m = 0; m < MR; m++) {
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m]));
        textgate_store(out, (r + m) * n + j, sum + bias, out_bf16);
    }
}

void textgate_lut4_linear(const void *x, int64_t rows, int64_t k, int x_bf16,
                          const uint8_t *codes, const float *absmax, int64_t block,
                          const float *lut, const float *bias, void *out, int64_t n,
                          int out_bf16) {
    const __m512 table = _mm512_loadu_ps(lut);
    const int64_t blocks_per_row = k / block;
#pragma omp parallel for schedule(static) if (rows * n * k >= GEMV_GRAIN)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row_codes = codes + j * (k / 2);
        const float *row_absmax = absmax + j * blocks_per_row;
        const float b = bias ? bias[j] : 0.0f;
        int64_t r = 0;
        for (; r + ROW_TILE <= rows; r += ROW_TILE)
            output_tile(x, r, k, x_bf16, row_codes, row_absmax, block, table, b, out, n, j,
                        out_bf16, ROW_TILE);
        switch (rows - r) {
        case 3:
            output_tile(x, r, k, x_bf16, row_codes, row_absmax, block, table, b, out, n, j,
                        out_bf16, 3);
            break;
        case 2:
            output_tile(x, r, k, x_bf16, row_codes, row_absmax, block, table, b, out, n, j,
                        out_bf16, 2);
            break;
        case 1:
            output_tile(x, r, k, x_bf16, row_codes, row_absmax, block, table, b, out, n, j,
                        out_bf16, 1);
            break;
        default:
            break;
        }
    }
}

#else

void textgate_lut4_linear(const void *x, int64_t rows, int64_t k, int x_bf16,
                          const uint8_t *codes, const float *absmax, int64_t block,
                          const float *lut, const float *bias, void *out, int64_t n,
                          int out_bf16) {
    (void)x, (void)rows, (void)k, (void)x_bf16, (void)codes, (void)absmax, (void)block;
    (void)lut, (void)bias, (void)out, (void)n, (void)out_bf16;
    /* built without AVX512: textgate_lut4_available() says so first */
}

#endif
