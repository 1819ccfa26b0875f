// Paged attention over kvpool's [N, B, H, D] per-layer views, read in place by block table (CPU).
// The contract (shapes, units, formulas) is kvpool/engine/paged_attention.py's docstring; this file is the
// loop it names. One work item = up to kRunTokens consecutive query tokens of a request x its KV heads: their
// query heads walk the request's blocks from the first key a window reaches to each query's own position,
// with an online softmax (Milakov & Gimelshein 2018; FlashAttention's running max and sum), so no key is
// copied and no mask is built. Runs of kMinRows queries or more take GEMM tiles instead (attend_rows).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

namespace {

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// e^x, 8 lanes (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial in r, times 2^n; within
// 2 ulp of expf); x below -87.3 (-inf included) gives 0, as the softmax wants
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365447504f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447504f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// [sum(a0), sum(a1), sum(a2), sum(a3)]: four keys' dot products reduced together (three hadds, no per-key
// horizontal sum)
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// score[o] += q[0 .. 8 NC) . k_o[0 .. 8 NC) for keys o < n (k_o = k + o * ks): q held in NC registers, keys
// four at a time
template <int NC>
inline void dots_chunk(const float* q, const float* k, int64_t ks, int64_t n, float* score) {
  __m256 qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
  int64_t o = 0;
  for (; o + 4 <= n; o += 4) {
    const float *k0 = k + o * ks, *k1 = k0 + ks, *k2 = k1 + ks, *k3 = k2 + ks;
    __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0)), a1 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k1));
    __m256 a2 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k2)), a3 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k3));
    for (int c = 1; c < NC; ++c) {
      a0 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k0 + 8 * c), a0);
      a1 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k1 + 8 * c), a1);
      a2 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k2 + 8 * c), a2);
      a3 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k3 + 8 * c), a3);
    }
    _mm_storeu_ps(score + o, _mm_add_ps(_mm_loadu_ps(score + o), hsum4(a0, a1, a2, a3)));
  }
  for (; o < n; ++o) {
    const float* ko = k + o * ks;
    __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(ko));
    for (int c = 1; c < NC; ++c) a = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(ko + 8 * c), a);
    score[o] += hsum(a);
  }
}

// acc[0 .. 8 NC) += sum_o w[o] v_o[0 .. 8 NC) (v_o = v + o * vs): the accumulator held in NC registers across
// the keys, loaded and stored once
template <int NC>
inline void axpy_chunk(const float* w, const float* v, int64_t vs, int64_t n, float* acc) {
  __m256 a[NC];
  for (int c = 0; c < NC; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t o = 0; o < n; ++o) {
    const __m256 wv = _mm256_broadcast_ss(w + o);
    const float* vo = v + o * vs;
    for (int c = 0; c < NC; ++c) a[c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vo + 8 * c), a[c]);
  }
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

// f<NC>(i) over the 8-float chunks of [0, n): groups of 8 chunks, then one group of the rest; returns the
// first index past them (the scalar tail starts there)
template <template <int> class F, typename... A>
inline int64_t by_chunks(int64_t n, A... args) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) F<8>::run(i, args...);
  switch ((n - i) / 8) {
    case 7: F<7>::run(i, args...); break;
    case 6: F<6>::run(i, args...); break;
    case 5: F<5>::run(i, args...); break;
    case 4: F<4>::run(i, args...); break;
    case 3: F<3>::run(i, args...); break;
    case 2: F<2>::run(i, args...); break;
    case 1: F<1>::run(i, args...); break;
    default: break;
  }
  return i + (n - i) / 8 * 8;
}

template <int NC>
struct Dots {
  static void run(int64_t i, const float* q, const float* k, int64_t ks, int64_t n, float* score) {
    dots_chunk<NC>(q + i, k + i, ks, n, score);
  }
};

template <int NC>
struct Axpys {
  static void run(int64_t i, const float* w, const float* v, int64_t vs, int64_t n, float* acc) {
    axpy_chunk<NC>(w, v + i, vs, n, acc + i);
  }
};
#endif

// score[o] = q . k_o for the n keys k_o = k + o * ks, q and each key d floats
inline void key_dots(const float* q, const float* k, int64_t ks, int64_t n, int64_t d, float* score) {
  std::fill(score, score + n, 0.f);
  int64_t i0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  i0 = by_chunks<Dots>(d, q, k, ks, n, score);
#endif
  for (int64_t o = 0; o < n; ++o)
    for (int64_t i = i0; i < d; ++i) score[o] += q[i] * k[o * ks + i];
}

