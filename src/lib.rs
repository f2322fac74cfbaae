//! tensorfold: an exact, fast inference engine for Qwen3.5 language models.
//!
//! See `ARCHITECTURE.md` for the layers and the data flow of a token, and `docs/numerics.md`
//! for the arithmetic contract every backend keeps.

pub mod backend;
pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod convert;
pub mod engine;
pub mod fsutil;
pub mod grammar;
pub mod hostmem;
pub mod hub;
pub mod model;
pub mod numerics;
pub mod runtime;
pub mod sampling;
pub mod serve;
pub mod server;
pub mod session;
pub mod synth;
#[doc(hidden)]
pub mod testutil;
pub mod tokenizer;
pub mod writer;
