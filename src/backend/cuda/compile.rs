//! Kernel sources and their compilation with NVRTC (at start, for the device's architecture,
//! cached on disk by source hash and architecture).
//!
//! Every kernel file is compiled with `common.cuh` in front of it and no CUDA headers, with
//! `--fmad=false` (no contraction of `a*b + c`: FMAs appear only where a kernel writes `fmaf`),
//! `--prec-div=true --prec-sqrt=true --ftz=false`: the arithmetic of docs/numerics.md.

use std::ffi::CString;
use std::path::PathBuf;

/// One kernel source file.
pub struct Source {
    pub file: &'static str,
    pub text: &'static str,
    /// The entry points it defines.
    pub entries: &'static [&'static str],
}

pub const COMMON: &str = include_str!("kernels/common.cuh");

/// matmul_int.cu's entry points: `quantize_rows`, then `matmul_int{bits}_s{sdt}_u{unit}_{tile}`
/// for bits 4, 8 × units 64, 32 × scale dtypes 0, 1, 2 × tiles one, small, large, in that
/// order ([`matmul_int_entry`] indexes it), then the wide prompt tile of 4-bit codes
/// `matmul_int4_s{sdt}_u{unit}_wide` for units 64, 32 × scale dtypes 0, 1, 2, then the one-token
/// gate|up products with SwiGLU `matmul_int{bits}_s{sdt}_u{unit}_one_swiglu` in the order of the
/// first, then the batched-decode tile `matmul_int{bits}_s{sdt}_u{unit}_mid` in that order too.
const MATMUL_INT_ENTRIES: [&str; 67] = [
    "quantize_rows",
    "matmul_int4_s0_u64_one",
    "matmul_int4_s0_u64_small",
    "matmul_int4_s0_u64_large",
    "matmul_int4_s1_u64_one",
    "matmul_int4_s1_u64_small",
    "matmul_int4_s1_u64_large",
    "matmul_int4_s2_u64_one",
    "matmul_int4_s2_u64_small",
    "matmul_int4_s2_u64_large",
    "matmul_int4_s0_u32_one",
    "matmul_int4_s0_u32_small",
    "matmul_int4_s0_u32_large",
    "matmul_int4_s1_u32_one",
    "matmul_int4_s1_u32_small",
    "matmul_int4_s1_u32_large",
    "matmul_int4_s2_u32_one",
    "matmul_int4_s2_u32_small",
    "matmul_int4_s2_u32_large",
    "matmul_int8_s0_u64_one",
    "matmul_int8_s0_u64_small",
    "matmul_int8_s0_u64_large",
    "matmul_int8_s1_u64_one",
    "matmul_int8_s1_u64_small",
    "matmul_int8_s1_u64_large",
    "matmul_int8_s2_u64_one",
    "matmul_int8_s2_u64_small",
    "matmul_int8_s2_u64_large",
    "matmul_int8_s0_u32_one",
    "matmul_int8_s0_u32_small",
    "matmul_int8_s0_u32_large",
    "matmul_int8_s1_u32_one",
    "matmul_int8_s1_u32_small",
    "matmul_int8_s1_u32_large",
    "matmul_int8_s2_u32_one",
    "matmul_int8_s2_u32_small",
    "matmul_int8_s2_u32_large",
    "matmul_int4_s0_u64_wide",
    "matmul_int4_s1_u64_wide",
    "matmul_int4_s2_u64_wide",
    "matmul_int4_s0_u32_wide",
    "matmul_int4_s1_u32_wide",
    "matmul_int4_s2_u32_wide",
    "matmul_int4_s0_u64_one_swiglu",
    "matmul_int4_s1_u64_one_swiglu",
    "matmul_int4_s2_u64_one_swiglu",
    "matmul_int4_s0_u32_one_swiglu",
    "matmul_int4_s1_u32_one_swiglu",
    "matmul_int4_s2_u32_one_swiglu",
    "matmul_int8_s0_u64_one_swiglu",
    "matmul_int8_s1_u64_one_swiglu",
    "matmul_int8_s2_u64_one_swiglu",
    "matmul_int8_s0_u32_one_swiglu",
    "matmul_int8_s1_u32_one_swiglu",
    "matmul_int8_s2_u32_one_swiglu",
    "matmul_int4_s0_u64_mid",
    "matmul_int4_s1_u64_mid",
    "matmul_int4_s2_u64_mid",
    "matmul_int4_s0_u32_mid",
    "matmul_int4_s1_u32_mid",
    "matmul_int4_s2_u32_mid",
    "matmul_int8_s0_u64_mid",
    "matmul_int8_s1_u64_mid",
    "matmul_int8_s2_u64_mid",
    "matmul_int8_s0_u32_mid",
    "matmul_int8_s1_u32_mid",
    "matmul_int8_s2_u32_mid",
];

