/* Attention in which a row's result is the same bits whatever the other rows of the call are.
 *
 * Every sum over keys (the softmax denominator, the weighted values) is a left fold over the row's visible
 * keys in slot order, and every dot product over the head dimension is the same fixed sequence of fused
 * multiply-adds for every (row, key); keys a row may not see contribute nothing. So a row's result depends on
 * its own query and visible keys only: not on the number of rows, on which other rows share the call, or (for
 * a tree) on the masked siblings between its ancestors. The max is exact in any order. Loops over lanes have
 * fixed trip counts (no scalar remainders) and multiply-adds are explicit fmaf, so vector and scalar code
 * compute every element alike; compiled without fast-math (models/kernel.py).
 *
 * Layout: q [n, heads, d]; keys transposed per KV head, kt [kv_heads, d, capacity]; values
 * v [kv_heads, capacity, d]; allowed: NULL (each row sees slots 0..length-1) or [n, padded] bytes, padded =
 * length rounded up to KEYS (zeros past length); out [n, heads, d]. capacity: a multiple of KEYS, >= padded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KEYS 64   /* keys scored at once: one accumulator each */
#define MAX_D 256 /* head dimension limit (the values' accumulator) */

/* b[t] = exp(b[t] - m) for a block of KEYS scores <= m, in plain IEEE arithmetic (Cephes' expf: x = n ln2 + r,
 * a degree-6 polynomial for e^r, 2^n from the exponent bits; within 2 ulp of expf). Unlike libm's expf it
 * vectorizes, and every lane computes the same bits. -inf and anything below -87 give 0 (e^-87 < 2^-125). */
static void exp_block(float *restrict b, float m) {
    float x[KEYS], p[KEYS];
    union { int32_t i[KEYS]; float f[KEYS]; } scale;
    for (int t = 0; t < KEYS; t++) {
        const float y = b[t] - m;
        x[t] = y < -87.f ? -87.f : y;
    }
    for (int t = 0; t < KEYS; t++) scale.i[t] = (int32_t)(x[t] * 1.44269504088896341f - 0.5f); /* round (x <= 0) */
    for (int t = 0; t < KEYS; t++) {
        const float fn = (float)scale.i[t];
        float r = fmaf(fn, -0.693359375f, x[t]);
        r = fmaf(fn, 2.12194440e-4f, r);
        float c = 1.9875691500e-4f;
        c = fmaf(c, r, 1.3981999507e-3f);
        c = fmaf(c, r, 8.3334519073e-3f);
        c = fmaf(c, r, 4.1665795894e-2f);
        c = fmaf(c, r, 1.6666665459e-1f);
        c = fmaf(c, r, 5.0000001201e-1f);
        p[t] = fmaf(c * r, r, r) + 1.f;
    }
    for (int t = 0; t < KEYS; t++) scale.i[t] = (scale.i[t] + 127) << 23;
    for (int t = 0; t < KEYS; t++) b[t] = b[t] - m < -87.f ? 0.f : p[t] * scale.f[t];
}

/* o = inv * sum over l of e[l] * values[l] (a left fold, keys of zero weight skipped). Inlined with a constant d,
 * the accumulator stays in registers. */
static inline __attribute__((always_inline)) void weigh(const float *restrict e, const float *restrict values,
                                                        int64_t padded, int d, float inv, float *restrict o) {
    float acc[MAX_D];
    for (int i = 0; i < d; i++) acc[i] = 0.f;
    for (int64_t l = 0; l < padded; l++) {
        if (e[l] == 0.f) continue;
        const float w = e[l], *vl = values + l * d;
        for (int i = 0; i < d; i++) acc[i] = fmaf(w, vl[i], acc[i]);
    }
    for (int i = 0; i < d; i++) o[i] = acc[i] * inv;
}

/* Rotary embedding of the q and k heads of new rows, and their keys and values written into the cache. qkv
 * [n, (heads + 2 kv_heads) d] (q heads, k heads, v heads); cos, sin [n, d]; x·cos + rotate_half(x)·sin, element i:
 * x_i c_i − x_{i+h} s_i below h = d/2, x_i c_i + x_{i−h} s_i above, each product and the sum rounded on its own.
 * Row r goes to slot start + r of kt [kv_heads, d, capacity] (transposed) and v [kv_heads, capacity, d]; the
 * rotated queries to q [n, heads, d]. */
