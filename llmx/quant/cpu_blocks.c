/* GEMV and row dequantization straight on GGUF's blocks, and one token's attention over a KV
 * cache, for the CPU (built by cpu_native.py).
 *
 * Types: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K (most GGUFs' matrices); f32, f16, bf16 caches.
 *
 * Decode on the CPU is a race to read every weight byte once: a Q4_K matrix kept as GGUF stores it
 * is 0.5625 bytes a weight, against 0.75 for cpu_pack's float32-scaled form. Each thread takes a
 * contiguous range of rows; a row's dot product multiplies each group's codes with x first and
 * applies the group's scale once to the partial sums, as llama.cpp's dot products do, but in
 * float32 (x is not quantized). Up to 8 rows of x reuse each weight row while it sits in L1.
 * Weights are exactly GGUF's (d * scale * q - dmin * min); only the summation order differs from a
 * float32 reference. With AVX2 and FMA the dot products use them explicitly (compilers left the
 * partial sums in memory); elsewhere a portable loop decodes a block and multiplies.
 * The library is linked to the OpenMP runtime torch itself loaded (cpu_native.compile_to), so
 * torch.set_num_threads governs both and one thread pool serves them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#define LLMX_AVX2 1
#endif
#if defined(LLMX_AVX2) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { T_Q4_K = 0, T_Q6_K = 1, T_Q8_0 = 2, T_Q4_0 = 3, T_Q4_1 = 4, T_Q5_K = 5 };

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
static inline void q4_k_scale_min(int j, const uint8_t *s, int *scale, int *min) {
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q4_K, and Q5_K (five: 32 bytes of fifth bits at 16, the nibbles at 48; see decode_q5_k). */
static inline void decode_k_nibbles(const uint8_t *b, float *out, int five) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *qh = b + 16;
    for (int c = 0; c < 4; c++) {
        int s0, m0, s1, m1;
        q4_k_scale_min(2 * c, b + 4, &s0, &m0);
        q4_k_scale_min(2 * c + 1, b + 4, &s1, &m1);
        const float a0 = d * (float)s0, b0 = dmin * (float)m0, a1 = d * (float)s1, b1 = dmin * (float)m1;
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

/* Q5_K: Q4_K's d, dmin and scales, then 32 bytes qh, then Q4_K's 128 bytes of nibbles; the fifth
 * bit of group 2c's weight l is bit 2c of qh[l], of group 2c + 1's bit 2c + 1. */
static void decode_q5_k(const uint8_t *b, float *out) { decode_k_nibbles(b, out, 1); }

/* One row of W (`blocks` blocks) times x. `xsum` is x's sum over each group of 32, so that a
 * group's offset (Q4_K's and Q5_K's minimums, Q4_0's -8, Q4_1's m) costs one multiply. */
typedef float (*dot_fn)(const uint8_t *row, int64_t blocks, const float *x, const float *xsum);

#ifdef LLMX_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256i bytes8(const uint8_t *p) { /* 8 bytes, zero-extended to 8 int32 */
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* Q4_K and Q5_K (qh != 0: the fifth bits, at byte 16 of each block, nibbles at 48). */
static inline float dot_k_nibbles(const uint8_t *row, int64_t blocks, const float *x, const float *xsum, int five) {
    const __m256i low = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
    const int bytes = five ? 176 : 144, nibbles = five ? 48 : 16;
    __m256 acc = _mm256_setzero_ps();
    float mins = 0.0f;
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint8_t *b = row + bytes * blk;
        const float d = half_to_float(b), dmin = half_to_float(b + 2);
        for (int c = 0; c < 4; c++) {
            int s0, m0, s1, m1;
            q4_k_scale_min(2 * c, b + 4, &s0, &m0);
            q4_k_scale_min(2 * c + 1, b + 4, &s1, &m1);
            const uint8_t *q = b + nibbles + 32 * c;
            const float *x0 = x + 256 * blk + 64 * c, *x1 = x0 + 32;
            __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps();
            for (int l = 0; l < 32; l += 8) {
                const __m256i v = bytes8(q + l);
                __m256i lo = _mm256_and_si256(v, low), hi = _mm256_srli_epi32(v, 4);
                if (five) {
                    const __m256i h = bytes8(b + 16 + l);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2 * c), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2 * c + 1), one), 4));
                }
                p0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_loadu_ps(x0 + l), p0);
                p1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_loadu_ps(x1 + l), p1);
            }
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)s0), p0, acc);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)s1), p1, acc);
            mins += dmin * (float)m0 * xsum[8 * blk + 2 * c] + dmin * (float)m1 * xsum[8 * blk + 2 * c + 1];
        }
    }
    return hsum(acc) - mins;
}

