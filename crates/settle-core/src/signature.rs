//! Webhook signatures: `Settle-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`.
//! Receivers recompute the MAC over the exact body bytes, compare in constant time, and reject a
//! timestamp too far from their clock (replays).

use sha2::{Digest, Sha256};

const BLOCK: usize = 64;

/// HMAC-SHA256 (RFC 2104).
pub fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(k.map(|b| b ^ 0x36));
    inner.update(message);
    let inner = inner.finalize();
    let mut outer = Sha256::new();
    outer.update(k.map(|b| b ^ 0x5c));
    outer.update(inner);
    outer.finalize().into()
}

/// The header value for `body` sent at `unix_seconds`.
pub fn sign(secret: &str, unix_seconds: i64, body: &[u8]) -> String {
    let mut msg = format!("{unix_seconds}.").into_bytes();
    msg.extend_from_slice(body);
    format!("t={unix_seconds},v1={}", hex::encode(hmac_sha256(secret.as_bytes(), &msg)))
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("malformed signature header")]
    Malformed,
    #[error("signature timestamp outside the tolerance")]
    Stale,
    #[error("signature does not match the body")]
    Mismatch,
}

/// Verifies a `Settle-Signature` header against `body`, accepting timestamps within
/// `tolerance_seconds` of `now_unix_seconds`.
pub fn verify(
    secret: &str,
    header: &str,
    body: &[u8],
    now_unix_seconds: i64,
    tolerance_seconds: i64,
) -> Result<(), SignatureError> {
    let mut t = None;
    let mut v1 = None;
    for part in header.split(',') {
        match part.split_once('=') {
            Some(("t", v)) => t = v.parse::<i64>().ok(),
            Some(("v1", v)) => v1 = hex::decode(v).ok(),
            _ => {}
        }
    }
    let (Some(t), Some(given)) = (t, v1) else { return Err(SignatureError::Malformed) };
    // The timestamp is the sender's (an attacker's) number: any i64 at all. `abs_diff` cannot
    // overflow, where `(now - t).abs()` panics in a debug build at `t = i64::MIN`.
    if now_unix_seconds.abs_diff(t) > tolerance_seconds.unsigned_abs() {
        return Err(SignatureError::Stale);
    }
    let mut msg = format!("{t}.").into_bytes();
    msg.extend_from_slice(body);
    let expected = hmac_sha256(secret.as_bytes(), &msg);
    // Constant time: fold every byte, no early exit.
    if given.len() != expected.len() || given.iter().zip(expected.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) != 0 {
        return Err(SignatureError::Mismatch);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extreme_timestamps_are_stale_not_a_panic() {
        let body = b"{}";
        for t in [i64::MIN, i64::MIN + 1, -1, i64::MAX] {
            let header = format!("t={t},v1={}", hex::encode(hmac_sha256(b"s", format!("{t}.{{}}").as_bytes())));
            for now in [0, 1_700_000_000, i64::MAX, i64::MIN] {
                let fresh = (i128::from(now) - i128::from(t)).abs() <= 300;
                let expected = if fresh { Ok(()) } else { Err(SignatureError::Stale) };
                assert_eq!(verify("s", &header, body, now, 300), expected, "t={t} now={now}");
            }
        }
        let header = format!("t=5,v1={}", hex::encode(hmac_sha256(b"s", b"5.{}")));
        assert_eq!(verify("s", &header, body, 5, i64::MIN), Ok(()), "a negative tolerance reads as its size");
    }

    #[test]
    fn rfc_4231_test_case_2() {
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(hex::encode(mac), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    }

    #[test]
    fn rfc_4231_test_case_6_long_key() {
        let key = [0xaau8; 131];
        let mac = hmac_sha256(&key, b"Test Using Larger Than Block-Size Key - Hash Key First");
        assert_eq!(hex::encode(mac), "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    }

    #[test]
    fn a_signed_body_verifies_and_a_tampered_one_does_not() {
        let h = sign("s3cret-s3cret-s3cret", 1_000, br#"{"seq":1}"#);
        assert_eq!(verify("s3cret-s3cret-s3cret", &h, br#"{"seq":1}"#, 1_010, 300), Ok(()));
        assert_eq!(verify("s3cret-s3cret-s3cret", &h, br#"{"seq":2}"#, 1_010, 300), Err(SignatureError::Mismatch));
        assert_eq!(verify("other-secret-other", &h, br#"{"seq":1}"#, 1_010, 300), Err(SignatureError::Mismatch));
        assert_eq!(verify("s3cret-s3cret-s3cret", &h, br#"{"seq":1}"#, 2_000, 300), Err(SignatureError::Stale));
        assert_eq!(verify("s3cret-s3cret-s3cret", "v1=zz", b"", 0, 300), Err(SignatureError::Malformed));
    }

    #[test]
    fn the_tolerance_holds_both_ways_and_at_its_edge() {
        let secret = "s3cret-s3cret-s3cret";
        let h = sign(secret, 1_000, b"{}");
        // A timestamp from the future (a replay prepared ahead, or a sender's clock far ahead) is
        // refused like an old one; exactly at the tolerance it is still accepted.
        assert_eq!(verify(secret, &h, b"{}", 699, 300), Err(SignatureError::Stale));
        assert_eq!(verify(secret, &h, b"{}", 700, 300), Ok(()));
        assert_eq!(verify(secret, &h, b"{}", 1_300, 300), Ok(()));
        assert_eq!(verify(secret, &h, b"{}", 1_301, 300), Err(SignatureError::Stale));
        // A header signed for another time does not verify with its t changed.
        let moved = h.replace("t=1000", "t=1001");
        assert_eq!(verify(secret, &moved, b"{}", 1_000, 300), Err(SignatureError::Mismatch));
    }

    /// A key of exactly one block (64 bytes) is used as it is, not hashed first (RFC 2104); the
    /// expected MAC is Python's `hmac.new(b"\x0b" * 64, b"Settle", "sha256")`.
    #[test]
    fn a_block_sized_key_is_not_hashed() {
        let mac = hmac_sha256(&[0x0b; 64], b"Settle");
        assert_eq!(hex::encode(mac), "51223beacb69dd84d9e6fe32e708d6c034c7d25b02c19be10739e011fcef0fe5");
    }

    /// Two wrong bytes whose differences cancel under XOR must still fail the compare.
    #[test]
    fn differences_do_not_cancel_out() {
        let secret = "s3cret-s3cret-s3cret";
        let h = sign(secret, 1_000, b"{}");
        let (t, v1) = h.split_once(",v1=").unwrap();
        let mut mac = hex::decode(v1).unwrap();
        mac[0] ^= 1;
        mac[1] ^= 1;
        let forged = format!("{t},v1={}", hex::encode(mac));
        assert_eq!(verify(secret, &forged, b"{}", 1_000, 300), Err(SignatureError::Mismatch));
    }
}
