// deepinfer::int4_matmul and int8_matmul's CPU kernels: activations quantized to int8 blocks times
// 4- or 8-bit weights by integer dot products (AVX-512 VNNI, else AVX2, else plain C++), as
// llama.cpp's q4_0 x q8_0 and q8_0 x q8_0; and float_matmul's, float weights as stored times a few
// rows, on the same driver (runs of rows sharing an expert, tiles of 8 weight rows). Built on the
// host that runs them (-march=native) by runtime/int_matmul.py, which documents the layouts and
// holds the references these must match.
//
// Weights, rows of 8 interleaved, so that a dot product of 4 bytes lands one row a lane (no sums
// across lanes):
// - int4 (int_matmul.py's INT4_LAYOUT): bytes [rows/8][in/8][32], byte 4r + i of 8-column unit j
//   holding row r's column 8j + i in its low nibble and 8j + 4 + i in its high one; q in 0..15
//   with w = (q - 8) * scale + zero, bfloat16 (scale, zero) pairs [rows/8][in/group][8].
// - int8 (INT8_LAYOUT): codes [rows/8][in/4][32], byte 4r + i of 4-column unit j holding row r's
//   column 4j + i; w = code * scale, a bfloat16 scale a row [rows].
// Activations: per block of 32 columns, int8 codes c and a float scale d (amax / 127); for int4,
// per weight group the float sum of x, which the zeros multiply:
//   int4: sum_i w_i x_i = sum_blocks scale_g * d_b * (sum_i q_i c_i - 8 sum_i c_i) + sum_groups zero_g * xsum_g
//   int8: sum_i w_i x_i = scale * sum_blocks d_b * sum_i code_i c_i
// (q - 8 in integers, so that the activations' rounding errors meet weights centred on zero. VNNI
// multiplies unsigned by signed bytes: int8 codes go in as code + 128, and 128 sum_i c_i comes off.)
//
// Each op is reached two ways: through the dispatcher (eager, the export backend, and torch's
// registration below), and as a C function AOTInductor's generated code calls directly
// (`aoti_torch_cpu_<op>`, at the end; compiler/backends/inductor.py's shims), without the proxy
// executor's boxing: a tiny model's chain of int4 [192, 192] products 2.5 -> 1.9 us a call.

#include "kernel_abi.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace deepinfer;
using torch::stable::Tensor;

constexpr int64_t BLOCK = 32;     // activation columns sharing one int8 scale
constexpr int64_t ROWS = 8;       // weight rows interleaved (one a lane of 8 int32)
constexpr int64_t UNIT = 8;       // int4 weight columns of one 32-byte load (4 low nibbles, 4 high, a row)
constexpr int64_t UNIT8 = 4;      // int8 weight columns of one 32-byte load (4 bytes a row)
constexpr int64_t ROW_BLOCKS = 2; // row blocks a task takes (its weights stay in L1 over a run of x rows)
// Multiply-adds a thread takes at least: less work runs on the calling thread, not in a parallel
// region whose start costs more than the work (a tiny model's [96, 192] times one row, the op
// from Python: 4.8 -> 3.6 us; 2x and 4x this minimum were slower from [512, 192] on).
constexpr int64_t THREAD_MIN_WORK = 1 << 16;

struct QuantizedRows {
  std::vector<int8_t> codes;  // [X, in]
  std::vector<float> scales;  // [X, in / BLOCK]
  std::vector<int32_t> code_sums;  // [X, in / BLOCK]: the sum of each block's codes
  std::vector<float> sums;    // [X, in / group]: int4's zeros multiply them (none for int8)
};

// (group 0: no group sums, int8's weights having no zeros)
#if defined(__AVX2__)
// A block's 32 values in four vectors: its absolute max, codes rounded to nearest even (the
// conversion's default, as nearbyint) and saturated into bytes, their sum, and the values' float
// sum for the groups. In plain C++ IEEE order kept the max and the sums scalar: 2.1x slower (a row
// of 512, g++ -O3 on an AMD EPYC), a third of a tiny model's 32-row int4 [96, 192] product.
void quantize_row(const float* x, int64_t in, int64_t group, int8_t* codes, float* scales, int32_t* code_sums, float* sums) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i byte_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // (the packs work within 128-bit lanes)
  for (int64_t g = 0; group > 0 && g < in / group; ++g) sums[g] = 0.f;
  for (int64_t b = 0; b < in / BLOCK; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(x + b * BLOCK + 8 * k);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
      total = _mm256_add_ps(total, v[k]);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float block_max = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    const __m256 inverse = _mm256_set1_ps(block_max > 0.f ? 127.f / block_max : 0.f);
    __m256i q[4], code_total = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inverse));
      code_total = _mm256_add_epi32(code_total, q[k]);
    }
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * BLOCK), _mm256_permutevar8x32_epi32(bytes, byte_order));
    __m128i c = _mm_add_epi32(_mm256_castsi256_si128(code_total), _mm256_extracti128_si256(code_total, 1));
    c = _mm_add_epi32(c, _mm_shuffle_epi32(c, 0x4E));
    scales[b] = block_max / 127.f;
    code_sums[b] = _mm_cvtsi128_si32(_mm_add_epi32(c, _mm_shuffle_epi32(c, 0xB1)));
    if (group > 0) {
      __m128 t = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
      t = _mm_add_ps(t, _mm_movehl_ps(t, t));
      sums[b * BLOCK / group] += _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
    }
  }
}
#else
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
    code_sums[b] = sum;
  }
  for (int64_t g = 0; group > 0 && g < in / group; ++g) {
    float sum = 0.f;
    for (int64_t i = 0; i < group; ++i) sum += x[g * group + i];
    sums[g] = sum;
  }
}
#endif

