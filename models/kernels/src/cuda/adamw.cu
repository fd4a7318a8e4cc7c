// AdamW on a GPU: one pass over an f32 chunk, the host loop's arithmetic (models/kernels/src/
// adamw.rs, `chunk`) operation by operation. Compiled at run time by NVRTC with --fmad=false, so
// that no multiply and add are contracted into one rounding but the fmafs the loop (and torch's
// lerp and addcmul) has: the same IEEE operations as the CPU, the same values.
//
// The moments are updated in place; the new parameters go to `out` (a fresh chunk: the old one
// may still be read through a gathered parameter that shares it).

struct AdamW {
  long long n;
  float decay, b2, one_minus_b1, one_minus_b2, step_size, bc2_sqrt, eps, clip;
  int has_decay, has_clip;
};

extern "C" __global__ void adamw_f32(const float *param, const float *grad, float *exp_avg, float *exp_avg_sq, float *out,
                                     AdamW k) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < k.n; i += (long long)blockDim.x * gridDim.x) {
    float g = grad[i];
    if (k.has_clip) g = g * k.clip;
    float p = param[i];
    if (k.has_decay) p = p * k.decay;
    float m = exp_avg[i];
    // torch's CPU kernels: lerp and addcmul end in a fused multiply-add, addcdiv divides last.
    m = fmaf(k.one_minus_b1, g - m, m);
    float v = fmaf(k.one_minus_b2 * g, g, exp_avg_sq[i] * k.b2);
    float denom = sqrtf(v) / k.bc2_sqrt + k.eps;
    out[i] = p + (-k.step_size * m) / denom;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}
