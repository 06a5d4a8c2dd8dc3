//! The SDK against a real server: every report answers `Report::Applied` or `Report::Replayed`, and
//! a refused one `ClientError::LeaseLost` with the details of what became of the job (decision 0019).

use serde_json::json;
use settle_client::{Client, ClientError, Failure, Report};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_answer_applied_replayed_or_lease_lost() {
    let served = crate::common::serve().await;
    let base = served.base.clone();
    let http = reqwest::Client::new();
    for (path, body) in [
        ("/v1/accounts", json!({"id": "a"})),
        ("/v1/accounts/a/grants", json!({"id": "g", "amount": 100})),
        (
            "/v1/jobs",
            json!({"id": "j", "account_id": "a", "kind": "render",
                            "items": [{"id": "i1", "cost": 10}, {"id": "i2", "cost": 10}]}),
        ),
    ] {
        assert_eq!(http.post(format!("{base}{path}")).json(&body).send().await.unwrap().status(), 201);
    }
    let c = Client::new(&base, None);
    let job = c.claim("w", &[], 1, Some(30), 0).await.unwrap().remove(0);
    let t = job.lease_token.as_str();

    assert_eq!(c.item_succeed("j", "i1", t).await.unwrap(), Report::Applied(false));
    assert_eq!(c.item_succeed("j", "i1", t).await.unwrap(), Report::Replayed(false));
    let path = c.register_artifact("j", "i2", t, "out.png").await.unwrap();
    assert_eq!(path, Report::Applied("j/i2/out.png".to_owned()));
    assert!(c.register_artifact("j", "i2", t, "out.png").await.unwrap().is_replay());

    let failure = Failure { code: "TIMEOUT".into(), message: "late".into(), retryable: None, retry_after_ms: None };
    match c.fail("j", "a-token-never-issued", &failure).await {
        Err(ClientError::LeaseLost { details, .. }) => {
            assert_eq!((details["lease"].as_str(), details["state"].as_str()), (Some("never_issued"), Some("running")));
            assert!(details["attempt"].is_null(), "{details}");
        }
        other => panic!("{other:?}"),
    }
    let done = c.succeed("j", t, None).await.unwrap();
    assert!(matches!(&done, Report::Applied(v) if v["state"] == "succeeded"), "{done:?}");
    assert!(c.succeed("j", t, None).await.unwrap().is_replay());
    match c.heartbeat("j", t).await {
        Err(ClientError::LeaseLost { details, .. }) => {
            assert_eq!(details["lease"], "ended");
            assert_eq!(details["attempt"]["result"], "succeeded");
        }
        other => panic!("{other:?}"),
    }
    drop(served);
}
