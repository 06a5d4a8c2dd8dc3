//! Issue 19, item 1: reqwest (like every URL client) removes `.` and `..` path segments, so
//! `items/../succeed` would be sent as the job's own `succeed`. The SDK refuses such ids before
//! anything is sent: the client below points at a port nothing listens on, so a request sent
//! would fail as `Transport`, never as `InvalidId`.

use settle_client::{Client, ClientError, Failure};

#[tokio::test]
async fn ids_that_a_url_would_rewrite_are_never_sent() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let c = Client::new(&format!("http://127.0.0.1:{port}"), None);
    let refused = |r: Result<settle_client::Report<bool>, ClientError>| matches!(r, Err(ClientError::InvalidId(_)));
    for bad in ["..", ".", "a/b", "", "a b", "%2e%2e"] {
        assert!(refused(c.item_succeed("job-1", bad, "t").await), "item {bad:?}");
        assert!(refused(c.item_fail("job-1", bad, "t", "NODE_DOWN", "m").await), "item {bad:?}");
        assert!(refused(c.item_succeed(bad, "main", "t").await), "job {bad:?}");
        assert!(matches!(c.succeed(bad, "t", None).await, Err(ClientError::InvalidId(_))), "job {bad:?}");
        assert!(matches!(c.heartbeat(bad, "t").await, Err(ClientError::InvalidId(_))), "job {bad:?}");
        let f = Failure { code: "NODE_DOWN".into(), message: "m".into(), retryable: None, retry_after_ms: None };
        assert!(matches!(c.fail(bad, "t", &f).await, Err(ClientError::InvalidId(_))), "job {bad:?}");
        assert!(matches!(c.unknown(bad, "t", "m").await, Err(ClientError::InvalidId(_))), "job {bad:?}");
        assert!(matches!(c.register_artifact("job-1", bad, "t", "k").await, Err(ClientError::InvalidId(_))));
    }
    // A well-formed id is sent (and fails only for want of a server).
    assert!(matches!(c.item_succeed("job-1", "a..b", "t").await, Err(ClientError::Transport(_))));
}
