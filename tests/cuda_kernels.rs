//! Every CUDA kernel compiles with NVRTC under the options of docs/numerics.md (no GPU needed).
//! `.ci/run` installs libnvrtc from PyPI and sets TENSORFOLD_REQUIRE_NVRTC=1, so in CI a kernel
//! that does not compile fails the build; elsewhere the test is skipped when libnvrtc is absent.

use tensorfold::backend::cuda::compile;

#[test]
fn every_kernel_compiles_for_hopper_and_ampere() {
    if !compile::nvrtc_available() {
        assert!(std::env::var("TENSORFOLD_REQUIRE_NVRTC").is_err(), "TENSORFOLD_REQUIRE_NVRTC is set but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)");
        eprintln!("skipped: libnvrtc not found (pip install nvidia-cuda-nvrtc and add its lib dir to LD_LIBRARY_PATH)");
        return;
    }
    for arch in ["sm_90", "sm_80"] {
        for src in compile::SOURCES {
            let (cubin, log) = compile::compile_with_log(src, arch, true).unwrap_or_else(|e| panic!("{e}"));
            // A CUBIN is an ELF image.
            assert_eq!(&cubin[..4], b"\x7fELF", "{} for {arch}", src.file);
            for entry in src.entries {
                assert!(log.contains(&format!("'{entry}'")), "{}: entry {entry} not compiled for {arch}", src.file);
            }
            // No kernel may spill to local memory in its decode configuration beyond a few bytes.
            for line in log.lines().filter(|l| l.contains("spill stores")) {
                let bytes: usize = line.split("bytes spill stores").next().and_then(|s| s.rsplit(',').next()).and_then(|s| s.trim().parse().ok()).unwrap_or(0);
                assert!(bytes <= 64, "{}: {line}", src.file);
            }
        }
    }
}
