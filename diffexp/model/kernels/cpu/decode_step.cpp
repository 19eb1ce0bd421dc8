// One decoding step's attention on CPU, for every variant: the query rows of a GQA group against the cached keys,
// and the weights of the step's row against the cached values, each cache row read once from memory.
//   step_probabilities: P[b, g, r] = softmax(scale q[b, g, r] . K[b, g, :valid_b])      (zeros past valid_b)
//   step_pair_weights:  W[b, g, i] = P1[b, g, i] - lam[b, g, i] P2[b, g, i], one K        (DIFF V2's pairs)
//   step_two_map_weights: W[b, g, r] = P1[b, g, r] - lam[b, g, r] P2[b, g, r]          (each map its own K)
//   step_values:        out[b, g, r] = sum_s W[b, g, r, s] V[b, g, s]                    (s < valid_b)
// The batched GEMMs these replace have 1-8 rows and run far from the memory bound; here every key and value row
// is loaded once and used by all rows of its group. K and V may be views into a larger cache (any strides, the
// last 1); valid_b = lengths[b] when given, else every key. The Python side: diffexp/model/kernels/cpu_native.py.
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

// Chunks per (batch, group) so that the tasks fill the threads even at batch 1.
int64_t chunks_for(int64_t groups_total, int64_t keys) {
  const int64_t wanted = (2 * at::get_num_threads() + groups_total - 1) / groups_total;
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

struct Scores {  // scale q . k for every query row of a group and every visible key: (B, groups, rows, S)
  at::Tensor logits;
  std::vector<int64_t> valid;
  int64_t batch, groups, rows, keys;
};

Scores step_scores(const at::Tensor& q_in, const at::Tensor& k_in, const std::optional<at::Tensor>& lengths,
                   double scale) {
  const at::Tensor q = q_in.contiguous();
  const Rows k = rows_of(k_in, "k");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 4 && q.size(0) == k.batch && q.size(1) == k.groups &&
                  q.size(3) == k.dim,
              "diffexp_cpu: q must be (B, groups, rows, dim) matching k");
  const int64_t batch = k.batch, groups = k.groups, rows = q.size(2), keys = k.length, dim = k.dim;
  const std::vector<int64_t> valid = valid_keys(lengths, batch, keys);
  at::Tensor probs = at::empty({batch, groups, rows, keys}, q.options());
  const float* qd = q.data_ptr<float>();
  float* pd = probs.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const int64_t chunks = chunks_for(batch * groups, keys), chunk = (keys + chunks - 1) / chunks;
  at::parallel_for(0, batch * groups * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / chunks, b = bg / groups, g = bg % groups;
      const int64_t first = (task % chunks) * chunk, last = std::min(valid[b], first + chunk);
      const float* qg = qd + bg * rows * dim;
      float* pg = pd + bg * rows * keys;
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
          float* out = pg + r * keys + j;
          out[0] = d0 * s, out[1] = d1 * s, out[2] = d2 * s, out[3] = d3 * s;
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
    }
  });
  return {probs, valid, batch, groups, rows, keys};
}

// Exponentiates p[0, n) in place, shifted by its maximum; returns 1 / their sum (0 for an empty row).
float exp_row(float* p, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t j = 0; j < n; ++j) top = std::max(top, p[j]);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < n; ++j) {
    p[j] = expf(p[j] - top);
    total += p[j];
  }
  return n > 0 ? 1.f / total : 0.f;
}

at::Tensor step_probabilities(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& lengths,
                              double scale) {
  Scores sc = step_scores(q, k, lengths, scale);
  float* pd = sc.logits.data_ptr<float>();
  const int64_t per_batch = sc.groups * sc.rows, keys = sc.keys;
  at::parallel_for(0, sc.batch * per_batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n = sc.valid[row / per_batch];
      float* p = pd + row * keys;
      const float inv = exp_row(p, n);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) p[j] *= inv;
      std::fill(p + n, p + keys, 0.f);
    }
  });
  return sc.logits;
}

// w = softmax(first) - lam softmax(second) over n keys, from the two maps' logits (overwritten), zeros up to keys.
void combine_rows(float* first, float* second, float lam, int64_t n, int64_t keys, float* w) {
  const float c1 = exp_row(first, n), c2 = lam * exp_row(second, n);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) w[j] = c1 * first[j] - c2 * second[j];
  std::fill(w + n, w + keys, 0.f);
}

const float* lambda_rows(const at::Tensor& lam, int64_t count) {
  TORCH_CHECK(lam.scalar_type() == at::kFloat && lam.is_contiguous() && lam.numel() == count,
              "diffexp_cpu: lam must be a contiguous fp32 tensor with one value per (batch, group, row)");
  return lam.data_ptr<float>();
}

