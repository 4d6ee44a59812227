//! Snapshot buffers on the CUDA backend: a save restored into other pages holds byte-identical
//! KV, also after the pages it came from were overwritten, in both tiers; and the restored
//! sequence continues exactly as one prefilled the same way without a snapshot. Run on the GPU
//! machine with `cargo test --release -p engine --test cuda_snapshots -- --ignored`.

use cache::{BackingId, KvGeometry, PageClone, PageCopy, PageId, Tier};
use engine::DType;
use engine::backend::{Backend, LogitsWanted, RowPlan, StepPlan};
use engine::cuda::{CudaBackend, CudaOptions};
use engine::model::ModelFiles;
use engine::model::synthetic::{self, SyntheticSpec};

const PAGE: usize = 16;

fn backend() -> (tempfile::TempDir, CudaBackend) {
    backend_with(|_| CudaOptions::for_tokens(32 * PAGE, 256, 4))
}

/// The tiny bf16 model on options chosen knowing its snapshot page's bytes.
fn backend_with(options: impl FnOnce(u64) -> CudaOptions) -> (tempfile::TempDir, CudaBackend) {
    let dir = tempfile::tempdir().unwrap();
    let spec = SyntheticSpec {
        dtype: DType::BF16,
        ..SyntheticSpec::tiny(11)
    };
    synthetic::write(dir.path(), &spec).unwrap();
    let model = ModelFiles::open(dir.path()).unwrap();
    let config = &model.config;
    let geometry = KvGeometry {
        layers: config.num_layers,
        kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        page_tokens: PAGE,
        dtype_bytes: 2,
    };
    let options = options(geometry.page_bytes() as u64);
    let backend = CudaBackend::load(&model, &options).expect("these tests need a CUDA device");
    (dir, backend)
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 31 + seed * 7) % 250 + 3)
        .collect()
}

