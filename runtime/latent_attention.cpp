// deepinfer::latent_attention's CPU kernel: a few query rows' attention over their sequences'
// cached rows in one pass, each row read once where it lies in the cache: its scores against the
// queries, the softmax kept running (a max and a sum a query), and the probability-weighted sum of
// its first `values` columns (MLA's latents), as flash-decoding does. A sequence's visible rows are
// split between the threads, whose partial sums are merged at the end. runtime/latent_attention.py
// documents the op and holds the torch reference this must match; runtime/int_matmul.py builds it
// with the int kernels into one library (-march=native), which AOTInductor's code calls as a C function.

#include "kernel_abi.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace deepinfer;
using torch::stable::Tensor;

constexpr float MINUS_INFINITY = -std::numeric_limits<float>::infinity();

// Vec: N float32 lanes, loaded from float32 or bfloat16 (widened). A load of n < N lanes (AVX-512
// only: row widths are multiples of 8) reads no further than them.
#if defined(__AVX512F__)
struct Vec {
  static constexpr int N = 16;
  static constexpr int KEYS = 4;  // cache rows a pass of dot products takes (16 accumulators for 4 queries)
  __m512 v;
  static Vec all(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p, int n = N) { return {n == N ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p)}; }
  static Vec load(const uint16_t* p, int n = N) {
    const __m256i bits = n == N ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi16(__mmask16((1u << n) - 1), p);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};
  }
  void store(float* p, int n = N) const {
    if (n == N) _mm512_storeu_ps(p, v); else _mm512_mask_storeu_ps(p, __mmask16((1u << n) - 1), v);
  }
  float sum() const { return _mm512_reduce_add_ps(v); }
};
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec nearest(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline Vec times_two_to(Vec a, Vec n) { return {_mm512_scalef_ps(a.v, n.v)}; }  // a 2^n, n an integer
inline Vec where_at_least(Vec a, Vec x, Vec floor) { return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, floor.v, _CMP_GE_OQ), a.v)}; }
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  static constexpr int N = 8;
  static constexpr int KEYS = 2;  // (16 registers: 8 accumulators for 4 queries)
  __m256 v;
  static Vec all(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p, int = N) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const uint16_t* p, int = N) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16))};
  }
  void store(float* p, int = N) const { _mm256_storeu_ps(p, v); }
  float sum() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec nearest(Vec a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline Vec times_two_to(Vec a, Vec n) {  // (n >= -126: the exponent field stays normal)
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(a.v, _mm256_castsi256_ps(exponent))};
}
inline Vec where_at_least(Vec a, Vec x, Vec floor) { return {_mm256_and_ps(a.v, _mm256_cmp_ps(x.v, floor.v, _CMP_GE_OQ))}; }
#else
// (plain C++: 8 lanes in loops, which the compiler vectorizes)
struct Vec {
  static constexpr int N = 8;
  static constexpr int KEYS = 2;
  float v[N];
  static Vec all(float x) { Vec r; for (float& l : r.v) l = x; return r; }
  static Vec load(const float* p, int = N) { Vec r; for (int l = 0; l < N; ++l) r.v[l] = p[l]; return r; }
  static Vec load(const uint16_t* p, int = N) { Vec r; for (int l = 0; l < N; ++l) r.v[l] = bf16_to_float(p[l]); return r; }
  void store(float* p, int = N) const { for (int l = 0; l < N; ++l) p[l] = v[l]; }
  float sum() const { float s = 0.f; for (float l : v) s += l; return s; }
};
template <class F>
Vec lanes(F f) { Vec r; for (int l = 0; l < Vec::N; ++l) r.v[l] = f(l); return r; }
inline Vec fma(Vec a, Vec b, Vec c) { return lanes([&](int l) { return a.v[l] * b.v[l] + c.v[l]; }); }
inline Vec operator*(Vec a, Vec b) { return lanes([&](int l) { return a.v[l] * b.v[l]; }); }
inline Vec operator-(Vec a, Vec b) { return lanes([&](int l) { return a.v[l] - b.v[l]; }); }
inline Vec operator+(Vec a, Vec b) { return lanes([&](int l) { return a.v[l] + b.v[l]; }); }
inline Vec max(Vec a, Vec b) { return lanes([&](int l) { return std::max(a.v[l], b.v[l]); }); }
inline Vec nearest(Vec a) { return lanes([&](int l) { return std::nearbyint(a.v[l]); }); }
inline Vec times_two_to(Vec a, Vec n) { return lanes([&](int l) { return std::ldexp(a.v[l], int(n.v[l])); }); }
inline Vec where_at_least(Vec a, Vec x, Vec floor) { return lanes([&](int l) { return x.v[l] >= floor.v[l] ? a.v[l] : 0.f; }); }
#endif

