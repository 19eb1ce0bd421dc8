// The two-map variants' attention on CPU, forward and backward, one fused pass per block of query rows:
//   two_map_*: out = (A1 - lambda A2) V                  (DIFF V1, Shared DIFF, DIFF V2; lambda per row)
//   dint_*:    out = (A1 - lambda A2 + gamma A3) V       (DINT, softmax integral)
// with A_m = softmax(scale Q_m K_m^T) (causal). Both maps' rows are combined before the one product with V;
// nothing T x T is kept: backward recomputes each block's maps from the saved row logsumexps. Inputs are
// contiguous fp32 (B, heads, T, dim); query head h reads kv head h / (heads / kv_heads). The math and the
// Python side: diffexp/kernels/cpu_native.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

// BLAS from the MKL/OpenBLAS inside libtorch_cpu (single-threaded inside at::parallel_for)
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);
// glibc's vector expf (libmvec), so that the row loops below vectorize without -ffast-math
extern "C" float expf(float) noexcept __attribute__((__simd__("notinbranch")));

namespace {

using Tensors = std::vector<at::Tensor>;

// Row-major C (m x n) = alpha op(A) op(B) + beta C, through column-major BLAS: C^T = op(B)^T op(A)^T.
void gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
          int ldb, float beta, float* c, int ldc) {
  const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
  sgemm_(&ta, &tb, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
}

struct Problem {
  int64_t batch, heads, kv_heads, length, dim, v_dim;
  const float *q1, *q2, *k1, *k2, *v, *lam;
  int64_t kv_of(int64_t bh) const { return (bh / heads) * kv_heads + (bh % heads) / (heads / kv_heads); }
};

Problem problem(const at::Tensor& q1, const at::Tensor& q2, const at::Tensor& k1, const at::Tensor& k2,
                const at::Tensor& v, const at::Tensor& lam) {
  for (const at::Tensor* t : {&q1, &q2, &k1, &k2, &v, &lam})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "diffexp_cpu: inputs must be contiguous fp32 CPU tensors");
  TORCH_CHECK(q1.dim() == 4 && k1.dim() == 4 && v.dim() == 4, "diffexp_cpu: q, k, v must be (B, heads, T, dim)");
  Problem p{q1.size(0), q1.size(1), k1.size(1), q1.size(2), q1.size(3), v.size(3),
            q1.data_ptr<float>(), q2.data_ptr<float>(), k1.data_ptr<float>(), k2.data_ptr<float>(),
            v.data_ptr<float>(), lam.data_ptr<float>()};
  TORCH_CHECK(q1.sizes() == q2.sizes() && k1.sizes() == k2.sizes(), "diffexp_cpu: the maps' shapes differ");
  TORCH_CHECK(k1.size(0) == p.batch && k1.size(2) == p.length && k1.size(3) == p.dim && v.size(0) == p.batch &&
                  v.size(1) == p.kv_heads && v.size(2) == p.length,
              "diffexp_cpu: q, k and v disagree in batch, length or dim");
  TORCH_CHECK(p.kv_heads > 0 && p.heads % p.kv_heads == 0, "diffexp_cpu: heads must be a multiple of kv heads");
  TORCH_CHECK(lam.numel() == p.batch * p.heads * p.length, "diffexp_cpu: lambda must be (B, heads, T)");
  return p;
}

// Softmax of the causal part (keys 0..valid-1) of one row of scaled logits, in place; returns its logsumexp.
float softmax_row(float* row, int valid) {
  float top = row[0];
#pragma omp simd reduction(max : top)
  for (int j = 0; j < valid; ++j) top = std::max(top, row[j]);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int j = 0; j < valid; ++j) {
    row[j] = expf(row[j] - top);
    total += row[j];
  }
  const float inv = 1.f / total;
#pragma omp simd
  for (int j = 0; j < valid; ++j) row[j] *= inv;
  return top + std::log(total);
}

// One block of query rows start..start+rows (keys 0..start+rows): both maps' scaled logits.
void block_logits(const Problem& p, int64_t bh, int start, int rows, float sc, float* map1, float* map2) {
  const int64_t T = p.length, d = p.dim, kv = p.kv_of(bh), keys = start + rows;
  gemm(false, true, rows, keys, d, sc, p.q1 + (bh * T + start) * d, d, p.k1 + kv * T * d, d, 0.f, map1, keys);
  gemm(false, true, rows, keys, d, sc, p.q2 + (bh * T + start) * d, d, p.k2 + kv * T * d, d, 0.f, map2, keys);
}