// acc += sum_o w[o] v_o for the n values v_o = v + o * vs, acc and each value dv floats
inline void value_sums(const float* w, const float* v, int64_t vs, int64_t n, int64_t dv, float* acc) {
  int64_t i0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  i0 = by_chunks<Axpys>(dv, w, v, vs, n, acc);
#endif
  for (int64_t o = 0; o < n; ++o)
    for (int64_t i = i0; i < dv; ++i) acc[i] += w[o] * v[o * vs + i];
}

// dst[o * d + i] = src[o * stride + i] as float32, for n rows of d elements
template <typename T>
inline void copy_rows(const T* src, int64_t stride, int64_t n, int64_t d, float* dst) {
  for (int64_t o = 0; o < n; ++o)
    for (int64_t i = 0; i < d; ++i) dst[o * d + i] = static_cast<float>(src[o * stride + i]);
}

// n rows of d elements (row stride `stride`) as float32: read in place for a float cache, else converted into
// tmp (and `stride` set to its row stride d)
template <typename T>
inline const float* rows_as_float(const T* src, int64_t& stride, int64_t n, int64_t d, float* tmp) {
  copy_rows(src, stride, n, d, tmp);
  stride = d;
  return tmp;
}

template <>
inline const float* rows_as_float<float>(const float* src, int64_t&, int64_t, int64_t, float*) { return src; }

struct Shape {
  int64_t tokens, requests, max_blocks, hq, hkv, d, dv, block;
  int64_t q_t, q_h, k_n, k_b, k_h, v_n, v_b, v_h, o_t, o_h;  // strides, in elements
  int64_t window, chunk;  // sliding window W, chunk C (0: none)
  float scale, softcap;   // softcap 0: none
};

// e^(x[o] - m) into x[o] for o < n; returns their sum
inline float exp_sum(float* x, int64_t n, float m) {
  float l = 0.f;
  int64_t o = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 top = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  for (; o + 8 <= n; o += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + o), top));
    _mm256_storeu_ps(x + o, e);
    total = _mm256_add_ps(total, e);
  }
  l = hsum(total);
#endif
  for (; o < n; ++o) {
    x[o] = std::exp(x[o] - m);
    l += x[o];
  }
  return l;
}

// One row of the online softmax: of the scores x[0, n), keys [a, b) count (a < b; the others become 0).
// Soft-capping, the running max mx and sum (acc [dv] rescaled when the max grows; on the first keys:
// 0 * the zero accumulator), then x[o] = e^(x[o] - mx), the weights of P V.
inline void online_update(float* x, int64_t n, int64_t a, int64_t b, float softcap, float& mx, float& sum,
                          float* acc, int64_t dv) {
  const float inf = std::numeric_limits<float>::infinity();
  std::fill(x, x + a, -inf);
  std::fill(x + b, x + n, -inf);
  if (softcap > 0.f)
    for (int64_t o = a; o < b; ++o) x[o] = std::tanh(x[o] / softcap) * softcap;
  float m = mx;
#pragma omp simd reduction(max : m)
  for (int64_t o = a; o < b; ++o) m = std::max(m, x[o]);
  if (m > mx) {
    const float c = std::exp(mx - m);
    for (int64_t i = 0; i < dv; ++i) acc[i] *= c;
    sum *= c;
    mx = m;
  }
  sum += exp_sum(x, n, m);
}

// One query head over n keys of a block (q scaled; k_o = k + o * ks, v_o = v + o * vs): the n scores,
// online_update, acc += P V. score: [n rounded up to 8] scratch (whole vectors of exp: the padding's
// e^-inf = 0).
inline void block_step(const Shape& s, const float* q, const float* k, int64_t ks, const float* v, int64_t vs,
                       int64_t n, float* score, float& mx, float& sum, float* acc) {
  key_dots(q, k, ks, n, s.d, score);
  online_update(score, (n + 7) / 8 * 8, 0, n, s.softcap, mx, sum, acc, s.dv);
  value_sums(score, v, vs, n, s.dv, acc);
}

