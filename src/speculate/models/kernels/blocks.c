/* y = x Wᵀ (+ bias) (+ residual) for W stored in GGUF's own quantized blocks (Q4_0, Q4_1, Q8_0), the rows of x
 * quantized on the fly to int8 per block of 32 (as llama.cpp does for these formats: its Q8_0 / Q8_1).
 *
 * A row's result is the same bits whatever the other rows of the call are, and whatever the number of threads:
 * every (row, output) pair runs the same sequence of operations on its own data. Per block of 32 inputs the
 * weight and activation integers are multiplied and summed exactly in 8 int32 lanes (lane i: elements 4i..4i+3);
 * the lanes are converted to float (exact: |lane| < 2^17), multiplied by the block's scale product and added
 * into one of two 8-lane float accumulators (even blocks, odd blocks); at the end the two are added lane-wise
 * and the 8 lanes summed in one fixed tree. The vector paths (AVX-512 VNNI, AVX-VNNI, AVX2) and the scalar path
 * compute exactly these values: integer sums are exact in any order, and every float operation is a single,
 * separately rounded multiply or add (no contraction: models/kernel.py compiles with -ffp-contract=off), so
 * tests can reproduce the kernel bit for bit in PyTorch ops (tests/test_blocks.py).
 *
 * Formats (ggml-common.h), 32 weights a block, rows of blocks along the input dimension:
 *   Q4_0: fp16 d, 16 bytes of nibbles: w = d (q - 8)        (element j: low nibble of byte j, j+16: high nibble)
 *   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles: w = d q + m
 *   Q8_0: fp16 d, 32 int8: w = d q
 * Activations: per row and block, a = da qa with da = max|x| / 127 and qa = round-half-even(x / da), |qa| <= 127.
 * A block's contribution: Q8_0 (dw da) Σ qw qa; Q4_1 (dw da) Σ qw qa + mw (da Σ qa); Q4_0 as Q4_1 with m = -8 d.
 * The m terms are summed in block order in their own float, added after the lanes.
 *
 * Threads: the outputs are split among OpenMP threads (the runtime PyTorch loaded, so its thread team is reused).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define VECTOR 1
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 }; /* ggml's type numbers */
#define QK 32
#define TILE 4 /* rows computed together: one weight block unpacked, used by each */

static int block_bytes(int type) { return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q8_0 ? 34 : 0; }

static float half_to_float(uint16_t h) {
#ifdef VECTOR
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exp == 0x1f) v.u = sign | 0x7f800000u | (man << 13);
    else if (exp) v.u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) v.u = sign;
    else { v.f = (float)man * 5.9604644775390625e-8f; v.u |= sign; } /* subnormal: man * 2^-24, exact */
    return v.f;
#endif
}

static uint16_t load16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return h; }

/* One row of x: int8 per block, da per block, and sa = da Σ qa (the Q4_1 m term's factor). */
static void quantize_row(const float *restrict x, int64_t k, int8_t *restrict q, float *restrict da,
                         float *restrict sa) {
    for (int64_t b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.f, inv = d != 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            const int v = (int)nearbyintf(xb[j] * inv);
            q[b * QK + j] = (int8_t)v;
            sum += v;
        }
        da[b] = d;
        sa[b] = d * (float)sum;
    }
}

/* The fixed lane-sum tree: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), as the AVX reduction below computes it. */
static float lane_sum(const float l[8]) {
    const float a0 = l[0] + l[4], a1 = l[1] + l[5], a2 = l[2] + l[6], a3 = l[3] + l[7];
    return (a0 + a2) + (a1 + a3);
}

#ifdef VECTOR
/* 8 int32 lanes, lane i = Σ_{p=4i}^{4i+3} u[p] s[p], for u unsigned bytes and s signed bytes (|pair| < 2^15). */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* (l0+l4, l1+l5, l2+l6, l3+l7) */
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));                                          /* (a0+a2, a1+a3, ..) */
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}
#endif

