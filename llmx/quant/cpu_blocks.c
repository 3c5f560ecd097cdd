/* GEMV and row dequantization straight on GGUF's blocks, one token's attention over a KV cache, and
 * the sampler's top-k, for the CPU (built by cpu_native.py).
 *
 * Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (most GGUFs' matrices); f32, f16, bf16 caches, and
 * caches of GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL), quantized as stored, read in tiles.
 *
 * Decode on the CPU is a race to read every weight byte once: a Q4_K matrix kept as GGUF stores it
 * is 0.5625 bytes a weight, against 0.75 for cpu_pack's float32-scaled form. Threads take chunks of
 * contiguous rows as they come free and prefetch ahead of themselves in them. A row's dot product multiplies
 * each group's integer codes with x's (rounded to 16-bit codes per group of 32, see qx_t) in integer
 * dot-product instructions, as llama.cpp's do with 8-bit x, and applies the group's scales once to
 * the exact integer sum: about a third of the instructions of float32 products, which left one core
 * at ~6 GB/s, short of its share of RAM's bandwidth. Up to 64 rows of x reuse each weight row while
 * it sits in L1, their products formed from codes unpacked once (see rows_fn; 16 rows of W at once for
 * the 32-weight types, and with AVX-512 the K-quants too, see wide_fn). Weights are exactly GGUF's
 * (d * scale * q - dmin * min). With AVX2 the dot products are written out (VNNI's dpbusd where the
 * CPU has it, else maddubs + madd: the same exact sums; with AVX-512 VNNI two groups or blocks a 512-bit
 * register); elsewhere a portable loop decodes a block and multiplies it with x's rounded values in float32.
 * The library is linked to the OpenMP runtime torch itself loaded (cpu_native.compile_to), so
 * torch.set_num_threads governs both and one thread pool serves them.
 */
#define _GNU_SOURCE /* pthread_setaffinity_np */
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) /* F16C: every AVX2 CPU has it */
#define LLMX_AVX2 1
#endif
#if defined(LLMX_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define LLMX_AVX512 1 /* 512-bit integer dot products where the K-quant loops can use them */
#endif
#if defined(LLMX_AVX2) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { T_Q4_K = 0, T_Q6_K = 1, T_Q8_0 = 2, T_Q4_0 = 3, T_Q4_1 = 4, T_Q5_K = 5, T_Q5_0 = 6, T_Q5_1 = 7 };

/* How far ahead of its rows a GEMV thread asks for weights (prefetch_block). The best distance is the
 * machine's: 2 KiB on the H200 host's Xeon (4 and 8 KiB 6-8% slower), 4-8 KiB on this project's Zen 4
 * (15% faster than 2), so cpu_native.py measures it once per machine and thread count and sets it.
 * A prefetch into the L1 holds one of the core's few fill buffers until its line arrives, which caps
 * the bytes in flight from RAM; so the lines `prefetch_far` times as far ahead may be asked into the L2
 * as well, whose queue holds more (two threads of a Q4_K GEMV streaming from RAM on a 2-core Xeon: 14.5-15.4
 * GB/s without, 18.6-19.9 with, from 4 to 16 KiB ahead); 0: not. Measured with the distance. */
static int64_t prefetch_ahead = 2048, prefetch_far = 0;
void llmx_set_prefetch(int64_t bytes, int64_t far) { prefetch_ahead = bytes, prefetch_far = far; }

static inline float half_to_float(const uint8_t *p) {
    uint16_t bits;
    memcpy(&bits, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(bits); /* one instruction */
#elif defined(__FLT16_MAX__)
    _Float16 h; /* the compiler's own conversion */
    memcpy(&h, &bits, 2);
    return (float)h;
#else
    const uint32_t sign = (uint32_t)(bits & 0x8000u) << 16, exp = (bits >> 10) & 31u, man = bits & 0x3ffu;
    uint32_t out;
    float f;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        f = (float)man * (1.0f / 16777216.0f);
        memcpy(&out, &f, 4);
        out |= sign;
    } else {
        out = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    }
    memcpy(&f, &out, 4);
    return f;
#endif
}

/* Q4_K: d, dmin (f16), 12 bytes of 6-bit scales and mins for 8 groups of 32, 128 bytes of nibbles;
 * bytes 32c..32c+31 hold group 2c in their low nibbles and group 2c+1 in their high ones. */
static inline void k_scales(const uint8_t *s, uint8_t scale[8], uint8_t min[8]) {
    /* groups 0..3: the low 6 bits of bytes 0..3 (scales) and 4..7 (mins); groups 4..7: the nibbles
     * of bytes 8..11, with the top 2 bits of bytes 0..3 (scales) and 4..7 (mins) above them */
    uint32_t u[3], out[4];
    memcpy(u, s, 12);
    const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
    out[0] = u[0] & six;
    out[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);
    out[2] = u[1] & six;
    out[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);
    memcpy(scale, out, 8);
    memcpy(min, out + 2, 8);
}

/* Q4_K, and Q5_K (five: 32 bytes of fifth bits at 16, the nibbles at 48; see decode_q5_k). */
static inline void decode_k_nibbles(const uint8_t *b, float *out, int five) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *qh = b + 16;
    uint8_t sc[8], mn[8];
    k_scales(b + 4, sc, mn);
    for (int c = 0; c < 4; c++) {
        const float a0 = d * (float)sc[2 * c], b0 = dmin * (float)mn[2 * c];
        const float a1 = d * (float)sc[2 * c + 1], b1 = dmin * (float)mn[2 * c + 1];
        const uint8_t *q = b + (five ? 48 : 16) + 32 * c;
        for (int l = 0; l < 32; l++) {
            const int h0 = five ? ((qh[l] >> (2 * c)) & 1) << 4 : 0, h1 = five ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0;
            out[64 * c + l] = a0 * (float)((q[l] & 15) | h0) - b0;
            out[64 * c + l + 32] = a1 * (float)((q[l] >> 4) | h1) - b1;
        }
    }
}

static void decode_q4_k(const uint8_t *b, float *out) { decode_k_nibbles(b, out, 0); }

/* Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16), d (f16).
 * Each half of 128 weights is four quarters j of 32: position l of quarter j takes the low (j < 2)
 * or high nibble of ql[l] (j even) or ql[l + 32] (j odd), bits 2j..2j+1 of qh[l], scale l/16 + 2j. */
static inline int q6_k_code(const uint8_t *ql, const uint8_t *qh, int j, int l) {
    const int low = j & 1 ? ql[l + 32] : ql[l];
    return (int)(((j & 2 ? low >> 4 : low & 15) | (((qh[l] >> (2 * j)) & 3) << 4))) - 32;
}

static void decode_q6_k(const uint8_t *b, float *out) {
    const float d = half_to_float(b + 208);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(b + 192 + 8 * h);
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) out[128 * h + 32 * j + l] = d * sc[l / 16 + 2 * j] * q6_k_code(ql, qh, j, l);
    }
}

/* Q8_0: d (f16) and 32 int8 codes. */
static void decode_q8_0(const uint8_t *b, float *out) {
    const float d = half_to_float(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int l = 0; l < 32; l++) out[l] = d * (float)q[l];
}

/* Q4_0: d (f16), 16 bytes: weight l is (low nibble of byte l) - 8, weight l + 16 its high nibble - 8.
 * Q4_1: d, m (f16), the same nibbles unsigned: d * q + m. */
static void decode_q4_0(const uint8_t *b, float *out) {
    const float d = half_to_float(b);
    for (int l = 0; l < 16; l++) {
        out[l] = d * (float)((b[2 + l] & 15) - 8);
        out[l + 16] = d * (float)((b[2 + l] >> 4) - 8);
    }
}

static void decode_q4_1(const uint8_t *b, float *out) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    for (int l = 0; l < 16; l++) {
        out[l] = d * (float)(b[4 + l] & 15) + m;
        out[l + 16] = d * (float)(b[4 + l] >> 4) + m;
    }
}

/* Q5_0: d (f16), qh (32 fifth bits, little-endian), 16 bytes of low nibbles as Q4_0's: q - 16.
 * Q5_1: d, m (f16), qh, nibbles: d * q + m. */
static void decode_q5(const uint8_t *b, float *out, int with_m) {
    const float d = half_to_float(b), m = with_m ? half_to_float(b + 2) : 0.0f;
    const uint8_t *qh = b + (with_m ? 4 : 2), *qs = qh + 4;
    uint32_t h;
    memcpy(&h, qh, 4);
    for (int l = 0; l < 16; l++) {
        const int q0 = (qs[l] & 15) | (int)((h >> l) & 1) << 4, q1 = (qs[l] >> 4) | (int)((h >> (l + 16)) & 1) << 4;
        out[l] = with_m ? d * (float)q0 + m : d * (float)(q0 - 16);
        out[l + 16] = with_m ? d * (float)q1 + m : d * (float)(q1 - 16);
    }
}

static void decode_q5_0(const uint8_t *b, float *out) { decode_q5(b, out, 0); }

static void decode_q5_1(const uint8_t *b, float *out) { decode_q5(b, out, 1); }

/* Q5_K: Q4_K's d, dmin and scales, then 32 bytes qh, then Q4_K's 128 bytes of nibbles; the fifth
 * bit of group 2c's weight l is bit 2c of qh[l], of group 2c + 1's bit 2c + 1. */
static void decode_q5_k(const uint8_t *b, float *out) { decode_k_nibbles(b, out, 1); }

/* x as the dot products read it: 16-bit codes per group of 32, c = round(x * X_CODES / max|x|) (half
 * away from zero), dx = max|x| / X_CODES, each code split into two signed bytes c = 255 * hi + lo, so
 * that integer dot-product instructions (bytes times bytes) multiply both halves with the weights'
 * codes: two instructions where float32 x takes eight. (Bytes alone, as llama.cpp's CPU and GPU dot
 * products and our GPU's quantize x, round each value by up to 1/254 of its group's largest; that
 * moves SmolLM2's greedy text away from float32's. Sixteen bits round by 1/65024.) s16 and s32 are
 * dx times the codes' sums per 16 and per 32, so that a group's offset (Q4_K's and Q5_K's minimums,
 * Q4_0's -8, Q4_1's m, Q6_K's -32) costs one multiply; f = dx * c, the same values in float32, only
 * for the portable loops (X_FLOATS: the AVX2 dot products never read them). The same codes are also
 * split c = 256 * hi8 + lo8 (hi8 in -127..127, lo8 in -128..127: lo8 is c's low byte read as signed),
 * which joins the halves' sums with one shift where 255 takes a shift and a subtraction: the same
 * exact integer sums, for every kernel whose weight codes are the unsigned operand (all but Q8_0,
 * whose byte sign flips need both halves in -127..127). */
#define X_CODES 32512 /* 255 * 127 + 127: both halves in -127..127 (byte sign flips stay exact) */
#ifdef LLMX_AVX2
#define X_FLOATS 0
#else
#define X_FLOATS 1
#endif
typedef struct {
    const int8_t *hi, *lo;
    const float *d, *s16, *s32, *f;
    const int16_t *c; /* the codes whole, for the kernels of several rows (see rows_fn) */
    const int8_t *hi8, *lo8; /* c = 256 * hi8 + lo8 */
} qx_t;

#ifdef LLMX_AVX2
static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* quantize_group's codes for 32 values, with the same roundings: the scale and each product in float32,
 * half away from zero as trunc(v) plus the sign where |v - trunc(v)| >= 1/2 (exact: v + 1/2 can round
 * up across a power of two), and hi = round(c / 255) to nearest (no ties: 255 is odd; float32's error
 * stays far below the 1/510 that separates c / 255 from a half), lo = c - 255 hi in -127..127 as the
 * scalar loop's modulo gives. The scalar loop's roundf and fmaxf were calls into libm: ~3 us of fixed
 * cost for a 576-wide x, more than a small matrix's products. */
static void quantize_group(const float *x, int8_t *hi, int8_t *lo, int8_t *hi8, int8_t *lo8, float *d, float *s16,
                           float *s32, float *f) {
    (void)f;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 xs[4], top = _mm256_setzero_ps();
    for (int q = 0; q < 4; q++) {
        xs[q] = _mm256_loadu_ps(x + 8 * q);
        top = _mm256_max_ps(top, _mm256_andnot_ps(sign, xs[q]));
    }
    const float amax = hmax(top);
    const float inv = amax > 0.0f ? (float)X_CODES / amax : 0.0f, dx = amax / (float)X_CODES;
    const __m256 vinv = _mm256_set1_ps(inv), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    __m256i c[4];
    for (int q = 0; q < 4; q++) {
        const __m256 v = _mm256_mul_ps(xs[q], vinv);
        const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(v, t)), half, _CMP_GE_OQ);
        const __m256 away = _mm256_or_ps(_mm256_and_ps(v, sign), one);  /* +-1 with v's sign */
        c[q] = _mm256_cvtps_epi32(_mm256_add_ps(t, _mm256_and_ps(up, away)));  /* exact integers */
    }
    for (int q = 0; q < 4; q += 2) {  /* 16 codes at a time: to 16-bit, then bytes */
        __m256i h[2], l[2];
        for (int r = 0; r < 2; r++) {
            const __m256 cf = _mm256_cvtepi32_ps(c[q + r]);
            const __m256 hf = _mm256_round_ps(_mm256_mul_ps(cf, _mm256_set1_ps(1.0f / 255.0f)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            h[r] = _mm256_cvtps_epi32(hf);
            l[r] = _mm256_sub_epi32(c[q + r], _mm256_mullo_epi32(h[r], _mm256_set1_epi32(255)));
        }
        /* packs work within 128-bit lanes: reorder the 64-bit quarters back to element order */
        const __m256i h16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(h[0], h[1]), 0xD8);
        const __m256i l16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(l[0], l[1]), 0xD8);
        const __m128i h8 = _mm_packs_epi16(_mm256_castsi256_si128(h16), _mm256_extracti128_si256(h16, 1));
        const __m128i l8 = _mm_packs_epi16(_mm256_castsi256_si128(l16), _mm256_extracti128_si256(l16, 1));
        _mm_storeu_si128((__m128i *)(hi + 8 * q), h8);
        _mm_storeu_si128((__m128i *)(lo + 8 * q), l8);
        /* the 256 split: lo8 the low byte, signed (shifts in 32-bit lanes), hi8 = (c - lo8) / 256 exactly */
        __m256i h2[2], l2[2];
        for (int r = 0; r < 2; r++) {
            l2[r] = _mm256_srai_epi32(_mm256_slli_epi32(c[q + r], 24), 24);
            h2[r] = _mm256_srai_epi32(_mm256_sub_epi32(c[q + r], l2[r]), 8);
        }
        const __m256i h16b = _mm256_permute4x64_epi64(_mm256_packs_epi32(h2[0], h2[1]), 0xD8);
        const __m256i l16b = _mm256_permute4x64_epi64(_mm256_packs_epi32(l2[0], l2[1]), 0xD8);
        _mm_storeu_si128((__m128i *)(hi8 + 8 * q),
                         _mm_packs_epi16(_mm256_castsi256_si128(h16b), _mm256_extracti128_si256(h16b, 1)));
        _mm_storeu_si128((__m128i *)(lo8 + 8 * q),
                         _mm_packs_epi16(_mm256_castsi256_si128(l16b), _mm256_extracti128_si256(l16b, 1)));
    }
    const int sum0 = hsum_epi32(_mm256_add_epi32(c[0], c[1])), sum1 = hsum_epi32(_mm256_add_epi32(c[2], c[3]));
    *d = dx;
    s16[0] = dx * (float)sum0;
    s16[1] = dx * (float)sum1;
    *s32 = dx * (float)(sum0 + sum1);
}
#else
static void quantize_group(const float *x, int8_t *hi, int8_t *lo, int8_t *hi8, int8_t *lo8, float *d, float *s16,
                           float *s32, float *f) {
    float amax = 0.0f;
    for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(x[l]));
    const float inv = amax > 0.0f ? (float)X_CODES / amax : 0.0f, dx = amax / (float)X_CODES;
    int sums[2] = {0, 0};
    for (int l = 0; l < 32; l++) {
        const float v = x[l] * inv;
        const int c = (int)roundf(v), low = ((c + 127) % 255 + 255) % 255 - 127;
        hi[l] = (int8_t)((c - low) / 255);
        lo[l] = (int8_t)low;
        lo8[l] = (int8_t)(uint8_t)(c & 255);
        hi8[l] = (int8_t)((c - lo8[l]) / 256);
        if (X_FLOATS) f[l] = dx * (float)c;
        sums[l / 16] += c;
    }
    *d = dx;
    s16[0] = dx * (float)sums[0];
    s16[1] = dx * (float)sums[1];
    *s32 = dx * (float)(sums[0] + sums[1]);
}
#endif

/* One row of W (`blocks` blocks) times x. */
typedef float (*dot_fn)(const uint8_t *row, int64_t blocks, const qx_t *x);

#ifdef LLMX_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 8 lanes' sums of a[0..7] as one vector: lane r holds a[r]'s. */
static inline __m256 hsum8(const __m256 a[8]) {
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    /* s0: a[0..3]'s sums over lanes 0-3, then over lanes 4-7; s1 the same for a[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* acc + 8 int32 lanes, each the sum of 4 adjacent products of unsigned bytes u and signed bytes s
 * (exact: no pair of products here reaches maddubs' int16 saturation, |u| <= 128, |s| <= 127). */
static inline __m256i add_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

static inline __m256i times255(__m256i v) { return _mm256_sub_epi32(_mm256_slli_epi32(v, 8), v); }

/* The same sums against 16-bit codes given as their halves: (u . hi) * 255 + u . lo. (At most
 * 4 * 128 * 127 * 256 in a lane: far inside int32.) */
static inline __m256i sum_u8s16(__m256i u, __m256i hi, __m256i lo) {
    return add_u8s8(times255(add_u8s8(_mm256_setzero_si256(), u, hi)), u, lo);
}

/* The same sums against the codes' 256 split (qx_t.hi8, lo8): (u . hi8) * 256 + u . lo8. */
static inline __m256i sum_u8s16_256(__m256i u, __m256i hi8, __m256i lo8) {
    return add_u8s8(_mm256_slli_epi32(add_u8s8(_mm256_setzero_si256(), u, hi8), 8), u, lo8);
}

/* acc + (integer lane sums) * scale */
static inline __m256 add_scaled(__m256i sums, __m256 scale, __m256 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 32 byte codes u (0..255, or -128..127 where is_signed) as two vectors of 16-bit codes: the bytes at
 * even positions, and those at odd ones (qx_set lays x's codes out the same way). */
static inline void widen_even_odd(__m256i u, int is_signed, __m256i *even, __m256i *odd) {
    *even = is_signed ? _mm256_srai_epi16(_mm256_slli_epi16(u, 8), 8) : _mm256_and_si256(u, _mm256_set1_epi16(0xff));
    *odd = is_signed ? _mm256_srai_epi16(u, 8) : _mm256_srli_epi16(u, 8);
}

/* Lane j: the sum of the products at positions 4j..4j+3 of a group (the weights widened by
 * widen_even_odd, x's codes from c): exact, |w| <= 127 (or w * a Q6_K scale, |w| <= 8064) times
 * |c| <= X_CODES stays far inside int32. VNNI's dpwssd adds the second half's products to the
 * first's in the multiply-add itself (the same exact sums, one instruction of three fewer a group
 * and x row: at 8 rows these products are most of a batched decode step's work). */
static inline __m256i dot_group16(const __m256i w[2], const int16_t *c) {
    const __m256i first = _mm256_madd_epi16(w[0], load32(c));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(first, w[1], load32(c + 16));
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(first, w[1], load32(c + 16));
#else
    return _mm256_add_epi32(first, _mm256_madd_epi16(w[1], load32(c + 16)));
#endif
}

/* Without VNNI, a group's lane sums take two 16-bit multiply-adds on the widened codes (the several-row
 * kernels' form) where the byte products against x's 256 split take two maddubs, two madds and a shift,
 * and Q8_0's sign flips three more: the same exact integer lane sums, so the float work after them
 * gives the same bits (one Zen 3 core, matrices in cache: Q8_0 1.14-1.44x, Q4_1 1.05-1.07x). With VNNI
 * dpbusd takes the byte products in one instruction each. */
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#define SUM_X_WIDE 0
#else
#define SUM_X_WIDE 1
#endif

static inline __m256i sum_x(__m256i u, const qx_t *x, int64_t at) { /* u times x's 32 codes from `at` */
#if SUM_X_WIDE
    __m256i w[2];
    widen_even_odd(u, 0, &w[0], &w[1]);
    return dot_group16(w, x->c + at);
#else
    return sum_u8s16_256(u, load32(x->hi8 + at), load32(x->lo8 + at));
#endif
}

#ifdef LLMX_AVX512
/* sum_x over 64 codes from `at` (two groups) in 512-bit registers: half the instructions of two
 * sum_x. Where a core computes rather than waits for RAM it pays: this project's 2-core Zen 4 runs a
 * Llama-3-8B decode's matmuls at 42 GB/s instead of 38.5; the H200 host's Xeon cores, ~5 GB/s each,
 * wait for memory and run as fast as before (bench/RESULTS.md). */
static inline __m512i times255_512(__m512i v) { return _mm512_sub_epi32(_mm512_slli_epi32(v, 8), v); }

static inline __m512i sum_u8s16_512(__m512i u, __m512i hi, __m512i lo) { /* sum_u8s16, 512 bits */
    return _mm512_dpbusd_epi32(times255_512(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, hi)), u, lo);
}

static inline __m512i sum_x64(__m512i u, const qx_t *x, int64_t at) { /* with the 256 split */
    const __m512i high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(x->hi8 + at));
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(high, 8), u, _mm512_loadu_si512(x->lo8 + at));
}