// e^x for x <= 0 (a softmax's scores less their max), 0 below -87 (-inf: a row not seen): Cephes'
// expf, x = n ln 2 + r with |r| <= ln 2 / 2 and e^r a polynomial, within 2 ulp of std::exp.
Vec exp_nonpositive(Vec x) {
  const Vec floor = Vec::all(-87.f), clamped = max(x, floor);
  const Vec n = nearest(clamped * Vec::all(1.44269504088896341f));
  Vec r = fma(n, Vec::all(-0.693359375f), clamped);
  r = fma(n, Vec::all(2.12194440e-4f), r);
  Vec p = Vec::all(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) p = fma(p, r, Vec::all(c));
  const Vec e = fma(p * r, r, r + Vec::all(1.f));  // p r^2 + r + 1
  return where_at_least(times_two_to(e, n), x, floor);
}

constexpr int QUERIES = 4;          // query rows a pass over a block's cache rows serves
constexpr int64_t BLOCK_KEYS = 16;  // cache rows scored before their values are added (in L1 for both)
// Multiply-adds a thread takes at least (as int_matmul.cpp's): a decode step at a short context
// runs on the calling thread, not in a parallel region whose start costs more than its work.
constexpr int64_t THREAD_MIN_WORK = 1 << 16;

// A task: query rows [M, C] (scaled) of one sequence over its cache rows [first, last), into a
// partial result (`partial`, partial_width(M, V) floats): acc [M, V] (unnormalized), each query's
// running max [M] and sum of e^(score - max) [M], then room for a block's scores [M, BLOCK_KEYS].
template <class T>
struct Task {
  const float* q;
  const T* rows;  // the sequence's row 0 ([L, C], rows `row_stride` apart)
  int64_t row_stride;
  const uint8_t* visible;  // [T, L], rows `mask_stride` apart: query m's row (query0 + m) / heads
  int64_t mask_stride, query0, heads, first, last;
  float* partial;
};

// n floats rounded up to whole 64-byte lines: one thread's part of a buffer never shares a line with another's.
constexpr int64_t whole_lines(int64_t n) { return (n + 15) / 16 * 16; }

constexpr int64_t partial_width(int64_t M, int64_t V) { return whole_lines(M * (V + 2 + BLOCK_KEYS)); }

// scores[i * BLOCK_KEYS + k] = q_i . row k, for G queries and the K rows at `rows` (`R` apart).
template <int G, int K, class T>
void dots(const float* q, const T* rows, int64_t R, int64_t C, float* scores) {
  Vec acc[G][K];
  for (int i = 0; i < G; ++i)
    for (int k = 0; k < K; ++k) acc[i][k] = Vec::all(0.f);
  for (int64_t c = 0; c < C; c += Vec::N) {
    const int n = int(std::min<int64_t>(Vec::N, C - c));
    Vec x[K];
    for (int k = 0; k < K; ++k) x[k] = Vec::load(rows + k * R + c, n);
    for (int i = 0; i < G; ++i) {
      const Vec qi = Vec::load(q + i * C + c, n);
      for (int k = 0; k < K; ++k) acc[i][k] = fma(qi, x[k], acc[i][k]);
    }
  }
  for (int i = 0; i < G; ++i)
    for (int k = 0; k < K; ++k) scores[i * BLOCK_KEYS + k] = acc[i][k].sum();
}

