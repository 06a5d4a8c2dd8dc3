//! Request fingerprints for create-by-id idempotency: same id and same fingerprint → replay;
//! same id and another fingerprint → `idempotency_conflict`. Fields are tagged and length-prefixed.

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
}