float scale_of(uint32_t pair) { return bits_to_float(pair << 16); }          // (scale, zero) bfloat16 pair:
float zero_of(uint32_t pair) { return bits_to_float(pair & 0xFFFF0000u); }  // scale in the low half

// One activation row: for integer weights quantized (codes [in], block scales [in/32], block code
// sums, group sums [in/group]); for float weights as given (x) or rounded to bfloat16 (xb).
struct Activation {
  const int8_t* c;
  const float* x_scale;
  const int32_t* code_sums;
  const float* x_sum;
  const float* x;
  const uint16_t* xb;
};

#if defined(__AVX2__)
// acc + each lane's 4 nibbles times the same 4 activation codes.
__m256i dot4(__m256i acc, __m256i nibbles, const int8_t* c) {
  int32_t four;
  std::memcpy(&four, c, 4);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, nibbles, _mm256_set1_epi32(four));
#else  // (pairs of u8 x s8 products fit int16: 15 * 128 * 2)
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles, _mm256_set1_epi32(four)), _mm256_set1_epi16(1)));
#endif
}

// One int4 row block (8 weight rows: bytes w [in/8][32], (scale, zero) pairs [groups][8]) times R
// activation rows (R <= 4: a run's rows share each load and nibble split) -> out[t][0..8).
template <int R>
void block_dots(const uint8_t* w, const uint8_t* scales, const Activation* a, int64_t in, int64_t group, float* const* out) {
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(scales);
  // Independent dot-product chains per activation row: a block's 8 products in one chain wait on
  // each other's latency; fewer rows leave the integer units idle without more chains.
  constexpr int CHAINS = R == 1 ? 4 : R == 2 ? 2 : 1;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256 high_halves = _mm256_castsi256_ps(_mm256_set1_epi32(int(0xFFFF0000u)));
  __m256 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < in / group; ++g) {
    const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + g * ROWS));
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
    const __m256 zero = _mm256_and_ps(_mm256_castsi256_ps(pair), high_halves);
    for (int64_t b = g * group / BLOCK; b < (g + 1) * group / BLOCK; ++b) {
      __m256i low_dots[R][CHAINS], high_dots[R][CHAINS];
      for (int t = 0; t < R; ++t)
        for (int c = 0; c < CHAINS; ++c) low_dots[t][c] = high_dots[t][c] = _mm256_setzero_si256();
      for (int64_t u = 0; u < BLOCK / UNIT; ++u) {
        const int64_t j = b * BLOCK / UNIT + u;
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * 32));
        const __m256i low = _mm256_and_si256(bytes, low_nibbles);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);
        for (int t = 0; t < R; ++t) {
          low_dots[t][u % CHAINS] = dot4(low_dots[t][u % CHAINS], low, a[t].c + j * UNIT);
          high_dots[t][u % CHAINS] = dot4(high_dots[t][u % CHAINS], high, a[t].c + j * UNIT + 4);
        }
      }
      for (int t = 0; t < R; ++t) {
        __m256i dots = _mm256_add_epi32(low_dots[t][0], high_dots[t][0]);
        for (int c = 1; c < CHAINS; ++c) dots = _mm256_add_epi32(dots, _mm256_add_epi32(low_dots[t][c], high_dots[t][c]));
        const __m256i centred = _mm256_sub_epi32(dots, _mm256_set1_epi32(8 * a[t].code_sums[b]));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(scale, _mm256_set1_ps(a[t].x_scale[b])), acc[t]);
      }
    }
    for (int t = 0; t < R; ++t) acc[t] = _mm256_fmadd_ps(zero, _mm256_set1_ps(a[t].x_sum[g]), acc[t]);
  }
  for (int t = 0; t < R; ++t) _mm256_storeu_ps(out[t], acc[t]);
}
#else
template <int R>
void block_dots(const uint8_t* w, const uint8_t* scales, const Activation* a, int64_t in, int64_t group, float* const* out) {
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(scales);
  for (int t = 0; t < R; ++t)
    for (int64_t r = 0; r < ROWS; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < in / group; ++g) {
        const uint32_t pair = pairs[g * ROWS + r];
        for (int64_t b = g * group / BLOCK; b < (g + 1) * group / BLOCK; ++b) {
          int32_t dot = -8 * a[t].code_sums[b];
          for (int64_t j = b * BLOCK / UNIT; j < (b + 1) * BLOCK / UNIT; ++j)
            for (int64_t i = 0; i < 4; ++i) {
              const uint8_t byte = w[j * 32 + 4 * r + i];
              dot += int32_t(byte & 0x0F) * a[t].c[j * UNIT + i] + int32_t(byte >> 4) * a[t].c[j * UNIT + 4 + i];
            }
          total += float(dot) * scale_of(pair) * a[t].x_scale[b];
        }
        total += zero_of(pair) * a[t].x_sum[g];
      }
      out[t][r] = total;
    }
}
#endif