// Floats of attend_run's scratch for `queries` query tokens x `kv_heads` KV heads: queries, accumulators,
// maxima and sums of their query heads, one block's scores, and one block's K and V as float32.
inline int64_t run_scratch(const Shape& s, int64_t queries, int64_t kv_heads) {
  return queries * kv_heads * (s.hq / s.hkv) * (s.d + s.dv + 2) + (s.block + 7) / 8 * 8 + s.block * (s.d + s.dv);
}

// Query tokens [t0, t1) of request r (consecutive positions), KV heads [g0, g1) and their query heads: block
// by block (each block's K and V rows of those heads read once, in order, for all the run's queries), every
// query head's block_step over the keys its window and causal edge leave in the block.
template <typename T>
void attend_run(const Shape& s, const T* q, const T* kc, const T* vc, const int32_t* tables,
                const int32_t* starts, const int32_t* positions, const float* sinks, T* out, int64_t r,
                int64_t t0, int64_t t1, int64_t g0, int64_t g1, std::vector<float>& buf) {
  const int64_t groups = s.hq / s.hkv, heads = (g1 - g0) * groups, h0 = g0 * groups, rows = (t1 - t0) * heads;
  const int64_t p0 = positions[r] + (t0 - starts[r]), last = p0 + (t1 - t0) - 1;
  auto lo_of = [&](int64_t p) -> int64_t {
    if (s.window > 0) return std::max<int64_t>(0, p - s.window + 1);
    if (s.chunk > 0) return s.chunk * (p / s.chunk);
    return 0;
  };
  float* qf = buf.data();         // [rows, D], row (t - t0) * heads + j
  float* acc = qf + rows * s.d;   // [rows, Dv]
  float* mx = acc + rows * s.dv;  // [rows]
  float* sum = mx + rows;         // [rows]
  float* score = sum + rows;      // [B rounded up to 8]
  float* kt = score + (s.block + 7) / 8 * 8;  // [B, D]
  float* vt = kt + s.block * s.d; // [B, Dv]
  for (int64_t i = 0; i < rows; ++i) {
    const T* row = q + (t0 + i / heads) * s.q_t + (h0 + i % heads) * s.q_h;
    for (int64_t x = 0; x < s.d; ++x) qf[i * s.d + x] = static_cast<float>(row[x]) * s.scale;
    std::fill(acc + i * s.dv, acc + (i + 1) * s.dv, 0.f);
    mx[i] = -std::numeric_limits<float>::infinity();
    sum[i] = 0.f;
  }
  const int32_t* table = tables + r * s.max_blocks;
  for (int64_t blk = lo_of(p0) / s.block; blk <= last / s.block; ++blk) {
    const int64_t phys = table[blk], k0 = blk * s.block;
    const int64_t first = std::max(lo_of(p0), k0) - k0, end = std::min(last + 1, k0 + s.block) - k0;
    for (int64_t g = g0; g < g1; ++g) {  // the rows any query of the run reads: [first, end)
      int64_t ks = s.k_b, vs = s.v_b;
      const float* kb = rows_as_float(kc + phys * s.k_n + g * s.k_h + first * s.k_b, ks, end - first, s.d, kt);
      const float* vb = rows_as_float(vc + phys * s.v_n + g * s.v_h + first * s.v_b, vs, end - first, s.dv, vt);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t p = p0 + (t - t0);
        const int64_t o0 = std::max(lo_of(p), k0) - k0, o1 = std::min(p + 1, k0 + s.block) - k0;
        if (o1 <= o0) continue;
        const int64_t base = (t - t0) * heads + (g - g0) * groups;
        for (int64_t j = base; j < base + groups; ++j)
          block_step(s, qf + j * s.d, kb + (o0 - first) * ks, ks, vb + (o0 - first) * vs, vs, o1 - o0, score,
                     mx[j], sum[j], acc + j * s.dv);
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t h = h0 + i % heads;
    float m = mx[i], denom = sum[i], c = 1.f;
    if (sinks != nullptr) {  // gpt-oss: the sink joins the softmax's denominator only
      const float top = std::max(m, sinks[h]);
      c = std::exp(m - top);
      denom = sum[i] * c + std::exp(sinks[h] - top);
    }
    T* row = out + (t0 + i / heads) * s.o_t + h * s.o_h;
    const float* a = acc + i * s.dv;
    for (int64_t x = 0; x < s.dv; ++x) row[x] = static_cast<T>(a[x] * c / denom);
  }
}


constexpr int64_t kTileKeys = 128;  // keys per GEMM tile (whole blocks), as SDPA's CPU kernel tiles

// A run of L >= kMinRows queries of one request, for KV head g and its G query heads as L * G rows (row
// i * G + j: query i, head g * G + j; query i at position p0 + i). Per tile of kTileKeys keys (whole blocks,
// staged in order out of the pool as float32: a tile per KV head, not a copy per query): S = Q K^T (one ATen
// GEMM), each row's online_update in place (its keys only: the window's start and the causal edge), then
// acc += P V (a second GEMM).
template <typename T>
void attend_rows(const Shape& s, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                 const int32_t* table, int64_t first, int64_t len, int64_t p0, int64_t g, const float* sinks,
                 at::Tensor& out) {
  const int64_t groups = s.hq / s.hkv;
  const float inf = std::numeric_limits<float>::infinity();
  at::Tensor qf = q.narrow(0, first, len).narrow(1, g * groups, groups).to(at::kFloat)
                      .reshape({len * groups, s.d}) * s.scale;  // a new tensor: the query is left as it is
  auto opts = qf.options();
  at::Tensor acc = at::zeros({len * groups, s.dv}, opts);
  at::Tensor mx = at::full({len * groups, 1}, -inf, opts), sum = at::zeros({len * groups, 1}, opts);
  auto lo_of = [&](int64_t p) -> int64_t {
    if (s.window > 0) return std::max<int64_t>(0, p - s.window + 1);
    if (s.chunk > 0) return s.chunk * (p / s.chunk);
    return 0;
  };
  const int64_t last = p0 + len - 1, tile = std::max<int64_t>(1, kTileKeys / s.block);
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  at::Tensor kt = at::empty({tile * s.block, s.d}, opts), vt = at::empty({tile * s.block, s.dv}, opts);
  for (int64_t blk = lo_of(p0) / s.block; blk <= last / s.block; blk += tile) {
    const int64_t nb = std::min(tile, last / s.block + 1 - blk), k0 = blk * s.block;
    const int64_t width = std::min(nb * s.block, last - k0 + 1), k1 = k0 + width - 1;  // never past `last`:
    // slots after the last new token are not written yet (and 0 * NaN in P V would not be 0)
    const int64_t r0 = std::max<int64_t>(0, k0 - p0);       // first query at or after the tile
    int64_t r1 = len;                                       // past the last query the tile reaches
    while (r1 > r0 && lo_of(p0 + r1 - 1) > k1) --r1;
    if (r1 <= r0) continue;
    const int64_t n = (r1 - r0) * groups;
    for (int64_t j = 0; j < nb; ++j) {  // the tile's blocks staged in order, as float32
      const int64_t rows = std::min(s.block, width - j * s.block), phys = table[blk + j];
      copy_rows(kp + phys * s.k_n + g * s.k_h, s.k_b, rows, s.d, kt.data_ptr<float>() + j * s.block * s.d);
      copy_rows(vp + phys * s.v_n + g * s.v_h, s.v_b, rows, s.dv, vt.data_ptr<float>() + j * s.block * s.dv);
    }
    at::Tensor sc = at::mm(qf.narrow(0, r0 * groups, n), kt.narrow(0, 0, width).t());  // [n, width]
    float* S = sc.data_ptr<float>();
    float* M = mx.data_ptr<float>() + r0 * groups;
    float* L = sum.data_ptr<float>() + r0 * groups;
    float* A = acc.data_ptr<float>() + r0 * groups * s.dv;
    for (int64_t i = 0; i < n; ++i) {  // row i: query r0 + i / G, its keys [lo, p] within the tile
      const int64_t p = p0 + r0 + i / groups;
      online_update(S + i * width, width, std::max<int64_t>(lo_of(p) - k0, 0), std::min(p - k0 + 1, width),
                    s.softcap, M[i], L[i], A + i * s.dv, s.dv);
    }
    acc.narrow(0, r0 * groups, n).addmm_(sc, vt.narrow(0, 0, width));
  }
  if (sinks != nullptr) {  // gpt-oss: the sink joins each row's denominator
    at::Tensor sink = at::from_blob(const_cast<float*>(sinks) + g * groups, {groups}, opts).repeat({len})
                          .unsqueeze(1);
    at::Tensor top = at::maximum(mx, sink);
    at::Tensor c = (mx - top).exp_();
    acc.mul_(c);
    sum.mul_(c).add_((sink - top).exp_());
  }
  acc.div_(sum);
  out.narrow(0, first, len).narrow(1, g * groups, groups).copy_(acc.view({len, groups, s.dv}));
}

// runs of fewer queries (decode, chunks, prefills up to 511 tokens) take attend_run's loop: measured faster
// than the tiles here up to 256 queries (128: 1.5x), slower from 512 (0.9x; at 1024 and 2048 too)
constexpr int64_t kMinRows = 512;
constexpr int64_t kRunTokens = 8;  // queries of one attend_run item (each block read once for them: 4-64 measured alike)
constexpr int64_t kRowTile = 512;  // queries per tile of a longer run (128, 64, 32 measured slower: more GEMM calls)

}  // namespace