struct Grads {
  at::Tensor dq1, dq2, dk1, dk2, dv;
  float *q1, *q2, *k1, *k2, *v;
  explicit Grads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v_)
      : dq1(at::empty_like(q)), dq2(at::empty_like(q)), dk1(at::zeros_like(k)), dk2(at::zeros_like(k)),
        dv(at::zeros_like(v_)), q1(dq1.data_ptr<float>()), q2(dq2.data_ptr<float>()), k1(dk1.data_ptr<float>()),
        k2(dk2.data_ptr<float>()), v(dv.data_ptr<float>()) {}
};

// A block's products after its row pass: dV += A^T dO, dQ_m = scale dS_m K_m, dK_m += scale dS_m^T Q_m.
void block_products(const Problem& p, Grads& g, int64_t bh, int start, int rows, float sc, const float* grad,
                    const float* combined, const float* ds1, const float* ds2) {
  const int64_t T = p.length, d = p.dim, dv = p.v_dim, kv = p.kv_of(bh), keys = start + rows;
  const int64_t q_at = (bh * T + start) * d;
  gemm(true, false, keys, dv, rows, 1.f, combined, keys, grad, dv, 1.f, g.v + kv * T * dv, dv);
  gemm(false, false, rows, d, keys, sc, ds1, keys, p.k1 + kv * T * d, d, 0.f, g.q1 + q_at, d);
  gemm(false, false, rows, d, keys, sc, ds2, keys, p.k2 + kv * T * d, d, 0.f, g.q2 + q_at, d);
  gemm(true, false, keys, d, rows, sc, ds1, keys, p.q1 + q_at, d, 1.f, g.k1 + kv * T * d, d);
  gemm(true, false, keys, d, rows, sc, ds2, keys, p.q2 + q_at, d, 1.f, g.k2 + kv * T * d, d);
}

// dA = dO V^T for a block
void block_grad_map(const Problem& p, int64_t bh, int start, int rows, const float* grad, float* d_map) {
  const int64_t T = p.length, dv = p.v_dim, keys = start + rows;
  gemm(false, true, rows, keys, dv, 1.f, grad, dv, p.v + p.kv_of(bh) * T * dv, dv, 0.f, d_map, keys);
}

// Backward runs one task per kv head (its query heads add into the same dK and dV), blocks in `order`.
template <typename Body>
void for_each_kv_head(const Problem& p, const Body& body) {
  at::parallel_for(0, p.batch * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t kv = begin; kv < end; ++kv) {
      const int64_t group = p.heads / p.kv_heads, b = kv / p.kv_heads, g = kv % p.kv_heads;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) body(b * p.heads + h);
    }
  });
}

float gamma_value(const at::Tensor& gamma) {
  TORCH_CHECK(gamma.numel() == 1 && gamma.device().is_cpu(), "diffexp_cpu: gamma must be one CPU value");
  return gamma.to(at::kFloat).item<float>();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> two_map_forward(const at::Tensor& q1, const at::Tensor& q2, const at::Tensor& k1,
                                                   const at::Tensor& k2, const at::Tensor& v, const at::Tensor& lam,
                                                   double scale, int64_t block_rows) {
  const Problem p = problem(q1, q2, k1, k2, v, lam);
  const int64_t T = p.length, dv = p.v_dim, blocks = (T + block_rows - 1) / block_rows;
  at::Tensor out = at::empty({p.batch, p.heads, T, dv}, v.options());
  at::Tensor lse = at::empty({p.batch, p.heads, 2, T}, v.options());
  float *outp = out.data_ptr<float>(), *lsep = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // blocks are independent here: one task per (head, block)
  at::parallel_for(0, p.batch * p.heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(2 * block_rows * T);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks;
      const int start = (task % blocks) * block_rows, rows = std::min<int64_t>(block_rows, T - start);
      const int keys = start + rows;
      float *map1 = buffer.data(), *map2 = map1 + rows * keys;
      block_logits(p, bh, start, rows, sc, map1, map2);
      for (int r = 0; r < rows; ++r) {
        const int i = start + r, valid = i + 1;
        float *a1 = map1 + r * keys, *a2 = map2 + r * keys;
        lsep[(bh * 2) * T + i] = softmax_row(a1, valid);
        lsep[(bh * 2 + 1) * T + i] = softmax_row(a2, valid);
        const float l = p.lam[bh * T + i];
#pragma omp simd
        for (int j = 0; j < valid; ++j) a1[j] -= l * a2[j];  // A = A1 - lambda A2, over A1
        std::fill(a1 + valid, a1 + keys, 0.f);
      }
      gemm(false, false, rows, dv, keys, 1.f, map1, keys, p.v + p.kv_of(bh) * T * dv, dv, 0.f,
           outp + (bh * T + start) * dv, dv);
    }
  });
  return {out, lse};
}

