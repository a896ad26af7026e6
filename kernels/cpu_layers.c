/*
 * Fused elementwise layer ops for the CPU: one pass over memory where PyTorch runs several
 * kernels, each row-parallel on torch's OpenMP threads. Each op rounds exactly where its
 * PyTorch reference (named per function) rounds, so bfloat16 results match it bit for bit
 * up to float summation order. Like PyTorch's own elementwise kernels, an op forks threads
 * only from GRAIN_SIZE elements on: a decode step's [32, hidden] rows are done sooner by one
 * thread than by waking a second one (which, on a busy 2-core machine, may be descheduled).
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"

#define GRAIN_SIZE 32768 /* at::internal::GRAIN_SIZE */

/* x rounded to the storage dtype, as a float. */
static inline float round_to(float x, int bf16) {
    return bf16 ? textgate_bf16_float(textgate_bf16_bits(x)) : x;
}

/* layers/norm.py RMSNorm.forward: s = x + residual (or x); out = (s * rsqrt(mean(s^2) + eps))
 * * weight. x, residual, out, sum_out: [rows, hidden]. Without a residual (NULL) the sum is
 * x itself and sum_out is not written. */
void textgate_add_rms_norm(const void *x, const void *residual, const void *weight, void *out,
                           void *sum_out, int64_t rows, int64_t hidden, float eps, int bf16) {
    const void *sum = residual != NULL ? sum_out : x;
#pragma omp parallel for schedule(static) if (rows * hidden >= GRAIN_SIZE)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t base = r * hidden;
        float sumsq = 0.0f;
        for (int64_t i = 0; i < hidden; ++i) {
            float s = textgate_load(x, base + i, bf16);
            if (residual != NULL) {
                s = round_to(s + textgate_load(residual, base + i, bf16), bf16);
                textgate_store(sum_out, base + i, s, bf16);
            }
            sumsq += s * s;
        }
        const float inv = 1.0f / sqrtf(eps + sumsq / (float)hidden);
        for (int64_t i = 0; i < hidden; ++i) {
            float normed = round_to(textgate_load(sum, base + i, bf16) * inv, bf16);
            textgate_store(out, base + i, normed * textgate_load(weight, i, bf16), bf16);
        }
    }
}

/* models/llama.py LlamaMLP: silu(gate) * up, gate_up [rows, 2 * width] -> out [rows, width]. */
void textgate_silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int bf16) {
#pragma omp parallel for schedule(static) if (rows * width >= GRAIN_SIZE)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t in = r * 2 * width, o = r * width;
        for (int64_t i = 0; i < width; ++i) {
            const float g = textgate_load(gate_up, in + i, bf16);
            const float silu = round_to(g / (1.0f + expf(-g)), bf16);
            textgate_store(out, o + i, silu * textgate_load(gate_up, in + width + i, bf16), bf16);
        }
    }
}

/* models/llama.py LlamaAttention: rotate q and k (rotary.apply_rotary_signed), write k and v
 * into their cache slots (KVCache.store) and q into query [rows, num_heads, dim].
 * qkv [rows, (num_heads + 2 num_kv_heads) * dim]; cos, sin_signed [rows, dim];
 * caches [slots, num_kv_heads, dim]. */
void textgate_rotary_and_store(const void *qkv, const void *cos, const void *sin_signed,
                               const int64_t *slot_mapping, void *key_cache, void *value_cache,
                               void *query, int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                               int64_t dim, int bf16) {
    const int64_t half = dim / 2, width = (num_heads + 2 * num_kv_heads) * dim;
#pragma omp parallel for schedule(static) if (rows * width >= GRAIN_SIZE)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slot_mapping[r];
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
            const int64_t in = r * width + h * dim;
            void *dst = h < num_heads ? query : key_cache;
            const int64_t out = h < num_heads ? (r * num_heads + h) * dim
                                              : (slot * num_kv_heads + h - num_heads) * dim;
            for (int64_t i = 0; i < dim; ++i) {
                const float x = textgate_load(qkv, in + i, bf16);
                const float rolled = textgate_load(qkv, in + (i + half) % dim, bf16);
                const float a = round_to(x * textgate_load(cos, r * dim + i, bf16), bf16);
                const float sine = textgate_load(sin_signed, r * dim + i, bf16);
                const float b = round_to(rolled * sine, bf16);
                textgate_store(dst, out + i, a + b, bf16);
            }
        }
        const int64_t v_in = r * width + (num_heads + num_kv_heads) * dim;
        const int64_t v_out = slot * num_kv_heads * dim;
        if (bf16)
            memcpy((uint16_t *)value_cache + v_out, (const uint16_t *)qkv + v_in, 2 * num_kv_heads * dim);
        else
            memcpy((float *)value_cache + v_out, (const float *)qkv + v_in, 4 * num_kv_heads * dim);
    }
}