/* Codes 0..15 from nibbles whose bytes `both` holds twice: each 64-bit lane shifted by its `shifts`
 * (0: the low nibbles, 4: the high ones; the mask drops what crosses a byte). Built from broadcast
 * loads, it spares the lane inserts that took the shuffle port a dot product's loop waits on. */
static inline __m512i nibbles_apart(__m512i both, __m512i shifts) {
    return _mm512_and_si512(_mm512_srlv_epi64(both, shifts), _mm512_set1_epi8(15));
}

/* scales[i] in lanes 0-7 and scales[i + 1] in lanes 8-15: the factors of two groups side by side */
static inline __m512 pair_scales(__m256 scales, int i) {
    const __m512i upper = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(i), upper), _mm512_castps256_ps512(scales));
}

#endif

/* A thread's rows (a chunk at a time) lie one after another: ask for the lines `prefetch_ahead` bytes past a
 * block while multiplying it, so that the stream from RAM keeps that many bytes in flight (one core's
 * hardware prefetchers alone stop at each 4 KiB page). Past the end it is harmless: no fault. Inlined by
 * force, as prefetch_share: a call of it has no effect GCC can see, and would be removed. */
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *b, int bytes) {
    const uint8_t *ahead = b + prefetch_ahead, *far = b + prefetch_far * prefetch_ahead;
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)(ahead + o), _MM_HINT_T0);
    if (prefetch_far)
        for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)(far + o), _MM_HINT_T2);
}

/* A Q4_K or Q5_K block's d * scale_j and dmin * min_j (j = 0..7) as floats, from one 16-byte load
 * (d, dmin, then k_scales' 12 bytes): the same values and products as k_scales and half_to_float
 * give, the masks and shifts on the four 32-bit words at once. The scalar form went through memory
 * (stores, then loads of 8 bytes): ~7% of the Q4_K dot product's time on one Zen 4 core, row in L2. */
static inline void k_scales8(const uint8_t *b, __m256 *dsc, __m256 *dmn) {
    const __m128i u = _mm_loadu_si128((const __m128i *)b); /* d and dmin (f16), then words u0, u1, u2 */
    /* lanes: out0 = u0 & six, out1 = (u2 & four) | ((u0 >> 2) & 0x30), out2 = u1 & six,
     * out3 = ((u2 >> 4) & four) | ((u1 >> 2) & 0x30) (bytewise: (u >> 6) & 3, moved up 4) */
    const __m128i a = _mm_srlv_epi32(_mm_shuffle_epi32(u, _MM_SHUFFLE(3, 2, 3, 1)), _mm_setr_epi32(0, 0, 0, 4));
    const __m128i s = _mm_srli_epi32(_mm_shuffle_epi32(u, _MM_SHUFFLE(2, 2, 1, 1)), 2);
    const __m128i out = _mm_or_si128(_mm_and_si128(a, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f)),
                                     _mm_and_si128(s, _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
    const __m128 halves = _mm_cvtph_ps(u); /* d, dmin */
    *dsc = _mm256_mul_ps(_mm256_broadcastss_ps(halves), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(out)));
    *dmn = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(halves)),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(out, 8))));
}

/* Q4_K and Q5_K (five: the fifth bits at byte 16 of each block, nibbles at 48). Group j's codes times
 * x's are scaled by d * scale_j * dx_j; the minimums come off at the end, dmin * min_j * s32_j. */
static inline float dot_k_nibbles(const uint8_t *row, int64_t blocks, const qx_t *x, int five) {
    const int bytes = five ? 176 : 144, nibbles = five ? 48 : 16;
    __m256 mins = _mm256_setzero_ps();
#ifdef LLMX_AVX512
    __m512 wide[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
#else
    const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
#endif
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint8_t *b = row + bytes * blk;
        prefetch_block(b, bytes);
        __m256 dsc, dmn;
        k_scales8(b, &dsc, &dmn);
        const __m256 scales = _mm256_mul_ps(dsc, _mm256_loadu_ps(x->d + 8 * blk));
#ifndef LLMX_AVX512
        float scale[8];
        _mm256_storeu_ps(scale, scales);
#endif
        mins = _mm256_fmadd_ps(dmn, _mm256_loadu_ps(x->s32 + 8 * blk), mins);
#ifdef LLMX_AVX512
        const __m512i hb = five ? _mm512_broadcast_i64x4(load32(b + 16)) : _mm512_setzero_si512(); /* in both halves */
#else
        const __m256i hb = five ? load32(b + 16) : _mm256_setzero_si256();
#endif
        for (int c = 0; c < 4; c++) {
            const __m256i v = load32(b + nibbles + 32 * c);
#ifdef LLMX_AVX512
            /* groups 2c and 2c + 1 side by side, as x's 64 codes from 64c lie */
            __m512i u = nibbles_apart(_mm512_broadcast_i64x4(v), _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4));
            if (five) { /* bits 2c (low half) and 2c + 1 (high) of each qh byte moved to bit 4 (64-bit
                           shifts stay in their byte once masked) */
                const __m512i shifts =
                    _mm512_add_epi64(_mm512_set1_epi64(2 * c), _mm512_setr_epi64(0, 0, 0, 0, 1, 1, 1, 1));
                const __m512i bits =
                    _mm512_and_si512(_mm512_srlv_epi64(hb, shifts), _mm512_set1_epi8(1));
                u = _mm512_or_si512(u, _mm512_slli_epi64(bits, 4));
            }
            wide[c & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_x64(u, x, 256 * blk + 64 * c)),
                                          pair_scales(scales, 2 * c), wide[c & 1]);
#else
            __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if (five) { /* bits 2c and 2c + 1 of each qh byte, moved to bit 4 (16-bit shifts stay in
                           their byte once masked) */
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), one), 4));
            }
            even = add_scaled(sum_x(lo, x, 256 * blk + 64 * c), _mm256_broadcast_ss(scale + 2 * c), even);
            odd = add_scaled(sum_x(hi, x, 256 * blk + 64 * c + 32), _mm256_broadcast_ss(scale + 2 * c + 1), odd);
#endif
        }
    }
#ifdef LLMX_AVX512
    return _mm512_reduce_add_ps(_mm512_add_ps(wide[0], wide[1])) - hsum(mins);
#else
    return hsum(_mm256_add_ps(even, odd)) - hsum(mins);
#endif
}

static float dot_q4_k(const uint8_t *row, int64_t blocks, const qx_t *x) { return dot_k_nibbles(row, blocks, x, 0); }

static float dot_q5_k(const uint8_t *row, int64_t blocks, const qx_t *x) { return dot_k_nibbles(row, blocks, x, 1); }

static inline __m256i legacy_codes(const uint8_t *nibbles) { /* 16 bytes: 32 codes, low nibbles first */
    const __m128i v = _mm_loadu_si128((const __m128i *)nibbles), low = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}

static inline __m256i hsum8i(const __m256i a[8]) { /* hsum8 for int32 lanes (exact) */
    const __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
}

/* The f16 at byte `at` of eight blocks `bytes` apart, as floats. */
static inline __m256 eight_halves(const uint8_t *b, int bytes, int at) {
    uint16_t bits[8];
    for (int i = 0; i < 8; i++) memcpy(bits + i, b + bytes * i + at, 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)bits));
}

/* Types of 32-weight blocks with an f16 d first (Q4_0, Q4_1, Q8_0): a block's products are few, so its
 * scalar work (d converted, times dx, broadcast, the sum converted) weighed as much as they did. Eight
 * blocks go at once: their integer sums reduced into one vector (lane i: block i), their d's converted
 * together, acc += sums * d * dx; returns the d's. A row's last blocks (fewer than eight) go one by one:
 * a partial group with zeroed lanes cost more. */
static inline __m256 add_eight_totals(__m256i totals, const uint8_t *b, int bytes, const float *dx, __m256 *acc) {
    const __m256 d = eight_halves(b, bytes, 0);
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals), _mm256_mul_ps(d, _mm256_loadu_ps(dx)), *acc);
    return d;
}

static inline __m256 add_eight_blocks(const __m256i sums[8], const uint8_t *b, int bytes, const float *dx, __m256 *acc) {
    return add_eight_totals(hsum8i(sums), b, bytes, dx, acc);
}

#ifdef LLMX_AVX512
/* hsum8i for eight blocks' lane sums two a register (block 2k in the low half of pairs[k], 2k + 1 in
 * the high one): unpacks and adds within 128-bit lanes, then one lane shuffle and one permute, where
 * splitting them for hsum8i's horizontal adds took twice the shuffles (the port the loop waits on).
 * Integer sums: the same totals in any order. */
static inline __m256i pair_totals(const __m512i pairs[4]) {
    const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(pairs[0], pairs[1]),
                                         _mm512_unpackhi_epi32(pairs[0], pairs[1]));
    const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(pairs[2], pairs[3]),
                                         _mm512_unpackhi_epi32(pairs[2], pairs[3]));
    /* lane 4c + k: the sum of pairs[k]'s 128-bit lane c (lanes 0, 1: block 2k; 2, 3: block 2k + 1) */
    const __m512i r = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
    const __m512i q = _mm512_add_epi32(r, _mm512_shuffle_i32x4(r, r, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, q));
}
#endif

/* The 32-weight types with an f16 d first, as their kernels tell them apart: Q4_1 and Q5_1 carry an
 * f16 m after d (w = d * q + m), Q4_0 and Q5_0 an offset every code carries (-8, -16), Q8_0 signed
 * codes; Q5_0's and Q5_1's fifth bits lie in a 32-bit qh before the nibbles. */
enum { L_Q4_0, L_Q4_1, L_Q8_0, L_Q5_0, L_Q5_1 };
static inline int legacy_bytes(int kind) { return (const int[]){18, 20, 34, 22, 24}[kind]; }
static inline int legacy_codes_at(int kind) { return (const int[]){2, 4, 2, 6, 8}[kind]; }
static inline int legacy_has_m(int kind) { return kind == L_Q4_1 || kind == L_Q5_1; }
static inline float legacy_offset(int kind) { return kind == L_Q5_0 ? -16.0f : -8.0f; } /* Q4_0, Q5_0 */

/* 32 bits as 32 bytes, byte l 16 where bit l is set, else 0: Q5_0's and Q5_1's fifth bits, in the order
 * legacy_codes lays out the nibbles (weights 0-15 in the low lane, 16-31 in the high one). */
static inline __m256i fifth_bits(const uint8_t *qh) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i mask = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(16));
}

/* A 4- or 5-bit block's 32 unsigned codes (0..15, 0..31), weight l in byte l. */
static inline __m256i nibble_codes(const uint8_t *b, int kind) {
    const __m256i codes = legacy_codes(b + legacy_codes_at(kind));
    return kind == L_Q5_0 || kind == L_Q5_1 ? _mm256_or_si256(codes, fifth_bits(b + legacy_codes_at(kind) - 4)) : codes;
}

#ifdef LLMX_AVX512
/* nibble_codes of two blocks `bytes` apart, the first's in the low half, from two broadcast loads
 * (nibbles_apart); Q5_0's and Q5_1's fifth bits (the two blocks' 32-bit qh, code l's bit l) as a byte
 * mask adding 16. */
static inline __m512i nibble_pair(const uint8_t *b, int bytes, int kind) {
    const uint8_t *q = b + legacy_codes_at(kind);
    const __m512i both = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q)),
                                                     0xFF00, _mm_loadu_si128((const __m128i *)(q + bytes)));
    const __m512i codes = nibbles_apart(both, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
    if (kind != L_Q5_0 && kind != L_Q5_1) return codes;
    uint32_t first, second;
    memcpy(&first, q - 4, 4);
    memcpy(&second, q + bytes - 4, 4);
    return _mm512_mask_add_epi8(codes, _cvtu64_mask64(first | (uint64_t)second << 32), codes, _mm512_set1_epi8(16));
}
#endif

/* Q4_0, Q4_1, Q5_0 and Q5_1, eight blocks at a time (add_eight_totals); the minimums (m, or the offset
 * times d) come off as m * s32, eight at a time too. */
static inline float dot_legacy_nibbles(const uint8_t *row, int64_t blocks, const qx_t *x, int kind) {
    const int bytes = legacy_bytes(kind), with_m = legacy_has_m(kind);
    const float offset = legacy_offset(kind);
    __m256 acc = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
    int64_t blk = 0;
    for (; blk + 8 <= blocks; blk += 8) {
        const uint8_t *b = row + bytes * blk;
        prefetch_block(b, 8 * bytes);
#ifdef LLMX_AVX512
        __m512i pairs[4];
        for (int i = 0; i < 8; i += 2) { /* two blocks a register: their x codes lie side by side */
            pairs[i / 2] = sum_x64(nibble_pair(b + bytes * i, bytes, kind), x, 32 * (blk + i));
        }
        const __m256 d = add_eight_totals(pair_totals(pairs), b, bytes, x->d + blk, &acc);
#else
        __m256i sums[8];
        for (int i = 0; i < 8; i++) sums[i] = sum_x(nibble_codes(b + bytes * i, kind), x, 32 * (blk + i));
        const __m256 d = add_eight_blocks(sums, b, bytes, x->d + blk, &acc);
#endif
        const __m256 m = with_m ? eight_halves(b, bytes, 2) : _mm256_mul_ps(d, _mm256_set1_ps(offset));
        offsets = _mm256_fmadd_ps(m, _mm256_loadu_ps(x->s32 + blk), offsets);
    }
    float total = hsum(acc) + hsum(offsets);
    for (; blk < blocks; blk++) {
        const uint8_t *b = row + bytes * blk;
        const float d = half_to_float(b);
        total += (float)hsum_epi32(sum_x(nibble_codes(b, kind), x, 32 * blk)) * (d * x->d[blk]);
        total += (with_m ? half_to_float(b + 2) : offset * d) * x->s32[blk];
    }
    return total;
}

static float dot_q4_0(const uint8_t *row, int64_t blocks, const qx_t *x) {
    return dot_legacy_nibbles(row, blocks, x, L_Q4_0);
}

static float dot_q4_1(const uint8_t *row, int64_t blocks, const qx_t *x) {
    return dot_legacy_nibbles(row, blocks, x, L_Q4_1);
}

static float dot_q5_0(const uint8_t *row, int64_t blocks, const qx_t *x) {
    return dot_legacy_nibbles(row, blocks, x, L_Q5_0);
}

static float dot_q5_1(const uint8_t *row, int64_t blocks, const qx_t *x) {
    return dot_legacy_nibbles(row, blocks, x, L_Q5_1);
}

/* Q6_K: codes 0..63 (the -32 comes off at the end, d * scale_i * s16_i for each 16), each quarter's
 * two scales applied to the integer products as 16-bit factors (madd), then d * dx per group. With
 * AVX-512 two quarters a register are built whole from 64-byte loads, and each lane's exact sum of 4
 * products (dpbusd, as sum_x64) is multiplied in float by its 16's factor, scale_i * d * dx (a block's
 * 16 factors made once, one permute a register: the int32 multiply by scale_i and the second permute
 * for d * dx took the ports the loop waits on; a Xeon core, row in L2, 69 -> 63 us a 1 MiB matrix, two
 * threads 1953 -> 1682 us a 64 MiB one; rounded once more than the integer form). */
static float dot_q6_k(const uint8_t *row, int64_t blocks, const qx_t *x) {
    const __m256i low = _mm256_set1_epi8(15), bits01 = _mm256_set1_epi8(3), bits23 = _mm256_set1_epi8(12),
                  bits45 = _mm256_set1_epi8(48);
    /* picks 16-bit scale 2j for bytes 0..15 of a quarter, 2j + 1 for bytes 16..31 (plus 4j) */
    const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2,
                                          3, 2, 3, 2, 3, 2, 3);
    __m256 offsets = _mm256_setzero_ps();
#ifdef LLMX_AVX512
    (void)pick, (void)bits01, (void)bits23, (void)bits45, (void)low;
    /* a register of two quarters: lanes 4i..4i+3 (16 weights) take its factor i; factor i of a block
     * belongs to the group of 32 i / 2 */
    const __m512i quarter_pick = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                  group_of = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i shift01 = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2), shift23 = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2),
                  bits45_512 = _mm512_set1_epi8(48), low512 = _mm512_set1_epi8(15);
    __m512 wide = _mm512_setzero_ps();
#else
    __m256 acc = _mm256_setzero_ps();
#endif
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint8_t *b = row + 210 * blk;
        prefetch_block(b, 210);
        const __m256 d = _mm256_set1_ps(half_to_float(b + 208));
        const __m256 scales8 = _mm256_mul_ps(d, _mm256_loadu_ps(x->d + 8 * blk));
#ifndef LLMX_AVX512
        float scale[8];
        _mm256_storeu_ps(scale, scales8);
#endif
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(b + 192));
#ifdef LLMX_AVX512
        /* factor i: scale i times d * dx of its group of 32 (i / 2) */
        const __m512 factors = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)),
                                             _mm512_permutexvar_ps(group_of, _mm512_castps256_ps512(scales8)));
#endif
        const __m256 sc_lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)),
                     sc_hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8)));
        offsets = _mm256_fmadd_ps(d, _mm256_fmadd_ps(sc_lo, _mm256_loadu_ps(x->s16 + 16 * blk),
                                                     _mm256_mul_ps(sc_hi, _mm256_loadu_ps(x->s16 + 16 * blk + 8))),
                                  offsets);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h;
#ifdef LLMX_AVX512
            /* quarters j and j + 1 a register, built whole: ql's 64 bytes (a, then c) give the low
             * nibbles of quarters 0, 1 and the high ones of 2, 3; qh (in both halves) shifted by 4, 2
             * (quarters 0, 1) or 0, 2 (2, 3) bits to bits 4-5 (64-bit shifts: the masks drop what
             * crosses a byte) */
            const __m512i ac = _mm512_loadu_si512(ql), hb = _mm512_broadcast_i64x4(load32(b + 128 + 32 * h));
            const __m512i q01 = _mm512_ternarylogic_epi32(ac, _mm512_and_si512(_mm512_sllv_epi64(hb, shift01), bits45_512),
                                                          low512, 0xEC); /* (ac & low) | high bits */
            const __m512i q23 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ac, 4),
                                                          _mm512_and_si512(_mm512_srlv_epi64(hb, shift23), bits45_512),
                                                          low512, 0xEC);
            for (int j = 0; j < 4; j += 2) {
                const __m512i qq = j == 0 ? q01 : q23;
                const int64_t at = 256 * blk + 128 * h + 32 * j;
                const __m512 factor =
                    _mm512_permutexvar_ps(_mm512_add_epi32(quarter_pick, _mm512_set1_epi32(8 * h + 2 * j)), factors);
                wide = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_x64(qq, x, at)), factor, wide);
            }
#else
            const __m256i a = load32(ql), c = load32(ql + 32), hb = load32(b + 128 + 32 * h);
            const __m128i half_scales = _mm_loadl_epi64((const __m128i *)(b + 192 + 8 * h));
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(a, low), _mm256_slli_epi16(_mm256_and_si256(hb, bits01), 4)),
                _mm256_or_si256(_mm256_and_si256(c, low), _mm256_slli_epi16(_mm256_and_si256(hb, bits23), 2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(hb, bits45)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), low),
                                _mm256_and_si256(_mm256_srli_epi16(hb, 2), bits45)),
            };
            const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(half_scales));
            for (int j = 0; j < 4; j++) {
                const __m256i factors =
                    _mm256_shuffle_epi8(scales, _mm256_add_epi8(pick, _mm256_set1_epi8((char)(4 * j))));
                const int64_t at = 256 * blk + 128 * h + 32 * j;
                const __m256i high = _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], load32(x->hi8 + at)), factors),
                              low_ = _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], load32(x->lo8 + at)), factors);
                const __m256i sums = _mm256_add_epi32(_mm256_slli_epi32(high, 8), low_);
                acc = add_scaled(sums, _mm256_broadcast_ss(scale + 4 * h + j), acc);
            }
#endif
        }
    }
#ifdef LLMX_AVX512
    return _mm512_reduce_add_ps(wide) - 32.0f * hsum(offsets);
#else
    return hsum(acc) - 32.0f * hsum(offsets);
#endif
}

static inline __m256i q8_0_sum(const uint8_t *b, const qx_t *x, int64_t at) { /* one block's lane sums */
    const __m256i w = load32(b + 2);
#if SUM_X_WIDE
    __m256i halves[2];
    widen_even_odd(w, 1, &halves[0], &halves[1]);
    return dot_group16(halves, x->c + at);
#else
    /* |w| times x with w's sign: unsigned times signed, as the instruction wants */
    return sum_u8s16(_mm256_abs_epi8(w), _mm256_sign_epi8(load32(x->hi + at), w), _mm256_sign_epi8(load32(x->lo + at), w));
#endif
}

#ifdef LLMX_AVX512
/* q8_0_sum of two blocks (34 bytes apart) in one register, the first's in the low half: |w| times x
 * with w's sign, the sign moved onto x by a byte mask (512-bit registers have no sign instruction). */
