/*
 * bfloat16 <-> float for the C kernels (included by each cpu_*.c): a bf16 is the high half of
 * a float; narrowing rounds to nearest even, as torch's .to(torch.bfloat16) does for finite
 * values.
 */

#ifndef TEXTGATE_CPU_BF16_H
#define TEXTGATE_CPU_BF16_H

#include <stdint.h>
#include <string.h>

static inline uint16_t textgate_bf16_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline float textgate_bf16_float(uint16_t value) {
    const uint32_t bits = (uint32_t)value << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* base[i] as a float; base holds floats, or bf16s when bf16. */
static inline float textgate_load(const void *base, int64_t i, int bf16) {
    return bf16 ? textgate_bf16_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* base[i] = x; base holds floats, or bf16s (x rounded) when bf16. */
static inline void textgate_store(void *base, int64_t i, float x, int bf16) {
    if (bf16)
        ((uint16_t *)base)[i] = textgate_bf16_bits(x);
    else
        ((float *)base)[i] = x;
}

#endif