#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int32_t INT8_OFFSET = 128;  // (VNNI's unsigned operand: code + 128; 128 x the block's code sum comes off)
__m256i int8_operand(__m256i codes) { return _mm256_xor_si256(codes, _mm256_set1_epi8(char(0x80))); }
__m256i dot4_int8(__m256i acc, __m256i operand, __m256i, const int8_t* c) {
  int32_t four;
  std::memcpy(&four, c, 4);
  return _mm256_dpbusd_epi32(acc, operand, _mm256_set1_epi32(four));
}
#else  // (|code| times the activation signed as the code: pairs fit int16, 127 * 127 * 2)
constexpr int32_t INT8_OFFSET = 0;
__m256i int8_operand(__m256i codes) { return _mm256_sign_epi8(codes, codes); }
__m256i dot4_int8(__m256i acc, __m256i operand, __m256i codes, const int8_t* c) {
  int32_t four;
  std::memcpy(&four, c, 4);
  const __m256i products = _mm256_maddubs_epi16(operand, _mm256_sign_epi8(_mm256_set1_epi32(four), codes));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(products, _mm256_set1_epi16(1)));
}
#endif

// One int8 row block (8 weight rows: codes w [in/4][32], scales [8] bfloat16) times R activation
// rows -> out[t][0..8).
template <int R>
void block_dots8(const uint8_t* w, const uint8_t* scales, const Activation* a, int64_t in, int64_t, float* const* out) {
  constexpr int CHAINS = R == 1 ? 4 : R == 2 ? 2 : 1;  // (as block_dots)
  __m256 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < in / BLOCK; ++b) {
    __m256i dots[R][CHAINS];
    for (int t = 0; t < R; ++t)
      for (int c = 0; c < CHAINS; ++c) dots[t][c] = _mm256_setzero_si256();
    for (int64_t u = 0; u < BLOCK / UNIT8; ++u) {
      const int64_t j = b * BLOCK / UNIT8 + u;
      const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * 32));
      const __m256i operand = int8_operand(codes);
      for (int t = 0; t < R; ++t) dots[t][u % CHAINS] = dot4_int8(dots[t][u % CHAINS], operand, codes, a[t].c + j * UNIT8);
    }
    for (int t = 0; t < R; ++t) {
      __m256i sum = dots[t][0];
      for (int c = 1; c < CHAINS; ++c) sum = _mm256_add_epi32(sum, dots[t][c]);
      sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(INT8_OFFSET * a[t].code_sums[b]));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(a[t].x_scale[b]), acc[t]);
    }
  }
  const __m128i scale_bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales));
  const __m256 row_scales = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(scale_bits), 16));
  for (int t = 0; t < R; ++t) _mm256_storeu_ps(out[t], _mm256_mul_ps(acc[t], row_scales));
}
#else
template <int R>
void block_dots8(const uint8_t* w, const uint8_t* scales, const Activation* a, int64_t in, int64_t, float* const* out) {
  const uint16_t* row_scales = reinterpret_cast<const uint16_t*>(scales);
  for (int t = 0; t < R; ++t)
    for (int64_t r = 0; r < ROWS; ++r) {
      float total = 0.f;
      for (int64_t b = 0; b < in / BLOCK; ++b) {
        int32_t dot = 0;
        for (int64_t j = b * BLOCK / UNIT8; j < (b + 1) * BLOCK / UNIT8; ++j)
          for (int64_t i = 0; i < 4; ++i) dot += int32_t(int8_t(w[j * 32 + 4 * r + i])) * a[t].c[j * UNIT8 + i];
        total += float(dot) * a[t].x_scale[b];
      }
      out[t][r] = total * bf16_to_float(row_scales[r]);
    }
}
#endif

