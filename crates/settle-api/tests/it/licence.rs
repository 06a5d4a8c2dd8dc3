//! One licence everywhere (issue 42): the LICENSE file at the root is the Apache License 2.0, and
//! every package Settle publishes — the Rust workspace, the Python client, the TypeScript client,
//! the OpenAPI document — says so and ships the same text.

use std::path::{Path, PathBuf};

const LICENCE: &str = "Apache-2.0";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../..").canonicalize().unwrap()
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn every_package_and_the_api_declare_one_licence() {
    let text = read("LICENSE");
    assert!(
        text.contains("Apache License") && text.contains("Version 2.0, January 2004"),
        "LICENSE is the Apache License 2.0"
    );
    for copy in ["clients/python/LICENSE", "clients/typescript/LICENSE"] {
        assert_eq!(read(copy), text, "{copy} is the root LICENSE, as shipped in its package");
    }
    let workspace: toml::Value = toml::from_str(&read("Cargo.toml")).unwrap();
    assert_eq!(workspace["workspace"]["package"]["license"].as_str(), Some(LICENCE), "Cargo.toml");
    for entry in std::fs::read_dir(root().join("crates")).unwrap() {
        let manifest = entry.unwrap().path().join("Cargo.toml");
        let crate_toml: toml::Value = toml::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
        let package = &crate_toml["package"];
        let inherits = package.get("license").and_then(|l| l.get("workspace")).and_then(|w| w.as_bool());
        let own = package.get("license").and_then(|l| l.as_str());
        assert!(inherits == Some(true) || own == Some(LICENCE), "{}: license {:?}", manifest.display(), package);
    }
    let python: toml::Value = toml::from_str(&read("clients/python/pyproject.toml")).unwrap();
    assert_eq!(python["project"]["license"]["text"].as_str(), Some(LICENCE), "pyproject.toml");
    let npm: serde_json::Value = serde_json::from_str(&read("clients/typescript/package.json")).unwrap();
    assert_eq!(npm["license"], LICENCE, "package.json");
    assert!(npm["files"].as_array().unwrap().iter().any(|f| f == "LICENSE"), "the npm package ships LICENSE");
    let lock: serde_json::Value = serde_json::from_str(&read("clients/typescript/package-lock.json")).unwrap();
    assert_eq!(lock["packages"][""]["license"], LICENCE, "package-lock.json");
    let doc = serde_json::to_value(settle_api::openapi()).unwrap();
    assert_eq!(doc["info"]["license"]["identifier"], LICENCE, "/openapi.json");
}

/// One version (issue 42): the workspace's, which every crate inherits; the Python and npm packages,
/// and its lock carry copies (written by scripts/set-version). `/openapi.json`'s `info.version`
/// is the API's (`1`), not the software's.
#[test]
fn every_package_and_the_api_carry_the_workspace_version() {
    let workspace: toml::Value = toml::from_str(&read("Cargo.toml")).unwrap();
    let version = workspace["workspace"]["package"]["version"].as_str().unwrap().to_owned();
    for entry in std::fs::read_dir(root().join("crates")).unwrap() {
        let manifest = entry.unwrap().path().join("Cargo.toml");
        let crate_toml: toml::Value = toml::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
        let v = &crate_toml["package"]["version"];
        assert_eq!(v.get("workspace").and_then(|w| w.as_bool()), Some(true), "{}: version {v}", manifest.display());
    }
    let python: toml::Value = toml::from_str(&read("clients/python/pyproject.toml")).unwrap();
    assert_eq!(python["project"]["version"].as_str(), Some(version.as_str()), "pyproject.toml");
    let npm: serde_json::Value = serde_json::from_str(&read("clients/typescript/package.json")).unwrap();
    assert_eq!(npm["version"], version.as_str(), "package.json");
    let lock: serde_json::Value = serde_json::from_str(&read("clients/typescript/package-lock.json")).unwrap();
    assert_eq!(lock["version"], version.as_str(), "package-lock.json");
    assert_eq!(lock["packages"][""]["version"], version.as_str(), "package-lock.json");
    assert_eq!(env!("CARGO_PKG_VERSION"), version, "the crates");
}
