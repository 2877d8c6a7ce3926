/* y = x Wᵀ (+ bias) (+ residual) for W in GGUF's own quantized blocks (Q4_0, Q4_1, Q8_0; Q4_K and Q6_K below, at
 * "K types"), the rows of x quantized
 * on the fly to int8 per block of 32 (as llama.cpp does for these formats: its Q8_0 / Q8_1).
 *
 * A row's result is the same bits whatever the other rows of the call are, and whatever the number of threads:
 * every (row, output) pair runs the same operations on its own data. For each block b of 32 inputs, the integer
 * dot product I_b of the weight and activation integers is exact (Q4_0: Σ q a − 8 Σ a); then, in block order,
 *     acc = acc + (float)I_b · (dw_b · da_b)          (|I_b| < 2^20: the conversion is exact)
 *     mt  = mt  + mw_b · sa_b                          (Q4_1 only; sa_b = da_b · Σ qa)
 * each product and sum a single, separately rounded float operation (compiled with -ffp-contract=off), and
 * y = acc + mt (Q4_1) or acc. The vector paths and the scalar path compute exactly these values, so tests can
 * reproduce the kernel bit for bit in PyTorch ops (tests/test_blocks.py).
 *
 * Formats (ggml-common.h), 32 weights a block, rows of blocks along the input dimension:
 *   Q4_0: fp16 d, 16 bytes of nibbles: w = d (q - 8)        (element j: low nibble of byte j, j+16: high nibble)
 *   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles: w = d q + m
 *   Q8_0: fp16 d, 32 int8: w = d q
 * Activations: per row and block, a = da qa with da = max|x| / 127 and qa = round-half-even(x · 127 / max|x|).
 * With two passes (what dtype q4 runs), the rest x − da qa is quantized the same way into a second row, and a row's
 * result is y = y_first + y_rest: ~16-bit activations, for the cost of one more row of integer dot products (the
 * weights are unpacked once for both). Why: 8-bit activations per block of 32 changed the default model's answers
 * (docs/benchmarks.md, "No precision may break the model").
 *
 * Layout as run: GROUP consecutive outputs interleaved (models/blocks.py, interleave), so that the vector lanes are
 * outputs: per group and block, the GROUP d's (fp16), the GROUP m's (Q4_1), then the quants in units of 4 bytes,
 * unit c of every output in turn (Q4: c = 0..3, bytes 4c..4c+3, whose low nibbles are elements 4c..4c+3 and high
 * nibbles elements 16+4c..; Q8_0: c = 0..7). One multiply-add instruction then takes 4 inputs of GROUP outputs
 * against 4 activation bytes broadcast to every lane. Outputs are padded to a multiple of GROUP with zero blocks.
 *
 * F32 (ggml's type 0: plain float weights, row-major, what dtype fp32 runs; "Float weights" below) takes the same
 * calls without quantizing anything: per (row, output), 16 partial sums in a fixed order, folded in a fixed tree.
 * BF16 (ggml's type 30, what dtype bf16 runs) is the same arithmetic on bfloat16 weights, each widened to the float
 * with the same value (its 16 bits shifted up: exact) as it is loaded: half the bytes read, fp32 sums.
 *
 * Threads: output groups are split among OpenMP threads (the runtime PyTorch loaded, so its thread team is reused).
 * With AMX (Intel's tile unit), Q8_0's integer dots at many rows take tiles instead ("AMX" below): the same
 * integers, the same float steps.
 */
#define _GNU_SOURCE /* clone(): the AMX self-test's process */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define WIDE 1   /* 512-bit vectors: 16 outputs a vector */
#define GROUP 16
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define VECTOR 1 /* 256-bit vectors: 8 outputs a vector */
#define GROUP 8
#else
#define GROUP 8  /* the scalar loops take any group */
#endif

enum { F32 = 0, BF16 = 30, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 }; /* ggml's type numbers */
#define QK 32
#define TILE 4  /* rows computed together: a group's block unpacked once, used by each (8 measured no faster) */

/* While a group's first tile reads a block, the bytes AHEAD further on are asked for (the next blocks, then the next
 * group's: a thread's groups lie one after another). Why: with one or two rows a block costs few instructions, and the
 * out-of-order window alone keeps too few cache misses in flight; the hardware prefetcher did not make up for it
 * (docs/benchmarks.md, "Weights asked for ahead"). A prefetch changes no value, and never faults (an address past
 * the weights is only a hint; uintptr_t arithmetic, so no pointer leaves its object). Later tiles of the group find
 * its blocks in cache and ask for nothing. */
#define AHEAD 4096
static inline __attribute__((always_inline)) void ask_ahead(const uint8_t *p, const int n) {
    for (int o = 0; o < n; o += 64) __builtin_prefetch((const void *)((uintptr_t)p + AHEAD + (uintptr_t)o), 0, 3);
}

/* Bytes a block of 32 per output (the K types: a super-block of 256 per output, see "K types" below). */
static int block_bytes(int type) {
    return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q8_0 ? 34 : type == Q4_K ? 148 : type == Q6_K ? 210 : 0;
}
static int is_k(int type) { return type == Q4_K || type == Q6_K; }
__attribute__((unused)) static int quant_bytes(int type) { return type == Q8_0 ? 32 : 16; }
static int scale_count(int type) { return type == Q4_1 ? 2 : 1; }

int speculate_block_group(void) { return GROUP; }

static float half_to_float(uint16_t h) {
#if defined(VECTOR) || defined(WIDE)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exp == 0x1f) v.u = sign | 0x7f800000u | (man << 13);
    else if (exp) v.u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) v.u = sign;
    else { v.f = (float)man * 5.9604644775390625e-8f; v.u |= sign; } /* subnormal: man · 2^-24, exact */
    return v.f;
#endif
}

/* e^x in plain IEEE arithmetic for SiLU (Cephes' expf, as attention.c's exp_block, over the whole float range:
 * x is clamped to [-87, 88]); unlike libm's expf it vectorizes, and every lane computes the same bits. */
static inline float exp_poly(float x) {
    x = x < -87.f ? -87.f : x > 88.f ? 88.f : x;
    const float fn = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    float c = 1.9875691500e-4f;
    c = c * r + 1.3981999507e-3f;
    c = c * r + 8.3334519073e-3f;
    c = c * r + 4.1665795894e-2f;
    c = c * r + 1.6666665459e-1f;
    c = c * r + 5.0000001201e-1f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)fn + 127) << 23};
    return ((c * r) * r + r + 1.f) * scale.f;
}

/* The layer's input row, before quantization: x itself; with ``norm``, RMSNorm (x · 1/sqrt(mean x² + eps)) · norm,
 * the squares summed left to right; with ``act``, x holds [gate | up] (2k values) and the input is
 * silu(gate) · up = gate / (1 + e^-gate) · up. Each row on its own: no row depends on another. */
static void prepare_row(const float *restrict x, int64_t k, const float *restrict norm, float eps, int act,
                        float *restrict out) {
    if (act) {
        for (int64_t j = 0; j < k; j++) out[j] = x[j] / (1.f + exp_poly(-x[j])) * x[k + j];
    } else if (norm) {
        float ss = 0.f;
        for (int64_t j = 0; j < k; j++) ss = ss + x[j] * x[j];
        const float inv = 1.f / sqrtf(ss / (float)k + eps);
        for (int64_t j = 0; j < k; j++) out[j] = (x[j] * inv) * norm[j];
    } else {
        memcpy(out, x, sizeof(float) * (size_t)k);
    }
}

/* max |x| over a block of 32: exact in any order (a max rounds nothing), so the vector paths take it in lanes.
 * (fmaxf's chain does not vectorize: its NaN rule forbids reordering; a NaN activation is a broken model anyway.) */
static inline float block_amax(const float *restrict xb) {
#if defined(WIDE)
    const __m512 sign = _mm512_set1_ps(-0.f);
    const __m512 a = _mm512_andnot_ps(sign, _mm512_loadu_ps(xb)), b = _mm512_andnot_ps(sign, _mm512_loadu_ps(xb + 16));
    return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
#elif defined(VECTOR)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb));
    for (int j = 8; j < QK; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + j)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
#else
    float amax = 0.f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
    return amax;
#endif
}

