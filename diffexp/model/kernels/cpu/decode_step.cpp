// One decoding step's attention on CPU, for every variant: the query rows of a GQA group against the cached keys,
// and the weights of the step's row against the cached values, each cache row read once from memory.
//   step_attention:         out[b, g, r] = softmax(scale q[b, g, r] . K[b, g, :valid_b]) V        (one map a row)
//   step_pair_attention:    out[b, g, i] = (P[b, g, 2i] - lam[b, g, i] P[b, g, 2i + 1]) V, one K (DIFF V2's pairs)
//   step_two_map_attention: out[b, g, r] = (P1[b, g, r] - lam[b, g, r] P2[b, g, r]) V, a K each (DIFF V1, Shared)
//   step_dint_attention:    out[b, g, r] = (P1 - lam P2 + gamma A3)[b, g, r] V, A3 from P1's column sums (DINT's)
//   step_probabilities:     P[b, g, r] (zeros past valid_b), and step_values: W V
// Two phases: the scores of a chunk of keys, exponentiated while they are in L1 (shifted by the chunk's maximum);
// then V, weighted by the exponentials times a coefficient per (row, chunk) that normalises them and, for two maps,
// subtracts the second. Each phase is one parallel pass; where a task holds whole rows, one pass runs both. The
// batched GEMMs these replace have 1-8 rows and run far from the memory bound; here every key and value row is loaded
// once and used by all rows of its group. K and V may be views into a larger cache (any strides, the last 1);
// valid_b = lengths[b] when given, else every key. The Python side: diffexp/model/kernels/cpu_native.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <initializer_list>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

extern "C" float expf(float) noexcept __attribute__((__simd__("notinbranch")));

namespace {

constexpr int64_t kMinChunk = 256;  // keys per task: enough work to amortise a task, small enough to share cores
constexpr int64_t kAhead = 16;      // rows fetched ahead of the one in use

struct Rows {  // a (B, groups, S, dim) view, last stride 1
  const float* data;
  int64_t batch, groups, length, dim, s0, s1, s2;
  const float* row(int64_t b, int64_t g, int64_t s) const { return data + b * s0 + g * s1 + s * s2; }
};

Rows rows_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.dim() == 4 && t.stride(3) == 1, "diffexp_cpu: ",
              name, " must be a (B, groups, S, dim) fp32 CPU tensor with unit last stride");
  return {t.data_ptr<float>(), t.size(0), t.size(1), t.size(2), t.size(3), t.stride(0), t.stride(1), t.stride(2)};
}

std::vector<int64_t> valid_keys(const std::optional<at::Tensor>& lengths, int64_t batch, int64_t keys) {
  std::vector<int64_t> valid(batch, keys);
  if (lengths.has_value()) {
    const at::Tensor l = lengths->to(at::kLong).contiguous();
    TORCH_CHECK(l.numel() == batch, "diffexp_cpu: lengths must hold one count per batch row");
    const int64_t* data = l.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) valid[b] = std::clamp<int64_t>(data[b], 0, keys);
  }
  return valid;
}

// Chunks per (batch, group): one where the groups split evenly over the threads (a task then scores, normalises and
// reads V at once, see attend); else enough for two tasks a thread, so that they fill the threads even at batch 1.
int64_t chunks_for(int64_t groups_total, int64_t keys) {
  const int64_t threads = at::get_num_threads();
  if (groups_total % threads == 0) return 1;
  const int64_t wanted = (2 * threads + groups_total - 1) / groups_total;
  return std::max<int64_t>(1, std::min<int64_t>(wanted, keys / kMinChunk));
}

