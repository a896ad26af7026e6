/*
 * A stack of Llama-family decoder layers in one call, their linears int8 (cpu_int8.c) or
 * dense float32/bfloat16 (cpu_dense.c): the same kernels the layers' Python modules call one
 * by one (cpu_layers.c, cpu_attention.c and those), in the same order on the same buffers,
 * so the result is the same bytes. What goes is the Python between them: at decode sizes, a
 * layer's nine calls through PyTorch modules and ctypes cost about as much as reading its
 * weights (docs/quantization.md has the numbers).
 *
 * Per layer, for rows [rows, hidden] of hidden states and the residual stream beside them:
 *   normed, residual = rms_norm(hidden + residual)       (the first layer: rms_norm(hidden))
 *   qkv = normed @ W_qkv;  q = rotate(q), k = rotate(k) -> cache, v -> cache
 *   hidden = attention(q, caches) @ W_o
 *   normed, residual = rms_norm(hidden + residual)
 *   hidden = (silu(normed @ W_gate) * (normed @ W_up)) @ W_down
 */

#include <stdint.h>
#include <string.h>

/* cpu_layers.c, cpu_int8.c, cpu_dense.c, cpu_attention.c */
void textgate_add_rms_norm(const void *x, const void *residual, const void *weight, void *out,
                           void *sum_out, int64_t rows, int64_t hidden, float eps, int bf16);
void textgate_silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int bf16);
void textgate_rotary_and_store(const void *qkv, const void *cos, const void *sin_signed,
                               const int64_t *slot_mapping, void *key_cache, void *value_cache,
                               void *query, int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                               int64_t dim, int bf16);
int textgate_int8_linear(const void *x, int64_t rows, int64_t k, int x_bf16, const float *smooth,
                         const int8_t *packed, const int32_t *wsum, const float *wscale,
                         const float *bias, void *out, int64_t n, int out_bf16);
void textgate_dense_linear(const void *x, int64_t rows, int64_t k, int64_t ldx,
                           const void *packed, const float *bias, void *out, int64_t n, int bf16);
int textgate_paged_attention(const void *query, const void *key_cache, const void *value_cache,
                             void *out, const int64_t *query_starts, const int64_t *query_lens,
                             const int64_t *seq_lens, const int64_t *block_tables,
                             int64_t num_seqs, int64_t max_blocks, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             int64_t max_seq_len, float scale, int64_t window, int bf16,
                             const float *key_scales, const float *value_scales, int kv_kind);

/* One linear: int8 as int8_linear.pack_int8 made it (wsum, wscale; smooth and bias may be
 * NULL), or dense in the activations' dtype as dense_linear.pack_dense made it (bias may be
 * NULL; wsum, wscale and smooth are). */
enum { LINEAR_INT8 = 0, LINEAR_DENSE = 1 };
typedef struct {
    int64_t kind;
    const void *packed;
    const int32_t *wsum;
    const float *wscale;
    const float *bias;
    const float *smooth;
    int64_t in_features, out_features;
} LinearWeights;

/* What one layer keeps: its norms (in the activations' dtype), its four linears, its caches
 * [blocks, block_size, kv_heads, head_dim] and its attention's scale and sliding window. */
typedef struct {
    const void *input_norm, *post_norm;
    float input_eps, post_eps;
    LinearWeights qkv, o, gate_up, down;
    void *key_cache, *value_cache;
    float scale;
    int64_t window;
} DecoderLayer;

/* One step's shapes, rotary tables [rows, head_dim], cache slots, the attention kernel's
 * batch (as CpuAttentionBackend's KernelBatch) and scratch buffers, each [rows, width]. */
typedef struct {
    int64_t rows, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int bf16;
    const void *cos, *sin_signed;
    const int64_t *slot_mapping;
    const int64_t *query_starts, *query_lens, *seq_lens, *block_tables;
    int64_t num_seqs, max_blocks, block_size, max_seq_len;
    void *normed, *qkv, *query, *attended, *gate_up, *activated;
} DecoderStep;

static int linear(const DecoderStep *s, const LinearWeights *w, const void *x, void *out) {
    if (w->kind == LINEAR_DENSE) {
        textgate_dense_linear(x, s->rows, w->in_features, w->in_features, w->packed, w->bias,
                              out, w->out_features, s->bf16);
        return 0;
    }
    return textgate_int8_linear(x, s->rows, w->in_features, s->bf16, w->smooth, w->packed,
                                w->wsum, w->wscale, w->bias, out, w->out_features, s->bf16);
}

/* hidden [rows, hidden] in, the last layer's output out; residual [rows, hidden] is read when
 * has_residual (else the first layer starts it from hidden) and holds the stream after.
 * Returns 0, or the failing kernel's nonzero status (scratch memory ran out). */
int textgate_decoder_layers(const DecoderStep *s, const DecoderLayer *layers, int64_t num_layers,
                            void *hidden, void *residual, int has_residual) {
    const size_t element = s->bf16 ? 2 : 4;
    for (int64_t i = 0; i < num_layers; ++i) {
        const DecoderLayer *layer = layers + i;
        if (i == 0 && !has_residual) {
            textgate_add_rms_norm(hidden, NULL, layer->input_norm, s->normed, NULL, s->rows,
                                  s->hidden, layer->input_eps, s->bf16);
            memcpy(residual, hidden, (size_t)(s->rows * s->hidden) * element);
        } else {
            textgate_add_rms_norm(hidden, residual, layer->input_norm, s->normed, residual,
                                  s->rows, s->hidden, layer->input_eps, s->bf16);
        }
        int failed = linear(s, &layer->qkv, s->normed, s->qkv);
        if (failed) return failed;
        textgate_rotary_and_store(s->qkv, s->cos, s->sin_signed, s->slot_mapping,
                                  layer->key_cache, layer->value_cache, s->query, s->rows,
                                  s->num_heads, s->num_kv_heads, s->head_dim, s->bf16);
        failed = textgate_paged_attention(
            s->query, layer->key_cache, layer->value_cache, s->attended, s->query_starts,
            s->query_lens, s->seq_lens, s->block_tables, s->num_seqs, s->max_blocks,
            s->num_heads, s->num_kv_heads, s->head_dim, s->block_size, s->max_seq_len,
            layer->scale, layer->window, s->bf16, NULL, NULL, 0);
        if (failed) return failed;
        failed = linear(s, &layer->o, s->attended, hidden);
        if (failed) return failed;
        textgate_add_rms_norm(hidden, residual, layer->post_norm, s->normed, residual, s->rows,
                              s->hidden, layer->post_eps, s->bf16);
        failed = linear(s, &layer->gate_up, s->normed, s->gate_up);
        if (failed) return failed;
        textgate_silu_and_mul(s->gate_up, s->activated, s->rows, s->intermediate, s->bf16);
        failed = linear(s, &layer->down, s->activated, hidden);
        if (failed) return failed;
    }
    return 0;
}
