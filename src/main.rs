//! The `tensorfold` program: run a model, inspect a checkpoint, write synthetic checkpoints,
//! measure speed. Library errors get their context here, at the edge.

mod cli;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let args = cli::Cli::parse();
    match cli::dispatch(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", cli::error_text(&e));
            std::process::ExitCode::FAILURE
        }
    }
}
