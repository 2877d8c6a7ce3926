/* Attention in which a row's result is the same bits whatever the other rows of the call are.
 *
 * Every sum over keys (the softmax denominator, the weighted values) is a left fold over the row's visible
 * keys in slot order, and every dot product over the head dimension is the same fixed sequence of fused
 * multiply-adds for every (row, key); keys a row may not see contribute nothing. So a row's result depends on
 * its own query and visible keys only: not on the number of rows, on which other rows share the call, or (for
 * a tree) on the masked siblings between its ancestors. Rows are scored and weighed a few at a time (TILE: each key
 * read once for all of them, their independent chains interleaved), each row by its own operations, the same as
 * alone. The max is exact in any order. Loops over lanes have
 * fixed trip counts (no scalar remainders) and multiply-adds are explicit fmaf, so vector and scalar code
 * compute every element alike; compiled without fast-math (models/kernel.py).
 *
 * Layout: the cache is paged (models/paged.py): slot l lives in block l / KEYS of the generation's block table, at
 * row l % KEYS. A block holds KEYS slots of every layer: keys transposed, [layers][kv_heads][d][KEYS], values
 * [layers][kv_heads][KEYS][d]; kb[j] / vb[j] point at block j's layer 0, ``offset`` (floats) selects the layer.
 * Where a block sits changes no operation: every sum runs over slots in slot order, whatever block holds them, so
 * a row's bits do not depend on which blocks hold its keys (shared prompt blocks, a preempted and recomputed
 * answer, blocks reused from other requests). q [n, heads, d]; allowed: NULL (each row sees slots 0..length-1) or
 * [n, padded] bytes, padded = length rounded up to KEYS (zeros past length); out [n, heads, d]. The table holds
 * >= padded / KEYS blocks.
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

/* Query rows scored and weighed together: each key read once for all of them, their chains interleaved. AVX-512's 32
 * vector registers hold 4 rows' accumulators (d = 64); AVX2's 16 hold 2. */
#ifdef __AVX512F__
#define TILE 4
#else
#define TILE 2
#endif
/* Query rows a work item takes from scores to output (several tiles): their scores stay in the cache, and as many
 * rows' softmax sums run side by side (each a left fold of its own). */
#define BLOCK (4 * TILE)

/* acc[j][t] = the dot product of row j's query qs[j] with key l0 + t: for every (row, key) the same sequence of fused
 * multiply-adds over i = 0..d-1 as for that row alone; TILE rows at a time, so the keys are read once and the rows'
 * independent chains fill the multiply-add units. Inlined with a constant d. */
static inline __attribute__((always_inline)) void score_tile(const float *const qs[TILE], const float *restrict keys,
                                                             int d, int nr, float acc[TILE][KEYS]) {
    for (int j = 0; j < nr; j++)
        for (int t = 0; t < KEYS; t++) acc[j][t] = 0.f;
    for (int i = 0; i < d; i++) {
        const float *ki = keys + (int64_t)i * KEYS;
        for (int j = 0; j < nr; j++) {
            const float qi = qs[j][i];
            for (int t = 0; t < KEYS; t++) acc[j][t] = fmaf(qi, ki[t], acc[j][t]);
        }
    }
}

/* o[j] = inv[j] * sum over l of e[j][l] * values[l], for TILE rows: each a left fold of fused multiply-adds over
 * keys in slot order (block by block: values[b] is block b's rows of this head), a key of zero weight skipped for
 * that row (its value may be anything: a masked sibling's), as alone. Inlined with a constant d, the accumulators
 * stay in registers. */
static inline __attribute__((always_inline)) void weigh(const float *const e[TILE], const float *const *values,
                                                        int64_t padded, int d, int nr, const float inv[TILE],
                                                        float *const o[TILE]) {
    float acc[TILE][MAX_D];
    for (int j = 0; j < nr; j++)
        for (int i = 0; i < d; i++) acc[j][i] = 0.f;
    for (int64_t l = 0; l < padded; l++) {
        const float *vl = values[l / KEYS] + (l % KEYS) * d;
        for (int j = 0; j < nr; j++) {
            const float w = e[j][l];
            if (w == 0.f) continue;
            for (int i = 0; i < d; i++) acc[j][i] = fmaf(w, vl[i], acc[j][i]);
        }
    }
    for (int j = 0; j < nr; j++)
        for (int i = 0; i < d; i++) o[j][i] = acc[j][i] * inv[j];
}

/* score_tile and weigh with constant row counts and head dimensions (64 and 128 specialised): one copy each.
 * CALL(D, N): the call with head dimension D and N rows. */
#define BY_D(CALL, N) do { if (d == 64) CALL(64, N); else if (d == 128) CALL(128, N); else CALL(d, N); } while (0)
#if TILE == 4
#define BY_ROWS(CALL) switch (nr) { case 1: BY_D(CALL, 1); break; case 2: BY_D(CALL, 2); break; \
                                    case 3: BY_D(CALL, 3); break; default: BY_D(CALL, 4); }
#else
#define BY_ROWS(CALL) switch (nr) { case 1: BY_D(CALL, 1); break; default: BY_D(CALL, 2); }
#endif