/* One row of x: int8 per block, da per block, the block's Σ qa, and sa = da · Σ qa (the offset terms' factor: once
 * per row and block here, not once per output group in the dot loops, where its int-to-float conversion and product
 * cost Q4_1 and Q4_K 3-11 % of a call; docs/benchmarks.md, "the offset terms' factor"). */
static void quantize_row(const float *restrict x, int64_t k, int8_t *restrict q, float *restrict da,
                         int32_t *restrict sums, int32_t *restrict lows, float *restrict sa) {
    for (int64_t b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
        const float amax = block_amax(xb);
        const float inv = amax != 0.f ? 127.f / amax : 0.f;
        int sum = 0, low = 0;
        for (int j = 0; j < QK; j++) {
            const int v = (int)nearbyintf(xb[j] * inv);
            q[b * QK + j] = (int8_t)v;
            sum += v;
            if (j < 16) low += v;
        }
        da[b] = amax / 127.f;
        sums[b] = sum;
        sa[b] = da[b] * (float)sum;
        lows[b] = low; /* Q6_K's scales cover 16 values: Σ qa of the block's first half */
    }
}

#ifdef WIDE
static inline __m512i bcast16(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
#endif

#ifdef VECTOR
/* Per 32-bit lane: Σ of 4 products of unsigned bytes u and signed bytes s, added to acc (|pair| < 2^15). */
static inline __m256i madd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

static inline __m256i bcast4(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }

#if !defined(__AVX512VNNI__) && !defined(__AVXVNNI__)
#define SUM16 1
/* A block of 32 of 4-bit weights w[0..7] (0..15: Q4_0, Q4_1, Q4_K before their offsets) against int8 activations a
 * (|a| <= 127, quantize_row): Σ w a per output. Without VNNI each multiply-add is maddubs (pairs of products, in
 * 16 bits), madd by ones (to 32 bits), add; but a pair is at most 2 · 15 · 127 = 3810 and the block's eight at most
 * 30480 < 2^15, so the eight are added in 16 bits and widened once: the same integers exactly, in 16 instructions
 * instead of 25 (llama.cpp's AVX2 Q4 dot does the same). Q6_K: q6_half below; Q8_0 (a pair up to 32512): no room. */
static inline __m256i q4_block(const __m256i *w, const int8_t *a) {
    __m256i lo = _mm256_maddubs_epi16(w[0], bcast4(a)), hi = _mm256_maddubs_epi16(w[4], bcast4(a + 16));
    for (int c = 1; c < 4; c++) { /* two chains, for the adds' latency */
        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(w[c], bcast4(a + 4 * c)));
        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(w[c + 4], bcast4(a + 16 + 4 * c)));
    }
    return _mm256_madd_epi16(_mm256_add_epi16(lo, hi), _mm256_set1_epi16(1));
}

/* Q6_K's half block (16 weights 0..63, its own scale): a pair of products is at most 2 · 63 · 127 = 16002, so two
 * maddubs results add in 16 bits (<= 32004 < 2^15), and the half's sum is two widenings: 9 instructions, not 12. */
static inline __m256i q6_half(const __m256i *w, const int8_t *a) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], bcast4(a)), _mm256_maddubs_epi16(w[1], bcast4(a + 4)));
    const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], bcast4(a + 8)),
                                         _mm256_maddubs_epi16(w[3], bcast4(a + 12)));
    return _mm256_add_epi32(_mm256_madd_epi16(s01, ones), _mm256_madd_epi16(s23, ones));
}
#endif
#endif

#if defined(WIDE) || defined(VECTOR)
/* The vector paths' operations at the build's width: GROUP lanes of 32 bits (16 with AVX-512, 8 with AVX2). */
#ifdef WIDE
typedef __m512 vf;
typedef __m512i vi;
#define HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define U8S(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define I8S(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define LOADI(p) _mm512_loadu_si512(p)
#define AND(a, b) _mm512_and_si512(a, b)
#define XOR(a, b) _mm512_xor_si512(a, b)
#define OR(a, b) _mm512_or_si512(a, b)
#define SRL16(a, n) _mm512_srli_epi16(a, n)
#define SLL16(a, n) _mm512_slli_epi16(a, n)
#define BYTES(c) _mm512_set1_epi8(c)
#define INTS(c) _mm512_set1_epi32(c)
#define ADDI(a, b) _mm512_add_epi32(a, b)
#define SUBI(a, b) _mm512_sub_epi32(a, b)
#define ZEROI() _mm512_setzero_si512()
#define DOT(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define BCAST(p) bcast16(p)
#define FLOATS(x) _mm512_set1_ps(x)
#define ZEROF() _mm512_setzero_ps()
#define MUL(a, b) _mm512_mul_ps(a, b)
#define ADD(a, b) _mm512_add_ps(a, b)
#define TOF(a) _mm512_cvtepi32_ps(a)
#define NEG(a) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), INTS((int)0x80000000u)))
#define STORE(p, a) _mm512_storeu_ps(p, a)
#define LOADF(p) _mm512_loadu_ps(p)
#define SUBF(a, b) _mm512_sub_ps(a, b)
#define ABSF(a) _mm512_abs_ps(a)
#define HMAXF(a) _mm512_reduce_max_ps(a)
#define ANY_NONFINITE(a) (_mm512_cmp_ps_mask(SUBF(a, a), SUBF(a, a), _CMP_UNORD_Q) != 0) /* inf − inf, NaN: NaN */
#else
typedef __m256 vf;
typedef __m256i vi;
#define HALVES(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define U8S(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define I8S(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define AND(a, b) _mm256_and_si256(a, b)
#define XOR(a, b) _mm256_xor_si256(a, b)
#define OR(a, b) _mm256_or_si256(a, b)
#define SRL16(a, n) _mm256_srli_epi16(a, n)
#define SLL16(a, n) _mm256_slli_epi16(a, n)
#define BYTES(c) _mm256_set1_epi8(c)
#define INTS(c) _mm256_set1_epi32(c)
#define ADDI(a, b) _mm256_add_epi32(a, b)
#define SUBI(a, b) _mm256_sub_epi32(a, b)
#define ZEROI() _mm256_setzero_si256()
#define DOT(acc, u, s) madd(acc, u, s) /* without VNNI: 16-bit pair sums, < 2^15 for the operands used here */
#if !defined(__AVX512VNNI__) && !defined(__AVXVNNI__)
#define SIGNED_Q8 1 /* Q8_0 by |w| · (a · sign w): w + 128 would saturate the 16-bit pair sums */
#endif
#define BCAST(p) bcast4(p)
#define FLOATS(x) _mm256_set1_ps(x)
#define ZEROF() _mm256_setzero_ps()
#define MUL(a, b) _mm256_mul_ps(a, b)
#define ADD(a, b) _mm256_add_ps(a, b)
#define TOF(a) _mm256_cvtepi32_ps(a)
#define NEG(a) _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(a), INTS((int)0x80000000u)))
#define STORE(p, a) _mm256_storeu_ps(p, a)
#define LOADF(p) _mm256_loadu_ps(p)
#define SUBF(a, b) _mm256_sub_ps(a, b)
#define ABSF(a) _mm256_andnot_ps(_mm256_set1_ps(-0.f), a)
#define HMAXF(a) hmax8(a)
#define ANY_NONFINITE(a) (_mm256_movemask_ps(_mm256_cmp_ps(SUBF(a, a), SUBF(a, a), _CMP_UNORD_Q)) != 0)
static inline float hmax8(__m256 a) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}
#endif
#endif

/* One output group, rows 0..nr-1 (nr <= TILE) of the tile: out[r * GROUP + lane]. Always inlined into
 * group_tile's cases, so that type and nr are constants there: no branches in the loop, accumulators in registers. */