// Float weights (float32 or bfloat16 [rows, in] as stored) times a few activation rows: WR weight
// rows x R activation rows of dot products at a time, each weight row's stream prefetching the row
// PREFETCH_PASSES passes further on into L2. One or two activation rows take one weight row at a
// time (one stream: bf16, 16 experts [1280, 1024], 1 row 1.2 ms against 1.6 for 4 rows at a time);
// 3-4 rows take 4, whose loads each serve more products; 5-8 rows take 2 (16 accumulators, as 4x4).
// Into L2 rather than L1, and 4 passes ahead: L1 holds too few misses in flight to stream while
// the dot products keep the core busy (a [20480, 1024] weight, 8 rows, bf16 2.14 -> 1.2 ms, float32
// 4.0 -> 3.3-3.7; 4 rows bf16 1.8 -> 1.0, float32 3.0 -> 2.1-2.4; 2 and 8 passes ahead alike).
// bfloat16 weights take the activations rounded to bfloat16, as a bf16 GEMM does (AVX512_BF16's
// dot product of pairs; elsewhere both widened).
// AVX2 (16 registers of 8 lanes): at most 8 accumulators, 4 weight rows for one or two activation
// rows (independent sums), fewer as the rows grow.
template <int R>
constexpr int64_t weight_rows_a_pass() {
#if defined(__AVX512F__)
  return R <= 2 ? 1 : R <= 4 ? 4 : 2;
#else
  return R <= 2 ? 4 : R <= 4 ? 2 : 1;
#endif
}
constexpr int64_t PREFETCH_PASSES = 4;

#if defined(__AVX512F__)
template <int R, int WR, bool BF16>
void float_pass(const uint8_t* w, const Activation* a, int64_t in, float* const* out) {
  __m512 acc[R][WR];
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < WR; ++r) acc[t][r] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if constexpr (BF16) {
    const uint16_t* wb = reinterpret_cast<const uint16_t*>(w);
    for (int64_t k = 0; k < in; k += 32) {
      __m512bh wv[WR], xv[R];
      for (int r = 0; r < WR; ++r) {
        wv[r] = (__m512bh)_mm512_loadu_si512(wb + r * in + k);
        _mm_prefetch(reinterpret_cast<const char*>(wb + (r + PREFETCH_PASSES * WR) * in + k), _MM_HINT_T1);
      }
      for (int t = 0; t < R; ++t) {
        xv[t] = (__m512bh)_mm512_loadu_si512(a[t].xb + k);
        asm volatile("" : "+v"(xv[t]));  // (in a register: not reloaded by every dot product)
      }
      for (int t = 0; t < R; ++t)
        for (int r = 0; r < WR; ++r) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], wv[r], xv[t]);
    }
  } else
#endif
  {
    auto widen = [](const uint16_t* p) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    };
    for (int64_t k = 0; k < in; k += 16) {
      __m512 wv[WR], xv[R];
      for (int r = 0; r < WR; ++r) {
        const uint8_t* row = w + (r * in + k) * (BF16 ? 2 : 4);
        wv[r] = BF16 ? widen(reinterpret_cast<const uint16_t*>(row)) : _mm512_loadu_ps(reinterpret_cast<const float*>(row));
        _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_PASSES * WR * in * (BF16 ? 2 : 4)), _MM_HINT_T1);
      }
      for (int t = 0; t < R; ++t) {
        xv[t] = BF16 ? widen(a[t].xb + k) : _mm512_loadu_ps(a[t].x + k);
        asm volatile("" : "+v"(xv[t]));
      }
      for (int t = 0; t < R; ++t)
        for (int r = 0; r < WR; ++r) acc[t][r] = _mm512_fmadd_ps(wv[r], xv[t], acc[t][r]);
    }
  }
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < WR; ++r) out[t][r] = _mm512_reduce_add_ps(acc[t][r]);
}
#elif defined(__AVX2__) && defined(__FMA__)
template <int R, int WR, bool BF16>
void float_pass(const uint8_t* w, const Activation* a, int64_t in, float* const* out) {
  auto load = [](const uint8_t* p) {  // 8 float32, or 8 bfloat16 widened
    if constexpr (BF16)
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
    else
      return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  };
  constexpr int64_t BYTES = BF16 ? 2 : 4;
  __m256 acc[R][WR];
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < WR; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in; k += 8) {
    __m256 wv[WR];
    for (int r = 0; r < WR; ++r) {
      const uint8_t* row = w + (r * in + k) * BYTES;
      wv[r] = load(row);
      _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_PASSES * WR * in * BYTES), _MM_HINT_T1);
    }
    for (int t = 0; t < R; ++t) {
      const __m256 xv = load(BF16 ? reinterpret_cast<const uint8_t*>(a[t].xb + k) : reinterpret_cast<const uint8_t*>(a[t].x + k));
      for (int r = 0; r < WR; ++r) acc[t][r] = _mm256_fmadd_ps(wv[r], xv, acc[t][r]);
    }
  }
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < WR; ++r) {
      __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc[t][r]), _mm256_extractf128_ps(acc[t][r], 1));
      sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
      out[t][r] = _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
    }
}
#else
// (plain C++: LANES independent sums a dot product, which the compiler vectorizes)
template <int R, int WR, bool BF16>
void float_pass(const uint8_t* w, const Activation* a, int64_t in, float* const* out) {
  constexpr int LANES = 8;
  float acc[R][WR][LANES] = {};
  for (int64_t k = 0; k < in; k += LANES)
    for (int r = 0; r < WR; ++r) {
      float wv[LANES];
      for (int l = 0; l < LANES; ++l)
        wv[l] = BF16 ? bf16_to_float(reinterpret_cast<const uint16_t*>(w)[r * in + k + l]) : reinterpret_cast<const float*>(w)[r * in + k + l];
      for (int t = 0; t < R; ++t)
        for (int l = 0; l < LANES; ++l) acc[t][r][l] += wv[l] * (BF16 ? bf16_to_float(a[t].xb[k + l]) : a[t].x[k + l]);
    }
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < WR; ++r) {
      float total = 0.f;
      for (int l = 0; l < LANES; ++l) total += acc[t][r][l];
      out[t][r] = total;
    }
}
#endif