static float dot_q4_k(const uint8_t *row, int64_t blocks, const float *x, const float *xsum) {
    return dot_k_nibbles(row, blocks, x, xsum, 0);
}

static float dot_q5_k(const uint8_t *row, int64_t blocks, const float *x, const float *xsum) {
    return dot_k_nibbles(row, blocks, x, xsum, 1);
}

/* Q4_0 and Q4_1 (offset: the f16 m after d, else the -8 every code carries). */
static inline float dot_legacy_nibbles(const uint8_t *row, int64_t blocks, const float *x, const float *xsum,
                                       int with_m) {
    const __m256i low = _mm256_set1_epi32(15);
    const int bytes = with_m ? 20 : 18;
    __m256 acc = _mm256_setzero_ps();
    float offsets = 0.0f;
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint8_t *b = row + bytes * blk, *q = b + (with_m ? 4 : 2);
        const float *xb = x + 32 * blk, d = half_to_float(b);
        __m256 p = _mm256_setzero_ps();
        for (int l = 0; l < 16; l += 8) {
            const __m256i v = bytes8(q + l);
            p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), _mm256_loadu_ps(xb + l), p);
            p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), _mm256_loadu_ps(xb + 16 + l), p);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc);
        offsets += (with_m ? half_to_float(b + 2) : -8.0f * d) * xsum[blk];
    }
    return hsum(acc) + offsets;
}

static float dot_q4_0(const uint8_t *row, int64_t blocks, const float *x, const float *xsum) {
    return dot_legacy_nibbles(row, blocks, x, xsum, 0);
}

static float dot_q4_1(const uint8_t *row, int64_t blocks, const float *x, const float *xsum) {
    return dot_legacy_nibbles(row, blocks, x, xsum, 1);
}

static float dot_q6_k(const uint8_t *row, int64_t blocks, const float *x, const float *xsum) {
    (void)xsum;
    const __m256i low = _mm256_set1_epi32(15), three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint8_t *b = row + 210 * blk;
        const float d = half_to_float(b + 208);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            const int8_t *sc = (const int8_t *)(b + 192 + 8 * h);
            const float *xh = x + 256 * blk + 128 * h;
            for (int g = 0; g < 2; g++) { /* positions 16g .. 16g + 15 of each quarter: one scale each */
                __m256 p[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                for (int l = 16 * g; l < 16 * g + 16; l += 8) {
                    const __m256i a = bytes8(ql + l), c = bytes8(ql + l + 32), hb = bytes8(qh + l);
                    const __m256i q[4] = {
                        _mm256_or_si256(_mm256_and_si256(a, low), _mm256_slli_epi32(_mm256_and_si256(hb, three), 4)),
                        _mm256_or_si256(_mm256_and_si256(c, low),
                                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, 2), three), 4)),
                        _mm256_or_si256(_mm256_srli_epi32(a, 4),
                                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, 4), three), 4)),
                        _mm256_or_si256(_mm256_srli_epi32(c, 4), _mm256_slli_epi32(_mm256_srli_epi32(hb, 6), 4)),
                    };
                    for (int j = 0; j < 4; j++)
                        p[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q[j], bias)),
                                               _mm256_loadu_ps(xh + 32 * j + l), p[j]);
                }
                for (int j = 0; j < 4; j++) acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc[g + 2 * j]), p[j], acc);
            }
        }
    }
    return hsum(acc);
}