static inline __attribute__((always_inline)) void
tile_body(const int type, const uint8_t *restrict wg, int64_t nb, const int8_t *restrict q,
          const float *restrict da, const int32_t *restrict sums, const float *restrict sa, int64_t k, const int nr,
          const int ahead, float *out) {
    const int bytes = block_bytes(type), ns = scale_count(type);
#if defined(WIDE) || defined(VECTOR)
    const int64_t unit = 4 * GROUP; /* bytes of one unit of 4 quants for every output */
    vf acc[TILE], mt[TILE];
    for (int r = 0; r < nr; r++) acc[r] = mt[r] = ZEROF();
    const vi low = BYTES(0x0f);
#ifndef SIGNED_Q8
    const vi flip = BYTES((char)0x80);
#endif
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * GROUP * bytes, *qs = blk + 2 * ns * GROUP;
        if (ahead) ask_ahead(blk, GROUP * bytes);
        const vf dw = HALVES(blk), mw = type == Q4_1 ? HALVES(blk + 2 * GROUP) : ZEROF();
        vi w[8];
#ifdef SIGNED_Q8
        vi wabs[8];
#endif
        if (type == Q8_0) {
            for (int c = 0; c < 8; c++) {
#ifdef SIGNED_Q8
                w[c] = LOADI(qs + c * unit);
                wabs[c] = _mm256_sign_epi8(w[c], w[c]);
#else
                w[c] = XOR(LOADI(qs + c * unit), flip); /* w + 128 as unsigned bytes: Σ w a = Σ (w + 128) a − 128 Σ a */
#endif
            }
        } else {
            for (int c = 0; c < 4; c++) {
                const vi raw = LOADI(qs + c * unit);
                w[c] = AND(raw, low);                 /* elements 4c..4c+3 */
                w[c + 4] = AND(SRL16(raw, 4), low);   /* elements 16+4c.. */
            }
        }
        for (int r = 0; r < nr; r++) {
            const int8_t *a = q + r * k + b * QK;
            const int64_t ab = r * nb + b;
            /* Two independent chains of multiply-adds (a block's first and second half), added at the end: integer
             * sums, so exact in any order, and the chains' latencies overlap. */
            vi lo = ZEROI(), hi = ZEROI(), isum;
            if (type == Q8_0) {
#ifdef SIGNED_Q8
                for (int c = 0; c < 4; c++) {
                    lo = DOT(lo, wabs[c], _mm256_sign_epi8(BCAST(a + 4 * c), w[c]));
                    hi = DOT(hi, wabs[c + 4], _mm256_sign_epi8(BCAST(a + 16 + 4 * c), w[c + 4]));
                }
                isum = ADDI(lo, hi);
#else
                for (int c = 0; c < 4; c++) {
                    lo = DOT(lo, w[c], BCAST(a + 4 * c));
                    hi = DOT(hi, w[c + 4], BCAST(a + 16 + 4 * c));
                }
                isum = SUBI(ADDI(lo, hi), INTS(128 * sums[ab]));
#endif
            } else {
#ifdef SUM16
                isum = q4_block(w, a);
#else
                for (int c = 0; c < 4; c++) {
                    lo = DOT(lo, w[c], BCAST(a + 4 * c));
                    hi = DOT(hi, w[c + 4], BCAST(a + 16 + 4 * c));
                }
                isum = ADDI(lo, hi);
#endif
                if (type == Q4_0) isum = SUBI(isum, INTS(8 * sums[ab]));
            }
            acc[r] = ADD(acc[r], MUL(TOF(isum), MUL(dw, FLOATS(da[ab]))));
            if (type == Q4_1) mt[r] = ADD(mt[r], MUL(mw, FLOATS(sa[ab])));
        }
    }
    for (int r = 0; r < nr; r++) STORE(out + r * GROUP, type == Q4_1 ? ADD(acc[r], mt[r]) : acc[r]);
#else
    (void)ahead; /* (the scalar loops: no prefetch) */
    const int qb = quant_bytes(type);
    for (int r = 0; r < nr; r++) {
        for (int lane = 0; lane < GROUP; lane++) {
            float acc = 0.f, mt = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = wg + b * GROUP * bytes, *qs = blk + 2 * ns * GROUP;
                const int8_t *a = q + r * k + b * QK;
                uint16_t h;
                memcpy(&h, blk + 2 * lane, 2);
                const float dw = half_to_float(h);
                int32_t isum = 0;
                for (int c = 0; c < qb / 4; c++) {
                    const uint8_t *u = qs + (c * GROUP + lane) * 4;
                    for (int j = 0; j < 4; j++) {
                        if (type == Q8_0) isum += (int8_t)u[j] * a[4 * c + j];
                        else isum += (u[j] & 0x0f) * a[4 * c + j] + (u[j] >> 4) * a[16 + 4 * c + j];
                    }
                }
                if (type == Q4_0) isum -= 8 * sums[r * nb + b];
                acc = acc + (float)isum * (dw * da[r * nb + b]);
                if (type == Q4_1) {
                    memcpy(&h, blk + 2 * (GROUP + lane), 2);
                    mt = mt + half_to_float(h) * sa[r * nb + b];
                }
            }
            out[r * GROUP + lane] = type == Q4_1 ? acc + mt : acc;
        }
    }
#endif
}

/* AMX (Intel's tile unit, where the CPU has AMX-INT8 and the OS lets this process use it: speculate_amx_enable) for
 * Q8_0 (the default model's LM head) at AMX_MIN activation rows and more: per output group and block, one tile
 * instruction (TDPBSSD) makes the integer dots I_b of up to AMX_ROWS rows and the group's 16 outputs. An integer dot
 * is exact whatever instruction sums it, so I_b is the VNNI loop's integer, and the float steps after it are
 * tile_body's, in its order: the same bits, by construction (tests/test_blocks.py compares both with the
 * arithmetic). The weights' layout is already the tile's: a block's unit c (4 inputs of each of the 16 outputs, 64
 * bytes) is row c of the weights' tile. Slots are read AMX_ROWS at a time: qrows pads them with zeros, whose results
 * are not used. Measured (docs/benchmarks.md, "AMX for the LM head"): the head's call 1.5-1.7x faster from 8 rows;
 * the Q4 layers not (their nibbles need unpacking into a tile, and a block's sums must leave the tile for their
 * own scale every 32 inputs), so they keep the VNNI loops. */
#if defined(WIDE) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define AMX 1
#define AMX_ROWS 16
#define AMX_MIN 8 /* activation rows from which a call takes the tile unit */
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static int amx_on; /* speculate_amx_enable's verdict */

typedef struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

/* The tiles' shapes, loaded by each thread at the start of its share of a call (amx_share). A thread's configuration
 * is not ours to keep between calls: another library's AMX code in the same thread (oneDNN's bf16 matmuls, in
 * PyTorch) loads its own and releases it, and a tile instruction without one is an illegal instruction. */
static void amx_configure(void) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = AMX_ROWS, c.colsb[0] = 64; /* 0: sums, AMX_ROWS slots × 16 int32 */
    c.rows[4] = AMX_ROWS, c.colsb[4] = QK; /* 4: AMX_ROWS slots × a block's 32 int8 */
    c.rows[6] = QK / 4, c.colsb[6] = 64;   /* 6: weights, 8 rows of 4 inputs × 16 outputs */
    _tile_loadconfig(&c);
}

/* One tile product against known integers: whether this CPU, hypervisor and kernel run AMX as documented. */
static int amx_selftest(void) {
    int8_t a[AMX_ROWS][QK], b[QK / 4][64];
    int32_t c[AMX_ROWS][16];
    for (int i = 0; i < AMX_ROWS; i++)
        for (int j = 0; j < QK; j++) a[i][j] = (int8_t)((i * 7 + j * 3) % 255 - 127);
    for (int i = 0; i < QK / 4; i++)
        for (int j = 0; j < 64; j++) b[i][j] = (int8_t)((i * 11 + j * 5) % 16);
    amx_configure();
    _tile_zero(0);
    _tile_loadd(4, a, QK);
    _tile_loadd(6, b, 64);
    _tile_dpbsud(0, 4, 6);
    _tile_stored(0, c, 64);
    _tile_release();
    for (int r = 0; r < AMX_ROWS; r++)
        for (int n = 0; n < 16; n++) {
            int32_t s = 0;
            for (int j = 0; j < QK; j++) s += a[r][j] * (uint8_t)b[j / 4][4 * n + j % 4];
            if (s != c[r][n]) return 0;
        }
    return 1;
}

/* The self-test's own process (speculate_amx_enable): the tile state asked for, then one product. SIGILL back to its
 * default first: the handler table is a copy of this process's (Python's faulthandler would report a crash that is
 * not). */
static int amx_child(void *unused) {
    (void)unused;
    signal(SIGILL, SIG_DFL);
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return 2;
    return amx_selftest() ? 0 : 3;
}

