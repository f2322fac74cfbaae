//! `tensorfold kernels --check`: compile every CUDA kernel with NVRTC, no GPU needed.

use anyhow::{bail, Result};
use clap::Args;
use tensorfold::backend::cuda::compile;

#[derive(Args, Debug)]
pub struct KernelsArgs {
    /// Compile every kernel and report errors (needs libnvrtc, not a GPU).
    #[arg(long)]
    pub check: bool,
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
            match compile::compile(src, arch) {
                Ok(cubin) => println!("ok    {arch} {:<22} {:>7} bytes  {}", src.file, cubin.len(), src.entries.join(", ")),
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
