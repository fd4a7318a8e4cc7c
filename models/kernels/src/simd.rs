//! Where a CPU kernel is chosen: the processor's features are read once, the switches are read
//! once, and [`Kernels`] is the one table every kernel consults. Nothing else in the workspace
//! reads CPUID or these variables.
//!
//! - [`SimdLevel`]: the vector code the element-wise kernels, dot products, exp, quantised blocks
//!   and attention run (AVX-512, AVX2 or plain code). A level is available only when the CPU has
//!   every feature its kernels enable, not only the one that names it.
//! - int8 block products ([`Kernels::int8_at`]): the AVX-512 VNNI kernel where the CPU has it, else
//!   AVX-VNNI's 256-bit `vpdpbusd` (Intel's client cores, Zen 5), else AVX2's `vpmaddubsw`;
//! - bf16 weights' products of many rows ([`Kernels::amx_bf16`]): AMX tiles where the CPU has
//!   AMX-BF16 and Linux grants this process the tile state, else widened to f32;
//! - [`MatmulKernels`]: who runs f32 matrix products at AVX-512, our packed driver or the gemm
//!   crate's kernels. Chosen by a measurement, not by the vendor: on CPUs that execute a 512-bit
//!   FMA as two 256-bit halves (Zen 4) gemm's wider tile gains nothing and our packed driver, which
//!   reads both operands packed, wins; where a 512-bit FMA does twice a 256-bit one's work
//!   (Intel's server cores with two 512-bit units) gemm's kernels win. See docs/design.md.
//!
//! Switches, validated by [`check_env`] (the binary calls it before any work):
//! - `FSDP_SIMD=best|avx512|avx2-vnni|avx2|scalar`: at most this level (never one the CPU lacks;
//!   `best` is the CPU's own, `avx512` the same without AMX tiles, as a Zen 4 runs), so tests
//!   and benches can run every path on one machine. `avx2` is an AVX2-only CPU's code
//!   (Zen 3: no int8 dot instruction); `avx2-vnni` is the AVX2 level with AVX-VNNI where the CPU
//!   has it (an AVX2 CPU with VNNI, such as Intel's client cores);
//! - `FSDP_MATMUL=gemm|packed`: products on gemm's kernels, or on the packed driver at AVX-512 too;
//! - `FSDP_K_BLOCKS=ours|candle`: K-format weights (Q4_K, Q5_K, Q6_K) on our int8 block kernels
//!   or on candle's ([`Kernels::k_blocks_ours`]), so that the two can be compared in a model.

use std::sync::OnceLock;

/// A vector instruction level; every kernel has a version for each (the scalar one is the
/// reference the others are tested against).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    Scalar,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// AVX-512 F with AVX2, FMA and F16C (the AVX-512 kernels use all four).
    Avx512,
}

/// The features of this CPU that our kernels use, read once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuFeatures {
    pub avx2: bool,
    pub fma: bool,
    pub f16c: bool,
    pub avx512f: bool,
    /// AVX512-VNNI with AVX512-BW and VL: the AVX-512 kernel of the int8 block products.
    pub avx512vnni: bool,
    /// AVX-VNNI (the VEX-encoded 256-bit `vpdpbusd`): the int8 instruction of the AVX2 kernel.
    pub avxvnni: bool,
    /// AMX-TILE and AMX-BF16, with the OS's grant of the tile state to this process: bf16
    /// weights' products of many rows.
    pub amx_bf16: bool,
}

impl CpuFeatures {
    /// This CPU's features (std's detection: CPUID and the OS's saved-state support).
    pub fn detected() -> Self {
        static FEATURES: OnceLock<CpuFeatures> = OnceLock::new();
        *FEATURES.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                Self {
                    avx2: is_x86_feature_detected!("avx2"),
                    fma: is_x86_feature_detected!("fma"),
                    f16c: is_x86_feature_detected!("f16c"),
                    avx512f: is_x86_feature_detected!("avx512f"),
                    avx512vnni: is_x86_feature_detected!("avx512vnni")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512bw"),
                    avxvnni: is_x86_feature_detected!("avxvnni"),
                    amx_bf16: amx::bf16_granted(),
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Self::default()
        })
    }

    /// The highest level whose kernels' features are all present.
    pub fn best_level(&self) -> SimdLevel {
        let avx2 = self.avx2 && self.fma && self.f16c;
        match (avx2, self.avx512f) {
            (true, true) => SimdLevel::Avx512,
            (true, false) => SimdLevel::Avx2,
            _ => SimdLevel::Scalar,
        }
    }
}