/* Whether the tile path runs in this process: the first call runs the self-test in a child process (a hypervisor
 * that advertises AMX but does not enable it kills with SIGILL: the child dies, not this process), then asks the
 * kernel for the tile state (ARCH_REQ_XCOMP_PERM); later calls reuse that verdict. The child shares this process's
 * memory while this one waits (CLONE_VM | CLONE_VFORK), on a stack of its own: a fork would mark every page
 * copy-on-write, and the first write to each after it would fault. ``off``: the path off (SPECULATE_NO_AMX, the tests'
 * other code path); a later call may turn it on again. */
int speculate_amx_enable(int off) {
    static int verdict = -1; /* -1: not asked yet */
    if (off) return amx_on = 0;
    if (verdict < 0) {
        const size_t size = 1 << 18;
        char *stack = malloc(size);
        const pid_t child = stack ? clone(amx_child, stack + size, CLONE_VM | CLONE_VFORK | SIGCHLD, NULL) : -1;
        int status = 0;
        verdict = child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0
                  && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
        free(stack);
    }
    return amx_on = verdict;
}

/* One output group of Q8_0 against slots 0..nr-1 (nr <= AMX_ROWS): per block, the sums' tile zeroed, the slots'
 * and the weights' tiles loaded, their dot, the sums stored; then tile_body's float steps for Q8_0, in its order. */
static void amx_tile(const uint8_t *restrict wg, int64_t nb, const int8_t *restrict q, const float *restrict da,
                     int64_t k, int nr, int ahead, float *out) {
    const int bytes = block_bytes(Q8_0);
    vf acc[AMX_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = ZEROF();
    _Alignas(64) int32_t c[AMX_ROWS][16];
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * GROUP * bytes, *qs = blk + 2 * GROUP;
        if (ahead) ask_ahead(blk, GROUP * bytes);
        _tile_zero(0);
        _tile_loadd(4, q + b * QK, k);
        _tile_loadd(6, qs, 4 * GROUP);
        _tile_dpbssd(0, 4, 6);
        _tile_stored(0, c, 64);
        const vf dw = HALVES(blk);
        for (int r = 0; r < nr; r++)
            acc[r] = ADD(acc[r], MUL(TOF(_mm512_load_si512(c[r])), MUL(dw, FLOATS(da[r * nb + b]))));
    }
    for (int r = 0; r < nr; r++) STORE(out + r * GROUP, acc[r]);
}
#else
#define AMX_ROWS 1
int speculate_amx_enable(int off) { (void)off; return 0; }
#endif

/* A thread's share of a call that runs tiles of ``rows`` (tile_rows) begins with its tile configuration loaded, and
 * ends with the tiles released (a thread holding tile state makes every context switch save 8 KB more). */
static inline void amx_share(int rows, int begin) {
#ifdef AMX
    if (rows != AMX_ROWS) return;
    if (begin) amx_configure();
    else _tile_release();
#else
    (void)rows, (void)begin;
#endif
}

/* K types (llama.cpp's k-quants), as run: per group and super-block of 256 inputs (8 blocks of 32), for Q4_K the
 * GROUP d's and dmin's (fp16), each block's 6-bit scale and min per output (8 × GROUP bytes each, unpacked from
 * the file's 12), and per block the nibbles in Q4_1's order (low: elements 0-15, high: 16-31), units of 4 bytes as
 * above; w = (d · sc) q − (dmin · m). For Q6_K the GROUP d's, 16 int8 scales per output (one per 16 inputs), per
 * block the low 4 bits in Q4_1's order and the high 2 bits (two words per output: byte i of word h holds the high
 * bits of elements 8h+i, 16+8h+i, 8h+4+i, 16+8h+4+i in bits 0-1, 2-3, 4-5, 6-7); w = (d · sc) (q − 32). The same
 * integer dots, then per block acc = acc + (float)I · ((d · sc) · da) and (Q4_K) mt = mt + (−(dmin · m)) · sa; Q6_K's
 * two halves of a block each add their own term, first half first. */
static inline float negate(float x) { union { float f; uint32_t u; } v = {x}; v.u ^= 0x80000000u; return v.f; }

__attribute__((unused)) static void k_scalar(int type, const uint8_t *restrict wg, int64_t nb, const int8_t *restrict q,
                     const float *restrict da, const int32_t *restrict sums, const int32_t *restrict lows,
                     const float *restrict sa, int64_t k,
                     int nr, float *out) {
    const int64_t rec = (int64_t)block_bytes(type) * GROUP, G = GROUP;
    for (int r = 0; r < nr; r++) {
        for (int lane = 0; lane < GROUP; lane++) {
            float acc = 0.f, mt = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *base = wg + (b / 8) * rec;
                const int j = (int)(b % 8);
                const int8_t *a = q + r * k + b * QK;
                const int64_t ab = r * nb + b;
                uint16_t h;
                memcpy(&h, base + 2 * lane, 2);
                const float d = half_to_float(h);
                if (type == Q4_K) {
                    memcpy(&h, base + 2 * G + 2 * lane, 2);
                    const float dmin = half_to_float(h);
                    const float dw = d * (float)base[4 * G + j * G + lane];
                    const float mw = negate(dmin * (float)base[12 * G + j * G + lane]);
                    const uint8_t *qs = base + 20 * G + j * 16 * G;
                    int32_t isum = 0;
                    for (int c = 0; c < 4; c++) {
                        const uint8_t *u = qs + (c * G + lane) * 4;
                        for (int i = 0; i < 4; i++) isum += (u[i] & 0x0f) * a[4 * c + i] + (u[i] >> 4) * a[16 + 4 * c + i];
                    }
                    acc = acc + (float)isum * (dw * da[ab]);
                    mt = mt + mw * sa[ab];
                } else {
                    const float dlo = d * (float)(int8_t)base[2 * G + 2 * j * G + lane];
                    const float dhi = d * (float)(int8_t)base[2 * G + (2 * j + 1) * G + lane];
                    const uint8_t *ql = base + 18 * G + j * 16 * G, *qh = base + 146 * G + j * 8 * G;
                    int32_t ilo = 0, ihi = 0;
                    for (int c = 0; c < 4; c++) {
                        const uint8_t *u = ql + (c * G + lane) * 4, *hw = qh + ((c >> 1) * G + lane) * 4;
                        for (int i = 0; i < 4; i++) {
                            const int lo2 = c & 1 ? (hw[i] >> 4) & 3 : hw[i] & 3;
                            const int hi2 = c & 1 ? (hw[i] >> 6) & 3 : (hw[i] >> 2) & 3;
                            ilo += ((u[i] & 0x0f) | lo2 << 4) * a[4 * c + i];
                            ihi += ((u[i] >> 4) | hi2 << 4) * a[16 + 4 * c + i];
                        }
                    }
                    ilo -= 32 * lows[ab];
                    ihi -= 32 * (sums[ab] - lows[ab]);
                    acc = acc + (float)ilo * (dlo * da[ab]);
                    acc = acc + (float)ihi * (dhi * da[ab]);
                }
            }
            out[r * GROUP + lane] = type == Q4_K ? acc + mt : acc;
        }
    }
}

