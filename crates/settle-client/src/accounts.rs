//! An account's money controls (api-v1 "Money controls"), for a platform's backend: balance alerts
//! and spend limits, each set whole and read back; top-ups, bought through the funding provider.

use crate::{Client, ClientError, segment};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// A balance alert as stored: `account.balance_low` when a posting takes the balance from at or
/// above `below` to under it, `account.balance_recovered` back; `side` is where the balance is.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Alert {
    pub id: String,
    pub below: i64,
    /// `above` or `below`.
    pub side: String,
}

/// A spend limit to put: at most `amount` spent per UTC `period` (`day` or `month`) through
/// creates of the job `kinds` (empty: every kind but `withdrawal`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NewLimit {
    pub period: String,
    pub amount: i64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub kinds: Vec<String>,
}

/// A spend limit with its current period: what it spent (net: negative when refunds of an
/// earlier period's charges came back in it) and when the next period starts.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct SpendLimit {
    pub period: String,
    pub amount: i64,
    pub kinds: Vec<String>,
    pub spent: i64,
    pub resets_at: String,
}

/// A top-up to make: `credits` bought for `price` minor units of `currency` (ISO 4217), charged to
/// the funding provider's `customer`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NewTopUp {
    pub id: String,
    pub account_id: String,
    pub credits: i64,
    pub price: i64,
    pub currency: String,
    pub customer: String,
}

/// A top-up as stored: its job's `state` and `last_error`, and, once the provider confirmed the
/// charge, its id and the grant it wrote (the top-up's id).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TopUp {
    pub id: String,
    pub account_id: String,
    pub state: String,
    pub credits: i64,
    pub price: i64,
    pub currency: String,
    pub customer: String,
    pub idempotency_key: String,
    pub provider_charge_id: Option<String>,
    pub grant_id: Option<String>,
    pub rule: bool,
    pub last_error: Option<Value>,
}

/// An account's auto top-up rule: when a posting takes the balance under `below`, buy `credits` for
/// `price` minor units of `currency` from `customer`, at most `monthly_credits_max` a UTC month.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AutoTopUp {
    pub below: i64,
    pub credits: i64,
    pub price: i64,
    pub currency: String,
    pub customer: String,
    pub monthly_credits_max: i64,
    /// `active`, or `paused` after one of its top-ups died (answers only).
    #[serde(default, skip_serializing)]
    pub state: String,
    /// What its top-ups made this month are buying or bought (answers only).
    #[serde(default, skip_serializing)]
    pub credits_this_month: i64,
}

fn one<T: for<'de> Deserialize<'de>>(v: Value) -> Result<T, ClientError> {
    serde_json::from_value(v).map_err(|e| ClientError::Transport(format!("an answer: {e}")))
}

fn list<T: for<'de> Deserialize<'de>>(v: Value, field: &str) -> Result<Vec<T>, ClientError> {
    serde_json::from_value(v[field].clone()).map_err(|e| ClientError::Transport(format!("an answer's {field}: {e}")))
}

impl Client {
    /// `PUT /v1/accounts/{id}/alerts`: replaces the account's alerts with `(id, below)` pairs (at
    /// most 16; none removes them); setting them fires nothing.
    pub async fn set_alerts(&self, account: &str, alerts: &[(&str, i64)]) -> Result<Vec<Alert>, ClientError> {
        let path = format!("/v1/accounts/{}/alerts", segment("account id", account)?);
        let body =
            json!({"alerts": alerts.iter().map(|(id, below)| json!({"id": id, "below": below})).collect::<Vec<_>>()});
        list(self.request(reqwest::Method::PUT, &path, Some(body)).await?.value(), "alerts")
    }

    /// An account's alerts, lowest threshold first.
    pub async fn alerts(&self, account: &str) -> Result<Vec<Alert>, ClientError> {
        let path = format!("/v1/accounts/{}/alerts", segment("account id", account)?);
        list(self.request(reqwest::Method::GET, &path, None).await?.value(), "alerts")
    }

    /// `PUT /v1/accounts/{id}/limits`: replaces the account's spend limits (at most 16; none
    /// removes them). A create past one then fails with `ClientError::Api` of code
    /// `spend_limit_exceeded`, its `details` saying which limit and what is left.
    pub async fn set_limits(&self, account: &str, limits: &[NewLimit]) -> Result<Vec<SpendLimit>, ClientError> {
        let path = format!("/v1/accounts/{}/limits", segment("account id", account)?);
        list(self.request(reqwest::Method::PUT, &path, Some(json!({"limits": limits}))).await?.value(), "limits")
    }

    /// An account's spend limits in the order put, each with its current period's spend.
    pub async fn limits(&self, account: &str) -> Result<Vec<SpendLimit>, ClientError> {
        let path = format!("/v1/accounts/{}/limits", segment("account id", account)?);
        list(self.request(reqwest::Method::GET, &path, None).await?.value(), "limits")
    }

    /// `POST /v1/top-ups`: nothing is charged to the account; the funding processor charges the
    /// customer and only the confirmed charge grants the credits. A replay answers the stored top-up.
    pub async fn create_top_up(&self, top_up: &NewTopUp) -> Result<TopUp, ClientError> {
        let body = serde_json::to_value(top_up).map_err(|e| ClientError::Transport(e.to_string()))?;
        one(self.request(reqwest::Method::POST, "/v1/top-ups", Some(body)).await?.value())
    }

    /// A top-up as it is now.
    pub async fn top_up(&self, id: &str) -> Result<TopUp, ClientError> {
        let path = format!("/v1/top-ups/{}", segment("top-up id", id)?);
        one(self.request(reqwest::Method::GET, &path, None).await?.value())
    }

    /// `PUT /v1/accounts/{id}/auto-top-up`: the account's one rule, active (a paused one turned on
    /// again); it fires nothing by itself.
    pub async fn set_auto_top_up(&self, account: &str, rule: &AutoTopUp) -> Result<AutoTopUp, ClientError> {
        let path = format!("/v1/accounts/{}/auto-top-up", segment("account id", account)?);
        let body = serde_json::to_value(rule).map_err(|e| ClientError::Transport(e.to_string()))?;
        one(self.request(reqwest::Method::PUT, &path, Some(body)).await?.value())
    }

    /// The account's rule (`ClientError::Api` 404 without one).
    pub async fn auto_top_up(&self, account: &str) -> Result<AutoTopUp, ClientError> {
        let path = format!("/v1/accounts/{}/auto-top-up", segment("account id", account)?);
        one(self.request(reqwest::Method::GET, &path, None).await?.value())
    }

    /// Removes the rule (a top-up it made goes on).
    pub async fn delete_auto_top_up(&self, account: &str) -> Result<(), ClientError> {
        let path = format!("/v1/accounts/{}/auto-top-up", segment("account id", account)?);
        self.request(reqwest::Method::DELETE, &path, None).await.map(drop)
    }
}
