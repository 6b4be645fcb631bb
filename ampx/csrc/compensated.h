// Compensated (Kahan) half-weight SGD and Adam/AdamW updates: what the CPU kernels
// (compensated.cpp, which also checks arguments and binds both) share with the CUDA
// kernels (compensated_cuda.cu).
//
// The numerics are specified by ampx/_reference_compensated.py: per element, every
// operation is one float32 operation rounded to float32 (no fused multiply-add), in the
// reference's order; the scalars below are the reference's Python floats rounded to
// float32 once (the bias/decay factors computed in double first, as the reference does).
// The kernels may assume checked lists: params/comps float16 or bfloat16 (the same),
// grads and state float32 or the parameter's dtype (both Adam moments alike), all
// contiguous, same shape, one device.
#pragma once

#include "ampx.h"

namespace ampx {

struct SgdScalars {
  float lr;
  float wd;
  float mu;
  float keep;     // 1 - dampening
  bool decay;     // weight_decay != 0
  bool momentum;  // momentum != 0 (the buffers are read and written)
  bool nesterov;
  bool maximize;
  bool first;  // the buffers are new: b = g
};

struct AdamScalars {
  float b1;
  float b2;
  float one_b1;
  float one_b2;
  float eps;
  float wd;
  float decay;  // 1 - lr * weight_decay (AdamW)
  float size;   // step_size
  float root2;  // bias2_sqrt
  bool decoupled;
  bool coupled_decay;  // !decoupled && weight_decay != 0
  bool maximize;
};

#ifdef AMPX_WITH_CUDA
void compensated_sgd_cuda(const TensorList& params, const TensorList& comps,
                          const TensorList& grads, const TensorList& bufs,
                          const SgdScalars& p);
void compensated_adam_cuda(const TensorList& params, const TensorList& comps,
                           const TensorList& grads, const TensorList& exp_avgs,
                           const TensorList& exp_avg_sqs, const AdamScalars& p);
#endif

}  // namespace ampx