static void score_rows(const float *const qs[TILE], const float *restrict keys, int d, int nr, float acc[TILE][KEYS]) {
#define SCORE(D, N) score_tile(qs, keys, D, N, acc)
    BY_ROWS(SCORE);
#undef SCORE
}

static void weigh_rows(const float *const e[TILE], const float *const *values, int64_t padded, int d, int nr,
                       const float inv[TILE], float *const o[TILE]) {
#define WEIGH(D, N) weigh(e, values, padded, D, N, inv, o)
    BY_ROWS(WEIGH);
#undef WEIGH
}

/* Rotary embedding of the q and k heads of new rows, and their keys and values written into the cache. qkv
 * [n, (heads + 2 kv_heads) d] (q heads, k heads, v heads); cos, sin [n, d]; x·cos + rotate_half(x)·sin, element i:
 * x_i c_i − x_{i+h} s_i below h = d/2, x_i c_i + x_{i−h} s_i above, each product and the sum rounded on its own.
 * Row r goes to slot start + r of the paged cache (kb, vb, offset: the layout above); the rotated queries to
 * q [n, heads, d]. */
void speculate_rope_write(const float *restrict qkv, int n, int heads, int kv_heads, int d,
                          const float *restrict cos, const float *restrict sin, float *const *kb, float *const *vb,
                          int64_t offset, int64_t start, float *restrict q) {
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
                float *keys = kb[(start + r) / KEYS] + offset + (int64_t)(head - heads) * d * KEYS + (start + r) % KEYS;
                for (int i = 0; i < d; i++) keys[(int64_t)i * KEYS] = out[i];
            }
        }
        for (int g = 0; g < kv_heads; g++)
            memcpy(vb[(start + r) / KEYS] + offset + ((int64_t)g * KEYS + (start + r) % KEYS) * d,
                   row + (heads + kv_heads + g) * d, sizeof(float) * d);
    }
}

/* n rows of queries q over the slots of a paged cache (kb, vb, offset: the layout above; n_blocks in its table). */
int speculate_attend(const float *restrict q, const float *const *kb, const float *const *vb, int64_t offset,
                     int64_t n_blocks, const uint8_t *restrict allowed, int n, int heads, int kv_heads, int d,
                     int length, float scaling, float *restrict out, int threads) {
    const int rep = heads / kv_heads, rows = n * rep;
    const int64_t padded = ((int64_t)length + KEYS - 1) / KEYS * KEYS;
    if (padded > n_blocks * KEYS || d > MAX_D || length < 1) return -1;
    int64_t *last = malloc(sizeof(int64_t) * n);
    if (!last) return -2;
    /* The last slot each row may see: key blocks past it are not scored (a causal prefill's upper half). */
    for (int r = 0; r < n; r++) {
        last[r] = length - 1;
        while (allowed && last[r] > 0 && !allowed[(int64_t)r * padded + last[r]]) last[r]--;
    }
    /* Work items: a KV head and a block of its query rows (BLOCK), each from scores to output on its own, so its
     * scores stay in the cache. In parallel (OpenMP, PyTorch's runtime), handed out one at a time: a causal prefill's
     * later rows see more keys. Every value is computed by the same operations whichever thread runs it and
     * whichever rows share its block. */
    const int blocks = (rows + BLOCK - 1) / BLOCK, items = kv_heads * blocks;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1 && (int64_t)rows * padded >= 512)
    {
        float *s = malloc(sizeof(float) * BLOCK * padded); /* this thread's scores, one row of the block each */
        const float **values = malloc(sizeof(float *) * (padded / KEYS + 1)); /* a KV head's rows, block by block */
        if (!s || !values) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            if (!s || !values) continue;
            const int g = item / blocks, b0 = (item % blocks) * BLOCK, nb = rows - b0 < BLOCK ? rows - b0 : BLOCK;
            const int64_t head_keys = offset + (int64_t)g * d * KEYS; /* this KV head's part of a block */
            for (int64_t b = 0; b < padded / KEYS; b++) values[b] = vb[b] + offset + (int64_t)g * KEYS * d;
            /* Key blocks past the item's last visible one are never touched: their scores would be -inf, their
             * weights 0, which add nothing to a sum and are skipped by weigh (the same values as over all). */
            int64_t end = 0;
            for (int r = b0; r < b0 + nb; r++) {
                const int64_t block_end = last[r / rep] / KEYS * KEYS + KEYS;
                end = block_end > end ? block_end : end;
            }
            /* Scores, masked: -inf where a row may not look; TILE rows at a time. */
            for (int r0 = b0; r0 < b0 + nb; r0 += TILE) {
                const int nr = b0 + nb - r0 < TILE ? b0 + nb - r0 : TILE;
                const float *qs[TILE];
                for (int j = 0; j < nr; j++) {
                    const int r = r0 + j;
                    qs[j] = q + ((int64_t)(r / rep) * heads + g * rep + r % rep) * d;
                }
                for (int64_t l0 = 0; l0 < end; l0 += KEYS) {
                    int seen = 0; /* whether any row of the tile may look at this block */
                    for (int j = 0; j < nr; j++) seen |= l0 <= last[(r0 + j) / rep];
                    float acc[TILE][KEYS];
                    if (seen) score_rows(qs, kb[l0 / KEYS] + head_keys, d, nr, acc);
                    for (int j = 0; j < nr; j++) {
                        const int r = r0 + j;
                        float *sj = s + (int64_t)(r - b0) * padded + l0;
                        if (l0 > last[r / rep]) {
                            for (int t = 0; t < KEYS; t++) sj[t] = -INFINITY;
                        } else if (allowed) {
                            const uint8_t *ok = allowed + (int64_t)(r / rep) * padded + l0;
                            for (int t = 0; t < KEYS; t++) sj[t] = ok[t] ? acc[j][t] * scaling : -INFINITY;
                        } else {
                            for (int t = 0; t < KEYS; t++) sj[t] = l0 + t < length ? acc[j][t] * scaling : -INFINITY;
                        }
                    }
                }
            }
            /* Softmax numerators e = exp(s - max) (the max of 8 lanes: exact in any order), then each row's sum, a
             * left fold (the block's rows' independent chains interleaved). */
            float sums[BLOCK];
            for (int j = 0; j < nb; j++) {
                float *sj = s + (int64_t)j * padded, lane[8], m = -INFINITY;
                for (int t = 0; t < 8; t++) lane[t] = -INFINITY;
                for (int64_t l0 = 0; l0 < end; l0 += 8)
                    for (int t = 0; t < 8; t++) lane[t] = sj[l0 + t] > lane[t] ? sj[l0 + t] : lane[t];
                for (int t = 0; t < 8; t++) m = lane[t] > m ? lane[t] : m;
                for (int64_t l0 = 0; l0 < end; l0 += KEYS) exp_block(sj + l0, m);
                sums[j] = 0.f;
            }
            for (int64_t l = 0; l < end; l++)
                for (int j = 0; j < nb; j++) sums[j] += s[(int64_t)j * padded + l];
            /* Weighted values: each output element a left fold of fused multiply-adds over keys of non-zero weight;
             * TILE rows at a time. */
            for (int r0 = b0; r0 < b0 + nb; r0 += TILE) {
                const int nr = b0 + nb - r0 < TILE ? b0 + nb - r0 : TILE;
                const float *e[TILE];
                float inv[TILE], *o[TILE];
                for (int j = 0; j < nr; j++) {
                    const int r = r0 + j;
                    e[j] = s + (int64_t)(r - b0) * padded;
                    inv[j] = 1.f / sums[r - b0];
                    o[j] = out + ((int64_t)(r / rep) * heads + g * rep + r % rep) * d;
                }
                weigh_rows(e, values, end, d, nr, inv, o);
            }
        }
        free(s);
        free(values);
    }
    free(last);
    return failed ? -2 : 0;
}