fn run(backend: &mut CudaBackend, tokens: &[u32], start_pos: usize, pages: &[PageId]) -> Vec<f32> {
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

fn copies(table: &[PageId], n: u32) -> Vec<PageCopy> {
    (0..n)
        .map(|i| PageCopy {
            snapshot_page: i,
            pool_page: table[i as usize],
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_restored_snapshot_is_byte_identical_and_continues_like_the_original() {
    let (_dir, mut backend) = backend();
    let tokens = prompt(1, 3 * PAGE + 5);
    let source = pages(&[4, 5, 6, 7]);
    run(&mut backend, &tokens[..3 * PAGE], 0, &source);
    let page_bytes = backend.info().geometry.page_bytes() as u64;
    let (saved, check, host) = (BackingId(1), BackingId(2), BackingId(3));
    backend
        .alloc_backing(saved, Tier::Device, 3 * page_bytes)
        .unwrap();
    backend.save_pages(saved, &copies(&source, 3)).unwrap();
    let bytes = backend.read_backing(saved).unwrap();
    assert!(bytes.iter().any(|&b| b != 0));

    // Another sequence overwrites every page the snapshot came from.
    run(&mut backend, &prompt(9, 4 * PAGE), 0, &source);

    let target = pages(&[20, 13, 27, 2]);
    backend.restore_pages(saved, &copies(&target, 3)).unwrap();
    backend
        .alloc_backing(check, Tier::Host, 3 * page_bytes)
        .unwrap();
    backend.save_pages(check, &copies(&target, 3)).unwrap();
    assert!(
        backend.read_backing(check).unwrap() == bytes,
        "restored KV differs"
    );

    // Continuing after the restore matches a sequence prefilled in the same two steps.
    let restored = run(&mut backend, &tokens[3 * PAGE..], 3 * PAGE, &target);
    let fresh = pages(&[8, 9, 10, 11]);
    run(&mut backend, &tokens[..3 * PAGE], 0, &fresh);
    let cold = run(&mut backend, &tokens[3 * PAGE..], 3 * PAGE, &fresh);
    assert!(
        restored
            .iter()
            .zip(&cold)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "restored logits differ from a cold prefill"
    );

    // A demotion to the host tier copies the buffer whole, beside the steps, and is reported
    // once; restoring from there works alike.
    backend
        .alloc_backing(host, Tier::Host, 3 * page_bytes)
        .unwrap();
    backend.copy_backing(saved, host).unwrap();
    run(
        &mut backend,
        &prompt(6, 4 * PAGE),
        0,
        &pages(&[12, 14, 15, 16]),
    );
    let ended = backend.finished_copies(true);
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].0, host);
    assert!(ended[0].1.is_ok(), "{:?}", ended[0].1);
    assert!(backend.finished_copies(true).is_empty(), "reported once");
    backend.free_backing(saved).unwrap();
    assert!(backend.read_backing(host).unwrap() == bytes);
    run(&mut backend, &prompt(5, 4 * PAGE), 0, &target);
    backend.restore_pages(host, &copies(&target, 3)).unwrap();
    let demoted = run(&mut backend, &tokens[3 * PAGE..], 3 * PAGE, &target);
    assert!(
        demoted
            .iter()
            .zip(&cold)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
    let memory = backend.memory();
    assert_eq!(memory.host_snapshot_bytes, 6 * page_bytes);
    assert_eq!((memory.device_snapshot_bytes, memory.backings), (0, 2));
}

/// `n` > 1: the other choices copy the first one's prompt pages, partial last page included;
/// the copies hold the same bytes and continue with the same logits.
#[test]
#[ignore = "needs a CUDA device"]
fn cloned_pages_are_byte_identical_and_continue_like_their_source() {
    let (_dir, mut backend) = backend();
    let tokens = prompt(3, 2 * PAGE + 7);
    let (head, last) = tokens.split_at(tokens.len() - 1);
    let source = pages(&[4, 5, 6]);
    run(&mut backend, head, 0, &source);
    let target = pages(&[30, 1, 17]);
    let clones: Vec<PageClone> = source
        .iter()
        .zip(&target)
        .map(|(&from, &to)| PageClone { from, to })
        .collect();
    backend.clone_pages(&clones).unwrap();
    let page_bytes = backend.info().geometry.page_bytes() as u64;
    let (a, b) = (BackingId(1), BackingId(2));
    backend
        .alloc_backing(a, Tier::Host, 3 * page_bytes)
        .unwrap();
    backend
        .alloc_backing(b, Tier::Host, 3 * page_bytes)
        .unwrap();
    backend.save_pages(a, &copies(&source, 3)).unwrap();
    backend.save_pages(b, &copies(&target, 3)).unwrap();
    let bytes = backend.read_backing(a).unwrap();
    assert!(bytes.iter().any(|&x| x != 0));
    assert!(
        backend.read_backing(b).unwrap() == bytes,
        "cloned KV differs"
    );
    let original = run(&mut backend, last, head.len(), &source);
    let cloned = run(&mut backend, last, head.len(), &target);
    assert!(
        cloned
            .iter()
            .zip(&original)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "logits after cloned pages differ"
    );
    let onto_itself = [PageClone {
        from: PageId(2),
        to: PageId(2),
    }];
    assert!(backend.clone_pages(&onto_itself).is_err());
}

#[test]
#[ignore = "needs a CUDA device"]
fn bad_backing_requests_are_errors_not_panics() {
    let (_dir, mut backend) = backend();
    let one = |s, p| {
        [PageCopy {
            snapshot_page: s,
            pool_page: PageId(p),
        }]
    };
    let err = backend.save_pages(BackingId(5), &one(0, 0)).unwrap_err();
    assert!(
        err.to_string().contains("backing 5: no such buffer"),
        "{err}"
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
    let err = backend.save_pages(BackingId(5), &one(1, 0)).unwrap_err();
    assert!(err.to_string().contains("out of range"), "{err}");
    // The pool's spare page belongs to no sequence.
    assert!(backend.restore_pages(BackingId(5), &one(0, 32)).is_err());
    backend
        .alloc_backing(BackingId(6), Tier::Host, 2 * page_bytes)
        .unwrap();
    assert!(backend.copy_backing(BackingId(5), BackingId(6)).is_err());
    let err = backend
        .alloc_backing(BackingId(7), Tier::Device, 1 << 50)
        .unwrap_err();
    assert!(err.to_string().starts_with("out of memory"), "{err}");
    backend.free_backing(BackingId(5)).unwrap();
    assert!(backend.free_backing(BackingId(5)).is_err());
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_sized_arena_hands_out_its_pages_and_never_grows() {
    let mut sized_for = 0;
    let (_dir, mut backend) = backend_with(|page_bytes| {
        sized_for = page_bytes;
        CudaOptions {
            // Eight pages of budget: the arena holds nine (an eighth more, for demotions).
            device_snapshot_bytes: 8 * page_bytes,
            host_snapshot_bytes: 4 * page_bytes,
            ..CudaOptions::for_tokens(32 * PAGE, 256, 4)
        }
    });
    backend.wait_for_snapshot_arenas();
    let page_bytes = backend.info().geometry.page_bytes() as u64;
    assert_eq!(page_bytes, sized_for);
    backend
        .alloc_backing(BackingId(1), Tier::Device, 6 * page_bytes)
        .unwrap();
    backend
        .alloc_backing(BackingId(2), Tier::Device, 3 * page_bytes)
        .unwrap();
    let err = backend
        .alloc_backing(BackingId(3), Tier::Device, page_bytes)
        .unwrap_err();
    assert!(err.to_string().contains("0 free"), "{err}");
    backend.free_backing(BackingId(2)).unwrap();
    backend
        .alloc_backing(BackingId(3), Tier::Device, 3 * page_bytes)
        .unwrap();
    backend
        .alloc_backing(BackingId(4), Tier::Host, 4 * page_bytes)
        .unwrap();
    assert!(
        backend
            .alloc_backing(BackingId(5), Tier::Host, page_bytes)
            .is_err()
    );
    let memory = backend.memory();
    assert_eq!(memory.device_snapshot_bytes, 9 * page_bytes);
    assert_eq!(memory.host_snapshot_bytes, 4 * page_bytes);
}

/// How fast a restore reads host-tier pages the CPU just wrote (a snapshot read back from the
/// disk tier), the first time and again: printed, and both must pass their checksums.
#[test]
#[ignore = "needs a CUDA device"]
fn restoring_host_pages_the_cpu_just_wrote_is_checked_and_timed() {
    let target = 1usize << 30;
    let (_dir, mut backend) = backend_with(|page| {
        let n = target / page as usize;
        CudaOptions {
            host_snapshot_bytes: (n as u64) * page,
            ..CudaOptions::for_tokens((n + 1) * PAGE, 256, 4)
        }
    });
    backend.wait_for_snapshot_arenas();
    let page = backend.info().geometry.page_bytes();
    let n = target / page;
    let backing = BackingId(1);
    backend
        .alloc_backing(backing, Tier::Host, (n * page) as u64)
        .unwrap();
    let runs = backend.host_runs(backing).unwrap();
    let block = page / (2 * backend.config().num_layers);
    let mut sums = Vec::new();
    for (r, run) in runs.iter().enumerate() {
        // SAFETY: the backing's own host memory, nothing else uses it now.
        let bytes = unsafe { std::slice::from_raw_parts_mut(run.ptr, run.len) };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(r as u32) as u8;
        }
        sums.extend(cache::checksum::block_sums(bytes, block));
    }
    backend.set_backing_sums(backing, &sums).unwrap();
    let table: Vec<PageId> = (0..n as u32).map(PageId).collect();
    for attempt in ["first", "again"] {
        let started = std::time::Instant::now();
        backend
            .restore_pages(backing, &copies(&table, n as u32))
            .unwrap();
        let verdicts = backend.restore_verdicts().unwrap();
        let took = started.elapsed().as_secs_f64();
        assert_eq!(verdicts, vec![true]);
        eprintln!(
            "{attempt} restore of {n} freshly written host pages ({} runs, {:.2} GiB): {:.1} ms, {:.1} GB/s",
            runs.len(),
            (n * page) as f64 / (1u64 << 30) as f64,
            took * 1e3,
            (n * page) as f64 / took / 1e9
        );
    }
}