static inline __m512i q8_0_sum2(const uint8_t *b, const qx_t *x, int64_t at) {
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(load32(b + 2)), load32(b + 34 + 2), 1);
    const __mmask64 negative = _mm512_movepi8_mask(w);
    const __m512i zero = _mm512_setzero_si512(), u = _mm512_abs_epi8(w);
    const __m512i hi = _mm512_loadu_si512(x->hi + at), lo = _mm512_loadu_si512(x->lo + at);
    const __m512i signed_hi = _mm512_mask_sub_epi8(hi, negative, zero, hi);
    return sum_u8s16_512(u, signed_hi, _mm512_mask_sub_epi8(lo, negative, zero, lo));
}
#endif

static float dot_q8_0(const uint8_t *row, int64_t blocks, const qx_t *x) { /* eight blocks at a time */
    __m256 acc = _mm256_setzero_ps();
    int64_t blk = 0;
    for (; blk + 8 <= blocks; blk += 8) {
        const uint8_t *b = row + 34 * blk;
        prefetch_block(b, 8 * 34);
#ifdef LLMX_AVX512
        __m512i pairs[4];
        for (int i = 0; i < 8; i += 2) pairs[i / 2] = q8_0_sum2(b + 34 * i, x, 32 * (blk + i));
        add_eight_totals(pair_totals(pairs), b, 34, x->d + blk, &acc);
#else
        __m256i sums[8];
        for (int i = 0; i < 8; i++) sums[i] = q8_0_sum(b + 34 * i, x, 32 * (blk + i));
        add_eight_blocks(sums, b, 34, x->d + blk, &acc);
#endif
    }
    float total = hsum(acc);
    for (; blk < blocks; blk++) {
        const uint8_t *b = row + 34 * blk;
        total += (float)hsum_epi32(q8_0_sum(b, x, 32 * blk)) * (half_to_float(b) * x->d[blk]);
    }
    return total;
}
#else
#define DOT_BY_DECODING(name, QK, BYTES)                                                               \
    static float dot_##name(const uint8_t *row, int64_t blocks, const qx_t *x) {                        \
        float wf[QK], s = 0.0f;                                                                         \
        for (int64_t blk = 0; blk < blocks; blk++) {                                                    \
            decode_##name(row + BYTES * blk, wf);                                                       \
            for (int l = 0; l < QK; l++) s += wf[l] * x->f[QK * blk + l];                               \
        }                                                                                               \
        return s;                                                                                       \
    }
DOT_BY_DECODING(q4_k, 256, 144)
DOT_BY_DECODING(q6_k, 256, 210)
DOT_BY_DECODING(q8_0, 32, 34)
DOT_BY_DECODING(q4_0, 32, 18)
DOT_BY_DECODING(q4_1, 32, 20)
DOT_BY_DECODING(q5_0, 32, 22)
DOT_BY_DECODING(q5_1, 32, 24)
DOT_BY_DECODING(q5_k, 256, 176)
#endif

/* The type's dot product, decoder, block size in weights and bytes; 0 for a type this file lacks. */
static int block_of(int type, dot_fn *dot, void (**decode)(const uint8_t *, float *), int *qk, int *bytes) {
    switch (type) {
    case T_Q4_K: *dot = dot_q4_k; *decode = decode_q4_k; *qk = 256; *bytes = 144; return 1;
    case T_Q6_K: *dot = dot_q6_k; *decode = decode_q6_k; *qk = 256; *bytes = 210; return 1;
    case T_Q8_0: *dot = dot_q8_0; *decode = decode_q8_0; *qk = 32; *bytes = 34; return 1;
    case T_Q4_0: *dot = dot_q4_0; *decode = decode_q4_0; *qk = 32; *bytes = 18; return 1;
    case T_Q4_1: *dot = dot_q4_1; *decode = decode_q4_1; *qk = 32; *bytes = 20; return 1;
    case T_Q5_K: *dot = dot_q5_k; *decode = decode_q5_k; *qk = 256; *bytes = 176; return 1;
    case T_Q5_0: *dot = dot_q5_0; *decode = decode_q5_0; *qk = 32; *bytes = 22; return 1;
    case T_Q5_1: *dot = dot_q5_1; *decode = decode_q5_1; *qk = 32; *bytes = 24; return 1;
    default: return 0;
    }
}

#define MAX_WEIGHTS 4
#ifndef CHUNKS_A_THREAD
#define CHUNKS_A_THREAD 16
#endif

/* --- passes of GEMVs over several matrices -------------------------------------------------------- */

/* m rows of x [m, k] as the dot products read them (qx_t), in one allocation: the code halves (255
 * and 256 splits), the whole codes (int16, see qx_set), with AVX-512 the same codes in pairs (see
 * wide_fn; NULL elsewhere, where nothing reads them), then per group dx, s32, two s16, and (X_FLOATS)
 * f, k floats a row. */
#ifdef LLMX_AVX512
#define PAIR_BYTES 2 /* a value's share of `pair` */
#else
#define PAIR_BYTES 0
#endif
typedef struct {
    int8_t *hi, *lo, *hi8, *lo8;
    int16_t *c;
    int32_t *pair;
    float *dx, *s32, *s16, *f;
    int64_t k, groups;
} qx_rows_t;

static int qx_alloc(qx_rows_t *q, int64_t m, int64_t k) {
    const int64_t groups = k / 32;
    q->hi = malloc((size_t)((6 + PAIR_BYTES) * m * k) + sizeof(float) * (size_t)(m * (4 * groups + X_FLOATS * k)));
    if (q->hi == NULL) return 0;
    q->lo = q->hi + m * k;
    q->hi8 = q->lo + m * k;
    q->lo8 = q->hi8 + m * k;
    q->c = (int16_t *)(q->lo8 + m * k);
    q->pair = PAIR_BYTES ? (int32_t *)(q->c + m * k) : NULL;
    q->dx = (float *)((uint8_t *)(q->c + m * k) + PAIR_BYTES * m * k);
    q->s32 = q->dx + m * groups;
    q->s16 = q->s32 + m * groups;
    q->f = q->s16 + 2 * m * groups;
    q->k = k, q->groups = groups;
    return 1;
}

static inline qx_t qx_row(const qx_rows_t *q, int64_t i) {
    const qx_t xi = {q->hi + i * q->k, q->lo + i * q->k, q->dx + i * q->groups, q->s16 + 2 * i * q->groups,
                     q->s32 + i * q->groups, q->f + X_FLOATS * i * q->k, q->c + i * q->k, q->hi8 + i * q->k,
                     q->lo8 + i * q->k};
    return xi;
}

/* Group g of the rows (row g / groups, its values from 32 (g % groups)) quantized from 32 floats. The
 * whole codes c = 255 hi + lo go to c as 16 of the group's even positions, then its 16 odd ones: the
 * order in which widen_even_odd lays out a weight block's bytes, so that 16-bit multiply-adds of
 * the two halves sum each run of four positions into one lane, as the byte dot products do. With
 * AVX-512, word p of the group's 16 in `pair` holds the codes of positions p (low half) and p + 16: the
 * positions that a 32-weight block's byte p holds for the nibble types (wide_fn). */
static inline void qx_set(const qx_rows_t *q, int64_t g, const float *values) {
    int8_t *hi = q->hi + 32 * g, *lo = q->lo + 32 * g;
    quantize_group(values, hi, lo, q->hi8 + 32 * g, q->lo8 + 32 * g, q->dx + g, q->s16 + 2 * g, q->s32 + g,
                   q->f + X_FLOATS * 32 * g);
    for (int l = 0; l < 32; l++) q->c[32 * g + l / 2 + 16 * (l & 1)] = (int16_t)(255 * hi[l] + lo[l]);
#ifdef LLMX_AVX512
    for (int p = 0; p < 16; p++)
        q->pair[16 * g + p] = (int32_t)((uint32_t)(uint16_t)(255 * hi[p] + lo[p]) |
                                        (uint32_t)(uint16_t)(255 * hi[p + 16] + lo[p + 16]) << 16);
#endif
}

/* Every row of x quantized: inside a parallel region the groups shared out among the team, outside
 * it on the calling thread. */
static void qx_fill(const qx_rows_t *q, const float *x, int64_t m) {
#pragma omp for schedule(static)
    for (int64_t g = 0; g < m * q->groups; g++) qx_set(q, g, x + 32 * g);
}

/* --- one row of W times several rows of x --------------------------------------------------------- */

/* A decode step of several sequences multiplies each row of W with several rows of x. Calling the dot
 * product once a row of x repeats its unpacking and its byte products a row: on the 2-core CI machine
 * 8 rows of x cost 6-7x what one costs (in L2), so batched decode hardly beat one sequence. Here a
 * block's codes are unpacked once, widened to 16 bits, for up to ROW_TILE rows of x, and each x row
 * multiplies them with its codes whole (qx_t.c) in 16-bit multiply-adds: two a group of 32 where the
 * code halves took four byte products and four more instructions to join them. Every lane's integer
 * sum is the one the row's own dot product forms, and the float work after it runs in the same order,
 * so each row's result equals the one-row kernel's to the bit (with AVX2; the AVX-512 dot products
 * sum their lanes in another order): a sequence's logits do not depend on its batch. */
#define ROW_TILE 8 /* x rows a pass over a W row serves: their accumulators stay in L1 */
#ifndef ROWS_FROM
#define ROWS_FROM 2
#endif

/* The product of one row of W (`blocks` blocks) with the x rows xs[0..nx) of qx, into
 * y[t * y_stride] for x row xs[t]. */
typedef void (*rows_fn)(const uint8_t *row, int64_t blocks, const qx_rows_t *qx, const int64_t *xs, int64_t nx,
                        float *y, int64_t y_stride);

#ifdef LLMX_AVX2
/* The x rows of the tile (of up to `tile`) that starts at x row t0 of nx. */
static inline int64_t tile_of(int64_t nx, int64_t t0, int64_t tile) { return nx - t0 < tile ? nx - t0 : tile; }

/* The 32-weight types (kind: L_Q4_0 ...), as dot_legacy_nibbles and dot_q8_0 compute each row: eight
 * blocks at a time, then one by one. */
static inline void rows_legacy(const uint8_t *row, int64_t blocks, const qx_rows_t *qx, const int64_t *xs,
                               int64_t nx, float *y, int64_t y_stride, int kind) {
    const int bytes = legacy_bytes(kind), at = legacy_codes_at(kind), with_m = legacy_has_m(kind);
    const int is_q8 = kind == L_Q8_0;
    for (int64_t t0 = 0; t0 < nx; t0 += ROW_TILE) {
        const int64_t nt = tile_of(nx, t0, ROW_TILE);
        qx_t x[ROW_TILE];
        __m256 acc[ROW_TILE], offsets[ROW_TILE];
        for (int64_t t = 0; t < nt; t++) x[t] = qx_row(qx, xs[t0 + t]), acc[t] = offsets[t] = _mm256_setzero_ps();
        int64_t blk = 0;
        for (; blk + 8 <= blocks; blk += 8) {
            const uint8_t *b = row + bytes * blk;
            if (t0 == 0) prefetch_block(b, 8 * bytes);
            const __m256 d = eight_halves(b, bytes, 0);
            const __m256 m = with_m ? eight_halves(b, bytes, 2) : _mm256_mul_ps(d, _mm256_set1_ps(legacy_offset(kind)));
            /* Four blocks' widened codes at a time: eight blocks' took all sixteen AVX2 registers, so the
             * compiler reloaded them from the stack for every x row (twice the loads a product needs).
             * Each row's sums of blocks 0-3 wait in `first` while blocks 4-7 are multiplied; the eight
             * sums then join as hsum8i joins them, and the float work is add_eight_blocks'. */
            __m128i first[ROW_TILE];
            for (int half = 0; half < 2; half++) {
                __m256i w[4][2];
                for (int i = 0; i < 4; i++) {
                    const uint8_t *q = b + bytes * (4 * half + i);
                    widen_even_odd(is_q8 ? load32(q + at) : nibble_codes(q, kind), is_q8, &w[i][0], &w[i][1]);
                }
                for (int64_t t = 0; t < nt; t++) {
                    const int16_t *c = x[t].c + 32 * (blk + 4 * half);
                    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(dot_group16(w[0], c), dot_group16(w[1], c + 32)),
                                                        _mm256_hadd_epi32(dot_group16(w[2], c + 64), dot_group16(w[3], c + 96)));
                    const __m128i four = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                    if (half == 0) {
                        first[t] = four;
                        continue;
                    }
                    const __m256 sums = _mm256_cvtepi32_ps(_mm256_set_m128i(four, first[t]));
                    acc[t] = _mm256_fmadd_ps(sums, _mm256_mul_ps(d, _mm256_loadu_ps(x[t].d + blk)), acc[t]);
                    if (!is_q8) offsets[t] = _mm256_fmadd_ps(m, _mm256_loadu_ps(x[t].s32 + blk), offsets[t]);
                }
            }
        }
        float total[ROW_TILE];
        for (int64_t t = 0; t < nt; t++) total[t] = is_q8 ? hsum(acc[t]) : hsum(acc[t]) + hsum(offsets[t]);
        for (; blk < blocks; blk++) {
            const uint8_t *b = row + bytes * blk;
            __m256i w[2];
            widen_even_odd(is_q8 ? load32(b + at) : nibble_codes(b, kind), is_q8, &w[0], &w[1]);
            const float d = half_to_float(b), m = with_m ? half_to_float(b + 2) : legacy_offset(kind) * d;
            for (int64_t t = 0; t < nt; t++) {
                total[t] += (float)hsum_epi32(dot_group16(w, x[t].c + 32 * blk)) * (d * x[t].d[blk]);
                if (!is_q8) total[t] += m * x[t].s32[blk];
            }
        }
        for (int64_t t = 0; t < nt; t++) y[(t0 + t) * y_stride] = total[t];
    }
}

static void rows_q4_0(const uint8_t *row, int64_t blocks, const qx_rows_t *qx, const int64_t *xs, int64_t nx,
                      float *y, int64_t y_stride) {
    rows_legacy(row, blocks, qx, xs, nx, y, y_stride, L_Q4_0);
}

static void rows_q4_1(const uint8_t *row, int64_t blocks, const qx_rows_t *qx, const int64_t *xs, int64_t nx,
                      float *y, int64_t y_stride) {
    rows_legacy(row, blocks, qx, xs, nx, y, y_stride, L_Q4_1);
}

static void rows_q8_0(const uint8_t *row, int64_t blocks, const qx_rows_t *qx, const int64_t *xs, int64_t nx,
                      float *y, int64_t y_stride) {
    rows_legacy(row, blocks, qx, xs, nx, y, y_stride, L_Q8_0);
}

static void rows_q5_0(const uint8_t *row, int64_t blocks, const qx_rows_t *qx, const int64_t *xs, int64_t nx,
                      float *y, int64_t y_stride) {
    rows_legacy(row, blocks, qx, xs, nx, y, y_stride, L_Q5_0);
}

static void rows_q5_1(const uint8_t *row, int64_t blocks, const qx_rows_t *qx, const int64_t *xs, int64_t nx,
                      float *y, int64_t y_stride) {
    rows_legacy(row, blocks, qx, xs, nx, y, y_stride, L_Q5_1);
}

/* Q4_K and Q5_K (five), as dot_k_nibbles computes each row (its AVX2 form). */
static inline void rows_k_nibbles(const uint8_t *row, int64_t blocks, const qx_rows_t *qx, const int64_t *xs,
                                  int64_t nx, float *y, int64_t y_stride, int five) {
    const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const int bytes = five ? 176 : 144, nibbles = five ? 48 : 16;
    for (int64_t t0 = 0; t0 < nx; t0 += ROW_TILE) {
        const int64_t nt = tile_of(nx, t0, ROW_TILE);
        qx_t x[ROW_TILE];
        __m256 even[ROW_TILE], odd[ROW_TILE], mins[ROW_TILE];
        for (int64_t t = 0; t < nt; t++)
            x[t] = qx_row(qx, xs[t0 + t]), even[t] = odd[t] = mins[t] = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < blocks; blk++) {
            const uint8_t *b = row + bytes * blk;
            if (t0 == 0) prefetch_block(b, bytes);
            __m256 dsc, dmn;
            k_scales8(b, &dsc, &dmn);
            const __m256i hb = five ? load32(b + 16) : _mm256_setzero_si256();
            __m256i w[8][2]; /* group g's codes: w[g] */
            for (int c = 0; c < 4; c++) {
                const __m256i v = load32(b + nibbles + 32 * c);
                __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                if (five) { /* the fifth bits, as dot_k_nibbles adds them */
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), one), 4));
                }
                widen_even_odd(lo, 0, &w[2 * c][0], &w[2 * c][1]);
                widen_even_odd(hi, 0, &w[2 * c + 1][0], &w[2 * c + 1][1]);
            }
            for (int64_t t = 0; t < nt; t++) {
                float scale[8];
                _mm256_storeu_ps(scale, _mm256_mul_ps(dsc, _mm256_loadu_ps(x[t].d + 8 * blk)));
                mins[t] = _mm256_fmadd_ps(dmn, _mm256_loadu_ps(x[t].s32 + 8 * blk), mins[t]);
                const int16_t *c16 = x[t].c + 256 * blk;
                for (int c = 0; c < 4; c++) {
                    even[t] = add_scaled(dot_group16(w[2 * c], c16 + 64 * c), _mm256_broadcast_ss(scale + 2 * c), even[t]);
                    odd[t] = add_scaled(dot_group16(w[2 * c + 1], c16 + 64 * c + 32), _mm256_broadcast_ss(scale + 2 * c + 1),
                                        odd[t]);
                }
            }
        }
        for (int64_t t = 0; t < nt; t++) y[(t0 + t) * y_stride] = hsum(_mm256_add_ps(even[t], odd[t])) - hsum(mins[t]);
    }
}

static void rows_q4_k(const uint8_t *row, int64_t blocks, const qx_rows_t *qx, const int64_t *xs, int64_t nx,
                      float *y, int64_t y_stride) {
    rows_k_nibbles(row, blocks, qx, xs, nx, y, y_stride, 0);
}

static void rows_q5_k(const uint8_t *row, int64_t blocks, const qx_rows_t *qx, const int64_t *xs, int64_t nx,
                      float *y, int64_t y_stride) {
    rows_k_nibbles(row, blocks, qx, xs, nx, y, y_stride, 1);
}

/* Q6_K, as dot_q6_k computes each row (its AVX2 form): each 16 weights' int8 scale goes into the
 * widened codes once (|63 * 128| fits 16 bits), which is the product the row's own kernel forms
 * with its 16-bit factors. */
static void rows_q6_k(const uint8_t *row, int64_t blocks, const qx_rows_t *qx, const int64_t *xs, int64_t nx,
                      float *y, int64_t y_stride) {
    const __m256i low = _mm256_set1_epi8(15), bits01 = _mm256_set1_epi8(3), bits23 = _mm256_set1_epi8(12),
                  bits45 = _mm256_set1_epi8(48);
    for (int64_t t0 = 0; t0 < nx; t0 += ROW_TILE) {
        const int64_t nt = tile_of(nx, t0, ROW_TILE);
        qx_t x[ROW_TILE];
        __m256 acc[ROW_TILE], offsets[ROW_TILE];
        for (int64_t t = 0; t < nt; t++) x[t] = qx_row(qx, xs[t0 + t]), acc[t] = offsets[t] = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < blocks; blk++) {
            const uint8_t *b = row + 210 * blk;
            if (t0 == 0) prefetch_block(b, 210);
            const __m256 d = _mm256_set1_ps(half_to_float(b + 208));
            const int8_t *sc = (const int8_t *)(b + 192);
            const __m128i sc8 = _mm_loadu_si128((const __m128i *)sc);
            const __m256 sc_lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)),
                         sc_hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8)));
            __m256i w[8][2]; /* quarter 4h + j's codes times their scales: w[4h + j] */
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = b + 64 * h;
                const __m256i a = load32(ql), c = load32(ql + 32), hb = load32(b + 128 + 32 * h);
                const __m256i q[4] = {
                    _mm256_or_si256(_mm256_and_si256(a, low), _mm256_slli_epi16(_mm256_and_si256(hb, bits01), 4)),
                    _mm256_or_si256(_mm256_and_si256(c, low), _mm256_slli_epi16(_mm256_and_si256(hb, bits23), 2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(hb, bits45)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), low),
                                    _mm256_and_si256(_mm256_srli_epi16(hb, 2), bits45)),
                };
                for (int j = 0; j < 4; j++) {
                    /* positions 0..15 (the low 128 bits of each widened half) take scale 2j, 16..31 2j + 1 */
                    const __m256i factors = _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * j + 1]), _mm_set1_epi16(sc[8 * h + 2 * j]));
                    widen_even_odd(q[j], 0, &w[4 * h + j][0], &w[4 * h + j][1]);
                    w[4 * h + j][0] = _mm256_mullo_epi16(w[4 * h + j][0], factors);
                    w[4 * h + j][1] = _mm256_mullo_epi16(w[4 * h + j][1], factors);
                }
            }
            for (int64_t t = 0; t < nt; t++) {
                float scale[8];
                _mm256_storeu_ps(scale, _mm256_mul_ps(d, _mm256_loadu_ps(x[t].d + 8 * blk)));
                const float *s16 = x[t].s16 + 16 * blk;
                offsets[t] = _mm256_fmadd_ps(d, _mm256_fmadd_ps(sc_lo, _mm256_loadu_ps(s16), _mm256_mul_ps(sc_hi, _mm256_loadu_ps(s16 + 8))),
                                             offsets[t]);
                for (int i = 0; i < 8; i++)
                    acc[t] = add_scaled(dot_group16(w[i], x[t].c + 256 * blk + 32 * i), _mm256_broadcast_ss(scale + i), acc[t]);
            }
        }
        for (int64_t t = 0; t < nt; t++) y[(t0 + t) * y_stride] = hsum(acc[t]) - 32.0f * hsum(offsets[t]);
    }
}
#endif