/* One generation's part of a batched forward (models/fast.py, _Segment): its new rows, where they go in its own
 * cache, what they may see. */
typedef struct segment {
    int rows, length;             /* new rows; the slots they may see (allowed's width, or start + rows) */
    int64_t start, blocks;        /* the slot of the first new row; the blocks in its table */
    const uint8_t *allowed;       /* NULL (every slot below length) or [rows, length padded to KEYS] */
    float *const *kb, *const *vb; /* its block table: each block's keys and values (layout as speculate_attend's) */
    int64_t layer;                /* floats per layer in a block (kv_heads * d * KEYS) */
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
        if ((g->start + g->rows + KEYS - 1) / KEYS > g->blocks) return -1;
        speculate_rope_write(qkv + r0 * width, g->rows, heads, kv_heads, d, cos + r0 * d, sin + r0 * d, g->kb, g->vb,
                             layer * g->layer, g->start, q + r0 * heads * d);
        r0 += g->rows;
    }
    /* Several generations: one each per thread (a generation's KV heads alone are too little work to split); one:
     * its KV heads and stretches of its rows in parallel inside speculate_attend. Either way each value is computed
     * by the same operations. */
    int rc = 0;
    if (threads > 1 && n_segs >= threads) {
        /* (Not an `if` clause on one pragma: a region that runs serially would still be a region, and the KV-head
         * region nested inside speculate_attend would then get one thread.) */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(| : rc)
        for (int s = 0; s < n_segs; s++) {
            const segment_t *g = segs + s;
            rc |= speculate_attend(q + first[s] * heads * d, (const float *const *)g->kb, (const float *const *)g->vb,
                                   layer * g->layer, g->blocks, g->allowed, g->rows, heads, kv_heads, d, g->length,
                                   scaling, out + first[s] * heads * d, 1);
        }
    } else {
        for (int s = 0; s < n_segs && !rc; s++) {
            const segment_t *g = segs + s;
            rc = speculate_attend(q + first[s] * heads * d, (const float *const *)g->kb, (const float *const *)g->vb,
                                  layer * g->layer, g->blocks, g->allowed, g->rows, heads, kv_heads, d, g->length,
                                  scaling, out + first[s] * heads * d, threads);
        }
    }
    return rc;
}