// One row block (8 weight rows, `in` elements apart) times R activation rows -> out[t][0..8).
template <int R, bool BF16>
void float_dots(const uint8_t* w, const uint8_t*, const Activation* a, int64_t in, int64_t, float* const* out) {
  constexpr int64_t WR = weight_rows_a_pass<R>();
  for (int64_t first = 0; first < ROWS; first += WR) {
    float* rows_out[R];
    for (int t = 0; t < R; ++t) rows_out[t] = out[t] + first;
    float_pass<R, WR, BF16>(w + first * in * (BF16 ? 2 : 4), a, in, rows_out);
  }
}

constexpr int MAX_RUN_ROWS = 8;  // activation rows a block's dots take at once, at most (a format's run_rows)
// A format's dots for one row block times 1..run_rows activation rows (index: the rows).
using BlockDots = void (*)(const uint8_t* w, const uint8_t* scales, const Activation* a, int64_t in, int64_t group, float* const* out);
constexpr BlockDots INT4_DOTS[] = {nullptr, block_dots<1>, block_dots<2>, block_dots<3>, block_dots<4>};
constexpr BlockDots INT8_DOTS[] = {nullptr, block_dots8<1>, block_dots8<2>, block_dots8<3>, block_dots8<4>};
// (float: up to 8 rows in one pass, so that every pass over a weight tile streams the next one in:
// 8 rows in two passes of 4 left the memory idle in the second)
template <bool BF16>
constexpr BlockDots FLOAT_DOTS[] = {nullptr, float_dots<1, BF16>, float_dots<2, BF16>, float_dots<3, BF16>, float_dots<4, BF16>,
                                    float_dots<5, BF16>, float_dots<6, BF16>, float_dots<7, BF16>, float_dots<8, BF16>};

// What a format's dots take of the activations.
enum class Operand { quantized, float32, bfloat16 };

// A stack of E weights [E, rows, ...] in one format: each weight row's code and scale bytes.
struct Weights {
  const uint8_t* codes;
  int64_t code_bytes;  // a row's
  const uint8_t* scales;
  int64_t scale_bytes;  // a row's
  const BlockDots* dots;
  int run_rows;  // the most activation rows its dots take at once
  Operand operand;
};

