//! The HTTP API in process (actix-web's test service over the real actors and CPU backend):
//! what the end-to-end tests of the binary cannot provoke, such as a backend that panics.

mod common;

use std::sync::Arc;

use actix_web::{App, test, web};
use actors::http::{ApiState, Model};
use common::*;
use engine::EngineError;
use engine::backend::{Backend, BackendInfo, MemoryReport, StepOutput, StepPlan};
use engine::model::ModelFiles;
use serde_json::{Value, json};

/// A backend whose forward pass panics, as a driver fault turned into a panic would.
struct PanickingBackend {
    info: BackendInfo,
}

impl Backend for PanickingBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }
    fn step(&mut self, _: &StepPlan) -> Result<StepOutput, EngineError> {
        panic!("injected panic in the forward pass");
    }
    fn alloc_backing(
        &mut self,
        _: cache::BackingId,
        _: cache::Tier,
        _: u64,
    ) -> Result<(), EngineError> {
        Ok(())
    }
    fn free_backing(&mut self, _: cache::BackingId) -> Result<(), EngineError> {
        Ok(())
    }
    fn save_pages(
        &mut self,
        _: cache::BackingId,
        _: &[cache::PageCopy],
    ) -> Result<(), EngineError> {
        Ok(())
    }
    fn restore_pages(
        &mut self,
        _: cache::BackingId,
        _: &[cache::PageCopy],
    ) -> Result<(), EngineError> {
        Ok(())
    }
    fn clone_pages(&mut self, _: &[cache::PageClone]) -> Result<(), EngineError> {
        Ok(())
    }
    fn copy_backing(
        &mut self,
        _: cache::BackingId,
        _: cache::BackingId,
    ) -> Result<(), EngineError> {
        Err(EngineError::ShutDown)
    }
    fn finished_copies(&mut self, _: bool) -> Vec<(cache::BackingId, Result<(), EngineError>)> {
        Vec::new()
    }
    fn backing_ids(&self) -> Vec<cache::BackingId> {
        Vec::new()
    }
    fn restore_verdicts(&mut self) -> Result<Vec<bool>, EngineError> {
        Ok(Vec::new())
    }
    fn backing_sums(&mut self, _: cache::BackingId) -> Result<Vec<u64>, EngineError> {
        Ok(Vec::new())
    }
    fn set_backing_sums(&mut self, _: cache::BackingId, _: &[u64]) -> Result<(), EngineError> {
        Ok(())
    }
    fn host_runs(
        &mut self,
        _: cache::BackingId,
    ) -> Result<Vec<engine::backend::HostRun>, EngineError> {
        Ok(Vec::new())
    }
    fn read_backing(&mut self, _: cache::BackingId) -> Result<Vec<u8>, EngineError> {
        Ok(Vec::new())
    }
    fn flip_byte(&mut self, _: cache::BackingId, _: u64, _: u8) -> Result<(), EngineError> {
        Ok(())
    }
    fn memory(&self) -> MemoryReport {
        MemoryReport::default()
    }
}

#[actix_rt::test]
async fn when_the_engine_dies_requests_fail_clearly_and_health_says_so() {
    let model = TinyModel::new();
    let info = cpu_backend(&model.files, 64).info().clone();
    let handles = actors::start(
        Box::new(PanickingBackend { info: info.clone() }),
        serve_config(&model.files, policies("")),
    )
    .unwrap();
    let files = ModelFiles::open(model_dir_of(&model.files)).unwrap();
    let limit = handles.limit;
    let state = ApiState {
        handles,
        model: Arc::new(Model::new(files, "tiny".into(), limit)),
        prometheus: None,
        body: actors::http::BodyLimits {
            timeout: std::time::Duration::from_secs(30),
            max_bytes: actors::http::MAX_BODY_BYTES,
        },
        keys: actors::http::ApiKeys::open(),
    };
    let app = test::init_service(
        App::new()
            .app_data(web::Data::new(state))
            .configure(actors::http::routes),
    )
    .await;

    let health = test::TestRequest::get().uri("/health").to_request();
    assert_eq!(test::call_service(&app, health).await.status(), 200);

    let request = test::TestRequest::post()
        .uri("/v1/completions")
        .set_json(json!({"prompt": "hello", "max_tokens": 4}))
        .to_request();
    let response = test::call_service(&app, request).await;
    assert_eq!(response.status(), 500);
    let body: Value = test::read_body_json(response).await;
    assert_eq!(body["error"]["code"], "engine_error", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unavailable"),
        "{body}"
    );

    // The engine's thread finishes unwinding a moment after the request saw it fail.
    let mut status = 0;
    for _ in 0..200 {
        let health = test::TestRequest::get().uri("/health").to_request();
        status = test::call_service(&app, health).await.status().as_u16();
        if status == 503 {
            break;
        }
        actix_rt::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(
        status, 503,
        "/health still says ok two seconds after the engine died"
    );
    // The metrics route is off without a recorder.
    let metrics = test::TestRequest::get().uri("/metrics").to_request();
    assert_eq!(test::call_service(&app, metrics).await.status(), 404);
}
