// Paged attention over kvpool's [N, B, H, D] per-layer views, read in place by block table (CPU).
// The contract (shapes, units, formulas) is kvpool/engine/paged_attention.py's docstring; this file is the
// loop it names. One work item = one query token x one KV head: its G = Hq / Hkv query heads walk the
// request's blocks from the first key its window reaches to its own position, with an online softmax
// (Milakov & Gimelshein 2018; FlashAttention's running max and sum), so no key is copied and no mask is built.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline const float* as_float(const T* src, float* tmp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(src[i]);
  return tmp;
}

template <>
inline const float* as_float<float>(const float* src, float*, int64_t) { return src; }

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
#endif

// out[j] = q[j] . k for the G rows of q ([G, n], row stride n): each 8 floats of k loaded once for all G
inline void dots(const float* q, const float* k, int64_t groups, int64_t n, float* out) {
  int64_t i0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (groups <= 8) {
    __m256 acc[8];
    for (int64_t j = 0; j < groups; ++j) acc[j] = _mm256_setzero_ps();
    for (; i0 + 8 <= n; i0 += 8) {
      const __m256 kv = _mm256_loadu_ps(k + i0);
      for (int64_t j = 0; j < groups; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * n + i0), kv, acc[j]);
    }
    for (int64_t j = 0; j < groups; ++j) out[j] = hsum(acc[j]);
  } else {
    for (int64_t j = 0; j < groups; ++j) out[j] = 0.f;
  }
#else
  for (int64_t j = 0; j < groups; ++j) out[j] = 0.f;
#endif
  for (int64_t j = 0; j < groups; ++j)
    for (int64_t i = i0; i < n; ++i) out[j] += q[j * n + i] * k[i];
}

// acc[j] += w[j] * v for the G rows of acc ([G, n], row stride n)
inline void axpys(const float* w, const float* v, int64_t groups, int64_t n, float* acc) {
  int64_t i0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i0 + 8 <= n; i0 += 8) {
    const __m256 vv = _mm256_loadu_ps(v + i0);
    for (int64_t j = 0; j < groups; ++j) {
      float* a = acc + j * n + i0;
      _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(w[j]), vv, _mm256_loadu_ps(a)));
    }
  }
#endif
  for (int64_t j = 0; j < groups; ++j)
    for (int64_t i = i0; i < n; ++i) acc[j * n + i] += w[j] * v[i];
}

struct Shape {
  int64_t tokens, requests, max_blocks, hq, hkv, d, dv, block;
  int64_t q_t, q_h, k_n, k_b, k_h, v_n, v_b, v_h, o_t, o_h;  // strides, in elements
  int64_t window, chunk;  // sliding window W, chunk C (0: none)
  float scale, softcap;   // softcap 0: none
};