static float dot_q8_0(const uint8_t *row, int64_t blocks, const float *x, const float *xsum) {
    (void)xsum;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint8_t *b = row + 34 * blk;
        const float *xb = x + 32 * blk;
        __m256 p = _mm256_setzero_ps();
        for (int l = 0; l < 32; l += 8) {
            const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + l)));
            p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(xb + l), p);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(b)), p, acc);
    }
    return hsum(acc);
}
#else
#define DOT_BY_DECODING(name, QK, BYTES)                                                               \
    static float dot_##name(const uint8_t *row, int64_t blocks, const float *x, const float *xsum) {   \
        (void)xsum;                                                                                     \
        float wf[QK], s = 0.0f;                                                                         \
        for (int64_t blk = 0; blk < blocks; blk++) {                                                    \
            decode_##name(row + BYTES * blk, wf);                                                       \
            for (int l = 0; l < QK; l++) s += wf[l] * x[QK * blk + l];                                  \
        }                                                                                               \
        return s;                                                                                       \
    }
DOT_BY_DECODING(q4_k, 256, 144)
DOT_BY_DECODING(q6_k, 256, 210)
DOT_BY_DECODING(q8_0, 32, 34)
DOT_BY_DECODING(q4_0, 32, 18)
DOT_BY_DECODING(q4_1, 32, 20)
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
    default: return 0;
    }
}

#define MAX_WEIGHTS 4

/* Several matrices that multiply the same x (q/k/v, gate/up), of any of the types, in one parallel
 * region: y [m, N] holds weight j's outputs in columns off_j .. off_j + n[j] - 1 (in order, N their
 * sum). Each W_j is n[j] rows of k weights, row_bytes[j] apart; m <= 8 rows of x [m, k].
 * Returns 0, or -1 for an unknown type, a bad count or m, or no memory. */
int llmx_gemv_many(int count, const int *types, const uint8_t *const *ws, const int64_t *ns,
                   const int64_t *row_bytes, int64_t k, const float *x, int64_t m, float *y, int threads) {
    dot_fn dot[MAX_WEIGHTS];
    void (*decode)(const uint8_t *, float *);
    int64_t blocks[MAX_WEIGHTS], start[MAX_WEIGHTS + 1] = {0};
    if (count < 1 || count > MAX_WEIGHTS || m < 1 || m > 8) return -1;
    for (int j = 0; j < count; j++) {
        int qk, bytes;
        if (!block_of(types[j], &dot[j], &decode, &qk, &bytes)) return -1;
        blocks[j] = k / qk;
        start[j + 1] = start[j] + ns[j];
    }
    const int64_t total = start[count], groups = k / 32;
    float *xsum = malloc(sizeof(float) * (size_t)(m * groups));
    if (xsum == NULL) return -1;
    for (int64_t g = 0; g < m * groups; g++) {
        float s = 0.0f;
        for (int l = 0; l < 32; l++) s += x[32 * g + l];
        xsum[g] = s;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < total; r++) {
        int j = 0;
        while (r >= start[j + 1]) j++;
        const uint8_t *row = ws[j] + (r - start[j]) * row_bytes[j];
        for (int64_t i = 0; i < m; i++) y[i * total + r] = dot[j](row, blocks[j], x + i * k, xsum + i * groups);
    }
    free(xsum);
    return 0;
}

/* out[r - r0, :] = W[r, :] in float32 for rows r0 <= r < r1. Returns 0, or -1 for an unknown type. */
int llmx_dequantize_rows(int type, const uint8_t *w, int64_t r0, int64_t r1, int64_t row_bytes, int64_t k,
                         float *out, int threads) {
    dot_fn dot;
    void (*decode)(const uint8_t *, float *);
    int qk, bytes;
    if (!block_of(type, &dot, &decode, &qk, &bytes)) return -1;
    const int64_t blocks = k / qk;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = r0; r < r1; r++)
        for (int64_t blk = 0; blk < blocks; blk++) decode(w + r * row_bytes + bytes * blk, out + (r - r0) * k + qk * blk);
    return 0;
}

/* --- one token's attention over a KV cache ------------------------------------------------------ */

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

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