/* The type's kernel of several x rows; NULL where there is none (without AVX2: the rows take turns
 * in the dot product). */
static rows_fn rows_of(int type) {
#ifdef LLMX_AVX2
    switch (type) {
    case T_Q4_K: return rows_q4_k;
    case T_Q6_K: return rows_q6_k;
    case T_Q8_0: return rows_q8_0;
    case T_Q4_0: return rows_q4_0;
    case T_Q4_1: return rows_q4_1;
    case T_Q5_K: return rows_q5_k;
    case T_Q5_0: return rows_q5_0;
    case T_Q5_1: return rows_q5_1;
    default: return NULL;
    }
#else
    (void)type;
    return NULL;
#endif
}

/* --- sixteen rows of W times several rows of x ------------------------------------------------------- */

/* rows_legacy multiplies one W row with each x row as the one-row kernel does: a block's products in a
 * vector of lanes, joined across the lanes before the block's scales apply. At 8 x rows those joins
 * and the float work around them cost more than the multiply-adds (~61 micro-ops for 256 products).
 * A wide kernel takes W_TILE = 16 rows of W at once, row r in 32-bit lane r: a block's codes of the
 * 16 rows are transposed so that one register holds the same two positions (p, p + 16) of every row,
 * which each x row multiplies by its own two codes broadcast (qx_rows_t.pair; VNNI's dpwssd on
 * 16-bit codes): 16 multiply-adds give the 16 rows' exact block sums, with no join. The transpose is
 * shared by the x rows. The float work then runs as the one-row kernel's for each pair of rows (the
 * lanes of blocks b mod 8 kept apart, joined by hsum's tree, a row's last blocks one by one), so each
 * product equals the one-row kernel's to the bit. On the 2-core Zen 4 (one thread, Q4_1 in cache:
 * bench/cpu_rows.py) 8 x rows take 534 us where a W row at a time took 760, 4 rows 268 against 440,
 * 2 rows 202 against 290: from 4 rows the time grows with the x rows alone, the multiply-adds bound it.
 * One x row keeps the one-row kernel (175 us against 191 for Q4_1, but 123 against 110 for Q8_0). The
 * K-quants take the same form a group of 32 weights at a time (wide_k_tile, wide_q6_k_tile), their float
 * sums in an order of their own: 8 x rows Q4_K 1053 -> 549 us, Q5_K 866 -> 560-659, Q6_K 697 -> 565; Q5_0
 * and Q5_1 the 32-weight form with their fifth bits (671-674 -> 477-498).
 * With AVX2 alone (no dpwssd: a 16-bit multiply-add, then an add) the 32-weight types take the same form,
 * a tile's 16 rows in two registers of 8 so that each broadcast x code serves two multiply-adds; x's codes
 * are read in qx_t.c's order, which shifts of the W rows' bytes give without a byte shuffle (lane_words).
 * On the 2-core Zen 3 (one thread, 2 MiB from L3: bench/cpu_rows.py) Q4_1 at 8 x rows 2000 -> 1385 us,
 * 4 rows 1144 -> 700, 2 rows 740 -> 444; Q4_0 alike; Q8_0, Q5_0 and Q5_1, whose codes transpose as whole
 * bytes, 1.1-1.3x (their helpers inlined by force: GCC called them, the arrays through memory). The
 * K-quants keep rows_fn there. */
/* x rows a wide kernel's pass over its W tile serves: AVX2's sixteen registers hold the sums of four
 * (two registers each) beside a pair of W codes and a broadcast x code. Eight a pass, sharing a block's
 * pairs between two such groups, are level with two passes of four (one Zen 3 thread, Q4_1, 8 x rows,
 * 2 MiB: 870-1140 us either way); with 8 W rows a register they had spilled (1350-1400). */
#ifndef WIDE_ROWS
#ifdef LLMX_AVX512
#define WIDE_ROWS ROW_TILE
#else
#define WIDE_ROWS 4
#endif
#endif
typedef void (*wide_fn)(const uint8_t *w, int64_t row_bytes, int64_t blocks, const qx_rows_t *qx, const int64_t *xs,
                        int64_t nx, float *y, int64_t y_stride);
#define W_TILE 16
/* x rows from which a pass takes a type's wide kernel (fewer are as fast a W row at a time: bench/cpu_rows.py,
 * one thread; Q4_1 at 2 rows 1.44x, Q4_K level, Q5_K 0.8x; Q6_K at 3 rows 0.9x) */
#ifndef WIDE_FROM
#define WIDE_FROM 2 /* the 32-weight types */
#endif
#ifndef WIDE_K_FROM
#define WIDE_K_FROM 3 /* Q4_K, Q5_K */
#endif
#ifndef WIDE_Q6_K_FROM
#define WIDE_Q6_K_FROM 4
#endif

/* The wide kernels' registers: a tile's W_TILE rows, one a 32-bit lane (with AVX2 in two registers), and
 * the float work on them (lanes_t) written once for both widths. */
#ifdef LLMX_AVX512
typedef __m512 lanes_t;
typedef __m512i lane_codes_t;
static inline lanes_t lanes_zero(void) { return _mm512_setzero_ps(); }
static inline lanes_t lanes_of(float v) { return _mm512_set1_ps(v); }
static inline lanes_t lanes_add(lanes_t a, lanes_t b) { return _mm512_add_ps(a, b); }
static inline lanes_t lanes_mul(lanes_t a, lanes_t b) { return _mm512_mul_ps(a, b); }
static inline lanes_t lanes_fmadd(lanes_t a, lanes_t b, lanes_t c) { return _mm512_fmadd_ps(a, b, c); }
static inline void lanes_store(float *p, lanes_t v) { _mm512_storeu_ps(p, v); }
/* x's codes as the multiply-adds broadcast them: word p of a group holds positions p and p + 16 */
static inline const int32_t *lane_words(const qx_rows_t *qx) { return qx->pair; }

/* The 16 x 16 matrix of 32-bit words v (row i in v[i]) transposed in place. */
static inline void transpose16(__m512i v[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* b[i + j], 128-bit lane L: column 4L + j of rows i .. i + 3 */
        b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    for (int j = 0; j < 4; j++) { /* the 4 x 4 matrix of 128-bit lanes b[j], b[4 + j], b[8 + j], b[12 + j] */
        const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x44), c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xEE);
        const __m512i c2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x44);
        const __m512i c3 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xEE);
        v[j] = _mm512_shuffle_i32x4(c0, c2, 0x88);
        v[4 + j] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
        v[8 + j] = _mm512_shuffle_i32x4(c1, c3, 0x88);
        v[12 + j] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
    }
}

/* The 16 x 8 matrix of 32-bit words v (row i in v[i], its words 0-7) transposed: out[j] lane i holds
 * word j of row i. */
static inline void transpose16x8(const __m256i v[16], __m512i out[8]) {
    __m512i a[8], b[8], c[8];
    for (int i = 0; i < 8; i++) { /* rows k and k + 4 side by side (k: 0-3, 8-11): 8 x 8 transposes in both halves */
        const int k = i < 4 ? i : i + 4;
        a[i] = _mm512_inserti64x4(_mm512_castsi256_si512(v[k]), v[k + 4], 1);
    }
    for (int i = 0; i < 8; i += 2) {
        b[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]);
        b[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        c[i] = _mm512_unpacklo_epi64(b[i], b[i + 2]);
        c[i + 1] = _mm512_unpackhi_epi64(b[i], b[i + 2]);
        c[i + 2] = _mm512_unpacklo_epi64(b[i + 1], b[i + 3]);
        c[i + 3] = _mm512_unpackhi_epi64(b[i + 1], b[i + 3]);
    } /* c[i + j], 128-bit lane L: word 4 (L % 2) + j of rows 2i + 4 (L / 2) .. + 3 */
    for (int j = 0; j < 4; j++) {
        out[j] = _mm512_shuffle_i32x4(c[j], c[4 + j], 0x88);     /* lanes 0, 2 of each: words j */
        out[4 + j] = _mm512_shuffle_i32x4(c[j], c[4 + j], 0xDD); /* lanes 1, 3: words 4 + j */
    }
}

/* The 32 bytes at p as 16 words of two halves: bytes i (low half) and i + 16, zero- or sign-extended. */
static inline __m512i byte_pairs(const uint8_t *p, int is_signed) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                                6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m256i v = load32(p);
    return _mm512_permutexvar_epi16(interleave, is_signed ? _mm512_cvtepi8_epi16(v) : _mm512_cvtepu8_epi16(v));
}

/* Block b of 16 rows row_bytes apart (`kind`: any of the 32-weight types) as pairs of codes: wp[p] lane r
 * holds row r's codes of positions p (low 16 bits) and p + 16 (the nibble types: byte p's two nibbles,
 * with Q5_0's and Q5_1's fifth bits p and p + 16; Q8_0: bytes p and p + 16, signed); returns the rows' d
 * (and Q4_1's and Q5_1's m) as floats. */
static inline void legacy_pairs(const uint8_t *b, int64_t row_bytes, int kind, __m512i wp[16], __m512 *d, __m512 *m) {
    if (kind == L_Q8_0) {
        for (int r = 0; r < W_TILE; r++) wp[r] = byte_pairs(b + r * row_bytes + 2, 1);
        transpose16(wp);
        uint16_t halves[W_TILE]; /* the rows' d: cheaper through memory than a gather */
        for (int r = 0; r < W_TILE; r++) memcpy(halves + r, b + r * row_bytes, 2);
        *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)halves));
        return;
    }
    /* Each row's block read as words (masked: no byte outside it): d (and m) in the first word, Q5's qh
     * in the next, then the 16 bytes of nibbles; the types without m from 2 bytes before the block, so
     * that d fills the first word's high half. */
    const int shifted = !legacy_has_m(kind), five = kind == L_Q5_0 || kind == L_Q5_1;
    const int bytes = legacy_bytes(kind) + 2 * shifted;
    const __mmask32 inside = ((bytes == 32 ? 0xFFFFFFFFu : (1u << bytes) - 1u) >> (2 * shifted)) << (2 * shifted);
    __m256i rows[16];
    __m512i words[8];
    for (int r = 0; r < W_TILE; r++) rows[r] = _mm256_maskz_loadu_epi8(inside, b + r * row_bytes - 2 * shifted);
    transpose16x8(rows, words);
    const __m512i dm = shifted ? _mm512_srli_epi32(words[0], 16) : words[0];
    *d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
    *m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
    const __m512i keep = _mm512_set1_epi32(0x000F000F), bit = _mm512_set1_epi32(0x00010001);
    const int codes = 1 + five;
    for (int p = 0; p < 16; p++) { /* byte p: word codes + p / 4, its byte p % 4 */
        const __m512i v = _mm512_and_si512(_mm512_srli_epi32(words[codes + p / 4], 8 * (p % 4)), _mm512_set1_epi32(0xFF));
        wp[p] = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), keep, 0xA8); /* (v | v << 12) & keep */
        if (five) /* qh's bits p and p + 16 to bit 4 of the two codes */
            wp[p] = _mm512_or_si512(wp[p], _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(words[1], p), bit), 4));
    }
}

/* Row r's exact integer sums of block blk with each of `rows` x rows' codes (pairs[t]: its words) in lane
 * r of sums[t], as floats. The x rows' multiply-adds interleave: each row's chain of 16 waits on itself. */
static inline __attribute__((always_inline)) void block_sums(const __m512i wp[16], const int32_t *const pairs[ROW_TILE],
                                                             int64_t blk, __m512 sums[ROW_TILE], int rows) {
    __m512i s[ROW_TILE];
    for (int t = 0; t < rows; t++) s[t] = _mm512_setzero_si512();
    for (int p = 0; p < 16; p++)
        for (int t = 0; t < rows; t++) s[t] = _mm512_dpwssd_epi32(s[t], wp[p], _mm512_set1_epi32(pairs[t][16 * blk + p]));
    for (int t = 0; t < rows; t++) sums[t] = _mm512_cvtepi32_ps(s[t]);
}

/* block_sums16 for codes up to 4096 in size (Q6_K's times their scales): 32 such products of x's codes
 * could pass int32, so the two halves of the pairs sum apart and meet as floats. */
static inline __attribute__((always_inline)) void block_sums16_halves(const __m512i wp[16],
                                                                      const int32_t *const pairs[ROW_TILE], int64_t blk,
                                                                      __m512 sums[ROW_TILE], int rows) {
    __m512i s[ROW_TILE], s2[ROW_TILE];
    for (int t = 0; t < rows; t++) s[t] = s2[t] = _mm512_setzero_si512();
    for (int p = 0; p < 8; p++)
        for (int t = 0; t < rows; t++) {
            s[t] = _mm512_dpwssd_epi32(s[t], wp[p], _mm512_set1_epi32(pairs[t][16 * blk + p]));
            s2[t] = _mm512_dpwssd_epi32(s2[t], wp[p + 8], _mm512_set1_epi32(pairs[t][16 * blk + p + 8]));
        }
    for (int t = 0; t < rows; t++) sums[t] = _mm512_add_ps(_mm512_cvtepi32_ps(s[t]), _mm512_cvtepi32_ps(s2[t]));
}

#elif defined(LLMX_AVX2)
/* AVX2 takes a tile's 16 rows as two registers of 8 (rows 0-7, then 8-15): each x code broadcast then
 * serves two multiply-adds, and the float work is that of two 8-lane registers side by side. */
typedef struct {
    __m256 h[2];
} lanes_t;
typedef struct {
    __m256i h[2];
} lane_codes_t;
static inline lanes_t lanes_zero(void) { return (lanes_t){{_mm256_setzero_ps(), _mm256_setzero_ps()}}; }
static inline lanes_t lanes_of(float v) { return (lanes_t){{_mm256_set1_ps(v), _mm256_set1_ps(v)}}; }
static inline lanes_t lanes_add(lanes_t a, lanes_t b) {
    return (lanes_t){{_mm256_add_ps(a.h[0], b.h[0]), _mm256_add_ps(a.h[1], b.h[1])}};
}
static inline lanes_t lanes_mul(lanes_t a, lanes_t b) {
    return (lanes_t){{_mm256_mul_ps(a.h[0], b.h[0]), _mm256_mul_ps(a.h[1], b.h[1])}};
}
static inline lanes_t lanes_fmadd(lanes_t a, lanes_t b, lanes_t c) {
    return (lanes_t){{_mm256_fmadd_ps(a.h[0], b.h[0], c.h[0]), _mm256_fmadd_ps(a.h[1], b.h[1], c.h[1])}};
}
static inline void lanes_store(float *p, lanes_t v) { _mm256_storeu_ps(p, v.h[0]), _mm256_storeu_ps(p + 8, v.h[1]); }
/* x's codes as qx_t.c lays them out, read in words: word j of a group holds positions 4j and 4j + 2, word
 * 8 + j positions 4j + 1 and 4j + 3 (j < 8), the pairs that 16-bit shifts of a W row's bytes give */
static inline const int32_t *lane_words(const qx_rows_t *qx) { return (const int32_t *)qx->c; }

