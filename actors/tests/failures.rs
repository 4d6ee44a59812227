//! Overload, cancellation and engine failures: each is handled per request, and the server
//! keeps serving.

mod common;

use std::time::Duration;

use actors::{Event, GenerateRequest, ServeError};
use common::*;
use engine::sampling::SamplingParams;

#[actix_rt::test]
async fn a_full_queue_refuses_with_overloaded_and_a_retry_delay() {
    let model = TinyModel::new();
    let vocab = model.files.config.vocab_size;
    let config = serve_config(
        &model.files,
        policies("[admission]\nmax_running = 1\nmax_queue = 2\n"),
    );
    let handles = actors::start(Box::new(cpu_backend(&model.files, 64)), config).unwrap();
    let mut accepted = Vec::new();
    let mut refusals = Vec::new();
    for i in 0..8 {
        match handles
            .submit(GenerateRequest {
                prompt: prompt(i, 30, vocab),
                params: greedy(20),
            })
            .await
        {
            Ok(stream) => accepted.push(stream),
            Err(e) => refusals.push(e),
        }
    }
    assert!(!refusals.is_empty(), "nothing was refused");
    for refusal in &refusals {
        match refusal {
            ServeError::Overloaded { retry_after } => {
                assert!(*retry_after >= Duration::from_millis(100))
            }
            other => panic!("refused with {other:?}"),
        }
        assert_eq!(refusal.code(), "overloaded");
    }
    for stream in accepted {
        assert!(finished(&stream.collect().await));
    }
    wait_idle(&handles).await;
}

#[actix_rt::test]
async fn invalid_requests_are_refused_with_the_reason() {
    let model = TinyModel::new();
    let handles = actors::start(
        Box::new(cpu_backend(&model.files, 64)),
        serve_config(&model.files, policies("")),
    )
    .unwrap();
    let refuse = |prompt: Vec<u32>, params: SamplingParams| {
        let handles = handles.clone();
        async move {
            handles
                .submit(GenerateRequest { prompt, params })
                .await
                .unwrap_err()
                .to_string()
        }
    };
    assert_eq!(
        refuse(vec![], greedy(4)).await,
        "invalid request: the prompt is empty"
    );
    assert!(
        refuse(vec![5, 9999], greedy(4))
            .await
            .contains("token id 9999 is outside the vocabulary of 259")
    );
    assert!(
        refuse(vec![5; 600], greedy(4))
            .await
            .contains("the prompt has 600 tokens; this model's context (512 positions) holds 511")
    );
    let bad = SamplingParams {
        top_p: 0.0,
        ..greedy(4)
    };
    assert!(refuse(vec![5], bad).await.contains("`top_p`"));
}

#[actix_rt::test]
async fn cancelling_half_the_requests_mid_stream_frees_every_page() {
    let model = TinyModel::new();
    let vocab = model.files.config.vocab_size;
    let config = serve_config(&model.files, policies("[admission]\nmax_running = 16\n"));
    let handles = actors::start(Box::new(cpu_backend(&model.files, 256)), config).unwrap();
    let mut streams = Vec::new();
    for i in 0..16 {
        let params = SamplingParams {
            ignore_eos: true,
            ..greedy(200)
        };
        streams.push(
            handles
                .submit(GenerateRequest {
                    prompt: prompt(i, 20 + i as usize, vocab),
                    params,
                })
                .await
                .unwrap(),
        );
    }
    for stream in &mut streams {
        assert!(matches!(stream.next().await, Some(Event::Token(_))));
    }
    let mut kept = Vec::new();
    for (i, mut stream) in streams.into_iter().enumerate() {
        match i % 4 {
            // Dropped: the caller went away.
            0 => drop(stream),
            // Cancelled explicitly: the stream sees `Cancelled`.
            1 => {
                handles.cancel(stream.id);
                let end = loop {
                    match stream.next().await.expect("a terminal event comes") {
                        Event::Token(_) => continue,
                        end => break end,
                    }
                };
                assert_eq!(end, Event::Cancelled);
            }
            _ => kept.push(stream),
        }
    }
    for stream in kept {
        assert!(finished(&stream.collect().await));
    }
    let stats = wait_idle(&handles).await;
    assert_eq!(stats.scheduler.cancelled, 8);
    assert_eq!(stats.pool.free_pages, stats.pool.total_pages);
}

#[actix_rt::test]
async fn an_engine_error_fails_only_the_requests_in_that_step() {
    let model = TinyModel::new();
    let vocab = model.files.config.vocab_size;
    let backend = FailingBackend {
        inner: cpu_backend(&model.files, 128),
        fail_at_step: 3,
        steps: 0,
        dropped: Default::default(),
    };
    // One request at a time, so a step holds exactly one request.
    let config = serve_config(&model.files, policies("[admission]\nmax_running = 1\n"));
    let handles = actors::start(Box::new(backend), config).unwrap();
    let requests: Vec<GenerateRequest> = (0..3)
        .map(|i| GenerateRequest {
            prompt: prompt(i, 12, vocab),
            params: SamplingParams {
                ignore_eos: true,
                ..greedy(4)
            },
        })
        .collect();
    let mut streams = Vec::new();
    for request in &requests {
        streams.push(handles.submit(request.clone()).await.unwrap());
    }
    let ends: Vec<_> = futures_collect(streams).await;
    // Steps 1-2 are the first request's prefill and first decode; step 3 fails it.
    match &ends[0].end {
        Event::Failed(e @ ServeError::Engine(reason)) => {
            assert!(reason.contains("injected failure at step 3"), "{reason}");
            assert_eq!(e.code(), "engine_error");
        }
        other => panic!("the first request ended with {other:?}"),
    }
    for (request, completion) in requests.iter().zip(&ends).skip(1) {
        assert!(finished(completion), "{:?}", completion.end);
        assert_eq!(completion.tokens, solo(&model.files, request));
    }
    wait_idle(&handles).await;
}

async fn futures_collect(streams: Vec<actors::RequestStream>) -> Vec<actors::Completion> {
    let mut out = Vec::new();
    for stream in streams {
        out.push(stream.collect().await);
    }
    out
}

#[actix_rt::test]
async fn shutdown_releases_the_backend_and_later_requests_fail_clearly() {
    let model = TinyModel::new();
    let vocab = model.files.config.vocab_size;
    let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let backend = FailingBackend {
        inner: cpu_backend(&model.files, 64),
        fail_at_step: usize::MAX,
        steps: 0,
        dropped: dropped.clone(),
    };
    let handles =
        actors::start(Box::new(backend), serve_config(&model.files, policies(""))).unwrap();
    let request = GenerateRequest {
        prompt: prompt(1, 20, vocab),
        params: greedy(3),
    };
    assert!(finished(
        &handles
            .submit(request.clone())
            .await
            .unwrap()
            .collect()
            .await
    ));
    handles.shutdown().await;
    assert!(
        dropped.load(std::sync::atomic::Ordering::SeqCst),
        "the backend is gone once shutdown returns"
    );
    assert!(!handles.engine_alive());
    let after = handles.submit(request).await.unwrap().collect().await;
    match after.end {
        Event::Failed(ServeError::Engine(reason)) => {
            assert!(reason.contains("shut down"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}