// acc[i] (row width V) += sum_k p[i * BLOCK_KEYS + k] row k's first V columns, for G queries, n rows `R` apart.
template <int G, class T>
void weighted(const float* p, const T* rows, int64_t n, int64_t R, int64_t V, float* acc) {
  for (int64_t v = 0; v < V; v += 2 * Vec::N) {
    const int first = int(std::min<int64_t>(Vec::N, V - v)), second = int(std::clamp<int64_t>(V - v - Vec::N, 0, Vec::N));
    Vec a[G][2];
    for (int i = 0; i < G; ++i) {
      a[i][0] = Vec::load(acc + i * V + v, first);
      a[i][1] = second ? Vec::load(acc + i * V + v + Vec::N, second) : Vec::all(0.f);
    }
    for (int64_t k = 0; k < n; ++k) {
      const Vec x0 = Vec::load(rows + k * R + v, first), x1 = second ? Vec::load(rows + k * R + v + Vec::N, second) : Vec::all(0.f);
      for (int i = 0; i < G; ++i) {
        const Vec pi = Vec::all(p[i * BLOCK_KEYS + k]);
        a[i][0] = fma(pi, x0, a[i][0]);
        a[i][1] = fma(pi, x1, a[i][1]);
      }
    }
    for (int i = 0; i < G; ++i) {
      a[i][0].store(acc + i * V + v, first);
      if (second) a[i][1].store(acc + i * V + v + Vec::N, second);
    }
  }
}

template <int G, class T>
void block_scores(const float* q, const T* rows, int64_t n, int64_t R, int64_t C, float* scores) {
  int64_t k = 0;
  for (; k + Vec::KEYS <= n; k += Vec::KEYS) dots<G, Vec::KEYS>(q, rows + k * R, R, C, scores + k);
  for (; k < n; ++k) dots<G, 1>(q, rows + k * R, R, C, scores + k);
}

template <class F>
void by_group(int64_t M, F f) {  // f(first query, a group of up to QUERIES as a template constant)
  for (int64_t m = 0; m < M; m += QUERIES) {
    switch (std::min<int64_t>(QUERIES, M - m)) {
      case 4: f(m, std::integral_constant<int, 4>()); break;
      case 3: f(m, std::integral_constant<int, 3>()); break;
      case 2: f(m, std::integral_constant<int, 2>()); break;
      default: f(m, std::integral_constant<int, 1>()); break;
    }
  }
}

template <class T>
void attend(const Task<T>& task, int64_t M, int64_t C, int64_t V) {
  float *acc = task.partial, *tops = acc + M * V, *totals = tops + M, *scores = totals + M;  // (scores [M, BLOCK_KEYS])
  std::fill_n(acc, M * V, 0.f);
  std::fill_n(tops, M, MINUS_INFINITY);
  std::fill_n(totals, M, 0.f);
  for (int64_t start = task.first; start < task.last; start += BLOCK_KEYS) {
    const int64_t n = std::min(BLOCK_KEYS, task.last - start);
    const T* rows = task.rows + start * task.row_stride;
    by_group(M, [&](int64_t m, auto G) { block_scores<G()>(task.q + m * C, rows, n, task.row_stride, C, scores + m * BLOCK_KEYS); });
    for (int64_t m = 0; m < M; ++m) {
      float* s = scores + m * BLOCK_KEYS;
      const uint8_t* seen = task.visible + (task.query0 + m) / task.heads * task.mask_stride + start;
      float top = MINUS_INFINITY;
      for (int64_t k = 0; k < BLOCK_KEYS; ++k) {
        s[k] = k < n && seen[k] ? s[k] : MINUS_INFINITY;
        top = std::max(top, s[k]);
      }
      if (top == MINUS_INFINITY) {  // (a block this query sees none of)
        std::fill_n(s, BLOCK_KEYS, 0.f);
        continue;
      }
      const float running = std::max(tops[m], top), rescale = std::exp(tops[m] - running);
      float added = 0.f;
      for (int64_t k = 0; k < BLOCK_KEYS; k += Vec::N) {
        const Vec p = exp_nonpositive(Vec::load(s + k) - Vec::all(running));
        p.store(s + k);
        added += p.sum();
      }
      totals[m] = totals[m] * rescale + added;
      tops[m] = running;
      if (rescale != 1.f)
        for (int64_t v = 0; v < V; ++v) acc[m * V + v] *= rescale;
    }
    by_group(M, [&](int64_t m, auto G) { weighted<G()>(scores + m * BLOCK_KEYS, rows, n, task.row_stride, V, acc + m * V); });
  }
}