/* The 8 x 8 matrix of 32-bit words v (row i in v[i]) transposed in place. */
static inline __attribute__((always_inline)) void transpose8(__m256i v[8]) {
    __m256i a[8], b[8];
    for (int i = 0; i < 8; i += 2) { /* a[i]: words 0, 1 of rows i, i + 1 (then 4, 5); a[i + 1]: 2, 3 (6, 7) */
        a[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
        a[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* b[i + j]: word j of rows i .. i + 3, then word 4 + j */
        b[i] = _mm256_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm256_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm256_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm256_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_permute2x128_si256(b[j], b[4 + j], 0x20);
        v[4 + j] = _mm256_permute2x128_si256(b[j], b[4 + j], 0x31);
    }
}

/* Lanes of the 16 bytes at b + at of 8 rows row_bytes apart, rows r and r + 4 side by side: v[k] holds
 * rows k (low 128 bits) and k + 4. */
static inline __attribute__((always_inline)) void rows_side_by_side(const uint8_t *b, int64_t row_bytes, int at,
                                                                    __m256i v[4]) {
    for (int k = 0; k < 4; k++)
        v[k] = _mm256_loadu2_m128i((const __m128i *)(b + (k + 4) * row_bytes + at), (const __m128i *)(b + k * row_bytes + at));
}

/* Half h of legacy_pairs: the block at b of 8 rows (wp[j].h[h] lane r: row r's codes at the positions of
 * x's word j, lane_words) and their d and m. Q4_0's and Q4_1's nibbles transpose as 4 words a row, each
 * byte's two codes then taken apart in 16-bit lanes; Q8_0's codes and the 5-bit codes (nibble_codes) as
 * 8 words a row of whole bytes. */
static inline __attribute__((always_inline)) void legacy_pairs8(const uint8_t *b, int64_t row_bytes, int kind, int h,
                                                                lane_codes_t wp[16], lanes_t *d, lanes_t *m) {
    __m256i v[8], a[4];
    rows_side_by_side(b, row_bytes, 0, v); /* the rows' first words: d (low half), then Q4_1's and Q5_1's m */
    const __m256i first = _mm256_unpacklo_epi64(_mm256_unpacklo_epi32(v[0], v[1]), _mm256_unpacklo_epi32(v[2], v[3]));
    const __m256i dm = _mm256_permute4x64_epi64( /* packed, the 64-bit quarters in order: d's, then m's */
        _mm256_packus_epi32(_mm256_and_si256(first, _mm256_set1_epi32(0xffff)), _mm256_srli_epi32(first, 16)), 0xD8);
    d->h[h] = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
    if (legacy_has_m(kind)) m->h[h] = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
    if (kind == L_Q4_0 || kind == L_Q4_1) {
        const __m256i nibble = _mm256_set1_epi32(0x000F000F);
        rows_side_by_side(b, row_bytes, legacy_codes_at(kind), v);
        for (int k = 0; k < 2; k++) {
            a[2 * k] = _mm256_unpacklo_epi32(v[2 * k], v[2 * k + 1]);
            a[2 * k + 1] = _mm256_unpackhi_epi32(v[2 * k], v[2 * k + 1]);
        }
        for (int j = 0; j < 4; j++) { /* lane r of t: row r's bytes 4j .. 4j + 3, byte p's nibbles positions p, p + 16 */
            const __m256i t = j & 1 ? _mm256_unpackhi_epi64(a[j / 2], a[j / 2 + 2]) : _mm256_unpacklo_epi64(a[j / 2], a[j / 2 + 2]);
            wp[j].h[h] = _mm256_and_si256(t, nibble);                            /* positions 4j, 4j + 2 */
            wp[4 + j].h[h] = _mm256_and_si256(_mm256_srli_epi16(t, 4), nibble); /* 16 + 4j, 16 + 4j + 2 */
            wp[8 + j].h[h] = _mm256_and_si256(_mm256_srli_epi16(t, 8), nibble); /* 4j + 1, 4j + 3 */
            wp[12 + j].h[h] = _mm256_srli_epi16(t, 12);                          /* 16 + 4j + 1, 16 + 4j + 3 */
        }
        return;
    }
    const int is_q8 = kind == L_Q8_0;
    for (int r = 0; r < 8; r++) v[r] = is_q8 ? load32(b + r * row_bytes + 2) : nibble_codes(b + r * row_bytes, kind);
    transpose8(v);
    for (int j = 0; j < 8; j++) { /* lane r of v[j]: row r's codes 4j .. 4j + 3, a byte each */
        wp[j].h[h] = is_q8 ? _mm256_srai_epi16(_mm256_slli_epi16(v[j], 8), 8) : _mm256_and_si256(v[j], _mm256_set1_epi16(0xff));
        wp[8 + j].h[h] = is_q8 ? _mm256_srai_epi16(v[j], 8) : _mm256_srli_epi16(v[j], 8);
    }
}

/* Block b of 16 rows row_bytes apart (`kind`: any of the 32-weight types) as pairs of codes, 8 rows a
 * register (legacy_pairs8), and the rows' d (and Q4_1's and Q5_1's m) as floats. */
static inline __attribute__((always_inline)) void legacy_pairs(const uint8_t *b, int64_t row_bytes, int kind,
                                                               lane_codes_t wp[16], lanes_t *d, lanes_t *m) {
    legacy_pairs8(b, row_bytes, kind, 0, wp, d, m);
    legacy_pairs8(b + 8 * row_bytes, row_bytes, kind, 1, wp, d, m);
}

/* Four x rows' sums of a block (block_sums), in eight named registers. */
static inline __attribute__((always_inline)) void block_sums4(const lane_codes_t wp[16], const int32_t *const words[4],
                                                              int64_t at, lanes_t sums[4], int n) {
    __m256i s00 = _mm256_setzero_si256(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00, s30 = s00, s31 = s00;
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        const __m256i w0 = wp[j].h[0], w1 = wp[j].h[1];
        __m256i x = _mm256_set1_epi32(words[0][at + j]);
        s00 = _mm256_add_epi32(s00, _mm256_madd_epi16(w0, x)), s01 = _mm256_add_epi32(s01, _mm256_madd_epi16(w1, x));
        if (n > 1) {
            x = _mm256_set1_epi32(words[1][at + j]);
            s10 = _mm256_add_epi32(s10, _mm256_madd_epi16(w0, x)), s11 = _mm256_add_epi32(s11, _mm256_madd_epi16(w1, x));
        }
        if (n > 2) {
            x = _mm256_set1_epi32(words[2][at + j]);
            s20 = _mm256_add_epi32(s20, _mm256_madd_epi16(w0, x)), s21 = _mm256_add_epi32(s21, _mm256_madd_epi16(w1, x));
            x = _mm256_set1_epi32(words[3][at + j]);
            s30 = _mm256_add_epi32(s30, _mm256_madd_epi16(w0, x)), s31 = _mm256_add_epi32(s31, _mm256_madd_epi16(w1, x));
        }
        /* the sums as they stand, in registers: else GCC reassociates the integer adds, forms every
         * product first and keeps them on the stack */
        __asm__("" : "+x"(s00), "+x"(s01), "+x"(s10), "+x"(s11), "+x"(s20), "+x"(s21), "+x"(s30), "+x"(s31));
    }
    sums[0] = (lanes_t){{_mm256_cvtepi32_ps(s00), _mm256_cvtepi32_ps(s01)}};
    if (n > 1) sums[1] = (lanes_t){{_mm256_cvtepi32_ps(s10), _mm256_cvtepi32_ps(s11)}};
    if (n > 2) {
        sums[2] = (lanes_t){{_mm256_cvtepi32_ps(s20), _mm256_cvtepi32_ps(s21)}};
        sums[3] = (lanes_t){{_mm256_cvtepi32_ps(s30), _mm256_cvtepi32_ps(s31)}};
    }
}

/* Row r's exact integer sums of block blk with each of `rows` x rows' codes (words[t]: lane_words of its
 * row) in lane r of sums[t], as floats: sixteen 16-bit multiply-adds an x row and register of rows, each
 * x code broadcast once for both registers; the x rows four at a time. */
static inline __attribute__((always_inline)) void block_sums(const lane_codes_t wp[16], const int32_t *const words[ROW_TILE],
                                                             int64_t blk, lanes_t sums[ROW_TILE], int rows) {
    for (int t0 = 0; t0 < rows; t0 += 4) block_sums4(wp, words + t0, 16 * blk, sums + t0, rows < 4 ? rows : 4);
}
#endif

#ifdef LLMX_AVX2
/* Where a tile's `rows` x rows read their codes (lane_words), scales and sums: xs[0..nt), the rest
 * repeating the last (their results are dropped). */
static inline __attribute__((always_inline)) void tile_x(const qx_rows_t *qx, const int64_t *xs, int64_t nt, int rows,
                                                         const int32_t *words[ROW_TILE], const float *dx[ROW_TILE],
                                                         const float *s32[ROW_TILE]) {
    for (int t = 0; t < rows; t++) {
        const int64_t row = xs[t < nt ? t : nt - 1];
        words[t] = lane_words(qx) + row * (qx->k / 2), dx[t] = qx->dx + row * qx->groups, s32[t] = qx->s32 + row * qx->groups;
    }
}

/* Block blk's share (`share`: the bytes of a block of all the rows ahead) of the next rows' bytes asked
 * for (`next`: those rows, NULL: none), so that a tile's stream from RAM runs ahead of its products.
 * Inlined by force: GCC found a call of it "looping const" (prefetches have no effect it can see) and
 * removed every call, so that the wide kernels streamed with no prefetch at all. */
static inline __attribute__((always_inline)) void prefetch_share(const uint8_t *next, int share, int64_t blk) {
    if (next != NULL)
        for (int o = 0; o < share; o += 64) _mm_prefetch((const char *)(next + share * blk + o), _MM_HINT_T0);
}

/* hsum's tree over the lanes of blocks b mod 8, one (row, x row) a lane. */
static inline lanes_t tree8(const lanes_t a[8]) {
    return lanes_add(lanes_add(lanes_add(a[0], a[4]), lanes_add(a[2], a[6])),
                     lanes_add(lanes_add(a[1], a[5]), lanes_add(a[3], a[7])));
}

/* Block blk of W_TILE rows: their products with each of `rows` x rows (sums[t], row r in lane r) and
 * the rows' d and m (Q4_0's m: its offset times d), with its share of the next rows asked for. */
static inline __attribute__((always_inline)) void wide_block(const uint8_t *w, int64_t row_bytes, int64_t blk, int kind,
                                                             const uint8_t *next, const int32_t *const words[ROW_TILE],
                                                             lanes_t sums[ROW_TILE], lanes_t *d, lanes_t *m, int rows) {
    const int bytes = legacy_bytes(kind);
    prefetch_share(next, W_TILE * bytes, blk);
    lane_codes_t wp[16];
    legacy_pairs(w + bytes * blk, row_bytes, kind, wp, d, m);
    if (!legacy_has_m(kind)) *m = lanes_mul(*d, lanes_of(legacy_offset(kind)));
    block_sums(wp, words, blk, sums, rows);
}

/* W_TILE W rows times `rows` x rows (1, 2, 4 or 8; xs[0..nt), the rest repeating the last, their
 * results dropped) for the 32-weight types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), as dot_legacy_nibbles and
 * dot_q8_0 compute each product: eight blocks at a time into lanes b mod 8, hsum's tree, then the last
 * blocks. */
static inline __attribute__((always_inline)) void wide_tile(const uint8_t *w, int64_t row_bytes, int64_t blocks,
                                                            const qx_rows_t *qx, const int64_t *xs, int64_t nt,
                                                            const uint8_t *next, float *y, int64_t y_stride, int kind,
                                                            int rows) {
    const int is_q8 = kind == L_Q8_0;
    const int32_t *words[ROW_TILE];
    const float *dx[ROW_TILE], *s32[ROW_TILE];
    lanes_t acc[ROW_TILE][8], offsets[ROW_TILE][8], total[ROW_TILE], sums[ROW_TILE], d, m;
    tile_x(qx, xs, nt, rows, words, dx, s32);
    for (int t = 0; t < rows; t++)
        for (int i = 0; i < 8; i++) acc[t][i] = offsets[t][i] = lanes_zero();
    int64_t blk = 0;
    for (; blk + 8 <= blocks; blk += 8)
        for (int i = 0; i < 8; i++) {
            wide_block(w, row_bytes, blk + i, kind, next, words, sums, &d, &m, rows);
            for (int t = 0; t < rows; t++) {
                acc[t][i] = lanes_fmadd(sums[t], lanes_mul(d, lanes_of(dx[t][blk + i])), acc[t][i]);
                if (!is_q8) offsets[t][i] = lanes_fmadd(m, lanes_of(s32[t][blk + i]), offsets[t][i]);
            }
        }
    for (int t = 0; t < rows; t++) total[t] = is_q8 ? tree8(acc[t]) : lanes_add(tree8(acc[t]), tree8(offsets[t]));
    for (; blk < blocks; blk++) {
        wide_block(w, row_bytes, blk, kind, next, words, sums, &d, &m, rows);
        for (int t = 0; t < rows; t++) {
            total[t] = lanes_fmadd(sums[t], lanes_mul(d, lanes_of(dx[t][blk])), total[t]);
            if (!is_q8) total[t] = lanes_fmadd(m, lanes_of(s32[t][blk]), total[t]);
        }
    }
    for (int64_t t = 0; t < nt; t++) lanes_store(y + t * y_stride, total[t]);
}

#ifdef LLMX_AVX512
/* Q4_K and Q5_K (five) in tiles of 16 W rows: each sub-block of 32 weights as a group of the legacy
 * types (its 16 pairs of positions p and p + 16 transposed, dpwssd with each x row's pairs), times the
 * rows' d * scale of the sub-block, less their dmin * min times x's sums. Its float sums run in their
 * own order (as the one-row kernels of AVX-512 do against those of 256 bits: a row's bits may differ in
 * the last place from its product alone). */
static inline __attribute__((always_inline)) void wide_k_tile(const uint8_t *w, int64_t row_bytes, int64_t blocks,
                                                              const qx_rows_t *qx, const int64_t *xs, int64_t nt,
                                                              const uint8_t *next, float *y, int64_t y_stride,
                                                              int five, int rows) {
    const int bytes = five ? 176 : 144, nibbles = five ? 48 : 16;
    const __m512i keep = _mm512_set1_epi32(0x000F000F), bit = _mm512_set1_epi32(0x00010001);
    const int32_t *pairs[ROW_TILE];
    const float *dx[ROW_TILE], *s32[ROW_TILE];
    __m512 acc[ROW_TILE], sums[ROW_TILE];
    tile_x(qx, xs, nt, rows, pairs, dx, s32);
    for (int t = 0; t < rows; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint8_t *b = w + bytes * blk;
        prefetch_share(next, W_TILE * bytes, blk);
        __m256i dsc_rows[W_TILE], dmn_rows[W_TILE];
        __m512i dsc[8], dmn[8]; /* sub-block s: its d * scale, dmin * min of the 16 rows */
        for (int r = 0; r < W_TILE; r++) {
            __m256 a, c;
            k_scales8(b + r * row_bytes, &a, &c);
            dsc_rows[r] = _mm256_castps_si256(a), dmn_rows[r] = _mm256_castps_si256(c);
        }
        transpose16x8(dsc_rows, dsc);
        transpose16x8(dmn_rows, dmn);
        for (int sb = 0; sb < 8; sb++) { /* sub-block sb: nibbles (low of even sb, high of odd) of bytes 32 (sb / 2) .. */
            const int64_t g = 8 * blk + sb;
            __m512i wp[16];
            for (int r = 0; r < W_TILE; r++) {
                const uint8_t *row = b + r * row_bytes;
                const __m512i v = byte_pairs(row + nibbles + 32 * (sb / 2), 0);
                wp[r] = _mm512_and_si512(sb & 1 ? _mm512_srli_epi16(v, 4) : v, keep);
                if (five) { /* bit sb of qh's bytes p and p + 16, to bit 4 of the codes */
                    const __m512i h = byte_pairs(row + 16, 0);
                    wp[r] = _mm512_or_si512(wp[r], _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, sb), bit), 4));
                }
            }
            transpose16(wp);
            block_sums(wp, pairs, g, sums, rows);
            for (int t = 0; t < rows; t++) {
                const __m512 scale = _mm512_mul_ps(_mm512_castsi512_ps(dsc[sb]), _mm512_set1_ps(dx[t][g]));
                acc[t] = _mm512_fnmadd_ps(_mm512_castsi512_ps(dmn[sb]), _mm512_set1_ps(s32[t][g]),
                                          _mm512_fmadd_ps(sums[t], scale, acc[t]));
            }
        }
    }
    for (int64_t t = 0; t < nt; t++) _mm512_storeu_ps(y + t * y_stride, acc[t]);
}

/* Q6_K in tiles of 16 W rows: each group of 32 weights as the legacy types' blocks, its codes (q - 32)
 * times their 16-weight scale in 16 bits (|.| <= 4096), times the rows' d. */
static inline __attribute__((always_inline)) void wide_q6_k_tile(const uint8_t *w, int64_t row_bytes, int64_t blocks,
                                                                 const qx_rows_t *qx, const int64_t *xs, int64_t nt,
                                                                 const uint8_t *next, float *y, int64_t y_stride,
                                                                 int rows) {
    const __m512i low = _mm512_set1_epi32(0x000F000F), two = _mm512_set1_epi32(0x00030003);
    const __m512i offset = _mm512_set1_epi16(32);
    const int32_t *pairs[ROW_TILE];
    const float *dx[ROW_TILE], *s32[ROW_TILE];
    __m512 acc[ROW_TILE], sums[ROW_TILE];
    tile_x(qx, xs, nt, rows, pairs, dx, s32);
    for (int t = 0; t < rows; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint8_t *b = w + 210 * blk;
        prefetch_share(next, W_TILE * 210, blk);
        uint16_t halves[W_TILE];
        for (int r = 0; r < W_TILE; r++) memcpy(halves + r, b + r * row_bytes + 208, 2);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)halves));
        for (int grp = 0; grp < 8; grp++) { /* weights 32 grp ..: half h, quarter j of ql/qh as decode_q6_k reads */
            const int h = grp / 4, j = grp % 4;
            __m512i wp[16];
            for (int r = 0; r < W_TILE; r++) {
                const uint8_t *row = b + r * row_bytes;
                const __m512i l = byte_pairs(row + 64 * h + 32 * (j & 1), 0), q = byte_pairs(row + 128 + 32 * h, 0);
                const __m512i nib = _mm512_and_si512(j & 2 ? _mm512_srli_epi16(l, 4) : l, low);
                const __m512i high = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(q, 2 * j), two), 4);
                const int8_t *sc = (const int8_t *)(row + 192 + 8 * h + 2 * j); /* positions p, then p + 16 */
                const __m512i scale = _mm512_set1_epi32((int32_t)((uint32_t)(uint16_t)sc[0] | (uint32_t)(uint16_t)sc[1] << 16));
                wp[r] = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_or_si512(nib, high), offset), scale);
            }
            transpose16(wp);
            block_sums16_halves(wp, pairs, 8 * blk + grp, sums, rows);
            for (int t = 0; t < rows; t++)
                acc[t] = _mm512_fmadd_ps(sums[t], _mm512_mul_ps(d, _mm512_set1_ps(dx[t][8 * blk + grp])), acc[t]);
        }
    }
    for (int64_t t = 0; t < nt; t++) _mm512_storeu_ps(y + t * y_stride, acc[t]);
}

#endif

/* The legacy kind of one of the 32-weight types. */
static inline int legacy_kind(int type) {
    switch (type) {
    case T_Q4_0: return L_Q4_0;
    case T_Q4_1: return L_Q4_1;
    case T_Q5_0: return L_Q5_0;
    case T_Q5_1: return L_Q5_1;
    default: return L_Q8_0;
    }
}

/* W_TILE W rows of `type`'s wide kernel, its `rows` (a constant where the call is inlined) x rows at a time. */
static inline __attribute__((always_inline)) void wide_type_tile(int type, const uint8_t *w, int64_t row_bytes,
                                                                 int64_t blocks, const qx_rows_t *qx, const int64_t *xs,
                                                                 int64_t nt, const uint8_t *next, float *y,
                                                                 int64_t y_stride, int rows) {
#ifdef LLMX_AVX512
    if (type == T_Q6_K) {
        wide_q6_k_tile(w, row_bytes, blocks, qx, xs, nt, next, y, y_stride, rows);
        return;
    }
    if (type == T_Q4_K || type == T_Q5_K) {
        wide_k_tile(w, row_bytes, blocks, qx, xs, nt, next, y, y_stride, type == T_Q5_K, rows);
        return;
    }
#endif
    wide_tile(w, row_bytes, blocks, qx, xs, nt, next, y, y_stride, legacy_kind(type), rows);
}

/* `type`'s wide kernel: the x rows ROW_TILE at a time, a last few in a tile of 4, 2 or 1 (its time
 * follows its rows); the next tile of W read ahead once. */
static inline __attribute__((always_inline)) void wide_rows(int type, const uint8_t *w, int64_t row_bytes,
                                                            int64_t blocks, const qx_rows_t *qx, const int64_t *xs,
                                                            int64_t nx, float *y, int64_t y_stride) {
    for (int64_t t0 = 0; t0 < nx; t0 += WIDE_ROWS) {
        const int64_t nt = tile_of(nx, t0, WIDE_ROWS);
        const uint8_t *next = t0 == 0 ? w + W_TILE * row_bytes : NULL;
        const int rows = nt > 4 ? ROW_TILE : nt > 2 ? 4 : nt > 1 ? 2 : 1;
        if (WIDE_ROWS == ROW_TILE && rows == ROW_TILE)
            wide_type_tile(type, w, row_bytes, blocks, qx, xs + t0, nt, next, y + t0 * y_stride, y_stride, ROW_TILE);
        else if (rows == 4)
            wide_type_tile(type, w, row_bytes, blocks, qx, xs + t0, nt, next, y + t0 * y_stride, y_stride, 4);
        else if (rows == 2)
            wide_type_tile(type, w, row_bytes, blocks, qx, xs + t0, nt, next, y + t0 * y_stride, y_stride, 2);
        else
            wide_type_tile(type, w, row_bytes, blocks, qx, xs + t0, nt, next, y + t0 * y_stride, y_stride, 1);
    }
}

#define WIDE_OF_TYPE(name, type)                                                                                  \
    static void name(const uint8_t *w, int64_t row_bytes, int64_t blocks, const qx_rows_t *qx, const int64_t *xs, \
                     int64_t nx, float *y, int64_t y_stride) {                                                     \
        wide_rows(type, w, row_bytes, blocks, qx, xs, nx, y, y_stride);                                          \
    }
WIDE_OF_TYPE(wide_q4_0, T_Q4_0)
WIDE_OF_TYPE(wide_q4_1, T_Q4_1)
WIDE_OF_TYPE(wide_q8_0, T_Q8_0)
WIDE_OF_TYPE(wide_q5_0, T_Q5_0)
WIDE_OF_TYPE(wide_q5_1, T_Q5_1)
#ifdef LLMX_AVX512
WIDE_OF_TYPE(wide_q4_k, T_Q4_K)
WIDE_OF_TYPE(wide_q5_k, T_Q5_K)
WIDE_OF_TYPE(wide_q6_k, T_Q6_K)
#endif
#endif

/* A type's wide kernel (NULL: none), and from how many x rows it serves. */
static wide_fn wide_of(int type, int64_t *from) {
    *from = type == T_Q6_K ? WIDE_Q6_K_FROM : type == T_Q4_K || type == T_Q5_K ? WIDE_K_FROM : WIDE_FROM;
#ifdef LLMX_AVX2
    switch (type) {
    case T_Q4_0: return wide_q4_0;
    case T_Q4_1: return wide_q4_1;
    case T_Q8_0: return wide_q8_0;
    case T_Q5_0: return wide_q5_0;
    case T_Q5_1: return wide_q5_1;
#ifdef LLMX_AVX512
    case T_Q4_K: return wide_q4_k;
    case T_Q5_K: return wide_q5_k;
    case T_Q6_K: return wide_q6_k;
#endif
    default: return NULL;
    }
#else
    return NULL;
#endif
}

/* One matrix of a pass: n rows of `blocks` blocks, row_bytes apart, each multiplied with the quantized
 * x rows xs[0..nx); the product of row r with x row xs[i] goes to y[i * y_stride + r]. `start` is its
 * first row in the pass and `first_tile` its first tile of W_TILE rows (set by pass_rows). */
typedef struct {
    dot_fn dot;
    rows_fn rows;
    wide_fn wide;
    int64_t wide_from; /* x rows from which `wide` serves */
    const uint8_t *w;
    int64_t row_bytes, blocks, n, start, first_tile;
    const int64_t *xs;
    int64_t nx;
    float *y;
    int64_t y_stride;
} matrix_t;

/* The matrix `type` makes of n rows of k weights at w; 0 for an unknown type or k not whole blocks. */
static int matrix_of(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, matrix_t *a) {
    void (*decode)(const uint8_t *, float *);
    int qk, bytes;
    if (!block_of(type, &a->dot, &decode, &qk, &bytes) || k % qk != 0) return 0;
    a->rows = rows_of(type), a->wide = wide_of(type, &a->wide_from);
    a->w = w, a->row_bytes = row_bytes, a->blocks = k / qk, a->n = n;
    return 1;
}

/* Numbers the matrices' rows one after another, and their tiles of W_TILE rows (a matrix's last may be
 * short); returns how many rows there are. */
static int64_t pass_rows(matrix_t *mats, int64_t count) {
    int64_t total = 0, tiles = 0;
    for (int64_t j = 0; j < count; j++) {
        mats[j].start = total, total += mats[j].n;
        mats[j].first_tile = tiles, tiles += (mats[j].n + W_TILE - 1) / W_TILE;
    }
    return total;
}

static int64_t pass_tiles(const matrix_t *mats, int64_t count) {
    return mats[count - 1].first_tile + (mats[count - 1].n + W_TILE - 1) / W_TILE;
}

/* Rows go out in chunks, up to CHUNKS_A_THREAD a thread, to whichever thread is free: a VM's threads
 * start late and run at uneven speeds, and with fixed shares the slowest decides. On the 16-core H200
 * host a Llama-3-8B decode's matmuls streamed 57.4 GB/s at 1 chunk a thread, 66.2 at 4, 67.9 at 8,
 * 71.3 at 16 (4 alternating rounds each). But each chunk a thread takes starts a stream of its own, whose
 * first lines wait for RAM before its prefetches run ahead, so a chunk holds at least MIN_CHUNK_BYTES of
 * the pass's first matrix (`mats`), as many a thread as that leaves. */
#ifndef MIN_CHUNK_BYTES
#define MIN_CHUNK_BYTES (64 << 10)
#endif
static int64_t chunk_of(const matrix_t *mats, int64_t total, int threads) {
    int64_t per_thread = total * mats[0].row_bytes / ((int64_t)threads * MIN_CHUNK_BYTES);
    per_thread = per_thread < 1 ? 1 : per_thread > CHUNKS_A_THREAD ? CHUNKS_A_THREAD : per_thread;
    const int64_t rows = (total + per_thread * threads - 1) / (per_thread * threads);
    return rows > 16 ? rows : 16;
}

/* Inside a parallel region: every row of the pass's matrices times its x rows, each row read once
 * (it stays in L1 while the x rows take turns), the rows shared out as chunk_of says, W_TILE at a time:
 * whole tiles of several x rows take the wide kernel where the type has one. */