template <typename T>
void attend_item(const Shape& s, const T* q, const T* kc, const T* vc, const int32_t* tables,
                 const int32_t* starts, const int32_t* positions, const float* sinks, T* out, int64_t item,
                 std::vector<float>& buf) {
  const int64_t t = item / s.hkv, g = item % s.hkv, groups = s.hq / s.hkv;
  const int64_t r = std::upper_bound(starts, starts + s.requests + 1, static_cast<int32_t>(t)) - starts - 1;
  const int64_t p = positions[r] + (t - starts[r]);
  int64_t lo = 0;
  if (s.window > 0) lo = std::max<int64_t>(0, p - s.window + 1);
  else if (s.chunk > 0) lo = s.chunk * (p / s.chunk);
  float* qf = buf.data();                  // [G, D] scaled queries
  float* acc = qf + groups * s.d;          // [G, Dv]
  float* score = acc + groups * s.dv;      // [G, B]
  float* mx = score + groups * s.block;    // [G]
  float* sum = mx + groups;                // [G]
  float* tmp = sum + groups;               // [max(D, Dv)]
  for (int64_t j = 0; j < groups; ++j) {
    const T* row = q + t * s.q_t + (g * groups + j) * s.q_h;
    for (int64_t i = 0; i < s.d; ++i) qf[j * s.d + i] = static_cast<float>(row[i]);
    std::fill(acc + j * s.dv, acc + (j + 1) * s.dv, 0.f);
    mx[j] = -std::numeric_limits<float>::infinity();
    sum[j] = 0.f;
  }
  const int32_t* table = tables + r * s.max_blocks;
  for (int64_t blk = lo / s.block; blk <= p / s.block; ++blk) {
    const int64_t phys = table[blk];
    const int64_t o0 = blk == lo / s.block ? lo % s.block : 0;
    const int64_t o1 = blk == p / s.block ? p % s.block + 1 : s.block;
    const T* kb = kc + phys * s.k_n + g * s.k_h;
    const T* vb = vc + phys * s.v_n + g * s.v_h;
    for (int64_t o = o0; o < o1; ++o) {
      float x[8];
      float* xs = groups <= 8 ? x : tmp + std::max(s.d, s.dv);  // G scores of key o (scratch past tmp)
      dots(qf, as_float(kb + o * s.k_b, tmp, s.d), groups, s.d, xs);
      for (int64_t j = 0; j < groups; ++j) {
        float y = xs[j] * s.scale;
        if (s.softcap > 0.f) y = std::tanh(y / s.softcap) * s.softcap;
        score[j * s.block + o] = y;
      }
    }
    for (int64_t j = 0; j < groups; ++j) {  // the block's max, then rescale what came before
      float m = mx[j];
      for (int64_t o = o0; o < o1; ++o) m = std::max(m, score[j * s.block + o]);
      const float c = std::exp(mx[j] - m);
      float* a = acc + j * s.dv;
      for (int64_t i = 0; i < s.dv; ++i) a[i] *= c;
      mx[j] = m;
      float* row = score + j * s.block;
      float l = 0.f;
#pragma omp simd reduction(+ : l)
      for (int64_t o = o0; o < o1; ++o) {  // vectorized expf (glibc's libmvec; -fno-math-errno)
        const float e = std::exp(row[o] - m);
        row[o] = e;
        l += e;
      }
      sum[j] = sum[j] * c + l;
    }
    for (int64_t o = o0; o < o1; ++o) {
      float w[8];
      float* ws = groups <= 8 ? w : tmp + std::max(s.d, s.dv);
      for (int64_t j = 0; j < groups; ++j) ws[j] = score[j * s.block + o];
      axpys(ws, as_float(vb + o * s.v_b, tmp, s.dv), groups, s.dv, acc);
    }
  }
  for (int64_t j = 0; j < groups; ++j) {
    const int64_t h = g * groups + j;
    float m = mx[j], denom = sum[j], c = 1.f;
    if (sinks != nullptr) {  // gpt-oss: the sink joins the softmax's denominator only
      const float top = std::max(m, sinks[h]);
      c = std::exp(m - top);
      denom = sum[j] * c + std::exp(sinks[h] - top);
    }
    T* row = out + t * s.o_t + h * s.o_h;
    const float* a = acc + j * s.dv;
    for (int64_t i = 0; i < s.dv; ++i) row[i] = static_cast<T>(a[i] * c / denom);
  }
}


constexpr int64_t kTileKeys = 128;  // keys per GEMM tile (whole blocks), as SDPA's CPU kernel tiles

