//! The CPU kernels of fsdp-app (and its CUDA sources), over plain slices and strides: no candle
//! `Tensor` in any signature (the `ops` crate wraps them as tensor ops). Each kernel has a
//! version per [`simd::SimdLevel`] and a scalar one that the others are tested against; which
//! one runs is decided in one place, [`simd::Kernels`].
//!
//! - `simd`: the CPU's features, the switches, the table of choices;
//! - `disjoint`, `pool`: the thread pool our loops share with candle, and the one type through
//!   which its threads write one buffer;
//! - `matmul` (its packed driver `matmul::packed` with the register tiles `matmul::tiles`, and
//!   `column_split`, the two-thread split): f32 matrix products, in bf16 on AMX tiles under
//!   `matmul::with_bf16_products` (training's mixed precision);
//! - `gemv` (its row layout timed in `gemv_layout`), `half_dot`, `small_batch`: products of a few
//!   rows (decoding), f32 / f16 / bf16 weights; `quant_blocks`: products over llama.cpp's 32-value block formats;
//! - `exp`, `attend_rows`, `paged_attention`: softmax and attention over cached keys and values;
//! - `adamw`: the optimizer's update of a chunk and the gradient norm's sum of squares;
//! - `round_through`: f32 values rounded through bf16 or f16 (mixed precision's sends);
//! - `rng`: the generator of test data and initial weights; `cuda`: our `.cu` sources (their
//!   NVRTC compilation with the `cuda` feature).

pub mod adamw;
pub mod attend_rows;
pub mod cuda;
pub mod disjoint;
pub mod exp;
pub mod gemv;
pub mod gemv_layout;
pub mod half_dot;
pub mod matmul;
pub mod paged_attention;
pub mod pool;
pub mod quant_blocks;
pub mod rng;
pub mod round_through;
pub mod simd;
pub mod small_batch;