// dS1 = A1 (dA - rowsum(A1 dA)), dS2 = -lambda A2 (dA - rowsum(A2 dA)), dlambda = -rowsum(A2 dA)
Tensors two_map_backward(const at::Tensor& grad_out, const at::Tensor& q1, const at::Tensor& q2, const at::Tensor& k1,
                         const at::Tensor& k2, const at::Tensor& v, const at::Tensor& lam, const at::Tensor& lse,
                         double scale, int64_t block_rows) {
  const Problem p = problem(q1, q2, k1, k2, v, lam);
  TORCH_CHECK(grad_out.is_contiguous() && grad_out.scalar_type() == at::kFloat, "diffexp_cpu: grad must be fp32");
  const int64_t T = p.length, dv = p.v_dim;
  Grads g(q1, k1, v);
  at::Tensor dlam = at::empty_like(lam);
  const float *gp = grad_out.data_ptr<float>(), *lsep = lse.data_ptr<float>();
  float* dlamp = dlam.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  for_each_kv_head(p, [&](int64_t bh) {
    std::vector<float> buffer(3 * block_rows * T);
    for (int start = 0; start < T; start += block_rows) {
      const int rows = std::min<int64_t>(block_rows, T - start), keys = start + rows;
      float *map1 = buffer.data(), *map2 = map1 + rows * keys, *d_map = map2 + rows * keys;
      const float* grad = gp + (bh * T + start) * dv;
      block_logits(p, bh, start, rows, sc, map1, map2);
      block_grad_map(p, bh, start, rows, grad, d_map);
      for (int r = 0; r < rows; ++r) {
        const int i = start + r, valid = i + 1;
        float *a1 = map1 + r * keys, *a2 = map2 + r * keys, *da = d_map + r * keys;
        const float lse1 = lsep[(bh * 2) * T + i], lse2 = lsep[(bh * 2 + 1) * T + i], l = p.lam[bh * T + i];
        float dot1 = 0.f, dot2 = 0.f;
#pragma omp simd reduction(+ : dot1, dot2)
        for (int j = 0; j < valid; ++j) {
          a1[j] = expf(a1[j] - lse1);
          a2[j] = expf(a2[j] - lse2);
          dot1 += a1[j] * da[j];
          dot2 += a2[j] * da[j];
        }
        dlamp[bh * T + i] = -dot2;
#pragma omp simd
        for (int j = 0; j < valid; ++j) {  // the combined map A replaces dA, dS_m replace A_m
          const float grad_j = da[j], e1 = a1[j], e2 = a2[j];
          da[j] = e1 - l * e2;
          a1[j] = e1 * (grad_j - dot1);
          a2[j] = -l * e2 * (grad_j - dot2);
        }
        for (float* row : {a1, a2, da}) std::fill(row + valid, row + keys, 0.f);
      }
      block_products(p, g, bh, start, rows, sc, grad, d_map, map1, map2);
    }
  });
  return {g.dq1, g.dq2, g.dk1, g.dk2, g.dv, dlam};
}

