/*
 * Groupwise int4 weights, as aten._convert_weight_to_int4pack_for_cpu packs them, expanded to
 * a dense [k, n] matrix for the prompt-sized matmuls where the int4 kernel itself is slow
 * (kernels/int4_linear.py holds the PyTorch reference and says when this runs).
 *
 * The packed layout (for n a multiple of `block`): uint8 [n / block][k][block / 2]; byte j of
 * block b, row i holds the codes of two output columns of that block, low nibble first: j
 * and j + block / 2 when `halves`, else 2j and 2j + 1. torch's layout depends on the CPU
 * (kernels/int4_linear.py reads it off torch: Int4Layout, torch_int4_layout).
 * Column c, input i is worth (code - 8) * scale + zero, with scale and zero
 * at scales_and_zeros[g][c][0] and [1] (bfloat16, g = i / group_size) — what the int4 kernel
 * computes. out[i][c] gets that value rounded to bfloat16 (nearest even).
 */

#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"

#define GRAIN_SIZE 32768 /* at::internal::GRAIN_SIZE */


void textgate_int4_dequantize(const uint8_t *packed, const uint16_t *scales_and_zeros, int64_t n,
                              int64_t k, int64_t group_size, int64_t block, int halves,
                              uint16_t *out) {
    const int64_t blocks = n / block, half = block / 2;
#pragma omp parallel for schedule(static) if (n * k >= GRAIN_SIZE)
    for (int64_t i = 0; i < k; i++) {
        const uint16_t *group = scales_and_zeros + (i / group_size) * n * 2;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *codes = packed + (b * k + i) * half;
            const uint16_t *sz = group + b * block * 2;
            uint16_t *dst = out + i * n + b * block;
            for (int64_t j = 0; j < half; j++) {
                const int64_t lo = halves ? j : 2 * j, hi = halves ? j + half : 2 * j + 1;
                const float low = (float)((codes[j] & 15) - 8), high = (float)((codes[j] >> 4) - 8);
                dst[lo] = textgate_bf16_bits(low * textgate_bf16_float(sz[2 * lo]) +
                                             textgate_bf16_float(sz[2 * lo + 1]));
                dst[hi] = textgate_bf16_bits(high * textgate_bf16_float(sz[2 * hi]) +
                                             textgate_bf16_float(sz[2 * hi + 1]));
            }
        }
    }
}