#if defined(WIDE) || defined(VECTOR)
/* The K types with outputs in the lanes: the same values as k_scalar. */
static inline __attribute__((always_inline)) void
k_vec(const int type, const uint8_t *restrict wg, int64_t nb, const int8_t *restrict q, const float *restrict da,
      const int32_t *restrict sums, const int32_t *restrict lows, const float *restrict sa, int64_t k, const int nr,
      const int ahead, float *out) {
    const int64_t rec = (int64_t)block_bytes(type) * GROUP, G = GROUP, unit = 4 * GROUP;
    vf acc[TILE], mt[TILE];
    for (int r = 0; r < nr; r++) acc[r] = mt[r] = ZEROF();
    const vi low = BYTES(0x0f), two = BYTES(0x30);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *base = wg + (b / 8) * rec;
        const int j = (int)(b % 8);
        if (ahead) ask_ahead(base + j * (rec / 8), (int)(rec / 8)); /* the super-block's eighth per block */
        const vf d = HALVES(base);
        vf dw, dw2 = ZEROF(), mw = ZEROF();
        vi w[8];
        if (type == Q4_K) {
            dw = MUL(d, U8S(base + 4 * G + j * G));
            mw = NEG(MUL(HALVES(base + 2 * G), U8S(base + 12 * G + j * G)));
            const uint8_t *qs = base + 20 * G + j * 16 * G;
            for (int c = 0; c < 4; c++) {
                const vi raw = LOADI(qs + c * unit);
                w[c] = AND(raw, low);
                w[c + 4] = AND(SRL16(raw, 4), low);
            }
        } else {
            dw = MUL(d, I8S(base + 2 * G + 2 * j * G));
            dw2 = MUL(d, I8S(base + 2 * G + (2 * j + 1) * G));
            const uint8_t *ql = base + 18 * G + j * 16 * G, *qh = base + 146 * G + j * 8 * G;
            for (int c = 0; c < 4; c++) {
                const vi raw = LOADI(ql + c * unit), hq = LOADI(qh + (c >> 1) * unit);
                const vi lo2 = c & 1 ? AND(hq, two) : AND(SLL16(hq, 4), two);
                const vi hi2 = c & 1 ? AND(SRL16(hq, 2), two) : AND(SLL16(hq, 2), two);
                w[c] = OR(AND(raw, low), lo2);
                w[c + 4] = OR(AND(SRL16(raw, 4), low), hi2);
            }
        }
        for (int r = 0; r < nr; r++) {
            const int8_t *a = q + r * k + b * QK;
            const int64_t ab = r * nb + b;
#ifdef SUM16
            vi ilo, ihi; /* (Q4_K: the block's whole sum in ilo, ihi zero) */
            if (type == Q4_K) ilo = q4_block(w, a), ihi = ZEROI();
            else ilo = q6_half(w, a), ihi = q6_half(w + 4, a + 16);
#else
            vi ilo = ZEROI(), ihi = ZEROI();
            for (int c = 0; c < 4; c++) {
                ilo = DOT(ilo, w[c], BCAST(a + 4 * c));
                ihi = DOT(ihi, w[c + 4], BCAST(a + 16 + 4 * c));
            }
#endif
            const vf dab = FLOATS(da[ab]);
            if (type == Q4_K) {
                acc[r] = ADD(acc[r], MUL(TOF(ADDI(ilo, ihi)), MUL(dw, dab)));
                mt[r] = ADD(mt[r], MUL(mw, FLOATS(sa[ab])));
            } else {
                ilo = SUBI(ilo, INTS(32 * lows[ab]));
                ihi = SUBI(ihi, INTS(32 * (sums[ab] - lows[ab])));
                acc[r] = ADD(acc[r], MUL(TOF(ilo), MUL(dw, dab)));
                acc[r] = ADD(acc[r], MUL(TOF(ihi), MUL(dw2, dab)));
            }
        }
    }
    for (int r = 0; r < nr; r++) STORE(out + r * GROUP, type == Q4_K ? ADD(acc[r], mt[r]) : acc[r]);
}
#endif

/* Float weights (F32): W as PyTorch holds it, [out][k] row-major (no copy: the lean path hands over the model's own
 * fused weights). The arithmetic, per (row r, output o), on the prepared row x (prepare_row: the norm or SiLU·up
 * applied; nothing quantized), k a multiple of 16:
 *     s_l = fma(w[o][j], x[j], s_l)   for j = l, l + 16, l + 32, ... < k, in that order, l = 0..15, from s_l = +0
 *     y   = ((((s_0 + s_8) + (s_4 + s_12)) + ((s_2 + s_10) + (s_6 + s_14))) + (((s_1 + s_9) + ...)))
 * i.e. the 16 partial sums folded in halves: t_i = s_i + s_(i+8), then t_i + t_(i+4), then + (i+2), then + (i+1);
 * each fma rounded once (fmaf, the same single rounding as the vector instructions) and each sum once. The 16
 * sums are the lanes of one 512-bit vector (two 256-bit ones with AVX2, 16 floats in the scalar loop), so every
 * path computes the same values; nothing depends on the other rows or the thread count; tests/test_blocks.py
 * reproduces them in float64 (a product of two floats is exact there). Tiles of FT rows and FO outputs: each
 * weight vector is read once for FT rows, and FT · FO independent chains hide the fma latency. BF16 weights: w[o][j]
 * is the bfloat16 value widened to float (exact), so a BF16 layer computes bit for bit what F32 computes on its
 * weights widened. */
#if defined(WIDE)
#define F32_WIDE 1
#define FO 4
#define FT 4
#elif defined(VECTOR) && defined(__FMA__)
#define F32_VECTOR 1
#define FO 2
#define FT 2 /* 8 accumulators, 4 row and 2 weight vectors: 14 of AVX2's 16 registers (4 rows spill) */
#else
#define FO 1
#define FT 4
#endif
#define FB (32 / FO) /* output tiles a thread takes together: blocks of 32 outputs */

#if defined(F32_VECTOR)
/* The tree's last three steps on i + (i+8) (the two 8-lane halves of the 16 sums, added): + (i+4), + (i+2), + (i+1). */
static inline float fold8(__m256 a) {
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* + (i+4) */
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                                  /* + (i+2) */
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));                        /* + (i+1) */
}
#endif
#if defined(F32_WIDE)
/* The tree for four outputs at once (a, b, c, d: their 16 sums): halves of each (i + (i+8), then + (i+4)), then a
 * 4 × 4 transpose puts their lanes side by side for the last two steps, (u_0 + u_2) + (u_1 + u_3): the four
 * results. */
static inline __m128 fold16x4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m128 f[4];
    const __m512 v[4] = {a, b, c, d};
    for (int i = 0; i < 4; i++) {
        const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v[i]),
                                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[i]), 1)));
        f[i] = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    }
    _MM_TRANSPOSE4_PS(f[0], f[1], f[2], f[3]);
    return _mm_add_ps(_mm_add_ps(f[0], f[2]), _mm_add_ps(f[1], f[3]));
}
#endif

