/* The two kernels of a decode step on the CPU: attention of one query row per head over the cached rows, and the
 * few-row matmuls (GEMV) of the projections, MLP and LM head. Built by kernels/decode_step.py with the machine's
 * compiler; torch's ops stay the reference and the fallback.
 *
 * Attention. Split-K ("flash-decoding"): the keys of each KV head are cut into blocks of BLOCK rows; every (KV head, block)
 * is one OpenMP work item that reads its rows once and keeps, per query head of the group, the block's max score,
 * its sum of exp(score - max) and its exp-weighted sum of values; a second pass merges the blocks per query head.
 * Scores, softmax and sums are fp32 (as SDPA's CPU kernel); the cache is read in place, bf16 or fp32.
 *
 * Why not torch's ops: a bf16 decode step streams the cache through oneDNN matmuls of 3 query rows or SDPA's
 * flash kernel at 5-8 GB/s on an AVX512-BF16 EPYC (a plain sum reads the same rows at 26-33 GB/s).
 *
 * Layout: q (H, d); k, v: KVH heads, head h's rows at k + h * head_stride, row j at + j * d (contiguous rows);
 * query head i reads KV head i / (H / KVH) (HF's repeat_kv); out (H, d) in the cache's dtype.
 *
 * GEMV. y (M, out) = x (M, in) W^T + b for a few rows M (one per sequence of a decode step; the caller sends M <= 4), W (out, in) row-major as
 * torch holds it, read once: each output row is one fp32 dot product per input row, rounded once to the dtype (as
 * oneDNN's bf16 matmul does). oneDNN's packed bf16 GEMV reads the weights at 17-21 GB/s on an AVX512-BF16 EPYC,
 * this loop at 26-50 GB/s.
 */
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>

