//! The SDK against `settle serve`'s application over real HTTP: one test binary, a module per story.

// What the modules share; not every module uses all of it.
mod answers;
mod cancel;
#[allow(dead_code)]
mod common;
mod held;
mod ids;
mod money;
mod together;