static void gemv_pass(const matrix_t *mats, int64_t count, const qx_rows_t *qx, int64_t chunk) {
    const int64_t tiles = pass_tiles(mats, count), chunk_tiles = (chunk + W_TILE - 1) / W_TILE;
    int64_t j = 0;
#pragma omp for schedule(dynamic, chunk_tiles)
    for (int64_t u = 0; u < tiles; u++) {
        if (u < mats[j].first_tile) j = 0; /* a thread's chunks come in order: j rarely starts over */
        while (j + 1 < count && u >= mats[j + 1].first_tile) j++;
        const matrix_t *a = mats + j;
        const int64_t i0 = (u - a->first_tile) * W_TILE, n = a->n - i0 < W_TILE ? a->n - i0 : W_TILE;
        if (a->wide != NULL && a->nx >= a->wide_from && n == W_TILE) {
            a->wide(a->w + i0 * a->row_bytes, a->row_bytes, a->blocks, qx, a->xs, a->nx, a->y + i0, a->y_stride);
            continue;
        }
        for (int64_t i = i0; i < i0 + n; i++) {
            const uint8_t *row = a->w + i * a->row_bytes;
            if (a->rows != NULL && a->nx >= ROWS_FROM) {
                a->rows(row, a->blocks, qx, a->xs, a->nx, a->y + i, a->y_stride);
                continue;
            }
            for (int64_t t = 0; t < a->nx; t++) {
                const qx_t xt = qx_row(qx, a->xs[t]);
                a->y[t * a->y_stride + i] = a->dot(row, a->blocks, &xt);
            }
        }
    }
}

#define MAX_ROWS 64 /* rows of x a GEMV call takes (cpu_native.MAX_ROWS) */

/* Several matrices that multiply the same x (q/k/v, gate/up), of any of the types, in one parallel
 * region: y [m, N] holds weight j's outputs in columns off_j .. off_j + n[j] - 1 (in order, N their
 * sum), plus res [m, N] where it is not NULL (a block's residual stream, added as torch's add_ would,
 * on this thread: a few thousand floats). Each W_j is n[j] rows of k weights, row_bytes[j] apart;
 * m <= MAX_ROWS rows of x [m, k]. Returns 0, or -1 for an unknown type, a bad count or m, or no memory. */
int llmx_gemv_many(int count, const int *types, const uint8_t *const *ws, const int64_t *ns,
                   const int64_t *row_bytes, int64_t k, const float *x, int64_t m, const float *res, float *y,
                   int threads) {
    matrix_t mats[MAX_WEIGHTS];
    int64_t all_rows[MAX_ROWS]; /* every x row */
    if (count < 1 || count > MAX_WEIGHTS || m < 1 || m > MAX_ROWS) return -1;
    for (int64_t t = 0; t < m; t++) all_rows[t] = t;
    for (int j = 0; j < count; j++)
        if (!matrix_of(types[j], ws[j], row_bytes[j], ns[j], k, &mats[j])) return -1;
    const int64_t total = pass_rows(mats, count);
    for (int j = 0; j < count; j++) mats[j].xs = all_rows, mats[j].nx = m, mats[j].y = y + mats[j].start,
                                    mats[j].y_stride = total;
    qx_rows_t qx;
    if (!qx_alloc(&qx, m, k)) return -1;
    const int64_t chunk = chunk_of(mats, total, threads);
#pragma omp parallel num_threads(threads)
    {
        qx_fill(&qx, x, m);
        gemv_pass(mats, count, &qx, chunk);
    }
    free(qx.hi);
    if (res != NULL)
        for (int64_t i = 0; i < m * total; i++) y[i] += res[i];
    return 0;
}

/* --- gated FFNs: a dense one, and the routed experts of a MoE layer -------------------------------- */

enum { ROUTE_LANES = 16 };

/* The dot product of two float32 vectors of n values (n a multiple of ROUTE_LANES) in ROUTE_LANES
 * running sums: vectorized, and in one order whatever the caller's threads (a router's logits, a
 * shared expert's gate). */
static inline float lanes_dot(const float *a, const float *b, int64_t n) {
    float lanes[ROUTE_LANES] = {0};
    for (int64_t i = 0; i < n; i += ROUTE_LANES)
        for (int l = 0; l < ROUTE_LANES; l++) lanes[l] += a[i + l] * b[i + l];
    float dot = 0.0f;
    for (int l = 0; l < ROUTE_LANES; l++) dot += lanes[l];
    return dot;
}

/* An expert stack as the GGUF stores it: n_expert matrices one after another, rows row_bytes apart. */
typedef struct {
    int type;
    const uint8_t *w;
    int64_t row_bytes;
} experts_t;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 }; /* a gated FFN's activation (cpu_native.ACTIVATIONS) */
#define SUM_TILE 256 /* outputs of a token summed at a time (experts_ffn's last loop) */

/* sum[c] += wt * o[c], each product rounded before the add (no fused multiply-add): the roundings of
 * the loop that summed one output at a time, whose products GCC formed in vectors apart from the adds */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static void add_weighted(float *sum, const float *o, float wt, int64_t n) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    for (int64_t c = 0; c < n; c++) sum[c] += wt * o[c];
}

/* act(g) * u for a gated FFN's gate g and up u: SiLU (Llama's SwiGLU) or GELU's tanh form (Gemma's). */
static inline float gated(int act, float g, float u) {
    if (act == ACT_GELU_TANH) return 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g))) * u;
    return g / (1.0f + expf(-g)) * u;
}

/* For m tokens x [m, K] and each token's k_used experts ids [m, k_used] with weights w [m, k_used]:
 * y[t] = sum over j of w[t, j] * down_e(act(gate_e x_t) * up_e x_t), e = ids[t, j], in one parallel
 * region of three passes: the gate and up rows of every chosen expert (each expert's rows read once
 * for all the tokens that chose it, the rows of all the chosen experts shared out evenly), then each
 * (token, expert) pair's activation quantized as x is, then the chosen experts' down rows the same
 * way; last, each output element sums its token's k_used products in slot order (deterministic,
 * whatever the threads did). gate and up are [n_expert, F, K], down [n_expert, N, F], y [m, N]. A decode
 * step's MoE layer thus costs one call where it took one an expert, eight experts a token, each with
 * three parallel regions whose fork, join and small shares cost more than the reads (bench/moe_cpu.py).
 * Prompts too: against that path (which multiplied an expert's rows dequantized to float32 with
 * torch.mm past 8 tokens) it was faster at 16 to 256 tokens and as fast at 512 on one thread of the
 * 2-core machine. Returns 0, or -1 for an unknown type, sizes not whole blocks, an id outside
 * 0..n_expert-1, or no memory. */
static int experts_ffn(const experts_t *gate, const experts_t *up, const experts_t *down, int64_t n_expert,
                       int64_t k, int64_t n_ff, int64_t n_out, const float *x, int64_t m, int64_t k_used,
                       const int64_t *ids, const float *w, int act, const float *res, float *y, int threads) {
    const int64_t pairs = m * k_used, f = n_ff, e = n_out;
    if (m < 1 || k_used < 1 || n_expert < 1 || k % 32 != 0 || f % 32 != 0) return -1;
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] < 0 || ids[p] >= n_expert) return -1;
    /* the pairs p = t * k_used + j, grouped by expert (ascending), in p's order within an expert:
     * sorted[s] is the pair at place s, place[p] the place of pair p, token[s] its token */
    int64_t *count = calloc((size_t)(n_expert + 1), sizeof(int64_t));
    int64_t *sorted = malloc(sizeof(int64_t) * (size_t)(4 * pairs));
    int64_t *place = sorted + pairs, *token = place + pairs, *places = token + pairs;
    matrix_t *mats = malloc(sizeof(matrix_t) * (size_t)(3 * pairs));
    float *gu = malloc(sizeof(float) * (size_t)(pairs * (2 * f + e))), *out = gu + pairs * 2 * f;
    qx_rows_t qx, qa;
    int ok = count != NULL && sorted != NULL && mats != NULL && gu != NULL && qx_alloc(&qx, m, k);
    if (ok && !qx_alloc(&qa, pairs, f)) ok = 0, free(qx.hi);
    if (!ok) {
        free(count), free(sorted), free(mats), free(gu);
        return -1;
    }
    for (int64_t p = 0; p < pairs; p++) count[ids[p] + 1]++;
    for (int64_t i = 0; i < n_expert; i++) count[i + 1] += count[i]; /* count[i]: expert i's first place */
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t s = count[ids[p]]++;
        sorted[s] = p, place[p] = s, token[s] = p / k_used, places[s] = s;
    }
    /* each chosen expert: its gate and up matrices (pass 1), its down matrix (pass 2) */
    matrix_t *gate_up = mats, *downs = mats + 2 * pairs;
    int64_t used = 0;
    for (int64_t s = 0; s < pairs && ok; used++) {
        const int64_t ex = ids[sorted[s]];
        int64_t n = 1;
        while (s + n < pairs && ids[sorted[s + n]] == ex) n++;
        matrix_t *g = gate_up + 2 * used, *u = g + 1, *d = downs + used;
        ok = matrix_of(gate->type, gate->w + ex * f * gate->row_bytes, gate->row_bytes, f, k, g) &&
             matrix_of(up->type, up->w + ex * f * up->row_bytes, up->row_bytes, f, k, u) &&
             matrix_of(down->type, down->w + ex * e * down->row_bytes, down->row_bytes, e, f, d);
        g->xs = u->xs = token + s, d->xs = places + s;
        g->nx = u->nx = d->nx = n;
        g->y = gu + s * 2 * f, u->y = g->y + f, d->y = out + s * e;
        g->y_stride = u->y_stride = 2 * f, d->y_stride = e;
        s += n;
    }
    if (ok) {
        const int64_t rows_gu = pass_rows(gate_up, 2 * used), rows_down = pass_rows(downs, used);
        const int64_t chunk_gu = chunk_of(gate_up, rows_gu, threads), chunk_down = chunk_of(downs, rows_down, threads);
        const int64_t groups = f / 32;
        /* x on this thread (microseconds, ~0.1% of a prompt's call) and the sums below without a
         * barrier of their own: on a machine shared with other work every barrier waits for a
         * preempted thread (three sync points here, against some forty-eight a decode step's eight
         * calls an expert made) */
        qx_fill(&qx, x, m);
#pragma omp parallel num_threads(threads)
        {
            gemv_pass(gate_up, 2 * used, &qx, chunk_gu);
#pragma omp for schedule(static)
            for (int64_t g = 0; g < pairs * groups; g++) {
                const float *gs = gu + (g / groups) * 2 * f + 32 * (g % groups), *us = gs + f;
                float a[32];
                for (int l = 0; l < 32; l++) a[l] = gated(act, gs[l], us[l]);
                qx_set(&qa, g, a);
            }
            gemv_pass(downs, used, &qa, chunk_down);
            /* a token's outputs SUM_TILE at a time, its k_used products added slot by slot (each
             * output's sum in slot order, as before, now in vector lanes over contiguous rows of
             * `out`): one output at a time, gathering its k_used products, took two 64-bit
             * divisions an output (i / e, i % e) and strided loads */
#pragma omp for collapse(2) schedule(static) nowait
            for (int64_t t = 0; t < m; t++)
                for (int64_t c0 = 0; c0 < e; c0 += SUM_TILE) {
                    const int64_t n = e - c0 < SUM_TILE ? e - c0 : SUM_TILE;
                    float sum[SUM_TILE] = {0};
                    for (int64_t j = 0; j < k_used; j++)
                        add_weighted(sum, out + place[t * k_used + j] * e + c0, w[t * k_used + j], n);
                    float *yt = y + t * e + c0;
                    const float *rt = res != NULL ? res + t * e + c0 : NULL;
                    for (int64_t c = 0; c < n; c++) yt[c] = rt != NULL ? sum[c] + rt[c] : sum[c];
                }
        }
    }
    free(count), free(sorted), free(mats), free(gu), free(qx.hi), free(qa.hi);
    return ok ? 0 : -1;
}

/* The routed experts' SwiGLU FFNs of a MoE layer (experts_ffn), the stacks given as type, base and row
 * bytes each; plus the block's residual stream res where not NULL (a decode step's add, in the call). */
int llmx_moe_swiglu(int gate_type, const uint8_t *gate, int64_t gate_row_bytes, int up_type, const uint8_t *up,
                    int64_t up_row_bytes, int down_type, const uint8_t *down, int64_t down_row_bytes,
                    int64_t n_expert, int64_t n_ff, int64_t n_embd, const float *x, int64_t m, int64_t k_used,
                    const int64_t *ids, const float *w, const float *res, float *y, int threads) {
    const experts_t g = {gate_type, gate, gate_row_bytes}, u = {up_type, up, up_row_bytes},
                    d = {down_type, down, down_row_bytes};
    return experts_ffn(&g, &u, &d, n_expert, n_embd, n_ff, n_embd, x, m, k_used, ids, w, ACT_SILU, res, y, threads);
}

/* The gated FFN of a few tokens, down(act(gate(x)) * up(x)) (act: ACT_SILU, or ACT_GELU_TANH), in one
 * call: gate and up (a joined pair, as llmx_gemv_many takes them: count 2, equal heights F), down
 * (count 1, F weights a row) into y [m, nd]: experts_ffn with one expert that every token takes at weight 1 (the same products: a
 * sum of one term times 1 is exact). A decode step's FFN thus costs one call where it took five torch
 * ops and two GEMV calls (~70 us a layer of Python and dispatch on the H200 host); with res [m, nd] not
 * NULL, y also gets the block's residual stream added (as torch's add_ would) where a sixth op did. With
 * scale [k] float32 not NULL, token t's weight is sigmoid(scale . x_t) instead of 1 (Qwen2-MoE's shared
 * expert, gated per token: y_t = res_t + s_t * ffn(x_t), each product and the add rounded once, as torch's
 * y += s * ffn rounds them), so that its step keeps no torch op between native calls (runtime.cpu_replay).
 * The down matrix must take F weights a row (the caller checks: its rows' bytes do not say). Returns 0,
 * or -1 as llmx_gemv_many does, or for unequal heights. */
int llmx_gated_ffn(int count, const int *types, const uint8_t *const *ws, const int64_t *ns,
                   const int64_t *row_bytes, int64_t k, const float *x, int64_t m, int down_count, const int *down_type,
                   const uint8_t *const *down, const int64_t *nd, const int64_t *down_row_bytes, int act,
                   const float *scale, const float *res, float *y, int threads) {
    int64_t expert0[MAX_ROWS];
    float weight[MAX_ROWS];
    if (count != 2 || ns[0] != ns[1] || down_count != 1 || m < 1 || m > MAX_ROWS || act < 0 || act > 1) return -1;
    if (scale != NULL && k % ROUTE_LANES != 0) return -1;
    for (int64_t t = 0; t < m; t++)
        expert0[t] = 0, weight[t] = scale != NULL ? 1.0f / (1.0f + expf(-lanes_dot(scale, x + t * k, k))) : 1.0f;
    const experts_t g = {types[0], ws[0], row_bytes[0]}, u = {types[1], ws[1], row_bytes[1]},
                    d = {down_type[0], down[0], down_row_bytes[0]};
    return experts_ffn(&g, &u, &d, 1, k, ns[0], nd[0], x, m, 1, expert0, weight, act, res, y, threads);
}

/* out[i, :] = W[r, :] in float32, times `scale` unless it is 1 (Gemma's embedding scale, as torch's
 * float32 multiply rounds it), for n rows r: ids[i] (an embedding lookup), or r0 + i where ids is NULL
 * (a chunk of a matrix). A few rows take one thread: a parallel region costs more than they do.
 * Returns 0, or -1 for an unknown type. */
int llmx_dequantize_rows(int type, const uint8_t *w, const int64_t *ids, int64_t r0, int64_t n, int64_t row_bytes,
                         int64_t k, float scale, float *out, int threads) {
    dot_fn dot;
    void (*decode)(const uint8_t *, float *);
    int qk, bytes;
    if (!block_of(type, &dot, &decode, &qk, &bytes)) return -1;
    const int64_t blocks = k / qk;
#pragma omp parallel for num_threads(n < 16 ? 1 : threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = w + (ids != NULL ? ids[i] : r0 + i) * row_bytes;
        for (int64_t blk = 0; blk < blocks; blk++) decode(row + bytes * blk, out + i * k + qk * blk);
        if (scale != 1.0f)
            for (int64_t j = 0; j < k; j++) out[i * k + j] *= scale;
    }
    return 0;
}

/* --- RMSNorm ------------------------------------------------------------------------------------ */

/* out[r] = h[r] / sqrt(mean(h[r]^2) + eps) * w for `rows` rows of n floats, h = x, or with `delta`
 * h = x + delta, also written to `sum`; with `res`, out[r] = res[r] + that (Gemma's norm after the FFN,
 * then its residual add). A decode step's norms (two a layer, and the per-head q/k norms of some models)
 * are one call on the calling thread, where torch took ~14 us of dispatch and helpers; a prompt step's
 * rows, from NORM_PARALLEL_FROM values, are shared out among the threads (one pass where torch's ops made
 * several). Each row's squares are summed in double lanes. */
#define NORM_PARALLEL_FROM (1 << 15)
void llmx_rms_norm(const float *x, const float *delta, const float *w, const float *res, float *sum, float *out,
                   int64_t rows, int64_t n, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1 && rows * n >= NORM_PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *hr = out + r * n;
        if (delta != NULL) {
            float *sr = sum + r * n;
            for (int64_t i = 0; i < n; i++) sr[i] = xr[i] + delta[r * n + i];
            xr = sr;
        }
        double squares = 0.0;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < n; i++) squares += (double)xr[i] * xr[i];
        const float scale = (float)(1.0 / sqrt(squares / (double)n + (double)eps));
        for (int64_t i = 0; i < n; i++) hr[i] = xr[i] * scale * w[i];
        if (res != NULL)
            for (int64_t i = 0; i < n; i++) hr[i] += res[r * n + i];
    }
}

/* --- one token's attention over a KV cache ------------------------------------------------------ */

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_Q8_0 = 3, KV_Q4_0 = 4, KV_Q4_1 = 5, KV_Q5_0 = 6, KV_Q5_1 = 7,
       KV_IQ4_NL = 8 };

/* Bytes of one head's d values in a cache row of `type` (block types: d / 32 blocks). */
static inline int64_t kv_head_bytes(int type, int64_t d) {
    static const int64_t block_bytes[] = {0, 0, 0, 34, 18, 20, 22, 24, 18};
    return type == KV_F32 ? 4 * d : type <= KV_BF16 ? 2 * d : d / 32 * block_bytes[type];
}

static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* IQ4_NL: d (f16) and Q4_0's nibbles, each an index into IQ4_LEVELS. */
static void decode_iq4_nl(const uint8_t *b, float *out) {
    const float d = half_to_float(b);
    for (int l = 0; l < 16; l++) {
        out[l] = d * (float)IQ4_LEVELS[b[2 + l] & 15];
        out[l + 16] = d * (float)IQ4_LEVELS[b[2 + l] >> 4];
    }
}

/* A block-type cache row's d values as floats in out. */
static void kv_blocks(const uint8_t *row, int type, int64_t d, float *out) {
    const int64_t bytes = kv_head_bytes(type, 32);
    for (int64_t i = 0; i < d; i += 32, row += bytes) {
        switch (type) {
        case KV_Q8_0: decode_q8_0(row, out + i); break;
        case KV_Q4_0: decode_q4_0(row, out + i); break;
        case KV_Q4_1: decode_q4_1(row, out + i); break;
        case KV_Q5_0: decode_q5(row, out + i, 0); break;
        case KV_Q5_1: decode_q5(row, out + i, 1); break;
        default: decode_iq4_nl(row, out + i); break;
        }
    }
}

/* Element i of a cache row of the given type, as float. */
static inline float kv_at(const void *row, int type, int64_t i) {
    if (type == KV_F32) return ((const float *)row)[i];
    if (type == KV_F16) return half_to_float((const uint8_t *)row + 2 * i);
    uint32_t bits = (uint32_t)((const uint16_t *)row)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#ifdef LLMX_AVX2
/* 8 elements of a cache row from element i, as floats (f16 through F16C where the CPU has it). */
static inline __m256 kv8(const void *row, int type, int64_t i) {
    if (type == KV_F32) return _mm256_loadu_ps((const float *)row + i);
    if (type == KV_BF16) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
#else
    float f[8];
    for (int j = 0; j < 8; j++) f[j] = kv_at(row, type, i + j);
    return _mm256_loadu_ps(f);
#endif
}
#endif

/* A cache row of `type` as d floats in `out` (d a multiple of 8; of 32 for block types). */
static inline void kv_row(const void *row, int type, int64_t d, float *out) {
    if (type > KV_BF16) {
        kv_blocks(row, type, d, out);
        return;
    }
#ifdef LLMX_AVX2
    for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(out + i, kv8(row, type, i));
#else
    for (int64_t i = 0; i < d; i++) out[i] = kv_at(row, type, i);
#endif
}

static inline float dot_f32(const float *a, const float *b, int64_t d) {
#ifdef LLMX_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum(acc);
#else
    float s = 0.0f;
    for (int64_t i = 0; i < d; i++) s += a[i] * b[i];
    return s;
#endif
}

#ifdef LLMX_AVX2
/* e^x for 8 floats x <= 0 (softmax's shifted scores), to within a few float32 ulps: x = n ln2 + r
 * with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial, 2^n into the exponent bits. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);  /* ln2 in two parts, */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);       /* so r stays exact */
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

