//! `GET /v1/memory` and the memory families of `/metrics`.

mod http_common;

use http_common::app;

#[tokio::test]
async fn memory_report_has_every_documented_field() {
    let a = app();
    let r = a.get("/v1/memory").await;
    assert_eq!(r.status, axum::http::StatusCode::OK);
    let v = r.json();
    let card = &v["cards"][0];
    for key in [
        "card",
        "uuid",
        "total_bytes",
        "free_bytes",
        "floor_bytes",
        "min_free_bytes",
        "breaches",
        "intrusions",
        "restore_ms_max",
        "foreign_bytes",
        "residue_bytes",
        "drift_bytes",
        "books",
    ] {
        assert!(card.get(key).is_some(), "missing {key} in {card}");
    }
    assert!(card["books"]["weights"].as_u64().unwrap() > 0, "weights are booked: {card}");
    assert!(card["books"]["kv_committed"].as_u64().unwrap() > 0, "KV is committed: {card}");
    assert!(card["books"].get("kv_reserved").is_some());
    assert!(v.get("spread_bytes").is_some());
}

#[tokio::test]
async fn metrics_export_the_corridor_record() {
    let a = app();
    let text = a.get("/metrics").await.text();
    for family in [
        "corridor_card_free_bytes{card=\"0\"}",
        "corridor_card_min_free_bytes{card=\"0\"}",
        "corridor_card_breaches_total{card=\"0\"} 0",
        "corridor_card_intrusions_total{card=\"0\"}",
        "corridor_card_books_bytes{card=\"0\",purpose=\"kv_committed\"}",
        "corridor_card_spread_bytes",
    ] {
        assert!(text.contains(family), "missing {family}");
    }
}
