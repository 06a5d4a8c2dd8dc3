//! Request fingerprints for create-by-id idempotency: same id and same fingerprint → replay;
//! same id and another fingerprint → `idempotency_conflict`. Fields are tagged and length-prefixed.
//! JSON a request carries (a job's payload, a success's result) is fingerprinted and stored as
//! [`canonical_json`].

use sha2::{Digest, Sha256};

pub struct Fingerprint(Sha256);

impl Fingerprint {
    pub fn new(domain: &str) -> Fingerprint {
        let mut f = Fingerprint(Sha256::new());
        f.0.update(b"settle.request.v1");
        f = f.str("domain", domain);
        f
    }
    pub fn str(mut self, name: &str, value: &str) -> Fingerprint {
        self.put(name, 1, value.as_bytes());
        self
    }
    pub fn opt_str(mut self, name: &str, value: Option<&str>) -> Fingerprint {
        match value {
            Some(v) => self.put(name, 1, v.as_bytes()),
            None => self.put(name, 0, &[]),
        }
        self
    }
    pub fn i64(mut self, name: &str, value: i64) -> Fingerprint {
        self.put(name, 2, &value.to_be_bytes());
        self
    }
    pub fn opt_i64(mut self, name: &str, value: Option<i64>) -> Fingerprint {
        match value {
            Some(v) => self.put(name, 2, &v.to_be_bytes()),
            None => self.put(name, 0, &[]),
        }
        self
    }
    fn put(&mut self, name: &str, tag: u8, bytes: &[u8]) {
        self.0.update((name.len() as u64).to_be_bytes());
        self.0.update(name.as_bytes());
        self.0.update([tag]);
        self.0.update((bytes.len() as u64).to_be_bytes());
        self.0.update(bytes);
    }
    pub fn finish(self) -> [u8; 32] {
        self.0.finalize().into()
    }
}

/// JSON text with object keys sorted at every level, so equal values fingerprint alike.
pub fn canonical_json(v: &serde_json::Value) -> String {
    fn write(v: &serde_json::Value, out: &mut String) {
        match v {
            serde_json::Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort();
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&serde_json::Value::String((*k).clone()).to_string());
                    out.push(':');
                    write(&map[*k], out);
                }
                out.push('}');
            }
            serde_json::Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write(item, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut out = String::new();
    write(v, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_boundaries_matter() {
        let a = Fingerprint::new("x").str("a", "bc").str("d", "").finish();
        let b = Fingerprint::new("x").str("a", "b").str("d", "c").finish();
        assert_ne!(a, b);
        let n = Fingerprint::new("x").opt_i64("n", None).finish();
        let z = Fingerprint::new("x").opt_i64("n", Some(0)).finish();
        assert_ne!(n, z);
    }

    #[test]
    fn canonical_json_sorts_keys_at_every_level() {
        let a: serde_json::Value = serde_json::from_str(r#"{"b":1,"a":{"y":[{"d":1,"c":2}],"x":null}}"#).unwrap();
        let b: serde_json::Value = serde_json::from_str(r#"{"a":{"x":null,"y":[{"c":2,"d":1}]},"b":1}"#).unwrap();
        assert_eq!(canonical_json(&a), canonical_json(&b));
        assert_eq!(canonical_json(&a), r#"{"a":{"x":null,"y":[{"c":2,"d":1}]},"b":1}"#);
    }
}
