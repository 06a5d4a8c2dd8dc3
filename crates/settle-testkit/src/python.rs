//! The tests' Python: one venv, `target/python-venv`, shared by every test process of a run (and
//! by `scripts/test-python`), changed only under a lock so two pips never write it at once.

use std::path::PathBuf;
use std::process::Command;

/// Runs `f` on the venv's folder with the venv locked (`target/tmp/python-venv.lock`, which
/// `scripts/test-python` takes too), creating the venv first if missing.
fn locked<T>(f: impl FnOnce(&std::path::Path) -> T) -> T {
    let target = super::target_dir();
    let lock = std::fs::File::create(target.join("tmp").join("python-venv.lock")).unwrap();
    lock.lock().unwrap();
    let venv = target.join("python-venv");
    if !venv.join("bin").join("python").exists() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv), "python3 -m venv target/python-venv");
    }
    f(&venv)
}

/// The venv's `bin/{name}`, pip-installing `requirement` first unless an install of it finished
/// before (a marker written after pip succeeded: an install cut short is done again).
pub fn tool(name: &str, requirement: &str) -> PathBuf {
    locked(|venv| {
        let bin = venv.join("bin").join(name);
        let mark: String =
            requirement.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '_' }).collect();
        let installed = venv.join(format!(".installed-{mark}"));
        if !installed.exists() || !bin.exists() {
            let pip = venv.join("bin").join("pip");
            run(Command::new(pip).args(["install", "-q", requirement]), &format!("pip install {requirement}"));
            assert!(bin.exists(), "pip installed {requirement} but {} is missing", bin.display());
            std::fs::write(&installed, requirement).unwrap();
        }
        bin
    })
}

/// The venv's python with the `settle-client` package installed from this checkout's
/// `clients/python` (installed again each call: the source may have changed since).
pub fn with_client() -> PathBuf {
    let package = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../clients/python");
    locked(|venv| {
        // pip builds and installs a local project afresh each time.
        run(
            Command::new(venv.join("bin").join("pip")).args(["install", "-q"]).arg(&package),
            "pip install ./clients/python",
        );
        venv.join("bin").join("python")
    })
}

fn run(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