// scale (qa . k_c) and scale (qb . k_c) for four keys k_0..k_3: eight dot products of length dim.
inline void dot_2x4(const float* qa, const float* qb, const float* k0, const float* k1, const float* k2,
                    const float* k3, int64_t dim, float s, float* oa, float* ob) {
#if defined(__AVX2__) && defined(__FMA__)
  if (dim % 8 == 0) {  // eight vector sums, then one tree of horizontal adds for all eight (not one per sum)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t i = 0; i < dim; i += 8) {
      const __m256 x = _mm256_loadu_ps(qa + i), y = _mm256_loadu_ps(qb + i);
      __m256 c0 = _mm256_loadu_ps(k0 + i), c1 = _mm256_loadu_ps(k1 + i), c2 = _mm256_loadu_ps(k2 + i),
             c3 = _mm256_loadu_ps(k3 + i);
      // keep the keys in registers: folded into each FMA as a memory operand, every key would be loaded twice
      __asm__("" : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3));
      a0 = _mm256_fmadd_ps(x, c0, a0), a1 = _mm256_fmadd_ps(x, c1, a1);
      a2 = _mm256_fmadd_ps(x, c2, a2), a3 = _mm256_fmadd_ps(x, c3, a3);
      b0 = _mm256_fmadd_ps(y, c0, b0), b1 = _mm256_fmadd_ps(y, c1, b1);
      b2 = _mm256_fmadd_ps(y, c2, b2), b3 = _mm256_fmadd_ps(y, c3, b3);
    }
    const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    const __m256 t2 = _mm256_hadd_ps(b0, b1), t3 = _mm256_hadd_ps(b2, b3);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: a0..a3 / b0..b3
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    const __m256 scaled = _mm256_mul_ps(sums, _mm256_set1_ps(s));
    _mm_storeu_ps(oa, _mm256_castps256_ps128(scaled));
    _mm_storeu_ps(ob, _mm256_extractf128_ps(scaled, 1));
    return;
  }
#endif
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f, b0 = 0.f, b1 = 0.f, b2 = 0.f, b3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3, b0, b1, b2, b3)
  for (int64_t i = 0; i < dim; ++i) {
    a0 += qa[i] * k0[i]; a1 += qa[i] * k1[i]; a2 += qa[i] * k2[i]; a3 += qa[i] * k3[i];
    b0 += qb[i] * k0[i]; b1 += qb[i] * k1[i]; b2 += qb[i] * k2[i]; b3 += qb[i] * k3[i];
  }
  oa[0] = a0 * s, oa[1] = a1 * s, oa[2] = a2 * s, oa[3] = a3 * s;
  ob[0] = b0 * s, ob[1] = b1 * s, ob[2] = b2 * s, ob[3] = b3 * s;
}

// Phase 1 of every op, one pass over K: scale q . k for a chunk of keys, then exp(logit - the chunk's maximum) in
// place while the chunk's logits are still in L1, with each row's chunk maximum and sum. A row's softmax is then
// coefficient(chunk) * e, with no second pass over the logits to find the row's maximum.
struct ChunkedExp {
  at::Tensor e;                   // (B, groups, rows, S): exp(logit - its chunk's max) for visible keys, unset past
  std::vector<float> top, total;  // per (bg, chunk, row): the chunk's max logit and sum of e
  std::vector<int64_t> valid;
  int64_t batch, groups, rows, keys, chunks, chunk;

  int64_t at(int64_t bg, int64_t c, int64_t r) const { return (bg * chunks + c) * rows + r; }

  // per (chunk, row) of group bg, into coef[at(bg, c, r)]: exp(top - the row's max) / the row's sum, times
  // `factor(bg, r)` (0 for an empty row)
  template <typename Factor>
  void coefficients_of(int64_t bg, Factor factor, float* coef) const {
    for (int64_t r = 0; r < rows; ++r) {
      float row_top = -std::numeric_limits<float>::infinity(), row_total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) row_top = std::max(row_top, top[at(bg, c, r)]);
      if (row_top == -std::numeric_limits<float>::infinity()) {
        for (int64_t c = 0; c < chunks; ++c) coef[at(bg, c, r)] = 0.f;
        continue;
      }
      for (int64_t c = 0; c < chunks; ++c) row_total += total[at(bg, c, r)] * std::exp(top[at(bg, c, r)] - row_top);
      const float scale = factor(bg, r) / row_total;
      for (int64_t c = 0; c < chunks; ++c) coef[at(bg, c, r)] = std::exp(top[at(bg, c, r)] - row_top) * scale;
    }
  }

  template <typename Factor>
  std::vector<float> coefficients(Factor factor) const {
    std::vector<float> coef(top.size(), 0.f);
    for (int64_t bg = 0; bg < batch * groups; ++bg) coefficients_of(bg, factor, coef.data());
    return coef;
  }
};

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) for x <= 0 (a logit minus its maximum), Cephes' expf in registers: 2^n exp(r), |r| <= ln(2) / 2, within
// 2 ulp of expf; x is clamped at -87.3 (exp = 1.2e-38, where expf turns denormal); NaN stays NaN. In registers, a
// loop of it keeps its sums there, where a call to libmvec's expf spills them.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);  // max_ps returns its second operand when one is NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

