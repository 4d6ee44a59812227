//! Snapshot buffers on the CPU backend: a prompt's pages saved into a backing survive the
//! pool being reused, and restored into other pages they continue exactly as a cold prefill.

use cache::{BackingId, PageClone, PageCopy, PageId, Tier};
use engine::backend::{Backend, LogitsWanted, RowPlan, StepPlan};
use engine::cpu::{CpuBackend, CpuOptions};
use engine::model::ModelFiles;
use engine::model::synthetic::{self, SyntheticSpec};

const PAGE: usize = 16;

fn tiny_backend() -> (tempfile::TempDir, CpuBackend) {
    let dir = tempfile::tempdir().unwrap();
    synthetic::write(dir.path(), &SyntheticSpec::tiny(11)).unwrap();
    let model = ModelFiles::open(dir.path()).unwrap();
    let backend = CpuBackend::load(
        &model,
        &CpuOptions {
            threads: 2,
            page_tokens: PAGE,
            num_pages: 32,
            int8_inputs: false,
        },
    )
    .unwrap();
    (dir, backend)
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 31 + seed * 7) % 250 + 3)
        .collect()
}

fn run(backend: &mut CpuBackend, tokens: &[u32], start_pos: usize, pages: &[PageId]) -> Vec<f32> {
    let row = RowPlan {
        tokens: tokens.to_vec(),
        start_pos,
        pages: pages.to_vec(),
        logits: LogitsWanted::Last,
    };
    backend.step(&StepPlan { rows: vec![row] }).unwrap().logits
}

fn pages(ids: &[u32]) -> Vec<PageId> {
    ids.iter().map(|&i| PageId(i)).collect()
}

#[test]
fn a_restored_snapshot_continues_exactly_like_a_cold_prefill_after_its_pages_were_reused() {
    let (_dir, mut backend) = tiny_backend();
    let tokens = prompt(1, 3 * PAGE + 5);
    let source = pages(&[4, 5, 6, 7]);
    run(&mut backend, &tokens[..3 * PAGE], 0, &source);

    let backing = BackingId(1);
    let page_bytes = backend.info().geometry.page_bytes() as u64;
    backend
        .alloc_backing(backing, Tier::Device, 3 * page_bytes)
        .unwrap();
    let save: Vec<PageCopy> = (0..3)
        .map(|i| PageCopy {
            snapshot_page: i,
            pool_page: source[i as usize],
        })
        .collect();
    backend.save_pages(backing, &save).unwrap();

    // Another sequence overwrites every page the snapshot came from.
    run(&mut backend, &prompt(9, 4 * PAGE), 0, &source);

    // Restore into other pages and finish the prompt there; a cold run does it all from scratch.
    let target = pages(&[20, 13, 27, 2]);
    let restore: Vec<PageCopy> = (0..3)
        .map(|i| PageCopy {
            snapshot_page: i,
            pool_page: target[i as usize],
        })
        .collect();
    backend.restore_pages(backing, &restore).unwrap();
    let restored = run(&mut backend, &tokens[3 * PAGE..], 3 * PAGE, &target);
    let cold = run(&mut backend, &tokens, 0, &pages(&[8, 9, 10, 11]));
    assert!(
        restored
            .iter()
            .zip(&cold)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "restored logits differ from a cold prefill"
    );

    // A demotion copies the buffer whole.
    backend
        .alloc_backing(BackingId(2), Tier::Host, 3 * page_bytes)
        .unwrap();
    backend.copy_backing(backing, BackingId(2)).unwrap();
    backend.free_backing(backing).unwrap();
    backend.restore_pages(BackingId(2), &restore).unwrap();
    let demoted = run(&mut backend, &tokens[3 * PAGE..], 3 * PAGE, &target);
    assert!(
        demoted
            .iter()
            .zip(&cold)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
    assert_eq!(backend.memory().host_snapshot_bytes, 3 * page_bytes);
    assert_eq!(backend.memory().device_snapshot_bytes, 0);
}

/// `n` > 1: the other choices copy the first one's prompt pages, partial last page included.
#[test]
fn cloned_pages_continue_exactly_like_their_source() {
    let (_dir, mut backend) = tiny_backend();
    let tokens = prompt(3, 2 * PAGE + 7);
    let source = pages(&[4, 5, 6]);
    let (head, last) = tokens.split_at(tokens.len() - 1);
    run(&mut backend, head, 0, &source);
    let target = pages(&[30, 1, 17]);
    let clones: Vec<PageClone> = source
        .iter()
        .zip(&target)
        .map(|(&from, &to)| PageClone { from, to })
        .collect();
    backend.clone_pages(&clones).unwrap();
    let original = run(&mut backend, last, head.len(), &source);
    let cloned = run(&mut backend, last, head.len(), &target);
    assert!(
        cloned
            .iter()
            .zip(&original)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "logits after cloned pages differ"
    );
    let onto_itself = [PageClone {
        from: PageId(2),
        to: PageId(2),
    }];
    assert!(backend.clone_pages(&onto_itself).is_err());
    let outside = [PageClone {
        from: PageId(2),
        to: PageId(32),
    }];
    assert!(backend.clone_pages(&outside).is_err());
}

#[test]
fn bad_backing_requests_are_errors_not_panics() {
    let (_dir, mut backend) = tiny_backend();
    let copy = [PageCopy {
        snapshot_page: 0,
        pool_page: PageId(0),
    }];
    assert!(
        backend
            .save_pages(BackingId(5), &copy)
            .unwrap_err()
            .to_string()
            .contains("backing 5: no such buffer")
    );
    let page_bytes = backend.info().geometry.page_bytes() as u64;
    backend
        .alloc_backing(BackingId(5), Tier::Device, page_bytes)
        .unwrap();
    assert!(
        backend
            .alloc_backing(BackingId(5), Tier::Device, page_bytes)
            .is_err()
    );
    let beyond = [PageCopy {
        snapshot_page: 1,
        pool_page: PageId(0),
    }];
    assert!(
        backend
            .save_pages(BackingId(5), &beyond)
            .unwrap_err()
            .to_string()
            .contains("out of range")
    );
    let no_page = [PageCopy {
        snapshot_page: 0,
        pool_page: PageId(32),
    }];
    assert!(backend.restore_pages(BackingId(5), &no_page).is_err());
    backend
        .alloc_backing(BackingId(6), Tier::Host, 2 * page_bytes)
        .unwrap();
    assert!(backend.copy_backing(BackingId(5), BackingId(6)).is_err());
    assert!(
        backend
            .alloc_backing(BackingId(7), Tier::Host, u64::MAX)
            .unwrap_err()
            .to_string()
            .starts_with("out of memory")
    );
    backend.free_backing(BackingId(5)).unwrap();
    assert!(backend.free_backing(BackingId(5)).is_err());
}