// DINT: G[n, :] = (1/n) sum_{m<=n} A1[m, :], A3[n, :] = softmax over j <= n of G[n, :]. Rows go in order within
// one task per head, carrying A1's column sums (G is in [0, 1]: exp(G) needs no max subtraction).
std::tuple<at::Tensor, at::Tensor, at::Tensor> dint_forward(const at::Tensor& q1, const at::Tensor& q2,
                                                            const at::Tensor& k1, const at::Tensor& k2,
                                                            const at::Tensor& v, const at::Tensor& lam,
                                                            const at::Tensor& gamma, double scale, int64_t block_rows) {
  const Problem p = problem(q1, q2, k1, k2, v, lam);
  const int64_t T = p.length, dv = p.v_dim;
  at::Tensor out = at::empty({p.batch, p.heads, T, dv}, v.options());
  at::Tensor lse = at::empty({p.batch, p.heads, 3, T}, v.options());
  at::Tensor col_sums = at::zeros({p.batch, p.heads, T}, v.options());
  float *outp = out.data_ptr<float>(), *lsep = lse.data_ptr<float>(), *colp = col_sums.data_ptr<float>();
  const float sc = static_cast<float>(scale), w3 = gamma_value(gamma);
  at::parallel_for(0, p.batch * p.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(2 * block_rows * T);
    for (int64_t bh = begin; bh < end; ++bh) {
      float* col = colp + bh * T;
      for (int start = 0; start < T; start += block_rows) {
        const int rows = std::min<int64_t>(block_rows, T - start), keys = start + rows;
        float *map1 = buffer.data(), *map2 = map1 + rows * keys;
        block_logits(p, bh, start, rows, sc, map1, map2);
        for (int r = 0; r < rows; ++r) {
          const int i = start + r, valid = i + 1;
          float *a1 = map1 + r * keys, *a2 = map2 + r * keys;
          lsep[(bh * 3) * T + i] = softmax_row(a1, valid);
          lsep[(bh * 3 + 1) * T + i] = softmax_row(a2, valid);
          const float l = p.lam[bh * T + i], inv_n = 1.f / valid;
          float total = 0.f;
#pragma omp simd reduction(+ : total)
          for (int j = 0; j < valid; ++j) {
            col[j] += a1[j];
            total += expf(col[j] * inv_n);
          }
          lsep[(bh * 3 + 2) * T + i] = std::log(total);
          const float w = w3 / total;
#pragma omp simd
          for (int j = 0; j < valid; ++j) a1[j] += w * expf(col[j] * inv_n) - l * a2[j];
          std::fill(a1 + valid, a1 + keys, 0.f);
        }
        gemm(false, false, rows, dv, keys, 1.f, map1, keys, p.v + p.kv_of(bh) * T * dv, dv, 0.f,
             outp + (bh * T + start) * dv, dv);
      }
    }
  });
  return {out, lse, col_sums};
}