// A run of L >= kMinRows queries of one request, for KV head g and its G query heads as L * G rows (row
// i * G + j: query i, head g * G + j; query i at position p0 + i). Per tile of kTileKeys keys (whole blocks,
// staged in order out of the pool: a tile per KV head, not a copy per query): S = Q K^T (one GEMM),
// soft-capping, -inf outside each row's keys (only the rows at the tile's causal or window edge), then the online softmax update and acc += P V (a second GEMM), as ATen ops
// (vectorized exp and GEMMs).
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
    at::Tensor kb, vb;  // [width, D]: one block's view of the pool, or a tile of blocks staged in order
    if (nb == 1 && kc.scalar_type() == at::kFloat) {
      kb = kc.select(0, table[blk]).select(1, g).narrow(0, 0, width);
      vb = vc.select(0, table[blk]).select(1, g).narrow(0, 0, width);
    } else {
      kb = kt.narrow(0, 0, width);
      vb = vt.narrow(0, 0, width);
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t rows = std::min(s.block, width - j * s.block);
        kb.narrow(0, j * s.block, rows).copy_(kc.select(0, table[blk + j]).select(1, g).narrow(0, 0, rows));
        vb.narrow(0, j * s.block, rows).copy_(vc.select(0, table[blk + j]).select(1, g).narrow(0, 0, rows));
      }
    }
    at::Tensor sc = at::mm(qf.narrow(0, r0 * groups, n), kb.t());  // [n, width]
    if (s.softcap > 0.f) sc.div_(s.softcap).tanh_().mul_(s.softcap);
    float* S = sc.data_ptr<float>();
    for (int64_t i = r0; i < r1; ++i) {  // only rows whose keys end or start inside the block
      const int64_t p = p0 + i, lo = lo_of(p);
      if (p >= k1 && lo <= k0) continue;
      for (int64_t j = 0; j < groups; ++j) {
        float* row = S + ((i - r0) * groups + j) * width;
        for (int64_t o = 0; o < width; ++o)
          if (k0 + o < lo || k0 + o > p) row[o] = -inf;
      }
    }
    at::Tensor m_old = mx.narrow(0, r0 * groups, n);
    at::Tensor m_new = at::maximum(m_old, sc.amax({1}, true));  // finite: each row has a key here
    at::Tensor c = (m_old - m_new).exp_();
    sc.sub_(m_new).exp_();
    at::Tensor l = sum.narrow(0, r0 * groups, n);
    l.mul_(c).add_(sc.sum(1, true));
    m_old.copy_(m_new);
    at::Tensor a = acc.narrow(0, r0 * groups, n);
    a.mul_(c).addmm_(sc, vb);
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

constexpr int64_t kMinRows = 4;   // shorter runs of queries (decode, short chunks) take the per-token loop
constexpr int64_t kRowTile = 512;  // queries per tile of a longer run (64 measured slower here: more ATen calls)

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
  const int64_t groups = s.hq / s.hkv;
  const int64_t scratch = groups * (s.d + s.dv + s.block + 3) + std::max(s.d, s.dv);
  const float* sink = sinks.numel() ? sinks.data_ptr<float>() : nullptr;
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* sp = starts.data_ptr<int32_t>();
  const int32_t* pp = positions.data_ptr<int32_t>();
  // per-token work items (token * Hkv + g), and tiles of kRowTile queries of the longer runs (request,
  // first query of the tile; x Hkv)
  std::vector<int64_t> items;
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t r = 0; r < s.requests; ++r) {
    if (sp[r + 1] - sp[r] >= kMinRows) {
      for (int64_t t = sp[r]; t < sp[r + 1]; t += kRowTile) tiles.emplace_back(r, t);
      continue;
    }
    for (int64_t t = sp[r]; t < sp[r + 1]; ++t)
      for (int64_t g = 0; g < s.hkv; ++g) items.push_back(t * s.hkv + g);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    auto tokens = [&](int64_t begin, int64_t end) {
      std::vector<float> buf(scratch);
      for (int64_t i = begin; i < end; ++i)
        attend_item<scalar_t>(s, qp, kp, vp, tp, sp, pp, sink, op, items[i], buf);
    };
    auto rows = [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const auto [r, t] = tiles[i / s.hkv];
        const int64_t len = std::min<int64_t>(kRowTile, sp[r + 1] - t);
        attend_rows<scalar_t>(s, q, k_cache, v_cache, tp + r * s.max_blocks, t, len, pp[r] + (t - sp[r]),
                              i % s.hkv, sink, out);
      }
    };
    const int64_t n_items = static_cast<int64_t>(items.size());
    const int64_t n_rows = static_cast<int64_t>(tiles.size()) * s.hkv;
    if (at::get_num_threads() == 1) {  // no parallel region: an idle OpenMP team spins on a busy machine
      tokens(0, n_items);
      rows(0, n_rows);
      return;
    }
    at::parallel_for(0, n_items, 1, tokens);
    at::parallel_for(0, n_rows, 1, rows);
  });
}
