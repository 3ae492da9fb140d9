// deepinfer::int4_matmul's CPU kernel: activations quantized to int8 blocks times 4-bit weights by
// integer dot products (AVX-512 VNNI, else AVX2, else plain C++), as llama.cpp's q4_0 x q8_0.
// Built on the host that runs it (-march=native) by runtime/int4_matmul.py, which documents the
// layout and holds the reference this must match.
//
// Weights: bytes [rows, in/2]; byte 32c + i holds column 64c + i in its low nibble and column
// 64c + 32 + i in its high one (so a 32-byte load covers two activation blocks); q in 0..15 with
// w = (q - 8) * scale + zero, bfloat16 (scale, zero) [rows, in/group, 2].
// Activations: per block of 32 columns, int8 codes c and a float scale d (amax / 127); per weight
// group the float sum of x, which the zeros multiply:
//   sum_i w_i x_i = sum_blocks scale_g * d_b * (sum_i q_i c_i - 8 sum_i c_i) + sum_groups zero_g * xsum_g
// (q - 8 in integers, so that the activations' rounding errors meet weights centred on zero.)

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

constexpr int64_t BLOCK = 32;   // activation columns sharing one int8 scale
constexpr int64_t CHUNK = 64;   // weight columns in one 32-byte load
constexpr int64_t ROW_TILE = 16; // weight rows a task takes (its rows stay in L1 over a run of x rows)
constexpr int64_t PREFETCH_AHEAD = 2048;  // bytes of weights ahead of the one being read

float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct QuantizedRows {
  std::vector<int8_t> codes;  // [X, in]
  std::vector<float> scales;  // [X, in / BLOCK]
  std::vector<int32_t> code_sums;  // [X, in / BLOCK]: 8 x the sum of each block's codes
  std::vector<float> sums;    // [X, in / group]
};

void quantize_row(const float* x, int64_t in, int64_t group, int8_t* codes, float* scales, int32_t* code_sums, float* sums) {
  for (int64_t b = 0; b < in / BLOCK; ++b) {
    const float* block = x + b * BLOCK;
    float amax = 0.f;
    for (int64_t i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(block[i]));
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < BLOCK; ++i) {
      codes[b * BLOCK + i] = int8_t(std::nearbyint(block[i] * inverse));
      sum += codes[b * BLOCK + i];
    }
    scales[b] = amax / 127.f;
    code_sums[b] = 8 * sum;
  }
  for (int64_t g = 0; g < in / group; ++g) {
    float sum = 0.f;
    for (int64_t i = 0; i < group; ++i) sum += x[g * group + i];
    sums[g] = sum;
  }
}

float scale_of(uint32_t pair) { return bits_to_float(pair << 16); }          // (scale, zero) bfloat16 pair:
float zero_of(uint32_t pair) { return bits_to_float(pair & 0xFFFF0000u); }  // scale in the low half

// One weight row: bytes [in/2] and (scale, zero) pairs [in/group].
struct WeightRow {
  const uint8_t* w;
  const uint32_t* pairs;
};

// One quantized activation row: codes [in], block scales [in/32], 8 x block code sums, group sums [in/group].
struct Activation {
  const int8_t* c;
  const float* x_scale;
  const int32_t* code_sums;
  const float* x_sum;
};

// Blocks [b, b + 2) (one 32-byte load): sum of (q - 8) * c * w_scale * x_scale, plainly.
float chunk_dot(const WeightRow& row, const Activation& a, int64_t b, int group_shift) {
  int32_t low = 0, high = 0;
  for (int64_t i = 0; i < 32; ++i) {
    low += int32_t(row.w[b * 16 + i] & 0x0F) * a.c[b * 32 + i];
    high += int32_t(row.w[b * 16 + i] >> 4) * a.c[b * 32 + 32 + i];
  }
  return float(low - a.code_sums[b]) * scale_of(row.pairs[b >> group_shift]) * a.x_scale[b] +
         float(high - a.code_sums[b + 1]) * scale_of(row.pairs[(b + 1) >> group_shift]) * a.x_scale[b + 1];
}