// Exponentiates p[0, n) in place, shifted by its maximum; stores that maximum and the sum (-inf, 0 when empty).
// Locals, not `top`: a reduction into a reference that p might alias stays scalar. Not inlined: inside the score
// loop it costs that loop its registers.
__attribute__((noinline)) void exp_chunk(float* p, int64_t n, float& top, float& total) {
  float most = -std::numeric_limits<float>::infinity(), sum = 0.f;
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {
    __m256 m0 = _mm256_loadu_ps(p), m1 = m0;
    for (; j + 16 <= n; j += 16)
      m0 = _mm256_max_ps(m0, _mm256_loadu_ps(p + j)), m1 = _mm256_max_ps(m1, _mm256_loadu_ps(p + j + 8));
    for (; j + 8 <= n; j += 8) m0 = _mm256_max_ps(m0, _mm256_loadu_ps(p + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
    for (const float lane : lanes) most = std::max(most, lane);
  }
  for (int64_t i = j; i < n; ++i) most = std::max(most, p[i]);
  const __m256 shift = _mm256_set1_ps(most);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  for (j = 0; j + 16 <= n; j += 16) {
    const __m256 e0 = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + j), shift));
    const __m256 e1 = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + j + 8), shift));
    _mm256_storeu_ps(p + j, e0), _mm256_storeu_ps(p + j + 8, e1);
    s0 = _mm256_add_ps(s0, e0), s1 = _mm256_add_ps(s1, e1);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(s0, s1));
  for (const float lane : lanes) sum += lane;
#else
#pragma omp simd reduction(max : most)
  for (int64_t i = 0; i < n; ++i) most = std::max(most, p[i]);
#endif
#pragma omp simd reduction(+ : sum)
  for (int64_t i = j; i < n; ++i) {  // the last few (all, without AVX2): libmvec's expf
    p[i] = expf(p[i] - most);
    sum += p[i];
  }
  top = most;
  total = sum;
}

// One map's phase 1: its queries, keys and result; `score(task)` runs one chunk of one (batch, group).
struct ScorePass {
  at::Tensor q;
  Rows k;
  float s;
  ChunkedExp out;

  ScorePass(const at::Tensor& q_in, const at::Tensor& k_in, const std::optional<at::Tensor>& lengths, double scale)
      : q(q_in.contiguous()), k(rows_of(k_in, "k")), s(static_cast<float>(scale)) {
    TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 4 && q.size(0) == k.batch && q.size(1) == k.groups &&
                    q.size(3) == k.dim,
                "diffexp_cpu: q must be (B, groups, rows, dim) matching k");
    const int64_t batch = k.batch, groups = k.groups, rows = q.size(2), keys = k.length;
    const int64_t chunks = chunks_for(batch * groups, keys), chunk = (keys + chunks - 1) / chunks;
    out = {at::empty({batch, groups, rows, keys}, q.options()), std::vector<float>(batch * groups * chunks * rows),
           std::vector<float>(batch * groups * chunks * rows), valid_keys(lengths, batch, keys), batch, groups, rows,
           keys, chunks, chunk};
  }

  int64_t tasks() const { return out.batch * out.groups * out.chunks; }

  void score(int64_t task) {
    const int64_t rows = out.rows, keys = out.keys, dim = k.dim, chunks = out.chunks;
    const int64_t bg = task / chunks, b = bg / out.groups, g = bg % out.groups;
    const int64_t first = (task % chunks) * out.chunk, last = std::min(out.valid[b], first + out.chunk);
    const float* qg = q.data_ptr<float>() + bg * rows * dim;
    float* pg = out.e.data_ptr<float>() + bg * rows * keys;
    int64_t j = first;
    for (; j + 4 <= last; j += 4) {  // 4 keys x 2 rows at a time: eight independent sums
      const float *k0 = k.row(b, g, j), *k1 = k.row(b, g, j + 1), *k2 = k.row(b, g, j + 2), *k3 = k.row(b, g, j + 3);
      if (j + kAhead < last)
        for (int64_t i = 0; i < 4 * dim; i += 16) __builtin_prefetch(k.row(b, g, j + kAhead) + i);
      int64_t r = 0;
      for (; r + 2 <= rows; r += 2) {
        const float* qa = qg + r * dim;
        dot_2x4(qa, qa + dim, k0, k1, k2, k3, dim, s, pg + r * keys + j, pg + (r + 1) * keys + j);
      }
      for (; r < rows; ++r) {
        const float* qr = qg + r * dim;
        float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
        for (int64_t i = 0; i < dim; ++i) {
          d0 += qr[i] * k0[i];
          d1 += qr[i] * k1[i];
          d2 += qr[i] * k2[i];
          d3 += qr[i] * k3[i];
        }
        float* o = pg + r * keys + j;
        o[0] = d0 * s, o[1] = d1 * s, o[2] = d2 * s, o[3] = d3 * s;
      }
    }
    for (; j < last; ++j) {
      const float* key = k.row(b, g, j);
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = qg + r * dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < dim; ++i) dot += qr[i] * key[i];
        pg[r * keys + j] = dot * s;
      }
    }
    const int64_t c = task % chunks;
    for (int64_t r = 0; r < rows; ++r)
      exp_chunk(pg + r * keys + first, last - first, out.top[out.at(bg, c, r)], out.total[out.at(bg, c, r)]);
  }
};

