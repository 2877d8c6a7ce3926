/* A q4 or fp32 model's decoder layers in one call (linked with blocks.c and attention.c): per layer RMSNorm + q/k/v,
 * rotary + cache write, attention, o_proj + residual, RMSNorm + gate/up, SiLU·up + down + residual, each the same
 * function models/fast.py would call from Python (so a row gets the same bits either way), without the Python
 * between them: a decode step of the default model makes 151 kernel calls, and their Python, ~20 µs a layer, was
 * a tenth of the step.
 */
#include <stdint.h>
#include <stdlib.h>

int speculate_block_matmul(int type, const uint8_t *w, int64_t out, int64_t k, const float *x, int64_t rows,
                           const float *norm, float eps, int act, const float *bias, const float *residual, float *y,
                           int64_t ld, int threads, int passes);
typedef struct segment segment_t; /* attention.c's */
int speculate_attention_many(const float *qkv, const float *cos, const float *sin, const segment_t *segs, int n_segs,
                             int layer, int heads, int kv_heads, int d, float scaling, float *q, float *out,
                             int threads);

#define PARTS 4
typedef struct { /* a BlockLinear (or FloatLinear): parts of one type each, side by side in the output columns */
    int parts;
    int types[PARTS];
    const uint8_t *packed[PARTS];
    int64_t rows[PARTS];
    const float *bias;
    int64_t out, k;
    int passes; /* activation rows per row of x (blocks.c) */
} linear_t;

typedef struct {
    const float *ln1, *ln2;
    linear_t qkv, o, gate_up, down;
} layer_t;

static int linear(const linear_t *l, const float *x, int64_t rows, const float *norm, float eps, int act,
                  const float *residual, float *y, int threads) {
    int64_t start = 0;
    for (int p = 0; p < l->parts; p++) {
        const int rc = speculate_block_matmul(l->types[p], l->packed[p], l->rows[p], l->k, x, rows, norm, eps, act,
                                              l->bias ? l->bias + start : NULL, residual ? residual + start : NULL,
                                              y + start, l->out, threads, l->passes);
        if (rc) return rc;
        start += l->rows[p];
    }
    return 0;
}

/* x [n, hidden]: the new rows' embeddings in (the segments' rows one after another), the last layer's output out.
 * cos, sin [n, d]; each segment's rows attend over its own cache (speculate_attention_many). Returns 0 or a
 * kernel's error. */
int speculate_decoder(const layer_t *layers, int n_layers, float *x, int n, int hidden, int heads, int kv_heads,
                      int d, const float *cos, const float *sin, const segment_t *segs, int n_segs, float scaling,
                      float eps, int threads) {
    const int64_t width = (int64_t)(heads + 2 * kv_heads) * d, inner = layers[0].gate_up.out;
    float *qkv = malloc(sizeof(float) * n * width), *q = malloc(sizeof(float) * n * heads * d);
    float *attn = malloc(sizeof(float) * n * heads * d), *x2 = malloc(sizeof(float) * n * hidden);
    float *gate_up = malloc(sizeof(float) * n * inner);
    int rc = !qkv || !q || !attn || !x2 || !gate_up ? -3 : 0;
    for (int i = 0; i < n_layers && !rc; i++) {
        const layer_t *L = layers + i;
        if ((rc = linear(&L->qkv, x, n, L->ln1, eps, 0, NULL, qkv, threads))) break;
        if ((rc = speculate_attention_many(qkv, cos, sin, segs, n_segs, i, heads, kv_heads, d, scaling, q, attn,
                                           threads))) break;
        if ((rc = linear(&L->o, attn, n, NULL, 0.f, 0, x, x2, threads))) break;                /* x2 = x + o(attn) */
        if ((rc = linear(&L->gate_up, x2, n, L->ln2, eps, 0, NULL, gate_up, threads))) break;
        rc = linear(&L->down, gate_up, n, NULL, 0.f, 1, x2, x, threads);                         /* x = x2 + down(..) */
    }
    free(qkv); free(q); free(attn); free(x2); free(gate_up);
    return rc;
}