#if defined(__AVX2__)
float horizontal_sum(__m256 v) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

__m256i nibble_dot(__m256i nibbles, const int8_t* c) {
  const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), nibbles, codes);
#else  // (pairs of u8 x s8 products fit int16: 15 * 128 * 2)
  return _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles, codes), _mm256_set1_epi16(1));
#endif
}

// One weight row times R activation rows (R <= 4: a run's rows share each load and nibble split).
// Eight blocks a step: each row's integer dots summed across lanes into one vector (lane b: block
// b's dot), converted once and scaled by the eight (weight scale x activation scale); the zeros
// eight groups a step.
template <int R>
void row_dots(const WeightRow& row, const Activation* a, int64_t in, int group_shift, float* result) {
  const int64_t blocks = in / BLOCK, groups = blocks >> group_shift;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i group_of_lane = _mm256_srli_epi32(lanes, group_shift);
  const __m256i pairs_needed = _mm256_cmpgt_epi32(_mm256_set1_epi32(8 >> group_shift), lanes);
  __m256 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8) {
    // (the weights stream from memory once: ask for the bytes a few rows ahead, which the hardware
    // prefetcher of one thread's stream fetches too late for the memory's bandwidth)
    _mm_prefetch(reinterpret_cast<const char*>(row.w + b * 16 + PREFETCH_AHEAD), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row.w + b * 16 + PREFETCH_AHEAD + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row.pairs + (b >> group_shift) + PREFETCH_AHEAD / 16), _MM_HINT_T0);
    __m256i pair_sums[R][4];  // hadd of the two blocks of each 32-byte load
    for (int i = 0; i < 4; ++i) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.w + (b + 2 * i) * 16));
      const __m256i low = _mm256_and_si256(bytes, low_nibbles);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);
      for (int t = 0; t < R; ++t)
        pair_sums[t][i] = _mm256_hadd_epi32(nibble_dot(low, a[t].c + (b + 2 * i) * 32), nibble_dot(high, a[t].c + (b + 2 * i) * 32 + 32));
    }
    const __m256i pairs = _mm256_permutevar8x32_epi32(  // (masked: the last groups of a row are its last bytes)
        _mm256_maskload_epi32(reinterpret_cast<const int*>(row.pairs + (b >> group_shift)), pairs_needed), group_of_lane);
    const __m256 w_scale = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
    for (int t = 0; t < R; ++t) {
      const __m256i abcd = _mm256_hadd_epi32(pair_sums[t][0], pair_sums[t][1]);
      const __m256i efgh = _mm256_hadd_epi32(pair_sums[t][2], pair_sums[t][3]);
      const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(abcd, efgh, 0x20), _mm256_permute2x128_si256(abcd, efgh, 0x31));
      const __m256i centred = _mm256_sub_epi32(sums, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t].code_sums + b)));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(w_scale, _mm256_loadu_ps(a[t].x_scale + b)), acc[t]);
    }
  }
  const int64_t tail = b;
  const __m256 high_halves = _mm256_castsi256_ps(_mm256_set1_epi32(int(0xFFFF0000u)));
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 zero = _mm256_and_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(row.pairs + g)), high_halves);
    for (int t = 0; t < R; ++t) acc[t] = _mm256_fmadd_ps(zero, _mm256_loadu_ps(a[t].x_sum + g), acc[t]);
  }
  for (int t = 0; t < R; ++t) {
    float total = horizontal_sum(acc[t]);
    for (b = tail; b < blocks; b += 2) total += chunk_dot(row, a[t], b, group_shift);
    for (int64_t h = g; h < groups; ++h) total += zero_of(row.pairs[h]) * a[t].x_sum[h];
    result[t] = total;
  }
}
#else
template <int R>
void row_dots(const WeightRow& row, const Activation* a, int64_t in, int group_shift, float* result) {
  for (int t = 0; t < R; ++t) {
    float total = 0.f;
    for (int64_t b = 0; b < in / BLOCK; b += 2) total += chunk_dot(row, a[t], b, group_shift);
    for (int64_t g = 0; g < (in / BLOCK) >> group_shift; ++g) total += zero_of(row.pairs[g]) * a[t].x_sum[g];
    result[t] = total;
  }
}
#endif

