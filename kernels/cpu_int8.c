/*
 * Per-token int8 quantization of a linear layer's input, in one pass (kernels/int8_linear.py
 * quantize_rows is the reference): for each row x of [rows, cols], m = max(max|x|, 1e-12),
 * out = nearbyint(x * ((1 / m) * 127)) + 128 as uint8 (ties to even, as torch.round), row_max = m.
 * The same float operations as the reference, so the bytes match it exactly.
 */

/* Exact float semantics here: the build's -ffast-math may reassociate x * ((1 / m) * 127),
 * which moves values that sit on a rounding tie. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-fast-math")
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>

#define GRAIN_SIZE 32768 /* at::internal::GRAIN_SIZE */

static inline float load_value(const void *base, int64_t i, int bf16) {
    if (!bf16) return ((const float *)base)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

void textgate_quantize_rows(const void *x, uint8_t *out, float *row_max, int64_t rows,
                            int64_t cols, int bf16) {
#pragma omp parallel for schedule(static) if (rows * cols >= GRAIN_SIZE)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * cols;
        float m = 0.0f;
        for (int64_t c = 0; c < cols; c++) {
            const float v = fabsf(load_value(x, base + c, bf16));
            m = v > m ? v : m; /* vectorizes without fast-math, unlike fmaxf */
        }
        m = fmaxf(m, 1e-12f);
        row_max[r] = m;
        const float inv = (1.0f / m) * 127.0f; /* as torch computes 127 / row_max */
        for (int64_t c = 0; c < cols; c++)
            out[base + c] = (uint8_t)(int32_t)(nearbyintf(load_value(x, base + c, bf16) * inv) + 128.0f);
    }
}