/// The `matmul_int` kernel for `bits` (4, 8), scale dtype `sdt` (0 f32, 1 f16, 2 bf16), unit
/// length `unit` (64, 32) and tile `tile` (0 one, 1 small, 2 large, 3 wide: 4-bit codes only,
/// 4 one token with SwiGLU, 5 mid: 32 rows × 16 tokens).
pub fn matmul_int_entry(bits: u32, sdt: u32, unit: u32, tile: usize) -> &'static str {
    if tile == 5 {
        return MATMUL_INT_ENTRIES[55 + (usize::from(bits == 8) * 2 + usize::from(unit == 32)) * 3 + sdt as usize];
    }
    if tile == 4 {
        return MATMUL_INT_ENTRIES[43 + (usize::from(bits == 8) * 2 + usize::from(unit == 32)) * 3 + sdt as usize];
    }
    if tile == 3 {
        assert_eq!(bits, 4, "the wide integer tile is for 4-bit codes");
        return MATMUL_INT_ENTRIES[37 + usize::from(unit == 32) * 3 + sdt as usize];
    }
    let i = ((usize::from(bits == 8) * 2 + usize::from(unit == 32)) * 3 + sdt as usize) * 3 + tile;
    MATMUL_INT_ENTRIES[1 + i]
}

/// Every kernel file, with the entry points the backend loads from it.
pub const SOURCES: &[Source] = &[
    Source { file: "embed.cu", text: include_str!("kernels/embed.cu"), entries: &["embed_rows"] },
    Source { file: "rms_norm.cu", text: include_str!("kernels/rms_norm.cu"), entries: &["rms_norm_rows"] },
    Source {
        file: "matmul.cu",
        text: include_str!("kernels/matmul.cu"),
        entries: &[
            "matmul_t1r1",
            "matmul_t1r2",
            "matmul_t1s",
            "matmul_t4r2",
            "matmul_t8r4",
            "matmul_swiglu_t1",
            "matmul_swiglu_t4",
            "matmul_swiglu_t8",
            "matmul_experts_t1r2",
            "matmul_experts_t4r2",
            "matmul_experts_t8r4",
        ],
    },
    Source { file: "matmul_int.cu", text: include_str!("kernels/matmul_int.cu"), entries: &MATMUL_INT_ENTRIES },
    Source { file: "moe.cu", text: include_str!("kernels/moe.cu"), entries: &["moe_route", "moe_plan", "moe_combine"] },
    Source { file: "swiglu.cu", text: include_str!("kernels/swiglu.cu"), entries: &["swiglu"] },
    Source { file: "gather_rows.cu", text: include_str!("kernels/gather_rows.cu"), entries: &["gather_rows"] },
    Source { file: "gdn_conv.cu", text: include_str!("kernels/gdn_conv.cu"), entries: &["gdn_conv"] },
    Source { file: "gdn_heads.cu", text: include_str!("kernels/gdn_heads.cu"), entries: &["gdn_heads"] },
    Source { file: "gdn_prompt.cu", text: include_str!("kernels/gdn_prompt.cu"), entries: &["gdn_prep", "gdn_scan", "gdn_out"] },
    Source { file: "attention_kv.cu", text: include_str!("kernels/attention_kv.cu"), entries: &["attn_write_kv"] },
    Source { file: "attention_scores.cu", text: include_str!("kernels/attention_scores.cu"), entries: &["attn_scores"] },
    Source { file: "attention_tiles.cu", text: include_str!("kernels/attention_tiles.cu"), entries: &["attn_tiles"] },
    Source { file: "attention_combine.cu", text: include_str!("kernels/attention_combine.cu"), entries: &["attn_combine"] },
    Source { file: "argmax.cu", text: include_str!("kernels/argmax.cu"), entries: &["argmax_part", "argmax_rows"] },
    Source { file: "sample.cu", text: include_str!("kernels/sample.cu"), entries: &["sample_rows"] },
    Source { file: "machine.cu", text: include_str!("kernels/machine.cu"), entries: &["fma_peak", "chain_link"] },
    Source { file: "numerics_check.cu", text: include_str!("kernels/numerics_check.cu"), entries: &["numerics_check"] },
];