/// The kernel of the int8 block products (`quant_blocks`): all three give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Kernel {
    /// 8 rows a register, bytes summed by `vpmaddubsw` + `vpmaddwd` (AVX2, FMA, F16C).
    Avx2,
    /// 8 rows a register, bytes summed by the 256-bit `vpdpbusd` (AVX2's features and AVX-VNNI).
    AvxVnni,
    /// 16 rows a register, bytes summed by `vpdpbusd` (AVX-512 F, BW, VL and VNNI).
    Avx512Vnni,
}

impl Int8Kernel {
    /// The kernels this CPU can run (whatever the switches say), for tests that compare them.
    pub fn runnable() -> Vec<Self> {
        let f = CpuFeatures::detected();
        let avx2 = f.best_level() >= SimdLevel::Avx2;
        [(Self::Avx2, avx2), (Self::AvxVnni, avx2 && f.avxvnni), (Self::Avx512Vnni, f.best_level() == SimdLevel::Avx512 && f.avx512vnni)]
            .into_iter()
            .filter_map(|(k, ok)| ok.then_some(k))
            .collect()
    }
}

/// Who runs f32 matrix products at AVX-512 (below it, the packed driver at AVX2 and gemm's
/// scalar kernels are the only choices).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulKernels {
    /// The gemm crate's kernels of the level.
    Gemm,
    /// Our packed driver's register tile of the level (`matmul::packed`).
    Packed,
}

/// The kernel choices of this process: one value, made once from the CPU's features, one
/// measurement and the switches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    pub features: CpuFeatures,
    /// The level every kernel runs at.
    pub level: SimdLevel,
    /// Whether the AVX2 level may use AVX-VNNI (the CPU has it and no switch held the code to
    /// plain AVX2).
    avxvnni: bool,
    /// Whether bf16 products may run on AMX tiles (the CPU and the OS allow them, the level is
    /// AVX-512, which the activations' packing uses, and no switch held the code below `best`).
    amx_bf16: bool,
    /// `FSDP_MATMUL`'s choice, for every level.
    matmul_switch: Option<MatmulKernels>,
    /// Who runs f32 products at AVX-512 when no switch says: the measurement's choice.
    matmul_avx512: MatmulKernels,
    /// `FSDP_K_BLOCKS`'s choice: K-format weights on our block kernels (true) or candle's.
    k_blocks_switch: Option<bool>,
}

/// The switches' variables and the values each takes, for errors and docs.
pub const SWITCHES: [(&str, &str); 3] = [
    ("FSDP_SIMD", "`best`, `avx512`, `avx2-vnni`, `avx2` or `scalar`"),
    ("FSDP_MATMUL", "`gemm` or `packed`"),
    ("FSDP_K_BLOCKS", "`ours` or `candle`"),
];