// Phase 1 of one or two maps in one parallel pass (one fork and join, not one per map).
void score_all(std::initializer_list<ScorePass*> passes) {
  int64_t total = 0;
  for (const ScorePass* p : passes) total += p->tasks();
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      int64_t t = task;
      for (ScorePass* p : passes) {
        if (t < p->tasks()) {
          p->score(t);
          break;
        }
        t -= p->tasks();
      }
    }
  });
}

ChunkedExp chunked_exp(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& lengths,
                       double scale) {
  ScorePass pass(q, k, lengths, scale);
  score_all({&pass});
  return std::move(pass.out);
}

at::Tensor step_probabilities(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& lengths,
                              double scale) {
  ChunkedExp ex = chunked_exp(q, k, lengths, scale);
  const std::vector<float> coef = ex.coefficients([](int64_t, int64_t) { return 1.f; });
  float* pd = ex.e.data_ptr<float>();
  const int64_t keys = ex.keys;
  at::parallel_for(0, ex.batch * ex.groups * ex.rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t bg = row / ex.rows, r = row % ex.rows, n = ex.valid[bg / ex.groups];
      float* p = pd + row * keys;
      for (int64_t c = 0; c < ex.chunks; ++c) {
        const float f = coef[ex.at(bg, c, r)];
        const int64_t first = c * ex.chunk, last = std::min(n, first + ex.chunk);
#pragma omp simd
        for (int64_t j = first; j < last; ++j) p[j] *= f;
      }
      std::fill(p + std::min(n, keys), p + keys, 0.f);
    }
  });
  return ex.e;
}

// The weights of a step's rows, made as the values are read: W[bg, r, s] = sum over the maps m of
// coef_m[(bg, chunk of s, r)] e_m[bg, r, s], where e_m's row r of group bg starts at e_m + (bg * group_rows +
// r * row_step) * keys.
struct Weights {
  const float* e[3];
  const float* coef[3];  // per (bg, chunk, r), as ChunkedExp::at with `rows` output rows
  int64_t group_rows, row_step;
};

#if defined(__AVX2__) && defined(__FMA__)
// acc[r, i:i+32] += sum over keys j of w[r, j] value_j[i:i+32] for rows r and r+1 (Two), in registers: 8 sums, not
// the 16 a full 64-wide row pair needs, which leave no registers for the values and go through memory on every key.
template <bool Two>
inline void accumulate_block(const float* values, int64_t stride, int64_t from, int64_t to, const float* w,
                             int64_t n, float* acc, int64_t dim) {
  float* o0 = acc;
  float* o1 = acc + dim;
  __m256 a0 = _mm256_loadu_ps(o0), a1 = _mm256_loadu_ps(o0 + 8), a2 = _mm256_loadu_ps(o0 + 16),
         a3 = _mm256_loadu_ps(o0 + 24);
  __m256 b0 = a0, b1 = a1, b2 = a2, b3 = a3;
  if constexpr (Two)
    b0 = _mm256_loadu_ps(o1), b1 = _mm256_loadu_ps(o1 + 8), b2 = _mm256_loadu_ps(o1 + 16),
    b3 = _mm256_loadu_ps(o1 + 24);
  for (int64_t j = from; j < to; ++j) {
    const float* x = values + j * stride;
    const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8), x2 = _mm256_loadu_ps(x + 16),
                 x3 = _mm256_loadu_ps(x + 24);
    const __m256 c = _mm256_set1_ps(w[j]);
    a0 = _mm256_fmadd_ps(c, x0, a0), a1 = _mm256_fmadd_ps(c, x1, a1);
    a2 = _mm256_fmadd_ps(c, x2, a2), a3 = _mm256_fmadd_ps(c, x3, a3);
    if constexpr (Two) {
      const __m256 d = _mm256_set1_ps(w[n + j]);
      b0 = _mm256_fmadd_ps(d, x0, b0), b1 = _mm256_fmadd_ps(d, x1, b1);
      b2 = _mm256_fmadd_ps(d, x2, b2), b3 = _mm256_fmadd_ps(d, x3, b3);
    }
  }
  _mm256_storeu_ps(o0, a0), _mm256_storeu_ps(o0 + 8, a1), _mm256_storeu_ps(o0 + 16, a2), _mm256_storeu_ps(o0 + 24, a3);
  if constexpr (Two)
    _mm256_storeu_ps(o1, b0), _mm256_storeu_ps(o1 + 8, b1), _mm256_storeu_ps(o1 + 16, b2),
    _mm256_storeu_ps(o1 + 24, b3);
}
#endif