void speculate_rope_write(const float *restrict qkv, int n, int heads, int kv_heads, int d,
                          const float *restrict cos, const float *restrict sin, float *restrict kt,
                          float *restrict v, int64_t capacity, int64_t start, float *restrict q) {
    const int h = d / 2, width = (heads + 2 * kv_heads) * d;
    for (int r = 0; r < n; r++) {
        const float *row = qkv + (int64_t)r * width, *c = cos + (int64_t)r * d, *s = sin + (int64_t)r * d;
        for (int head = 0; head < heads + kv_heads; head++) {
            const float *x = row + head * d;
            float out[MAX_D];
            for (int i = 0; i < h; i++) out[i] = x[i] * c[i] - x[i + h] * s[i];
            for (int i = h; i < d; i++) out[i] = x[i] * c[i] + x[i - h] * s[i];
            if (head < heads) {
                memcpy(q + ((int64_t)r * heads + head) * d, out, sizeof(float) * d);
            } else {
                float *keys = kt + (int64_t)(head - heads) * d * capacity + start + r;
                for (int i = 0; i < d; i++) keys[(int64_t)i * capacity] = out[i];
            }
        }
        for (int g = 0; g < kv_heads; g++)
            memcpy(v + ((int64_t)g * capacity + start + r) * d, row + (heads + kv_heads + g) * d, sizeof(float) * d);
    }
}

int speculate_attend(const float *restrict q, const float *restrict kt, const float *restrict v, int64_t capacity,
                     const uint8_t *restrict allowed, int n, int heads, int kv_heads, int d, int length,
                     float scaling, float *restrict out, int threads) {
    const int rep = heads / kv_heads, rows = n * rep;
    const int64_t padded = ((int64_t)length + KEYS - 1) / KEYS * KEYS;
    if (padded > capacity || capacity % KEYS || d > MAX_D || length < 1) return -1;
    float *all_scores = malloc(sizeof(float) * kv_heads * rows * padded);
    float *all_sums = malloc(sizeof(float) * kv_heads * rows);
    int64_t *last = malloc(sizeof(int64_t) * n);
    if (!all_scores || !all_sums || !last) { free(all_scores); free(all_sums); free(last); return -2; }
    /* The last slot each row may see: key blocks past it are not scored (a causal prefill's upper half). */
    for (int r = 0; r < n; r++) {
        last[r] = length - 1;
        while (allowed && last[r] > 0 && !allowed[(int64_t)r * padded + last[r]]) last[r]--;
    }
    /* KV heads in parallel (OpenMP, PyTorch's runtime): each has its own buffers and its own rows of out, and every
     * value is computed by the same operations whichever thread runs it. */
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (threads > 1 && kv_heads > 1 && (int64_t)rows * padded >= 512)
    for (int g = 0; g < kv_heads; g++) {
        float *scores = all_scores + (int64_t)g * rows * padded, *sums = all_sums + (int64_t)g * rows;
        const float *keys = kt + (int64_t)g * d * capacity, *values = v + (int64_t)g * capacity * d;
        /* Scores, masked: -inf where a row may not look. */
        for (int64_t l0 = 0; l0 < padded; l0 += KEYS)
            for (int r = 0; r < rows; r++) {
                const float *qr = q + ((int64_t)(r / rep) * heads + g * rep + r % rep) * d;
                float *s = scores + (int64_t)r * padded + l0;
                if (l0 > last[r / rep]) {
                    for (int t = 0; t < KEYS; t++) s[t] = -INFINITY;
                    continue;
                }
                float acc[KEYS];
                for (int t = 0; t < KEYS; t++) acc[t] = 0.f;
                for (int i = 0; i < d; i++) {
                    const float qi = qr[i], *ki = keys + (int64_t)i * capacity + l0;
                    for (int t = 0; t < KEYS; t++) acc[t] = fmaf(qi, ki[t], acc[t]);
                }
                if (allowed) {
                    const uint8_t *ok = allowed + (int64_t)(r / rep) * padded + l0;
                    for (int t = 0; t < KEYS; t++) s[t] = ok[t] ? acc[t] * scaling : -INFINITY;
                } else {
                    for (int t = 0; t < KEYS; t++) s[t] = l0 + t < length ? acc[t] * scaling : -INFINITY;
                }
            }
        /* Softmax numerators e = exp(s - max) (the max of 8 lanes: exact in any order), then each row's sum. */
        for (int r = 0; r < rows; r++) {
            float *s = scores + (int64_t)r * padded, lane[8], m = -INFINITY;
            for (int t = 0; t < 8; t++) lane[t] = -INFINITY;
            for (int64_t l0 = 0; l0 < padded; l0 += 8)
                for (int t = 0; t < 8; t++) lane[t] = s[l0 + t] > lane[t] ? s[l0 + t] : lane[t];
            for (int t = 0; t < 8; t++) m = lane[t] > m ? lane[t] : m;
            for (int64_t l0 = 0; l0 < padded; l0 += KEYS) exp_block(s + l0, m);
        }
        /* Sums left to right, the rows' independent chains interleaved. */
        for (int r = 0; r < rows; r++) sums[r] = 0.f;
        for (int64_t l = 0; l < padded; l++)
            for (int r = 0; r < rows; r++) sums[r] += scores[(int64_t)r * padded + l];
        /* Weighted values: each output element a left fold of fused multiply-adds over keys of non-zero weight. */
        for (int r = 0; r < rows; r++) {
            float *o = out + ((int64_t)(r / rep) * heads + g * rep + r % rep) * d;
            const float *s = scores + (int64_t)r * padded, inv = 1.f / sums[r];
            if (d == 64) weigh(s, values, padded, 64, inv, o);
            else if (d == 128) weigh(s, values, padded, 128, inv, o);
            else weigh(s, values, padded, d, inv, o);
        }
    }
    free(all_scores);
    free(all_sums);
    free(last);
    return 0;
}