/* 16 (8: w16, w8; one: wf) weights from element i of w: fp32 as they are, or bf16 (half) widened exactly. */
#if defined(F32_WIDE)
static inline __m512 w16(const void *w, int64_t i, const int half) {
    if (!half) return _mm512_loadu_ps((const float *)w + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif defined(F32_VECTOR)
static inline __m256 w8(const void *w, int64_t i, const int half) {
    if (!half) return _mm256_loadu_ps((const float *)w + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#else
static inline float wf(const void *w, int64_t i, const int half) {
    if (!half) return ((const float *)w)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

#if defined(F32_WIDE) || defined(F32_VECTOR)
/* While a tile's weights stream in, the next tile's (the next FO outputs: the following bytes, row-major) are asked
 * for, a slice per step of 16 inputs, so each is fetched once, a tile ahead. Why: the out-of-order window alone
 * keeps too few cache misses in flight once each weight costs more instructions (BF16's widening): measured on
 * 212-425 MB of a 3072 × 576 layer's copies, one row, BF16 read 11 GB/s without it and 18 with it, F32 19 and 22. */
static inline __attribute__((always_inline)) void
prefetch_next_tile(const void *w, int64_t k, int64_t j, const int half) {
    const int esz = half ? 2 : 4;
    const char *next = (const char *)w + (int64_t)FO * k * esz;
    for (int p = 0; p < FO * 16 * esz; p += 64) _mm_prefetch(next + j * FO * esz + p, _MM_HINT_T0);
}
#endif

static inline __attribute__((always_inline)) void
float_body(const void *restrict w, const float *restrict x, int64_t k, const int no, const int nr, const int half,
           float *out) {
#if defined(F32_WIDE)
    __m512 acc[FO][FT];
    for (int o = 0; o < no; o++)
        for (int r = 0; r < nr; r++) acc[o][r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) {
        __m512 xv[FT];
        prefetch_next_tile(w, k, j, half);
        for (int r = 0; r < nr; r++) xv[r] = _mm512_loadu_ps(x + r * k + j);
        for (int o = 0; o < no; o++) {
            const __m512 wv = w16(w, o * k + j, half);
            for (int r = 0; r < nr; r++) acc[o][r] = _mm512_fmadd_ps(wv, xv[r], acc[o][r]);
        }
    }
    for (int o = no; o < FO; o++)
        for (int r = 0; r < nr; r++) acc[o][r] = _mm512_setzero_ps(); /* (a short tile's missing outputs) */
    for (int r = 0; r < nr; r++) _mm_storeu_ps(out + r * FO, fold16x4(acc[0][r], acc[1][r], acc[2][r], acc[3][r]));
#elif defined(F32_VECTOR)
    __m256 lo[FO][FT], hi[FO][FT]; /* lanes 0-7 and 8-15 of the 16 sums */
    for (int o = 0; o < no; o++)
        for (int r = 0; r < nr; r++) lo[o][r] = hi[o][r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) {
        __m256 xl[FT], xh[FT];
        prefetch_next_tile(w, k, j, half);
        for (int r = 0; r < nr; r++) xl[r] = _mm256_loadu_ps(x + r * k + j), xh[r] = _mm256_loadu_ps(x + r * k + j + 8);
        for (int o = 0; o < no; o++) {
            const __m256 wl = w8(w, o * k + j, half), wh = w8(w, o * k + j + 8, half);
            for (int r = 0; r < nr; r++) {
                lo[o][r] = _mm256_fmadd_ps(wl, xl[r], lo[o][r]);
                hi[o][r] = _mm256_fmadd_ps(wh, xh[r], hi[o][r]);
            }
        }
    }
    for (int o = 0; o < no; o++)
        for (int r = 0; r < nr; r++) out[r * FO + o] = fold8(_mm256_add_ps(lo[o][r], hi[o][r]));
#else
    for (int o = 0; o < no; o++) {
        for (int r = 0; r < nr; r++) {
            float s[16] = {0.f};
            for (int64_t j = 0; j < k; j += 16)
                for (int l = 0; l < 16; l++) s[l] = fmaf(wf(w, o * k + j + l, half), x[r * k + j + l], s[l]);
            for (int step = 8; step >= 1; step /= 2) /* (the fold: + 8, + 4, + 2, + 1) */
                for (int l = 0; l < step; l++) s[l] = s[l] + s[l + step];
            out[r * FO + o] = s[0];
        }
    }
#endif
}

/* float_body with constant output and row counts and weight type: one specialised copy each (accumulators in
 * registers). */
static void float_tile(const void *restrict w, const float *restrict x, int64_t k, int no, int nr, int half,
                       float *out) {
#define FCASE(O, R)                                                                                                   \
    case O * 8 + R:                                                                                                   \
        if (half) float_body(w, x, k, O, R, 1, out);                                                                  \
        else float_body(w, x, k, O, R, 0, out);                                                                       \
        break;
#if FT == 4
#define FROWS(O) FCASE(O, 1) FCASE(O, 2) FCASE(O, 3) FCASE(O, 4)
#else
#define FROWS(O) FCASE(O, 1) FCASE(O, 2)
#endif
    switch (no * 8 + nr) {
#if FO == 4
    FROWS(1) FROWS(2) FROWS(3) FROWS(4)
#elif FO == 2
    FROWS(1) FROWS(2)
#else
    FROWS(1)
#endif
    default: break;
    }
#undef FROWS
#undef FCASE
}

/* tile_body with constant type and row count: one specialised copy each. */
static void group_tile(int type, const uint8_t *restrict wg, int64_t nb, const int8_t *restrict q,
                       const float *restrict da, const int32_t *restrict sums, const int32_t *restrict lows,
                       const float *restrict sa, int64_t k, int nr, int ahead, float *out) {
#define CASE(T, N) case T * 16 + N: tile_body(T, wg, nb, q, da, sums, sa, k, N, ahead, out); break;
#if TILE == 8
#define ROWS(T) CASE(T, 1) CASE(T, 2) CASE(T, 3) CASE(T, 4) CASE(T, 5) CASE(T, 6) CASE(T, 7) CASE(T, 8)
#else
#define ROWS(T) CASE(T, 1) CASE(T, 2) CASE(T, 3) CASE(T, 4)
#endif
#if defined(WIDE) || defined(VECTOR)
#define KCASE(T, N) case T * 16 + N: k_vec(T, wg, nb, q, da, sums, lows, sa, k, N, ahead, out); break;
#if TILE == 8
#define KROWS(T) KCASE(T, 1) KCASE(T, 2) KCASE(T, 3) KCASE(T, 4) KCASE(T, 5) KCASE(T, 6) KCASE(T, 7) KCASE(T, 8)
#else
#define KROWS(T) KCASE(T, 1) KCASE(T, 2) KCASE(T, 3) KCASE(T, 4)
#endif
    switch (type * 16 + nr) { ROWS(Q4_0) ROWS(Q4_1) ROWS(Q8_0) KROWS(Q4_K) KROWS(Q6_K) default: break; }
#undef KROWS
#undef KCASE
#else
    if (is_k(type)) { k_scalar(type, wg, nb, q, da, sums, lows, sa, k, nr, out); return; }
    switch (type * 16 + nr) { ROWS(Q4_0) ROWS(Q4_1) ROWS(Q8_0) default: break; }
#endif
#undef ROWS
#undef CASE
}

/* A tile's results into y: got[r · width + i] is row r0 + r (with two passes, rows r and r + 1 are one row's two
 * results, added first) and output o0 + i, i < n; then the bias, then the residual, each one rounding:
 * y = residual + ((y_row + y_rest) + bias). */
static inline void finish(const float *got, int width, int nr, int passes, int64_t o0, int n, int64_t r0,
                          const float *bias, const float *residual, float *y, int64_t ld) {
    for (int r = 0; r < nr; r += passes) {
        const int64_t yr = (r0 + r) / passes;
        for (int i = 0; i < n; i++) {
            const int64_t o = o0 + i;
            float v = got[r * width + i];
            if (passes == 2) v = v + got[(r + 1) * width + i];
            if (bias) v = v + bias[o];
            if (residual) v = residual[yr * ld + o] + v;
            y[yr * ld + o] = v;
        }
    }
}

/* Quantized rows of k inputs, side by side: quantize_row's outputs for slot i at q + i · k and at i · nb of the
 * per-block arrays. One set of buffers for what the block matmul and the argmax head quantize. */
typedef struct { int8_t *q; float *da, *sa; int32_t *sums, *lows; int64_t k, nb; } qrows;

static void qrows_free(qrows *b) { free(b->q); free(b->da); free(b->sa); free(b->sums); free(b->lows); }

/* n slots of k inputs, for tiles of ``step`` slots (tile_rows); 0, or 3 (no memory: nothing left allocated). */
static int qrows_new(qrows *b, int64_t n, int64_t k, int step) {
    /* (q: whole tiles of ``step`` slots, for the tile path's loads of AMX_ROWS slots at once; zero past slot n, whose
     * results are not used) */
    const size_t blocks = (size_t)(n * (k / QK)), padded = (size_t)((n + step - 1) / step * step);
    *b = (qrows){malloc(padded * (size_t)k), malloc(sizeof(float) * blocks), malloc(sizeof(float) * blocks),
                 malloc(sizeof(int32_t) * blocks), malloc(sizeof(int32_t) * blocks), k, k / QK};
    if (b->q) memset(b->q + n * k, 0, (padded - (size_t)n) * (size_t)k);
    if (b->q && b->da && b->sa && b->sums && b->lows) return 0;
    qrows_free(b);
    return 3;
}

/* Row x quantized into slot i. */
static void qrows_put(const qrows *b, int64_t i, const float *restrict x) {
    const int64_t at = i * b->nb;
    quantize_row(x, b->k, b->q + i * b->k, b->da + at, b->sums + at, b->lows + at, b->sa + at);
}

/* Row x into slot i, and the second pass's row into slot j: what slot i missed, rest = x − da · qa per element
 * (``rest``: k floats, left holding it). */
static void qrows_put_two(const qrows *b, int64_t i, int64_t j, const float *restrict x, float *restrict rest) {
    qrows_put(b, i, x);
    const int8_t *q = b->q + i * b->k;
    const float *da = b->da + i * b->nb;
    for (int64_t e = 0; e < b->k; e++) rest[e] = x[e] - da[e / QK] * (float)q[e];
    qrows_put(b, j, rest);
}

/* group_tile of the group at wg against slots r0..r0+nr-1; ``ahead``: ask for the bytes after its blocks (AHEAD), as
 * a group's first tile in a pass over all groups does. */
static inline void qrows_tile(int type, const uint8_t *restrict wg, const qrows *b, int64_t r0, int nr, int ahead,
                              float *got) {
    const int64_t at = r0 * b->nb;
    group_tile(type, wg, b->nb, b->q + r0 * b->k, b->da + at, b->sums + at, b->lows + at, b->sa + at, b->k, nr, ahead,
               got);
}

/* The activation rows a tile takes for ``type`` and n slots: AMX_ROWS where the tile unit runs them (AMX above),
 * else TILE. */
static inline int tile_rows(int type, int64_t n) {
#ifdef AMX
    if (amx_on && n >= AMX_MIN && type == Q8_0) return AMX_ROWS;
#else
    (void)type, (void)n;
#endif
    return TILE;
}

/* qrows_tile, or the tile unit's amx_tile where ``rows`` (tile_rows) says so. */
static inline void qrows_run(int type, const uint8_t *restrict wg, const qrows *b, int64_t r0, int nr, int rows,
                             int ahead, float *got) {
#ifdef AMX
    if (rows == AMX_ROWS) {
        const int64_t at = r0 * b->nb;
        amx_tile(wg, b->nb, b->q + r0 * b->k, b->da + at, b->k, nr, ahead, got);
        return;
    }
#endif
    (void)rows;
    qrows_tile(type, wg, b, r0, nr, ahead, got);
}

/* speculate_block_matmul for F32 or BF16 weights (``half``; row-major, k a multiple of 16): the rows prepared, then
 * "Float weights" above, tiles of FO outputs split among the threads, then y = residual + (x Wᵀ + bias) as for the
 * blocks. */
static int float_matmul(const uint8_t *restrict w, int half, int64_t out, int64_t k, const float *restrict x,
                        int64_t rows, const float *norm, float eps, int act, const float *bias, const float *residual,
                        float *y, int64_t ld, int threads) {
    if (k <= 0 || k % 16) return 2;
    if (rows <= 0) return 0; /* (nothing to compute; aligned_alloc of 0 bytes may give NULL) */
    /* 64-byte aligned (k % 16 == 0: every row too): a vector load then never spans two cache lines (malloc's
     * 16-byte alignment cost ~20 % at 16 rows) */
    float *prepared = aligned_alloc(64, sizeof(float) * (size_t)(rows * k));
    if (!prepared) return 3;
    /* (each row on its own: the same bits on any thread; many rows' SiLU was a serial tenth of the call) */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * k >= 16384)
    for (int64_t r = 0; r < rows; r++) prepare_row(x + r * k * (act ? 2 : 1), k, norm, eps, act, prepared + r * k);
    const int64_t tiles = (out + FO - 1) / FO, blocks = (tiles + FB - 1) / FB;
    /* Per thread, FB output tiles at a time (their weights stay in L2) against FT rows at a time (in L1). */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tiles * rows >= 64)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t r0 = 0; r0 < rows; r0 += FT) {
            const int nr = rows - r0 < FT ? (int)(rows - r0) : FT;
            for (int64_t t = b * FB; t < tiles && t < (b + 1) * FB; t++) {
                const int no = out - t * FO < FO ? (int)(out - t * FO) : FO;
                float got[FT * FO];
                float_tile(w + t * FO * k * (half ? 2 : 4), prepared + r0 * k, k, no, nr, half, got);
#ifdef F32_WIDE
                if (no == FO) { /* finish's operations, four outputs a vector */
                    for (int r = 0; r < nr; r++) {
                        const int64_t at = (r0 + r) * ld + t * FO;
                        __m128 v = _mm_loadu_ps(got + r * FO);
                        if (bias) v = _mm_add_ps(v, _mm_loadu_ps(bias + t * FO));
                        if (residual) v = _mm_add_ps(_mm_loadu_ps(residual + at), v);
                        _mm_storeu_ps(y + at, v);
                    }
                    continue;
                }
#endif
                finish(got, FO, nr, 1, t * FO, no, r0, bias, residual, y, ld);
            }
        }
    }
    free(prepared);
    return 0;
}

/* RMSNorm of each row of x [rows, k] into out (not x): prepare_row's arithmetic, the squares summed left to right, so
 * a row's bits are the same whatever rows share the call, on any CPU, by construction. The final norm of a model the
 * block path runs (models/fast.py, LeanModel._final_norm), where PyTorch's rms_norm cost ~0.2 ms of a decode step
 * (docs/benchmarks.md, "Around the forward, cold"). */
void speculate_rms_rows(const float *restrict x, int64_t rows, int64_t k, const float *restrict norm, float eps,
                        float *restrict out) {
    for (int64_t r = 0; r < rows; r++) prepare_row(x + r * k, k, norm, eps, 0, out + r * k);
}

/* x [rows, k] fp32 (k a multiple of 32; [rows, 2k] with ``act``), prepared as prepare_row says (``norm`` [k] or
 * NULL, ``eps``, ``act`` 0/1); w: the interleaved layout of [out] rows of ``type``; bias [out] or NULL; residual
 * [rows, ld] or NULL (y = residual + (x Wᵀ + bias)); y [rows, ld], columns 0..out-1 written (``ld``: the row
 * stride of y and residual, >= out: a layer of parts of several types writes each part's columns). ``passes``: 1, each
 * row quantized once (llama.cpp's Q8 activations), or 2, the row and then what its quantization missed (``rest`` =
 * x − da · qa per element), each through the same integer dots, y = y_row + y_rest (see the top of this file).
 * F32 and BF16 quantize nothing (``passes`` unused; row-major weights, k a multiple of 16). Returns 0, or non-zero
 * for an unknown type, a bad k, a bad ``passes``, or no memory. */
int speculate_block_matmul(int type, const uint8_t *restrict w, int64_t out, int64_t k, const float *restrict x,
                           int64_t rows, const float *norm, float eps, int act, const float *bias,
                           const float *residual, float *y, int64_t ld, int threads, int passes) {
    if (type == F32 || type == BF16)
        return float_matmul(w, type == BF16, out, k, x, rows, norm, eps, act, bias, residual, y, ld, threads);
    const int bytes = block_bytes(type);
    if (!bytes) return 1;
    if (k <= 0 || k % (is_k(type) ? 8 * QK : QK)) return 2;
    if (passes != 1 && passes != 2) return 4;
    /* Quantized rows: passes per row of x, side by side (row r's at r · passes, its rest's next to it). */
    const int64_t nb = k / QK, groups = (out + GROUP - 1) / GROUP, n = rows * passes;
    qrows qr;
    /* Each row prepared and quantized on its own (its own scratch: 2k floats), so the rows are split among the threads
     * when there are many: the same bits on any thread. (Serial, they were ~5 % of a 32-row step, with the other
     * thread waiting.) */
    const int step = tile_rows(type, n);
    float *scratch = malloc(sizeof(float) * (size_t)(2 * k * rows));
    if (!scratch || qrows_new(&qr, n, k, step)) { free(scratch); return 3; }
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows >= 4 && rows * k >= 4096)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t h = r * passes; /* the row's first quantized row */
        float *row = scratch + 2 * k * r, *rest = row + k;
        prepare_row(x + r * k * (act ? 2 : 1), k, norm, eps, act, row);
        if (passes == 2) qrows_put_two(&qr, h, h + 1, row, rest); /* what the first missed: ~16 bits a block in all */
        else qrows_put(&qr, h, row);
    }
    free(scratch);
    const int64_t group_bytes = (is_k(type) ? nb / 8 : nb) * GROUP * bytes;