/* Rows r0..r0+nr-1 (nr <= TILE) of one output o. */
static void tile(int type, const uint8_t *restrict wrow, int64_t nb, const int8_t *restrict q,
                 const float *restrict da, const float *restrict sa, int64_t k, int nr, float *out) {
    const int bytes = block_bytes(type);
#ifdef VECTOR
    __m256 acc[TILE][2];
    float mt[TILE];
    for (int r = 0; r < nr; r++) { acc[r][0] = acc[r][1] = _mm256_setzero_ps(); mt[r] = 0.f; }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wrow + b * bytes;
        const float dw = half_to_float(load16(blk));
        __m256i w;
        float mw = 0.f;
        if (type == Q8_0) {
            w = _mm256_loadu_si256((const __m256i *)(blk + 2));
        } else {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (type == Q4_1 ? 4 : 2)));
            const __m128i low = _mm_set1_epi8(0x0f);
            w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
            mw = type == Q4_1 ? half_to_float(load16(blk + 2)) : -8.f * dw;
        }
        const __m256i wabs = type == Q8_0 ? _mm256_sign_epi8(w, w) : w;
        for (int r = 0; r < nr; r++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(q + r * k + b * QK));
            if (type == Q8_0) a = _mm256_sign_epi8(a, w); /* Σ w a = Σ |w| (a · sign w) */
            const __m256 lanes = _mm256_cvtepi32_ps(dot_u8s8(wabs, a));
            const __m256 scale = _mm256_set1_ps(dw * da[r * nb + b]);
            acc[r][b & 1] = _mm256_add_ps(acc[r][b & 1], _mm256_mul_ps(lanes, scale));
            if (type != Q8_0) mt[r] = mt[r] + mw * sa[r * nb + b];
        }
    }
    for (int r = 0; r < nr; r++) out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + mt[r];
#else
    for (int r = 0; r < nr; r++) {
        float acc[2][8] = {{0}}, mt = 0.f;
        const int8_t *qr = q + r * k;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = wrow + b * bytes;
            const float dw = half_to_float(load16(blk));
            int w[QK];
            float mw = 0.f;
            if (type == Q8_0) {
                for (int j = 0; j < QK; j++) w[j] = (int8_t)blk[2 + j];
            } else {
                const uint8_t *qs = blk + (type == Q4_1 ? 4 : 2);
                for (int j = 0; j < 16; j++) { w[j] = qs[j] & 0x0f; w[j + 16] = qs[j] >> 4; }
                mw = type == Q4_1 ? half_to_float(load16(blk + 2)) : -8.f * dw;
            }
            const float scale = dw * da[r * nb + b];
            for (int i = 0; i < 8; i++) {
                int s = 0;
                for (int j = 4 * i; j < 4 * i + 4; j++) s += w[j] * qr[b * QK + j];
                acc[b & 1][i] = acc[b & 1][i] + (float)s * scale;
            }
            if (type != Q8_0) mt = mt + mw * sa[r * nb + b];
        }
        float l[8];
        for (int i = 0; i < 8; i++) l[i] = acc[0][i] + acc[1][i];
        out[r] = lane_sum(l) + mt;
    }
    (void)lane_sum;
#endif
}

/* x [rows, k] fp32 (k a multiple of 32); w: [out] rows of k/32 blocks of ``type``; bias [out] or NULL; residual
 * [rows, out] or NULL (added last: y = residual + (x Wᵀ + bias)); y [rows, out]. Returns 0, or non-zero for an
 * unknown type, a bad k, or no memory. */
int speculate_block_matmul(int type, const uint8_t *restrict w, int64_t out, int64_t k, const float *restrict x,
                           int64_t rows, const float *restrict bias, const float *restrict residual,
                           float *restrict y, int threads) {
    const int bytes = block_bytes(type);
    if (!bytes) return 1;
    if (k <= 0 || k % QK) return 2;
    const int64_t nb = k / QK;
    int8_t *q = aligned_alloc(64, (size_t)((rows * k + 63) / 64 * 64));
    float *da = malloc(sizeof(float) * (size_t)(rows * nb)), *sa = malloc(sizeof(float) * (size_t)(rows * nb));
    if (!q || !da || !sa) { free(q); free(da); free(sa); return 3; }
    for (int64_t r = 0; r < rows; r++) quantize_row(x + r * k, k, q + r * k, da + r * nb, sa + r * nb);
    const int64_t row_bytes = nb * bytes;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && out * rows >= 256)
    for (int64_t o = 0; o < out; o++) {
        float got[TILE];
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            const int nr = rows - r0 < TILE ? (int)(rows - r0) : TILE;
            tile(type, w + o * row_bytes, nb, q + r0 * k, da + r0 * nb, sa + r0 * nb, k, nr, got);
            for (int r = 0; r < nr; r++) {
                float v = got[r];
                if (bias) v = v + bias[o];
                if (residual) v = residual[(r0 + r) * out + o] + v;
                y[(r0 + r) * out + o] = v;
            }
        }
    }
    free(q); free(da); free(sa);
    return 0;
}
