//! An account's money controls through the SDK (issue 45), on both engines: alerts set and read;
//! spend limits set, a create past one refused with `spend_limit_exceeded` and its details, the
//! spend read back.

use serde_json::json;
use settle_client::{AutoTopUp, Client, ClientError, NewLimit, NewTopUp};

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
    top_ups(&served, &c).await;
    drop(served);
}

/// A top-up bought through the SDK, charged by a funding processor against `settle funding-sim`:
/// granted once the charge is confirmed; a declined card ends it without a grant.
async fn top_ups(served: &crate::common::Served, c: &Client) {
    use settle_worker::funding::{FundingProcessor, HttpFunding, HttpProviderConfig};
    let config = settle_sim::SimConfig { invalid_prefix: "declined".into(), ..settle_sim::SimConfig::default() };
    let sim = settle_sim::start_speaking("127.0.0.1:0", config, &settle_sim::FUNDING_V1).await.unwrap();
    let funding = HttpFunding::new(&HttpProviderConfig {
        url: sim.url(),
        timeout: std::time::Duration::from_secs(5),
        connect_timeout: std::time::Duration::from_secs(1),
    })
    .unwrap();
    let worker = settle_core::ids::WorkerName::parse("funding").unwrap();
    let processor =
        FundingProcessor::new(served.store.clone(), std::sync::Arc::new(funding), worker, Default::default());
    let buy = |id: &str, customer: &str| NewTopUp {
        id: id.into(),
        account_id: "a".into(),
        credits: 500,
        price: 499,
        currency: "usd".into(),
        customer: customer.into(),
    };
    let t = c.create_top_up(&buy("t1", "cus_a")).await.unwrap();
    assert_eq!((t.state.as_str(), t.currency.as_str(), t.grant_id.as_deref()), ("queued", "USD", None));
    assert_eq!(c.create_top_up(&buy("t1", "cus_a")).await.unwrap().idempotency_key, t.idempotency_key);
    c.create_top_up(&buy("t2", "declined-a")).await.unwrap();
    assert_eq!(processor.process_pass().await.unwrap().len(), 2);
    let paid = c.top_up("t1").await.unwrap();
    assert_eq!((paid.state.as_str(), paid.grant_id.as_deref()), ("succeeded", Some("t1")));
    let declined = c.top_up("t2").await.unwrap();
    assert_eq!((declined.state.as_str(), declined.grant_id), ("dead", None));
    assert_eq!(declined.last_error.unwrap()["code"], "CARD_DECLINED");
    // the rule: put, read, and a crossing buys (t1's 500 were granted: 1500 → 400 crosses 500)
    let rule = AutoTopUp {
        below: 500,
        credits: 300,
        price: 299,
        currency: "eur".into(),
        customer: "cus_a".into(),
        monthly_credits_max: 3000,
        state: String::new(),
        credits_this_month: 0,
    };
    let put = c.set_auto_top_up("a", &rule).await.unwrap();
    assert_eq!((put.state.as_str(), put.currency.as_str()), ("active", "EUR"));
    assert_eq!(c.auto_top_up("a").await.unwrap(), put);
    c.delete_auto_top_up("a").await.unwrap();
    match c.auto_top_up("a").await {
        Err(ClientError::Api { status: 404, .. }) => {}
        other => panic!("{other:?}"),
    }
    match c.create_top_up(&NewTopUp { currency: "XXX".into(), ..buy("t3", "cus_a") }).await {
        Err(ClientError::Api { status: 400, code, .. }) => assert_eq!(code, "invalid_request"),
        other => panic!("{other:?}"),
    }
    sim.task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_money_controls() {
    money_controls(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_money_controls() {
    money_controls(true).await;
}