// out [X, k, rows] (k = 1 without ids): x row p times expert ids[p, j]'s weight (zeros for an id
// outside [0, E)). Tasks are (run, ROW_BLOCKS row blocks); a run is consecutive x rows with
// the same expert in one column j of ids (a prompt chunk's rows sorted by expert, or a linear's
// rows), so a tile's weights are read from memory once per run. `group`: int4's, 0 for int8.
AtenTensorHandle products(View x, const View* ids, int64_t E, int64_t rows, int64_t group, const Weights& weights, const char* op) {
  const int64_t X = x.size(0), in = x.size(1), groups = group > 0 ? in / group : 0;
  const int64_t k = ids ? ids->size(1) : 1;
  std::vector<int64_t> expert(X * k, 0);
  if (ids) {
    STD_TORCH_CHECK(ids->is(aoti_torch_dtype_int64()) && ids->dim() == 2 && ids->size(0) == X, op, ": ids must be contiguous int64 [X, k]");
    std::memcpy(expert.data(), ids->data(), sizeof(int64_t) * X * k);
  }

  const AtenTensorHandle out = empty({X, k, rows}, aoti_torch_dtype_float32());  // (nothing below checks)
  float* y = static_cast<float*>(View{out}.data());
  const float* xs = static_cast<const float*>(x.data());

  const bool quantized = weights.operand == Operand::quantized, rounded = weights.operand == Operand::bfloat16;
  const int64_t quantized_x = quantized ? X : 0;
  QuantizedRows q{std::vector<int8_t>(quantized_x * in), std::vector<float>(quantized_x * in / BLOCK),
                  std::vector<int32_t>(quantized_x * in / BLOCK), std::vector<float>(quantized_x * groups)};
  std::vector<uint16_t> xb(rounded ? X * in : 0);  // x rounded to bfloat16, for bfloat16 weights
  // (a row no expert here takes is not converted: a prompt chunk's rows that GEMMs or another rank compute)
  std::vector<bool> taken(X, true);
  if (ids)
    for (int64_t p = 0; p < X; ++p)
      taken[p] = std::any_of(&expert[p * k], &expert[p * k + k], [E](int64_t e) { return e >= 0 && e < E; });
  if (quantized || rounded)
    torch::stable::parallel_for(0, X, std::max<int64_t>(1, THREAD_MIN_WORK / in), [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        if (!taken[p])
          continue;
        else if (quantized)
          quantize_row(xs + p * in, in, group, &q.codes[p * in], &q.scales[p * in / BLOCK], &q.code_sums[p * in / BLOCK], q.sums.data() + p * groups);
        else
          for (int64_t i = 0; i < in; ++i) xb[p * in + i] = float_to_bf16(xs[p * in + i]);
    });

  struct Run { int64_t j, first, last, expert; };  // x rows [first, last) with expert `expert` in column j
  std::vector<Run> runs;
  for (int64_t j = 0; j < k; ++j)
    for (int64_t p = 0; p < X;) {
      int64_t end = p + 1;
      while (end < X && expert[end * k + j] == expert[p * k + j]) ++end;
      const int64_t e = expert[p * k + j];
      if (e >= 0 && e < E)
        runs.push_back({j, p, end, e});
      else  // (zeros: no expert here)
        for (int64_t q = p; q < end; ++q) std::fill_n(y + (q * k + j) * rows, rows, 0.f);
      p = end;
    }
  const int64_t row_blocks = rows / ROWS, tiles = (row_blocks + ROW_BLOCKS - 1) / ROW_BLOCKS;
  int64_t taken_rows = 0;
  for (const Run& run : runs) taken_rows += run.last - run.first;
  // (a run's rows on average; no runs: no rows)
  const int64_t task_work = std::max<int64_t>(1, taken_rows / std::max<int64_t>(1, int64_t(runs.size())) * ROW_BLOCKS * ROWS * in);
  torch::stable::parallel_for(0, int64_t(runs.size()) * tiles, std::max<int64_t>(1, THREAD_MIN_WORK / task_work), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const Run& run = runs[task / tiles];
      const int64_t first = (task % tiles) * ROW_BLOCKS, last = std::min(row_blocks, first + ROW_BLOCKS);
      for (int64_t block = first; block < last; ++block)
        for (int64_t p = run.first; p < run.last; p += weights.run_rows) {
          const int n = int(std::min<int64_t>(weights.run_rows, run.last - p));
          Activation a[MAX_RUN_ROWS];
          float* out_rows[MAX_RUN_ROWS];
          for (int t = 0; t < n; ++t) {
            if (quantized)
              a[t] = {&q.codes[(p + t) * in], &q.scales[(p + t) * in / BLOCK], &q.code_sums[(p + t) * in / BLOCK],
                      q.sums.data() + (p + t) * groups, nullptr, nullptr};
            else
              a[t] = {nullptr, nullptr, nullptr, nullptr, xs + (p + t) * in, rounded ? &xb[(p + t) * in] : nullptr};
            out_rows[t] = y + ((p + t) * k + run.j) * rows + block * ROWS;
          }
          const int64_t first_row = run.expert * rows + block * ROWS;
          weights.dots[n](weights.codes + first_row * weights.code_bytes, weights.scales + first_row * weights.scale_bytes, a, in,
                          group, out_rows);
        }
    }
  });
  return out;
}

void check_x(View x, const char* op) {
  STD_TORCH_CHECK(x.is(aoti_torch_dtype_float32()) && x.dim() == 2, op, ": x must be contiguous float32 [X, in]");
}

AtenTensorHandle int4_matmul(View x, View codes, View scale_zero, const View* ids) {
  check_x(x, "int4_matmul");
  STD_TORCH_CHECK(codes.is(aoti_torch_dtype_uint8()), "int4_matmul: codes must be contiguous uint8");
  STD_TORCH_CHECK(scale_zero.is(aoti_torch_dtype_bfloat16()), "int4_matmul: scale_zero must be contiguous bfloat16");
  STD_TORCH_CHECK(codes.dim() == (ids ? 3 : 2), "int4_matmul: codes must be [E, rows, in/2] with ids, [rows, in/2] without");
  const int64_t in = x.size(1), E = ids ? codes.size(0) : 1, rows = codes.size(-2);
  const int64_t groups = scale_zero.size(-2), group = in / std::max<int64_t>(groups, 1);
  STD_TORCH_CHECK(codes.size(-1) * 2 == in && groups * group == in && group % BLOCK == 0 && rows % ROWS == 0,
                  "int4_matmul: inputs must be a multiple of the group (a multiple of 32), rows of 8");
  const Weights weights{static_cast<const uint8_t*>(codes.data()), in / 2, static_cast<const uint8_t*>(scale_zero.data()), groups * 4,
                        INT4_DOTS, 4, Operand::quantized};
  return products(x, ids, E, rows, group, weights, "int4_matmul");
}