#pragma omp parallel num_threads(threads) if (threads > 1 && groups * n >= 32)
    {
        amx_share(step, 1);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            float got[(AMX_ROWS > TILE ? AMX_ROWS : TILE) * GROUP];
            for (int64_t r0 = 0; r0 < n; r0 += step) { /* TILE and AMX_ROWS are even: a row's passes share a tile */
                const int nr = n - r0 < step ? (int)(n - r0) : step;
                qrows_run(type, w + g * group_bytes, &qr, r0, nr, step, r0 == 0, got);
                finish(got, GROUP, nr, passes, g * GROUP, out - g * GROUP < GROUP ? (int)(out - g * GROUP) : GROUP, r0,
                       bias, residual, y, ld);
            }
        }
        amx_share(step, 0);
    }
    qrows_free(&qr);
    return 0;
}

/* speculate_block_argmax's bound on one group's first-pass values v[0..n-1] of one row (l1g: the group's [S][GROUP]
 * segment sums, a: the row's 1.01 A_s): with B_i = Σ_s a_s · l1g[s][i] + 2^-20 |v_i|, *hi = max_i (v_i + B_i) and
 * *lo = max_i (v_i − B_i). Returns whether some v_i is not finite. The vector paths compute the same values lane by
 * lane (the same operations in the same order), a group at a time where it is whole. */