// acc[r] += sum over keys j < n of w[r * n + j] value_j for `rows` rows of `dim`; value_j = values + j * stride.
inline void accumulate_values(const float* values, int64_t stride, int64_t n, const float* w, int64_t rows,
                              int64_t dim, float* acc) {
#if defined(__AVX2__) && defined(__FMA__)
  if (dim % 32 == 0) {  // blocks of keys that stay in L1 while each pair of rows reads them, 32 columns at a time
    constexpr int64_t kKeyBlock = 64;
    for (int64_t from = 0; from < n; from += kKeyBlock) {
      const int64_t to = std::min(n, from + kKeyBlock);
      for (int64_t j = to; j < std::min(n, to + kAhead); ++j)
        for (int64_t i = 0; i < dim; i += 16) __builtin_prefetch(values + j * stride + i);
      for (int64_t r = 0; r < rows; r += 2)
        for (int64_t i = 0; i < dim; i += 32) {
          if (r + 1 < rows)
            accumulate_block<true>(values + i, stride, from, to, w + r * n, n, acc + r * dim + i, dim);
          else
            accumulate_block<false>(values + i, stride, from, to, w + r * n, n, acc + r * dim + i, dim);
        }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const float* value = values + j * stride;
    if (j + kAhead < n)
      for (int64_t i = 0; i < dim; i += 16) __builtin_prefetch(value + kAhead * stride + i);
    for (int64_t r = 0; r < rows; ++r) {
      const float weight = w[r * n + j];
      float* __restrict__ out = acc + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) out[i] += weight * value[i];
    }
  }
}

struct Unprepared {
  void operator()(int64_t) const {}
};

// out[b, g, r] = sum_{s < valid_b} W[b, g, r, s] V[b, g, s] for Maps (1 to 3) maps' weights, in the chunks of keys
// phase 1 used (same batch, groups and keys give the same chunks). `prepare(task)` runs first in each task: it may
// make that task's weights (see attend).
template <int Maps, typename Prepare = Unprepared>
at::Tensor weighted_values(const Weights& w, const at::Tensor& v_in, const std::vector<int64_t>& valid, int64_t rows,
                           const at::TensorOptions& options, Prepare prepare = {}) {
  const Rows v = rows_of(v_in, "v");
  const int64_t batch = v.batch, groups = v.groups, keys = v.length, dim = v.dim;
  TORCH_CHECK(static_cast<int64_t>(valid.size()) == batch, "diffexp_cpu: v must have the batch of q and k");
  const int64_t chunks = chunks_for(batch * groups, keys), chunk = (keys + chunks - 1) / chunks;
  // one partial sum per chunk, added up below; one chunk writes the output directly
  at::Tensor partial = at::zeros({batch * groups, chunks, rows, dim}, options);
  float* sums = partial.data_ptr<float>();
  at::parallel_for(0, batch * groups * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      prepare(task);
      const int64_t bg = task / chunks, b = bg / groups, g = bg % groups;
      const int64_t first = (task % chunks) * chunk, last = std::min(valid[b], first + chunk);
      const float* e0 = w.e[0] + bg * w.group_rows * keys;
      const float* e1 = Maps >= 2 ? w.e[1] + bg * w.group_rows * keys : nullptr;
      const float* e2 = Maps == 3 ? w.e[2] + bg * w.group_rows * keys : nullptr;
      const int64_t stride = w.row_step * keys, n = std::max<int64_t>(0, last - first);
      // the chunk's weights first, a vectorised pass while its exponentials are hot; then one pass over V
      thread_local std::vector<float> chunk_weights;
      chunk_weights.resize(rows * n);
      for (int64_t r = 0; r < rows; ++r) {
        const float a = w.coef[0][task * rows + r], c = Maps >= 2 ? w.coef[1][task * rows + r] : 0.f;
        const float *x = e0 + r * stride + first, *y = Maps >= 2 ? e1 + r * stride + first : nullptr;
        float* out = chunk_weights.data() + r * n;
        if constexpr (Maps == 3) {
          const float f = w.coef[2][task * rows + r];
          const float* z = e2 + r * stride + first;
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) out[j] = a * x[j] + c * y[j] + f * z[j];
        } else if constexpr (Maps == 2) {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) out[j] = a * x[j] + c * y[j];
        } else {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) out[j] = a * x[j];
        }
      }
      accumulate_values(v.row(b, g, first), v.s2, n, chunk_weights.data(), rows, dim, sums + task * rows * dim);
    }
  });
  if (chunks == 1) return partial.view({batch, groups, rows, dim});
  at::Tensor out = at::empty({batch, groups, rows, dim}, options);
  float* od = out.data_ptr<float>();
  for (int64_t bg = 0; bg < batch * groups; ++bg) {  // a few rows: a plain sum, cheaper than an ATen op's dispatch
    float* o = od + bg * rows * dim;
    const float* p = sums + bg * chunks * rows * dim;
    std::copy(p, p + rows * dim, o);
    for (int64_t c = 1; c < chunks; ++c)
#pragma omp simd
      for (int64_t i = 0; i < rows * dim; ++i) o[i] += p[c * rows * dim + i];
  }
  return out;
}

