//! Secrets from the environment or from files: every secret variable `SETTLE_X` may instead be
//! given as `SETTLE_X_FILE`, the path of a file that holds it (a secret store's mount, a systemd
//! credential, a Kubernetes secret), so no secret has to sit in the environment or the config file.

use anyhow::{Context, bail};
use std::collections::BTreeMap;
use std::path::Path;

/// `name` from the environment, or the contents of the file `name_FILE` names; both set is refused
/// (which one wins would be a guess).
pub fn from_env(env: &BTreeMap<String, String>, name: &str) -> anyhow::Result<Option<String>> {
    let file_var = format!("{name}_FILE");
    match (env.get(name), env.get(&file_var)) {
        (Some(_), Some(_)) => bail!("{name} and {file_var} are both set: give the secret one way"),
        (Some(value), None) => Ok(Some(value.clone())),
        (None, Some(path)) => read(Path::new(path), &file_var).map(Some),
        (None, None) => Ok(None),
    }
}

/// A secret kept in a file: refused if every user may read it; one trailing line break is not part
/// of it; an empty one is refused.
pub fn read(path: &Path, what: &str) -> anyhow::Result<String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).with_context(|| format!("{what}: read {}", path.display()))?;
    let mode = meta.permissions().mode();
    if mode & 0o007 != 0 {
        bail!(
            "{what}: {} is open to every user (mode {:o}): chmod o-rwx (or 600) it; it holds a secret",
            path.display(),
            mode & 0o777
        );
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("{what}: read {}", path.display()))?;
    let secret = text.strip_suffix('\n').map(|t| t.strip_suffix('\r').unwrap_or(t)).unwrap_or(&text);
    if secret.is_empty() {
        bail!("{what}: {} is empty", path.display());
    }
    Ok(secret.to_owned())
}

/// The process's `SETTLE_` environment (what the configuration reads).
pub fn settle_env() -> BTreeMap<String, String> {
    std::env::vars().filter(|(k, _)| k.starts_with("SETTLE_")).collect()
}

/// `url` with `password` as its password: a PostgreSQL URL's password can then live in a file
/// (`SETTLE_DATABASE_PASSWORD_FILE`) instead of in the URL. Refused for a URL that has one already
/// or is not PostgreSQL's.
pub fn with_password(url: &str, password: &str) -> anyhow::Result<String> {
    let Some(rest) = url.strip_prefix("postgres://").or_else(|| url.strip_prefix("postgresql://")) else {
        bail!("SETTLE_DATABASE_PASSWORD is for postgres:// URLs; {} has none to take", settle_store::redacted_url(url));
    };
    let scheme = &url[..url.len() - rest.len()];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some((user, hosts)) = authority.rsplit_once('@') else {
        bail!("SETTLE_DATABASE_PASSWORD needs a user in the URL (postgres://USER@host/db)");
    };
    if user.contains(':') || tail.contains("password=") {
        bail!("the database URL has a password already: give it one way (the URL or SETTLE_DATABASE_PASSWORD[_FILE])");
    }
    Ok(format!("{scheme}{user}:{}@{hosts}{tail}", percent_encode(password)))
}

/// Percent-encodes everything but RFC 3986's unreserved characters (a URL's password, a path
/// segment, a query value).
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_goes_into_the_url_encoded() {
        let url = with_password("postgres://settle@db1:5432,db2:5432/settle?sslmode=require", "p@ss:w/rd").unwrap();
        assert_eq!(url, "postgres://settle:p%40ss%3Aw%2Frd@db1:5432,db2:5432/settle?sslmode=require");
        assert!(with_password("postgres://settle:old@db/settle", "new").is_err());
        assert!(with_password("postgres://db/settle", "new").is_err());
        assert!(with_password("sqlite://settle.db", "new").is_err());
    }

    #[test]
    fn a_secret_comes_one_way() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        std::fs::write(&path, "sekrit-of-16-characters\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let mut env = BTreeMap::new();
        env.insert("SETTLE_X_FILE".to_owned(), path.display().to_string());
        assert_eq!(from_env(&env, "SETTLE_X").unwrap().as_deref(), Some("sekrit-of-16-characters"));
        env.insert("SETTLE_X".to_owned(), "other".to_owned());
        assert!(from_env(&env, "SETTLE_X").unwrap_err().to_string().contains("both set"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read(&path, "SETTLE_X_FILE").unwrap_err().to_string().contains("open to every user"));
    }
}