impl Kernels {
    /// The table of this process (the switches read from the environment once).
    ///
    /// # Panics
    /// When a switch holds a value it does not take; [`check_env`] reports that as an error
    /// before any kernel runs.
    pub fn get() -> &'static Kernels {
        match table() {
            Ok(k) => k,
            Err(e) => panic!("{e}"),
        }
    }

    /// The table for `features` and the switches' values (`None`: unset).
    pub fn choose(
        features: CpuFeatures,
        simd: Option<&str>,
        matmul: Option<&str>,
        k_blocks: Option<&str>,
        wide_fma: impl FnOnce() -> bool,
    ) -> Result<Self, String> {
        let best = features.best_level();
        let (level, avxvnni, amx) = match simd {
            None | Some("best") => (best, true, true),
            Some("avx512") => (best, true, false),
            Some("avx2-vnni") => (best.min(SimdLevel::Avx2), true, false),
            Some("avx2") => (best.min(SimdLevel::Avx2), false, false),
            Some("scalar") => (SimdLevel::Scalar, false, false),
            Some(v) => return Err(invalid("FSDP_SIMD", v)),
        };
        let avxvnni = avxvnni && features.avxvnni;
        let amx_bf16 = amx && features.amx_bf16 && level == SimdLevel::Avx512;
        let matmul_switch = match matmul {
            None => None,
            Some("gemm") => Some(MatmulKernels::Gemm),
            Some("packed") => Some(MatmulKernels::Packed),
            Some(v) => return Err(invalid("FSDP_MATMUL", v)),
        };
        let k_blocks_switch = match k_blocks {
            None => None,
            Some("ours") => Some(true),
            Some("candle") => Some(false),
            Some(v) => return Err(invalid("FSDP_K_BLOCKS", v)),
        };
        // The measurement only matters (and only runs) where products may run at AVX-512.
        let measure = matmul_switch.is_none() && best == SimdLevel::Avx512;
        let matmul_avx512 = if measure && !wide_fma() { MatmulKernels::Packed } else { MatmulKernels::Gemm };
        Ok(Self { features, level, avxvnni, amx_bf16, matmul_switch, matmul_avx512, k_blocks_switch })
    }

    /// Who runs f32 products at `level` (the current one, or a lower one a test asks for): a
    /// switch's choice; else at AVX2 the packed driver (faster on every CPU measured), at
    /// AVX-512 the measurement's choice, and gemm's kernels at the scalar level (the packed
    /// driver has no scalar tile).
    pub fn matmul_at(&self, level: SimdLevel) -> MatmulKernels {
        match (self.matmul_switch, level) {
            (Some(choice), _) => choice,
            (None, SimdLevel::Avx2) => MatmulKernels::Packed,
            (None, SimdLevel::Avx512) => self.matmul_avx512,
            (None, SimdLevel::Scalar) => MatmulKernels::Gemm,
        }
    }

    /// The kernel of int8 block products at `level` (at least AVX2; lower than the table's, or
    /// the table's own): the AVX-512 one at the AVX-512 level on CPUs with AVX512-VNNI, BW and
    /// VL; else the AVX2 one, with AVX-VNNI's `vpdpbusd` where the CPU has it and no switch
    /// held the code to plain AVX2. Never one the CPU cannot run.
    pub fn int8_at(&self, level: SimdLevel) -> Int8Kernel {
        if level.min(self.level) == SimdLevel::Avx512 && self.features.avx512vnni {
            Int8Kernel::Avx512Vnni
        } else if self.avxvnni {
            Int8Kernel::AvxVnni
        } else {
            Int8Kernel::Avx2
        }
    }

    /// Whether K-format weights (Q4_K, Q5_K, Q6_K) run on our int8 block kernels at `level`
    /// rather than on candle's: `FSDP_K_BLOCKS`'s choice; else where the int8 kernel there is
    /// AVX2's `vpmaddubsw`, on which ours decode and prefill faster (docs/benchmarks.md, Zen 3).
    /// Where the CPU has VNNI, candle's repacked K tiles use it as ours do, and candle keeps
    /// them until the two are measured side by side there.
    pub fn k_blocks_ours(&self, level: SimdLevel) -> bool {
        self.k_blocks_switch.unwrap_or(self.int8_at(level) == Int8Kernel::Avx2)
    }

    /// Who runs an f32 product whose lhs has `lhs_rows` rows at `level`: [`Self::matmul_at`],
    /// except that where the measurement gave AVX-512 products to gemm, short ones (a short
    /// prompt's or a decode batch's few rows) still run on the packed driver: gemm's per-call
    /// work outweighs its kernels there (a 46-token SmolLM2 prefill ran 1.4x faster packed on
    /// the AVX-512 Xeon, where a training step's products are even).
    pub fn matmul_for(&self, level: SimdLevel, lhs_rows: usize) -> MatmulKernels {
        match (self.matmul_switch, self.matmul_at(level)) {
            (None, MatmulKernels::Gemm) if level == SimdLevel::Avx512 && lhs_rows < PACKED_BELOW_ROWS => MatmulKernels::Packed,
            (_, choice) => choice,
        }
    }

    /// Who runs f32 products at the level in use.
    pub fn matmul(&self) -> MatmulKernels {
        self.matmul_at(self.level)
    }

    /// Whether bf16 weights' products of many rows run on AMX tiles (`matmul::amx_bf16`).
    pub fn amx_bf16(&self) -> bool {
        self.amx_bf16
    }
}