/* A cache row of `type` as d floats in `out` (d a multiple of 8). */
static inline void kv_row(const void *row, int type, int64_t d, float *out) {
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
#define PREFETCH_ROWS 8 /* cache rows ahead (prefetching past the end is harmless: it cannot fault) */

/* q [H, D] float32 (scaled), k and v [n, Hk, D] of `type`, every key visible -> out [H, D] float32.
 * The keys are cut into chunks, so that there are a few (KV head, chunk) items a thread; each item
 * reads its keys and values once, converting each row once for the H / Hk query heads of its group,
 * and leaves per query head its scores' maximum, the sum of their exponentials and the unnormalized
 * weighted sum of its values; the chunks of a head are then combined (as flash-decoding does).
 * `scratch` holds H * n floats. Returns 0, or -1 for D not a multiple of 8 (or above MAX_HEAD_DIM),
 * H not a multiple of Hk, or no memory. */
int llmx_decode_attention(const float *q, const void *k, const void *v, int type, int64_t n, int64_t n_head,
                          int64_t n_kv, int64_t d, float *scratch, float *out, int threads) {
    if (d % 8 != 0 || d > MAX_HEAD_DIM || n_head % n_kv != 0 || n < 1) return -1;
    const int64_t group = n_head / n_kv, elem = type == KV_F32 ? 4 : 2, row_bytes = n_kv * d * elem;
    int64_t chunks = (4 * threads + n_kv - 1) / n_kv;  /* about four items a thread ... */
    if (chunks > (n + 63) / 64) chunks = (n + 63) / 64; /* ... of 64 keys or more */
    if (chunks < 1) chunks = 1;
    const int64_t len = (n + chunks - 1) / chunks;
    float *part = malloc(sizeof(float) * (size_t)(n_head * chunks * (d + 2)));  /* o, then max and sum */
    if (part == NULL) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t h = 0; h < n_kv; h++) {
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t j0 = c * len, j1 = j0 + len < n ? j0 + len : n;
            const char *kh = (const char *)k + h * d * elem, *vh = (const char *)v + h * d * elem;
            const float *qh = q + h * group * d;
            float *s = scratch + h * group * n, row[MAX_HEAD_DIM];
            for (int64_t j = j0; j < j1; j++) {
                __builtin_prefetch(kh + (j + PREFETCH_ROWS) * row_bytes);  /* rows are strided: help */
                kv_row(kh + j * row_bytes, type, d, row);
                for (int64_t g = 0; g < group; g++) s[g * n + j] = dot_f32(qh + g * d, row, d);
            }
            for (int64_t g = 0; g < group; g++) {
                float *pg = part + ((h * group + g) * chunks + c) * (d + 2);
                if (j1 <= j0) {  /* an empty last chunk: weight 0 in the combination */
                    pg[d] = -INFINITY;
                    pg[d + 1] = 0.0f;
                    continue;
                }
                pg[d] = max_of(s + g * n + j0, j1 - j0);
                pg[d + 1] = exp_shifted(s + g * n + j0, j1 - j0, pg[d]);
                for (int64_t i = 0; i < d; i++) pg[i] = 0.0f;
            }
            for (int64_t j = j0; j < j1; j++) {
                __builtin_prefetch(vh + (j + PREFETCH_ROWS) * row_bytes);
                kv_row(vh + j * row_bytes, type, d, row);
                for (int64_t g = 0; g < group; g++) {
                    const float p = s[g * n + j];
                    float *og = part + ((h * group + g) * chunks + c) * (d + 2);
#ifdef LLMX_AVX2
                    const __m256 pv = _mm256_set1_ps(p);
                    for (int64_t i = 0; i < d; i += 8)
                        _mm256_storeu_ps(og + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(row + i), _mm256_loadu_ps(og + i)));
#else
                    for (int64_t i = 0; i < d; i++) og[i] += p * row[i];
#endif
                }
            }
        }
    }
    for (int64_t hq = 0; hq < n_head; hq++) {  /* combine each query head's chunks */
        const float *ph = part + hq * chunks * (d + 2);
        float top = -INFINITY, sum = 0.0f, *o = out + hq * d;
        for (int64_t c = 0; c < chunks; c++) top = ph[c * (d + 2) + d] > top ? ph[c * (d + 2) + d] : top;
        for (int64_t i = 0; i < d; i++) o[i] = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const float *pc = ph + c * (d + 2), w = pc[d] == -INFINITY ? 0.0f : expf(pc[d] - top);
            sum += w * pc[d + 1];
            for (int64_t i = 0; i < d; i++) o[i] += w * pc[i];
        }
        for (int64_t i = 0; i < d; i++) o[i] /= sum;
    }
    free(part);
    return 0;
}
