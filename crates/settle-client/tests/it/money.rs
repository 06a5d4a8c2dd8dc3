//! An account's money controls through the SDK (issue 45), on both engines: alerts set and read;
//! spend limits set, a create past one refused with `spend_limit_exceeded` and its details, the
//! spend read back.

use serde_json::json;
use settle_client::{Client, ClientError, NewLimit};

async fn money_controls(postgres: bool) {
    let served = crate::common::serve_on(postgres).await;
    let base = served.base.clone();
    let http = reqwest::Client::new();
    for (path, body) in
        [("/v1/accounts", json!({"id": "a"})), ("/v1/accounts/a/grants", json!({"id": "g", "amount": 1000}))]
    {
        assert_eq!(http.post(format!("{base}{path}")).json(&body).send().await.unwrap().status(), 201);
    }
    let c = Client::new(&base, None);
    let alerts = c.set_alerts("a", &[("low", 500)]).await.unwrap();
    assert_eq!((alerts[0].id.as_str(), alerts[0].below, alerts[0].side.as_str()), ("low", 500, "above"));
    assert_eq!(c.alerts("a").await.unwrap(), alerts);
    let day = NewLimit { period: "day".into(), amount: 100, kinds: vec!["render".into()] };
    let limits = c.set_limits("a", &[day]).await.unwrap();
    assert_eq!((limits[0].spent, limits[0].kinds.clone()), (0, vec!["render".to_owned()]));
    let create = |id: &str, cost: i64| {
        let body = json!({"id": id, "account_id": "a", "kind": "render", "cost": cost});
        http.post(format!("{base}/v1/jobs")).json(&body).send()
    };
    assert_eq!(create("j1", 70).await.unwrap().status(), 201);
    let refused = create("j2", 31).await.unwrap();
    assert_eq!(refused.status(), 402);
    assert_eq!(c.limits("a").await.unwrap()[0].spent, 70);
    match c.set_limits("a", &[NewLimit { period: "week".into(), amount: 5, kinds: vec![] }]).await {
        Err(ClientError::Api { status: 400, code, .. }) => assert_eq!(code, "invalid_request"),
        other => panic!("{other:?}"),
    }
    match c.alerts("nobody").await {
        Err(ClientError::Api { status: 404, .. }) => {}
        other => panic!("{other:?}"),
    }
    drop(served);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_money_controls() {
    money_controls(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_money_controls() {
    money_controls(true).await;
}