/* The largest of n scores. */
static inline float max_of(const float *s, int64_t n) {
    float top = -INFINITY;
    for (int64_t j = 0; j < n; j++) top = s[j] > top ? s[j] : top;
    return top;
}

/* s[j] = e^(s[j] - top) for n scores; returns their sum. */
static inline float exp_shifted(float *s, int64_t n, float top) {
    float sum = 0.0f;
    int64_t j = 0;
#ifdef LLMX_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top)));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum(acc);
#endif
    for (; j < n; j++) {
        s[j] = expf(s[j] - top);
        sum += s[j];
    }
    return sum;
}

#define MAX_HEAD_DIM 512
#define KEY_TILE 8 /* cache rows converted at once: their dot products share each load of q, and their
                      weighted values each load and store of the output */

/* Where a sequence's key j lies in the pool: row j % block_rows of block table[j / block_rows] (a
 * paged cache: blocks of block_rows rows handed out to sequences), or row j where table is NULL (one
 * sequence's contiguous cache). */
static inline int64_t pool_row(const int32_t *table, int64_t block_rows, int64_t j) {
    return table == NULL ? j % block_rows : (int64_t)table[j / block_rows] * block_rows + j % block_rows;
}

/* The pool rows (pool_row) of a sequence's keys j..j+t-1, one division for them all. */
static inline void tile_pool_rows(const int32_t *table, int64_t block_rows, int64_t j, int64_t t, int64_t *rows) {
    int64_t blk = j / block_rows, at = j - blk * block_rows;
    for (int64_t r = 0; r < t; r++) {
        rows[r] = table == NULL ? at : (int64_t)table[blk] * block_rows + at;
        if (++at == block_rows) blk++, at = 0;
    }
}

/* A sequence's keys j..j+t-1 (t <= KEY_TILE) of one KV head, its rows row_bytes apart in the pool
 * (pool_row), as floats in rows (the rest of the tile zeroed); every line of the next tile's rows up
 * to key `end` is asked for meanwhile (the rows are strided, and in a paged cache scattered, which
 * the hardware prefetcher does not follow), and, into the L2, the tile `prefetch_far` tiles ahead's
 * where that is set (prefetch_block says why: SmolLM2 at 4096 keys, 2-core Xeon, 59.4-62.6 -> 62.9-66.1
 * t/s). */
static inline void tile_rows(const char *base, int64_t row_bytes, int type, int64_t d, const int32_t *table,
                             int64_t block_rows, int64_t j, int64_t t, int64_t end, float rows[][MAX_HEAD_DIM]) {
    const int64_t bytes = kv_head_bytes(type, d), next = j + KEY_TILE;
    const int64_t ahead = end - next < KEY_TILE ? end - next : KEY_TILE;
    int64_t at[KEY_TILE];
    if (ahead > 0) {
        tile_pool_rows(table, block_rows, next, ahead, at);
        for (int64_t r = 0; r < ahead; r++)
            for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(base + at[r] * row_bytes + o);
    }
    const int64_t far = j + prefetch_far * KEY_TILE, far_n = end - far < KEY_TILE ? end - far : KEY_TILE;
    if (prefetch_far && far_n > 0) {
        tile_pool_rows(table, block_rows, far, far_n, at);
        for (int64_t r = 0; r < far_n; r++)
            for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(base + at[r] * row_bytes + o, 0, 1);
    }
    tile_pool_rows(table, block_rows, j, t, at);
    for (int64_t r = 0; r < KEY_TILE; r++) {
        if (r < t) kv_row(base + at[r] * row_bytes, type, d, rows[r]);
        else memset(rows[r], 0, sizeof(float) * (size_t)d);
    }
}

/* s[g * n + r] = q_g . rows[r] for the group's query heads g (q_g = qh + g * d) and the tile's t rows. */
static inline void tile_scores(const float *qh, int64_t group, int64_t d, float rows[][MAX_HEAD_DIM], int64_t t,
                               float *s, int64_t n) {
    for (int64_t g = 0; g < group; g++) {
#ifdef LLMX_AVX2
        __m256 acc[KEY_TILE];
        for (int r = 0; r < KEY_TILE; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
            const __m256 qv = _mm256_loadu_ps(qh + g * d + i);
            for (int r = 0; r < KEY_TILE; r++) acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[r] + i), acc[r]);
        }
        if (t == KEY_TILE) { /* a whole tile: one store (a copy of 8 floats became rep movs) */
            _mm256_storeu_ps(s + g * n, hsum8(acc));
            continue;
        }
        float sums[KEY_TILE];
        _mm256_storeu_ps(sums, hsum8(acc));
        for (int64_t r = 0; r < t; r++) s[g * n + r] = sums[r];
#else
        for (int64_t r = 0; r < t; r++) s[g * n + r] = dot_f32(qh + g * d, rows[r], d);
#endif
    }
}

/* For each query head g of the group, its partial output (og + g * og_stride) += sum over the tile's
 * t rows of weight s[g * n + r] times rows[r]. */
static inline void tile_values(float *og, int64_t og_stride, int64_t group, int64_t d, float rows[][MAX_HEAD_DIM],
                               int64_t t, const float *s, int64_t n) {
    for (int64_t g = 0; g < group; g++) {
        float *o = og + g * og_stride;
        const float *p = s + g * n;
#ifdef LLMX_AVX2
        __m256 pv[KEY_TILE];
        for (int r = 0; r < KEY_TILE; r++) pv[r] = _mm256_set1_ps(r < t ? p[r] : 0.0f);  /* no score read past the tile */
        for (int64_t i = 0; i < d; i += 8) {
            __m256 acc = _mm256_loadu_ps(o + i);
            for (int r = 0; r < KEY_TILE; r++) acc = _mm256_fmadd_ps(pv[r], _mm256_loadu_ps(rows[r] + i), acc);
            _mm256_storeu_ps(o + i, acc);
        }
#else
        for (int64_t r = 0; r < t; r++)
            for (int64_t i = 0; i < d; i++) o[i] += p[r] * rows[r][i];
#endif
    }
}

/* One sequence of an attention call. */
typedef struct {
    const float *q;       /* [H, D] its query, rotated and scaled */
    const int32_t *table; /* its block table (pool_row); NULL: a contiguous cache, or a ring of block_rows rows */
    int64_t first, n;     /* it sees keys first..n-1 (a sliding window starts past 0) */
    float *out;           /* [H, D] */
} seq_attn_t;

/* Whether the attention kernels take these shapes: D a multiple of 8 (of 32 for a block type) up to
 * MAX_HEAD_DIM, H a multiple of Hk. */
static int takes_shapes(int type_k, int type_v, int64_t n_head, int64_t n_kv, int64_t d) {
    if (d % 8 != 0 || d > MAX_HEAD_DIM || n_kv < 1 || n_head % n_kv != 0) return 0;
    return !((type_k > KV_BF16 || type_v > KV_BF16) && d % 32 != 0);
}

/* Each sequence's query over its visible keys in the pool k, v [rows, Hk, D] of type_k and type_v
 * (shapes as takes_shapes checks; every sequence sees at least one key). A sequence's keys are cut
 * into chunks of one length for the whole call, so that there are a few (chunk, KV head) items a
 * thread whether the call holds one long sequence or many short ones; each item reads its keys and
 * values once, converting each row once for the H / Hk query heads of its group, and leaves per query
 * head its scores' maximum, the sum of their exponentials and the unnormalized weighted sum of its
 * values; a sequence's chunks are then combined (as flash-decoding does). A chunk's sums do not
 * depend on the other sequences of the call only when its length does not: results agree with a call
 * of one sequence to float rounding. Returns 0, or -1 for no memory. */
static int attend(const seq_attn_t *seqs, int64_t n_seq, const void *k, const void *v, int type_k, int type_v,
                  int64_t block_rows, int64_t n_head, int64_t n_kv, int64_t d, int threads) {
    const int64_t group = n_head / n_kv, k_head = kv_head_bytes(type_k, d), v_head = kv_head_bytes(type_v, d);
    int64_t keys = 0;
    for (int64_t b = 0; b < n_seq; b++) keys += seqs[b].n - seqs[b].first;
    int64_t len = (keys * n_kv + 4 * threads - 1) / (4 * threads); /* about four items a thread ... */
    if (len < 64) len = 64;                                         /* ... of 64 keys or more */
    int64_t n_chunks = 0;
    for (int64_t b = 0; b < n_seq; b++) n_chunks += (seqs[b].n - seqs[b].first + len - 1) / len;
    /* per sequence: its first chunk and its first key among all the call's (where its partial outputs
     * and its scores start); per chunk: its sequence and its place in it */
    int64_t *index = malloc(sizeof(int64_t) * (size_t)(2 * n_seq + 2 * n_chunks));
    float *scores = malloc(sizeof(float) * (size_t)(n_head * keys));
    float *part = malloc(sizeof(float) * (size_t)(n_head * n_chunks * (d + 2))); /* o, then max and sum */
    if (index == NULL || scores == NULL || part == NULL) {
        free(index);
        free(scores);
        free(part);
        return -1;
    }
    int64_t *chunk0 = index, *key0 = index + n_seq, *chunk_seq = index + 2 * n_seq, *chunk_at = chunk_seq + n_chunks;
    for (int64_t b = 0, c0 = 0, j0 = 0; b < n_seq; b++) {
        const int64_t m = seqs[b].n - seqs[b].first, chunks = (m + len - 1) / len;
        chunk0[b] = c0;
        key0[b] = j0;
        for (int64_t c = 0; c < chunks; c++) {
            chunk_seq[c0 + c] = b;
            chunk_at[c0 + c] = c;
        }
        c0 += chunks;
        j0 += m;
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic) collapse(2)
    for (int64_t ci = 0; ci < n_chunks; ci++) {
        for (int64_t h = 0; h < n_kv; h++) {
            const seq_attn_t *sq = seqs + chunk_seq[ci];
            const int64_t b = chunk_seq[ci], c = chunk_at[ci], m = sq->n - sq->first, chunks = (m + len - 1) / len;
            const int64_t j0 = sq->first + c * len, j1 = j0 + len < sq->n ? j0 + len : sq->n;
            const char *kh = (const char *)k + h * k_head, *vh = (const char *)v + h * v_head;
            const float *qh = sq->q + h * group * d;
            /* the group's scores: query head g's of key j at s[g * m + j - first] */
            float *s = scores + key0[b] * n_head + h * group * m, rows[KEY_TILE][MAX_HEAD_DIM];
            for (int64_t j = j0; j < j1; j += KEY_TILE) {
                const int64_t t = j1 - j < KEY_TILE ? j1 - j : KEY_TILE;
                tile_rows(kh, n_kv * k_head, type_k, d, sq->table, block_rows, j, t, j1, rows);
                tile_scores(qh, group, d, rows, t, s + (j - sq->first), m);
            }
            float *og = part + (chunk0[b] * n_head + h * group * chunks + c) * (d + 2);
            const int64_t og_stride = chunks * (d + 2); /* from one query head's partial output to the next's */
            for (int64_t g = 0; g < group; g++) {
                float *pg = og + g * og_stride;
                pg[d] = max_of(s + g * m + (j0 - sq->first), j1 - j0);
                pg[d + 1] = exp_shifted(s + g * m + (j0 - sq->first), j1 - j0, pg[d]);
                for (int64_t i = 0; i < d; i++) pg[i] = 0.0f;
            }
            for (int64_t j = j0; j < j1; j += KEY_TILE) {
                const int64_t t = j1 - j < KEY_TILE ? j1 - j : KEY_TILE;
                tile_rows(vh, n_kv * v_head, type_v, d, sq->table, block_rows, j, t, j1, rows);
                tile_values(og, og_stride, group, d, rows, t, s + (j - sq->first), m);
            }
        }
    }
    for (int64_t b = 0; b < n_seq; b++) { /* combine each query head's chunks */
        const int64_t chunks = (seqs[b].n - seqs[b].first + len - 1) / len;
        for (int64_t hq = 0; hq < n_head; hq++) {
            const float *ph = part + (chunk0[b] * n_head + hq * chunks) * (d + 2);
            float top = -INFINITY, sum = 0.0f, *o = seqs[b].out + hq * d;
            for (int64_t c = 0; c < chunks; c++) top = ph[c * (d + 2) + d] > top ? ph[c * (d + 2) + d] : top;
            for (int64_t i = 0; i < d; i++) o[i] = 0.0f;
            for (int64_t c = 0; c < chunks; c++) {
                const float *pc = ph + c * (d + 2), w = expf(pc[d] - top);
                sum += w * pc[d + 1];
                for (int64_t i = 0; i < d; i++) o[i] += w * pc[i];
            }
            for (int64_t i = 0; i < d; i++) o[i] /= sum;
        }
    }
    free(index);
    free(scores);
    free(part);
    return 0;
}

/* One token's attention: q [H, D] float32 (scaled) over k and v [n, Hk, D] of type_k and type_v, every
 * key visible -> out [H, D] float32 (see attend). Returns 0, or -1 for shapes takes_shapes refuses,
 * n < 1, or no memory. */
int llmx_decode_attention(const float *q, const void *k, const void *v, int type_k, int type_v, int64_t n,
                          int64_t n_head, int64_t n_kv, int64_t d, float *out, int threads) {
    if (!takes_shapes(type_k, type_v, n_head, n_kv, d) || n < 1) return -1;
    const seq_attn_t one = {q, NULL, 0, n, out};
    return attend(&one, 1, k, v, type_k, type_v, n, n_head, n_kv, d, threads);
}