// out [B, M, V] in queries' dtype: query row (b, m) of queries [B, M, C] over sequence b's rows of
// cache [S, L, C] (slot slots[b]), seeing row l where visible[t, l] for t = (b M + m) / (B M / T),
// visible [T, L] bool. Any strides but a unit one for the cache's and the mask's last dimension:
// a context bucket's view of the cache pool is read where it lies, not copied (the op's
// needs_fixed_stride_order tag tells AOTInductor so).
AtenTensorHandle latent_attention(View queries, View cache, View slots, View visible, double scale, int64_t V) {
  const bool bf16 = queries.of(aoti_torch_dtype_bfloat16());
  STD_TORCH_CHECK(bf16 || queries.of(aoti_torch_dtype_float32()), "latent_attention: queries must be float32 or bfloat16");
  STD_TORCH_CHECK(queries.dim() == 3 && cache.dim() == 3 && visible.dim() == 2, "latent_attention: queries [B, M, C], cache [S, L, C], visible [T, L]");
  const int64_t B = queries.size(0), M = queries.size(1), C = queries.size(2), S = cache.size(0), L = cache.size(1), T = visible.size(0);
  STD_TORCH_CHECK(cache.of(bf16 ? aoti_torch_dtype_bfloat16() : aoti_torch_dtype_float32()) && cache.size(2) == C && cache.stride(2) == 1,
                  "latent_attention: cache must be [S, L, C] in the queries' dtype, each row's elements adjacent");
  STD_TORCH_CHECK(slots.of(aoti_torch_dtype_int64()) && slots.dim() == 1 && slots.size(0) == B, "latent_attention: slots must be int64 [B]");
  STD_TORCH_CHECK(visible.of(aoti_torch_dtype_bool()) && visible.size(1) == L && visible.stride(1) == 1 && T > 0 && (B * M) % T == 0,
                  "latent_attention: visible must be bool [T, L], each row's elements adjacent, T dividing B x M");
  STD_TORCH_CHECK(C % 8 == 0 && V % 8 == 0 && V <= C, "latent_attention: widths must be multiples of 8, values at most C");
  const int64_t heads = B * M / T;  // query rows a row of the mask serves
  const int64_t* slot = static_cast<const int64_t*>(slots.data());
  const int64_t slot_stride = slots.stride(0), slot_apart = cache.stride(0), row_stride = cache.stride(1), mask_stride = visible.stride(0);
  const uint8_t* mask = static_cast<const uint8_t*>(visible.data());

  // Tasks: each sequence's rows spanning those any of its queries sees, cut into as many runs of
  // whole blocks as the threads want (fewer where a thread's share would be under THREAD_MIN_WORK).
  struct Run { int64_t b, first, last; };
  std::vector<Run> runs;
  const int64_t threads = std::max<uint32_t>(1, torch::stable::get_num_threads());
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = slot[b * slot_stride];
    STD_TORCH_CHECK(s >= 0 && s < S, "latent_attention: slot ", s, " outside the cache's ", S);
    int64_t first = L, last = 0;
    for (int64_t t = b * M / heads; t <= (b * M + M - 1) / heads; ++t)
      for (int64_t l = 0; l < L; ++l)
        if (mask[t * mask_stride + l]) first = std::min(first, l), last = std::max(last, l + 1);
    const int64_t blocks = (std::max<int64_t>(0, last - first) + BLOCK_KEYS - 1) / BLOCK_KEYS;
    const int64_t parts = std::max<int64_t>(1, std::min({(threads + B - 1) / B, blocks, (last - first) * M * (C + V) / THREAD_MIN_WORK}));
    for (int64_t r = 0; r < parts; ++r)
      runs.push_back({b, std::min(last, first + blocks * r / parts * BLOCK_KEYS), std::min(last, first + blocks * (r + 1) / parts * BLOCK_KEYS)});
  }

  // One buffer, on a 64-byte line (no task's part shares a line with another's): the queries in
  // float32, scaled [B, M, C], then each task's partial result (uninitialized: its task sets it).
  const int64_t tasks = int64_t(runs.size()), width = partial_width(M, V), queries_width = whole_lines(B * M * C);
  const std::unique_ptr<float[]> work(new float[queries_width + tasks * width + 16]);
  float* q = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(work.get()) + 63) & ~uintptr_t(63));
  float* partials = q + queries_width;
  const int64_t qb = queries.stride(0), qm = queries.stride(1), qc = queries.stride(2);
  const void* given = queries.data();  // (a library call: not per element)
  for (int64_t b = 0, i = 0; b < B; ++b)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < C; ++c, ++i) {
        const int64_t at = b * qb + m * qm + c * qc;
        q[i] = float(scale) * (bf16 ? bf16_to_float(static_cast<const uint16_t*>(given)[at]) : static_cast<const float*>(given)[at]);
      }
  auto attend_all = [&](auto zero) {
    using T = decltype(zero);
    const uint8_t* base = static_cast<const uint8_t*>(cache.data());
    auto task = [&](int64_t t) {
      const Run& run = runs[t];
      return Task<T>{q + run.b * M * C, reinterpret_cast<const T*>(base + slot[run.b * slot_stride] * slot_apart * int64_t(sizeof(T))),
                     row_stride, mask, mask_stride, run.b * M, heads, run.first, run.last, partials + t * width};
    };
    if (tasks == 1)
      attend(task(0), M, C, V);
    else
      torch::stable::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) attend(task(t), M, C, V);
      });
  };
  if (bf16) attend_all(uint16_t()); else attend_all(float());

  // Merged: each query's partial sums rescaled to the largest of their maxima (no row seen: 0 / 0,
  // NaN, as torch's softmax over -inf).
  const AtenTensorHandle out = empty({B, M, V}, bf16 ? aoti_torch_dtype_bfloat16() : aoti_torch_dtype_float32());
  void* y = View{out}.data();
  for (int64_t t = 0; t < tasks;) {
    int64_t end = t + 1;
    while (end < tasks && runs[end].b == runs[t].b) ++end;
    for (int64_t m = 0; m < M; ++m) {  // (into the first task's acc)
      auto top = [&](int64_t u) { return partials[u * width + M * V + m]; };
      float largest = MINUS_INFINITY, sum = 0.f;
      for (int64_t u = t; u < end; ++u) largest = std::max(largest, top(u));
      float* merged = partials + t * width + m * V;
      for (int64_t u = t; u < end; ++u) {
        const float weight = top(u) == MINUS_INFINITY ? 0.f : std::exp(top(u) - largest);
        sum += weight * partials[u * width + M * V + M + m];
        for (int64_t v = 0; v < V; ++v) merged[v] = (u == t ? 0.f : merged[v]) + weight * partials[u * width + m * V + v];
      }
      const int64_t at = (runs[t].b * M + m) * V;
      for (int64_t v = 0; v < V; ++v) {
        if (bf16) static_cast<uint16_t*>(y)[at + v] = float_to_bf16(merged[v] / sum); else static_cast<float*>(y)[at + v] = merged[v] / sum;
      }
    }
    t = end;
  }
  return out;
}

Tensor latent_attention_op(Tensor queries, Tensor cache, Tensor slots, Tensor visible, double scale, int64_t values) {
  return Tensor(latent_attention(View{queries.get()}, View{cache.get()}, View{slots.get()}, View{visible.get()}, scale, values));
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(deepinfer, CPU, m) { m.impl("latent_attention", TORCH_BOX(&latent_attention_op)); }

// Its C shim: runtime/latent_attention.py's C_SHIMS holds the declaration the compiler hands AOTInductor.
extern "C" AOTITorchError aoti_torch_cpu_latent_attention(AtenTensorHandle queries, AtenTensorHandle cache, AtenTensorHandle slots,
                                                          AtenTensorHandle visible, double scale, int64_t values, AtenTensorHandle* ret0) {
  return shim("latent_attention", [&] { *ret0 = latent_attention(View{queries}, View{cache}, View{slots}, View{visible}, scale, values); });
}