/// Lhs rows below which [`Kernels::matmul_for`] keeps products on the packed driver.
pub(crate) const PACKED_BELOW_ROWS: usize = 128;

fn invalid(var: &str, value: &str) -> String {
    let takes = SWITCHES.iter().find(|(v, _)| *v == var).map_or("", |(_, t)| t);
    format!("{var}={value:?}: expected {takes} (or unset)")
}

fn table() -> &'static Result<Kernels, String> {
    static TABLE: OnceLock<Result<Kernels, String>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let read = |var: &str| std::env::var(var).ok();
        let (simd, matmul, k_blocks) = (read("FSDP_SIMD"), read("FSDP_MATMUL"), read("FSDP_K_BLOCKS"));
        Kernels::choose(CpuFeatures::detected(), simd.as_deref(), matmul.as_deref(), k_blocks.as_deref(), wide_fma::measured)
    })
}

/// Whether the switches hold values they take: for the binary to refuse a bad one, naming the
/// variable and its values, before it starts work.
pub fn check_env() -> Result<(), String> {
    table().as_ref().map(|_| ()).map_err(Clone::clone)
}

impl SimdLevel {
    /// The best level this CPU has (whatever the switches say), found once.
    #[inline]
    pub fn detected() -> Self {
        static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
        *LEVEL.get_or_init(|| CpuFeatures::detected().best_level())
    }

    /// This level where the CPU has it, else the best it has: what a kernel given a level as an
    /// argument dispatches on, so that no argument can make it run instructions the CPU lacks.
    /// Inlined: decoding's row kernels ask it for every few weight rows.
    #[inline]
    pub fn usable(self) -> Self {
        self.min(Self::detected())
    }

    /// The level in use ([`Kernels::get`]).
    pub fn current() -> Self {
        Kernels::get().level
    }
}

/// AMX: whether this CPU has the bf16 tiles and this process may use them.
mod amx {
    /// AMX-TILE and AMX-BF16 in CPUID (leaf 7: EDX bits 24 and 22), and Linux's grant of the tile
    /// data state to this process (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, which Linux requires before
    /// the first tile instruction; without it that instruction faults). Elsewhere the tiles stay
    /// unused.
    pub fn bf16_granted() -> bool {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
            if leaf7.edx & (1 << 24) == 0 || leaf7.edx & (1 << 22) == 0 {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: the call only asks for a permission; it reads and writes no memory of ours.
            unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    }
}

/// The one measurement behind the choice of matrix kernels: how much work a 512-bit FMA does
/// beside a 256-bit one on this core.
mod wide_fma {
    /// Whether 512-bit FMAs run at least 1.5x the flops of 256-bit ones here (two full-width
    /// units), from a few short timed loops (~0.5 ms in all).
    pub fn measured() -> bool {
        #[cfg(target_arch = "x86_64")]
        if super::CpuFeatures::detected().best_level() == super::SimdLevel::Avx512 {
            // The best of several runs each, interleaved: a shared core's noise only slows a run.
            let (mut narrow, mut wide) = (f64::MAX, f64::MAX);
            for _ in 0..5 {
                // SAFETY: the CPU has AVX-512 F, AVX2 and FMA (the level says so).
                narrow = narrow.min(time(|| unsafe { x86::chains_256(ITERS) }));
                wide = wide.min(time(|| unsafe { x86::chains_512(ITERS) }));
            }
            // A 512-bit FMA does twice the flops: per flop, wide / 2 against narrow.
            return narrow / (wide / 2.0) >= 1.5;
        }
        false
    }

    #[cfg(target_arch = "x86_64")]
    const ITERS: usize = 4096;