at::Tensor step_values(const at::Tensor& w_in, const at::Tensor& v, const std::optional<at::Tensor>& lengths) {
  const at::Tensor w = w_in.contiguous();
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 4 && v.dim() == 4 && w.size(0) == v.size(0) &&
                  w.size(1) == v.size(1) && w.size(3) == v.size(2),
              "diffexp_cpu: the weights must be (B, groups, rows, S) matching v");
  const int64_t batch = w.size(0), groups = w.size(1), rows = w.size(2), keys = w.size(3);
  const int64_t chunks = chunks_for(batch * groups, keys);
  const std::vector<float> ones(batch * groups * chunks * rows, 1.f);
  const Weights weights{{w.data_ptr<float>(), nullptr, nullptr}, {ones.data(), nullptr, nullptr}, rows, 1};
  return weighted_values<1>(weights, v, valid_keys(lengths, batch, keys), rows, w.options());
}

// V must hold a row for every key phase 1 scored: its chunks are the same.
void check_values(const ChunkedExp& ex, const at::Tensor& v) {
  TORCH_CHECK(v.dim() == 4 && v.size(0) == ex.batch && v.size(1) == ex.groups && v.size(2) == ex.keys,
              "diffexp_cpu: v must be (B, groups, S, dv) matching k");
}

// The passes' scores, then V weighted by w (rows_out rows a group). `normalise(bg)` makes group bg's coefficients
// in w from its scores. Where a task holds whole rows (one chunk a group, see chunks_for), both run in one parallel
// pass, task by task: the task's exponentials are still in cache when its values are read, and no thread waits
// for the others between the two.
template <int Maps, typename Normalise>
at::Tensor attend(std::initializer_list<ScorePass*> passes, const Weights& w, const at::Tensor& v, int64_t rows_out,
                  Normalise normalise) {
  const ChunkedExp& ex = (*passes.begin())->out;
  check_values(ex, v);
  if (ex.chunks == 1)
    return weighted_values<Maps>(w, v, ex.valid, rows_out, ex.e.options(), [&](int64_t bg) {
      for (ScorePass* p : passes) p->score(bg);
      normalise(bg);
    });
  score_all(passes);
  for (int64_t bg = 0; bg < ex.batch * ex.groups; ++bg) normalise(bg);
  return weighted_values<Maps>(w, v, ex.valid, rows_out, ex.e.options());
}

float unit(int64_t, int64_t) { return 1.f; }

// One map per query row (the baseline, and any single-map head): softmax(scale q K^T) V.
at::Tensor step_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& lengths, double scale) {
  ScorePass pass(q, k, lengths, scale);
  const ChunkedExp& ex = pass.out;
  std::vector<float> coef(ex.top.size());
  const Weights w{{ex.e.data_ptr<float>(), nullptr, nullptr}, {coef.data(), nullptr, nullptr}, ex.rows, 1};
  return attend<1>({&pass}, w, v, ex.rows, [&](int64_t bg) { ex.coefficients_of(bg, unit, coef.data()); });
}

