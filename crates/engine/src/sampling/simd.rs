//! The sampler's hot loops, compiled twice: for the baseline x86-64 target
//! and for AVX2 + FMA, chosen at run time. Only the vector width changes:
//! Rust never fuses a multiply and an add on its own, and every loop keeps
//! its own fixed order of operations per lane, so both builds give the same
//! bits (the draw must not depend on the machine).

/// Define `fn NAME(args) -> R { body }` that runs `body` compiled with AVX2
/// and FMA where the CPU has them, and as compiled otherwise.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn portable($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn wide($($arg: $ty),*) -> $ret {
                    portable($($arg),*)
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU has both features, checked just above.
                    return unsafe { wide($($arg),*) };
                }
            }
            portable($($arg),*)
        }
    };
}

pub(crate) use multiversion;