// q [T, Hq, D]; k_cache [N, B, Hkv, D], v_cache [N, B, Hkv, Dv] (any strides, last dim contiguous);
// tables [R, M] int32; starts [R + 1] int32; positions [R] int32; sinks [Hq] float32 or empty;
// out [T, Hq, Dv] (last dim contiguous). Indices are trusted (checked by the caller).
void paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                     torch::Tensor starts, torch::Tensor positions, torch::Tensor sinks, torch::Tensor out,
                     int64_t window, int64_t chunk, double scale, double softcap) {
  Shape s{q.size(0), tables.size(0), tables.size(1), q.size(1), k_cache.size(2), q.size(2),
          v_cache.size(3), k_cache.size(1), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
          k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0),
          out.stride(1), window, chunk, static_cast<float>(scale), static_cast<float>(softcap)};
  const float* sink = sinks.numel() ? sinks.data_ptr<float>() : nullptr;
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* sp = starts.data_ptr<int32_t>();
  const int32_t* pp = positions.data_ptr<int32_t>();
  // runs of up to kRunTokens consecutive queries of one request, and tiles of kRowTile queries of the runs
  // of kMinRows or more (request, first query of the tile; x Hkv)
  std::vector<std::array<int64_t, 3>> runs;  // request, first token, past the last token
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t r = 0; r < s.requests; ++r) {
    if (sp[r + 1] - sp[r] >= kMinRows) {
      for (int64_t t = sp[r]; t < sp[r + 1]; t += kRowTile) tiles.emplace_back(r, t);
      continue;
    }
    for (int64_t t = sp[r]; t < sp[r + 1]; t += kRunTokens)
      runs.push_back({r, t, std::min<int64_t>(t + kRunTokens, sp[r + 1])});
  }
  // a run's item covers all its KV heads (each block read once, in order), split by KV head only when
  // there are too few runs for the threads
  const int64_t threads = at::get_num_threads();
  const int64_t splits = threads > 1 && static_cast<int64_t>(runs.size()) < 2 * threads ? s.hkv : 1;
  const int64_t scratch = run_scratch(s, kRunTokens, s.hkv / splits);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    auto tokens = [&](int64_t begin, int64_t end) {
      std::vector<float> buf(scratch);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t part = i % splits, per = s.hkv / splits;
        const auto [r, t0, t1] = runs[i / splits];
        attend_run<scalar_t>(s, qp, kp, vp, tp, sp, pp, sink, op, r, t0, t1, part * per, (part + 1) * per,
                             buf);
      }
    };
    auto rows = [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const auto [r, t] = tiles[i / s.hkv];
        const int64_t len = std::min<int64_t>(kRowTile, sp[r + 1] - t);
        attend_rows<scalar_t>(s, q, k_cache, v_cache, tp + r * s.max_blocks, t, len, pp[r] + (t - sp[r]),
                              i % s.hkv, sink, out);
      }
    };
    const int64_t n_items = static_cast<int64_t>(runs.size()) * splits;
    const int64_t n_rows = static_cast<int64_t>(tiles.size()) * s.hkv;
    if (threads == 1) {  // no parallel region: an idle OpenMP team spins on a busy machine
      tokens(0, n_items);
      rows(0, n_rows);
      return;
    }
    at::parallel_for(0, n_items, 1, tokens);
    at::parallel_for(0, n_rows, 1, rows);
  });
}