// DIFF V2's pairs share K: row i of q1 and row i of q2 are the two maps of pair i, combined as they are normalised,
// so the step's (B, groups, pairs, S) weights are written once and the two maps' rows are never stored. q1 and q2
// may be strided views of one tensor of query heads; they are interleaved here, not by a copy in the graph.
at::Tensor step_pair_weights(const at::Tensor& q1, const at::Tensor& q2, const at::Tensor& k, const at::Tensor& lam,
                             const std::optional<at::Tensor>& lengths, double scale) {
  TORCH_CHECK(q1.dim() == 4 && q1.sizes() == q2.sizes() && q1.scalar_type() == at::kFloat &&
                  q2.scalar_type() == at::kFloat,
              "diffexp_cpu: q1 and q2 must be (B, groups, pairs, dim) fp32");
  const int64_t batch = q1.size(0), groups = q1.size(1), pairs = q1.size(2), dim = q1.size(3);
  at::Tensor q = at::empty({batch, groups, 2 * pairs, dim}, q1.options().memory_format(at::MemoryFormat::Contiguous));
  float* row = q.data_ptr<float>();
  const auto a = q1.accessor<float, 4>(), c = q2.accessor<float, 4>();
  for (int64_t b = 0; b < batch; ++b)  // a few rows: a plain copy, cheaper than an ATen op's dispatch
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t i = 0; i < pairs; ++i)
        for (const auto* from : {&a, &c}) {
          for (int64_t x = 0; x < dim; ++x) row[x] = (*from)[b][g][i][x];
          row += dim;
        }
  Scores sc = step_scores(q, k, lengths, scale);
  const int64_t keys = sc.keys, per_batch = sc.groups * pairs;
  const float* ld = lambda_rows(lam, sc.batch * per_batch);
  at::Tensor weights = at::empty({sc.batch, sc.groups, pairs, keys}, sc.logits.options());
  float *pd = sc.logits.data_ptr<float>(), *wd = weights.data_ptr<float>();
  at::parallel_for(0, sc.batch * per_batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      float* first = pd + 2 * pair * keys;
      combine_rows(first, first + keys, ld[pair], sc.valid[pair / per_batch], keys, wd + pair * keys);
    }
  });
  return weights;
}

// DIFF V1 and Shared DIFF: each map reads its own K; row r of q1 and row r of q2 are the two maps of one head.
at::Tensor step_two_map_weights(const at::Tensor& q1, const at::Tensor& k1, const at::Tensor& q2,
                                const at::Tensor& k2, const at::Tensor& lam, const std::optional<at::Tensor>& lengths,
                                double scale) {
  Scores first = step_scores(q1, k1, lengths, scale), second = step_scores(q2, k2, lengths, scale);
  TORCH_CHECK(first.logits.sizes() == second.logits.sizes(), "diffexp_cpu: the two maps' shapes must match");
  const int64_t keys = first.keys, per_batch = first.groups * first.rows;
  const float* ld = lambda_rows(lam, first.batch * per_batch);
  at::Tensor weights = at::empty_like(first.logits);
  float *p1 = first.logits.data_ptr<float>(), *p2 = second.logits.data_ptr<float>(), *wd = weights.data_ptr<float>();
  at::parallel_for(0, first.batch * per_batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      combine_rows(p1 + row * keys, p2 + row * keys, ld[row], first.valid[row / per_batch], keys, wd + row * keys);
  });
  return weights;
}

at::Tensor step_values(const at::Tensor& w_in, const at::Tensor& v_in, const std::optional<at::Tensor>& lengths) {
  const at::Tensor w = w_in.contiguous();
  const Rows v = rows_of(v_in, "v");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 4 && w.size(0) == v.batch && w.size(1) == v.groups &&
                  w.size(3) == v.length,
              "diffexp_cpu: the weights must be (B, groups, rows, S) matching v");
  const int64_t batch = v.batch, groups = v.groups, rows = w.size(2), keys = v.length, dim = v.dim;
  const std::vector<int64_t> valid = valid_keys(lengths, batch, keys);
  const int64_t chunks = chunks_for(batch * groups, keys), chunk = (keys + chunks - 1) / chunks;
  // per chunk partial sums, added up below; one chunk writes the output directly
  at::Tensor partial = at::zeros({batch * groups, chunks, rows, dim}, w.options());
  const float* wd = w.data_ptr<float>();
  float* sums = partial.data_ptr<float>();
  at::parallel_for(0, batch * groups * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / chunks, b = bg / groups, g = bg % groups;
      const int64_t first = (task % chunks) * chunk, last = std::min(valid[b], first + chunk);
      const float* wg = wd + bg * rows * keys;
      float* acc = sums + task * rows * dim;
      for (int64_t j = first; j < last; ++j) {
        const float* value = v.row(b, g, j);
        if (j + kAhead < last)
          for (int64_t i = 0; i < dim; i += 16) __builtin_prefetch(v.row(b, g, j + kAhead) + i);
        for (int64_t r = 0; r < rows; ++r) {
          const float weight = wg[r * keys + j];
          float* out = acc + r * dim;
#pragma omp simd
          for (int64_t i = 0; i < dim; ++i) out[i] += weight * value[i];
        }
      }
    }
  });
  if (chunks == 1) return partial.view({batch, groups, rows, dim});
  return partial.sum(1).view({batch, groups, rows, dim});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diffexp_cpu, m) {
  m.def("step_probabilities(Tensor q, Tensor k, Tensor? lengths, float scale) -> Tensor");
  m.def("step_pair_weights(Tensor q1, Tensor q2, Tensor k, Tensor lam, Tensor? lengths, float scale) -> Tensor");
  m.def("step_two_map_weights(Tensor q1, Tensor k1, Tensor q2, Tensor k2, Tensor lam, Tensor? lengths, "
        "float scale) -> Tensor");
  m.def("step_values(Tensor weights, Tensor v, Tensor? lengths) -> Tensor");
}

TORCH_LIBRARY_IMPL(diffexp_cpu, CPU, m) {
  m.impl("step_probabilities", &step_probabilities);
  m.impl("step_pair_weights", &step_pair_weights);
  m.impl("step_two_map_weights", &step_two_map_weights);
  m.impl("step_values", &step_values);
}