/* One generation's part of a batched forward (models/fast.py, _Segment): its new rows, where they go in its own
 * cache, what they may see. */
typedef struct segment {
    int rows, length;             /* new rows; the slots they may see (allowed's width, or start + rows) */
    int64_t start, capacity;      /* the slot of the first new row; the slots of the cache buffers */
    const uint8_t *allowed;       /* NULL (every slot below length) or [rows, length padded to KEYS] */
    float *const *kt, *const *v;  /* per layer: this generation's cache buffers (layout as speculate_attend's) */
} segment_t;

/* One layer's attention for every generation of a batched forward, in one call: each segment's rows (consecutive
 * in qkv, cos, sin, q and out) get rotary, are written into that segment's cache and attend over it. Each row's
 * result is what speculate_rope_write and speculate_attend give it alone. Returns 0 or speculate_attend's error. */
int speculate_attention_many(const float *restrict qkv, const float *restrict cos, const float *restrict sin,
                             const segment_t *segs, int n_segs, int layer, int heads, int kv_heads, int d,
                             float scaling, float *restrict q, float *restrict out, int threads) {
    const int64_t width = (int64_t)(heads + 2 * kv_heads) * d;
    int64_t first[n_segs > 0 ? n_segs : 1];
    int64_t r0 = 0;
    for (int s = 0; s < n_segs; s++) {
        const segment_t *g = segs + s;
        first[s] = r0;
        speculate_rope_write(qkv + r0 * width, g->rows, heads, kv_heads, d, cos + r0 * d, sin + r0 * d, g->kt[layer],
                             g->v[layer], g->capacity, g->start, q + r0 * heads * d);
        r0 += g->rows;
    }
    /* Several generations: one each per thread (a generation's KV heads alone are too little work to split); one:
     * its KV heads in parallel inside speculate_attend. Either way each value is computed by the same operations. */
    int rc = 0;
    if (threads > 1 && n_segs >= threads) {
        /* (Not an `if` clause on one pragma: a region that runs serially would still be a region, and the KV-head
         * region nested inside speculate_attend would then get one thread.) */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(| : rc)
        for (int s = 0; s < n_segs; s++) {
            const segment_t *g = segs + s;
            rc |= speculate_attend(q + first[s] * heads * d, g->kt[layer], g->v[layer], g->capacity, g->allowed,
                                   g->rows, heads, kv_heads, d, g->length, scaling, out + first[s] * heads * d, 1);
        }
    } else {
        for (int s = 0; s < n_segs && !rc; s++) {
            const segment_t *g = segs + s;
            rc = speculate_attend(q + first[s] * heads * d, g->kt[layer], g->v[layer], g->capacity, g->allowed,
                                  g->rows, heads, kv_heads, d, g->length, scaling, out + first[s] * heads * d, threads);
        }
    }
    return rc;
}
