//! Embeds the migrations (`migrations/sqlite`, `migrations/postgres`) in the library, as sqlx's
//! `migrate!` would, without sqlx's proc macros: those compile sqlx's drivers and the bundled SQLite
//! a second time for the build host, the largest part of a clean build after Settle's own crates
//! (docs/testing.md, "What CI runs and how long it takes").
//!
//! A file `<VERSION>_<description>.sql` becomes one migration, read as sqlx reads it: the version
//! is the number, the description the rest with `_` as spaces, and a first line
//! `-- no-transaction` runs it outside a transaction. The checksum sqlx keeps in
//! `_sqlx_migrations` is computed from the same text when the migrator is made, so databases
//! migrated by earlier builds verify unchanged.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut code = String::new();
    for engine in ["sqlite", "postgres"] {
        let dir = Path::new("migrations").join(engine);
        println!("cargo:rerun-if-changed={}", dir.display());
        writeln!(code, "/// The {engine} migrations, in version order.").unwrap();
        writeln!(code, "fn {engine}_migrations() -> Vec<sqlx::migrate::Migration> {{\n    vec![").unwrap();
        for (version, description, path, no_tx) in migrations(&dir) {
            writeln!(
                code,
                "        sqlx::migrate::Migration::new({version}, std::borrow::Cow::Borrowed({description:?}), \
                 sqlx::migrate::MigrationType::Simple, sqlx::SqlStr::from_static(include_str!({path:?})), {no_tx}),"
            )
            .unwrap();
        }
        writeln!(code, "    ]\n}}").unwrap();
    }
    std::fs::write(out.join("migrations.rs"), code).expect("write migrations.rs");
}

/// (version, description, absolute path, no_tx) of every migration in `dir`, by version.
fn migrations(dir: &Path) -> Vec<(i64, String, String, bool)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).expect("a UTF-8 file name").to_owned();
        let Some((version, rest)) = name.split_once('_') else {
            panic!("migration {name:?} is not named <VERSION>_<description>.sql");
        };
        let Some(description) = rest.strip_suffix(".sql") else {
            panic!("migration {name:?} is not a .sql file");
        };
        // sqlx would read these as reversible migrations: Settle has none, and would need them read
        // as sqlx reads them.
        assert!(
            !description.ends_with(".up") && !description.ends_with(".down"),
            "migration {name:?}: reversible migrations are not embedded by this build script"
        );
        let version: i64 =
            version.parse().unwrap_or_else(|_| panic!("migration {name:?}: the version is not a number"));
        let sql = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let absolute = std::fs::canonicalize(&path).expect("canonical path");
        found.push((
            version,
            description.replace('_', " "),
            absolute.to_str().expect("a UTF-8 path").to_owned(),
            sql.starts_with("-- no-transaction"),
        ));
    }
    found.sort_by_key(|m| m.0);
    for pair in found.windows(2) {
        assert!(pair[0].0 != pair[1].0, "two migrations have version {}", pair[0].0);
    }
    found
}