#define BLOCK 256
#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_ROWS 8
#define MAX_IN 16384

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {  /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* exp(x) for x <= 0: 2^(x log2 e) split into 2^i * 2^f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial
 * (Cephes' exp2f coefficients, relative error ~2e-7); written without branches or libm so that the loops calling it vectorize. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float fi = t >= 0.0f ? (float)(int)(t + 0.5f) : (float)(int)(t - 0.5f);
    float f = t - fi;
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6184374e-3f;
    p = p * f + 5.5503325e-2f;
    p = p * f + 2.4022648e-1f;
    p = p * f + 6.9314720e-1f;
    p = p * f + 1.0f;
    int32_t e = ((int32_t)fi + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* One work item: keys [lo, hi) of one KV head for its `group` query rows qf (already scaled, fp32); writes per
 * query row max, sum of exp and the exp-weighted sum of values to part. D is a compile-time constant in the
 * specialized copies (64, 128), which keeps a row and the value accumulator in vector registers. */
#define DEFINE_BLOCK(NAME, T, LOAD, D_EXPR)                                                                         \
static void NAME(const T *kh, const T *vh, int64_t lo, int64_t hi, const float *qf, int group, int d_arg,          \
                 float *part) {                                                                                    \
    const int d = D_EXPR;                                                                                          \
    const int64_t stride = 2 + d;                                                                                  \
    float scores[MAX_GROUP][BLOCK];                                                                                \
    for (int64_t j = lo; j < hi; j++) {                                                                            \
        const T *kj = kh + j * d;                                                                                  \
        float row[MAX_DIM];                                                                                        \
        _Pragma("omp simd")                                                                                        \
        for (int t = 0; t < d; t++) row[t] = LOAD(kj[t]);                                                          \
        for (int g = 0; g < group; g++) {                                                                          \
            const float *qg = qf + g * d;                                                                          \
            float s = 0.0f;                                                                                        \
            _Pragma("omp simd reduction(+:s)")                                                                     \
            for (int t = 0; t < d; t++) s += qg[t] * row[t];                                                       \
            scores[g][j - lo] = s;                                                                                 \
        }                                                                                                          \
    }                                                                                                              \
    const int64_t len = hi - lo;                                                                                   \
    for (int g = 0; g < group; g++) {                                                                              \
        float m = -INFINITY, sum = 0.0f, acc[MAX_DIM];                                                             \
        _Pragma("omp simd reduction(max:m)")                                                                       \
        for (int64_t j = 0; j < len; j++) m = scores[g][j] > m ? scores[g][j] : m;                                 \
        _Pragma("omp simd reduction(+:sum)")                                                                       \
        for (int64_t j = 0; j < len; j++) {                                                                        \
            scores[g][j] = exp_nonpositive(scores[g][j] - m);                                                      \
            sum += scores[g][j];                                                                                   \
        }                                                                                                          \
        for (int t = 0; t < d; t++) acc[t] = 0.0f;                                                                 \
        for (int64_t j = 0; j < len; j++) {                                                                        \
            const T *vj = vh + (lo + j) * d;                                                                       \
            const float p = scores[g][j];                                                                          \
            _Pragma("omp simd")                                                                                    \
            for (int t = 0; t < d; t++) acc[t] += p * LOAD(vj[t]);                                                 \
        }                                                                                                          \
        part[g * stride] = m;                                                                                      \
        part[g * stride + 1] = sum;                                                                                \
        memcpy(part + g * stride + 2, acc, sizeof(float) * d);                                                     \
    }                                                                                                              \
}

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                                         \
DEFINE_BLOCK(NAME##_block64, T, LOAD, 64)                                                                           \
DEFINE_BLOCK(NAME##_block128, T, LOAD, 128)                                                                         \
DEFINE_BLOCK(NAME##_block, T, LOAD, d_arg)                                                                          \
int NAME(const T *q, const T *k, const T *v, T *out, int heads, int kv_heads, int d, int64_t head_stride,          \
         int64_t n, float scale) {                                                                                 \
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads || heads / kv_heads > MAX_GROUP || d > MAX_DIM || n <= 0) \
        return -1;                                                                                                  \
    const int group = heads / kv_heads;                                                                             \
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;                                                                 \
    const int64_t stride = 2 + d; /* max, sum, values */                                                            \
    float *scratch = malloc(sizeof(float) * heads * blocks * stride); /* every block's partial results */          \
    if (!scratch) return -2;                                                                                        \
    _Pragma("omp parallel for schedule(static)")                                                                    \
    for (int64_t item = 0; item < kv_heads * blocks; item++) {                                                      \
        const int h = (int)(item / blocks);                                                                         \
        const int64_t lo = (item % blocks) * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;                           \
        float qf[MAX_GROUP * MAX_DIM];                                                                              \
        for (int g = 0; g < group; g++)                                                                             \
            for (int t = 0; t < d; t++) qf[g * d + t] = LOAD(q[(int64_t)(h * group + g) * d + t]) * scale;          \
        const T *kh = k + h * head_stride, *vh = v + h * head_stride;                                               \
        float *part = scratch + item * group * stride;                                                              \
        if (d == 64) NAME##_block64(kh, vh, lo, hi, qf, group, d, part);                                            \
        else if (d == 128) NAME##_block128(kh, vh, lo, hi, qf, group, d, part);                                     \
        else NAME##_block(kh, vh, lo, hi, qf, group, d, part);                                                      \
    }                                                                                                               \
    for (int i = 0; i < heads; i++) { /* merge the blocks of query head i */                                        \
        const int h = i / group, g = i % group;                                                                     \
        float m = -INFINITY, total = 0.0f, acc[MAX_DIM];                                                            \
        for (int64_t b = 0; b < blocks; b++) {                                                                      \
            const float mb = scratch[((h * blocks + b) * group + g) * stride];                                      \
            m = mb > m ? mb : m;                                                                                    \
        }                                                                                                           \
        memset(acc, 0, sizeof(float) * d);                                                                          \
        for (int64_t b = 0; b < blocks; b++) {                                                                      \
            const float *part = scratch + ((h * blocks + b) * group + g) * stride;                                  \
            const float w = expf(part[0] - m);                                                                      \
            total += w * part[1];                                                                                   \
            for (int t = 0; t < d; t++) acc[t] += w * part[2 + t];                                                  \
        }                                                                                                           \
        for (int t = 0; t < d; t++) out[(int64_t)i * d + t] = STORE(acc[t] / total);                                \
    }                                                                                                               \
    free(scratch);                                                                                                  \
    return 0;                                                                                                       \
}

#define LOAD_FLOAT(x) (x)
#define STORE_FLOAT(x) (x)

DEFINE_KERNEL(decode_attention_bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_KERNEL(decode_attention_f32, float, LOAD_FLOAT, STORE_FLOAT)

#define DEFINE_GEMV(NAME, T, LOAD, STORE)                                                                           \
int NAME(const T *x, const T *w, const T *bias, T *y, int rows, int64_t out, int64_t in) {                         \
    if (rows <= 0 || rows > MAX_ROWS || in <= 0 || in > MAX_IN) return -1;                                         \
    float *xf = malloc(sizeof(float) * rows * in);                                                                 \
    if (!xf) return -2;                                                                                             \
    for (int m = 0; m < rows; m++)                                                                                  \
        for (int64_t i = 0; i < in; i++) xf[m * in + i] = LOAD(x[m * in + i]);                                      \
    _Pragma("omp parallel for schedule(static)")                                                                    \
    for (int64_t o = 0; o < out; o++) {                                                                             \
        const T *wo = w + o * in;                                                                                   \
        const float b = bias ? LOAD(bias[o]) : 0.0f;                                                                \
        for (int m = 0; m < rows; m++) {                                                                            \
            const float *xm = xf + m * in;                                                                          \
            float s = 0.0f;                                                                                         \
            _Pragma("omp simd reduction(+:s)")                                                                      \
            for (int64_t i = 0; i < in; i++) s += xm[i] * LOAD(wo[i]);                                              \
            y[m * out + o] = STORE(s + b);                                                                          \
        }                                                                                                           \
    }                                                                                                               \
    free(xf);                                                                                                       \
    return 0;                                                                                                       \
}

DEFINE_GEMV(gemv_bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_GEMV(gemv_f32, float, LOAD_FLOAT, STORE_FLOAT)