/* A float as a cache element of `type` at `out`, rounded to nearest even as torch's .to() does. */
static inline void store_kv(float f, int type, void *out) {
    if (type == KV_F32) {
        memcpy(out, &f, 4);
        return;
    }
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint16_t h;
    if (type == KV_BF16) {
        h = (bits & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((bits >> 16) | 0x40u) /* NaN stays NaN */
                                                : (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    } else {
#if defined(__F16C__)
        h = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#elif defined(__FLT16_MAX__)
        _Float16 v = (_Float16)f;
        memcpy(&h, &v, 2);
#else
        const uint32_t sign = (bits >> 16) & 0x8000u, mag = bits & 0x7fffffffu;
        if (mag > 0x7f800000u) {
            h = (uint16_t)(sign | 0x7e00u); /* NaN */
        } else if (mag >= 0x477ff000u) {
            h = (uint16_t)(sign | 0x7c00u); /* rounds past 65504: infinity */
        } else if (mag < 0x38800000u) { /* below 2^-14: a subnormal half (or zero), m * 2^-24 */
            const int shift = 126 - (int)(mag >> 23); /* 14 .. for the implicit-one mantissa */
            if (shift > 24) {
                h = (uint16_t)sign;
            } else {
                const uint32_t m = (mag & 0x7fffffu) | 0x800000u, q = m >> shift, rest = m & ((1u << shift) - 1u),
                               half = 1u << (shift - 1);
                h = (uint16_t)(sign | (q + (rest > half || (rest == half && (q & 1u)))));
            }
        } else { /* normal: rebias the exponent, round the 13 dropped mantissa bits to even */
            const uint32_t r = mag - 0x38000000u;
            h = (uint16_t)(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
        }
#endif
    }
    memcpy(out, &h, 2);
}

/* --- quantize-on-store: a head's d floats as cache blocks, the bytes of llmx/quant/quantize.py --- */

/* Contraction into fused multiply-adds would round x * id + 8.5 once instead of twice, and move codes
 * off gguf's at rounding ties: GCC takes the attribute, clang the pragma. */
#pragma STDC FP_CONTRACT OFF
#if defined(__GNUC__) && !defined(__clang__)
#define NO_FMA __attribute__((optimize("fp-contract=off")))
#else
#define NO_FMA
#endif

/* 32 codes: byte l holds code l (low nibble) and code l + 16 (high); for five-bit codes their fifth
 * bits go to qh (bit l of a little-endian uint32). */
static inline void pack_codes(const uint8_t q[32], uint8_t *qs, uint8_t *qh) {
    uint32_t h = 0;
    for (int l = 0; l < 16; l++) {
        qs[l] = (uint8_t)((q[l] & 15) | (q[l + 16] & 15) << 4);
        h |= (uint32_t)(q[l] >> 4) << l | (uint32_t)(q[l + 16] >> 4) << (l + 16);
    }
    if (qh != NULL) memcpy(qh, &h, 4);
}

/* The first of the block's values of the largest magnitude. */
static inline float largest(const float *x) {
    float amax = 0.0f, vmax = 0.0f;
    for (int l = 0; l < 32; l++) {
        if (amax < fabsf(x[l])) {
            amax = fabsf(x[l]);
            vmax = x[l];
        }
    }
    return vmax;
}

/* One block of 32 floats of `type` at b. */
NO_FMA static void quantize_block(const float *x, int type, uint8_t *b) {
    uint8_t q[32];
    if (type == KV_Q8_0) {
        float amax = 0.0f;
        for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(x[l]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        store_kv(d, KV_F16, b);
        for (int l = 0; l < 32; l++) ((int8_t *)b)[2 + l] = (int8_t)roundf(x[l] * id);
    } else if (type == KV_Q4_0 || type == KV_Q5_0) {
        const int levels = type == KV_Q4_0 ? 16 : 32;
        const float d = largest(x) / (float)(-levels / 2), id = d != 0.0f ? 1.0f / d : 0.0f;
        store_kv(d, KV_F16, b);
        for (int l = 0; l < 32; l++) {
            const int c = (int)(x[l] * id + ((float)(levels / 2) + 0.5f));
            q[l] = (uint8_t)(c < 0 ? 0 : c > levels - 1 ? levels - 1 : c);
        }
        pack_codes(q, b + (type == KV_Q4_0 ? 2 : 6), type == KV_Q4_0 ? NULL : b + 2);
    } else if (type == KV_Q4_1 || type == KV_Q5_1) {
        const int levels = type == KV_Q4_1 ? 16 : 32;
        float lo = x[0], hi = x[0];
        for (int l = 1; l < 32; l++) {
            lo = x[l] < lo ? x[l] : lo;
            hi = x[l] > hi ? x[l] : hi;
        }
        const float d = (hi - lo) / (float)(levels - 1), id = d != 0.0f ? 1.0f / d : 0.0f;
        store_kv(d, KV_F16, b);
        store_kv(lo, KV_F16, b + 2);
        for (int l = 0; l < 32; l++) {
            const int c = (int)((x[l] - lo) * id + 0.5f);
            q[l] = (uint8_t)(c < 0 ? 0 : c > levels - 1 ? levels - 1 : c);
        }
        pack_codes(q, b + (type == KV_Q4_1 ? 4 : 8), type == KV_Q4_1 ? NULL : b + 4);
    } else { /* IQ4_NL: the nearest level (the upper of two as near), then d refit by weighted least squares */
        float d = largest(x) / (float)IQ4_LEVELS[0], sumqx = 0.0f, sumq2 = 0.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int l = 0; l < 32; l++) {
            const float v = x[l] * id;
            int c = 0;
            for (int i = 0; i < 15; i++) c += !(v - (float)IQ4_LEVELS[i] < (float)IQ4_LEVELS[i + 1] - v);
            q[l] = (uint8_t)c;
            const float level = (float)IQ4_LEVELS[c], w = x[l] * x[l];
            sumqx += w * level * x[l];
            sumq2 += w * level * level;
        }
        store_kv(sumq2 > 0.0f ? sumqx / sumq2 : d, KV_F16, b);
        pack_codes(q, b + 2, NULL);
    }
}

/* A head's d floats (x) as a cache row's part of `type` at out. */
static void store_head(const float *x, int type, int64_t d, char *out) {
    if (type <= KV_BF16) {
        const int64_t elem = type == KV_F32 ? 4 : 2;
        for (int64_t i = 0; i < d; i++) store_kv(x[i], type, out + i * elem);
        return;
    }
    for (int64_t i = 0; i < d; i += 32) quantize_block(x + i, type, (uint8_t *)out + i / 32 * kv_head_bytes(type, 32));
}

/* x [D] rotated in place by RoPE's angles (cos, sin [n_dims / 2]): pairs (x[2i], x[2i+1]) as GGML
 * rotates them, or (x[i], x[i + n_dims / 2]) in NeoX's mode; elements past n_dims untouched. */
static inline void rope_in_place(float *x, const float *cos, const float *sin, int64_t n_dims, int neox) {
    const int64_t half = n_dims / 2;
    for (int64_t i = 0; i < half; i++) {
        float *a = neox ? x + i : x + 2 * i, *b = neox ? x + i + half : x + 2 * i + 1;
        const float x0 = *a, x1 = *b;
        *a = x0 * cos[i] - x1 * sin[i];
        *b = x0 * sin[i] + x1 * cos[i];
    }
}

/* x [d] with each run of `block` values (a power of two; 0: none) rotated by the orthonormal Walsh-Hadamard
 * matrix, as llmx/ops/hadamard.py's `rotate` does it, to the bit: butterflies (a + b, a - b) of strides 1,
 * 2, 4, .. then the scale 1 / sqrt(block) rounded once from double, as Python's float meets float32. */
static void hadamard_in_place(float *x, int64_t d, int block) {
    if (block == 0) return;
    const float scale = (float)(1.0 / sqrt((double)block));
    for (int64_t r = 0; r < d; r += block) {
        float *y = x + r;
        for (int s = 1; s < block; s *= 2)
            for (int g = 0; g < block; g += 2 * s)
                for (int i = g; i < g + s; i++) {
                    const float a = y[i], b = y[i + s];
                    y[i] = a + b, y[i + s] = a - b;
                }
        for (int i = 0; i < block; i++) y[i] *= scale;
    }
}

/* A token's query q [H, D] rotated by RoPE, then by the key cache's Walsh-Hadamard blocks (rot_k), and
 * scaled into qs [H, D]. */
static void rope_query(const float *q, const float *cos, const float *sin, int64_t n_dims, int neox, float scale,
                       int rot_k, int64_t n_head, int64_t d, float *qs) {
    for (int64_t h = 0; h < n_head; h++) {
        float *qh = qs + h * d;
        memcpy(qh, q + h * d, sizeof(float) * (size_t)d);
        rope_in_place(qh, cos, sin, n_dims, neox);
        hadamard_in_place(qh, d, rot_k);
        for (int64_t i = 0; i < d; i++) qh[i] *= scale;
    }
}

/* A token's key k [Hk, D] rotated by RoPE and then by rot_k's blocks, and its value v [Hk, D] by
 * rot_v's, stored (quantized, for a block type) as the cache rows krow and vrow; each head goes
 * through the stack on its way there. */
static void rope_store(const float *k, const float *v, const float *cos, const float *sin, int64_t n_dims, int neox,
                       int rot_k, int rot_v, char *krow, char *vrow, int type_k, int type_v, int64_t n_kv,
                       int64_t d) {
    const int64_t k_head = kv_head_bytes(type_k, d), v_head = kv_head_bytes(type_v, d);
    float kh[MAX_HEAD_DIM], vh[MAX_HEAD_DIM];
    for (int64_t h = 0; h < n_kv; h++) {
        memcpy(kh, k + h * d, sizeof(float) * (size_t)d);
        rope_in_place(kh, cos, sin, n_dims, neox);
        hadamard_in_place(kh, d, rot_k);
        store_head(kh, type_k, d, krow + h * k_head);
        const float *vs = v + h * d;
        if (rot_v) { /* rotated on the stack: v is the caller's */
            memcpy(vh, vs, sizeof(float) * (size_t)d);
            hadamard_in_place(vh, d, rot_v);
            vs = vh;
        }
        store_head(vs, type_v, d, vrow + h * v_head);
    }
}

/* x [rows, d] float32, each row's runs of `block` values rotated in place (hadamard_in_place), the rows
 * shared among `threads`: the eager path's rotation of a prompt's queries, keys, values and outputs on
 * the CPU (llmx/ops/hadamard.py), the same bits as the fused steps'. */
void llmx_hadamard_rows(float *x, int64_t rows, int64_t d, int block, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) hadamard_in_place(x + r * d, d, block);
}

/* The attention's output of n rows of H heads [n, H, D] rotated back by rot_v's blocks (its own inverse). */
static void unrotate_output(float *out, int64_t n, int64_t n_head, int64_t d, int rot_v) {
    if (rot_v == 0) return;
    for (int64_t i = 0; i < n * n_head; i++) hadamard_in_place(out + i * d, d, rot_v);
}

/* One token's attention step on the CPU, whole: q [H, D] and k [Hk, D] (float32, this step's) rotated
 * by RoPE, q scaled, k and v [Hk, D] stored as the cache row of `position` in kc and vc (type_k, type_v;
 * `rows` rows, position p in row p mod rows: a sliding-window layer's ring), then its attention over
 * positions 0..position (with a sliding `window` > 0 only the last `window` of them, which the rows
 * must hold). With rot_k (rot_v) > 0 the keys and q (the values, and the output back) are rotated by
 * Walsh-Hadamard blocks of that many values after RoPE (hadamard_in_place: the cache's rotation, see
 * llmx/ops/hadamard.py). q and k stay as they are. The step costs one call instead of some twenty torch
 * ops. Returns as llmx_decode_attention, or -1 for a position whose visible keys the rows do not hold. */
int llmx_rope_store_attend(const float *q, const float *k, const float *v, const float *cos, const float *sin,
                           int64_t n_dims, int neox, void *kc, void *vc, int type_k, int type_v, int64_t position,
                           int64_t rows, int64_t window, int64_t n_head, int64_t n_kv, int64_t d, float scale,
                           int rot_k, int rot_v, float *out, int threads) {
    const int64_t first = window > 0 && position + 1 > window ? position + 1 - window : 0;
    if (!takes_shapes(type_k, type_v, n_head, n_kv, d) || n_dims > d || n_dims % 2 != 0 || position < 0 ||
        position + 1 - first > rows)
        return -1;
    float *qs = malloc(sizeof(float) * (size_t)(n_head * d));
    if (qs == NULL) return -1;
    rope_query(q, cos, sin, n_dims, neox, scale, rot_k, n_head, d, qs);
    const int64_t slot = position % rows;
    char *krow = (char *)kc + slot * n_kv * kv_head_bytes(type_k, d), *vrow = (char *)vc + slot * n_kv * kv_head_bytes(type_v, d);
    rope_store(k, v, cos, sin, n_dims, neox, rot_k, rot_v, krow, vrow, type_k, type_v, n_kv, d);
    const seq_attn_t one = {qs, NULL, first, position + 1, out};
    const int err = attend(&one, 1, kc, vc, type_k, type_v, rows, n_head, n_kv, d, threads);
    unrotate_output(out, 1, n_head, d, rot_v);
    free(qs);
    return err;
}

/* The decode step of n_seq sequences over a paged cache, in one call (a batch's layer): sequence b's
 * token at positions[b], its q [H, D] and k [Hk, D] (rows b of q [B, H, D], k and v [B, Hk, D], float32,
 * each row's heads contiguous and rows q_stride, k_stride, v_stride floats apart: the columns of one
 * joined q/k/v projection, read where they lie) rotated by RoPE at its angles (row b of cos, sin [B, n_dims / 2]), q scaled, k and v stored in its
 * position's row of the pools kc and vc (type_k, type_v; its blocks are row b of tables [B, table_stride],
 * block_rows rows each, as pool_row reads them), then its attention over its positions 0..positions[b]
 * (with a sliding `window` > 0 only the last `window` of them) -> row b of out [B, H, D], rotated by
 * rot_k and rot_v as llmx_rope_store_attend's. Every token is
 * stored before any attends, so the (chunk, KV head) items of all sequences share one parallel loop
 * (see attend) where a call per sequence left a thread idle at each. Sequences may share blocks (a
 * prefix cache) but never the block a position of this step lies in. Returns 0, or -1 for shapes
 * takes_shapes refuses, a position outside its table, or no memory. */
int llmx_paged_rope_store_attend(const float *q, const float *k, const float *v, int64_t q_stride, int64_t k_stride,
                                 int64_t v_stride, const float *cos, const float *sin, int64_t n_dims, int neox, void *kc, void *vc, int type_k, int type_v,
                                 const int32_t *tables, int64_t table_stride, int64_t block_rows,
                                 const int64_t *positions, int64_t window, int64_t n_seq, int64_t n_head, int64_t n_kv,
                                 int64_t d, float scale, int rot_k, int rot_v, float *out, int threads) {
    if (!takes_shapes(type_k, type_v, n_head, n_kv, d) || n_dims > d || n_dims % 2 != 0 || n_seq < 1) return -1;
    for (int64_t b = 0; b < n_seq; b++)
        if (positions[b] < 0 || positions[b] >= table_stride * block_rows) return -1;
    float *qs = malloc(sizeof(float) * (size_t)(n_seq * n_head * d));
    seq_attn_t *seqs = malloc(sizeof(seq_attn_t) * (size_t)n_seq);
    if (qs == NULL || seqs == NULL) {
        free(qs);
        free(seqs);
        return -1;
    }
    const int64_t half = n_dims / 2, k_row = n_kv * kv_head_bytes(type_k, d), v_row = n_kv * kv_head_bytes(type_v, d);
    for (int64_t b = 0; b < n_seq; b++) {
        const int32_t *table = tables + b * table_stride;
        const int64_t pos = positions[b], slot = pool_row(table, block_rows, pos);
        rope_query(q + b * q_stride, cos + b * half, sin + b * half, n_dims, neox, scale, rot_k, n_head, d,
                   qs + b * n_head * d);
        rope_store(k + b * k_stride, v + b * v_stride, cos + b * half, sin + b * half, n_dims, neox, rot_k, rot_v,
                   (char *)kc + slot * k_row, (char *)vc + slot * v_row, type_k, type_v, n_kv, d);
        const int64_t first = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
        seqs[b] = (seq_attn_t){qs + b * n_head * d, table, first, pos + 1, out + b * n_head * d};
    }
    const int err = attend(seqs, n_seq, kc, vc, type_k, type_v, block_rows, n_head, n_kv, d, threads);
    unrotate_output(out, n_seq, n_head, d, rot_v);
    free(qs);
    free(seqs);
    return err;
}

/* --- the sampler's top-k ------------------------------------------------------------------------ */

/* Sifts entry i of a min-heap of n (value, id) entries down; the smaller value is the lower entry, and
 * of equal values the later id (so it leaves first and earlier ids win ties). */
static void sift_down(float *v, int64_t *id, int64_t n, int64_t i) {
    for (;;) {
        int64_t low = i;
        for (int64_t c = 2 * i + 1; c <= 2 * i + 2 && c < n; c++)
            if (v[c] < v[low] || (v[c] == v[low] && id[c] > id[low])) low = c;
        if (low == i) return;
        const float tv = v[i];
        const int64_t ti = id[i];
        v[i] = v[low], id[i] = id[low], v[low] = tv, id[low] = ti;
        i = low;
    }
}

/* The k largest of x[0..n) (1 <= k <= n, no NaN) into values/ids, largest first, of equal values the
 * lower id first. One pass on one thread: blocks of 16 values none of which beats the heap's least
 * are skipped with a vectorized compare, so a vocabulary of 128k costs ~10-20 us, where torch.topk
 * took 0.12 ms here and 0.87 ms on the 16-core H200 host. */
void llmx_top_k(const float *x, int64_t n, int64_t k, float *values, int64_t *ids) {
    for (int64_t i = 0; i < k; i++) values[i] = x[i], ids[i] = i;
    for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(values, ids, k, i);
    for (int64_t b = k; b < n; b += 16) {
        const int64_t e = b + 16 < n ? b + 16 : n;
        const float least = values[0];
        int beats = 0;
        for (int64_t i = b; i < e; i++) beats |= x[i] > least;
        if (!beats) continue;
        for (int64_t i = b; i < e; i++) {
            if (x[i] > values[0]) {
                values[0] = x[i], ids[0] = i;
                sift_down(values, ids, k, 0);
            }
        }
    }
    for (int64_t m = k - 1; m > 0; m--) { /* heap sort: the least goes last */
        const float tv = values[0];
        const int64_t ti = ids[0];
        values[0] = values[m], ids[0] = ids[m], values[m] = tv, ids[m] = ti;
        sift_down(values, ids, m, 0);
    }
}

/* --- threads ------------------------------------------------------------------------------------ */

/* Pins each worker of an OpenMP team of `threads` (the pool torch's CPU ops use too) to its own CPU,
 * worker i to cpus[i]; the calling thread (team member 0, Python's) stays free, and with it every
 * thread it starts later. A worker the scheduler moves leaves its prefetched stream and its cache
 * behind. On the 16-core H200 host, a Llama-3-8B decode's matmuls streamed 70.7 GB/s pinned against
 * 67.1 unpinned (4 fresh processes of each, alternating). Returns the workers that could not be pinned. */
int llmx_pin_threads(const int *cpus, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(+ : failed)
    {
        const int i = omp_get_thread_num();
        if (i > 0) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cpus[i], &set);
            failed += pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0;
        }
    }
    return failed;
}

/* --- a MoE layer's router ---------------------------------------------------------------------- */

/* Each of m tokens' k_used experts by the router w [n_expert, n_embd] (float32 rows, as GGUF keeps
 * routers): p = softmax(w x_t), its k_used largest best first (of equal p the lower id first, as
 * torch.topk on distinct values; llmx_top_k), rescaled to sum to 1 where `normalize`, into weights
 * [m, k_used] float32 and ids [m, k_used]. The router in one call a layer, where torch took a matmul,
 * a softmax and a top-k: a decode step with no torch op between its native calls, which a replay makes
 * again (runtime.cpu_replay). Each dot keeps ROUTE_LANES running sums (vectorized, and in one order at
 * any thread count), the experts' rows shared out among the threads. Returns 0, or -1 for k_used
 * outside 1..n_expert, n_embd not a multiple of ROUTE_LANES, or no memory. */
int llmx_moe_route(const float *x, int64_t m, int64_t n_embd, const float *w, int64_t n_expert, int64_t k_used,
                   int normalize, float *weights, int64_t *ids, int threads) {
    if (m < 1 || k_used < 1 || k_used > n_expert || n_embd % ROUTE_LANES != 0) return -1;
    float *p = malloc(sizeof(float) * (size_t)(m * n_expert));
    if (p == NULL) return -1;
#pragma omp parallel for num_threads(n_expert * n_embd < (1 << 16) ? 1 : threads) schedule(static)
    for (int64_t e = 0; e < n_expert; e++) {
        const float *row = w + e * n_embd;
        for (int64_t t = 0; t < m; t++) {
            p[t * n_expert + e] = lanes_dot(row, x + t * n_embd, n_embd);
        }
    }
    for (int64_t t = 0; t < m; t++) {
        float *pt = p + t * n_expert, *wt = weights + t * k_used, top = pt[0], sum = 0.0f;
        for (int64_t e = 1; e < n_expert; e++) top = pt[e] > top ? pt[e] : top;
        for (int64_t e = 0; e < n_expert; e++) sum += pt[e] = expf(pt[e] - top);
        for (int64_t e = 0; e < n_expert; e++) pt[e] /= sum;
        llmx_top_k(pt, n_expert, k_used, wt, ids + t * k_used);
        if (normalize) {
            float chosen = 0.0f;
            for (int64_t j = 0; j < k_used; j++) chosen += wt[j];
            for (int64_t j = 0; j < k_used; j++) wt[j] /= chosen;
        }
    }
    free(p);
    return 0;
}

/* --- a recorded step made again (runtime.cpu_replay) --------------------------------------------------
 * A CPU decode step is some 180 calls of the entry points above; made from Python each costs ~1 us of
 * argument conversion, ~3% of SmolLM2's step. A replay hands the recorded calls over once: each call's
 * arguments as slots (an integer or pointer, or a float), run here in order. */

typedef union {
    int64_t i;
    float f;
} slot_t;

#define PTR(n) ((void *)(intptr_t)a[n].i)

static int slots_gemv_many(const slot_t *a) {
    return llmx_gemv_many((int)a[0].i, PTR(1), PTR(2), PTR(3), PTR(4), a[5].i, PTR(6), a[7].i, PTR(8), PTR(9),
                          (int)a[10].i);
}

static int slots_gated_ffn(const slot_t *a) {
    return llmx_gated_ffn((int)a[0].i, PTR(1), PTR(2), PTR(3), PTR(4), a[5].i, PTR(6), a[7].i, (int)a[8].i, PTR(9),
                          PTR(10), PTR(11), PTR(12), (int)a[13].i, PTR(14), PTR(15), PTR(16), (int)a[17].i);
}

static int slots_moe_swiglu(const slot_t *a) {
    return llmx_moe_swiglu((int)a[0].i, PTR(1), a[2].i, (int)a[3].i, PTR(4), a[5].i, (int)a[6].i, PTR(7), a[8].i,
                           a[9].i, a[10].i, a[11].i, PTR(12), a[13].i, a[14].i, PTR(15), PTR(16), PTR(17), PTR(18),
                           (int)a[19].i);
}

static int slots_moe_route(const slot_t *a) {
    return llmx_moe_route(PTR(0), a[1].i, a[2].i, PTR(3), a[4].i, a[5].i, (int)a[6].i, PTR(7), PTR(8), (int)a[9].i);
}

static int slots_dequantize_rows(const slot_t *a) {
    return llmx_dequantize_rows((int)a[0].i, PTR(1), PTR(2), a[3].i, a[4].i, a[5].i, a[6].i, a[7].f, PTR(8),
                                (int)a[9].i);
}

static int slots_decode_attention(const slot_t *a) {
    return llmx_decode_attention(PTR(0), PTR(1), PTR(2), (int)a[3].i, (int)a[4].i, a[5].i, a[6].i, a[7].i, a[8].i,
                                 PTR(9), (int)a[10].i);
}

static int slots_rope_store_attend(const slot_t *a) {
    return llmx_rope_store_attend(PTR(0), PTR(1), PTR(2), PTR(3), PTR(4), a[5].i, (int)a[6].i, PTR(7), PTR(8),
                                  (int)a[9].i, (int)a[10].i, a[11].i, a[12].i, a[13].i, a[14].i, a[15].i, a[16].i,
                                  a[17].f, (int)a[18].i, (int)a[19].i, PTR(20), (int)a[21].i);
}

static int slots_paged_rope_store_attend(const slot_t *a) {
    return llmx_paged_rope_store_attend(PTR(0), PTR(1), PTR(2), a[3].i, a[4].i, a[5].i, PTR(6), PTR(7), a[8].i,
                                        (int)a[9].i, PTR(10), PTR(11), (int)a[12].i, (int)a[13].i, PTR(14), a[15].i,
                                        a[16].i, PTR(17), a[18].i, a[19].i, a[20].i, a[21].i, a[22].i, a[23].f,
                                        (int)a[24].i, (int)a[25].i, PTR(26), (int)a[27].i);
}

static int slots_rms_norm(const slot_t *a) {
    llmx_rms_norm(PTR(0), PTR(1), PTR(2), PTR(3), PTR(4), PTR(5), a[6].i, a[7].i, a[8].f, (int)a[9].i);
    return 0;
}

#undef PTR

typedef int (*slots_fn)(const slot_t *);

static const struct {
    const char *name;
    slots_fn run;
    int args;
} SLOT_ENTRIES[] = {
    {"llmx_gemv_many", slots_gemv_many, 11},
    {"llmx_gated_ffn", slots_gated_ffn, 18},
    {"llmx_moe_swiglu", slots_moe_swiglu, 20},
    {"llmx_moe_route", slots_moe_route, 10},
    {"llmx_dequantize_rows", slots_dequantize_rows, 10},
    {"llmx_decode_attention", slots_decode_attention, 11},
    {"llmx_rope_store_attend", slots_rope_store_attend, 22},
    {"llmx_paged_rope_store_attend", slots_paged_rope_store_attend, 28},
    {"llmx_rms_norm", slots_rms_norm, 10},
};

/* The replay's number for entry point `name` taking `args` arguments, or -1 where it has none. */
int llmx_slots_entry(const char *name, int args) {
    for (int e = 0; e < (int)(sizeof SLOT_ENTRIES / sizeof SLOT_ENTRIES[0]); e++)
        if (strcmp(SLOT_ENTRIES[e].name, name) == 0) return SLOT_ENTRIES[e].args == args ? e : -1;
    return -1;
}

/* n calls: call c runs entry entries[c] on the slots args[c], its slot threads_at[c] (where >= 0) set to
 * `threads` first; the (call, slot, offset) triples `fields` set to position + offset before any runs.
 * Returns 0, or c + 1 for the first call c that failed. */
int llmx_replay(int64_t n, const int32_t *entries, slot_t *const *args, const int32_t *threads_at, int threads,
                int64_t n_fields, const int64_t *fields, int64_t position) {
    for (int64_t f = 0; f < n_fields; f++) args[fields[3 * f]][fields[3 * f + 1]].i = position + fields[3 * f + 2];
    for (int64_t c = 0; c < n; c++) {
        if (threads_at[c] >= 0) args[c][threads_at[c]].i = threads;
        if (SLOT_ENTRIES[entries[c]].run(args[c]) != 0) return (int)(c + 1);
    }
    return 0;
}

/* A captured GPU step's trips to its CPU experts (llmx/runtime/host_trips.py), served while the step's
 * graph runs: call c waits until the GPU has raised *ready[c] away from *done[c] (its operands written to
 * host memory), runs like a replayed call, and echoes the value it read into *done[c], on which the GPU
 * waits. The flags live in pinned memory that the GPU writes and reads over PCIe. Returns 0, c + 1 for a
 * call c that failed, or -(c + 1) where the GPU had not reached trip c within timeout_ns. */
int llmx_serve_trips(int64_t n, const int32_t *entries, slot_t *const *args, const int32_t *threads_at, int threads,
                     int32_t *const *ready, int32_t *const *done, int64_t timeout_ns) {
    for (int64_t c = 0; c < n; c++) {
        int32_t seen;
        int64_t since = -1;
        for (uint32_t spins = 0; (seen = __atomic_load_n(ready[c], __ATOMIC_ACQUIRE)) == *done[c]; spins++) {
            if ((spins & 4095) == 0) { /* the clock now and then: a poll is a few nanoseconds */
                struct timespec now;
                clock_gettime(CLOCK_MONOTONIC, &now);
                const int64_t ns = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
                if (since < 0) since = ns;
                else if (ns - since > timeout_ns) return (int)-(c + 1);
            }
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        }
        if (threads_at[c] >= 0) args[c][threads_at[c]].i = threads;
        if (SLOT_ENTRIES[entries[c]].run(args[c]) != 0) return (int)(c + 1);
        __atomic_store_n(done[c], seen, __ATOMIC_RELEASE); /* after the call's stores to its output */
    }
    return 0;
}
