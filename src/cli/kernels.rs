//! `tensorfold kernels --check`: compile every CUDA kernel with NVRTC, no GPU needed.

use anyhow::{bail, Result};
use clap::Args;
use tensorfold::backend::cuda::compile;

#[derive(Args, Debug)]
pub struct KernelsArgs {
    /// Compile every kernel and report errors (needs libnvrtc, not a GPU).
    #[arg(long)]
    pub check: bool,
    /// Print ptxas's registers, shared memory and spills per kernel.
    #[arg(long)]
    pub resources: bool,
    /// Go through the on-disk cache the GPU backend reads at start (`TENSORFOLD_CACHE`, else the
    /// user cache directory): a kernel already there is not compiled again, the others are
    /// stored, so that a machine with the same NVRTC version starts without compiling.
    #[arg(long, conflicts_with = "resources")]
    pub cache: bool,
    /// Target architectures.
    #[arg(long, value_delimiter = ',', default_value = "sm_90,sm_80")]
    pub arch: Vec<String>,
}

pub fn kernels(a: KernelsArgs) -> Result<()> {
    if !compile::nvrtc_available() {
        bail!("libnvrtc was not found (install the CUDA toolkit or `pip install nvidia-cuda-nvrtc` and put its lib directory on LD_LIBRARY_PATH)");
    }
    let (maj, min) = compile::nvrtc_version().map_err(anyhow::Error::msg)?;
    println!("NVRTC {maj}.{min}; options: {}", compile::options("<arch>").join(" "));
    let mut failed = 0;
    for arch in &a.arch {
        for src in compile::SOURCES {
            let compiled = if a.cache { compile::compile_cached(src, arch).map(|c| (c, String::new())) } else { compile::compile_with_log(src, arch, a.resources) };
            match compiled {
                Ok((cubin, log)) => {
                    println!("ok    {arch} {:<22} {:>7} bytes  {}", src.file, cubin.len(), src.entries.join(", "));
                    if a.resources {
                        for line in log.lines().filter(|l| l.contains("Used") || l.contains("spill") || l.contains("Compiling entry")) {
                            println!("      {}", line.trim());
                        }
                    }
                }
                Err(log) => {
                    failed += 1;
                    println!("FAIL  {arch} {}\n{log}", src.file);
                }
            }
        }
    }
    if failed > 0 {
        bail!("{failed} kernel compilation(s) failed");
    }
    if !a.check {
        println!("(every kernel compiled; --check makes this the explicit purpose)");
    }
    Ok(())
}