/// The options of docs/numerics.md §1, for `arch` (e.g. `sm_90`), then the `-D` definitions of
/// `TENSORFOLD_CUDA_DEFINES` (`NAME=VALUE` separated by spaces or commas): a tuning knob for kernel constants
/// that change scheduling, never arithmetic (e.g. `T1_U1=8`, matmul.cu).
pub fn options(arch: &str) -> Vec<String> {
    let mut o = vec![format!("--gpu-architecture={arch}"), "--fmad=false".into(), "--prec-div=true".into(), "--prec-sqrt=true".into(), "--ftz=false".into(), "--std=c++17".into()];
    if let Ok(defs) = std::env::var("TENSORFOLD_CUDA_DEFINES") {
        o.extend(defs.split(|c: char| c.is_whitespace() || c == ',').filter(|d| !d.is_empty()).map(|d| format!("-D{d}")));
    }
    o
}

/// Whether libnvrtc can be loaded (without it nothing compiles; the CPU backend still runs).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), String> {
    let (mut a, mut b) = (0, 0);
    // SAFETY: plain out-parameters.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcVersion failed: {r:?}"));
    }
    Ok((a, b))
}

/// FNV-1a over the bytes: a stable key for the on-disk cache (not a security boundary).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TENSORFOLD_CACHE") {
        return Some(PathBuf::from(p).join("kernels"));
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(p).join("tensorfold/kernels"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/tensorfold/kernels"))
}

/// Compiles one kernel file to a CUBIN for `arch`, or returns NVRTC's log.
pub fn compile(src: &Source, arch: &str) -> Result<Vec<u8>, String> {
    compile_with_log(src, arch, false).map(|(c, _)| c)
}

/// [`compile`], also returning NVRTC's log; `resources` adds ptxas's register and spill report.
pub fn compile_with_log(src: &Source, arch: &str, resources: bool) -> Result<(Vec<u8>, String), String> {
    use cudarc::nvrtc::{result, sys};
    let text = format!("{COMMON}\n// ---- {} ----\n{}", src.file, src.text);
    let csrc = CString::new(text).map_err(|e| e.to_string())?;
    let name = CString::new(src.file).unwrap();
    let prog = result::create_program(&csrc, Some(&name)).map_err(|e| format!("{}: nvrtcCreateProgram: {e:?}", src.file))?;
    let mut opts = options(arch);
    if resources {
        opts.push("--ptxas-options=-v".into());
    }
    // SAFETY: `prog` is a live program; options are plain strings.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    let log = unsafe { result::get_program_log(prog) }
        .map(|l| {
            let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default();
    if compiled.is_err() {
        // SAFETY: destroying the program we created.
        let _ = unsafe { result::destroy_program(prog) };
        return Err(format!("{} failed to compile for {arch}:\n{log}", src.file));
    }
    let mut size = 0usize;
    // SAFETY: the program compiled; NVRTC writes the size, then the image into our buffer.
    let cubin = unsafe {
        let r = sys::nvrtcGetCUBINSize(prog, &mut size);
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            let _ = result::destroy_program(prog);
            return Err(format!("{}: nvrtcGetCUBINSize: {r:?}", src.file));
        }
        let mut buf = vec![0u8; size];
        let r = sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut _);
        let _ = result::destroy_program(prog);
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(format!("{}: nvrtcGetCUBIN: {r:?}", src.file));
        }
        buf
    };
    Ok((cubin, log))
}

/// [`compile`] through the on-disk cache, keyed by the source, the options, the NVRTC version
/// and the architecture. A cache that cannot be written is not an error.
pub fn compile_cached(src: &Source, arch: &str) -> Result<Vec<u8>, String> {
    let ver = nvrtc_version().unwrap_or((0, 0));
    let opts = options(arch).join(" ");
    let key = fnv1a(&[COMMON.as_bytes(), src.text.as_bytes(), opts.as_bytes(), format!("{ver:?}").as_bytes()]);
    let path = cache_dir().map(|d| d.join(format!("{}-{arch}-{key:016x}.cubin", src.file.trim_end_matches(".cu"))));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            return Ok(bytes);
        }
    }
    let cubin = compile(src, arch)?;
    if let Some(p) = &path {
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
            let tmp = p.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, &cubin).is_ok() {
                let _ = std::fs::rename(&tmp, p);
            }
        }
    }
    Ok(cubin)
}

#[cfg(test)]
mod tests {
    use super::matmul_int_entry;

    #[test]
    fn matmul_int_entry_names_the_kernel_of_every_format_and_tile() {
        for bits in [4, 8] {
            for sdt in 0..3 {
                for unit in [64, 32] {
                    for (tile, name) in ["one", "small", "large", "wide", "one_swiglu", "mid"].iter().enumerate() {
                        if tile == 3 && bits == 8 {
                            continue;
                        }
                        assert_eq!(matmul_int_entry(bits, sdt, unit, tile), format!("matmul_int{bits}_s{sdt}_u{unit}_{name}"));
                    }
                }
            }
        }
    }
}