constexpr int MAX_RUN_ROWS = 4;  // activation rows row_dots takes at once
void (*const row_dots_of[MAX_RUN_ROWS + 1])(const WeightRow&, const Activation*, int64_t, int, float*) = {
    nullptr, row_dots<1>, row_dots<2>, row_dots<3>, row_dots<4>};

// out [X, k, rows] (k = 1 without ids): x row p times expert ids[p, j]'s weight (zeros for an id
// outside [0, E)). Tasks are (run, tile of ROW_TILE weight rows); a run is consecutive x rows with
// the same expert in one column j of ids (a prompt chunk's rows sorted by expert, or a linear's
// rows), so a tile's weights are read from memory once per run.
Tensor int4_matmul(Tensor x, Tensor codes, Tensor scale_zero, std::optional<Tensor> ids) {
  STD_TORCH_CHECK(x.scalar_type() == ScalarType::Float && x.is_contiguous() && x.dim() == 2,
                  "int4_matmul: x must be contiguous float32 [X, in]");
  STD_TORCH_CHECK(codes.scalar_type() == ScalarType::Byte && codes.is_contiguous(), "int4_matmul: codes must be contiguous uint8");
  STD_TORCH_CHECK(scale_zero.scalar_type() == ScalarType::BFloat16 && scale_zero.is_contiguous(),
                  "int4_matmul: scale_zero must be contiguous bfloat16");
  const bool experts = ids.has_value();
  STD_TORCH_CHECK(codes.dim() == (experts ? 3 : 2), "int4_matmul: codes must be [E, rows, in/2] with ids, [rows, in/2] without");
  const int64_t X = x.size(0), in = x.size(1);
  const int64_t E = experts ? codes.size(0) : 1, rows = codes.size(-2);
  const int64_t groups = scale_zero.size(-2), group = in / std::max<int64_t>(groups, 1);
  STD_TORCH_CHECK(in % CHUNK == 0 && codes.size(-1) * 2 == in && groups * group == in && group % BLOCK == 0,
                  "int4_matmul: inputs must be a multiple of 64 and of the group (a multiple of 32)");
  int group_shift = 0;  // log2(group / BLOCK): a block's group is b >> group_shift
  while ((BLOCK << group_shift) < group) ++group_shift;
  STD_TORCH_CHECK((BLOCK << group_shift) == group, "int4_matmul: the group must be 32 times a power of two");
  const int64_t k = experts ? ids->size(1) : 1;
  std::vector<int64_t> expert(X * k, 0);
  if (experts) {
    STD_TORCH_CHECK(ids->scalar_type() == ScalarType::Long && ids->is_contiguous() && ids->dim() == 2 && ids->size(0) == X,
                    "int4_matmul: ids must be contiguous int64 [X, k]");
    std::memcpy(expert.data(), ids->const_data_ptr(), sizeof(int64_t) * X * k);
  }

  Tensor out = torch::stable::new_empty(x, {X, k, rows});
  float* y = static_cast<float*>(out.mutable_data_ptr());
  const float* xs = static_cast<const float*>(x.const_data_ptr());
  const uint8_t* w = static_cast<const uint8_t*>(codes.const_data_ptr());
  const uint32_t* sz = static_cast<const uint32_t*>(scale_zero.const_data_ptr());

  QuantizedRows q{std::vector<int8_t>(X * in), std::vector<float>(X * in / BLOCK), std::vector<int32_t>(X * in / BLOCK),
                  std::vector<float>(X * groups)};
  torch::stable::parallel_for(0, X, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      quantize_row(xs + p * in, in, group, &q.codes[p * in], &q.scales[p * in / BLOCK], &q.code_sums[p * in / BLOCK], &q.sums[p * groups]);
  });

  struct Run { int64_t j, first, last, expert; };  // x rows [first, last) with expert `expert` in column j
  std::vector<Run> runs;
  for (int64_t j = 0; j < k; ++j)
    for (int64_t p = 0; p < X;) {
      int64_t end = p + 1;
      while (end < X && expert[end * k + j] == expert[p * k + j]) ++end;
      runs.push_back({j, p, end, expert[p * k + j]});
      p = end;
    }
  const int64_t tiles = (rows + ROW_TILE - 1) / ROW_TILE;
  torch::stable::parallel_for(0, int64_t(runs.size()) * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const Run& run = runs[task / tiles];
      const int64_t first_row = (task % tiles) * ROW_TILE, last_row = std::min(rows, first_row + ROW_TILE);
      const bool owned = run.expert >= 0 && run.expert < E;
      for (int64_t r = first_row; r < last_row; ++r) {
        const WeightRow row{w + (run.expert * rows + r) * in / 2, sz + (run.expert * rows + r) * groups};
        for (int64_t p = run.first; p < run.last; p += MAX_RUN_ROWS) {
          const int n = int(std::min<int64_t>(MAX_RUN_ROWS, run.last - p));
          Activation a[MAX_RUN_ROWS];
          float result[MAX_RUN_ROWS] = {};
          for (int t = 0; t < n; ++t)
            a[t] = {&q.codes[(p + t) * in], &q.scales[(p + t) * in / BLOCK], &q.code_sums[(p + t) * in / BLOCK], &q.sums[(p + t) * groups]};
          if (owned) row_dots_of[n](row, a, in, group_shift, result);
          for (int t = 0; t < n; ++t) y[((p + t) * k + run.j) * rows + r] = result[t];
        }
      }
    }
  });
  return out;
}