AtenTensorHandle int8_matmul(View x, View codes, View scales, const View* ids) {
  check_x(x, "int8_matmul");
  STD_TORCH_CHECK(codes.is(aoti_torch_dtype_int8()), "int8_matmul: codes must be contiguous int8");
  STD_TORCH_CHECK(scales.is(aoti_torch_dtype_bfloat16()), "int8_matmul: scales must be contiguous bfloat16");
  STD_TORCH_CHECK(codes.dim() == (ids ? 3 : 2), "int8_matmul: codes must be [E, rows, in] with ids, [rows, in] without");
  const int64_t in = x.size(1), E = ids ? codes.size(0) : 1, rows = codes.size(-2);
  STD_TORCH_CHECK(codes.size(-1) == in && in % BLOCK == 0 && rows % ROWS == 0 && scales.numel() == E * rows,
                  "int8_matmul: inputs must be a multiple of 32, rows of 8, a scale a row");
  const Weights weights{static_cast<const uint8_t*>(codes.data()), in, static_cast<const uint8_t*>(scales.data()), 2, INT8_DOTS, 4,
                        Operand::quantized};
  return products(x, ids, E, rows, 0, weights, "int8_matmul");
}

AtenTensorHandle float_matmul(View x, View w, const View* ids) {
  check_x(x, "float_matmul");
  const bool bf16 = w.is(aoti_torch_dtype_bfloat16());
  STD_TORCH_CHECK(bf16 || w.is(aoti_torch_dtype_float32()), "float_matmul: w must be contiguous float32 or bfloat16");
  STD_TORCH_CHECK(w.dim() == (ids ? 3 : 2), "float_matmul: w must be [E, rows, in] with ids, [rows, in] without");
  const int64_t in = x.size(1), E = ids ? w.size(0) : 1, rows = w.size(-2);
  STD_TORCH_CHECK(w.size(-1) == in && in % BLOCK == 0 && rows % ROWS == 0, "float_matmul: inputs must be a multiple of 32, rows of 8");
  const int64_t row_bytes = in * (bf16 ? 2 : 4);
  const Weights weights{static_cast<const uint8_t*>(w.data()), row_bytes, nullptr, 0, bf16 ? FLOAT_DOTS<true> : FLOAT_DOTS<false>,
                        MAX_RUN_ROWS, bf16 ? Operand::bfloat16 : Operand::float32};
  return products(x, ids, E, rows, 0, weights, "float_matmul");
}

#if defined(__AVX2__)
__m128i to_bf16(__m256 v) {  // 8 floats -> 8 bfloat16, rounded to nearest even
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  return (__m128i)_mm256_cvtneps_pbh(v);
#else
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);  // (in 128-bit lanes)
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
#endif
}

// One row block's unit (8 rows x 8 columns, 32 bytes) -> out rows [8][8] at stride `in`, each row
// r's codes times scale[r] plus offset[r].
void decode_unit(const uint8_t* bytes, const float* scale, const float* offset, uint16_t* out, int64_t in) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i all = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  const __m256i low = _mm256_and_si256(all, low_nibbles), high = _mm256_and_si256(_mm256_srli_epi16(all, 4), low_nibbles);
  // each row's 4 low then 4 high codes, 8 bytes a row: rows 0 1 | 4 5, and 2 3 | 6 7
  const __m256i rows_0145 = _mm256_unpacklo_epi32(low, high), rows_2367 = _mm256_unpackhi_epi32(low, high);
  const __m128i quads[4] = {_mm256_castsi256_si128(rows_0145), _mm256_castsi256_si128(rows_2367),
                            _mm256_extracti128_si256(rows_0145, 1), _mm256_extracti128_si256(rows_2367, 1)};
  for (int half = 0; half < 4; ++half)  // rows (0 1), (2 3), (4 5), (6 7)
    for (int second = 0; second < 2; ++second) {
      const int r = 2 * half + second;
      const __m128i codes = second ? _mm_srli_si128(quads[half], 8) : quads[half];
      const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), _mm256_set1_ps(scale[r]), _mm256_set1_ps(offset[r]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * in), to_bf16(w));
    }
}
#else
void decode_unit(const uint8_t* bytes, const float* scale, const float* offset, uint16_t* out, int64_t in) {
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t i = 0; i < 4; ++i) {
      out[r * in + i] = float_to_bf16(float(bytes[4 * r + i] & 0x0F) * scale[r] + offset[r]);
      out[r * in + 4 + i] = float_to_bf16(float(bytes[4 * r + i] >> 4) * scale[r] + offset[r]);
    }
}
#endif