// Rows in reverse. dA3 = gamma dA, dG = A3 (dA3 - rowsum(A3 dA3)); A1[m] feeds G[n] / n for every n >= m, so
// dA1[m] = dA[m] + carried, carried = sum_{n>=m} dG[n] / n. col: A1's column sums through row n, peeled going up.
Tensors dint_backward(const at::Tensor& grad_out, const at::Tensor& q1, const at::Tensor& q2, const at::Tensor& k1,
                      const at::Tensor& k2, const at::Tensor& v, const at::Tensor& lam, const at::Tensor& gamma,
                      const at::Tensor& lse, const at::Tensor& col_sums, double scale, int64_t block_rows) {
  const Problem p = problem(q1, q2, k1, k2, v, lam);
  TORCH_CHECK(grad_out.is_contiguous() && grad_out.scalar_type() == at::kFloat, "diffexp_cpu: grad must be fp32");
  const int64_t T = p.length, dv = p.v_dim, last_block = ((T - 1) / block_rows) * block_rows;
  Grads g(q1, k1, v);
  at::Tensor dlam = at::empty_like(lam), dgamma = at::empty_like(lam);
  const float *gp = grad_out.data_ptr<float>(), *lsep = lse.data_ptr<float>(), *colp = col_sums.data_ptr<float>();
  float *dlamp = dlam.data_ptr<float>(), *dgp = dgamma.data_ptr<float>();
  const float sc = static_cast<float>(scale), w3 = gamma_value(gamma);
  for_each_kv_head(p, [&](int64_t bh) {
    std::vector<float> buffer(3 * block_rows * T + 3 * T);
    float *col = buffer.data() + 3 * block_rows * T, *carried = col + T, *scratch = carried + T;
    std::copy(colp + bh * T, colp + (bh + 1) * T, col);
    std::fill(carried, carried + T, 0.f);
    for (int64_t start = last_block; start >= 0; start -= block_rows) {
      const int rows = std::min<int64_t>(block_rows, T - start), keys = start + rows;
      float *map1 = buffer.data(), *map2 = map1 + rows * keys, *d_map = map2 + rows * keys;
      const float* grad = gp + (bh * T + start) * dv;
      block_logits(p, bh, start, rows, sc, map1, map2);
      block_grad_map(p, bh, start, rows, grad, d_map);
      for (int r = rows - 1; r >= 0; --r) {
        const int i = start + r, valid = i + 1;
        float *a1 = map1 + r * keys, *a2 = map2 + r * keys, *da = d_map + r * keys;
        const float lse1 = lsep[(bh * 3) * T + i], lse2 = lsep[(bh * 3 + 1) * T + i];
        const float lse3 = lsep[(bh * 3 + 2) * T + i], l = p.lam[bh * T + i], inv_n = 1.f / valid;
        float dot2 = 0.f, dot3 = 0.f;
#pragma omp simd reduction(+ : dot2, dot3)
        for (int j = 0; j < valid; ++j) {
          a1[j] = expf(a1[j] - lse1);
          a2[j] = expf(a2[j] - lse2);
          scratch[j] = expf(col[j] * inv_n - lse3);  // A3
          dot2 += a2[j] * da[j];
          dot3 += scratch[j] * da[j];
        }
        dlamp[bh * T + i] = -dot2;
        dgp[bh * T + i] = dot3;
        float dot1 = 0.f;
#pragma omp simd reduction(+ : dot1)
        for (int j = 0; j < valid; ++j) {  // A replaces dA, dS2 replaces A2, dA1 goes to scratch
          const float grad_j = da[j], e1 = a1[j], e2 = a2[j], e3 = scratch[j];
          carried[j] += w3 * e3 * (grad_j - dot3) * inv_n;
          col[j] -= e1;
          scratch[j] = grad_j + carried[j];
          dot1 += e1 * scratch[j];
          da[j] = e1 - l * e2 + w3 * e3;
          a2[j] = -l * e2 * (grad_j - dot2);
        }
#pragma omp simd
        for (int j = 0; j < valid; ++j) a1[j] *= scratch[j] - dot1;
        for (float* row : {a1, a2, da}) std::fill(row + valid, row + keys, 0.f);
      }
      block_products(p, g, bh, start, rows, sc, grad, d_map, map1, map2);
    }
  });
  return {g.dq1, g.dq2, g.dk1, g.dk2, g.dv, dlam, dgamma};
}

// Schemas apart from the CPU kernels, so that torch.compile can trace the ops through their fake (shape-only)
// versions, registered in cpu_native.py, instead of running these on tensors without data.
TORCH_LIBRARY(diffexp_cpu, m) {
  m.def("two_map_forward(Tensor q1, Tensor q2, Tensor k1, Tensor k2, Tensor v, Tensor lam, float scale, "
        "int block_rows) -> (Tensor, Tensor)");
  m.def("two_map_backward(Tensor grad_out, Tensor q1, Tensor q2, Tensor k1, Tensor k2, Tensor v, Tensor lam, "
        "Tensor lse, float scale, int block_rows) -> Tensor[]");
  m.def("dint_forward(Tensor q1, Tensor q2, Tensor k1, Tensor k2, Tensor v, Tensor lam, Tensor gamma, "
        "float scale, int block_rows) -> (Tensor, Tensor, Tensor)");
  m.def("dint_backward(Tensor grad_out, Tensor q1, Tensor q2, Tensor k1, Tensor k2, Tensor v, Tensor lam, "
        "Tensor gamma, Tensor lse, Tensor col_sums, float scale, int block_rows) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(diffexp_cpu, CPU, m) {
  m.impl("two_map_forward", &two_map_forward);
  m.impl("two_map_backward", &two_map_backward);
  m.impl("dint_forward", &dint_forward);
  m.impl("dint_backward", &dint_backward);
}