static inline int margins(const float *restrict v, const float *restrict l1g, const float *restrict a, int64_t S,
                          int64_t n, float *hi, float *lo) {
#if defined(WIDE) || defined(VECTOR)
    if (n == GROUP) {
        vf b = ZEROF();
        for (int64_t s = 0; s < S; s++) b = ADD(b, MUL(FLOATS(a[s]), LOADF(l1g + s * GROUP)));
        const vf x = LOADF(v), bo = ADD(b, MUL(FLOATS(0x1p-20f), ABSF(x)));
        *hi = HMAXF(ADD(x, bo));
        *lo = HMAXF(SUBF(x, bo));
        return ANY_NONFINITE(x);
    }
#endif
    int flag = 0;
    *hi = *lo = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        float b = 0.f;
        for (int64_t s = 0; s < S; s++) b = b + a[s] * l1g[s * GROUP + i];
        const float bo = b + 0x1p-20f * fabsf(v[i]);
        *hi = v[i] + bo > *hi ? v[i] + bo : *hi;
        *lo = v[i] - bo > *lo ? v[i] - bo : *lo;
        flag |= !isfinite(v[i]);
    }
    return flag;
}

/* Greedy decoding's LM head (issue 41): of a row's logits, exactly those that may be its greatest; every other one
 * -inf. The argmax (its first index where several tie) is then the full call's, by construction, on any CPU.
 *
 * With two passes a logit is y = y_row + y_rest (finish: one rounding), where y_row is the first pass's value, the
 * same bits as a one-pass call's. For the types whose blocks scale integers without an offset term (Q4_0, Q8_0,
 * Q6_K), y_rest = Σ_j w_j · r_j over the de-quantized weights w_j and the rest's values r_j = da · qa (the integer
 * dots exact), and |r_j| <= A_b, the largest |rest| of j's block b. The blocks fall into S segments (block b in
 * segment b · S / nb); with A_s the largest A_b of segment s and l1[o][s] = Σ_{j in s} |w_oj| (given by the caller),
 * |y_rest| <= Σ_s A_s · l1[o][s]. The float products and sums add at most a relative (1 + 2^-24)^(blocks + S + 3) to
 * that (< 1.0001 below 10,000 blocks), and y's own rounding u · |y_row + y_rest|. So with
 *     B_o = Σ_s (1.01 · A_s) · l1[o][s] + 2^-20 · |y_row_o|   and   T = max_o (y_row_o − B_o),
 * every o with y_row_o + B_o < T has y_o < T <= max y: it can be neither the argmax nor tied with it. Only the
 * groups of GROUP outputs that hold some other o run their second pass, per row (the same group_tile calls on the
 * same integers as the full call, so each such y_o is the full call's bits); the rest are written -inf. A row with a
 * non-finite value runs every group. (One segment, the row's largest |rest| for every weight, kept 1.4 % of the
 * default model's groups and 4 % of the Qwen 1.5B's, whose hidden rows have a few very large values; four keep
 * 0.1-0.2 %, and eight saved fewer second passes than their arithmetic cost: docs/benchmarks.md, "The argmax head".)
 *
 * x [rows, k] (the LM head's input, prepared: no norm, no SiLU), y [rows, out]; l1 [groups][S][GROUP] (an output's
 * segment sums at lane o % GROUP of its group, padding outputs 0); ``counts`` [rows]: the groups that ran their
 * second pass. Returns 0, 5 for a type with offset terms (Q4_1, Q4_K: the caller computes every logit) or a bad S,
 * else speculate_block_matmul's codes. */
int speculate_block_argmax(int type, const uint8_t *restrict w, int64_t out, int64_t k, const float *restrict x,
                           int64_t rows, const float *restrict l1, int segments, float *restrict y,
                           int64_t *restrict counts, int threads) {
    if (type != Q4_0 && type != Q8_0 && type != Q6_K) return 5;
    const int bytes = block_bytes(type);
    if (k <= 0 || k % (is_k(type) ? 8 * QK : QK)) return 2;
    const int64_t nb = k / QK, groups = (out + GROUP - 1) / GROUP, S = segments;
    if (S < 1 || S > nb) return 5;
    if (rows <= 0) return 0;
    const int64_t group_bytes = (is_k(type) ? nb / 8 : nb) * GROUP * bytes;
    const int step = tile_rows(type, rows); /* (the first passes' tiles: slots 0..rows-1) */
    /* The rows' first passes in slots 0..rows-1, their rests' in rows..2·rows-1. */
    qrows qr;
    float *rest = malloc(sizeof(float) * (size_t)k), *a = malloc(sizeof(float) * (size_t)(rows * S));
    float *high = malloc(sizeof(float) * (size_t)(rows * groups)), *t = malloc(sizeof(float) * (size_t)rows);
    int *bad = malloc(sizeof(int) * (size_t)rows);
    if (!rest || !a || !high || !t || !bad || qrows_new(&qr, 2 * rows, k, step)) {
        free(rest); free(a); free(high); free(t); free(bad);
        return 3;
    }
    for (int64_t r = 0; r < rows; r++) {
        qrows_put_two(&qr, r, rows + r, x + r * k, rest);
        for (int64_t s = 0; s < S; s++) a[r * S + s] = 0.f;
        for (int64_t b = 0; b < nb; b++) { /* 1.01 A_s, the margin of the bound above */
            const float m = 1.01f * block_amax(rest + b * QK);
            float *as = a + r * S + b * S / nb;
            *as = m > *as ? m : *as;
        }
        t[r] = -INFINITY;
        bad[r] = 0;
        for (int64_t s = 0; s < S; s++) bad[r] |= !isfinite(a[r * S + s]);
    }
    free(rest);
    /* The first passes, every group (speculate_block_matmul's loop at one pass); as each tile is written, per row the
     * group's highest y_row + B (high[r · groups + g]) and the greatest y_row − B (t[r], over the threads). */
#pragma omp parallel num_threads(threads) if (threads > 1 && groups * rows >= 32)
    {
        float *tl = malloc(sizeof(float) * (size_t)rows);
        int *badl = malloc(sizeof(int) * (size_t)rows);
        for (int64_t r = 0; r < rows && tl && badl; r++) tl[r] = -INFINITY, badl[r] = 0;
        amx_share(step, 1);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            float got[(AMX_ROWS > TILE ? AMX_ROWS : TILE) * GROUP];
            const int64_t o0 = g * GROUP, n = out - o0 < GROUP ? out - o0 : GROUP;
            for (int64_t r0 = 0; r0 < rows; r0 += step) {
                const int nr = rows - r0 < step ? (int)(rows - r0) : step;
                qrows_run(type, w + g * group_bytes, &qr, r0, nr, step, r0 == 0, got);
                finish(got, GROUP, nr, 1, o0, (int)n, r0, NULL, NULL, y, out);
                for (int r = 0; r < nr && tl && badl; r++) {
                    float lo;
                    badl[r0 + r] |= margins(got + r * GROUP, l1 + g * S * GROUP, a + (r0 + r) * S, S, n,
                                            high + (r0 + r) * groups + g, &lo);
                    tl[r0 + r] = lo > tl[r0 + r] ? lo : tl[r0 + r];
                }
            }
        }
        amx_share(step, 0);
#pragma omp critical
        for (int64_t r = 0; r < rows; r++) {
            if (!tl || !badl) bad[r] = 1; /* (no memory for this thread's bounds: every group of every row) */
            else t[r] = tl[r] > t[r] ? tl[r] : t[r], bad[r] |= badl[r];
        }
        free(tl); free(badl);
    }
    /* Per group and row: the second pass where the group's high reaches the row's T (y = y_row + y_rest, as finish
     * adds them), else -inf. */
    for (int64_t r = 0; r < rows; r++) counts[r] = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 64) if (threads > 1 && groups * rows >= 32)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t o0 = g * GROUP, n = out - o0 < GROUP ? out - o0 : GROUP;
        for (int64_t r = 0; r < rows; r++) {
            float *yr = y + r * out + o0;
            if (bad[r] || high[r * groups + g] >= t[r]) {
                float got[GROUP];
                qrows_tile(type, w + g * group_bytes, &qr, rows + r, 1, 0, got); /* (a few groups: none ahead) */
                for (int64_t i = 0; i < n; i++) yr[i] = yr[i] + got[i];
#pragma omp atomic
                counts[r]++;
            } else {
                for (int64_t i = 0; i < n; i++) yr[i] = -INFINITY;
            }
        }
    }
    qrows_free(&qr);
    free(a); free(high); free(t); free(bad);
    return 0;
}