// The weights in bfloat16 [..., rows, in], for a prompt chunk's GEMMs, row blocks in parallel.
AtenTensorHandle int4_values(View codes, View scale_zero) {
  STD_TORCH_CHECK(codes.is(aoti_torch_dtype_uint8()), "int4_values: codes must be contiguous uint8");
  STD_TORCH_CHECK(scale_zero.is(aoti_torch_dtype_bfloat16()), "int4_values: scale_zero must be contiguous bfloat16");
  const int64_t in = codes.size(-1) * 2, groups = scale_zero.size(-2), rows = codes.numel() * 2 / in;
  STD_TORCH_CHECK(groups > 0 && in % groups == 0 && (in / groups) % BLOCK == 0 && rows % ROWS == 0,
                  "int4_values: inputs must be a multiple of the group (a multiple of 32), rows of 8");
  std::vector<int64_t> shape(codes.dim());
  for (int64_t d = 0; d < codes.dim(); ++d) shape[d] = codes.size(d);
  shape.back() = in;
  const AtenTensorHandle out = empty(shape, aoti_torch_dtype_bfloat16());
  uint16_t* y = static_cast<uint16_t*>(View{out}.data());
  const uint8_t* w = static_cast<const uint8_t*>(codes.data());
  const uint32_t* sz = static_cast<const uint32_t*>(scale_zero.data());
  const int64_t group = in / groups;
  torch::stable::parallel_for(0, rows / ROWS, 1, [&](int64_t begin, int64_t end) {
    float scale[ROWS], offset[ROWS];
    for (int64_t block = begin; block < end; ++block)
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t r = 0; r < ROWS; ++r) {
          const uint32_t pair = sz[(block * groups + g) * ROWS + r];
          scale[r] = scale_of(pair);
          offset[r] = zero_of(pair) - 8.f * scale[r];
        }
        for (int64_t j = g * group / UNIT; j < (g + 1) * group / UNIT; ++j)
          decode_unit(w + block * ROWS * in / 2 + j * 32, scale, offset, y + block * ROWS * in + j * UNIT, in);
      }
  });
  return out;
}

const View* optional_view(AtenTensorHandle handle, View& slot) {  // (a Tensor? argument: no handle for None)
  slot = View{handle};
  return handle ? &slot : nullptr;
}

// The ops as the dispatcher calls them (boxed): borrowed inputs, an owned result.
View view(const Tensor& t) { return View{t.get()}; }
Tensor int4_matmul_op(Tensor x, Tensor codes, Tensor scale_zero, std::optional<Tensor> ids) {
  View id;
  return Tensor(int4_matmul(view(x), view(codes), view(scale_zero), optional_view(ids ? ids->get() : nullptr, id)));
}
Tensor int8_matmul_op(Tensor x, Tensor codes, Tensor scales, std::optional<Tensor> ids) {
  View id;
  return Tensor(int8_matmul(view(x), view(codes), view(scales), optional_view(ids ? ids->get() : nullptr, id)));
}
Tensor float_matmul_op(Tensor x, Tensor w, std::optional<Tensor> ids) {
  View id;
  return Tensor(float_matmul(view(x), view(w), optional_view(ids ? ids->get() : nullptr, id)));
}
Tensor int4_values_op(Tensor codes, Tensor scale_zero) { return Tensor(int4_values(view(codes), view(scale_zero))); }

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("int4_matmul", TORCH_BOX(&int4_matmul_op));
  m.impl("int4_values", TORCH_BOX(&int4_values_op));
  m.impl("int8_matmul", TORCH_BOX(&int8_matmul_op));
  m.impl("float_matmul", TORCH_BOX(&float_matmul_op));
}

// The C shims: their declarations are runtime/int_matmul.py's C_SHIMS, which the compiler hands
// to AOTInductor. The library is loaded with its symbols global so the regions' code finds them.
extern "C" {
AOTITorchError aoti_torch_cpu_int4_matmul(AtenTensorHandle x, AtenTensorHandle codes, AtenTensorHandle scale_zero, AtenTensorHandle* ids,
                                          AtenTensorHandle* ret0) {
  View id;
  return shim("int4_matmul", [&] { *ret0 = int4_matmul(View{x}, View{codes}, View{scale_zero}, optional_view(ids ? *ids : nullptr, id)); });
}
AOTITorchError aoti_torch_cpu_int8_matmul(AtenTensorHandle x, AtenTensorHandle codes, AtenTensorHandle scales, AtenTensorHandle* ids,
                                          AtenTensorHandle* ret0) {
  View id;
  return shim("int8_matmul", [&] { *ret0 = int8_matmul(View{x}, View{codes}, View{scales}, optional_view(ids ? *ids : nullptr, id)); });
}
AOTITorchError aoti_torch_cpu_float_matmul(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ids, AtenTensorHandle* ret0) {
  View id;
  return shim("float_matmul", [&] { *ret0 = float_matmul(View{x}, View{w}, optional_view(ids ? *ids : nullptr, id)); });
}
AOTITorchError aoti_torch_cpu_int4_values(AtenTensorHandle codes, AtenTensorHandle scale_zero, AtenTensorHandle* ret0) {
  return shim("int4_values", [&] { *ret0 = int4_values(View{codes}, View{scale_zero}); });
}
}