    #[cfg(target_arch = "x86_64")]
    fn time(f: impl Fn() -> f32) -> f64 {
        let start = std::time::Instant::now();
        std::hint::black_box(f());
        start.elapsed().as_secs_f64()
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use std::arch::x86_64::*;

        /// 12 independent FMA chains (enough to fill two units of 4-cycle latency).
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn chains_256(iters: usize) -> f32 {
            let (m, a) = (_mm256_set1_ps(0.999_9), _mm256_set1_ps(1e-4));
            let mut acc = [_mm256_set1_ps(1.0); 12];
            for _ in 0..iters {
                for r in acc.iter_mut() {
                    *r = _mm256_fmadd_ps(*r, m, a);
                }
            }
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc.iter().fold(_mm256_setzero_ps(), |s, r| _mm256_add_ps(s, *r)));
            lanes.iter().sum()
        }

        /// [`chains_256`] on 512-bit registers.
        #[target_feature(enable = "avx512f,avx2,fma")]
        pub unsafe fn chains_512(iters: usize) -> f32 {
            let (m, a) = (_mm512_set1_ps(0.999_9), _mm512_set1_ps(1e-4));
            let mut acc = [_mm512_set1_ps(1.0); 12];
            for _ in 0..iters {
                for r in acc.iter_mut() {
                    *r = _mm512_fmadd_ps(*r, m, a);
                }
            }
            _mm512_reduce_add_ps(acc.iter().fold(_mm512_setzero_ps(), |s, r| _mm512_add_ps(s, *r)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: CpuFeatures =
        CpuFeatures { avx2: true, fma: true, f16c: true, avx512f: true, avx512vnni: true, avxvnni: true, amx_bf16: true };

    /// A level needs every feature its kernels enable.
    #[test]
    fn a_level_needs_every_feature_of_its_kernels() {
        assert_eq!(ALL.best_level(), SimdLevel::Avx512);
        assert_eq!(CpuFeatures { avx512f: false, ..ALL }.best_level(), SimdLevel::Avx2);
        assert_eq!(CpuFeatures { f16c: false, ..ALL }.best_level(), SimdLevel::Scalar);
        assert_eq!(CpuFeatures { fma: false, avx512f: false, ..ALL }.best_level(), SimdLevel::Scalar);
        assert_eq!(CpuFeatures::default().best_level(), SimdLevel::Scalar);
    }

    /// The switches lower the level, never raise it; matrix kernels follow the measurement
    /// unless a switch names them; a bad value is an error naming the variable and its values.
    #[test]
    fn the_table_follows_features_measurement_and_switches() {
        let pick = |f: CpuFeatures, simd, matmul, wide| Kernels::choose(f, simd, matmul, None, || wide).map(|k| (k.level, k.matmul()));
        use MatmulKernels::*;
        use SimdLevel::*;
        assert_eq!(pick(ALL, None, None, true), Ok((Avx512, Gemm)));
        assert_eq!(pick(ALL, None, None, false), Ok((Avx512, Packed)));
        assert_eq!(pick(ALL, Some("avx2"), None, true), Ok((Avx2, Packed)));
        assert_eq!(pick(ALL, Some("scalar"), None, false), Ok((Scalar, Gemm)));
        assert_eq!(pick(ALL, None, Some("packed"), true), Ok((Avx512, Packed)));
        assert_eq!(pick(ALL, None, Some("gemm"), false), Ok((Avx512, Gemm)));
        // A lower level asked for by a test follows that level's default.
        let k = Kernels::choose(ALL, None, None, None, || true).unwrap();
        assert_eq!((k.matmul_at(Avx2), k.matmul_at(Scalar)), (Packed, Gemm));
        let avx2_only = CpuFeatures { avx512f: false, ..ALL };
        assert_eq!(pick(avx2_only, Some("avx512"), None, true), Ok((Avx2, Packed)));
        // Short products run packed where the measurement gave AVX-512 to gemm, unless switched.
        assert_eq!((k.matmul_for(Avx512, 46), k.matmul_for(Avx512, 512), k.matmul_for(Avx2, 46)), (Packed, Gemm, Packed));
        let switched = Kernels::choose(ALL, None, Some("gemm"), None, || true).unwrap();
        assert_eq!(switched.matmul_for(Avx512, 46), Gemm);
        // AVX-512 VNNI only at the AVX-512 level and where the CPU has it; AVX-VNNI below it,
        // unless FSDP_SIMD=avx2 holds the code to an AVX2-only CPU's.
        use Int8Kernel::{Avx512Vnni, AvxVnni};
        assert_eq!((k.int8_at(Avx512), k.int8_at(Avx2)), (Avx512Vnni, AvxVnni));
        let int8 = |f: CpuFeatures, simd: Option<&str>| Kernels::choose(f, simd, None, None, || true).unwrap().int8_at(Avx512);
        assert_eq!(int8(CpuFeatures { avx512vnni: false, ..ALL }, None), AvxVnni);
        assert_eq!(int8(CpuFeatures { avx512vnni: false, avxvnni: false, ..ALL }, None), Int8Kernel::Avx2);
        assert_eq!(int8(ALL, Some("avx2-vnni")), AvxVnni);
        assert_eq!(int8(ALL, Some("avx2")), Int8Kernel::Avx2);
        assert_eq!(int8(CpuFeatures { avxvnni: false, ..ALL }, Some("avx2-vnni")), Int8Kernel::Avx2);
        assert_eq!(pick(ALL, Some("avx2-vnni"), None, true), Ok((Avx2, Packed)));
        // AMX tiles for bf16 only where the CPU (and OS) has them, and never under a switch
        // below `best` (`avx512` is a Zen 4's code).
        let amx = |f: CpuFeatures, simd: Option<&str>| Kernels::choose(f, simd, None, None, || true).unwrap().amx_bf16();
        assert!(amx(ALL, None) && amx(ALL, Some("best")));
        assert!(!amx(ALL, Some("avx512")) && !amx(ALL, Some("avx2")) && !amx(CpuFeatures { amx_bf16: false, ..ALL }, None));
        assert!(!amx(CpuFeatures { avx512f: false, ..ALL }, None));
        let e = pick(ALL, Some("avx-512"), None, true).unwrap_err();
        assert!(e.contains("FSDP_SIMD=\"avx-512\"") && e.contains("`best`, `avx512`, `avx2-vnni`, `avx2` or `scalar`"), "{e}");
        assert_eq!(pick(ALL, Some("best"), None, true), Ok((Avx512, Gemm)));
        let e = pick(ALL, None, Some("blas"), true).unwrap_err();
        assert!(e.contains("FSDP_MATMUL=\"blas\"") && e.contains("`gemm` or `packed`"), "{e}");
        // K-format weights on our kernels where the int8 kernel is AVX2's, else on candle's,
        // unless FSDP_K_BLOCKS says.
        let k_blocks = |f: CpuFeatures, simd: Option<&str>, switch: Option<&str>| {
            Kernels::choose(f, simd, None, switch, || true).map(|k| (k.k_blocks_ours(Avx512), k.k_blocks_ours(Avx2)))
        };
        assert_eq!(k_blocks(ALL, None, None), Ok((false, false)));
        assert_eq!(k_blocks(ALL, Some("avx2"), None), Ok((true, true)));
        assert_eq!(k_blocks(CpuFeatures { avx512vnni: false, ..ALL }, None, None), Ok((false, false)));
        assert_eq!(k_blocks(CpuFeatures { avx512vnni: false, avxvnni: false, ..ALL }, None, None), Ok((true, true)));
        assert_eq!(k_blocks(ALL, None, Some("ours")), Ok((true, true)));
        assert_eq!(k_blocks(ALL, Some("avx2"), Some("candle")), Ok((false, false)));
        let e = k_blocks(ALL, None, Some("ggml")).unwrap_err();
        assert!(e.contains("FSDP_K_BLOCKS=\"ggml\"") && e.contains("`ours` or `candle`"), "{e}");
    }

    /// The measurement runs on this CPU and gives an answer in well under a millisecond's loops.
    #[test]
    fn the_fma_width_measurement_runs() {
        let start = std::time::Instant::now();
        let wide = wide_fma::measured();
        assert!(start.elapsed().as_millis() < 500, "took {:?}", start.elapsed());
        if SimdLevel::detected() < SimdLevel::Avx512 {
            assert!(!wide);
        }
    }
}