const float* lambda_rows(const at::Tensor& lam, int64_t count) {
  TORCH_CHECK(lam.scalar_type() == at::kFloat && lam.is_contiguous() && lam.numel() == count,
              "diffexp_cpu: lam must be a contiguous fp32 tensor with one value per (batch, group, row)");
  return lam.data_ptr<float>();
}

// DIFF V2's pairs share K: rows 2i and 2i + 1 of q are the two maps of pair i, scored in one pass over K and
// combined (A1 - lam A2) as V is read.
at::Tensor step_pair_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lam,
                               const std::optional<at::Tensor>& lengths, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) % 2 == 0, "diffexp_cpu: q must be (B, groups, 2 * pairs, dim)");
  const int64_t batch = q.size(0), groups = q.size(1), pairs = q.size(2) / 2;
  ScorePass pass(q, k, lengths, scale);
  const ChunkedExp& ex = pass.out;
  const float* ld = lambda_rows(lam, batch * groups * pairs);
  // the coefficients of rows 2i and 2i + 1, regrouped per pair: A1's and -lam times A2's
  std::vector<float> coef(ex.top.size()), first(batch * groups * ex.chunks * pairs), second(first.size());
  const auto normalise = [&](int64_t bg) {
    ex.coefficients_of(bg, [&](int64_t, int64_t r) { return r % 2 == 0 ? 1.f : -ld[bg * pairs + r / 2]; },
                       coef.data());
    for (int64_t ch = 0; ch < ex.chunks; ++ch)
      for (int64_t i = 0; i < pairs; ++i) {
        first[(bg * ex.chunks + ch) * pairs + i] = coef[ex.at(bg, ch, 2 * i)];
        second[(bg * ex.chunks + ch) * pairs + i] = coef[ex.at(bg, ch, 2 * i + 1)];
      }
  };
  const float* e = ex.e.data_ptr<float>();
  const Weights w{{e, e + ex.keys, nullptr}, {first.data(), second.data(), nullptr}, 2 * pairs, 2};
  return attend<2>({&pass}, w, v, pairs, normalise);
}

// DIFF V1 and Shared DIFF: each map reads its own K; row r of q1 and row r of q2 are the two maps of one head.
at::Tensor step_two_map_attention(const at::Tensor& q1, const at::Tensor& k1, const at::Tensor& q2,
                                  const at::Tensor& k2, const at::Tensor& v, const at::Tensor& lam,
                                  const std::optional<at::Tensor>& lengths, double scale) {
  ScorePass first(q1, k1, lengths, scale), second(q2, k2, lengths, scale);
  const ChunkedExp &one = first.out, &two = second.out;
  TORCH_CHECK(one.e.sizes() == two.e.sizes(), "diffexp_cpu: the two maps' shapes must match");
  const float* ld = lambda_rows(lam, one.batch * one.groups * one.rows);
  std::vector<float> c1(one.top.size()), c2(two.top.size());
  const Weights w{{one.e.data_ptr<float>(), two.e.data_ptr<float>(), nullptr}, {c1.data(), c2.data(), nullptr},
                  one.rows, 1};
  return attend<2>({&first, &second}, w, v, one.rows, [&](int64_t bg) {
    one.coefficients_of(bg, unit, c1.data());
    two.coefficients_of(bg, [&](int64_t, int64_t r) { return -ld[bg * two.rows + r]; }, c2.data());
  });
}

