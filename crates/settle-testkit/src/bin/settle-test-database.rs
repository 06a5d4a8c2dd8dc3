//! Prints the URL of a fresh, empty database on the test PostgreSQL server (started in the temp
//! dir if none answers, as for the Rust tests; `scripts/test` stops it at the end). For test
//! suites outside Rust: `scripts/test-python` runs the Python client's tests on it.

#[tokio::main(flavor = "current_thread")]
async fn main() {
    println!("{}", settle_testkit::fresh_database().await);
}