uint16_t float_to_bf16(float f) {  // (round to nearest even; the weights are finite)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// The weights in bfloat16 [..., rows, in], for a prompt chunk's GEMMs: plain loops over a 64-column
// chunk the compiler vectorizes, rows in parallel.
Tensor int4_values(Tensor codes, Tensor scale_zero) {
  STD_TORCH_CHECK(codes.scalar_type() == ScalarType::Byte && codes.is_contiguous(), "int4_values: codes must be contiguous uint8");
  STD_TORCH_CHECK(scale_zero.scalar_type() == ScalarType::BFloat16 && scale_zero.is_contiguous(),
                  "int4_values: scale_zero must be contiguous bfloat16");
  const int64_t in = codes.size(-1) * 2, groups = scale_zero.size(-2), rows = codes.numel() * 2 / in;
  STD_TORCH_CHECK(in % CHUNK == 0 && groups > 0 && in % groups == 0 && (in / groups) % BLOCK == 0,
                  "int4_values: inputs must be a multiple of 64 and of the group (a multiple of 32)");
  std::vector<int64_t> shape(codes.sizes().begin(), codes.sizes().end());
  shape.back() = in;
  Tensor out = torch::stable::new_empty(codes, shape, ScalarType::BFloat16);
  uint16_t* y = static_cast<uint16_t*>(out.mutable_data_ptr());
  const uint8_t* w = static_cast<const uint8_t*>(codes.const_data_ptr());
  const uint32_t* sz = static_cast<const uint32_t*>(scale_zero.const_data_ptr());
  const int64_t group = in / groups;
  torch::stable::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t c = 0; c < in / CHUNK; ++c) {
        const uint8_t* bytes = w + r * in / 2 + c * 32;
        uint16_t* out_row = y + r * in + c * CHUNK;
        const uint32_t low_pair = sz[r * groups + c * CHUNK / group], high_pair = sz[r * groups + (c * CHUNK + 32) / group];
        const float low_scale = scale_of(low_pair), low_offset = zero_of(low_pair) - 8.f * low_scale;
        const float high_scale = scale_of(high_pair), high_offset = zero_of(high_pair) - 8.f * high_scale;
        for (int64_t i = 0; i < 32; ++i) out_row[i] = float_to_bf16(float(bytes[i] & 0x0F) * low_scale + low_offset);
        for (int64_t i = 0; i < 32; ++i) out_row[32 + i] = float_to_bf16(float(bytes[i] >> 4) * high_scale + high_offset);
      }
  });
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("int4_matmul", TORCH_BOX(&int4_matmul));
  m.impl("int4_values", TORCH_BOX(&int4_values));
}