// DINT's step: V weighted by A1 - lam A2 + gamma A3, with A3 the integral of the step's row n (0-based position):
// G = (A1's column sums over rows 0..n) / (n + 1), A3 = softmax of G over the visible keys ("softmax") or G ("mean").
// col_sums (B, h, >= S), h = groups * rows, holds the column sums of the earlier rows and gains this row's A1 in
// place. Three parallel passes over the same chunks of keys: both maps' scores, then each row's A1 into col_sums
// and G (exponentiated per chunk for "softmax"), then the values.
at::Tensor step_dint_attention(const at::Tensor& q1, const at::Tensor& k1, const at::Tensor& q2, const at::Tensor& k2,
                               const at::Tensor& v, const at::Tensor& lam, const at::Tensor& gamma,
                               at::Tensor& col_sums, const at::Tensor& positions,
                               const std::optional<at::Tensor>& lengths, double scale, bool softmax_integral) {
  ScorePass first(q1, k1, lengths, scale), second(q2, k2, lengths, scale);
  score_all({&first, &second});
  const ChunkedExp &one = first.out, &two = second.out;
  TORCH_CHECK(one.e.sizes() == two.e.sizes(), "diffexp_cpu: the two maps' shapes must match");
  check_values(one, v);
  const int64_t batch = one.batch, groups = one.groups, rows = one.rows, keys = one.keys, chunks = one.chunks;
  TORCH_CHECK(col_sums.scalar_type() == at::kFloat && col_sums.dim() == 3 && col_sums.size(0) == batch &&
                  col_sums.size(1) == groups * rows && col_sums.size(2) >= keys && col_sums.stride(2) == 1,
              "diffexp_cpu: col_sums must be a (B, heads, >= S) fp32 tensor with unit last stride");
  TORCH_CHECK(gamma.scalar_type() == at::kFloat && gamma.numel() == 1, "diffexp_cpu: gamma must be one fp32 value");
  const at::Tensor position = positions.to(at::kLong).contiguous();
  TORCH_CHECK(position.numel() == batch, "diffexp_cpu: positions must hold one position per batch row");
  const float* ld = lambda_rows(lam, batch * groups * rows);
  const float g = gamma.item<float>();
  const std::vector<float> c1 = one.coefficients([](int64_t, int64_t) { return 1.f; });  // A1 = c1 e1
  const std::vector<float> c2 = two.coefficients([&](int64_t bg, int64_t r) { return -ld[bg * rows + r]; });

  ChunkedExp three{at::empty({batch, groups, rows, keys}, one.e.options()), std::vector<float>(c1.size()),
                   std::vector<float>(c1.size()), one.valid, batch, groups, rows, keys, chunks, one.chunk};
  const float* e1 = one.e.data_ptr<float>();
  float* e3 = three.e.data_ptr<float>();
  float* sums = col_sums.data_ptr<float>();
  const int64_t* pos = position.data_ptr<int64_t>();
  const int64_t s0 = col_sums.stride(0), s1 = col_sums.stride(1);
  at::parallel_for(0, batch * groups * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / chunks, c = task % chunks, b = bg / groups;
      const int64_t from = c * one.chunk, to = std::min(one.valid[b], from + one.chunk);
      const float count = static_cast<float>(pos[b] + 1);
      for (int64_t r = 0; r < rows; ++r) {
        const float a = c1[one.at(bg, c, r)];
        const float* x = e1 + (bg * rows + r) * keys;
        float* column = sums + b * s0 + ((bg % groups) * rows + r) * s1;
        float* mean = e3 + (bg * rows + r) * keys;
#pragma omp simd
        for (int64_t j = from; j < to; ++j) {
          column[j] += a * x[j];
          mean[j] = column[j] / count;
        }
        if (softmax_integral) exp_chunk(mean + from, std::max<int64_t>(0, to - from), three.top[three.at(bg, c, r)],
                                        three.total[three.at(bg, c, r)]);
      }
    }
  });
  const std::vector<float> c3 = softmax_integral ? three.coefficients([&](int64_t, int64_t) { return g; })
                                                 : std::vector<float>(c1.size(), g);
  const Weights w{{e1, two.e.data_ptr<float>(), e3}, {c1.data(), c2.data(), c3.data()}, rows, 1};
  return weighted_values<3>(w, v, one.valid, rows, one.e.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diffexp_cpu, m) {
  m.def("step_probabilities(Tensor q, Tensor k, Tensor? lengths, float scale) -> Tensor");
  m.def("step_values(Tensor weights, Tensor v, Tensor? lengths) -> Tensor");
  m.def("step_attention(Tensor q, Tensor k, Tensor v, Tensor? lengths, float scale) -> Tensor");
  m.def("step_pair_attention(Tensor q, Tensor k, Tensor v, Tensor lam, Tensor? lengths, float scale) -> Tensor");
  m.def("step_two_map_attention(Tensor q1, Tensor k1, Tensor q2, Tensor k2, Tensor v, Tensor lam, Tensor? lengths, "
        "float scale) -> Tensor");
  m.def("step_dint_attention(Tensor q1, Tensor k1, Tensor q2, Tensor k2, Tensor v, Tensor lam, Tensor gamma, "
        "Tensor(a!) col_sums, Tensor positions, Tensor? lengths, float scale, bool softmax_integral) -> Tensor");
}

TORCH_LIBRARY_IMPL(diffexp_cpu, CPU, m) {
  m.impl("step_probabilities", &step_probabilities);
  m.impl("step_values", &step_values);
  m.impl("step_attention", &step_attention);
  m.impl("step_pair_attention", &step_pair_attention);
  m.impl("step_two_map_attention", &step_two_map_attention);
  m.impl("step_dint_attention", &step_dint_attention);
}
